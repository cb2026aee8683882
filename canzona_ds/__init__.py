"""canzona-ds: exact, load-balanced matrix optimizers (Muon) for DeepSpeed ZeRO-1 and
Megatron-style tensor parallelism, after the Canzona paper.

``import canzona_ds`` registers ``"type": "CanzonaMuon"`` for DeepSpeed's ds_config.
Importing is cheap: if DeepSpeed is not imported yet, a tiny import hook installs the
registration right after ``import deepspeed`` finishes; nothing heavy is imported here.
"""
from __future__ import annotations

import importlib.abc
import sys

__version__ = "0.1.0"


class _DeepSpeedImportHook(importlib.abc.MetaPathFinder):
    """Run ``canzona_ds.integration.install()`` once ``deepspeed`` has been imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            pass
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            from canzona_ds.integration import install

            install()

        loader.exec_module = exec_then_install
        return spec


def _register() -> None:
    if "deepspeed" in sys.modules:
        from canzona_ds.integration import install

        install()
    elif not any(isinstance(f, _DeepSpeedImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImportHook())


_register()

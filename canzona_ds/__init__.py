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
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install_or_warn()

        loader.exec_module = exec_then_install
        return spec


def _install_or_warn() -> None:
    """Register with DeepSpeed; an unsupported DeepSpeed version must not break ``import deepspeed``
    for users who do not use CanzonaMuon, so it warns here (``canzona_ds.integration.install()``
    raises the same message)."""
    from canzona_ds.integration import install

    try:
        install()
    except RuntimeError as err:
        import warnings

        warnings.warn(f"CanzonaMuon is not registered with DeepSpeed: {err}", stacklevel=3)


def _register() -> None:
    if "deepspeed" in sys.modules:
        _install_or_warn()
    elif not any(isinstance(f, _DeepSpeedImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImportHook())


_register()

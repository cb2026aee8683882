"""canzona-ds: exact, load-balanced matrix optimizers (Muon, Shampoo, SOAP) for DeepSpeed ZeRO
and Megatron-style tensor parallelism, after the Canzona paper.

``import canzona_ds`` registers ``"type": "CanzonaMuon" | "CanzonaShampoo" | "CanzonaSOAP"``
for DeepSpeed's ds_config.
Importing is cheap: if DeepSpeed is not imported yet, a tiny import hook installs the
registration right after ``import deepspeed`` finishes; nothing heavy is imported here.
"""
from __future__ import annotations

import importlib.abc
import sys

__version__ = "0.1.0"


class _DeepSpeedImportHook(importlib.abc.MetaPathFinder):
    """Run ``canzona_ds.integration.install()`` once ``deepspeed`` has been imported.

    The hook stays in ``sys.meta_path`` until DeepSpeed's module code actually runs: a bare
    probe such as ``importlib.util.find_spec("deepspeed")`` (``transformers`` does this to
    test whether DeepSpeed is installed) returns a spec that is never executed, so it must
    not use the hook up.
    """

    _probing = False

    def find_spec(self, fullname, path, target=None):
        if fullname != "deepspeed" or self._probing:
            return None
        import importlib.util

        self._probing = True  # find the real spec with the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._probing = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        hook = self

        def exec_then_install(module):
            if hook in sys.meta_path:
                sys.meta_path.remove(hook)
            exec_module(module)
            _install_or_warn()

        spec.loader.exec_module = exec_then_install
        return spec


def _install_or_warn() -> None:
    """Register with DeepSpeed; an unsupported DeepSpeed version must not break ``import deepspeed``
    for users who do not use the Canzona optimizers, so it warns here (``canzona_ds.integration.install()``
    raises the same message)."""
    from canzona_ds.integration import install

    try:
        install()
    except RuntimeError as err:
        import warnings

        warnings.warn(f"The Canzona optimizer types are not registered with DeepSpeed: {err}", stacklevel=3)


def _register() -> None:
    if "deepspeed" in sys.modules:
        _install_or_warn()
    elif not any(isinstance(f, _DeepSpeedImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImportHook())


_register()

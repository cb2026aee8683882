"""canzona-ds: exact, load-balanced matrix optimizers (Muon, Shampoo, SOAP) for DeepSpeed ZeRO
and Megatron-style tensor parallelism, after the Canzona paper.

``import canzona_ds`` registers ``"type": "CanzonaMuon" | "CanzonaShampoo" | "CanzonaSOAP"``
for DeepSpeed's ds_config.
Importing is cheap: if DeepSpeed is not imported yet, a tiny import hook installs the
registration right after ``import deepspeed`` finishes; nothing heavy is imported here.

Two process-wide effects, both about DeepSpeed's CPU shared-memory op:

* ``TORCH_EXTENSIONS_DIR`` defaults (``os.environ.setdefault``, a value already set wins) to a
  folder of this Python environment (:func:`op_cache_dir`), so DeepSpeed's JIT-built ops are
  built once per environment: ``launch/install.sh`` builds there, ``launch/train.sh`` and the
  suite load from there, and another environment on the machine (which would share torch's
  default ``~/.cache/torch_extensions/py3XX_cpu``) cannot invalidate the build;
* a process whose DeepSpeed backend created a ``/dev/shm`` all-reduce buffer unlinks it when it
  exits (``canzona_ds.integration.runtime_info.release_shm_buffers_at_exit``; DeepSpeed never does).
"""
from __future__ import annotations

import importlib.abc
import os
import sys

from .version import __version__  # noqa: F401  (canzona_ds.__version__)


def op_cache_dir() -> str:
    """Where this Python environment keeps DeepSpeed's JIT-built ops (``TORCH_EXTENSIONS_DIR``):

        <sys.prefix>/var/cache/torch_extensions       a virtual or conda environment (its own
                                                      folder: deleting the environment deletes it)
        ~/.cache/canzona_ds/torch_extensions/<id>     any other Python (system, pyenv), or an
                                                      environment folder this user cannot write;
                                                      <id> = a hash of sys.prefix

    Either way one folder per environment: two environments never share (and rebuild) an op."""
    own = os.path.join(sys.prefix, "var", "cache", "torch_extensions")
    is_env = sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))
    base = own
    while not os.path.exists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if is_env and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
        return own
    import hashlib

    digest = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "canzona_ds", "torch_extensions", digest)


os.environ.setdefault("TORCH_EXTENSIONS_DIR", op_cache_dir())


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
        from canzona_ds.integration.runtime_info import release_shm_buffers_at_exit

        release_shm_buffers_at_exit()
    except RuntimeError as err:
        import warnings

        warnings.warn(f"The Canzona optimizer types are not registered with DeepSpeed: {err}", stacklevel=3)


def _register() -> None:
    if "deepspeed" in sys.modules:
        _install_or_warn()
    elif not any(isinstance(f, _DeepSpeedImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImportHook())


_register()

"""Reading a checkpoint file never runs code from it.

A ``.pt`` file is a pickle: unpickled as it is (``torch.load(weights_only=False)``), it can call
any function it names (``os.system``, ``subprocess.Popen``), and the sha256 manifest does not
stop that (it has no key: whoever crafts a file recomputes it).  Every read canzona-ds makes
goes through :func:`load`:

1. the types the file's pickle names are listed without unpickling anything (a zip file's
   ``data.pkl`` disassembled by ``torch.serialization.get_unsafe_globals_in_checkpoint``); any
   that is neither torch's own (tensors, storages, dtypes, ``OrderedDict``, ``torch.Size``)
   nor in ``allowed`` is refused: :class:`UnsafeCheckpointError`, one line naming the file and
   the type(s);
2. then it is unpickled by an unpickler that looks up only allowed names, checking each
   again as it reads, so a pickle that hides a name from step 1 is still refused before the
   name is called: for a zip file, the standard library's C unpickler restricted to the names
   torch's ``weights_only`` unpickler allows plus the allowed ones the file names
   (:func:`_restricted_pickle`: torch's own unpickler is written in Python and parses several
   times slower); for a file in torch's legacy (non-zip) format, whose names cannot be listed
   beforehand, ``torch.load(weights_only=True)`` itself, with the allowed types added for the
   duration of the call (``torch.serialization.safe_globals``; a type the process had already
   allowed stays allowed after it).

``allowed`` is data: ``"module.QualName"`` strings, resolved (imported) only when a file
names them.  :data:`DATA_GLOBALS` are the plain-data types outside torch that checkpoints hold
(argparse's ``Namespace``, which Megatron-DeepSpeed stores as ``args``; numpy's RNG state);
:data:`DEEPSPEED_GLOBALS` are DeepSpeed's own (its loss scalers, ``ZeroStageEnum``,
``fragment_address``), :data:`MEGATRON_GLOBALS` Megatron-DeepSpeed's; together
:data:`CHECKPOINT_GLOBALS`, the default.  integration/ckpt/safe.py routes DeepSpeed's own reads
(its checkpoint engine) through :func:`load` and carries the user's opt-in.  ``unsafe=True`` is today's
``weights_only=False``: for a file whose origin the user trusts and that holds other objects
(ds_config ``canzona_checkpoint.allow_unsafe_pickle``; docs/checkpoints.md).

This module imports no DeepSpeed.
"""
from __future__ import annotations

import importlib
import pickle
import re
from typing import Any, Iterable

from .tag import CheckpointError

#: plain-data types outside torch that checkpoint files hold ("module.QualName")
DATA_GLOBALS = (
    "argparse.Namespace",  # Megatron-DeepSpeed's `args`
    # numpy arrays and scalars (np.random.get_state() in Megatron-DeepSpeed's rng_state)
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
    "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType", "numpy.dtypes.Int64DType", "numpy.dtypes.Float64DType",
    "numpy.dtypes.Float32DType", "numpy.dtypes.BoolDType",
)
#: the types DeepSpeed 0.19.8 pickles into a tag's files beside tensors, found by saving every
#: layout the suite covers (ZeRO 0-3, offload, pipeline layer files, MoE expert files, TP, the
#: main job's tags) and listing what ``torch.serialization.get_unsafe_globals_in_checkpoint``
#: reports: the ZeRO optimizer states' loss scaler, ``zero_stage`` and ``param_slice_mappings``
#: (names only: DeepSpeed is imported when a file names one of them, as unpickling it would)
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
#: what Megatron-DeepSpeed adds to the model states beside DATA_GLOBALS (``args.model_type``)
MEGATRON_GLOBALS = ("megatron.core.enums.ModelType",)
#: every type a tag's files may hold beside torch's own: the default allowlist
CHECKPOINT_GLOBALS = DATA_GLOBALS + DEEPSPEED_GLOBALS + MEGATRON_GLOBALS

#: how torch's restricted unpickler names a refused type
_TORCH_REFUSAL = re.compile(r"(?:GLOBAL|global) ([\w.]+) (?:was not|is not)")


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that holds a type outside the allowlist: it was not unpickled.

    ``path``: the file; ``types``: the refused ``"module.QualName"`` names."""

    def __init__(self, path: str, types: Iterable[str], detail: str = "") -> None:
        self.types = sorted(types)
        what = ", ".join(self.types) if self.types else "an object"
        super().__init__(f"{path}: holds {what}, which no checkpoint canzona-ds or DeepSpeed writes holds; refused "
                         f"before anything was unpickled{detail}. Load it only if you trust where it came from "
                         "(ds_config canzona_checkpoint.allow_unsafe_pickle: true; docs/checkpoints.md).",
                         path, [(path, f"holds {what}")])

    def __reduce__(self):  # picklable with its attributes (broadcast between ranks)
        return (_rebuild, (str(self), self.path, self.problems, self.types))


def _rebuild(message: str, path: str, problems: list, types: list) -> "UnsafeCheckpointError":
    e = UnsafeCheckpointError.__new__(UnsafeCheckpointError)
    CheckpointError.__init__(e, message, path, problems)
    e.types = list(types)
    return e


def _resolve(name: str) -> Any:
    """The object ``"module.QualName"`` names (its module imported: a name of the allowlist,
    never one read from a file); None when its module is not installed."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return None
        return obj
    return None


def named_globals(path: str) -> list[str] | None:
    """The types a zip-format torch file's pickle names that torch would not load with
    ``weights_only=True`` on its own (nothing unpickled); None for torch's legacy format, which
    cannot be listed (its restricted unpickler is then the check)."""
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):
        return None
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except pickle.UnpicklingError:  # an opcode torch.save never writes (e.g. protocol 4's STACK_GLOBAL)
        raise UnsafeCheckpointError(path, _all_globals(path), " (named by a pickle opcode torch.save never "
                                    "writes)") from None


def _restricted_pickle(extra: dict[str, Any]) -> Any:
    """A ``pickle_module`` for ``torch.load`` whose ``Unpickler`` (the standard library's, in C)
    looks up only the names torch's ``weights_only`` unpickler allows (its own and the ones the
    process added) and ``extra``; any other name is an ``UnpicklingError``.  None where torch
    does not expose its allowlist (then the caller uses ``weights_only=True`` itself).

    Used for a zip-format file whose every name :func:`named_globals` has listed (its
    disassembler accepts only the opcodes ``torch.save`` writes, so the list is complete): the
    same names ``weights_only=True`` would accept, without its unpickler written in Python,
    which parses a pickle several times slower (a memory-mapped load is all parsing)."""
    import _compat_pickle
    import types

    try:
        from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals

        allowed = {**_get_allowed_globals(), **_get_user_allowed_globals(), **extra}
    except (ImportError, AttributeError):
        return None

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # a protocol-2 pickle names Python 2's modules (``__builtin__.set``: DeepSpeed before
            # 0.19.7 pickles ``sparse_tensor_module_names=set()``); pickle's own lookup maps them
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
            obj = allowed.get(f"{module}.{name}")
            if obj is None:
                raise pickle.UnpicklingError(f"global {module}.{name} was not an allowed global")
            return obj

    return types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="canzona_ds_restricted_pickle")


def _all_globals(path: str) -> list[str]:
    """Every type a zip-format torch file's pickle names, GLOBAL or STACK_GLOBAL (the two strings
    pushed before it), read with the standard library's disassembler: nothing unpickled."""
    import pickletools
    import zipfile

    names: set[str] = set()
    try:
        with zipfile.ZipFile(path) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1))
        strings, memo = [], {}
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                names.add(arg.replace(" ", "."))
            elif isinstance(arg, str) and "UNICODE" in op.name:
                strings.append(arg)
            elif op.name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                strings.append(memo[arg])
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.add(f"{strings[-2]}.{strings[-1]}")
    except Exception:  # noqa: BLE001 - a name we could not recover: the refusal stands without it
        pass
    return sorted(names - _torch_default_names())


def _torch_default_names() -> set[str]:
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        return set(_get_allowed_globals())
    except ImportError:
        return set()


def check(path: str, allowed: Iterable[str] = CHECKPOINT_GLOBALS) -> None:
    """Raise :class:`UnsafeCheckpointError` if ``path`` names a type outside torch's own and
    ``allowed``, unpickling nothing (a legacy-format file: loaded by :func:`load`, whose
    restricted unpickler is the check)."""
    names = named_globals(str(path))
    if names is None:
        load(path, allowed, mmap=False)
        return
    refused = [n for n in names if n not in set(allowed)]
    if refused:
        raise UnsafeCheckpointError(str(path), refused)


def load(path: str, allowed: Iterable[str] = CHECKPOINT_GLOBALS, *, map_location: Any = "cpu", mmap: bool = False,
         unsafe: bool = False) -> Any:
    """``torch.load(path)`` unpickling only data: torch's own types and ``allowed``
    (``"module.QualName"``); a file naming any other type raises :class:`UnsafeCheckpointError`
    before anything is unpickled.  ``unsafe=True``: ``weights_only=False`` (trusted files only)."""
    import torch

    path = str(path)
    if unsafe:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    allowed = set(allowed)
    names = named_globals(path)
    if names is None:  # legacy format: every allowed type available, torch's unpickler checks each name
        needed = sorted(allowed)
    else:
        refused = [n for n in names if n not in allowed]
        if refused:
            raise UnsafeCheckpointError(path, refused)
        needed = names
    resolved = {n: o for n, o in ((n, _resolve(n)) for n in needed) if o is not None}
    if names is not None:
        restricted = _restricted_pickle(resolved)
        if restricted is not None:  # torch's C unpickler, every name it may look up checked above
            try:
                return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap,
                                  pickle_module=restricted)
            except pickle.UnpicklingError as e:
                m = _TORCH_REFUSAL.search(str(e))
                raise UnsafeCheckpointError(path, [m.group(1)] if m else [],
                                            "" if m else f" ({str(e).splitlines()[0]})") from None
    already = {g if not isinstance(g, tuple) else g[0] for g in torch.serialization.get_safe_globals()}
    objs = [o for o in resolved.values() if o not in already]
    try:
        with torch.serialization.safe_globals(objs):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = _TORCH_REFUSAL.search(str(e))
        raise UnsafeCheckpointError(path, [m.group(1)] if m else [],
                                    "" if m else f" ({str(e).splitlines()[0]})") from None

"""Reading a checkpoint file never runs code from it, changes nothing in the process, and reads
nothing but that file.

A ``.pt`` file is a pickle: unpickled as it is (``torch.load(weights_only=False)``), it can call
any function it names (``os.system``), and a BUILD opcode can set attributes on any object it
can name, a class or a function included.  The sha256 manifest stops none of it (it has no key:
whoever crafts a file recomputes it).  Every read canzona-ds makes goes through :func:`load`:

1. the file is opened once (:func:`canzona_ds.ckpt.tag.open_regular`: refused by name unless
   it is a regular file, so a FIFO or a device never blocks or streams), and that one open file
   is what every later step reads: the bytes checked are the bytes unpickled (a memory-mapped
   read maps the same open file, through ``/proc/self/fd``; where the platform has none, through
   the name, refused if the name no longer reaches the file opened);
2. a zip-format file (what ``torch.save`` writes) whose members would inflate to more than
   :data:`MAX_EXPANSION` times the file's size is refused by name before any member is read
   (a decompression bomb: ``torch.save`` stores its members uncompressed);
3. it is unpickled by torch's own ``weights_only`` unpickler, with the allowlist added for the
   call (``torch.serialization.safe_globals``): a name outside torch's own and ``allowed`` is
   refused when the pickle names it, before it is called, and BUILD runs only on instances of
   tensors, parameters, ``OrderedDict`` and the allowed types, never on a class or a function
   (torch's rule), for the zip format and torch's legacy format alike;
4. every failure is one line naming the file (:class:`UnsafeCheckpointError` for a refused
   type, :class:`MalformedCheckpointError` for anything else: an empty file, junk, a truncated
   zip, a pickle nested too deep), both :class:`~canzona_ds.ckpt.tag.CheckpointError`\\ s.

``allowed`` is data: ``"module.QualName"`` strings, resolved only to objects of modules the
process has already imported (``sys.modules``): reading a file never imports anything, so a
package planted where Python looks for modules never runs.  A name whose module is not
imported is refused by name like any other.  :data:`DATA_GLOBALS` are the plain-data types
outside torch that checkpoints hold (argparse's ``Namespace``, which Megatron-DeepSpeed stores
as ``args``; numpy's RNG state); :data:`DEEPSPEED_GLOBALS` are DeepSpeed's own (its loss
scalers, ``ZeroStageEnum``, ``fragment_address``), :data:`MEGATRON_GLOBALS`
Megatron-DeepSpeed's; together :data:`CHECKPOINT_GLOBALS`, the default.
integration/ckpt/safe.py imports DeepSpeed's modules before its reads (DeepSpeed is
canzona-ds's dependency, imported by the program, never because a file names it), routes
DeepSpeed's own reads through :func:`load` and carries the user's opt-in.  ``unsafe=True`` is
today's ``weights_only=False``: for a file whose origin the user trusts and that holds other
objects (ds_config ``canzona_checkpoint.allow_unsafe_pickle``; docs/checkpoints.md).

This module imports no DeepSpeed.
"""
from __future__ import annotations

import os
import pickle
import re
import sys
import warnings
from typing import Any, Iterable

from .tag import CheckpointError, CheckpointFileError, open_regular

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
#: (names only: resolved when DeepSpeed is imported, which integration/ckpt/safe.py does)
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
#: what Megatron-DeepSpeed adds to the model states beside DATA_GLOBALS (``args.model_type``;
#: resolved only in a process that has imported Megatron)
MEGATRON_GLOBALS = ("megatron.core.enums.ModelType",)
#: every type a tag's files may hold beside torch's own: the default allowlist
CHECKPOINT_GLOBALS = DATA_GLOBALS + DEEPSPEED_GLOBALS + MEGATRON_GLOBALS

#: a zip file's members may inflate to at most this multiple of the file's size (plus
#: :data:`_SLACK`); ``torch.save`` stores them uncompressed, so a real file's is about 1
MAX_EXPANSION = 2
_SLACK = 1 << 20
#: names numpy 2 moved (a file pickled under numpy 1 names the old module; numpy 2 keeps the
#: old name as a shim module that is imported only on first use)
_MOVED = (("numpy.core.", "numpy._core."),)

#: how torch's weights_only unpickler names a refused global, a blocked module, a refused BUILD
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+) (?:was not an allowed global|whose module)")
_REFUSED_BUILD = re.compile(r"Can only build .*?but got <class '([^']+)'>")
_WO_DETAIL = re.compile(r"WeightsUnpickler error: (.*)")


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that names a type outside the allowlist, or builds (BUILD) anything but
    data: refused before the type was called.

    ``path``: the file; ``types``: the refused ``"module.QualName"`` names."""

    def __init__(self, path: str, types: Iterable[str], detail: str = "") -> None:
        self.types = sorted(types)
        what = ", ".join(self.types) if self.types else "an object"
        super().__init__(f"{path}: holds {what}, which no checkpoint canzona-ds or DeepSpeed writes holds; refused "
                         f"before it was called{detail}. Load it only if you trust where it came from "
                         "(ds_config canzona_checkpoint.allow_unsafe_pickle: true; docs/checkpoints.md).",
                         path, [(path, f"holds {what}")])

    def __reduce__(self):  # picklable with its attributes (broadcast between ranks)
        return (_rebuild, (str(self), self.path, self.problems, self.types))


def _rebuild(message: str, path: str, problems: list, types: list) -> "UnsafeCheckpointError":
    e = UnsafeCheckpointError.__new__(UnsafeCheckpointError)
    CheckpointError.__init__(e, message, path, problems)
    e.types = list(types)
    return e


class MalformedCheckpointError(CheckpointFileError):
    """A file that is not a checkpoint file torch can read (empty, truncated, junk, a pickle nested
    too deep, a decompression bomb, a FIFO or a device): one line, ``"<file>: <what>"``."""


def _lookup(name: str) -> Any:
    """The object ``"module.QualName"`` names, looked up in a module the process has already
    imported (``sys.modules``, then the module's and the classes' own dicts: no import, no module
    ``__getattr__``); None when its module is not imported."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for p in parts[i:]:
            obj = vars(obj).get(p) if hasattr(obj, "__dict__") else None
            if obj is None:
                return None
        return obj
    return None


def _resolve(name: str) -> Any:
    """:func:`_lookup` of ``name``, or of its new name where numpy 2 moved it."""
    obj = _lookup(name)
    for old, new in _MOVED:
        if obj is None and name.startswith(old):
            obj = _lookup(new + name[len(old):])
    return obj


def _allowlist(allowed: Iterable[str]) -> list:
    """``[(object, name), ...]`` for torch's ``safe_globals``: every name of ``allowed`` whose
    module is imported, under the name the file uses (numpy's moved names included)."""
    out = []
    for name in sorted(set(allowed)):
        obj = _resolve(name)
        if obj is not None:
            out.append((obj, name))
    return out


def _check_zip(path: str, f, size: int) -> bool:
    """True for a zip-format file (torch's own test: the first four bytes), after checking that
    its members inflate to no more than :data:`MAX_EXPANSION` times ``size``; the file is left at
    its start.  Reads the zip's directory only."""
    import zipfile

    head = f.read(4)
    f.seek(0)
    if head != b"PK\x03\x04":
        return False
    try:
        with zipfile.ZipFile(f) as z:
            inflated = sum(i.file_size for i in z.infolist())
    except Exception as e:  # noqa: BLE001 - any way the directory is unreadable is one line naming the file
        raise MalformedCheckpointError(path, f"a zip file whose directory is unreadable ({type(e).__name__}: "
                                             f"{_first_line(e)})") from None
    finally:
        f.seek(0)
    if inflated > MAX_EXPANSION * size + _SLACK:
        raise MalformedCheckpointError(path, f"its zip members inflate to {inflated} bytes, more than {MAX_EXPANSION}x "
                                             f"its {size} bytes (a decompression bomb): refused")
    return True


def _first_line(e: BaseException) -> str:
    """The gist of ``e`` on one line (torch's weights_only message: its unpickler's own words)."""
    text = str(e)
    m = _WO_DETAIL.search(text)
    if m:
        text = text[m.start(1):].split("Check the documentation")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _named_globals(f) -> list[str]:
    """Every global a zip-format file's pickle names (GLOBAL, or STACK_GLOBAL's two pushed
    strings), read from the open file ``f`` with the standard library's disassembler, nothing
    unpickled: to name, in a refusal, what a pickle torch's unpickler stopped reading early
    (e.g. at protocol 4's FRAME) would have called."""
    import pickletools
    import zipfile

    names: set[str] = set()
    try:
        with zipfile.ZipFile(f) as z:
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
    return sorted(names)


def _same_file(f) -> str | None:
    """A path that opens the very file ``f`` is (``/proc/self/fd/N``: torch's memory-mapped read
    needs a path; the descriptor's path reaches the same inode whatever the name now points to);
    None where the platform has none."""
    fd_path = f"/proc/self/fd/{f.fileno()}"
    return fd_path if os.path.exists(fd_path) and _is_open_file(fd_path, f) else None


def _is_open_file(path: str, f) -> bool:
    """Whether ``path`` names the file ``f`` has open (same device and inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _refusal(path: str, e: BaseException, f, zipped: bool, allowed: set) -> CheckpointError:
    """torch's weights_only refusal ``e`` of the open file ``f`` as one line naming ``path``."""
    text = str(e)
    m = _REFUSED_GLOBAL.search(text)
    if m:
        return UnsafeCheckpointError(path, [m.group(1)])
    m = _REFUSED_BUILD.search(text)
    if m:
        return UnsafeCheckpointError(path, [f"a BUILD on a {m.group(1)} object"],
                                     " (only tensors, parameters, OrderedDict and the allowed types are built)")
    if zipped:  # stopped before a name it holds (an opcode torch.save never writes): name them
        from torch._weights_only_unpickler import _get_allowed_globals

        f.seek(0)
        refused = [n for n in _named_globals(f) if n not in allowed and n not in _get_allowed_globals()]
        if refused:
            return UnsafeCheckpointError(path, refused, f" (named by a pickle torch's unpickler does not read: "
                                                        f"{_first_line(e)})")
    return MalformedCheckpointError(path, f"not a checkpoint file torch can read ({_first_line(e)})")


def load(path: str, allowed: Iterable[str] = CHECKPOINT_GLOBALS, *, map_location: Any = "cpu", mmap: bool = False,
         unsafe: bool = False) -> Any:
    """``torch.load(path)`` unpickling only data: torch's own types and ``allowed``
    (``"module.QualName"``, of modules already imported), the file opened once (see the module
    doc); a file naming any other type raises :class:`UnsafeCheckpointError` before the type is
    called, any other bad file :class:`MalformedCheckpointError`, each one line naming the file.
    ``mmap``: memory-mapped where the format allows (the zip format; a legacy file is read
    whole).  ``unsafe=True``: ``weights_only=False`` (trusted files only)."""
    import torch

    path, allowed = str(path), tuple(allowed)
    if unsafe:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    with open_regular(path) as f:
        zipped = _check_zip(path, f, os.fstat(f.fileno()).st_size)
        src: Any = f
        if mmap and zipped:  # (without /proc/self/fd: the name, checked below to still be the file opened)
            src = _same_file(f) or path
        ours = _allowlist(allowed)
        already = set(torch.serialization.get_safe_globals())
        try:
            with torch.serialization.safe_globals([g for g in ours if g not in already]), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (torch's remarks on a file's protocol: the error says it)
                out = torch.load(src, map_location=map_location, weights_only=True, mmap=mmap and zipped)
            if src == path and not _is_open_file(path, f):
                raise MalformedCheckpointError(path, "replaced while it was read: refused")
            return out
        except CheckpointError:
            raise
        except pickle.UnpicklingError as e:
            raise _refusal(path, e, f, zipped, set(allowed)) from None
        except RecursionError:
            raise MalformedCheckpointError(path, "a pickle nested too deep to read: refused") from None
        except Exception as e:  # noqa: BLE001 - every way a file is not a checkpoint is one line naming it
            raise MalformedCheckpointError(path, f"not a checkpoint file torch can read ({type(e).__name__}: "
                                                 f"{_first_line(e)})") from None


def check(path: str, allowed: Iterable[str] = CHECKPOINT_GLOBALS) -> None:
    """Raise what :func:`load` would for ``path``, reading it as cheaply as the format allows
    (memory-mapped: the pickle parsed by the same restricted unpickler, no tensor data read)."""
    load(path, allowed, mmap=True)

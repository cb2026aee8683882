"""DeepSpeed's part of the safe checkpoint reads (canzona_ds/ckpt/safe_load.py: the loader and
the allowlist, ``CHECKPOINT_GLOBALS``, names of the few types DeepSpeed's and
Megatron-DeepSpeed's files hold beside tensors).

:func:`read` is every read canzona-ds makes of a tag (the index reader, the pre-index records,
the main job's look at a tag); :func:`engine_reads` routes DeepSpeed's own reads of a tag
(``engine.checkpoint_engine.load``: model states, ZeRO optimizer states, pipeline layer files,
expert files) through the same loader for the duration of one ``load_checkpoint``.  Both honour
``canzona_checkpoint.allow_unsafe_pickle`` (the engine's ds_config), which turns the check off
for that load.  The loader resolves the allowlist only in modules already imported; DeepSpeed's
are imported here, by the program, before any file is read (:func:`import_deepspeed_types`), so
a tag's DeepSpeed types load in a process that has not imported DeepSpeed yet (``canzona-ckpt``).
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from typing import Any

from ...ckpt import safe_load
from ...ckpt import tag as ck

#: every type a tag's files may hold beside torch's own (ckpt/safe_load.py lists them)
GLOBALS = safe_load.CHECKPOINT_GLOBALS

#: True inside a load whose ds_config opted in to arbitrary pickles
_UNSAFE = contextvars.ContextVar("canzona_ds_allow_unsafe_pickle", default=False)


def import_deepspeed_types() -> None:
    """Import the modules of ``safe_load.DEEPSPEED_GLOBALS`` (DeepSpeed is canzona-ds's dependency;
    a module missing from the installed release is skipped, its names then refused)."""
    for name in safe_load.DEEPSPEED_GLOBALS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name.rsplit(".", 1)[0])


def read(path: str, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """One checkpoint file, unpickling only data (:data:`GLOBALS`); raises
    ``safe_load.UnsafeCheckpointError`` naming the file and the type otherwise, and a
    ``CheckpointError`` naming the file for any other bad file."""
    if not _UNSAFE.get():
        import_deepspeed_types()
    return safe_load.load(path, GLOBALS, map_location=map_location, mmap=mmap, unsafe=_UNSAFE.get())


def _pt_files(path: str) -> list[str]:
    """The ``.pt`` files of the tag directory ``path``, each checked to stay inside it (a symlink
    leaving the tag is refused by name; the loader refuses what is not a regular file)."""
    return [ck.member(path, f, "the tag directory") for f in sorted(os.listdir(path)) if f.endswith(".pt")]


def check_tag(path: str) -> None:
    """Every ``.pt`` file of the tag directory ``path`` holds only data (``safe_load.check``: the
    restricted unpickler, memory-mapped, no tensor read); raises the ``CheckpointError`` of the
    first that does not (``safe_load.UnsafeCheckpointError`` for a refused type)."""
    import_deepspeed_types()
    for f in _pt_files(path):
        safe_load.check(f, GLOBALS)


def check_tag_collective(load_dir, tag) -> None:
    """:func:`check_tag` of ``load_dir/tag`` (``latest`` when ``tag`` is None; nothing when there
    is no such directory: the load says why) on every rank together: the files split over the
    ranks, the verdicts all-gathered, so every rank raises the same error or none does, whatever
    the error (a refusal on one rank alone would leave the others in the load's collectives)."""
    rank, world = ck._rank_world()
    mine = None
    try:
        import_deepspeed_types()
        if tag is None:
            tag = ck.read_latest(str(load_dir))
        path = os.path.join(str(load_dir), str(tag))
        files = _pt_files(path) if tag and os.path.isdir(path) else []
        for f in files[rank::world]:
            safe_load.check(f, GLOBALS)
    except ck.CheckpointError as e:
        mine = e
    except Exception as e:  # noqa: BLE001 - shared like a CheckpointError: no rank may wait on another
        mine = ck.CheckpointError(f"checking checkpoint {load_dir}/{tag} failed on rank {rank}: "
                                  f"{type(e).__name__}: {e}", str(load_dir))
    refused = [e for e in ck._all_gather(mine) if e is not None]
    if refused:
        raise refused[0]


@contextlib.contextmanager
def engine_reads(engine, load_dir=None, tag=None, allow_unsafe_pickle: bool = False):
    """Within: DeepSpeed's reads of checkpoint files on ``engine`` (its checkpoint engine's
    ``load``) and canzona-ds's own go through :func:`read`, after every file of ``load_dir/tag``
    was checked on every rank together (:func:`check_tag_collective`; skipped without
    ``load_dir``); ``allow_unsafe_pickle``: nothing checked, both unpickle anything (the user's
    opt-in)."""
    if load_dir is not None and not allow_unsafe_pickle:
        check_tag_collective(load_dir, tag)
    token = _UNSAFE.set(bool(allow_unsafe_pickle))
    ce = getattr(engine, "checkpoint_engine", None)
    patched = ce is not None and "load" not in vars(ce)
    if patched:
        def load(path, map_location=None):
            return read(str(path), map_location=map_location)

        ce.load = load  # an instance attribute over the class's method, removed below
    try:
        yield
    finally:
        if patched:
            del ce.load
        _UNSAFE.reset(token)

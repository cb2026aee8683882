"""DeepSpeed's part of the safe checkpoint reads (canzona_ds/ckpt/safe_load.py: the loader and
the allowlist, ``CHECKPOINT_GLOBALS``, names of the few types DeepSpeed's and
Megatron-DeepSpeed's files hold beside tensors).

:func:`read` is every read canzona-ds makes of a tag (the index reader, the pre-index records,
the main job's look at a tag); :func:`engine_reads` routes DeepSpeed's own reads of a tag
(``engine.checkpoint_engine.load``: model states, ZeRO optimizer states, pipeline layer files,
expert files) through the same loader for the duration of one ``load_checkpoint``.  Both honour
``canzona_checkpoint.allow_unsafe_pickle`` (the engine's ds_config), which turns the check off
for that load.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from ...ckpt import safe_load

#: every type a tag's files may hold beside torch's own (ckpt/safe_load.py lists them)
GLOBALS = safe_load.CHECKPOINT_GLOBALS

#: True inside a load whose ds_config opted in to arbitrary pickles
_UNSAFE = contextvars.ContextVar("canzona_ds_allow_unsafe_pickle", default=False)


def read(path: str, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """One checkpoint file, unpickling only data (:data:`GLOBALS`); raises
    ``safe_load.UnsafeCheckpointError`` naming the file and the type otherwise."""
    return safe_load.load(path, GLOBALS, map_location=map_location, mmap=mmap, unsafe=_UNSAFE.get())


def check_tag(path: str) -> None:
    """Every ``.pt`` file of the tag directory ``path`` holds only data (nothing unpickled:
    ``safe_load.check``); raises ``safe_load.UnsafeCheckpointError`` naming the first that does not."""
    import os

    for f in sorted(os.listdir(path)):
        if f.endswith(".pt") and os.path.isfile(os.path.join(path, f)):
            safe_load.check(os.path.join(path, f), GLOBALS)


def check_tag_collective(load_dir, tag) -> None:
    """:func:`check_tag` of ``load_dir/tag`` (``latest`` when ``tag`` is None; nothing when there
    is no such directory: the load says why) on every rank together: the files split over the
    ranks, the verdicts all-gathered, so every rank raises the same refusal or none does (a rank
    reads other ranks' files only in some layouts; a refusal on one rank alone would leave the
    others in the load's collectives).  Nothing is unpickled."""
    import os

    from ...ckpt import tag as ck

    if tag is None:
        latest = os.path.join(str(load_dir), ck.LATEST)
        tag = open(latest).read().strip() if os.path.isfile(latest) else None
    path = os.path.join(str(load_dir), str(tag))
    files = sorted(f for f in os.listdir(path) if f.endswith(".pt")) if tag and os.path.isdir(path) else []
    rank, world = ck._rank_world()
    mine = None
    for f in files[rank::world]:
        try:
            safe_load.check(os.path.join(path, f), GLOBALS)
        except safe_load.UnsafeCheckpointError as e:
            mine = e
            break
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

"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` of a Canzona engine: a manifest on
every save, verification before every load.

HF Trainer, Megatron-DeepSpeed and most scripts call the engine methods, not
:mod:`canzona_ds.checkpoint`; registry.py's ``install()`` routes both through here when the
engine runs a Canzona optimizer (any other engine keeps DeepSpeed's own methods)::

    save_checkpoint(dir, tag, client_state, save_latest)      every rank
      1. DeepSpeed writes dir/<tag>/ (its own code, asked not to write `latest`)
      2. checkpoint.hash_files: the files split over the ranks, sha256 + fsync, all-gathered
      3. rank 0: dir/<tag>/canzona_manifest.json (temp file, fsync, os.replace), then
         dir/latest the same way -- `latest` never names a tag whose manifest is not on
         disk; the outcome is broadcast, so every rank returns (True) or raises together

    load_checkpoint(dir, tag, ...)                              every rank
      checkpoint.load(..., unverified="load"): the tag (or `latest`) checked against its
      manifest collectively (rank 0 the structure, every rank a share of the digests, one
      verdict everywhere); a bad file raises CheckpointError naming it, or with
      canzona_checkpoint.fallback the newest intact tag is loaded instead; then the
      DeepSpeed (or checkpoint-index) load of that tag.  A tag without a manifest is loaded as it is,
      rank 0 logging once that it was not verified.

Unlike :func:`canzona_ds.checkpoint.save`, the engine method writes the tag directory in
place, as DeepSpeed does: a save that dies half-way through re-writing an existing tag
leaves the old manifest beside new bytes, which the next load refuses (it is never loaded
unverified), and `latest` still names the previous tag unless that is the one re-written.
Use ``checkpoint.save`` for saves that are atomic per tag.

Not covered (saved without a manifest, rank 0 says why): a decoupled (asynchronous)
DeepSpeed checkpoint engine, whose files may still be in flight when ``save_checkpoint``
returns, and ``use_node_local_storage``, where no rank sees every file.  DeepSpeed's
universal checkpoints (``load_universal_checkpoint``) load as before; a canzona-ds tag loaded with
that flag set (Megatron-DeepSpeed's ``--universal-checkpoint``) loads through its index.
"""
from __future__ import annotations

import contextlib
import logging
import os

from ...ckpt import tag as ck
from .emit import checkpoint_config

logger = logging.getLogger(__name__)


def _no_manifest_reason(engine) -> str | None:
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is not None and ckpt_engine.is_decoupled():
        return "the decoupled checkpoint engine may still be writing its files when save_checkpoint returns"
    if engine.use_node_local_storage():
        return "use_node_local_storage: no rank sees every file"
    return None


def _write_error(exc: BaseException, path: str) -> str:
    """``exc`` (raised writing ``path``) as a sentence that names the cause: torch reports a full
    disk as ``enforce fail at inline_container.cc ... unexpected pos``, so the free space of the
    filesystem is checked too."""
    import errno

    cause = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.errno is not None:
        cause = f"{os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)}): {exc}"
    elif not (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
        try:
            st = os.statvfs(os.path.dirname(path) or ".")
            if st.f_bavail * st.f_frsize < (1 << 20):
                cause = f"No space left on device ({st.f_bavail * st.f_frsize} bytes free; torch: {exc})"
        except OSError:
            pass
    return f"{cause} (writing {path})"


def write_tag(engine, stock_save, save_dir, tag: str, client_state, exclude_frozen_parameters) -> bool:
    """DeepSpeed's save of ``save_dir/tag`` (without ``latest``), then the checkpoint index
    (integration/ckpt/), written by rank 0.  A file that cannot be written (a full disk,
    a permission) is removed and the error kept, so DeepSpeed's own collectives still run on
    every rank; then every rank raises the same :class:`CheckpointError` naming the cause, the
    path and the rank.  Every rank calls it."""
    from ...ckpt.index import INDEX
    from .emit import gather_index

    directory = os.path.join(str(save_dir), tag)
    ce = engine.checkpoint_engine
    errors: list[str] = []
    stock_write = ce.save

    def guarded(state_dict, path):
        try:
            stock_write(state_dict, path)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            errors.append(_write_error(e, str(path)))
            try:
                os.remove(path)  # never leave a half-written file
            except OSError:
                pass

    ce.save = guarded
    try:
        out = stock_save(engine, save_dir, tag, client_state, False, exclude_frozen_parameters)
    finally:
        del ce.save  # the class's method again
    failed = [(r, e) for r, errs in enumerate(ck._all_gather(errors)) for e in errs]
    if failed:
        msg = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise ck.CheckpointError(f"saving checkpoint {directory} failed: {msg}", directory,
                                 [(directory, e) for _, e in failed])
    index = gather_index(engine, tag, directory)
    ck._on_rank0(lambda: ck.write_atomic(os.path.join(directory, INDEX), index.dumps()),
                 f"writing the checkpoint index of {directory}")
    return out


def _expected_files(engine, save_dir, tag: str) -> list[str]:
    """The DeepSpeed files every rank will write into the tag (all-gathered)."""
    mine = []
    if engine.save_zero_checkpoint and engine.zero_optimization_stage() > 0:
        mine.append(os.path.basename(engine._get_zero_ckpt_name(save_dir, tag)))
    if engine.save_non_zero_checkpoint and not engine.has_moe_layers:
        mine.append(os.path.basename(engine._get_ckpt_name(save_dir, tag)))
    return sorted({f for part in ck._all_gather(mine) for f in part})


def save_checkpoint(engine, stock_save, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006
                    exclude_frozen_parameters=False):
    """DeepSpeed's ``save_checkpoint`` (same arguments and return value) plus the index and the
    manifest: rank 0 first records the save as started (``canzona_saving.json``: the files
    expected), then every rank writes; the index, the manifest, the record's removal and
    ``latest`` follow in that order, so a tag is complete exactly when the record is gone."""
    import json
    import time

    reason = _no_manifest_reason(engine)
    if reason is not None:
        if ck._rank_world()[0] == 0:
            logger.warning("canzona_ds: checkpoint %s saved WITHOUT a manifest (load_checkpoint will not verify it): "
                           "%s", os.path.join(str(save_dir), str(tag)), reason)
        return stock_save(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    if tag is None:
        tag = f"global_step{engine.global_steps}"  # DeepSpeed's default, resolved here to name the directory
    tag = str(tag)
    directory = os.path.join(str(save_dir), tag)
    expected = _expected_files(engine, save_dir, tag)
    record = os.path.join(directory, ck.SAVING)

    def start():
        os.makedirs(directory, exist_ok=True)
        ck.write_atomic(record, json.dumps({"tag": tag, "started_unix_ns": time.time_ns(), "expected": expected}))

    ck._on_rank0(start, f"starting the save of {directory}")
    try:
        out = write_tag(engine, stock_save, save_dir, tag, client_state, exclude_frozen_parameters)
    except ck.CheckpointError as e:
        error = str(e)

        def note():  # the record names why the save failed (it stays: the tag is incomplete)
            try:
                ck.write_atomic(record, json.dumps({"tag": tag, "expected": expected, "error": error}))
            except OSError:
                pass  # a full disk may refuse even this; the record written at the start remains
        ck._on_rank0(note)
        raise
    files = ck.hash_files(directory)

    def publish():
        ck.write_manifest(engine, directory, tag, files)
        os.remove(record)
        ck._fsync_dir(directory)
        if save_latest:
            ck.write_atomic(os.path.join(str(save_dir), ck.LATEST), tag)

    ck._on_rank0(publish, f"writing the manifest of {directory}")
    return out


def load_checkpoint(engine, load, load_dir, tag=None, **load_kwargs):
    """Verify, then ``load(engine, load_dir, tag, **load_kwargs)`` (DeepSpeed's load or the
    checkpoint-index one); returns its ``(load_path, client_state)``."""
    cfg = checkpoint_config(engine)
    with canzona_tag_is_universal(engine, load_dir, tag):
        if cfg.verify == "off" or engine.load_universal_checkpoint():
            return load(engine, load_dir, tag, **load_kwargs)
        res = ck.load(engine, load_dir, tag=tag, fallback=cfg.fallback, verify=cfg.verify, unverified="load",
                      loader=lambda e, d, t, manifest, **kw: load(e, d, t, **kw), **load_kwargs)
        return res.path, res.client_state


@contextlib.contextmanager
def canzona_tag_is_universal(engine, load_dir, tag):
    """DeepSpeed's ``checkpoint.load_universal`` (Megatron-DeepSpeed's ``--universal-checkpoint``,
    which is also what lets Megatron resume at another TP or PP size) says the folder is a
    ``ds_to_universal`` conversion.  A canzona-ds tag needs none: its index resumes into any
    layout.  So while a tag with an index loads, the flag is off and the tag takes the one
    comparison like any other (DeepSpeed's stock load at the same layout, else the index loop);
    a folder without an index (a real universal checkpoint) keeps the flag, and the Canzona ZeRO
    optimizers refuse it by name (integration/zero.py)."""
    from ...ckpt.index import INDEX
    from .route import latest_tag

    if not engine.load_universal_checkpoint():
        yield
        return
    name = latest_tag(load_dir) if tag is None else tag
    if name is None or not os.path.isfile(os.path.join(str(load_dir), str(name), INDEX)):
        yield
        return
    if ck._rank_world()[0] == 0:
        logger.warning("canzona_ds: checkpoint.load_universal (Megatron-DeepSpeed: --universal-checkpoint) with %s: a "
                       "canzona-ds tag, which its index resumes into any layout; loaded through it, no ds_to_universal "
                       "conversion", os.path.join(str(load_dir), str(name)))
    config = engine._config
    config.load_universal_checkpoint = False
    try:
        yield
    finally:
        config.load_universal_checkpoint = True

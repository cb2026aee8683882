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
      DeepSpeed (or elastic) load of that tag.  A tag without a manifest is loaded as it is,
      rank 0 logging once that it was not verified.

Unlike :func:`canzona_ds.checkpoint.save`, the engine method writes the tag directory in
place, as DeepSpeed does: a save that dies half-way through re-writing an existing tag
leaves the old manifest beside new bytes, which the next load refuses (it is never loaded
unverified), and `latest` still names the previous tag unless that is the one re-written.
Use ``checkpoint.save`` for saves that are atomic per tag.

Not covered (saved without a manifest, rank 0 says why): a decoupled (asynchronous)
DeepSpeed checkpoint engine, whose files may still be in flight when ``save_checkpoint``
returns, and ``use_node_local_storage``, where no rank sees every file.  DeepSpeed's
universal checkpoints (``load_universal_checkpoint``) load as before.
"""
from __future__ import annotations

import logging
import os

from .. import checkpoint as ck
from ..optim.config import CheckpointConfig

#: top-level ds_config section read by :func:`checkpoint_config`
DS_CONFIG_CHECKPOINT_KEY = "canzona_checkpoint"

logger = logging.getLogger(__name__)


def checkpoint_config(engine) -> CheckpointConfig:
    return CheckpointConfig.from_section(engine._config._param_dict.get(DS_CONFIG_CHECKPOINT_KEY))


def _no_manifest_reason(engine) -> str | None:
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is not None and ckpt_engine.is_decoupled():
        return "the decoupled checkpoint engine may still be writing its files when save_checkpoint returns"
    if engine.use_node_local_storage():
        return "use_node_local_storage: no rank sees every file"
    return None


def save_checkpoint(engine, stock_save, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006
                    exclude_frozen_parameters=False):
    """DeepSpeed's ``save_checkpoint`` (same arguments and return value) plus the manifest."""
    reason = _no_manifest_reason(engine)
    if reason is not None:
        if ck._rank_world()[0] == 0:
            logger.warning("canzona_ds: checkpoint %s saved WITHOUT a manifest (load_checkpoint will not verify it): "
                           "%s", os.path.join(str(save_dir), str(tag)), reason)
        return stock_save(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    if tag is None:
        tag = f"global_step{engine.global_steps}"  # DeepSpeed's default, resolved here to name the directory
    tag = str(tag)
    # `latest` is written below, after the manifest
    out = stock_save(engine, save_dir, tag, client_state, False, exclude_frozen_parameters)
    directory = os.path.join(str(save_dir), tag)
    files = ck.hash_files(directory)

    def publish():
        ck.write_manifest(engine, directory, tag, files)
        if save_latest:
            ck.write_atomic(os.path.join(str(save_dir), ck.LATEST), tag)

    ck._on_rank0(publish, f"writing the manifest of {directory}")
    return out


def load_checkpoint(engine, load, load_dir, tag=None, **load_kwargs):
    """Verify, then ``load(engine, load_dir, tag, **load_kwargs)`` (DeepSpeed's load or the
    elastic one); returns its ``(load_path, client_state)``."""
    cfg = checkpoint_config(engine)
    if cfg.verify == "off" or engine.load_universal_checkpoint():
        return load(engine, load_dir, tag, **load_kwargs)
    res = ck.load(engine, load_dir, tag=tag, fallback=cfg.fallback, verify=cfg.verify, unverified="load",
                  loader=lambda e, d, t, manifest, **kw: load(e, d, t, **kw), **load_kwargs)
    return res.path, res.client_state

"""The public checkpoint API: ``save`` writes a tag atomically with its manifest, ``load``
verifies before loading (with ``fallback`` to the newest intact tag), ``verify`` checks a tag
against its manifest (docs/checkpoints.md).  The code lives in :mod:`canzona_ds.ckpt.tag`, with
the rest of the checkpoint model (canzona_ds/ckpt/); this module is its documented name."""
from .ckpt.tag import (INDEX, LATEST, MANIFEST, CheckpointError, LoadResult, engine_hooks_off, load,
                       published_tags, read_manifest, save, verify, verify_collective)

__all__ = ["INDEX", "LATEST", "MANIFEST", "CheckpointError", "LoadResult", "engine_hooks_off", "load",
           "published_tags", "read_manifest", "save", "verify", "verify_collective"]

"""Checkpoint index (no DeepSpeed): what every save wrote, chunk by chunk, and the region reader.

See :mod:`canzona_ds.ckpt.index`."""
from .index import FORMAT, INDEX, MASTER, CheckpointIndexError, Chunk, Index, Reader, missing, overlaps

__all__ = ["FORMAT", "INDEX", "MASTER", "CheckpointIndexError", "Chunk", "Index", "Reader", "missing", "overlaps"]

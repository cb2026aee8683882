"""Checkpoint index (no DeepSpeed): what every save wrote, chunk by chunk, and the region reader.

See :mod:`canzona_ds.ckpt.index`."""
from .frames import FrameError, TPFrame
from .index import FORMAT, INDEX, MASTER, CheckpointIndexError, Chunk, Index, Reader, missing, overlaps

__all__ = ["FrameError", "TPFrame", "FORMAT", "INDEX", "MASTER", "CheckpointIndexError", "Chunk", "Index", "Reader", "missing", "overlaps"]

"""The checkpoint model, without DeepSpeed (integration/ckpt/ is DeepSpeed's side):

    index.py      the index: what every save wrote, chunk by chunk, and the region reader
    frames.py     a TP shard's frame: where its elements sit in the whole parameter
    tag.py        a tag on disk: atomic writes, the sha256 manifest, verification, the verified
                  load with fallback (public as :mod:`canzona_ds.checkpoint`)
    safe_load.py  every read of a checkpoint file unpickles only data
"""
from .frames import FrameError, TPFrame
from .index import FORMAT, INDEX, MASTER, CheckpointIndexError, Chunk, Index, Reader, missing, overlaps

__all__ = ["FrameError", "TPFrame", "FORMAT", "INDEX", "MASTER", "CheckpointIndexError", "Chunk", "Index", "Reader", "missing", "overlaps"]

"""Hosted runtime of a micro-group plan: any matrix rule on tensor-parallel matrices (TP-ASC).

See :mod:`canzona_ds.tp.runtime` for the interface and the data layout.
"""
from .runtime import FlatSplit, GridSplit, MicroGroupRuntime, StepStats, TPMatrix
from .verify import verify_same_across_group

__all__ = ["FlatSplit", "GridSplit", "MicroGroupRuntime", "StepStats", "TPMatrix", "verify_same_across_group"]

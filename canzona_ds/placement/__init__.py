"""Where a matrix's update happens: one strategy per file, one small interface (base.py).

    context.py  StepContext: what one step of the matrix group hands every placement
    local.py    replicated (one process, ZeRO stage 0): every rank updates every matrix it holds
    owned.py    ZeRO stage 1/2: the planned owner updates its whole matrices inside its flat
                fp32 partition; no collective
    sharded.py  ZeRO stage 3: every matrix in flat pieces over the DP group (ZeRO-3's partitions);
                each matrix goes whole to a planned host through the hosted strategy
    hosted.py   matrices split across a group (Megatron TP / AutoTP shards, ZeRO-3 pieces): fused
                all-to-all of the pieces to a planned host, the rule on the whole matrix there, the
                direction's pieces back (the micro-group runtime of canzona_ds/tp)

A holding strategy (local, owned) says which matrices this rank holds and gives their
(parameter, gradient) views; the split ones among them go through the hosted strategy, the rest
through :func:`~canzona_ds.optim.rule.rule_step`.  A new placement (experts) is a new file here.
"""
from __future__ import annotations

from .base import Placement
from .context import StepContext
from .hosted import HostedPlacement, HostedSet, describe_matrix
from .local import LocalPlacement
from .owned import FlatView, OwnedPlacement
from .sharded import FlatPiece, ShardedPlacement

#: holding strategies by the name CanzonaOptimizer(placement=...) takes
HOLDING: dict[str, type[Placement]] = {"local": LocalPlacement, "owned": OwnedPlacement,
                                       "sharded": ShardedPlacement}

__all__ = ["FlatPiece", "FlatView", "HOLDING", "HostedPlacement", "HostedSet", "LocalPlacement", "OwnedPlacement", "Placement",
           "ShardedPlacement", "StepContext", "describe_matrix"]

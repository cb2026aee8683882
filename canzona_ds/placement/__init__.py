"""Where a matrix's update happens: one strategy per file, one small interface (base.py).

    local.py    replicated (one process, ZeRO stage 0): every rank updates every matrix it holds
    owned.py    ZeRO stage 1/2: the planned owner updates its whole matrices inside its flat
                fp32 partition; no collective
    hosted.py   matrices split across a group (Megatron TP / AutoTP shards): fused all-to-all of
                the shards to a planned host, the rule on the whole matrix there, the direction's
                shards back (the micro-group runtime of canzona_ds/tp)

A holding strategy (local, owned) says which matrices this rank holds and gives their
(parameter, gradient) views; the split ones among them go through the hosted strategy, the rest
through :func:`~canzona_ds.optim.rule.rule_step`.  A new placement (ZeRO-3 partitions over the DP
group, experts) is a new file here.
"""
from __future__ import annotations

from .base import Placement, StepContext
from .hosted import HostedPlacement, describe_matrix
from .local import LocalPlacement
from .owned import FlatView, OwnedPlacement

#: holding strategies by the name CanzonaOptimizer(placement=...) takes
HOLDING: dict[str, type[Placement]] = {"local": LocalPlacement, "owned": OwnedPlacement}

__all__ = ["FlatView", "HOLDING", "HostedPlacement", "LocalPlacement", "OwnedPlacement", "Placement", "StepContext",
           "describe_matrix"]

"""Hosted placement: matrices split across a process group (Megatron TP, DeepSpeed AutoTP) are
updated whole on a planned host rank and every rank applies its shard of the result.

Per micro-group (planned by ``planning/tp.py`` from the rule's cost; the runtime is
``canzona_ds/tp/runtime.py``, which draws the data layout)::

    shards --all_to_all_single--> host: G = cat(shards); D = rule.direction(G, state, info, step)
    host --all_to_all_single--> shards of D;  every rank: apply_rule_update(shard, D_r, ...)

The group is any process group: the TP group for TP shards; the DP group for the matrices the
mixed ZeRO-1/2 layout cuts at chunk boundaries (:class:`~canzona_ds.tp.runtime.FlatSplit`
pieces, hosts planned by planning/mixed.py); ZeRO-3 partitions and expert groups are the same
machinery with another group and another split.
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from ..optim.config import TPConfig
from ..optim.rule import MatrixInfo, MatrixRule
from ..planning.params import ParamSpec
from ..tp.runtime import FlatSplit, MicroGroupRuntime, TPMatrix
from .base import StepContext


def describe_matrix(name: str, param: Tensor, tp_size: int, per_head: bool
                    ) -> tuple[ParamSpec, MatrixInfo, TPMatrix | None]:
    """(planner spec of what this rank holds, the rule's view of the WHOLE matrix, its TP split or
    None) for one matrix parameter."""
    heads = getattr(param, "muon_num_heads", None) if per_head else None
    if TPMatrix.is_split(param, tp_size):
        tpm = TPMatrix.from_param(name, param, tp_size)
        if not per_head:
            tpm = TPMatrix(tpm.name, tpm.full_shape, tpm.partition_dim, tpm.shard_sizes, None)
        spec = ParamSpec(name, tuple(param.shape), "matrix", tp_partition_dim=tpm.partition_dim, tp_size=tp_size,
                         num_heads=tpm.num_heads)
        return spec, tpm.info, tpm
    return ParamSpec(name, tuple(param.shape), "matrix", num_heads=heads), MatrixInfo(name, tuple(param.shape),
                                                                                     heads), None


class HostedPlacement:
    """The micro-group runtime over ``group`` for the split matrices ``matrices`` (the same list,
    in the same order, on every rank of the group)."""

    kind = "hosted"

    def __init__(self, matrices: Sequence[TPMatrix | FlatSplit], rule: MatrixRule, group, config: TPConfig,
                 states: dict[str, dict[str, Tensor]], hosts: Sequence[int] | None = None,
                 piece_states: dict[str, dict[str, Tensor]] | None = None) -> None:
        """``hosts``: the planned host of every matrix (the mixed DP layout); default: the
        micro-group scheduler of ``config`` chooses.  ``piece_states``: this rank's pieces of the
        rule's element-wise state of flat-split matrices (None: the host keeps all state)."""
        self.split: dict[str, TPMatrix | FlatSplit] = {m.name: m for m in matrices}
        self.runtime = MicroGroupRuntime(list(matrices), rule, group, config, state=states, hosts=hosts,
                                         piece_state=piece_states)

    def hosted_names(self) -> list[str]:
        return self.runtime.hosted_names()

    def step(self, held: dict[str, tuple[Tensor, Tensor]], ctx: StepContext) -> None:
        missing = [n for n in self.split if n not in held]
        if missing:
            raise RuntimeError(f"Hosted step is missing this rank's shards of {missing}.")
        order = [m.name for m in self.runtime.matrices]
        self.runtime.step([held[n][0] for n in order], [held[n][1] for n in order], lr=ctx.lr,
                          weight_decay=ctx.weight_decay, step=ctx.step)

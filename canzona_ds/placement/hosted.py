"""Hosted placement: matrices split across a process group (Megatron TP, DeepSpeed AutoTP) are
updated whole on a planned host rank and every rank applies its shard of the result.

Per micro-group (planned by ``planning/tp.py`` from the rule's cost; the runtime is
``canzona_ds/tp/runtime.py``, which draws the data layout)::

    shards --all_to_all_single--> host: G = cat(shards); D = rule.direction(G, state, info, step)
    host --all_to_all_single--> shards of D;  every rank: apply_rule_update(shard, D_r, ...)
    QK-clip (optim/qk_clip.py): every rank scales its shard by its piece of the whole matrix's
    per-row factors, cut by the same ``split.piece`` that cut D

The group is any process group: the TP group for TP shards; the DP group for the matrices the
mixed ZeRO-1/2 layout cuts at chunk boundaries (:class:`~canzona_ds.tp.runtime.FlatSplit`
pieces, hosts planned by planning/mixed.py); the DP x TP grid for the tensor-parallel ones it
hosts (:class:`~canzona_ds.tp.runtime.GridSplit`: each TP shard cut into DP pieces); ZeRO-3
partitions and expert groups are the same machinery with another group and another split.

Where a rank runs several of these (the mixed layout under TP: owned TP-split matrices over the
TP group, hosted replicated ones over the DP group, hosted TP-split ones over the grid),
:class:`HostedSet` steps them one after the other, in the same fixed order on every rank.
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from ..config import TPConfig
from ..optim.rule import MatrixInfo, MatrixRule
from ..planning.params import ParamSpec
from ..tp.runtime import FlatSplit, GridSplit, MicroGroupRuntime, StepStats, TPMatrix
from .context import StepContext


def describe_matrix(name: str, param: Tensor, tp_size: int, per_head: bool, num_experts: int | None = None
                    ) -> tuple[ParamSpec, MatrixInfo, TPMatrix | None]:
    """(planner spec of what this rank holds, the rule's view of the WHOLE matrix, its TP split or
    None) for one matrix parameter; ``num_experts``: the parameter is a stack of that many experts."""
    heads = getattr(param, "muon_num_heads", None) if per_head else None
    if TPMatrix.is_split(param, tp_size):
        if num_experts is not None:
            raise ValueError(f"Expert stack {name!r} {list(param.shape)} is tensor-parallel: per-expert updates of a "
                             "TP-split stack are not supported (shard experts with expert parallelism instead).")
        tpm = TPMatrix.from_param(name, param, tp_size)
        if not per_head:
            tpm = TPMatrix(tpm.name, tpm.full_shape, tpm.partition_dim, tpm.shard_sizes, None)
        spec = ParamSpec(name, tuple(param.shape), "matrix", tp_partition_dim=tpm.partition_dim, tp_size=tp_size,
                         num_heads=tpm.num_heads)
        return spec, tpm.info, tpm
    if num_experts is not None:
        heads = None  # per-head Muon applies to attention projections, never to experts
    shape = tuple(param.shape)
    return (ParamSpec(name, shape, "matrix", num_heads=heads, num_experts=num_experts),
            MatrixInfo(name, shape, heads, num_experts), None)


class HostedPlacement:
    """The micro-group runtime over ``group`` for the split matrices ``matrices`` (the same list,
    in the same order, on every rank of the group)."""

    kind = "hosted"

    def __init__(self, matrices: Sequence[TPMatrix | FlatSplit | GridSplit], rule: MatrixRule, group, config: TPConfig,
                 states: dict[str, dict[str, Tensor]], hosts: Sequence[int] | None = None,
                 piece_states: dict[str, dict[str, Tensor]] | None = None) -> None:
        """``hosts``: the planned host of every matrix (the mixed DP layout); default: the
        micro-group scheduler of ``config`` chooses.  ``piece_states``: this rank's pieces of the
        rule's element-wise state of flat-split matrices (None: the host keeps all state)."""
        self.split: dict[str, TPMatrix | FlatSplit | GridSplit] = {m.name: m for m in matrices}
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
        for n in order:
            if n in ctx.qk_scales:
                scale_piece(held[n][0], self.split[n], ctx.qk_scales[n], self.runtime.tp_rank)


def scale_piece(piece: Tensor, split, row_scale: Tensor, rank: int) -> None:
    """``piece`` (rank ``rank``'s flat or shard piece of ``split``'s matrix) *= its part of the
    whole matrix's per-row factors ``row_scale`` (rows,): the factors are laid out as the whole
    matrix (one transient whole-matrix tensor) and cut by ``split.piece``, as the update was."""
    full = tuple(split.info.shape)
    whole = row_scale.to(device=piece.device, dtype=piece.dtype).view(-1, *([1] * (len(full) - 1))).expand(full)
    piece.mul_(split.piece(whole, rank).reshape(piece.shape))


class HostedSet:
    """Several hosted strategies on one rank, each over its own group, stepped in a fixed order
    (the order given, the same on every rank, so no two groups wait on each other): the
    :class:`HostedPlacement` interface (``split``, ``hosted_names``, ``step``) over all of them,
    and ``runtime``, a :class:`RuntimeSet` whose counts are the sums of theirs."""

    kind = "hosted"

    def __init__(self, parts: Sequence[HostedPlacement]) -> None:
        self.parts = tuple(parts)
        self.split: dict = {}
        for part in self.parts:
            twice = sorted(set(self.split) & set(part.split))
            if twice:
                raise ValueError(f"Matrices {twice[:3]} are hosted by two runtimes.")
            self.split.update(part.split)
        self.runtime = RuntimeSet([p.runtime for p in self.parts])

    def hosted_names(self) -> list[str]:
        return [n for p in self.parts for n in p.hosted_names()]

    def step(self, held: dict[str, tuple[Tensor, Tensor]], ctx: StepContext) -> None:
        missing = [n for n in self.split if n not in held]
        if missing:
            raise RuntimeError(f"Hosted step is missing this rank's shards of {missing}.")
        for part in self.parts:
            part.step({n: held[n] for n in part.split}, ctx)


class RuntimeSet:
    """The runtimes of a :class:`HostedSet`, read as one: ``matrices`` and ``hosted_names`` in
    step order, ``stats`` and ``expected_collectives`` summed (each runtime on its own group)."""

    def __init__(self, runtimes: Sequence[MicroGroupRuntime]) -> None:
        self.runtimes = tuple(runtimes)

    @property
    def matrices(self) -> tuple:
        return tuple(m for rt in self.runtimes for m in rt.matrices)

    def hosted_names(self) -> list[str]:
        return [n for rt in self.runtimes for n in rt.hosted_names()]

    @property
    def stats(self) -> StepStats:
        out = StepStats()
        for rt in self.runtimes:
            for op, n in rt.stats.collectives.items():
                out.collectives[op] = out.collectives.get(op, 0) + n
            out.bytes_sent += rt.stats.bytes_sent
            out.flops += rt.stats.flops
        return out

    def expected_collectives(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rt in self.runtimes:
            for op, n in rt.expected_collectives().items():
                out[op] = out.get(op, 0) + n
        return out

"""``ParallelGroups``: every parallel degree, its process group, and this rank's coordinates.

Built and validated once, from whatever the user has (``integration/groups.py`` reads an
engine: plain DP, a Megatron ``mpu``, a ``PipelineModule``'s grid, DeepSpeed's AutoTP groups),
then passed explicitly: no other module discovers process groups.  torchtitan's
``parallel_dims`` idea, with the groups themselves attached::

    world = dp x tp x pp (x ep inside dp)
    rank (dp_rank, tp_rank, pp_rank)
      data     ranks holding the same layers and shards; ZeRO partitions over it and the
               planner balances matrix ownership over it (one plan per pipeline stage)
      tensor   ranks holding shards of the same matrices (Megatron TP, AutoTP); split
               matrices are hosted over it (placement/hosted.py)
      pipeline ranks holding different layers (stages); each stage plans its own matrices
      expert   ranks holding different experts of the same MoE layers (DeepSpeed MoE's
               expert-parallel group); expert parameters are planned and owned over their
               expert-data-parallel group (the ranks holding the same experts), the rest over
               data.  ep x edp = dp, or dp x tp under tensor parallelism: DeepSpeed MoE
               without expert tensor parallelism lays its expert groups over every rank of
               the stage, TP ranks included (docs/moe.md, "MoE x tensor parallelism").  A
               model may have MoE layers of several ep sizes: one :class:`ExpertGroups` per
               DeepSpeed expert group name ("ep_size_2", ...), and ``ep_size``/``ep_rank``/
               ``ep_group`` are those of the largest.
      grid     the dp x tp ranks of this pipeline stage (``grid_group``; only where the mixed
               ZeRO-1/2 layout may host a tensor-parallel matrix): a hosted TP-split matrix is
               cut into TP shards and each shard into DP pieces, and one all-to-all over the
               grid brings every piece to the host (tp/runtime.GridSplit).  ``grid_cells[g]``
               is the (tp_rank, dp_rank) of grid-group rank g (torch numbers a group's ranks
               in global-rank order, so the cells say which piece each group rank holds)

A group of size 1 may be ``None``.  Everything here is plain ``torch.distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AXES = ("dp", "tp", "pp", "ep")


@dataclass(frozen=True)
class ExpertGroups:
    """One expert group (DeepSpeed names it ``ep_size_<n>``): the expert-parallel group (ranks
    holding different experts) and the expert-data-parallel group (ranks holding the same
    experts, over which their gradients are averaged and their ownership is planned)."""

    name: str
    ep_size: int
    ep_rank: int
    ep_group: Any
    edp_size: int
    edp_rank: int
    edp_group: Any

    def __post_init__(self) -> None:
        for axis in ("ep", "edp"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1 or not 0 <= rank < size:
                raise ValueError(f"Invalid expert group {self.name!r}: {axis}_size={size!r}, {axis}_rank={rank!r}.")


@dataclass(frozen=True)
class ParallelGroups:
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Any = None
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    #: the expert groups by name (DeepSpeed MoE); empty without MoE layers
    experts: tuple = ()
    #: where the degrees were read from (for messages): "single", "dp", "mpu", "pipeline", "autotp"
    source: str = "single"
    #: the DP x TP grid of this pipeline stage (module doc; None: not built)
    grid_group: Any = None
    #: per grid-group rank: its (tp_rank, dp_rank)
    grid_cells: tuple = ()

    def __post_init__(self) -> None:
        for axis in AXES:
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Invalid {axis}_size={size!r} ({self.source}). Must be an int >= 1.")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"Invalid {axis}_rank={rank!r} ({self.source}). Must be in [0, {axis}_size={size}).")
        names = [e.name for e in self.experts]
        if len(set(names)) != len(names) or not all(isinstance(e, ExpertGroups) for e in self.experts):
            raise ValueError(f"experts must be ExpertGroups with distinct names, got {names}.")
        for e in self.experts:
            if e.ep_size * e.edp_size not in (self.dp_size, self.dp_size * self.tp_size):
                raise ValueError(f"Expert group {e.name!r}: ep_size={e.ep_size} x edp_size={e.edp_size} is neither "
                                 f"dp_size={self.dp_size} nor dp_size x tp_size={self.dp_size * self.tp_size} "
                                 f"({self.source}); expert parallelism lives inside data parallelism, or inside "
                                 "data x tensor parallelism (DeepSpeed MoE under an mpu, experts not TP-split).")
        if self.grid_group is not None or self.grid_cells:
            cells = tuple(tuple(c) for c in self.grid_cells)
            want = sorted((t, d) for t in range(self.tp_size) for d in range(self.dp_size))
            if sorted(cells) != want:
                raise ValueError(f"Invalid grid_cells={list(self.grid_cells)[:8]} ({self.source}): must hold every "
                                 f"(tp_rank, dp_rank) of tp_size={self.tp_size} x dp_size={self.dp_size} once.")
        self._check_group_sizes()

    def expert(self, name: str) -> ExpertGroups:
        """The expert group ``name`` (ValueError naming the known ones)."""
        for e in self.experts:
            if e.name == name:
                return e
        raise ValueError(f"No expert group {name!r} ({self.source}); known: {[e.name for e in self.experts]}.")

    def partition_size(self, partition: str | None) -> int:
        """The number of ranks a partition's matrices are planned over: the DP group for dense
        parameters (``None``), the expert-data-parallel group for an expert group's."""
        return self.dp_size if partition is None else self.expert(partition).edp_size

    def _check_group_sizes(self) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        for axis in AXES:
            group = getattr(self, f"{axis}_group")
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if group is None:
                if size > 1:
                    raise ValueError(f"{axis}_size={size} ({self.source}) but no {axis} process group was given.")
                continue
            if dist.get_world_size(group) != size or dist.get_rank(group) != rank:
                raise ValueError(f"{self.source}: {axis} group has {dist.get_world_size(group)} ranks (this is rank "
                                 f"{dist.get_rank(group)}), but {axis}_size={size}, {axis}_rank={rank} were reported.")
        if self.grid_group is not None:
            cells = tuple(tuple(c) for c in self.grid_cells)
            g = dist.get_rank(self.grid_group)
            if dist.get_world_size(self.grid_group) != len(cells) or cells[g] != (self.tp_rank, self.dp_rank):
                raise ValueError(f"{self.source}: the DP x TP grid group has {dist.get_world_size(self.grid_group)} "
                                 f"ranks and calls this rank {g} at cell {cells[g] if g < len(cells) else None}, but "
                                 f"this rank is (tp_rank={self.tp_rank}, dp_rank={self.dp_rank}) of {len(cells)} cells.")
        for e in self.experts:
            for axis in ("ep", "edp"):
                group, size, rank = (getattr(e, f"{axis}_{k}") for k in ("group", "size", "rank"))
                if group is None:
                    if size > 1:
                        raise ValueError(f"Expert group {e.name!r}: {axis}_size={size} but no process group.")
                    continue
                if dist.get_world_size(group) != size or dist.get_rank(group) != rank:
                    raise ValueError(f"Expert group {e.name!r}: {axis} group has {dist.get_world_size(group)} ranks "
                                     f"(this is rank {dist.get_rank(group)}), but {axis}_size={size}, "
                                     f"{axis}_rank={rank} were reported.")

    @classmethod
    def single(cls) -> "ParallelGroups":
        """One process: every degree 1."""
        return cls()

    @property
    def coordinates(self) -> dict[str, int]:
        return {axis: getattr(self, f"{axis}_rank") for axis in AXES}

    @property
    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, f"{axis}_size") for axis in AXES}

    def describe(self) -> str:
        sizes = " x ".join(f"{axis.upper()}={getattr(self, f'{axis}_size')}" for axis in AXES
                           if getattr(self, f"{axis}_size") > 1 or axis == "dp")
        return f"{sizes} (from {self.source}), this rank at {self.coordinates}"

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
      expert   room for expert parallelism (size 1 today)

A group of size 1 may be ``None``.  Everything here is plain ``torch.distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AXES = ("dp", "tp", "pp", "ep")


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
    #: where the degrees were read from (for messages): "single", "dp", "mpu", "pipeline", "autotp"
    source: str = "single"

    def __post_init__(self) -> None:
        for axis in AXES:
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Invalid {axis}_size={size!r} ({self.source}). Must be an int >= 1.")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"Invalid {axis}_rank={rank!r} ({self.source}). Must be in [0, {axis}_size={size}).")
        self._check_group_sizes()

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

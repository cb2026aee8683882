"""DP ownership planners: which rank owns (updates, stores state for) each matrix.

The runtime realises a plan in DeepSpeed's flat buffer like this ("planned padding"):

    flat buffer of the matrix param group, dp = 3, every rank's range padded to P

      rank 0 range (P)              rank 1 range (P)              rank 2 range (P)
    |  W_a  |   W_d   |  pad |   W_b     | W_e | pad...  |  W_c  |  W_f  | W_g |pad|
      ^ rank_params[0] in order   ^ rank_params[1]             ^ rank_params[2]

Every matrix lies wholly inside one rank's range, so DeepSpeed's stock equal-chunk
code (reduce to owner, partitioned step, all-gather) keeps working unchanged and the
optimizer step needs no communication.  The cost is ``padding = dp*P - S`` elements in
the replicated buffer and the post-step all-gather; the planners minimise it by
balancing ``numel`` (memory) together with the compute cost.

Planners are pure functions of (specs, world size, settings): every rank computes the
same plan; :meth:`OwnershipPlan.fingerprint` lets the runtime verify that.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import time
from dataclasses import dataclass, field
from typing import Sequence

from .params import ParamSpec


@dataclass(frozen=True)
class OwnershipPlan:
    """Result of a DP planner over one parameter group (the matrices)."""

    planner: str
    world_size: int
    specs: tuple[ParamSpec, ...]
    #: owner rank of spec i (for ``equal_chunk``: the rank holding its first element)
    owner: tuple[int, ...]
    #: per rank, spec indices in buffer order
    rank_params: tuple[tuple[int, ...], ...]
    #: per rank, the cost-model load (e.g. Newton-Schulz FLOPs)
    rank_load: tuple[float, ...]
    #: per rank, elements of its parameters (before padding)
    rank_numel: tuple[int, ...]
    #: every rank's range is padded to this many elements (multiple of ``align``)
    shard_numel: int
    #: matrices cut by a rank boundary (only ``equal_chunk`` has any)
    split_params: tuple[int, ...] = ()
    cost_model: str = "numel"
    alpha: float | None = None
    plan_ms: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def total_numel(self) -> int:
        return sum(self.rank_numel)

    @property
    def padding(self) -> int:
        """Extra elements the padded layout adds: ``dp * P - S``."""
        return self.world_size * self.shard_numel - self.total_numel

    @property
    def padding_fraction(self) -> float:
        return self.padding / self.total_numel if self.total_numel else 0.0

    def rank_offsets(self, rank: int) -> list[tuple[int, int]]:
        """(spec index, element offset inside the rank's range) in buffer order."""
        out, off = [], 0
        for i in self.rank_params[rank]:
            out.append((i, off))
            off += self.specs[i].numel
        return out

    def buffer_order(self) -> list[int]:
        """All spec indices in flat-buffer order (rank 0's first)."""
        return [i for r in range(self.world_size) for i in self.rank_params[r]]

    def fingerprint(self) -> str:
        """Stable hash of everything the runtime layout depends on."""
        payload = {
            "planner": self.planner,
            "world_size": self.world_size,
            "specs": [(s.name, list(s.shape)) for s in self.specs],
            "rank_params": [list(r) for r in self.rank_params],
            "shard_numel": self.shard_numel,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def _validate(specs: Sequence[ParamSpec], world_size: int, alpha: float | None) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}. Must be an int >= 1.")
    if len(specs) == 0:
        raise ValueError("Empty parameter list: nothing to plan (specs=[]).")
    if alpha is not None and not (0.0 <= alpha <= 1.0):
        raise ValueError(f"Invalid alpha={alpha!r}. Must be within [0, 1].")


def _finish(
    planner: str,
    specs: Sequence[ParamSpec],
    world_size: int,
    rank_params: list[list[int]],
    loads: Sequence[float],
    align: int,
    t0: float,
    cost_model: str,
    alpha: float | None = None,
    split_params: tuple[int, ...] = (),
    owner: list[int] | None = None,
) -> OwnershipPlan:
    if owner is None:
        owner = [-1] * len(specs)
        for r, idxs in enumerate(rank_params):
            for i in idxs:
                owner[i] = r
    rank_numel = [sum(specs[i].numel for i in idxs) for idxs in rank_params]
    rank_load = [sum(loads[i] for i in idxs) for idxs in rank_params]
    shard = _round_up(max(max(rank_numel), 1), align)
    return OwnershipPlan(
        planner=planner,
        world_size=world_size,
        specs=tuple(specs),
        owner=tuple(owner),
        rank_params=tuple(tuple(r) for r in rank_params),
        rank_load=tuple(float(x) for x in rank_load),
        rank_numel=tuple(rank_numel),
        shard_numel=shard,
        split_params=split_params,
        cost_model=cost_model,
        alpha=alpha,
        plan_ms=(time.perf_counter() - t0) * 1e3,
    )


def plan_lpt(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    align: int = 1,
    cost_model: str = "numel",
) -> OwnershipPlan:
    """Global LPT: heaviest matrix first onto the least-loaded rank (ties: lower numel, rank).

    Inside a rank, parameters keep their original model order.
    """
    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    order = sorted(range(len(specs)), key=lambda i: (-loads[i], -specs[i].numel, i))
    heap = [(0.0, 0, r) for r in range(world_size)]
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, numel, r = heapq.heappop(heap)
        rank_params[r].append(i)
        heapq.heappush(heap, (load + loads[i], numel + specs[i].numel, r))
    for r in rank_params:
        r.sort()
    return _finish("lpt", specs, world_size, rank_params, loads, align, t0, cost_model)


def plan_dp(
    specs: Sequence[ParamSpec],
    world_size: int,
    planner: str = "lpt",
    alpha: float = 1.0,
    cost: str = "numel",
    optimizer: str = "muon",
    align: int = 1,
) -> OwnershipPlan:
    """Plan ownership of ``specs`` (all atomic) over ``world_size`` DP ranks.

    Args:
        planner: planner name (see ``DP_PLANNERS``).
        alpha: balance factor of ``alpha_balanced`` (ignored by the others), in [0, 1].
        cost: cost model name used as the load (``numel`` or ``flops``).
        optimizer: which optimizer's FLOPs the ``flops`` cost model counts.
        align: every rank's range is rounded up to a multiple of this many elements.
    """
    from .cost import cost_vector  # local import keeps the module graph one-way

    _validate(specs, world_size, alpha)
    loads = cost_vector(specs, cost=cost, optimizer=optimizer)
    if planner == "lpt":
        return plan_lpt(specs, world_size, loads, align=align, cost_model=cost)
    raise ValueError(f"Unknown DP planner={planner!r}. Allowed: ['lpt']")

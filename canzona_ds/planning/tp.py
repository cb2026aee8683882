"""TP micro-group scheduler (paper Algorithms 2-4): which TP rank hosts each split matrix,
and how the matrices are batched into micro-groups for fused all-to-all.

    TP group of 2, three TP-split matrices, C_max large enough for two per group

    micro-group 0:  host 0 <- W_fc1 (heaviest)      host 1 <- W_qkv
    micro-group 1:  host 0 <- W_proj                host 1 <- (nothing)

    per group: all_to_all(grad shards -> hosts) ; hosts run Muon on full matrices ;
               all_to_all(update shards -> every TP rank)

Deterministic: sorted by (cost desc, index asc); every TP rank computes the same plan.
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
class MicroGroup:
    #: (spec index, host TP rank) in execution order
    tasks: tuple[tuple[int, int], ...]
    #: per TP rank, summed cost of the tasks it hosts in this group
    rank_load: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.rank_load) if self.rank_load else 0.0


@dataclass(frozen=True)
class MicroGroupPlan:
    scheduler: str
    tp_size: int
    specs: tuple[ParamSpec, ...]
    groups: tuple[MicroGroup, ...]
    #: host TP rank of spec i
    host: tuple[int, ...]
    #: per TP rank, total cost over all groups
    rank_load: tuple[float, ...]
    c_max: float
    cost_model: str = "numel"
    plan_ms: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def fingerprint(self) -> str:
        payload = {
            "scheduler": self.scheduler,
            "tp_size": self.tp_size,
            "specs": [(s.name, list(s.shape)) for s in self.specs],
            "groups": [list(map(list, g.tasks)) for g in self.groups],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def min_heap_solver(items: Sequence[tuple[float, int]], ranks: int) -> tuple[list[list[int]], list[float]]:
    """Algorithm 4: LPT of ``(cost, index)`` items onto ``ranks``; returns (assignment, loads)."""
    heap = [(0.0, r) for r in range(ranks)]
    assign: list[list[int]] = [[] for _ in range(ranks)]
    for cost, idx in sorted(items, key=lambda t: (-t[0], t[1])):
        load, r = heapq.heappop(heap)
        assign[r].append(idx)
        heapq.heappush(heap, (load + cost, r))
    loads = [0.0] * ranks
    for load, r in heap:
        loads[r] = load
    return assign, loads


def _group(items: list[tuple[float, int]], tp_size: int) -> MicroGroup:
    assign, loads = min_heap_solver(items, tp_size)
    host_of = {i: r for r, idxs in enumerate(assign) for i in idxs}
    order = [idx for _, idx in sorted(items, key=lambda t: (-t[0], t[1]))]
    return MicroGroup(tasks=tuple((i, host_of[i]) for i in order), rank_load=tuple(loads))


def plan_micro_groups(
    specs: Sequence[ParamSpec],
    tp_size: int,
    c_max: float,
    loads: Sequence[float],
    cost_model: str = "numel",
) -> MicroGroupPlan:
    """Algorithm 3: global LPT sort, greedy packing with rollback at makespan ``c_max``."""
    t0 = time.perf_counter()
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"Invalid tp_size={tp_size!r}. Must be an int >= 1.")
    if len(specs) == 0:
        raise ValueError("Empty parameter list: nothing to schedule (specs=[]).")
    if not c_max > 0:
        raise ValueError(f"Invalid c_max={c_max!r}. Must be > 0.")
    biggest = max(range(len(specs)), key=lambda i: (loads[i], -i))
    if loads[biggest] > c_max:
        raise ValueError(
            f"c_max={c_max:g} is smaller than the largest task {specs[biggest].name!r} "
            f"(cost {loads[biggest]:g} under cost model {cost_model!r}); raise c_max to at least that."
        )
    order = sorted(range(len(specs)), key=lambda i: (-loads[i], i))
    groups: list[MicroGroup] = []
    current: list[tuple[float, int]] = []
    for i in order:
        trial = current + [(loads[i], i)]
        _, trial_loads = min_heap_solver(trial, tp_size)
        if max(trial_loads) <= c_max:
            current = trial
        else:
            groups.append(_group(current, tp_size))
            current = [(loads[i], i)]
    if current:
        groups.append(_group(current, tp_size))
    host = [-1] * len(specs)
    totals = [0.0] * tp_size
    for g in groups:
        for i, r in g.tasks:
            host[i] = r
            totals[r] += loads[i]
    return MicroGroupPlan(
        scheduler="lpt_rollback",
        tp_size=tp_size,
        specs=tuple(specs),
        groups=tuple(groups),
        host=tuple(host),
        rank_load=tuple(totals),
        c_max=float(c_max),
        cost_model=cost_model,
        plan_ms=(time.perf_counter() - t0) * 1e3,
    )

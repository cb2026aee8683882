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
from typing import Callable, Sequence

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


def _validate(specs: Sequence[ParamSpec], tp_size: int, c_max: float, loads: Sequence[float], cost_model: str) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
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


def _plan(
    scheduler: str,
    specs: Sequence[ParamSpec],
    tp_size: int,
    groups: list[MicroGroup],
    loads: Sequence[float],
    c_max: float,
    cost_model: str,
    t0: float,
) -> MicroGroupPlan:
    host = [-1] * len(specs)
    totals = [0.0] * tp_size
    for g in groups:
        for i, r in g.tasks:
            host[i] = r
            totals[r] += loads[i]
    return MicroGroupPlan(
        scheduler=scheduler,
        tp_size=tp_size,
        specs=tuple(specs),
        groups=tuple(groups),
        host=tuple(host),
        rank_load=tuple(totals),
        c_max=float(c_max),
        cost_model=cost_model,
        plan_ms=(time.perf_counter() - t0) * 1e3,
    )


def plan_micro_groups(
    specs: Sequence[ParamSpec],
    tp_size: int,
    c_max: float,
    loads: Sequence[float],
    cost_model: str = "numel",
) -> MicroGroupPlan:
    """Algorithm 3: global LPT sort, greedy packing with rollback at makespan ``c_max``."""
    t0 = time.perf_counter()
    _validate(specs, tp_size, c_max, loads, cost_model)
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
    return _plan("lpt_rollback", specs, tp_size, groups, loads, c_max, cost_model, t0)


def plan_no_fusion(
    specs: Sequence[ParamSpec], tp_size: int, c_max: float, loads: Sequence[float], cost_model: str = "numel"
) -> MicroGroupPlan:
    """Baseline ("No-Fuse"): one tensor per micro-group (one all-to-all each); hosts by
    a global min-heap over the LPT order, so the totals are as balanced as plain LPT."""
    t0 = time.perf_counter()
    _validate(specs, tp_size, c_max, loads, cost_model)
    heap = [(0.0, r) for r in range(tp_size)]
    groups = []
    for i in sorted(range(len(specs)), key=lambda i: (-loads[i], i)):
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + loads[i], r))
        rank_load = [0.0] * tp_size
        rank_load[r] = loads[i]
        groups.append(MicroGroup(tasks=((i, r),), rank_load=tuple(rank_load)))
    return _plan("no_fusion", specs, tp_size, groups, loads, c_max, cost_model, t0)


def plan_round_robin(
    specs: Sequence[ParamSpec], tp_size: int, c_max: float, loads: Sequence[float], cost_model: str = "numel"
) -> MicroGroupPlan:
    """Baseline: model order, host ``k % tp_size`` for the k-th tensor, packed into
    micro-groups under the same capacity rule (no group's busiest host above ``c_max``)."""
    t0 = time.perf_counter()
    _validate(specs, tp_size, c_max, loads, cost_model)
    groups: list[MicroGroup] = []
    tasks: list[tuple[int, int]] = []
    group_load = [0.0] * tp_size
    for k in range(len(specs)):
        r = k % tp_size
        if tasks and group_load[r] + loads[k] > c_max:
            groups.append(MicroGroup(tasks=tuple(tasks), rank_load=tuple(group_load)))
            tasks, group_load = [], [0.0] * tp_size
        tasks.append((k, r))
        group_load[r] += loads[k]
    groups.append(MicroGroup(tasks=tuple(tasks), rank_load=tuple(group_load)))
    return _plan("round_robin", specs, tp_size, groups, loads, c_max, cost_model, t0)


#: scheduler name -> fn(specs, tp_size, c_max, loads, cost_model) -> MicroGroupPlan
TP_SCHEDULERS: dict[str, Callable[..., MicroGroupPlan]] = {
    "lpt_rollback": plan_micro_groups,
    "no_fusion": plan_no_fusion,
    "round_robin": plan_round_robin,
}
DEFAULT_TP_SCHEDULER = "lpt_rollback"


def plan_tp(
    specs: Sequence[ParamSpec],
    tp_size: int,
    scheduler: str = DEFAULT_TP_SCHEDULER,
    c_max: float | None = None,
    cost: str = "numel",
    model=None,
) -> MicroGroupPlan:
    """Schedule the TP-split matrices ``specs`` (TP-local shards) over a TP group.

    A task's load is the cost of the *full* matrix (``cost_vector(..., hosted=True)``): the
    host reassembles it and runs the optimizer on all of it.

    Args:
        scheduler: name in ``TP_SCHEDULERS``.
        c_max: per-group makespan capacity, in units of ``cost``; None = the largest task
            (the smallest valid value: groups as small as balance allows, so they pipeline).
            Kept as the default after the C_max sweep of ``benchmarks/paper_experiments.py``
            (Figure 14, simulated; results/paper_experiments.md): with the pipelined runtime
            it is within 1% of the best C_max in all but the most latency-bound simulated
            cells, and for Qwen3-32B at TP=8 it already is a full fc1 (1000 MiB of fp32
            gradient per host), past the paper's ~512 MB plateau.  The blocking runtime
            (``pipelined=False``) prefers larger groups: give it a larger ``c_max``.
        cost: cost name (``numel``, ``flops``, ``peak_flops``, ``memory``).
        model: the optimizer's cost model (needed for every cost but ``numel``).
    """
    from .cost import check_cost, cost_vector

    check_cost(cost)
    if scheduler not in TP_SCHEDULERS:
        raise ValueError(f"Unknown TP scheduler={scheduler!r}. Allowed: {sorted(TP_SCHEDULERS)}")
    if len(specs) == 0:
        raise ValueError("Empty parameter list: nothing to schedule (specs=[]).")
    loads = cost_vector(specs, cost=cost, model=model, hosted=True)
    if c_max is None:
        c_max = max(loads) if max(loads) > 0 else 1.0
    return TP_SCHEDULERS[scheduler](specs, tp_size, c_max, loads, cost)


def plan_fixed_hosts(specs: Sequence[ParamSpec], hosts: Sequence[int], group_size: int,
                     loads: Sequence[float] | None = None) -> MicroGroupPlan:
    """Micro-groups for hosts chosen elsewhere (the mixed DP layout's plan, planning/mixed.py):
    group k holds the k-th matrix (in ``specs`` order) of every host, so one group's hosts
    each run at most one task while the next group's all-to-all is in flight.  Collectives
    per step: 2 x (most matrices on one host)."""
    t0 = time.perf_counter()
    if len(hosts) != len(specs) or any(not 0 <= h < group_size for h in hosts):
        raise ValueError(f"hosts={list(hosts)} must give one rank in [0, {group_size}) per matrix ({len(specs)}).")
    loads = [float(s.numel) for s in specs] if loads is None else list(loads)
    per_host: list[list[int]] = [[] for _ in range(group_size)]
    for i, h in enumerate(hosts):
        per_host[h].append(i)
    groups = []
    for k in range(max((len(x) for x in per_host), default=0)):
        tasks = tuple((per_host[r][k], r) for r in range(group_size) if k < len(per_host[r]))
        rank_load = [0.0] * group_size
        for i, r in tasks:
            rank_load[r] += loads[i]
        groups.append(MicroGroup(tasks=tasks, rank_load=tuple(rank_load)))
    return _plan("fixed_hosts", specs, group_size, groups, loads, max(loads, default=1.0) or 1.0, "numel", t0)

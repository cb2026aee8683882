"""Balance metrics of DP and TP plans (paper eqs. 2, 3, 6), and their lower bounds.

    R_LB   = max_r W_r / mean_r W_r                     (eq. 6), for FLOPs and memory
    bound  = max(1, max_p W(p) / mean_r W_r)            no atomic plan can beat it
    J_DP   = max_r |W_r - mu|                           (eq. 2), in the plan's cost model
    J_comm = sum_buckets sum_r |S_{i,r} - |B_i| / R|    (eq. 3), elements; one bucket =
                                                        the whole buffer unless the plan
                                                        records buckets (alpha_balanced)

The mean is the *useful* work divided by the ranks, so a plan that repeats work
(equal_chunk's redundant Newton-Schulz on split matrices) shows it as imbalance.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from .cost import cost_vector, slice_cost
from .dp import OwnershipPlan
from .tp import MicroGroupPlan


def rank_costs(plan: OwnershipPlan, cost: str, model=None) -> list[float]:
    """Per DP rank load under ``cost``.  A matrix cut by a rank boundary (only
    ``equal_chunk``, DeepSpeed's stock slicing) is updated in full on every rank it touches
    (DeepSpeed's Muon), so FLOPs and optimizer state are charged in full to each of them;
    its master weight and gradient (and ``numel``) pro rata to the slice
    (:func:`canzona_ds.planning.cost.slice_cost`)."""
    loads = cost_vector(plan.specs, cost=cost, model=model)
    out = [0.0] * plan.world_size
    if plan.mixed:
        return _mixed_costs(plan, cost, loads)
    slices = plan.extra.get("slices", {})
    for r, idxs in enumerate(plan.rank_params):
        for i in idxs:
            if i not in slices:
                out[r] += loads[i]
    for i, parts in slices.items():
        for r, n in parts:
            out[r] += slice_cost(plan.specs[i], cost, loads[i], n)
    return out


def _mixed_costs(plan: OwnershipPlan, cost: str, loads: Sequence[float]) -> list[float]:
    """Mixed layout (planning/mixed.py): a rank computes its owned matrices and the hosted ones
    it hosts (FLOPs and rule state there, but for a hosted matrix's element-wise state, which
    stays with its pieces); it holds the fp32 master weight and gradient of its range, whatever
    matrices that range cuts, and the element-wise state of the hosted pieces in it
    (``memory``); ``numel`` = its range's elements."""
    from .cost import MASTER_GRAD_BYTES

    out = [0.0] * plan.world_size
    if cost == "numel":
        return [float(n) for n in plan.rank_numel]
    eb = plan.extra.get("elementwise_bytes", 0.0)
    for i, h in enumerate(plan.host):
        if cost == "memory":  # the host keeps the state but a hosted matrix's element-wise part
            out[h] += loads[i] - plan.specs[i].numel * (MASTER_GRAD_BYTES + (eb if plan.owner[i] < 0 else 0.0))
        else:
            out[h] += loads[i]
    if cost == "memory":
        hosted = plan.extra.get("rank_hosted_numel", [0] * plan.world_size)
        out = [x + n * MASTER_GRAD_BYTES + m * eb for x, n, m in zip(out, plan.rank_numel, hosted)]
    return out


def _ratio(values: Sequence[float], useful_total: float) -> float:
    mean = useful_total / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _bound(loads: Sequence[float], ranks: int) -> float:
    total = sum(loads)
    return max(1.0, max(loads) * ranks / total) if total > 0 else 1.0


@dataclass(frozen=True)
class DPReport:
    planner: str
    world_size: int
    #: max/avg of the optimizer's amortised FLOPs per rank
    flops_ratio: float
    #: max/avg of the optimizer's peak-step FLOPs per rank (refresh steps of Shampoo/SOAP)
    peak_flops_ratio: float
    #: max/avg of optimizer-state bytes per rank
    memory_ratio: float
    #: max/avg of elements per rank (= 1 + padding fraction for atomic plans)
    numel_ratio: float
    flops_lower_bound: float
    memory_lower_bound: float
    #: largest matrix * dp / S: no atomic plan has numel_ratio (1 + padding) below it
    numel_lower_bound: float
    #: eq. 2 in the plan's cost model units
    j_dp: float
    #: eq. 3 in elements
    j_comm: float
    padding_fraction: float
    split_matrices: int
    plan_ms: float
    fingerprint: str

    def as_dict(self) -> dict:
        return asdict(self)


def dp_report(plan: OwnershipPlan, model) -> DPReport:
    """Balance of ``plan`` under the optimizer's cost ``model`` (e.g. optim.cost_model("muon"))."""
    flops = rank_costs(plan, "flops", model)
    peak = rank_costs(plan, "peak_flops", model)
    memory = rank_costs(plan, "memory", model)
    flops_each = cost_vector(plan.specs, "flops", model)
    peak_each = cost_vector(plan.specs, "peak_flops", model)
    memory_each = cost_vector(plan.specs, "memory", model)
    loads = rank_costs(plan, plan.cost_model, model)
    mu = sum(cost_vector(plan.specs, plan.cost_model, model)) / plan.world_size
    if "bucket_rank_numel" in plan.extra:
        buckets = plan.extra["bucket_rank_numel"]
    else:
        buckets = [list(plan.rank_numel)]
    j_comm = sum(abs(s - sum(row) / plan.world_size) for row in buckets for s in row)
    return DPReport(
        planner=plan.planner,
        world_size=plan.world_size,
        flops_ratio=_ratio(flops, sum(flops_each)),
        peak_flops_ratio=_ratio(peak, sum(peak_each)),
        memory_ratio=_ratio(memory, sum(memory_each)),
        numel_ratio=_ratio(plan.rank_numel, plan.total_numel),
        flops_lower_bound=_bound(flops_each, plan.world_size),
        memory_lower_bound=_bound(memory_each, plan.world_size),
        numel_lower_bound=_bound([float(sp.numel) for sp in plan.specs], plan.world_size),
        j_dp=max(abs(x - mu) for x in loads),
        j_comm=j_comm,
        padding_fraction=plan.padding_fraction,
        split_matrices=len(plan.split_params),
        plan_ms=plan.plan_ms,
        fingerprint=plan.fingerprint(),
    )


@dataclass(frozen=True)
class TPReport:
    scheduler: str
    tp_size: int
    #: max/avg over TP ranks of the full-matrix FLOPs each hosts (whole schedule)
    flops_ratio: float
    #: max/avg over TP ranks of the full-matrix bytes each hosts
    memory_ratio: float
    flops_lower_bound: float
    #: sum over micro-groups of the group's busiest host (FLOPs), / (total / tp): the
    #: step time of groups run one after another, relative to perfect balance
    serial_ratio: float
    micro_groups: int
    tasks: int
    plan_ms: float
    fingerprint: str

    def as_dict(self) -> dict:
        return asdict(self)


def tp_report(plan: MicroGroupPlan, model) -> TPReport:
    flops_each = cost_vector(plan.specs, "flops", model, hosted=True)
    memory_each = cost_vector(plan.specs, "memory", model, hosted=True)
    flops = [0.0] * plan.tp_size
    memory = [0.0] * plan.tp_size
    serial = 0.0
    for g in plan.groups:
        group_flops = [0.0] * plan.tp_size
        for i, r in g.tasks:
            flops[r] += flops_each[i]
            memory[r] += memory_each[i]
            group_flops[r] += flops_each[i]
        serial += max(group_flops)
    total = sum(flops_each)
    return TPReport(
        scheduler=plan.scheduler,
        tp_size=plan.tp_size,
        flops_ratio=_ratio(flops, total),
        memory_ratio=_ratio(memory, sum(memory_each)),
        flops_lower_bound=_bound(flops_each, plan.tp_size),
        serial_ratio=serial * plan.tp_size / total if total > 0 else 1.0,
        micro_groups=len(plan.groups),
        tasks=len(plan.specs),
        plan_ms=plan.plan_ms,
        fingerprint=plan.fingerprint(),
    )


def _patterns(sizes: list[int], counts: list[int], capacity: float, limit: int) -> list[tuple[int, ...]] | None:
    """All count vectors a (a_t <= counts_t) with sum a_t*sizes_t <= capacity; None past limit."""
    out: list[tuple[int, ...]] = []

    def rec(t: int, room: float, prefix: tuple[int, ...]) -> bool:
        if t == len(sizes):
            out.append(prefix)
            return len(out) <= limit
        top = min(counts[t], int(room // sizes[t]) if sizes[t] else counts[t])
        return all(rec(t + 1, room - a * sizes[t], prefix + (a,)) for a in range(top, -1, -1))

    return out if rec(0, capacity, ()) else None


def numel_lp_bound(numels: Sequence[int], ranks: int, max_patterns: int = 20_000, tol: float = 1e-4) -> float | None:
    """Lower bound on ``numel_ratio`` (1 + padding) of ANY atomic plan, from the
    configuration LP of bin packing: a capacity C is infeasible if covering every matrix
    with per-rank patterns (multisets of sizes summing to <= C) needs more than ``ranks``
    patterns even fractionally.  Bisects C.  None when there are too many patterns (many
    matrices per rank: then the simple bound is the useful one) or scipy is missing.
    """
    try:
        from scipy.optimize import linprog
    except ImportError:
        return None
    if not numels or sum(numels) == 0:
        return None
    by_size: dict[int, int] = {}
    for n in numels:
        by_size[n] = by_size.get(n, 0) + 1
    sizes, counts = list(by_size), list(by_size.values())
    mean = sum(numels) / ranks

    def feasible(ratio: float) -> bool | None:
        pats = _patterns(sizes, counts, ratio * mean, max_patterns)
        if pats is None:
            return None
        pats = [p for p in pats if any(p)]
        a = [[-p[t] for p in pats] for t in range(len(sizes))]
        res = linprog([1.0] * len(pats), A_ub=a, b_ub=[-c for c in counts], bounds=(0, None), method="highs")
        return res.status == 0 and res.fun <= ranks + 1e-9

    lo = max(1.0, max(numels) / mean)
    hi = 1.0
    while True:  # grow hi until feasible (LPT's 4/3 guarantee bounds this quickly)
        hi = max(hi * 1.25, lo)
        f = feasible(hi)
        if f is None:
            return None
        if f:
            break
    if feasible(lo):
        return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        f = feasible(mid)
        if f is None:
            return None
        lo, hi = (lo, mid) if f else (mid, hi)
    return lo

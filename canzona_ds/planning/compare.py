"""Run every DP planner and TP scheduler on one model/parallel layout and collect reports.

What is planned (shared by ``canzona-plan`` and ``benchmarks/plan_sweep.py``):

    DP   the matrix ParamSpecs of ONE TP rank (TP-local shards; every TP rank has the
         same shapes, so one DP plan serves all of them), over ``dp`` ranks.
    TP   the TP-split matrices owned by the busiest DP rank (by FLOPs) of the default DP
         plan: under ZeRO-1 a DP rank only holds reduced gradients of what it owns, so
         these are the tasks its TP group reassembles and schedules (the setting of the
         paper's Figure 3b).  ``tp_whole_model`` also reports scheduling every TP-split
         matrix of the model in one TP group (the DP=1 case).
    experts  for a mixture-of-experts model, ``expert_stacks``: the default DP planner with
         every stack whole (one unit of ownership, as the ZeRO-1/2 layout keeps it) and with
         each expert a unit of its own (``per_expert``, planned by ``lpt``: what splitting
         stacks across owners could reach), each with its FLOPs and memory max/avg.  ``ep`` is the
         expert-parallel size (``compare(ep=...)``, ``canzona-plan --ep``): with ``ep`` > 1 the plan
         is DeepSpeed MoE's (:func:`plan_expert_parallel`): each expert-parallel rank holds E/ep
         experts of every stack, planned over its expert-data-parallel group (dp/ep ranks), the
         dense matrices over all dp ranks, and a DP rank's load is its dense share plus its
         expert share.  ``joint`` (ep > 1, PLANNER ONLY: the runtime does not plan this way) plans
         the two partitions with each other's per-rank loads as seeds (:func:`_joint_plans`).
         ``per_expert_mixed`` (ep > 1): the runtime's plans with ``layout: "mixed"`` forced (each
         partition in the mixed layout, its hosted matrices over its own DP group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .dp import DEFAULT_DP_PLANNER, DEFAULT_BUCKET_NUMEL, DP_PLANNERS, OwnershipPlan, plan_dp, plan_mixed_dp
from .models import matrix_specs, model_shape, model_specs
from .params import split_experts
from .cost import cost_vector
from .report import dp_report, rank_costs, tp_report
from .tp import DEFAULT_TP_SCHEDULER, TP_SCHEDULERS, plan_tp


@dataclass
class Comparison:
    """Reports of all planners/schedulers for one (model, dp, tp) plus the plans."""

    summary: dict
    dp_plans: dict[str, OwnershipPlan] = field(default_factory=dict)
    tp_plans: dict = field(default_factory=dict)


def compare(
    model: str | Path,
    dp: int,
    tp: int = 1,
    cost_model=None,
    alpha: float = 1.0,
    cost: str = "numel",
    c_max: float | None = None,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    dp_planner: str = DEFAULT_DP_PLANNER,
    tp_scheduler: str = DEFAULT_TP_SCHEDULER,
    ep: int = 1,
) -> Comparison:
    if dp_planner not in DP_PLANNERS:
        raise ValueError(f"Unknown DP planner={dp_planner!r}. Allowed: {sorted(DP_PLANNERS)}")
    if tp_scheduler not in TP_SCHEDULERS:
        raise ValueError(f"Unknown TP scheduler={tp_scheduler!r}. Allowed: {sorted(TP_SCHEDULERS)}")
    if cost_model is None:
        raise ValueError("compare() needs the optimizer's cost model, e.g. canzona_ds.optim.cost_model('muon').")
    optimizer = cost_model.name
    specs = model_specs(model, tp=tp)
    mats = matrix_specs(specs)
    check_ep(ep, dp, mats)
    summary: dict = {
        "model": model_shape(model).name,
        "dp": dp,
        "tp": tp,
        "optimizer": optimizer,
        "optimizer_config": cost_model.describe() if hasattr(cost_model, "describe") else {"rule": optimizer},
        "cost": cost,
        "alpha": alpha,
        "matrices": len(mats),
        "matrix_numel": sum(s.numel for s in mats),
        "dp_planners": {},
        "tp_schedulers": {},
        "tp_whole_model": {},
        "tp_scope": "busiest_dp_rank",
        "default_dp_planner": dp_planner,
        "default_tp_scheduler": tp_scheduler,
    }
    out = Comparison(summary)
    if not mats:
        summary["note"] = "model has no matrix parameters: nothing for a matrix optimizer to plan"
        return out
    for name in DP_PLANNERS:
        plan = plan_dp(mats, dp, planner=name, alpha=alpha, cost=cost, model=cost_model, bucket_numel=bucket_numel)
        out.dp_plans[name] = plan
        summary["dp_planners"][name] = dp_report(plan, cost_model).as_dict()
    summary["layout"] = _layout_summary(mats, dp, dp_planner, alpha, cost, cost_model, bucket_numel)
    default = out.dp_plans[dp_planner]
    stacks = [s for s in mats if s.num_experts is not None]
    if stacks:
        summary["expert_stacks"] = _expert_stacks(default, mats, stacks, dp, dp_planner, cost, cost_model, ep)
    flops = rank_costs(default, "flops", cost_model)
    busiest = max(range(dp), key=lambda r: (flops[r], -r))
    owned = [mats[i] for i in default.rank_params[busiest] if mats[i].is_tp_split]
    split = [s for s in mats if s.is_tp_split]
    summary["tp_busiest_dp_rank"] = busiest
    if tp == 1 or not owned:
        summary["tp_note"] = "no TP-split matrices to schedule (tp=1 or the busiest DP rank owns none)"
        return out
    for name in TP_SCHEDULERS:
        plan = plan_tp(owned, tp, scheduler=name, c_max=c_max, cost=cost, model=cost_model)
        out.tp_plans[name] = plan
        summary["tp_schedulers"][name] = tp_report(plan, cost_model).as_dict()
        whole = plan_tp(split, tp, scheduler=name, c_max=c_max, cost=cost, model=cost_model)
        summary["tp_whole_model"][name] = tp_report(whole, cost_model).as_dict()
    return out


def _layout_summary(mats, dp, planner, alpha, cost, cost_model, bucket_numel) -> dict:
    """The ZeRO-1/2 layouts side by side (planning/mixed.py): the owned layout of ``planner``
    and the mixed one, their padding, balance and per-step bytes, and what ``layout: "auto"``
    picks (``choose_layout``; at TP > 1 the plan of the TP-local shapes, which every TP rank's
    buffer follows: a hosted TP-split matrix is updated over the DP x TP grid, its bytes per
    rank those of its TP-local pieces)."""
    from .cost import cost_vector
    from .dp import DEFAULT_MAX_PADDING, choose_layout, owned_step_bytes, plan_mixed_dp

    chosen, atomic, why = choose_layout(mats, dp, planner=planner, alpha=alpha, cost=cost, model=cost_model,
                                        bucket_numel=bucket_numel)
    mixed = chosen if chosen.mixed else plan_mixed_dp(mats, dp, cost_vector(mats, cost, cost_model), cost, cost_model)
    out = {"auto": chosen.planner if chosen.mixed else "owned", "why": why, "max_padding": DEFAULT_MAX_PADDING}
    for key, plan, sb in (("owned", atomic, owned_step_bytes(atomic)), ("mixed", mixed, mixed.extra["step_bytes"])):
        r = dp_report(plan, cost_model)
        out[key] = {"padding_fraction": r.padding_fraction, "flops_ratio": r.flops_ratio,
                    "memory_ratio": r.memory_ratio, "hosted_matrices": len(plan.hosted),
                    "hosted_numel": plan.extra.get("hosted_numel", 0), "all_gather_bytes": sb["all_gather"],
                    "hosted_sent_max": sb["hosted_sent_max"], "hosted_collectives": sb["hosted_collectives"],
                    "rank_cost": sb["rank_cost"]}
    return out


#: the planner of the per-expert comparison
PER_EXPERT_PLANNER = "lpt"


def check_ep(ep: int, dp: int, mats) -> None:
    """ValueError unless ``ep`` (expert-parallel size) divides ``dp`` and every stack's experts."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"Invalid ep={ep!r}: the expert-parallel size must be an int >= 1.")
    if ep == 1:
        return
    experts = sorted({s.num_experts for s in mats if s.num_experts is not None})
    if not experts:
        raise ValueError(f"Invalid ep={ep}: the model has no expert stacks (ep must be 1).")
    if dp % ep:
        raise ValueError(f"Invalid ep={ep}: it must divide dp={dp} (expert-data-parallel group of dp/ep ranks).")
    bad = [e for e in experts if e % ep]
    if bad:
        raise ValueError(f"Invalid ep={ep}: it must divide the number of experts {bad[0]} "
                         f"(each expert-parallel rank holds E/ep experts of every stack).")


def local_experts(mats, ep: int, per_expert: bool) -> list:
    """The expert matrices of ONE expert-parallel rank (every rank holds the same shapes): each
    stack's E/ep experts as separate 2-D matrices (``per_expert``, DeepSpeed MoE's separate
    parameters) or as one stack of E/ep (an HF-style stack sharded by expert parallelism)."""
    from .params import ParamSpec

    out = []
    for s in mats:
        if s.num_experts is None:
            continue
        n = s.num_experts // ep
        if per_expert:
            out += [ParamSpec(f"{s.name}[{e}]", tuple(s.shape[1:]), "matrix", s.dtype_bytes) for e in range(n)]
        else:
            out.append(ParamSpec(s.name, (n,) + tuple(s.shape[1:]), "matrix", s.dtype_bytes, num_experts=n))
    return out


#: rounds of :func:`plan_expert_parallel`'s ``joint`` variant (each: experts seeded by the dense
#: loads, then dense seeded by the expert loads; the best round is kept)
JOINT_ROUNDS = 4


def _joint_plans(dense, experts, dp: int, ep: int, cost: str, cost_model) -> dict:
    """PLANNER ONLY (the runtime plans each partition on its own): LPT plans of the dense matrices
    over dp ranks and of one EP rank's experts over dp/ep expert-DP ranks, each seeded with the
    load the other partition puts on its ranks.  An expert-DP rank k is shared by DP ranks
    k*ep .. k*ep+ep-1 (one plan serves every EP rank), so its seed is the largest dense load
    among them; a DP rank's dense seed is its expert-DP rank's expert load.  Starts from the
    unseeded dense plan; keeps the round with the lowest busiest-rank load."""
    from .dp import plan_lpt

    d_loads = cost_vector(dense, cost=cost, model=cost_model) if dense else []
    e_loads = cost_vector(experts, cost=cost, model=cost_model) if experts else []
    edp = dp // ep
    best, best_max = None, None
    d_plan = plan_lpt(dense, dp, d_loads, cost) if dense else None
    for _ in range(JOINT_ROUNDS):
        d_rank = d_plan.rank_load if d_plan is not None else [0.0] * dp
        seed_e = [max(d_rank[k * ep:(k + 1) * ep]) for k in range(edp)]
        e_plan = plan_lpt(experts, edp, e_loads, cost, initial=seed_e) if experts else None
        e_rank = e_plan.rank_load if e_plan is not None else [0.0] * edp
        if dense:
            d_plan = plan_lpt(dense, dp, d_loads, cost, initial=[e_rank[r // ep] for r in range(dp)])
        d_rank = d_plan.rank_load if d_plan is not None else [0.0] * dp
        busiest = max(d_rank[r] + e_rank[r // ep] for r in range(dp))
        if best_max is None or busiest < best_max:
            best, best_max = {k: v for k, v in (("dense", d_plan), ("experts", e_plan)) if v is not None}, busiest
    return best


def plan_expert_parallel(mats, dp: int, ep: int, planner: str, cost: str, cost_model, per_expert: bool,
                         joint: bool = False, mixed: bool = False) -> dict:
    """DeepSpeed MoE's plan at expert-parallel size ``ep``: the dense matrices planned over all
    ``dp`` ranks, one expert-parallel rank's experts (:func:`local_experts`) over its
    expert-data-parallel group of dp/ep ranks (every EP rank alike: one plan serves all).  DP rank
    r is expert-parallel rank r % ep and expert-DP rank r // ep (DeepSpeed's groups: ranks
    {0..ep-1} hold different experts), so its load is ``dense[r] + experts[r // ep]``.  Ratios are
    max over the dp ranks / (useful total / dp); padding = (dense buffer + ep expert buffers) /
    useful elements - 1; ``flops_lower_bound``: the largest unit over the mean rank.
    ``joint``: PLANNER ONLY, not what the runtime does: the two partitions planned with each
    other's loads as seeds (:func:`_joint_plans`, LPT on ``cost``; ``planner`` is not used).
    ``mixed``: each partition in the mixed layout (``layout: "mixed"``: planning/mixed.py, what the
    runtime plans per matrix group when it is forced; ``planner`` is not used)."""
    check_ep(ep, dp, mats)
    dense = [s for s in mats if s.num_experts is None]
    experts = local_experts(mats, ep, per_expert)
    plans = {}
    if joint:
        plans = _joint_plans(dense, experts, dp, ep, cost, cost_model)
    for key, specs, world in (("dense", dense, dp), ("experts", experts, dp // ep)):
        if specs and mixed:
            plans[key] = plan_mixed_dp(specs, world, cost_vector(specs, cost, cost_model), cost, cost_model)
        elif specs and not joint:
            # the runtime relabels ranks so that rank 0 owns a matrix (optimizer.py _plan)
            plans[key] = plan_dp(specs, world, planner=planner, cost=cost, model=cost_model).nonempty_first()
    out: dict = {"ep": ep, "expert_dp": dp // ep, "units": {"dense": len(dense), "experts_per_ep_rank": len(experts)}}
    held = useful = 0.0
    for key, plan in plans.items():
        n = float(plan.total_numel) * (ep if key == "experts" else 1)
        useful += n
        held += n * (1.0 + plan.padding_fraction)
    out["padding_fraction"] = held / useful - 1.0 if useful else 0.0
    for metric in ("flops", "memory"):
        part = {k: rank_costs(p, metric, cost_model) for k, p in plans.items()}
        each = {k: cost_vector(p.specs, metric, cost_model) for k, p in plans.items()}
        loads = [part["dense"][r] if "dense" in part else 0.0 for r in range(dp)]
        if "experts" in part:
            loads = [x + part["experts"][r // ep] for r, x in enumerate(loads)]
        total = sum(each.get("dense", [])) + ep * sum(each.get("experts", []))
        mean = total / dp
        out[f"{metric}_ratio"] = max(loads) / mean if mean > 0 else 1.0
        out[f"rank_{metric}"] = loads
        if metric == "flops":
            largest = max(max(v) for v in each.values() if v)
            out["flops_lower_bound"] = max(1.0, largest / mean) if mean > 0 else 1.0
    return out


def _expert_stacks(whole: OwnershipPlan, mats, stacks, dp: int, planner: str, cost: str, cost_model,
                   ep: int = 1) -> dict:
    """Stacks kept whole against each expert a unit of its own.  ep=1: one plan over the DP group
    (``whole`` is what the ZeRO-1/2 layout realises for HF stacks); ep > 1: DeepSpeed MoE's plans
    (:func:`plan_expert_parallel`), ``per_expert`` being what the runtime realises (its experts
    are separate matrices, planned by the default planner, owned layout) and ``whole`` an
    HF-style stack of E/ep per expert-parallel rank."""
    keys = ("flops_ratio", "memory_ratio", "flops_lower_bound", "padding_fraction")
    head = {"stacks": len(stacks), "experts_per_stack": sorted({s.num_experts for s in stacks}),
            "largest_stack_numel": max(s.numel for s in stacks), "ep": ep, "expert_dp": dp // ep,
            "planner": planner, "per_expert_planner": PER_EXPERT_PLANNER if ep == 1 else planner}
    if ep > 1:  # a few hundred experts per EP rank: the runtime's planner is quick
        w = plan_expert_parallel(mats, dp, ep, planner, cost, cost_model, per_expert=False)
        x = plan_expert_parallel(mats, dp, ep, planner, cost, cost_model, per_expert=True)
        j = plan_expert_parallel(mats, dp, ep, planner, cost, cost_model, per_expert=True, joint=True)
        m = plan_expert_parallel(mats, dp, ep, planner, cost, cost_model, per_expert=True, mixed=True)
        # "joint": PLANNER ONLY (the runtime plans the dense and expert partitions on their own);
        # "per_expert_mixed": the runtime's plans with layout "mixed" forced (each group hosts over its own DP group)
        return {**head, "whole": {k: w[k] for k in keys}, "per_expert": {k: x[k] for k in keys},
                "per_expert_mixed": {k: m[k] for k in keys},
                "joint": {**{k: j[k] for k in keys}, "planner_only": True, "planner": "lpt, seeded"}}
    # lpt: thousands of experts make multi_lpt slow (minutes at 12k units), and lpt already
    # balances them to within a percent
    split = plan_dp(split_experts(mats), dp, planner=PER_EXPERT_PLANNER, cost=cost, model=cost_model)

    def ratios(plan: OwnershipPlan) -> dict:
        r = dp_report(plan, cost_model).as_dict()
        return {k: r[k] for k in keys}

    return {**head, "whole": ratios(whole), "per_expert": ratios(split)}

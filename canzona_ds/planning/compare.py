"""Run every DP planner and TP scheduler on one model/parallel layout and collect reports.

What is planned (shared by ``canzona-plan`` and ``benchmarks/plan_sweep.py``):

    DP   the matrix ParamSpecs of ONE TP rank (TP-local shards; every TP rank has the
         same shapes, so one DP plan serves all of them), over ``dp`` ranks.
    TP   the TP-split matrices owned by the busiest DP rank (by FLOPs) of the default DP
         plan: under ZeRO-1 a DP rank only holds reduced gradients of what it owns, so
         these are the tasks its TP group reassembles and schedules (the setting of the
         paper's Figure 3b).  ``tp_whole_model`` also reports scheduling every TP-split
         matrix of the model in one TP group (the DP=1 case).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .dp import DEFAULT_DP_PLANNER, DEFAULT_BUCKET_NUMEL, DP_PLANNERS, OwnershipPlan, plan_dp
from .models import matrix_specs, model_shape, model_specs
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
    picks (``choose_layout``: the runtime refuses to host TP-split matrices over DP, so at
    TP > 1 this is the plan of the TP-local shapes)."""
    from .cost import cost_vector
    from .dp import DEFAULT_MAX_PADDING, choose_layout, owned_step_bytes, plan_mixed_dp

    chosen, atomic, why = choose_layout(mats, dp, planner=planner, alpha=alpha, cost=cost, model=cost_model,
                                        bucket_numel=bucket_numel)
    mixed = chosen if chosen.mixed else plan_mixed_dp(mats, dp, cost_vector(mats, cost, cost_model), cost, cost_model)
    out = {"auto": chosen.planner if chosen.mixed else "owned", "why": why, "max_padding": DEFAULT_MAX_PADDING}
    if chosen.mixed and any(s.is_tp_split for s in mats):
        out["runtime_note"] = ("the runtime does not host TP-split matrices over DP yet: at this TP size layout "
                               "\"auto\" runs owned (docs/zero.md, Limits)")
    for key, plan, sb in (("owned", atomic, owned_step_bytes(atomic)), ("mixed", mixed, mixed.extra["step_bytes"])):
        r = dp_report(plan, cost_model)
        out[key] = {"padding_fraction": r.padding_fraction, "flops_ratio": r.flops_ratio,
                    "memory_ratio": r.memory_ratio, "hosted_matrices": len(plan.hosted),
                    "hosted_numel": plan.extra.get("hosted_numel", 0), "all_gather_bytes": sb["all_gather"],
                    "hosted_sent_max": sb["hosted_sent_max"], "hosted_collectives": sb["hosted_collectives"],
                    "rank_cost": sb["rank_cost"]}
    return out

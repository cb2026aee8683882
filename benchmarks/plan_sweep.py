"""Sweep the DP planners and TP schedulers over Qwen3 0.6B..32B x DP x TP.

    python benchmarks/plan_sweep.py                 # writes benchmarks/results/plan_sweep.{md,json}
    python benchmarks/plan_sweep.py --optimizer shampoo --out /tmp/sweep

Pure planning (no processes, no GPU): every number is a property of the plans.  Costs come
from the rule's cost model (``canzona_ds.optim.cost_model(name)``, default
hyper-parameters); a TP-split matrix weighs its DP owner's share of the full matrix and
its TP host the full matrix (``planning/cost.py``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from canzona_ds.optim import cost_model
from canzona_ds.planning.compare import compare
from canzona_ds.planning.cost import CostModel
from canzona_ds.planning.dp import DEFAULT_BUCKET_NUMEL, DEFAULT_DP_PLANNER, plan_dp
from canzona_ds.planning.models import matrix_specs, model_specs
from canzona_ds.planning.report import numel_lp_bound, rank_costs
from canzona_ds.planning.tp import DEFAULT_TP_SCHEDULER

MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
DPS = (8, 16, 32, 64, 128)
TPS = (1, 2, 4, 8)
RESULTS = Path(__file__).resolve().parent / "results"
#: DP planners in the sweep table's column order (the last column is the default planner)
SWEEP_PLANNERS = ("equal_chunk", "paper_naive", "naive_atomic", "alpha_balanced", "layerwise", "lpt", DEFAULT_DP_PLANNER)


def flops_makespan(model: str, dp: int, tp: int, planner: str, cost: str, rule: CostModel) -> float:
    plan = plan_dp(matrix_specs(model_specs(model, tp)), dp, planner=planner, cost=cost, model=rule)
    return max(rank_costs(plan, "flops", rule))


def plan_time_ms(model: str, dp: int, tp: int, rule: CostModel, repeats: int = 5) -> float:
    """Median wall time of building specs + the default DP plan (what a rank does at init)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan_dp(matrix_specs(model_specs(model, tp)), dp, cost="flops", model=rule)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sweep(optimizer: str) -> dict:
    rule = cost_model(optimizer)
    rows = []
    for model in MODELS:
        for tp in TPS:
            for dp in DPS:
                s = compare(model, dp, tp, cost_model=rule, cost="flops").summary
                row = {"model": model, "dp": dp, "tp": tp, "matrices": s["matrices"]}
                for name, r in s["dp_planners"].items():
                    row[f"dp.{name}"] = {k: r[k] for k in ("flops_ratio", "peak_flops_ratio", "memory_ratio", "numel_ratio",
                                                           "padding_fraction", "split_matrices", "plan_ms")}
                any_r = next(iter(s["dp_planners"].values()))
                row["dp.bound"] = {k: any_r[k] for k in ("flops_lower_bound", "memory_lower_bound", "numel_lower_bound")}
                for name, r in s["tp_schedulers"].items():
                    row[f"tp.{name}"] = {k: r[k] for k in ("flops_ratio", "memory_ratio", "serial_ratio", "micro_groups", "flops_lower_bound")}
                for name, r in s["tp_whole_model"].items():
                    row[f"tpw.{name}"] = {k: r[k] for k in ("flops_ratio", "serial_ratio", "micro_groups")}
                rows.append(row)
    numel_vs_flops = []
    for model, dp, tp in (("qwen3-32b", 16, 8), ("qwen3-32b", 32, 8), ("qwen3-32b", 128, 1), ("qwen3-8b", 64, 4), ("qwen3-0.6b", 64, 1)):
        entry = {"model": model, "dp": dp, "tp": tp}
        for planner in ("alpha_balanced", "lpt", DEFAULT_DP_PLANNER):
            n = flops_makespan(model, dp, tp, planner, "numel", rule)
            f = flops_makespan(model, dp, tp, planner, "flops", rule)
            entry[planner] = {"numel_planned": n, "flops_planned": f, "ratio": n / f}
        numel_vs_flops.append(entry)
    timing = {f"qwen3-32b dp=128 tp={tp}": plan_time_ms("qwen3-32b", 128, tp, rule) for tp in (1, 8)}
    return {"optimizer": optimizer, "optimizer_config": rule.describe(), "default_dp_planner": DEFAULT_DP_PLANNER,
            "default_tp_scheduler": DEFAULT_TP_SCHEDULER, "bucket_numel": DEFAULT_BUCKET_NUMEL,
            "rows": rows, "numel_vs_flops": numel_vs_flops, "plan_time_ms": timing}


def targets(data: dict) -> list[str]:
    d = f"dp.{DEFAULT_DP_PLANNER}"
    t = f"tp.{DEFAULT_TP_SCHEDULER}"
    row = next(r for r in data["rows"] if (r["model"], r["dp"], r["tp"]) == ("qwen3-32b", 32, 8))
    out = []
    ok = row[d]["flops_ratio"] <= 1.05 and row[d]["memory_ratio"] <= 1.05
    out.append(f"- Qwen3-32B DP=32 TP=8, DP FLOPs <= 1.05 and memory <= 1.05: **{'met' if ok else 'NOT met'}** "
               f"({row[d]['flops_ratio']:.3f} / {row[d]['memory_ratio']:.3f}; paper's alpha-balanced 1.43 / 1.11 "
               f"and naive 3.24 / 2.46; here alpha_balanced {row['dp.alpha_balanced']['flops_ratio']:.3f} / "
               f"{row['dp.alpha_balanced']['memory_ratio']:.3f} and paper_naive {row['dp.paper_naive']['flops_ratio']:.3f} / "
               f"{row['dp.paper_naive']['memory_ratio']:.3f}, both over {data['bucket_numel']:,}-element buckets "
               "and planned on FLOPs)")
    tr = row[t]
    out.append(f"- Qwen3-32B DP=32 TP=8, TP FLOPs ratio <= 1.25 within the TP group of the busiest DP rank: "
               f"**{'met' if tr['flops_ratio'] <= 1.25 else 'NOT met'}** ({tr['flops_ratio']:.3f}; paper 2.46). "
               f"Impossible there: lower bound {tr['flops_lower_bound']:.3f} (largest full matrix vs the mean of the "
               f"{row['matrices'] // 32} matrices that rank owns over {row['tp']} hosts). Whole-model TP schedule: "
               f"{row['tpw.' + DEFAULT_TP_SCHEDULER]['flops_ratio']:.3f}.")
    worst = max((r for r in data["rows"] if r["dp"] <= 64), key=lambda r: r[d]["padding_fraction"])
    bad = [r for r in data["rows"] if r["dp"] <= 64 and r[d]["padding_fraction"] > 0.02]
    for r in bad:
        if "numel_lp_bound" not in r:
            r["numel_lp_bound"] = numel_lp_bound([s.numel for s in matrix_specs(model_specs(r["model"], r["tp"]))], r["dp"])
    proven = [r for r in bad if r["numel_lp_bound"] is not None and r["numel_lp_bound"] - 1 > 0.02]
    tradeoff = [r for r in bad if r not in proven]
    out.append(f"- Padding <= 2% for every Qwen3 size at DP <= 64: **{'met' if not bad else 'NOT met'}**: over 2% in "
               f"{len(bad)} of {sum(r['dp'] <= 64 for r in data['rows'])} configs (worst {worst['model']} dp={worst['dp']} "
               f"tp={worst['tp']}: {worst[d]['padding_fraction']:.2%}). {len(proven)} of them are impossible for ANY atomic "
               f"plan (configuration-LP lower bound on padding > 2%: "
               + ", ".join(f"{r['model']} dp={r['dp']} tp={r['tp']} {r[d]['padding_fraction']:.1%} >= {r['numel_lp_bound'] - 1:.1%}" for r in proven)
               + ("). " + (f"The other {len(tradeoff)} trade padding for FLOPs balance (the planner minimises max(FLOPs, numel) "
                          "ratio; bound, padding, FLOPs ratio): "
                          + ", ".join(f"{r['model']} dp={r['dp']} tp={r['tp']} LB {((r['numel_lp_bound'] or 1) - 1):.1%} "
                                      f"pad {r[d]['padding_fraction']:.1%} FLOPs {r[d]['flops_ratio']:.3f}" for r in tradeoff)
                          if tradeoff else "None trades padding for FLOPs balance (every config over 2% has an LP floor "
                          f"above 2%); {sum(r[d]['padding_fraction'] - (r['numel_lp_bound'] - 1) <= 1e-3 for r in proven)} "
                          f"of the {len(proven)} sit at that floor (within 0.1 points).")))
    ms = data["plan_time_ms"]
    out.append("- Planning Qwen3-32B at DP=128 in <= 100 ms: " + ", ".join(
        f"{k}: {v:.1f} ms ({'met' if v <= 100 else 'NOT met'})" for k, v in ms.items()))
    return out


def markdown(data: dict) -> str:
    d = DEFAULT_DP_PLANNER
    lines = [
        "# Planner sweep (generated by `python benchmarks/plan_sweep.py`)",
        "",
        f"Optimizer: {data['optimizer']}. Cost model: flops (`paper_naive` ignores it: eq. 1 places by position). "
        f"Bucketed planners (`paper_naive`, `alpha_balanced`): {data['bucket_numel']:,}-element buckets "
        f"(DeepSpeed's reduce_bucket_size). Default DP planner `{d}`, default TP scheduler "
        f"`{data['default_tp_scheduler']}`. DP plan over one TP rank's matrices, a TP-split matrix weighing its "
        "owner's share (1/tp) of the full matrix's FLOPs and state; TP schedule over the TP-split "
        "matrices of the busiest DP rank, each weighing the full matrix (its host runs all of it). "
        "Ratios are max/avg (paper eq. 6); `pad` = padding / matrix elements (DeepSpeed's 2-element range "
        "alignment, `planning/layout.py`); "
        "`LB` = lower bound (largest single matrix / average) that no atomic plan can beat.",
        "",
        "## Targets",
        "",
        *targets(data),
        "",
        "## numel- vs flops-planned FLOPs makespan (paper D.5)",
        "",
        "| model | dp | tp | planner | makespan numel-planned / flops-planned |",
        "|---|---|---|---|---|",
    ]
    for e in data["numel_vs_flops"]:
        for planner in ("alpha_balanced", "lpt", d):
            lines.append(f"| {e['model']} | {e['dp']} | {e['tp']} | {planner} | {e[planner]['ratio']:.4f} |")
    lines += ["", "## Sweep", "",
              "DP columns: FLOPs ratio / memory ratio (pad). TP columns: FLOPs ratio (groups).", "",
              "| model | tp | dp | " + " | ".join(SWEEP_PLANNERS[:-1] + (d,)) + " | DP LB flops/mem/numel | TP lpt_rollback | TP round_robin | TP LB | TP whole-model |",
              "|---|---|---|" + "---|" * len(SWEEP_PLANNERS) + "---|---|---|---|---|"]
    for r in data["rows"]:
        cells = []
        for name in SWEEP_PLANNERS[:-1] + (d,):
            x = r[f"dp.{name}"]
            extra = f", {x['split_matrices']} split" if x["split_matrices"] else ""
            cells.append(f"{x['flops_ratio']:.3f} / {x['memory_ratio']:.3f} ({x['padding_fraction']:.1%}{extra})")
        b = r["dp.bound"]
        cells.append(f"{b['flops_lower_bound']:.3f} / {b['memory_lower_bound']:.3f} / {b['numel_lower_bound']:.3f}")
        if "tp.lpt_rollback" in r:
            cells += [f"{r['tp.lpt_rollback']['flops_ratio']:.3f} ({r['tp.lpt_rollback']['micro_groups']})",
                      f"{r['tp.round_robin']['flops_ratio']:.3f}", f"{r['tp.lpt_rollback']['flops_lower_bound']:.3f}",
                      f"{r['tpw.lpt_rollback']['flops_ratio']:.3f}"]
        else:
            cells += ["-"] * 4
        lines.append(f"| {r['model']} | {r['tp']} | {r['dp']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    p.add_argument("--out", default=str(RESULTS / "plan_sweep"), help="path without extension")
    args = p.parse_args()
    data = sweep(args.optimizer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(data)  # adds the configuration-LP padding bounds of the configs over 2% to data["rows"]
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(md)
    print("\n".join(targets(data)))


if __name__ == "__main__":
    main()

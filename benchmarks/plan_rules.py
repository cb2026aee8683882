"""DP load balance of Shampoo and SOAP in the paper's Figure 12 setting (Qwen3-14B, DP=32, TP=4).

    python benchmarks/plan_rules.py            # writes benchmarks/results/plan_rules.{md,json}
    python benchmarks/plan_rules.py --out /tmp/rules

Pure planning (no processes, no GPU).  The DP plan covers the matrices of one TP rank
(TP-local shards); a TP-split matrix weighs its DP owner's share of the FULL matrix's
FLOPs and optimizer state (``planning/cost.py``), from the rule's own cost model
(``canzona_ds.optim.cost_model``):

    shampoo (full)      max_preconditioner_dim = 65536: no matrix is blocked, every factor
                        is the whole side (34816 x 34816 for an MLP fc1), cost ~ m^3 + n^3
    shampoo (blocked)   the default max_preconditioner_dim = 1024: every Qwen3-14B side is a
                        multiple of 1024, so every matrix is cut into 1024 x 1024 blocks and
                        its FLOPs, peak FLOPs and state are all proportional to its numel
    soap                the default max_precond_dim = 10000 (the fc1 side of 34816 is not rotated)
    soap (full)         max_precond_dim = 65536: both sides rotated

Planners, all given ``cost="flops"`` (amortised) and the rule as the cost model:
``equal_chunk`` (DeepSpeed's stock ZeRO-1 slicing; a cut matrix is updated in full on
every rank it touches), ``naive_atomic`` (the paper's unbalanced ASC), ``alpha_balanced``
(the paper's Algorithm 1, alpha = 1), ``multi_lpt`` (canzona-ds's default).

Lower bounds on max/mean that no atomic plan can beat: ``simple`` = largest matrix /
mean, and ``LP`` = the configuration-LP bound of bin packing (``report.numel_lp_bound``
applied to the cost): 40 fc1 matrices on 32 ranks force some rank to hold two, which the
simple bound misses.

The paper's Figure 12 is measured with PP=2 as well (each pipeline stage plans its own 20
layers); the second table is that view (stage 0, layers 0-19; stage 1 has the same
matrices).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from canzona_ds.optim import cost_model
from canzona_ds.planning.cost import CostModel, cost_vector
from canzona_ds.planning.dp import DEFAULT_DP_PLANNER, plan_dp
from canzona_ds.planning.models import matrix_specs, model_specs
from canzona_ds.planning.params import ParamSpec
from canzona_ds.planning.report import dp_report, numel_lp_bound

MODEL, DP, TP, PP = "qwen3-14b", 32, 4, 2
PLANNERS = ("equal_chunk", "paper_naive", "naive_atomic", "alpha_balanced", DEFAULT_DP_PLANNER)
RULES: dict[str, tuple[str, dict]] = {
    "shampoo (full)": ("shampoo", {"max_preconditioner_dim": 65536}),
    "shampoo (blocked)": ("shampoo", {}),
    "soap": ("soap", {}),
    "soap (full)": ("soap", {"max_precond_dim": 65536}),
}
#: paper §C.4 / Figure 12 (Shampoo/SOAP, Qwen3-14B, PP=2, DP=32, TP=4): FLOPs max/avg
PAPER = {"naive_flops_ratio": "> 2.0", "balanced_flops_ratio": "~ 1.05",
         "source": "Canzona §C.4 'Load Balance (Figure 12)': 'reducing the FLOPs load-balance ratio from > 2.0 "
                   "to ~ 1.05'"}
#: LP bound: most per-rank patterns to enumerate (the peak FLOPs of full Shampoo need ~1e5)
LP_PATTERNS = 200_000
RESULTS = Path(__file__).resolve().parent / "results"
REPEATS = 3


def stage_specs(specs: list[ParamSpec], stage: int, stages: int, layers: int) -> list[ParamSpec]:
    """The matrices of pipeline stage ``stage`` (Megatron's even split of the layers)."""
    per = layers // stages
    lo, hi = stage * per, (stage + 1) * per
    return [s for s in specs if lo <= int(s.name.split(".")[2]) < hi]


def bounds(specs: list[ParamSpec], rule: CostModel, dp: int) -> dict:
    out = {}
    for cost, key in (("flops", "flops"), ("peak_flops", "peak_flops"), ("memory", "memory")):
        loads = cost_vector(specs, cost, rule)
        mean = sum(loads) / dp
        out[f"{key}_simple"] = max(1.0, max(loads) / mean)
        out[f"{key}_lp"] = numel_lp_bound(loads, dp, max_patterns=LP_PATTERNS)
    return out


def evaluate(specs: list[ParamSpec], rule: CostModel, dp: int) -> dict:
    planners = {}
    for name in PLANNERS:
        times, plan = [], None
        for _ in range(REPEATS):
            plan = plan_dp(specs, dp, planner=name, cost="flops", model=rule)
            times.append(plan.plan_ms)
        r = dp_report(plan, rule)
        planners[name] = {"flops_ratio": r.flops_ratio, "peak_flops_ratio": r.peak_flops_ratio,
                          "memory_ratio": r.memory_ratio, "numel_ratio": r.numel_ratio,
                          "padding_fraction": r.padding_fraction, "split_matrices": r.split_matrices,
                          "plan_ms": statistics.median(times), "fingerprint": r.fingerprint}
    return {"config": rule.describe(), "matrices": len(specs), "lower_bound": bounds(specs, rule, dp),
            "planners": planners}


def run() -> dict:
    t0 = time.perf_counter()
    specs = matrix_specs(model_specs(MODEL, tp=TP))
    layers = 1 + max(int(s.name.split(".")[2]) for s in specs)
    stage0 = stage_specs(specs, 0, PP, layers)
    data: dict = {"model": MODEL, "dp": DP, "tp": TP, "cost": "flops", "default_dp_planner": DEFAULT_DP_PLANNER,
                  "paper": PAPER, "whole_model": {}, "pp_stage0": {}, "pp": PP}
    for label, (name, kw) in RULES.items():
        rule = cost_model(name, **kw)
        data["whole_model"][label] = evaluate(specs, rule, DP)
        data["pp_stage0"][label] = evaluate(stage0, rule, DP)
    data["wall_s"] = time.perf_counter() - t0
    return data


def _bound_cell(b: dict, key: str) -> str:
    lp = b[f"{key}_lp"]
    return f"{b[f'{key}_simple']:.3f} / {lp:.3f}" if lp is not None else f"{b[f'{key}_simple']:.3f} / -"


def table(section: dict) -> list[str]:
    lines = ["| rule | planner | FLOPs max/mean | peak FLOPs max/mean | memory max/mean | padding | plan ms |",
             "|---|---|---|---|---|---|---|"]
    for label, entry in section.items():
        for name, r in entry["planners"].items():
            split = f", {r['split_matrices']} split" if r["split_matrices"] else ""
            star = f"**{r['flops_ratio']:.3f}**" if name == DEFAULT_DP_PLANNER else f"{r['flops_ratio']:.3f}"
            lines.append(f"| {label} | {name} | {star} | {r['peak_flops_ratio']:.3f} | {r['memory_ratio']:.3f} | "
                         f"{r['padding_fraction']:.1%}{split} | {r['plan_ms']:.1f} |")
        b = entry["lower_bound"]
        lines.append(f"| {label} | lower bound (simple / LP) | {_bound_cell(b, 'flops')} | {_bound_cell(b, 'peak_flops')} "
                     f"| {_bound_cell(b, 'memory')} | | |")
    return lines


def markdown(data: dict) -> str:
    d = data["default_dp_planner"]
    whole, stage = data["whole_model"], data["pp_stage0"]
    sf, sb = whole["shampoo (full)"]["planners"], whole["shampoo (blocked)"]["planners"]
    so = whole["soap"]["planners"]
    lines = [
        "# Shampoo and SOAP: DP load balance in the paper's Figure 12 setting "
        "(generated by `python benchmarks/plan_rules.py`)",
        "",
        f"{data['model']}, DP={data['dp']}, TP={data['tp']}: the DP plan of one TP rank's "
        f"{whole['soap']['matrices']} matrices (TP-local shards, each weighing its owner's 1/{data['tp']} share of the "
        "full matrix's FLOPs and state). Every planner balances amortised FLOPs (`cost=\"flops\"`) with the rule as "
        "its cost model. Ratios are max/mean over the DP ranks (paper eq. 6); `peak` = the step that also refreshes "
        "the preconditioners (Shampoo's inverse roots, SOAP's eigenbases); memory = fp32 master + gradient + "
        "optimizer state; padding = the planned layout's padding / matrix elements. "
        "`equal_chunk` (DeepSpeed's stock ZeRO-1) cuts matrices and runs a cut matrix's whole step on every rank it "
        "touches. Lower bounds: simple = largest matrix / mean; LP = configuration-LP bound of bin packing "
        "(no atomic plan beats either; `-` = too many patterns to enumerate).",
        "",
        "## Paper vs ours",
        "",
        f"FLOPs max/mean, `PP=1 / PP={data['pp']}` (the paper's runs use PP={data['pp']}: each pipeline stage plans its "
        "own layers).",
        "",
        "| | paper (§C.4, Fig. 12) | " + " | ".join(f"ours: {k}" for k in RULES) + " |",
        "|---|---|" + "---|" * len(RULES),
        _paper_row("naive, the paper's eq. 1 over 5e8-element buckets (`paper_naive`)", data["paper"]["naive_flops_ratio"],
                   data, "paper_naive"),
        _paper_row("atomic, unbalanced (`naive_atomic`)", "-", data, "naive_atomic"),
        _paper_row("DeepSpeed stock ZeRO-1 (`equal_chunk`)", "-", data, "equal_chunk"),
        _paper_row(f"balanced (paper: its strategy; ours: `{d}`)", data["paper"]["balanced_flops_ratio"], data, d),
        _paper_row("lower bound (LP)", "-", data, None),
        "",
        _reading(data),
        "",
        f"## {data['model']}, DP={data['dp']}, TP={data['tp']} (all {whole['soap']['matrices']} matrices)",
        "",
        *table(whole),
        "",
        f"## The same with PP={data['pp']}: one pipeline stage ({stage['soap']['matrices']} matrices)",
        "",
        *table(stage),
        "",
        "Rules: " + "; ".join(f"`{k}` = {json.dumps(v['config'])}" for k, v in whole.items()) + ".",
        "",
        f"Benchmark wall time: {data['wall_s']:.1f} s (mostly the LP bounds); `plan ms` is the planner alone, "
        f"median of {REPEATS}.",
    ]
    return "\n".join(lines) + "\n"


def _lp(entry: dict) -> str:
    lp = entry["lower_bound"]["flops_lp"]
    return f"{lp:.3f}" if lp is not None else "-"


def _paper_row(title: str, paper: str, data: dict, planner: str | None) -> str:
    cells = []
    for label in RULES:
        pair = []
        for section in ("whole_model", "pp_stage0"):
            entry = data[section][label]
            pair.append(_lp(entry) if planner is None else f"{entry['planners'][planner]['flops_ratio']:.3f}")
        cells.append(" / ".join(pair))
    return f"| {title} | {paper} | " + " | ".join(cells) + " |"


def _reading(data: dict) -> str:
    d = data["default_dp_planner"]
    whole, stage = data["whole_model"], data["pp_stage0"]
    full = whole["shampoo (full)"]

    def span(section: dict, planner: str) -> str:
        values = [e["planners"][planner]["flops_ratio"] for e in section.values()]
        return f"{min(values):.2f}-{max(values):.2f}"

    def gap(section: dict) -> float:
        return max(e["planners"][d]["flops_ratio"] / e["lower_bound"]["flops_lp"] - 1
                   for e in section.values() if e["lower_bound"]["flops_lp"])

    return (
        f"Reading: the paper's eq. 1 naive assignment gives {span(stage, 'paper_naive')} at PP={data['pp']} and "
        f"{span(whole, 'paper_naive')} over the whole model (the paper: > 2.0). "
        f"DeepSpeed's stock slicing gives per "
        f"pipeline stage here ({span(stage, 'equal_chunk')} at PP={data['pp']}, {span(whole, 'equal_chunk')} "
        f"over the whole model), while the atomic but unbalanced `naive_atomic` gives {span(stage, 'naive_atomic')} "
        f"(PP={data['pp']}) and {span(whole, 'naive_atomic')} (PP=1). `{d}` is within {100 * gap(whole):.1f}% "
        f"(PP=1) and {100 * gap(stage):.1f}% (PP={data['pp']}) of the LP bound, i.e. of the best any atomic plan can "
        "do, for every rule. It reaches the paper's ~1.05 where the costs allow it (blocked Shampoo, default SOAP), "
        "not with full-matrix factors: a Qwen3-14B MLP fc1 (34816 x 5120) then costs so much more than the other "
        f"matrices that, at PP={data['pp']}, one fc1 alone is {stage['shampoo (full)']['lower_bound']['flops_simple']:.3f}x "
        f"a mean rank of full Shampoo, and at PP=1 its {full['matrices'] // 4} copies (one per layer) on "
        f"{data['dp']} ranks force two onto some rank: no plan gets below {full['lower_bound']['flops_lp']:.3f} (the "
        f"simple bound, {full['lower_bound']['flops_simple']:.3f}, misses this). Blocked Shampoo (the default "
        "max_preconditioner_dim = 1024) makes every cost proportional to numel: its FLOPs, peak and memory ratios "
        "coincide, and balancing elements balances everything. The paper does not state its Shampoo block size or "
        "how it counts FLOPs."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / "plan_rules"), help="path without extension")
    args = p.parse_args()
    data = run()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()

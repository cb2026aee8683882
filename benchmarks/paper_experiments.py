"""The Canzona paper's experiments, reproduced side by side with ours (pure planning).

    python benchmarks/paper_experiments.py     # -> benchmarks/results/paper_experiments.{json,md} + PNGs
    python benchmarks/paper_experiments.py --tflops 400 --gbps 150 --latency-us 30 --out /tmp/pe/paper_experiments

Every number here is a property of plans (no processes, no GPU), except the TP step times
of Figure 14, which come from a stated step-time model (below).  The JSON is the source
of every number: the markdown tables are rendered from it by ``benchmarks/tables.py`` (the
same functions keep README/docs tables in sync), and the PNG plots are drawn from it.

Sections (paper reference -> what we compute):

    fig3      Figure 3b/3c, Qwen3-32B DP=32 TP=8, Muon: FLOPs and memory R_LB (eq. 6) of the
              paper's naive atomic assignment (eq. 1, ``paper_naive``), Algorithm 1
              (``alpha_balanced``), our default (``multi_lpt``), the layer-wise baseline and
              the lower bounds; TP ratios in the TP group of the busiest DP rank.
    buckets   eq. 1 and Algorithm 1 depend on the bucket size, which the paper does not
              state: R_LB over bucket sizes (Megatron's default, DeepSpeed's, ...).
    fig13     alpha sweep 0 -> 1 of Algorithm 1: FLOPs R_LB and J_comm (eq. 3).
    fig14     C_max sweep of the TP micro-groups (No-Fuse -> one group): simulated step time.
    d5        §D.5 numel vs FLOPs as the planner's cost: planned FLOPs makespan.
    scaling   Figures 8/9: DP 8 -> 128, TP 1 -> 8, model 1.7B -> 32B: planned makespan and
              padding of the default, alpha_balanced, paper_naive, layerwise, equal_chunk.
    padding   the planned layout's padding (replicated bf16 buffer, all-gather) per GPU.

Step-time model of fig14 (``simulate_tp``; the idea of ``benchmarks/bench_tp.py``): per
micro-group k, gather G_k = (fp32 gradient bytes the busiest host receives) / B + L,
compute C_k[r] = (rule FLOPs host r runs, full matrices) / R, scatter S_k = (direction
bytes the busiest rank receives, the rule's direction dtype) / B + L; the runtime's issue
order (``tp/async_tasks.py``: pipelined or blocking) is replayed as a discrete-event
timeline in which collectives run one at a time on the link and start when every rank
has issued them.  R, B, L are ASSUMPTIONS (no GPU here), defaults: R = 400 TFLOP/s
(~40% of an H100 SXM's 989 TFLOP/s dense bf16 peak: Newton-Schulz runs in bf16), B =
150 GB/s received per GPU (an 8-GPU NVLink all-to-all; NVLink 4 peaks at 450 GB/s per
direction), L = 30 us per collective (NCCL launch + sync).  They are script arguments and
the sensitivity table varies L and B.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from canzona_ds.optim import cost_model  # noqa: E402
from canzona_ds.planning.compare import compare  # noqa: E402
from canzona_ds.planning.cost import CostModel, cost_vector  # noqa: E402
from canzona_ds.planning.dp import (  # noqa: E402
    DEFAULT_BUCKET_NUMEL, DEFAULT_DP_PLANNER, OwnershipPlan, make_buckets, megatron_bucket_numel, plan_dp,
)
from canzona_ds.planning.models import matrix_specs, model_specs, pipeline_stage  # noqa: E402
from canzona_ds.planning.params import ParamSpec  # noqa: E402
from canzona_ds.planning.report import dp_report, rank_costs, tp_report  # noqa: E402
from canzona_ds.planning.tp import plan_tp  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
QWEN3 = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
SWEEP_DPS = (8, 16, 32, 64, 128)
SWEEP_TPS = (1, 2, 4, 8)
ALPHAS = tuple(round(0.1 * k, 1) for k in range(11))
#: bucket sizes (elements) of the bucket-sensitivity sweep
BUCKET_SIZES = tuple(int(m * 1e6) for m in (20, 30, 40, 50, 60, 80, 100, 125, 150, 175, 200, 250, 300, 350, 400, 450,
                                            500, 600, 700, 800, 1000, 1250, 1500, 2000, 3000, 4000))
#: C_max candidates of fig14, as multiples of the largest task (1 = today's default, the
#: smallest valid value); "one group" = everything in one micro-group
C_MAX_MULTIPLES = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)
#: the planners of the scaling study: (label, planner, cost, bucket)
SCALING_PLANS = (
    ("default", DEFAULT_DP_PLANNER, "flops", None),
    ("alpha_balanced", "alpha_balanced", "numel", DEFAULT_BUCKET_NUMEL),
    ("paper_naive", "paper_naive", "numel", DEFAULT_BUCKET_NUMEL),
    ("layerwise", "layerwise", "flops", None),
    ("equal_chunk", "equal_chunk", "flops", None),
)

#: the paper's numbers we set ours beside (Canzona, Feb 2026)
PAPER: dict[str, Any] = {
    "fig3_dp": {"naive": {"flops_ratio": 3.24, "memory_ratio": 2.46},
                "alpha_balanced": {"flops_ratio": 1.43, "memory_ratio": 1.11},
                "setting": "Qwen3-32B, Muon, 256 GPUs = DP32 x TP8 (§5.2)",
                "source": "§5.2 'Effectiveness of Load Balancing Strategies (Figure 3)': DP naive FLOPs 3.24x, "
                          "memory 2.46x; alpha-Balanced 1.43x and 1.11x. Memory is the measured peak memory per "
                          "GPU, FLOPs the optimizer's per rank; W(p) = numel in its runs (§D.5)."},
    "fig3_tp": {"naive": {"flops_ratio": 3.24}, "micro_group": {"flops_ratio": 2.46, "memory_ratio": 1.16},
                "source": "§5.2: 'For Tensor Parallelism (Figure 3b), the naive baseline ... (FLOPs Ratio: 3.24x) "
                          "... we improve the FLOPs ratio to 2.46x and the Memory ratio to 1.16x'. The TP naive "
                          "3.24 and the TP 2.46 repeat the DP naive pair (3.24 / 2.46) digit for digit."},
    "fig13": {"setting": "Qwen3-32B, 128 GPUs = PP8 x DP16 (TP=1)",
              "finding": "Muon time falls monotonically as alpha goes 0 -> 1; Fwd-Bwd time stays flat; alpha = 1 "
                         "is best (§C.5)"},
    "fig14": {"setting": "Qwen3-32B, 128 GPUs = DP16 x TP8", "no_fuse_s": 0.11, "fused_s": 0.073,
              "finding": "optimizer time ~0.11 s without fusion, ~0.073 s fused; slight gains as C_max grows, "
                         "plateau from ~512 MB (1024-2048 MB flat) (§C.6)"},
    "d5": {"setting": "Qwen3-32B, DP16 x TP8", "flops_s": 0.0717, "numel_s": 0.0718,
           "finding": "optimizer step 0.0717 s with W = FLOPs vs 0.0718 s with W = numel (§D.5, Figure 16)"},
    "fig8": {"dp": "Qwen3-32B, TP=4, DP 16 -> 128: ASC's R_LB rises linearly, LB-ASC stays ~1.0",
             "tp": "Qwen3-32B, PP=4, DP=4, TP 2 -> 8: micro-groups keep the TP FLOPs ratio well below ASC's"},
    "fig9": {"setting": "DP=16, TP=4, Qwen3 1.7B -> 32B: ASC's DP R_LB grows with model size, LB-ASC flat"},
}
RATE_SOURCE = ("assumed, not measured: R = ~40% of an H100 SXM's 989 TFLOP/s dense bf16 peak (Newton-Schulz runs in "
               "bf16); B = per-GPU receive bandwidth of an 8-GPU NVLink all-to-all (NVLink 4: 450 GB/s per "
               "direction peak); L = NCCL launch + synchronisation per collective. The same defaults as "
               "benchmarks/bench_tp.py's simulation.")


# ----------------------------------------------------------------------------- helpers
def _specs(model: str, tp: int, pp: int = 1, stage: int = 0) -> list[ParamSpec]:
    specs = model_specs(model, tp=tp)
    if pp > 1:
        specs = pipeline_stage(specs, pp, stage)
    return matrix_specs(specs)


def _r(x: float, nd: int = 6) -> float:
    return round(float(x), nd)


def dp_entry(plan: OwnershipPlan, rule: CostModel, per_rank: bool = False) -> dict:
    """Balance, padding and communication numbers of one DP plan."""
    rep = dp_report(plan, rule)
    flops = rank_costs(plan, "flops", rule)
    total_numel = plan.total_numel
    out = {
        "planner": plan.planner, "cost": plan.cost_model, "flops_ratio": _r(rep.flops_ratio),
        "memory_ratio": _r(rep.memory_ratio), "numel_ratio": _r(rep.numel_ratio),
        "padding_fraction": _r(rep.padding_fraction), "split_matrices": rep.split_matrices,
        "j_comm_fraction": _r(rep.j_comm / total_numel), "makespan_tflop": _r(max(flops) / 1e12, 4),
        "empty_ranks": sum(1 for r in plan.rank_params if not r),
    }
    if "buckets" in plan.extra:
        out["buckets"] = len(plan.extra["buckets"])
    if not plan.split_params:
        layout = plan.nonempty_first().layout()
        out["padding_elements"] = layout.total_padding
    if per_rank:
        mem = rank_costs(plan, "memory", rule)
        fm, mm = sum(cost_vector(plan.specs, "flops", rule)) / plan.world_size, sum(
            cost_vector(plan.specs, "memory", rule)) / plan.world_size
        out["rank_flops"] = [_r(x / fm, 4) for x in flops]
        out["rank_memory"] = [_r(x / mm, 4) for x in mem]
    return out


def bounds(specs: Sequence[ParamSpec], dp: int, rule: CostModel) -> dict:
    def b(loads: list[float]) -> float:
        return _r(max(1.0, max(loads) * dp / sum(loads)))

    return {"flops": b(cost_vector(specs, "flops", rule)), "memory": b(cost_vector(specs, "memory", rule)),
            "numel": b([float(s.numel) for s in specs])}


# ----------------------------------------------------------------------------- figure 3
def fig3(rule: CostModel) -> dict:
    model, dp, tp = "qwen3-32b", 32, 8
    specs = _specs(model, tp)
    mega = megatron_bucket_numel(dp)
    plans = (
        ("paper_naive, DeepSpeed buckets", "paper_naive", "numel", DEFAULT_BUCKET_NUMEL),
        ("paper_naive, Megatron buckets", "paper_naive", "numel", mega),
        ("paper_naive, one bucket", "paper_naive", "numel", None),
        ("alpha_balanced (numel), DeepSpeed buckets", "alpha_balanced", "numel", DEFAULT_BUCKET_NUMEL),
        ("alpha_balanced (numel), Megatron buckets", "alpha_balanced", "numel", mega),
        ("alpha_balanced (flops), DeepSpeed buckets", "alpha_balanced", "flops", DEFAULT_BUCKET_NUMEL),
        (f"{DEFAULT_DP_PLANNER} (default)", DEFAULT_DP_PLANNER, "flops", None),
        ("layerwise", "layerwise", "flops", None),
        ("naive_atomic", "naive_atomic", "flops", None),
        ("equal_chunk (DeepSpeed stock)", "equal_chunk", "flops", None),
    )
    rows = []
    for label, planner, cost, bucket in plans:
        plan = plan_dp(specs, dp, planner=planner, cost=cost, model=rule, bucket_numel=bucket)
        rows.append({"label": label, "bucket_numel": bucket, **dp_entry(plan, rule, per_rank=True)})
    tp_views = {}
    for planner in (DEFAULT_DP_PLANNER, "paper_naive"):
        s = compare(model, dp, tp, cost_model=rule, cost="flops", dp_planner=planner).summary
        owned = next(iter(s["tp_schedulers"].values()))["tasks"] if s["tp_schedulers"] else 0
        tp_views[planner] = {
            "busiest_dp_rank": s["tp_busiest_dp_rank"], "matrices": owned,
            "schedulers": {n: {k: _r(r[k]) if isinstance(r[k], float) else r[k]
                               for k in ("flops_ratio", "memory_ratio", "serial_ratio", "micro_groups",
                                         "flops_lower_bound")} for n, r in s["tp_schedulers"].items()},
        }
        if planner == DEFAULT_DP_PLANNER:
            tp_views["whole_model"] = {n: {k: _r(r[k]) if isinstance(r[k], float) else r[k]
                                           for k in ("flops_ratio", "memory_ratio", "micro_groups")}
                                       for n, r in s["tp_whole_model"].items()}
    return {"model": model, "dp": dp, "tp": tp, "matrices": len(specs),
            "matrix_numel": sum(s.numel for s in specs), "megatron_bucket_numel": mega,
            "deepspeed_bucket_numel": DEFAULT_BUCKET_NUMEL, "plans": rows, "bounds": bounds(specs, dp, rule),
            "tp_views": tp_views}


def bucket_sweep(rule: CostModel) -> dict:
    model, dp, tp = "qwen3-32b", 32, 8
    specs = _specs(model, tp)
    total = sum(s.numel for s in specs)
    sizes = sorted(set(BUCKET_SIZES) | {megatron_bucket_numel(dp), DEFAULT_BUCKET_NUMEL})
    rows = []
    for b in sizes:
        row: dict = {"bucket_numel": b, "buckets": len(make_buckets(specs, b))}
        for key, planner, cost in (("paper_naive", "paper_naive", "numel"), ("alpha_numel", "alpha_balanced", "numel"),
                                   ("alpha_flops", "alpha_balanced", "flops")):
            r = dp_report(plan_dp(specs, dp, planner=planner, cost=cost, model=rule, bucket_numel=b), rule)
            row[key] = {"flops_ratio": _r(r.flops_ratio), "memory_ratio": _r(r.memory_ratio)}
        rows.append(row)
    near = [r for r in rows if abs(r["paper_naive"]["flops_ratio"] - PAPER["fig3_dp"]["naive"]["flops_ratio"]) <= 0.4]
    return {"model": model, "dp": dp, "tp": tp, "matrix_numel": total, "rows": rows,
            "megatron_bucket_numel": megatron_bucket_numel(dp), "deepspeed_bucket_numel": DEFAULT_BUCKET_NUMEL,
            "within_0.4_of_paper_naive": [r["bucket_numel"] for r in near]}


# ----------------------------------------------------------------------------- figure 13
def fig13(rule: CostModel) -> dict:
    settings = []
    for label, model, dp, tp, pp, bucket in (
        ("paper's: Qwen3-32B PP=8 (stage 0) DP=16 TP=1, Megatron buckets", "qwen3-32b", 16, 1, 8,
         megatron_bucket_numel(16)),
        ("paper's: Qwen3-32B PP=8 (stage 0) DP=16 TP=1, DeepSpeed buckets", "qwen3-32b", 16, 1, 8, DEFAULT_BUCKET_NUMEL),
        ("Qwen3-32B DP=32 TP=8, DeepSpeed buckets", "qwen3-32b", 32, 8, 1, DEFAULT_BUCKET_NUMEL),
    ):
        specs = _specs(model, tp, pp)
        for cost in ("numel", "flops"):
            rows = []
            for a in ALPHAS:
                plan = plan_dp(specs, dp, planner="alpha_balanced", alpha=a, cost=cost, model=rule, bucket_numel=bucket)
                rep = dp_report(plan, rule)
                mu = sum(cost_vector(specs, cost, rule)) / dp
                rows.append({"alpha": a, "flops_ratio": _r(rep.flops_ratio), "memory_ratio": _r(rep.memory_ratio),
                             "numel_ratio": _r(rep.numel_ratio), "j_dp_rel": _r(rep.j_dp / mu),
                             "j_comm_fraction": _r(rep.j_comm / plan.total_numel)})
            settings.append({"label": label, "model": model, "dp": dp, "tp": tp, "pp": pp, "bucket_numel": bucket,
                             "buckets": len(make_buckets(specs, bucket)), "matrices": len(specs), "cost": cost,
                             "rows": rows})
    return {"alphas": list(ALPHAS), "settings": settings}


# ----------------------------------------------------------------------------- figure 14
def replay(G: Sequence[float], C: Sequence[Sequence[float]], S: Sequence[float], tp: int, pipelined: bool) -> float:
    """The runtime's issue order (``tp/async_tasks.py``) as a discrete-event timeline.

    Each rank has a clock; a collective starts when every rank has issued it and the
    previous collective has left the link, and lasts its duration; waiting on it moves a
    rank's clock to its end; a compute stage adds that rank's hosted time.  Pipelined:
    round j issues gather(j), computes group j-1 (then issues its scatter), applies j-2.
    (``benchmarks/bench_tp.py`` simulates with it too.)"""
    t = [0.0] * tp
    link = 0.0
    done_g: dict[int, float] = {}
    done_s: dict[int, float] = {}

    def issue(dur: float) -> float:
        nonlocal link
        link = max(max(t), link) + dur
        return link

    def compute(k: int) -> None:
        for r in range(tp):
            t[r] = max(t[r], done_g[k]) + C[k][r]
        done_s[k] = issue(S[k])

    def apply(k: int) -> None:
        for r in range(tp):
            t[r] = max(t[r], done_s[k])

    K = len(G)
    if not pipelined:
        for k in range(K):
            done_g[k] = issue(G[k])
            compute(k)
            apply(k)
        return max(t)
    for j in range(K + 2):
        if j < K:
            done_g[j] = issue(G[j])
        if 0 <= j - 1 < K:
            compute(j - 1)
        if 0 <= j - 2 < K:
            apply(j - 2)
    return max(t)


def simulate_tp(specs: Sequence[ParamSpec], tp: int, rule: CostModel, scheduler: str, c_max: float | None,
                tflops: float, gbps: float, latency_us: float, direction_bytes: int) -> dict:
    """Step time of one TP group's micro-group schedule under the stated model (module doc).
    ``c_max`` in numel of full matrices (elements of fp32 gradient a host receives per group)."""
    flops = cost_vector(specs, "flops", rule, hosted=True)
    full = [s.numel * tp for s in specs]
    plan = plan_tp(specs, tp, scheduler=scheduler, c_max=c_max, cost="numel")
    rate, bw, lat = tflops * 1e12, gbps * 1e9, latency_us * 1e-6
    G, C, S = [], [], []
    peak = 0.0
    serial = 0.0
    for grp in plan.groups:
        recv, comp, back = [0.0] * tp, [0.0] * tp, [0.0] * tp
        for i, h in grp.tasks:
            recv[h] += full[i] * 4 * (tp - 1) / tp
            comp[h] += flops[i]
            for r in range(tp):
                if r != h:
                    back[r] += full[i] * direction_bytes / tp
        G.append(max(recv) / bw + lat)
        C.append([c / rate for c in comp])
        S.append(max(back) / bw + lat)
        # a host holds the full fp32 gradients of the matrices it hosts in this group
        peak = max(peak, max(sum(full[i] for i, h in grp.tasks if h == r) for r in range(tp)) * 4)
        serial += max(comp)
    return {"groups": len(plan.groups), "pipelined_s": _r(replay(G, C, S, tp, True), 6),
            "blocking_s": _r(replay(G, C, S, tp, False), 6), "serial_ratio": _r(serial * tp / sum(flops), 4),
            "peak_host_mib": _r(peak / 2**20, 1)}


def _busiest_rank_specs(model: str, dp: int, tp: int, rule: CostModel) -> list[ParamSpec]:
    """The TP-split matrices of the busiest DP rank (by FLOPs) of the default DP plan
    (``planning/compare.py``'s convention); dp = 1: all of them."""
    specs = [s for s in _specs(model, tp) if s.is_tp_split]
    if dp == 1:
        return specs
    plan = plan_dp(specs, dp, cost="flops", model=rule)
    flops = rank_costs(plan, "flops", rule)
    busiest = max(range(dp), key=lambda r: (flops[r], -r))
    return [specs[i] for i in plan.rank_params[busiest]]


def _cmax_rows(specs: list[ParamSpec], tp: int, rule: CostModel, rates: dict, direction_bytes: int) -> list[dict]:
    largest = max(s.numel * tp for s in specs)
    rows = [{"c_max": "no-fuse", "c_max_mib": None,
             **simulate_tp(specs, tp, rule, "no_fusion", None, direction_bytes=direction_bytes, **rates)}]
    for m in C_MAX_MULTIPLES:
        c = largest * m
        rows.append({"c_max": "largest task (default)" if m == 1.0 else f"{m:g}x largest", "c_max_mib": _r(c * 4 / 2**20, 1),
                     **simulate_tp(specs, tp, rule, "lpt_rollback", c, direction_bytes=direction_bytes, **rates)})
    total = sum(s.numel * tp for s in specs)
    rows.append({"c_max": "one group", "c_max_mib": _r(total * 4 / 2**20, 1),
                 **simulate_tp(specs, tp, rule, "lpt_rollback", float(total), direction_bytes=direction_bytes, **rates)})
    return rows


FIG14_SETTINGS = (
    ("paper's: Qwen3-32B DP=16 TP=8 (busiest DP rank)", "qwen3-32b", 16, 8),
    ("Qwen3-32B DP=1 TP=8 (all 256 matrices)", "qwen3-32b", 1, 8),
    ("Qwen3-8B DP=8 TP=4 (busiest DP rank)", "qwen3-8b", 8, 4),
    ("Qwen3-1.7B DP=1 TP=2 (all 112 matrices)", "qwen3-1.7b", 1, 2),
)
SENSITIVITY_LATENCY_US = (10.0, 30.0, 100.0, 300.0, 1000.0)
SENSITIVITY_GBPS = (50.0, 150.0, 400.0)


def fig14(rule: CostModel, rates: dict) -> dict:
    import torch

    direction_bytes = torch.empty(0, dtype=rule.direction_dtype(torch.float32)).element_size()
    settings = []
    for label, model, dp, tp in FIG14_SETTINGS:
        specs = _busiest_rank_specs(model, dp, tp, rule)
        largest = max(s.numel * tp for s in specs)
        settings.append({"label": label, "model": model, "dp": dp, "tp": tp, "matrices": len(specs),
                         "largest_task_mib": _r(largest * 4 / 2**20, 1),
                         "rows": _cmax_rows(specs, tp, rule, rates, direction_bytes)})
    sensitivity = []
    for label, model, dp, tp in FIG14_SETTINGS:
        specs = _busiest_rank_specs(model, dp, tp, rule)
        for lat in SENSITIVITY_LATENCY_US:
            for gbps in SENSITIVITY_GBPS:
                rows = [r for r in _cmax_rows(specs, tp, rule, dict(tflops=rates["tflops"], gbps=gbps, latency_us=lat),
                                              direction_bytes) if r["c_max"] != "no-fuse"]
                default = rows[0]
                bp = min(rows, key=lambda r: r["pipelined_s"])
                bb = min(rows, key=lambda r: r["blocking_s"])
                sensitivity.append({"setting": label, "latency_us": lat, "gbps": gbps,
                                    "best_pipelined": bp["c_max"], "default_over_best_pipelined":
                                        _r(default["pipelined_s"] / bp["pipelined_s"], 4),
                                    "best_blocking": bb["c_max"], "default_over_best_blocking":
                                        _r(default["blocking_s"] / bb["blocking_s"], 4)})
    worst_p = max(sensitivity, key=lambda s: s["default_over_best_pipelined"])
    worst_b = max(sensitivity, key=lambda s: s["default_over_best_blocking"])
    within = sum(s["default_over_best_pipelined"] <= 1.01 for s in sensitivity)
    return {"rates": rates, "rate_source": RATE_SOURCE, "direction_bytes": direction_bytes, "settings": settings,
            "sensitivity": sensitivity,
            "summary": {"cells": len(sensitivity), "default_within_1pct_pipelined": within,
                        "worst_pipelined": worst_p, "worst_blocking": worst_b}}


# ----------------------------------------------------------------------------- §D.5
D5_CONFIGS = (("qwen3-32b", 16, 8), ("qwen3-32b", 32, 8), ("qwen3-32b", 128, 1), ("qwen3-14b", 32, 4),
              ("qwen3-8b", 64, 4), ("qwen3-1.7b", 16, 4), ("qwen3-0.6b", 64, 1))


def d5(rule: CostModel, tflops: float) -> dict:
    rows = []
    for model, dp, tp in D5_CONFIGS:
        specs = _specs(model, tp)
        for label, planner, bucket in (("alpha_balanced, DeepSpeed buckets", "alpha_balanced", DEFAULT_BUCKET_NUMEL),
                                       ("alpha_balanced, Megatron buckets", "alpha_balanced", megatron_bucket_numel(dp)),
                                       ("lpt", "lpt", None), (DEFAULT_DP_PLANNER, DEFAULT_DP_PLANNER, None)):
            m = {}
            for cost in ("numel", "flops"):
                plan = plan_dp(specs, dp, planner=planner, cost=cost, model=rule, bucket_numel=bucket)
                m[cost] = max(rank_costs(plan, "flops", rule))
            rows.append({"model": model, "dp": dp, "tp": tp, "planner": label, "bucket_numel": bucket,
                         "numel_planned_tflop": _r(m["numel"] / 1e12, 4), "flops_planned_tflop": _r(m["flops"] / 1e12, 4),
                         "ratio": _r(m["numel"] / m["flops"], 4),
                         "delta_ms_at_rate": _r((m["numel"] - m["flops"]) / (tflops * 1e12) * 1e3, 3)})
    return {"rows": rows, "tflops": tflops}


# ----------------------------------------------------------------------------- figures 8/9
def _scaling_row(model: str, dp: int, tp: int, rule: CostModel, pp: int = 1) -> dict:
    specs = _specs(model, tp, pp)
    row: dict = {"model": model, "dp": dp, "tp": tp, "pp": pp, "matrices": len(specs),
                 "bounds": bounds(specs, dp, rule), "plans": {}}
    default_plan = None
    for label, planner, cost, bucket in SCALING_PLANS:
        plan = plan_dp(specs, dp, planner=planner, cost=cost, model=rule,
                       bucket_numel=bucket if bucket is not None else DEFAULT_BUCKET_NUMEL)
        row["plans"][label] = dp_entry(plan, rule)
        if label == "default":
            default_plan = plan
    if tp > 1:
        flops = rank_costs(default_plan, "flops", rule)
        busiest = max(range(dp), key=lambda r: (flops[r], -r))
        owned = [specs[i] for i in default_plan.rank_params[busiest] if specs[i].is_tp_split]
        if owned:
            row["tp_busiest"] = {
                n: {k: _r(getattr(rep, k)) for k in ("flops_ratio", "memory_ratio", "flops_lower_bound")}
                for n in ("round_robin", "lpt_rollback")
                for rep in [tp_report(plan_tp(owned, tp, scheduler=n, cost="flops", model=rule), rule)]}
            row["tp_busiest"]["matrices"] = len(owned)
        split = [s for s in specs if s.is_tp_split]
        row["tp_whole"] = {n: _r(tp_report(plan_tp(split, tp, scheduler=n, cost="flops", model=rule), rule).flops_ratio)
                           for n in ("round_robin", "lpt_rollback")}
    return row


def scaling(rule: CostModel) -> dict:
    return {
        "dp": [_scaling_row("qwen3-32b", dp, 4, rule) for dp in SWEEP_DPS],
        "tp": [_scaling_row("qwen3-32b", 4, tp, rule, pp=4) for tp in SWEEP_TPS],
        "model": [_scaling_row(m, 16, 4, rule) for m in QWEN3[1:]],
        "plans": [{"label": a, "planner": b, "cost": c, "bucket_numel": d} for a, b, c, d in SCALING_PLANS],
    }


# ----------------------------------------------------------------------------- padding
def padding(rule: CostModel) -> dict:
    rows = []
    for model in QWEN3:
        for tp in SWEEP_TPS:
            specs = _specs(model, tp)
            for dp in SWEEP_DPS:
                plan = plan_dp(specs, dp, cost="flops", model=rule)
                layout = plan.nonempty_first().layout()
                pad = layout.total_padding
                rows.append({"model": model, "tp": tp, "dp": dp, "padding_fraction": _r(layout.padding_fraction),
                             "padding_elements": pad, "replicated_mib_bf16": _r(pad * 2 / 2**20, 2),
                             "allgather_extra_mib_bf16": _r(pad * 2 * (dp - 1) / dp / 2**20, 2),
                             "shard_numel": layout.shard_numel, "matrix_numel": layout.total_numel})
    worst_fraction = sorted(rows, key=lambda r: (-r["padding_fraction"], r["model"], r["tp"], r["dp"]))[:8]
    worst_bytes = sorted(rows, key=lambda r: (-r["replicated_mib_bf16"], r["model"], r["tp"], r["dp"]))[:8]
    over = [r for r in rows if r["padding_fraction"] > 0.02]
    claim = {
        "dp_le_16_over_2pct": [f"{r['model']} dp={r['dp']} tp={r['tp']}" for r in over if r["dp"] <= 16],
        "qwen3_32b_over_2pct": [f"{r['model']} dp={r['dp']} tp={r['tp']} ({r['padding_fraction']:.1%})"
                                for r in over if r["model"] == "qwen3-32b"],
        "dp_le_32_over_2pct": [f"{r['model']} dp={r['dp']} tp={r['tp']}" for r in over if r["dp"] <= 32],
        "configs": len(rows), "over_2pct": len(over),
    }
    return {"rows": rows, "worst_fraction": worst_fraction, "worst_bytes": worst_bytes, "claim": claim}


# ----------------------------------------------------------------------------- plots
def plots(data: dict, out_dir: Path, stem: str) -> list[str]:
    """PNG figures drawn from ``data`` only (the JSON); returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{stem}_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)

    # figure 3c: per-rank FLOPs / mean
    f3 = data["fig3"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    pick = ("paper_naive, DeepSpeed buckets", "alpha_balanced (numel), DeepSpeed buckets", f"{DEFAULT_DP_PLANNER} (default)")
    for ax, key, title in ((axes[0], "rank_flops", "FLOPs"), (axes[1], "rank_memory", "optimizer memory")):
        for row in f3["plans"]:
            if row["label"] in pick:
                ax.plot(range(f3["dp"]), row[key], marker="o", ms=3,
                        label=f"{row['label']} (R_LB {row['flops_ratio' if key == 'rank_flops' else 'memory_ratio']:.2f})")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set(title=f"Fig. 3c: {title} per DP rank / mean ({f3['model']}, DP={f3['dp']}, TP={f3['tp']})",
               xlabel="DP rank", ylabel="load / mean")
        ax.legend(fontsize=7)
    save(fig, "fig3_dp")

    # bucket sensitivity
    bs = data["buckets"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [r["bucket_numel"] / 1e6 for r in bs["rows"]]
    ax.plot(xs, [r["paper_naive"]["flops_ratio"] for r in bs["rows"]], marker="o", ms=3, label="paper_naive (eq. 1)")
    ax.plot(xs, [r["alpha_numel"]["flops_ratio"] for r in bs["rows"]], marker="s", ms=3, label="alpha_balanced (numel)")
    ax.plot(xs, [r["alpha_flops"]["flops_ratio"] for r in bs["rows"]], marker="^", ms=3, label="alpha_balanced (flops)")
    ax.axhline(PAPER["fig3_dp"]["naive"]["flops_ratio"], color="C0", ls=":", lw=1, label="paper naive 3.24")
    ax.axhline(PAPER["fig3_dp"]["alpha_balanced"]["flops_ratio"], color="C1", ls=":", lw=1, label="paper alpha 1.43")
    for x, name in ((bs["megatron_bucket_numel"], "Megatron default"), (bs["deepspeed_bucket_numel"], "DeepSpeed default")):
        ax.axvline(x / 1e6, color="gray", lw=0.8, ls="--")
        ax.text(x / 1e6, ax.get_ylim()[1] * 0.9, name, rotation=90, fontsize=7, va="top")
    ax.set(xscale="log", yscale="log", xlabel="bucket size (M elements)", ylabel="FLOPs R_LB",
           title=f"DP FLOPs R_LB vs bucket size ({bs['model']}, DP={bs['dp']}, TP={bs['tp']})")
    ax.legend(fontsize=7)
    save(fig, "buckets")

    # figure 13
    f13 = data["fig13"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for s in f13["settings"]:
        lab = f"{s['label'].replace(chr(39) + 's: ', ': ')} [{s['cost']}]"
        axes[0].plot(f13["alphas"], [r["flops_ratio"] for r in s["rows"]], marker="o", ms=3, label=lab)
        axes[1].plot(f13["alphas"], [r["j_comm_fraction"] for r in s["rows"]], marker="o", ms=3, label=lab)
    axes[0].set(xlabel="alpha", ylabel="FLOPs R_LB", title="Fig. 13: alpha_balanced, FLOPs max/mean", yscale="log")
    axes[1].set(xlabel="alpha", ylabel="J_comm / elements", title="Fig. 13: bucket communication imbalance (eq. 3)")
    axes[0].legend(fontsize=6)
    save(fig, "fig13_alpha")

    # figure 14
    f14 = data["fig14"]
    fig, axes = plt.subplots(1, len(f14["settings"]), figsize=(4.2 * len(f14["settings"]), 4))
    for ax, s in zip(axes, f14["settings"]):
        labels = [r["c_max"].replace(" (default)", "*").replace(" largest", "") for r in s["rows"]]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, [r["pipelined_s"] * 1e3 for r in s["rows"]], 0.4, label="pipelined")
        ax.bar(x + 0.2, [r["blocking_s"] * 1e3 for r in s["rows"]], 0.4, label="blocking")
        ax.set_xticks(x, labels, rotation=60, fontsize=7)
        ax.set(title=s["label"], ylabel="simulated step (ms)")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    save(fig, "fig14_cmax")

    # figures 8/9
    sc = data["scaling"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for col, (key, xkey, title) in enumerate((("dp", "dp", "Fig. 8a: Qwen3-32B TP=4, DP"),
                                              ("tp", "tp", "Fig. 8b: Qwen3-32B PP=4 DP=4, TP"),
                                              ("model", "model", "Fig. 9: DP=16 TP=4, model"))):
        rows = sc[key]
        xs = list(range(len(rows)))
        for p in sc["plans"]:
            axes[0, col].plot(xs, [r["plans"][p["label"]]["flops_ratio"] for r in rows], marker="o", ms=3, label=p["label"])
            axes[1, col].plot(xs, [100 * r["plans"][p["label"]]["padding_fraction"] for r in rows], marker="o", ms=3,
                              label=p["label"])
        axes[0, col].plot(xs, [r["bounds"]["flops"] for r in rows], color="k", ls=":", label="lower bound")
        for ax in axes[:, col]:
            ax.set_xticks(xs, [str(r[xkey]).replace("qwen3-", "") for r in rows])
        axes[0, col].set(title=title, ylabel="DP FLOPs R_LB (planned makespan / ideal)", yscale="log")
        axes[1, col].set_yscale("symlog", linthresh=1.0)
        axes[1, col].set_ylim(bottom=0)
        axes[1, col].set_ylabel("planned-layout padding (%)")
    axes[0, 0].legend(fontsize=7)
    save(fig, "scaling")
    return written


# ----------------------------------------------------------------------------- main
def run(rates: dict) -> dict:
    t0 = time.perf_counter()
    rule = cost_model("muon")
    data: dict = {"optimizer": rule.describe(), "paper": PAPER,
                  "bucket_defaults": {"deepspeed": DEFAULT_BUCKET_NUMEL, "megatron_dp16": megatron_bucket_numel(16),
                                      "megatron_dp32": megatron_bucket_numel(32)},
                  "default_dp_planner": DEFAULT_DP_PLANNER}
    data["fig3"] = fig3(rule)
    data["buckets"] = bucket_sweep(rule)
    data["fig13"] = fig13(rule)
    data["fig14"] = fig14(rule, rates)
    data["d5"] = d5(rule, rates["tflops"])
    data["scaling"] = scaling(rule)
    data["padding"] = padding(rule)
    data["wall_s"] = _r(time.perf_counter() - t0, 1)
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tflops", type=float, default=400.0, help="R: rule compute rate per GPU (TFLOP/s), assumed")
    ap.add_argument("--gbps", type=float, default=150.0, help="B: per-GPU receive bandwidth (GB/s), assumed")
    ap.add_argument("--latency-us", type=float, default=30.0, help="L: per-collective latency (us), assumed")
    ap.add_argument("--out", default=str(RESULTS / "paper_experiments"), help="path without extension")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    for name in ("tflops", "gbps", "latency_us"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    rates = {"tflops": args.tflops, "gbps": args.gbps, "latency_us": args.latency_us}
    data = run(rates)
    cmd = "python benchmarks/paper_experiments.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    data["command"] = cmd
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data["plots"] = [] if args.no_plots else plots(data, out.parent, out.name)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    import tables

    out.with_suffix(".md").write_text(tables.paper_experiments_markdown(data))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

"""Markdown tables rendered from the results JSON files: the one place their numbers are formatted.

    python benchmarks/tables.py --list                    # table names and the JSON each reads
    python benchmarks/tables.py --render fig3_dp          # print one table
    python benchmarks/tables.py --update README.md docs/*.md
    python benchmarks/tables.py --check README.md docs/*.md   # exit 1 naming every stale block

A markdown file embeds a table as a block::

    <!-- table:fig3_dp -->
    | ... the rendered table ... |
    <!-- /table:fig3_dp -->

``--update`` replaces the inside of every block with :func:`render` of its name;
``--check`` reports (and exits non-zero for) every block whose inside differs, every
unknown name and every unclosed block.  ``tests/test_results_in_sync.py`` runs the check
on README.md and docs/*.md, so a number that drifts from its results file fails a test.

Each renderer takes the parsed JSON of one results file (``TABLES[name] = (stem, fn)``:
``benchmarks/results/<stem>.json``).  ``benchmarks/paper_experiments.py`` builds its
markdown from the same functions.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->\n(?P<body>.*?)<!-- /table:(?P=name) -->", re.S)
OPEN = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->")

Data = dict[str, Any]


def _pct(x: float, nd: int = 1) -> str:
    return f"{100 * x:.{nd}f}%"


def _mib(x: float) -> str:
    return f"{x:,.1f} MiB" if x < 1024 else f"{x / 1024:,.2f} GiB"


def _bucket(b: int | None) -> str:
    if b is None:
        return "one bucket"
    return f"{b / 1e6:g}M" if b < 1e9 else f"{b / 1e9:g}G"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ============================================================================ paper_experiments.json
def fig3_dp(d: Data) -> str:
    """Figure 3c: DP load ratios, Qwen3-32B DP=32 TP=8, paper beside ours."""
    f, p = d["fig3"], d["paper"]["fig3_dp"]
    rows = [["paper: naive (eq. 1)", f"{p['naive']['flops_ratio']:.2f}", f"{p['naive']['memory_ratio']:.2f}",
             "-", "-", "-", "measured (peak GPU memory)"],
            ["paper: alpha-balanced (Alg. 1)", f"{p['alpha_balanced']['flops_ratio']:.2f}",
             f"{p['alpha_balanced']['memory_ratio']:.2f}", "-", "-", "-", "measured, W = numel"]]
    for r in f["plans"]:
        cost = "-" if r["planner"] in ("paper_naive", "naive_atomic", "equal_chunk") else r["cost"]
        where = ""
        if r["planner"] in ("paper_naive", "alpha_balanced"):
            where = ", one bucket" if r["bucket_numel"] is None else f", {_bucket(r['bucket_numel'])} buckets"
        rows.append([f"ours: `{r['planner']}`{where}",
                     f"{r['flops_ratio']:.3f}", f"{r['memory_ratio']:.3f}", _pct(r["padding_fraction"]),
                     str(r["split_matrices"]), f"{r['j_comm_fraction']:.3f}", f"planned, cost {cost}"])
    b = f["bounds"]
    rows.append(["lower bound (largest matrix / mean)", f"{b['flops']:.3f}", f"{b['memory']:.3f}",
                 _pct(b["numel"] - 1), "-", "-", "any atomic plan"])
    return _table(["layout", "FLOPs R_LB", "memory R_LB", "padding", "split", "J_comm / elements", "kind"], rows)


def fig3_tp(d: Data) -> str:
    """Figure 3b: TP load ratios in the TP group of the busiest DP rank, paper beside ours."""
    f, p = d["fig3"], d["paper"]["fig3_tp"]
    rows = [["paper: naive", "-", f"{p['naive']['flops_ratio']:.2f}", "-", "-", "-"],
            ["paper: micro-group scheduling", "-", f"{p['micro_group']['flops_ratio']:.2f}",
             f"{p['micro_group']['memory_ratio']:.2f}", "-", "-"]]
    for planner in (d["default_dp_planner"], "paper_naive"):
        v = f["tp_views"][planner]
        for name, label in (("round_robin", "naive (round-robin hosts)"), ("lpt_rollback", "micro-groups (Alg. 2-4)")):
            r = v["schedulers"][name]
            rows.append([f"ours: {label}", f"`{planner}`, rank {v['busiest_dp_rank']} ({v['matrices']} matrices)",
                         f"{r['flops_ratio']:.3f}", f"{r['memory_ratio']:.3f}", str(r["micro_groups"]),
                         f"{r['flops_lower_bound']:.3f}"])
    w = f["tp_views"]["whole_model"]
    for name, label in (("round_robin", "naive (round-robin hosts)"), ("lpt_rollback", "micro-groups (Alg. 2-4)")):
        rows.append([f"ours: {label}", "whole model (DP=1 view)", f"{w[name]['flops_ratio']:.3f}",
                     f"{w[name]['memory_ratio']:.3f}", str(w[name]["micro_groups"]), "-"])
    return _table(["TP schedule", "matrices scheduled (DP plan, busiest rank)", "FLOPs R_LB", "memory R_LB",
                   "micro-groups", "lower bound"], rows)


def buckets(d: Data) -> str:
    """R_LB of eq. 1 and Algorithm 1 over bucket sizes (Qwen3-32B DP=32 TP=8)."""
    b = d["buckets"]
    marks = {b["megatron_bucket_numel"]: " (Megatron default)", b["deepspeed_bucket_numel"]: " (DeepSpeed default)"}
    keep = {20_000_000, 100_000_000, 200_000_000, 300_000_000, 400_000_000, 1_000_000_000, 2_000_000_000,
            b["rows"][-1]["bucket_numel"]} | set(marks)
    rows = []
    for r in b["rows"]:
        if r["bucket_numel"] not in keep:
            continue
        rows.append([_bucket(r["bucket_numel"]) + marks.get(r["bucket_numel"], ""), str(r["buckets"]),
                     f"{r['paper_naive']['flops_ratio']:.2f} / {r['paper_naive']['memory_ratio']:.2f}",
                     f"{r['alpha_numel']['flops_ratio']:.2f} / {r['alpha_numel']['memory_ratio']:.2f}",
                     f"{r['alpha_flops']['flops_ratio']:.2f} / {r['alpha_flops']['memory_ratio']:.2f}"])
    return _table(["bucket (elements)", "buckets", "paper_naive FLOPs / memory R_LB",
                   "alpha_balanced (numel)", "alpha_balanced (flops)"], rows)


def fig13_alpha(d: Data) -> str:
    """Figure 13: alpha sweep of Algorithm 1 (FLOPs R_LB and J_comm per setting)."""
    f = d["fig13"]
    header = ["setting", "cost", "buckets"] + [f"α={a:g}" for a in f["alphas"]]
    rows = []
    for s in f["settings"]:
        rows.append([s["label"], s["cost"], f"{s['buckets']} x {_bucket(s['bucket_numel'])}"]
                    + [f"{r['flops_ratio']:.2f} ({r['j_comm_fraction']:.2f})" for r in s["rows"]])
    return _table(header, rows)


def fig14_cmax(d: Data) -> str:
    """Figure 14: simulated TP step per C_max (pipelined / blocking, ms) per setting."""
    f = d["fig14"]
    rows = []
    for s in f["settings"]:
        for r in s["rows"]:
            mib = "-" if r["c_max_mib"] is None else _mib(r["c_max_mib"])
            rows.append([s["label"], r["c_max"], mib, str(r["groups"]), f"{1e3 * r['pipelined_s']:.1f}",
                         f"{1e3 * r['blocking_s']:.1f}", f"{r['serial_ratio']:.3f}", _mib(r["peak_host_mib"])])
    return _table(["setting", "C_max", "C_max (fp32 grad per host)", "groups", "pipelined ms", "blocking ms",
                   "serial FLOPs ratio", "peak gathered per host"], rows)


def fig14_sensitivity(d: Data) -> str:
    """Figure 14 robustness: the default C_max (largest task) vs the best, over latency x bandwidth."""
    f = d["fig14"]
    rows = []
    for label in dict.fromkeys(s["setting"] for s in f["sensitivity"]):
        cells = [s for s in f["sensitivity"] if s["setting"] == label]
        wp = max(cells, key=lambda s: s["default_over_best_pipelined"])
        wb = max(cells, key=lambda s: s["default_over_best_blocking"])
        rows.append([label, str(len(cells)), str(sum(s["default_over_best_pipelined"] <= 1.01 for s in cells)),
                     f"{wp['default_over_best_pipelined']:.3f} (L={wp['latency_us']:g} us, B={wp['gbps']:g} GB/s)",
                     f"{wb['default_over_best_blocking']:.3f} (L={wb['latency_us']:g} us, B={wb['gbps']:g} GB/s, "
                     f"best {wb['best_blocking']})"])
    return _table(["setting", "(L, B) cells", "default within 1% of best, pipelined", "worst default / best, pipelined",
                   "worst default / best, blocking"], rows)


def d5_numel_vs_flops(d: Data) -> str:
    """§D.5: planned FLOPs makespan of numel-planned vs flops-planned plans."""
    rows = []
    for r in d["d5"]["rows"]:
        rows.append([r["model"], str(r["dp"]), str(r["tp"]), r["planner"], f"{r['numel_planned_tflop']:.2f}",
                     f"{r['flops_planned_tflop']:.2f}", f"{r['ratio']:.4f}", f"{r['delta_ms_at_rate']:+.2f}"])
    return _table(["model", "DP", "TP", "planner", "max-rank TFLOP, W=numel", "max-rank TFLOP, W=flops",
                   "numel / flops", f"Δ ms at {d['d5']['tflops']:g} TFLOP/s"], rows)


def _scaling(d: Data, key: str, xkey: str) -> str:
    sc = d["scaling"]
    labels = [p["label"] for p in sc["plans"]]
    header = [xkey] + [f"{lab}" for lab in labels] + ["DP LB", "TP round-robin / micro-groups (LB)"]
    rows = []
    for r in sc[key]:
        cells = [str(r[xkey])]
        for lab in labels:
            x = r["plans"][lab]
            extra = f", {x['split_matrices']} split" if x["split_matrices"] else ""
            cells.append(f"{x['flops_ratio']:.2f} ({_pct(x['padding_fraction'])}{extra})")
        cells.append(f"{r['bounds']['flops']:.2f}")
        t = r.get("tp_busiest")
        cells.append(f"{t['round_robin']['flops_ratio']:.2f} / {t['lpt_rollback']['flops_ratio']:.2f} "
                     f"({t['lpt_rollback']['flops_lower_bound']:.2f})" if t else "-")
        rows.append(cells)
    return _table(header, rows)


def scaling_dp(d: Data) -> str:
    """Figure 8a: Qwen3-32B TP=4, DP 8 -> 128: FLOPs R_LB (padding) per planner."""
    return _scaling(d, "dp", "dp")


def scaling_tp(d: Data) -> str:
    """Figure 8b: Qwen3-32B PP=4 (stage 0) DP=4, TP 1 -> 8."""
    return _scaling(d, "tp", "tp")


def scaling_model(d: Data) -> str:
    """Figure 9: DP=16 TP=4, Qwen3 1.7B -> 32B."""
    return _scaling(d, "model", "model")


def padding_worst(d: Data) -> str:
    """The default plan's padding, worst configurations (by fraction and by bytes), per GPU."""
    pad = d["padding"]
    seen, rows = set(), []
    for r in pad["worst_fraction"] + pad["worst_bytes"]:
        key = (r["model"], r["tp"], r["dp"])
        if key in seen:
            continue
        seen.add(key)
        rows.append([r["model"], str(r["dp"]), str(r["tp"]), _pct(r["padding_fraction"]), f"{r['padding_elements']:,}",
                     _mib(r["replicated_mib_bf16"]), _mib(r["allgather_extra_mib_bf16"])])
    return _table(["model", "DP", "TP", "padding / matrix elements", "padding elements (one TP rank)",
                   "replicated bf16 buffer, extra per GPU", "all-gather, extra received per GPU per step"], rows)


# ============================================================================ plan_sweep.json
def plan_sweep_numel_vs_flops(d: Data) -> str:
    """plan_sweep: FLOPs makespan of numel-planned / flops-planned plans."""
    rows = []
    for e in d["numel_vs_flops"]:
        for planner, v in e.items():
            if isinstance(v, dict):
                rows.append([e["model"], str(e["dp"]), str(e["tp"]), planner, f"{v['ratio']:.4f}"])
    return _table(["model", "dp", "tp", "planner", "makespan numel-planned / flops-planned"], rows)


def plan_sweep_default(d: Data) -> str:
    """plan_sweep: the default planner's FLOPs R_LB (padding) per model x DP, worst over TP."""
    key = f"dp.{d['default_dp_planner']}"
    models = list(dict.fromkeys(r["model"] for r in d["rows"]))
    dps = sorted({r["dp"] for r in d["rows"]})
    rows = []
    for m in models:
        cells = [m]
        for dp in dps:
            rs = [r for r in d["rows"] if r["model"] == m and r["dp"] == dp]
            f = max(r[key]["flops_ratio"] for r in rs)
            p = max(r[key]["padding_fraction"] for r in rs)
            cells.append(f"{f:.3f} ({_pct(p)})")
        rows.append(cells)
    return _table(["model"] + [f"DP={dp}" for dp in dps], rows)


def plan_sweep_planners(d: Data) -> str:
    """plan_sweep: every DP planner at Qwen3-32B DP=32 TP=8 (FLOPs / memory R_LB, padding)."""
    row = next(r for r in d["rows"] if (r["model"], r["dp"], r["tp"]) == ("qwen3-32b", 32, 8))
    rows = []
    for k, v in row.items():
        if k.startswith("dp.") and k != "dp.bound":
            rows.append([f"`{k[3:]}`", f"{v['flops_ratio']:.3f}", f"{v['memory_ratio']:.3f}", _pct(v["padding_fraction"]),
                         str(v["split_matrices"])])
    b = row["dp.bound"]
    rows.append(["lower bound", f"{b['flops_lower_bound']:.3f}", f"{b['memory_lower_bound']:.3f}",
                 _pct(b["numel_lower_bound"] - 1), "-"])
    return _table(["planner (Qwen3-32B DP=32 TP=8)", "FLOPs R_LB", "memory R_LB", "padding", "split"], rows)


# ============================================================================ plan_rules.json
def plan_rules_paper(d: Data) -> str:
    """plan_rules: Shampoo/SOAP DP FLOPs R_LB, paper (Fig. 12) beside ours, PP=1 / PP=2."""
    labels = list(d["whole_model"])
    rows = []
    naive = [("naive, eq. 1 (`paper_naive`)", d["paper"]["naive_flops_ratio"], "paper_naive")] \
        if "paper_naive" in next(iter(d["whole_model"].values()))["planners"] else []
    for title, paper, planner in (*naive,
                                  ("atomic, unbalanced (`naive_atomic`)", "-" if naive else d["paper"]["naive_flops_ratio"],
                                   "naive_atomic"),
                                  ("DeepSpeed stock ZeRO-1 (`equal_chunk`)", "-", "equal_chunk"),
                                  (f"balanced (ours: `{d['default_dp_planner']}`)", d["paper"]["balanced_flops_ratio"],
                                   d["default_dp_planner"]),
                                  ("lower bound (LP)", "-", None)):
        cells = [title, paper]
        for lab in labels:
            pair = []
            for sec in ("whole_model", "pp_stage0"):
                e = d[sec][lab]
                if planner is None:
                    lp = e["lower_bound"]["flops_lp"]
                    pair.append("-" if lp is None else f"{lp:.3f}")
                else:
                    pair.append(f"{e['planners'][planner]['flops_ratio']:.3f}")
            cells.append(" / ".join(pair))
        rows.append(cells)
    return _table(["", "paper (§C.4, Fig. 12)"] + [f"ours: {lab}" for lab in labels], rows)


def plan_rules_detail(d: Data) -> str:
    """plan_rules: every rule x planner over the whole model."""
    rows = []
    for lab, e in d["whole_model"].items():
        for name, r in e["planners"].items():
            split = f", {r['split_matrices']} split" if r["split_matrices"] else ""
            rows.append([lab, name, f"{r['flops_ratio']:.3f}", f"{r['peak_flops_ratio']:.3f}",
                         f"{r['memory_ratio']:.3f}", f"{_pct(r['padding_fraction'])}{split}"])
    return _table(["rule", "planner", "FLOPs max/mean", "peak FLOPs max/mean", "memory max/mean", "padding"], rows)


# ============================================================================ pipeline.json
def pipeline_planned(d: Data) -> str:
    """bench_pipeline planned part: per-stage FLOPs / memory max/mean, Fig. 12 setting with PP=2."""
    p = d["planned"]
    shown = ("naive_atomic", "equal_chunk", p["default_dp_planner"])
    rows = []
    for label, stages in p["rules"].items():
        for k, e in enumerate(stages):
            cells = [label, f"{k} of {p['pp']}", str(e["matrices"])]
            for name in shown:
                r = e["planners"][name]
                cell = f"{r['flops_ratio']:.3f} / {r['memory_ratio']:.3f}"
                cells.append(f"**{cell}**" if name == p["default_dp_planner"] else cell)
            lp = e["lower_bound"]["flops_lp"]
            cells.append("-" if lp is None else f"{lp:.3f}")
            rows.append(cells)
    return _table(["rule", "stage", "matrices"] + [f"`{n}` FLOPs / memory" for n in shown] + ["FLOPs LP bound"], rows)


def pipeline_measured(d: Data) -> str:
    """bench_pipeline measured part: PP=2 x DP=2, per stage busiest/mean rule CPU time beside the plan."""
    m = d["measured"]
    rows = []
    for r in m["rows"]:
        rows.append([r["rule"], f"`{r['planner']}`", str(r["stage"]), f"{r['planned_flops_ratio']:.3f}",
                     f"{r['measured_ratio']:.3f}", ", ".join(f"{v:.1f}" for v in r["rule_cpu_ms_per_step"]),
                     ", ".join(f"{v:.3f}" for v in r["planned_gflop_per_rank"]),
                     ", ".join(str(n) for n in r["matrices_per_rank"])])
    return _table(["rule", "planner", "stage", "planned FLOPs max/mean", "measured rule CPU max/mean",
                   "rule CPU ms / step, DP rank 0, 1", "planned GFLOP / step, DP rank 0, 1", "matrices per rank"], rows)


# ============================================================================ tp.json
TP_LABELS = {"sc": "TP-SC (all-gather + redundant update)", "asc-blocking": "TP-ASC micro-groups, blocking",
             "asc-pipelined": "TP-ASC micro-groups, pipelined", "asc-no-fusion": "no fusion (one matrix per group)",
             "local": "shard-local (DeepSpeed Muon under AutoTP)"}


def tp_measured(d: Data) -> str:
    """bench_tp measured part: TP=2 step time vs TP-SC, collectives, bytes, exactness."""
    m = d["measured"]
    sc = m["sc"]["step_s"]
    rows = []
    for label in ("sc", "asc-blocking", "asc-pipelined", "asc-no-fusion", "local"):
        if label not in m:
            continue
        r = m[label]
        coll = ", ".join(f"{v} {k}" for k, v in r["collectives"].items()) or "0"
        exact = f"no: {100 * m['local_rel_dev']:.0f}% off" if label == "local" else "yes"
        rows.append([TP_LABELS[label], f"{r['step_s'] / sc:.2f}x", coll, f"{max(r['bytes_sent']) / 2**20:.1f} MiB", exact])
    return _table(["strategy", "step time vs TP-SC (median)", "collectives / step", "bytes sent / rank",
                   "exact vs TP=1"], rows)


def tp_simulated(d: Data) -> str:
    """bench_tp simulated part: SC / ASC / LB-ASC step per scope."""
    rows = []
    for s in d["simulated"]:
        scope = "whole model" if s["dp"] == 1 else f"busiest DP rank of DP={s['dp']}"
        rows.append([f"{s['model']} TP={s['tp']}, {scope}", "SC", f"{s['SC']['makespan_s']:.3f}", "-",
                     str(s["SC"]["collectives"]), "1.00"])
        for lab in ("ASC", "LB-ASC", "LB-ASC no-fuse"):
            a = s[lab]
            rows.append(["", lab, f"{a['makespan_blocking_s']:.3f}", f"{a['makespan_pipelined_s']:.3f}",
                         str(a["collectives"]), f"{a['flops_ratio']:.2f}"])
    return _table(["setting", "schedule", "step blocking (s)", "step pipelined (s)", "collectives", "FLOPs max/avg"], rows)


# ============================================================================ bench_rules / bench_muon
def bench_rules(d: Data) -> str:
    """bench_zero --suite rules: optimizer CPU ms of the busiest rank per rule x DP x placement."""
    rows_in = d["rows"]
    rows = []
    for key, r in rows_in.items():
        rule, placement = r["kind"].split("/")
        rep = rows_in.get(f"{rule}/replicated@dp{r['dp']}")
        naive = rows_in.get(f"{rule}/naive@dp{r['dp']}")
        mean = r.get("opt_cpu_mean_busiest_ms")
        rows.append([rule, str(r["dp"]), placement, f"{r['opt_cpu_busiest_ms']:.1f}",
                     f"{r['opt_cpu_busiest_ms'] / rep['opt_cpu_busiest_ms']:.2f}x" if rep else "-",
                     f"{r['opt_cpu_busiest_ms'] / naive['opt_cpu_busiest_ms']:.2f}x" if naive else "-",
                     "-" if mean is None else f"{mean:.1f}", f"{r['opt_cpu_total_ms']:.1f}", f"{r['iter_ms']:.1f}"])
    return _table(["rule", "DP", "placement", "optimizer CPU ms, busiest rank (median)", "vs replicated", "vs naive",
                   "mean (with refresh steps)", "optimizer CPU ms, total", "iteration ms (wall)"], rows)


def bench_muon(d: Data) -> str:
    """bench_zero --suite muon: CanzonaMuon vs DeepSpeed Muon vs AdamW, stages 1/2, offload, layerwise."""
    rows = [[r["kind"], str(r["dp"]), f"{r['iter_ms']:.1f}", f"{r['mat_cpu_busiest_ms']:.1f}",
             f"{r['opt_cpu_busiest_ms']:.1f}", f"{r['bytes_max_rank'] / 1e6:.2f}"] for r in d["rows"].values()]
    return _table(["kind", "DP", "iteration ms (wall)", "matrix rule CPU ms, busiest rank",
                   "optimizer step CPU ms, busiest rank", "MB sent / iteration, busiest rank"], rows)


def bench_muon_summary(d: Data) -> str:
    """bench_zero --suite muon, the ratios: CanzonaMuon over DeepSpeed's Muon per setting (DP > 1)."""
    rows_in = d["rows"]
    rows = []
    for dp in sorted({r["dp"] for r in rows_in.values() if r["dp"] > 1}):
        adamw = rows_in.get(f"adamw/stage1@dp{dp}")
        owner = rows_in.get(f"adamw/stage1+reduce_to_owner@dp{dp}")
        for setting in ("stage1", "stage2", "stage1+offload", "stage2+offload"):
            ours, theirs = rows_in.get(f"canzona/{setting}@dp{dp}"), rows_in.get(f"ds_muon/{setting}@dp{dp}")
            if not (ours and theirs):
                continue
            rows.append([f"ZeRO {setting}, vs DeepSpeed Muon", str(dp), f"{ours['mat_cpu_busiest_ms'] / theirs['mat_cpu_busiest_ms']:.2f}x",
                         f"{ours['iter_ms'] / theirs['iter_ms']:.2f}x",
                         f"{ours['bytes_max_rank'] / 1e6:.2f} / {theirs['bytes_max_rank'] / 1e6:.2f}"
                         + (f" / {adamw['bytes_max_rank'] / 1e6:.2f}" if adamw else " / -")
                         + (f" / {owner['bytes_max_rank'] / 1e6:.2f}" if owner else " / -")])
        lw, ours = rows_in.get(f"layerwise/stage0@dp{dp}"), rows_in.get(f"canzona/stage1@dp{dp}")
        if lw and ours:
            rows.append(["ZeRO stage1, vs NV-layerwise (ZeRO 0 + broadcast)", str(dp),
                         f"{ours['mat_cpu_busiest_ms'] / lw['mat_cpu_busiest_ms']:.2f}x",
                         f"{ours['iter_ms'] / lw['iter_ms']:.2f}x",
                         f"{ours['bytes_max_rank'] / 1e6:.2f} / {lw['bytes_max_rank'] / 1e6:.2f} / - / -"])
    return _table(["setting", "DP", "matrix rule CPU, busiest rank: CanzonaMuon / baseline",
                   "iteration (wall): CanzonaMuon / baseline",
                   "MB sent per iteration: CanzonaMuon / baseline / stock AdamW / AdamW reducing to owners"], rows)


def bench_scaling(d: Data) -> str:
    """bench_zero --suite scaling: the matrix optimizer's per-rank CPU time at DP 2/4/8."""
    rows_in = d["rows"]
    rows = []
    for r in rows_in.values():
        ds = rows_in.get(f"ds_muon/stage1@dp{r['dp']}")
        rows.append([str(r["dp"]), r["kind"].split("/")[0], f"{r['mat_cpu_busiest_ms']:.1f}",
                     f"{r['mat_cpu_total_ms']:.1f}", ", ".join(f"{v:.0f}" for v in r["mat_cpu_per_rank_ms"]),
                     f"{r['mat_cpu_busiest_ms'] / ds['mat_cpu_busiest_ms']:.2f}x" if ds else "-"])
    return _table(["DP", "optimizer", "matrix CPU ms, busiest rank", "total over ranks", "per rank",
                   "busiest vs DeepSpeed Muon"], rows)


#: bench_zero3 kinds -> how the tables name them
ZERO3_KINDS = {"ds_muon": "DeepSpeed Muon, stage 3", "hosted": "Canzona hosted step",
               "engine": "Canzona ZeRO-3 engine", "replicated": "replicated, stage 3"}


def _zero3_rows(d: Data) -> list[tuple[str, dict, dict | None]]:
    """(rule, row, baseline row) per DP and rule: Muon against DeepSpeed's Muon, the others
    against the replicated baseline; the baselines themselves with ``None``."""
    rows_in, out = d["rows"], []
    for dp in sorted({r["dp"] for r in rows_in.values()}):
        for rule in d["rules"]:
            base_key = f"ds_muon@dp{dp}" if rule == "muon" else f"replicated/{rule}@dp{dp}"
            base = rows_in.get(base_key)
            if base:
                out.append((rule, base, None))
            kind = "engine" if f"engine/{rule}@dp{dp}" in rows_in else "hosted"
            r = rows_in.get(f"{kind}/{rule}@dp{dp}")
            if r:
                out.append((rule, r, base))
    return out


def bench_zero3(d: Data) -> str:
    """bench_zero3: rule work and bytes per optimizer step at ZeRO stage 3, DP 2/4/8."""
    rows = []
    for rule, r, base in _zero3_rows(d):
        kind = ZERO3_KINDS[r["kind"].split("/")[0]]
        rows.append([str(r["dp"]), rule, kind, f"{r['rule_cpu_busiest_ms']:.1f}", f"{r['rule_cpu_mean_ms']:.1f}",
                     f"{r['rule_cpu_busiest_ms'] / r['rule_cpu_mean_ms']:.2f}x", f"{r['rule_cpu_total_ms']:.1f}",
                     f"{r['rule_cpu_busiest_ms'] / base['rule_cpu_busiest_ms']:.2f}x" if base else "1.00x",
                     f"{r['bytes_busiest'] / 1e6:.2f}",
                     f"{r['bytes_busiest'] / base['bytes_busiest']:.2f}x" if base else "1.00x"])
    return _table(["DP", "rule", "optimizer", "rule CPU ms / step, busiest rank", "mean over ranks",
                   "busiest / mean", "total over ranks", "busiest vs baseline", "MB sent / step, busiest rank",
                   "bytes vs baseline"], rows)


def bench_zero3_hosted(d: Data) -> str:
    """bench_zero3: the engine-free hosted step beside the engine (a cross-check of the engine's
    rule work; its bytes = stock ZeRO-3's + the hosted all-to-alls, no clipping norm)."""
    rows_in, rows = d["rows"], []
    for key, h in rows_in.items():
        if not h["kind"].startswith("hosted/"):
            continue
        e = rows_in.get(key.replace("hosted/", "engine/"))
        rows.append([str(h["dp"]), h["kind"].split("/")[1], f"{h['rule_cpu_busiest_ms']:.1f}",
                     f"{e['rule_cpu_busiest_ms']:.1f}" if e else "-", f"{h['rule_cpu_total_ms']:.1f}",
                     f"{e['rule_cpu_total_ms']:.1f}" if e else "-", f"{h['bytes_busiest'] / 1e6:.2f}",
                     f"{e['bytes_busiest'] / 1e6:.2f}" if e else "-"])
    return _table(["DP", "rule", "hosted step: rule CPU ms, busiest", "engine: busiest", "hosted: total over ranks",
                   "engine: total", "hosted: MB / step, busiest", "engine: MB / step, busiest"], rows)


def bench_zero3_goals(d: Data) -> str:
    """bench_zero3: issue 16's goals at the largest DP, measured."""
    g, rows_in = d["goals"], d["rows"]
    top, low = g["dp"], min(r["dp"] for r in rows_in.values())
    rows = []
    if "busiest_vs_ds_muon" in g:
        rows.append([f"Muon busiest rank vs DeepSpeed Muon's busiest, DP={top}", "<= 0.92x",
                     f"{g['busiest_vs_ds_muon']:.2f}x", "yes" if g["busiest_vs_ds_muon"] <= 0.92 else "no"])
        rows.append([f"Muon busiest rank vs its own mean, DP={top}", "<= 1.05x",
                     f"{g['busiest_vs_own_mean']:.2f}x (DeepSpeed Muon: {g['ds_busiest_vs_own_mean']:.2f}x)",
                     "yes" if g["busiest_vs_own_mean"] <= 1.05 else "no"])
    for rule in d["rules"]:
        ratios = g.get(f"{rule}_total_vs_dp{low}")
        if not ratios:
            continue
        src = g.get("source", "hosted")
        ours = [r for r in rows_in.values() if r["kind"] == f"{src}/{rule}"]
        calls = {sum(r["rule_calls_per_rank"]) for r in ours}
        flops = {round(sum(r["extra_per_rank"][0]["plan_load"]) / 1e9, 2) for r in ours}
        constant = len(calls) == 1 and len(flops) == 1
        cpu = ", ".join(f"{v:.2f}x (DP={k})" for k, v in ratios.items() if int(k) != low)
        if rule == "muon":
            ds = {r["dp"]: r["rule_cpu_total_ms"] for r in rows_in.values() if r["kind"] == "ds_muon"}
            if low in ds and top in ds:
                cpu += f"; DeepSpeed Muon (same calls): {ds[top] / ds[low]:.2f}x (DP={top})"
        rows.append([f"{rule}: total rule work does not grow with DP", "rule calls and planned FLOPs per step constant",
                     f"{min(calls):.0f} calls, {min(flops):g} GFLOP planned (amortised) at every DP; CPU total vs DP={low}: {cpu}",
                     "yes" if constant else "no"])
    if "bytes_vs_ds_muon" in g:
        rows.append([f"bytes per step vs DeepSpeed Muon stage 3, DP={top}", "<= 0.8x", f"{g['bytes_vs_ds_muon']:.2f}x",
                     "yes" if g["bytes_vs_ds_muon"] <= 0.8 else "no"])
    return _table(["goal (issue 16)", "target", "measured", "met"], rows)


def bench_zero3_markdown(d: Data) -> str:
    """benchmarks/results/bench_zero3.md, from its JSON."""
    m = d["model"]
    return "\n".join([
        "# ZeRO stage 3: matrix-rule work and bytes per optimizer step (generated by `benchmarks/bench_zero3.py`)", "",
        f"Command: `{d['command']}`. Source of the Canzona rows: {d['source']}.", "",
        f"Machine: {d['machine']}. Model: Qwen3ForCausalLM, {m['num_layers']} layers, hidden {m['hidden_size']}, "
        f"SwiGLU {m['intermediate_size']}, {m['num_heads']} query heads x {m['head_dim']}, {m['num_kv_heads']} "
        f"key/value heads, vocab {m['vocab_size']}; micro-batch {d['micro']} x seq {d['seq']} per rank; "
        f"{d['steps']} timed steps after {d['warmup']} warm-up, every kind in the same processes, interleaved.", "",
        "Code measured: " + "; ".join(f"{k}: {v}" for k, v in d.get("code", {}).items()) + ".", "",
        "Rule CPU = thread CPU time of the matrix rule's work on a rank per optimizer step (DeepSpeed's "
        "`muon_update` calls; Canzona's `rule.direction` calls), mean over the timed steps (refresh steps "
        "included). Bytes = what a rank sends per step over every collective of the step (forward, backward, "
        "optimizer): DeepSpeed's own collectives counted at its communication backend (ring bytes for "
        "all-reduce / all-gather / reduce-scatter), the hosted all-to-alls exactly.", "",
        bench_zero3(d), "", bench_zero3_goals(d), "",
        "The engine-free hosted step (the same micro-group runtime over `FlatSplit.even` pieces, without "
        "DeepSpeed around it; its bytes = stock ZeRO-3's + its all-to-alls) beside the engine:", "",
        bench_zero3_hosted(d), "",
        "Baselines: Muon against DeepSpeed 0.19.8's own Muon at stage 3 (`\"type\": \"Muon\"`, "
        "`\"reduce_scatter\": false`, which it requires): full gradients all-reduced, then gradients and momenta "
        "all-gathered, matrices dealt round-robin, updates and momenta all-gathered. Shampoo and SOAP against "
        "the stage-3 replicated baseline: every rank all-gathers every matrix's reduce-scattered gradient and "
        "runs the rule on every whole matrix (rule state on every rank), keeping its piece of each update. "
        f"Rules: {json.dumps(d['rules'])}.", "",
    ])


def config_fuzz(d: Data) -> str:
    """config_fuzz: generated invalid settings and rank mismatches, what happened."""
    rows = [[f"invalid optimizer settings ({d['invalid_settings']} generated from the config dataclasses)",
             f"{d['refused_naming_the_key']} of {d['invalid_settings']} refused with an error naming the key"]]
    for name, m in d["rank_mismatches"].items():
        rows.append([f"2 ranks, {name}", ("every rank refused, naming the setting" if m["refused_on_every_rank"]
                                          else "NOT refused on every rank") + f", {m['seconds']} s"])
    return _table(["bad input", "what happened"], rows)


def elastic_rss(d: Data) -> str:
    """bench_elastic_rss: peak RSS and wall time of an elastic resume per rank, share read vs whole model."""
    what = {"new": "reads its share (memory-mapped)", "old": "reads the whole model (before)"}
    rows = []
    for c in d["cases"]:
        for path in ("new", "old"):
            ranks = c[path]
            rows.append([f"{c['from_dp']} -> {c['to_dp']}", what[path],
                         ", ".join(f"{r['peak_mib']:,.0f}" for r in ranks), _mib(max(r["peak_mib"] for r in ranks)),
                         _mib(max(r["retained_mib"] for r in ranks)), f"{max(r['wall_s'] for r in ranks):.1f}",
                         "yes" if c["identical"] else "NO"])
    return _table(["DP", "load", "peak RSS increment per rank, MiB", "max", "kept (new state), max",
                   "load wall s, slowest rank", "same state as the other path"], rows)


def ckpt_index(d: Data) -> str:
    """bench_ckpt_index: load through the checkpoint index vs the per-layout reader, per rank."""
    rows = [[r["change"], r["path"], ", ".join(f"{m:,.0f}" for m in r["peak_mib"]), f"{r['wall_s_max']:.2f}"]
            for r in d["rows"]]
    return _table(["change", "path", "peak RSS increment per rank, MiB", "load wall s, slowest rank"], rows)


def _fault_table_entry(d: Data) -> str:
    """fault_injection: checkpoint faults injected into a real run and what --resume did."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fault_injection", RESULTS.parent / "fault_injection.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fault_table(d["faults"]).strip()


def dp_exactness(d: Data) -> str:
    rows = ["| DP | run | vs | max abs diff, matrices | max abs diff, other params |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['dp']} | {r['run']} | {r['reference']} | {r['max_abs_diff_matrices']:.2g} "
                    f"| {r['max_abs_diff_other']:.2g} |")
    return "\n".join(rows)


def main_job_run(d: Data) -> str:
    r = d["run"]
    return "\n".join([
        "| command | model | ranks | steps | wall time | loss (first → last) | held-out loss | median tokens/s "
        "| median step | machine |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| `{r['command']}` | {r['model']}, {r['optimizer']} | {r['ranks']} | {r['steps']} | {r['wall_s']:.0f} s "
        f"| {r['first_loss']:.2f} → {r['final_loss']:.2f} | {r['final_val_loss']:.2f} "
        f"| {r['median_tokens_per_s']:,.0f} | {r['median_step_ms']:.0f} ms | {d['machine']} |"])


def main_job_plan(d: Data) -> str:
    plan = d["plan"]
    out = [f"| layout (dp={plan['world_size']}) | Newton–Schulz GFLOP per rank per step | busiest | max/mean "
           "| padding |", "|---|---|---|---|---|"]
    for lay in plan["layouts"]:
        per_rank = ", ".join(f"{f / 1e9:.3f}" for f in lay["rank_flops"])
        out.append(f"| {lay['name']} | {per_rank} | {max(lay['rank_flops']) / 1e9:.3f} | {lay['imbalance']:.2f} "
                   f"| {_pct(lay['padding_fraction'], 2)} |")
    return "\n".join(out)


def main_job_reference(d: Data) -> str:
    c = d["compare"]
    names = list(c["losses"])
    out = ["| step | reference | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for i, ref in enumerate(c["reference"]):
        out.append(f"| {ref['step']} | {ref['loss']:.5f} | "
                   + " | ".join(f"{c['losses'][n][i]:.5f}" if i < len(c["losses"][n]) else "n/a" for n in names)
                   + " |")
    return "\n".join(out)


def main_job_compare(d: Data) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)
    out = ["| run (`" + d["compare"]["command"] + "`) | loss | held-out | median step ms | tokens/s | fwd+bwd "
           "| reduce | opt | allgather |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in d["compare"]["runs"].items():
        out.append(f"| {name} | {f(r['final_loss'], '.3f')} | {f(r['final_val_loss'], '.3f')} "
                   f"| {f(r['median_step_ms'], '.0f')} | {f(r['median_tokens_per_s'], ',.0f')} "
                   f"| {f(r['median_fwd_bwd_ms'], '.0f')} | {f(r['median_grad_reduce_ms'], '.0f')} "
                   f"| {f(r['median_optimizer_ms'], '.0f')} | {f(r['median_allgather_ms'], '.0f')} |")
    return "\n".join(out)


#: table name -> (results JSON stem, renderer)

# ============================================================================ layout_*.json
def _gb(b: float) -> str:
    return f"{b / 2**30:,.2f}" if b >= 2**30 else f"{b / 2**30:,.3f}"


def layout_planned(d: Data) -> str:
    """bench_layout --suite planned: owned (planned padding) vs mixed, Qwen3 at TP=8, Muon."""
    rows = []
    for r in d["rows"]:
        o, m = r["owned"], r["mixed"]
        rows.append([r["model"], str(r["dp"]), _pct(o["padding"]), _pct(m["padding"], 2),
                     f"{o['flops_ratio']:.3f} / {m['flops_ratio']:.3f} ({o['flops_lower_bound']:.3f})",
                     f"{o['memory_ratio']:.2f} / {m['memory_ratio']:.2f}",
                     f"{m['hosted']} ({_pct(m['hosted_share'], 0)})",
                     f"{_gb(o['all_gather_bytes'])} / {_gb(m['all_gather_bytes'])}",
                     f"{_gb(m['hosted_sent_max'])} ({m['hosted_collectives']})",
                     f"{_gb(o['rank_cost'])} / {_gb(m['rank_cost'])}",
                     "mixed" if r["choice"] == "mixed" else "owned"])
    return _table(["model", "DP", "padding owned", "padding mixed", "FLOPs max/avg owned / mixed (bound)",
                   "memory max/avg owned / mixed", "hosted matrices (elements)", "all-gather GiB owned / mixed",
                   "hosted all-to-all GiB, busiest rank (collectives)", "step cost GiB-eq. owned / mixed",
                   "auto picks"], rows)


def layout_measured(d: Data) -> str:
    """bench_layout --suite measured: the one-layer Qwen3-shaped model under ZeRO-1 at 8 CPU ranks."""
    k = d["kinds"]
    names = {"owned": 'CanzonaMuon, layout "owned"', "mixed": 'CanzonaMuon, layout "mixed"', "adamw": "DeepSpeed AdamW"}
    rows = []
    for kind in ("owned", "mixed", "adamw"):
        r = k[kind]
        rows.append([names[kind], f"{r['bit16_buffer']:,} / {r['params']:,} = {r['ratio']:.3f}",
                     "-" if "matrix_padding" not in r else _pct(r["matrix_padding"], 2),
                     "-" if "hosted" not in r else str(len(r["hosted"])),
                     f"{r['bytes_max_rank'] / 2**20:,.3f}", f"{r['bytes_total'] / 2**20:,.3f}",
                     f"{r['bytes_total'] / k['owned']['bytes_total']:.3f}",
                     ", ".join(f"{op} {b / 2**20:,.3f}" for op, b in sorted(r["bytes_by_op_total"].items()) if b),
                     "-" if "max_abs_diff_matrices" not in r else
                     f"{r['max_abs_diff_matrices']:.2g} / {r['max_abs_diff_aux']:.2g}"])
    return _table(["optimizer (ZeRO-1, DP=8)", "bit16 buffer / parameters", "matrix padding", "hosted matrices",
                   "MiB sent per step, busiest rank", "MiB sent per step, all ranks", "all ranks vs owned",
                   "MiB by collective, all ranks", "max abs(weight - reference), matrices / AdamW"], rows)


def layout_measured_tp(d: Data) -> str:
    """bench_layout --suite measured, DP=4 x TP=2: the Megatron stand-in under ZeRO-1, owned vs
    mixed (hosted TP-split matrices over the DP x TP grid)."""
    t = d["tp"]
    k = t["kinds"]
    rows = []
    for kind in ("owned", "mixed"):
        r = k[kind]
        hosted = f"{len(r['grid_hosted'])} over the grid, {len(r['dp_hosted'])} over DP" if r["hosted"] else "0"
        rows.append([f'CanzonaMuon, layout "{kind}"', f"{r['bit16_buffer']:,} / {r['params']:,} = {r['ratio']:.3f}",
                     _pct(r["matrix_padding"], 2), hosted, str(r["step_collectives_max_rank"]),
                     f"{r['bytes_max_rank'] / 2**20:,.3f}", f"{r['bytes_total'] / 2**20:,.3f}",
                     f"{r['bytes_total'] / k['owned']['bytes_total']:.3f}",
                     ", ".join(f"{op} {b / 2**20:,.3f}" for op, b in sorted(r["bytes_by_op_total"].items()) if b),
                     "-" if "vs_owned" not in r else f"{r['vs_owned']:.2g}"])
    return _table([f"optimizer (ZeRO-1, DP={t['dp']} x TP={t['tp']})", "bit16 buffer / parameters (one rank)",
                   "matrix padding", "hosted matrices", "optimizer-step all-to-alls, busiest rank",
                   "MiB sent per step, busiest rank", "MiB sent per step, all ranks", "all ranks vs owned",
                   "MiB by collective, all ranks", "max abs(weight - owned layout's)"], rows)


def layout_grid(d: Data) -> str:
    """bench_layout --suite grid: per (dp, tp) cell FLOPs max/mean of the mixed layout under TP, the
    grid hosts' TP ranks picked without (before) and with (after) the owned TP runtime's load."""
    rows = []
    for r in d["rows"]:
        hosted = f"{r['owned_tp']} / {r['grid_hosted']} ({r['grid_moved']} at another TP rank) / {r['dp_hosted']}"
        rows.append([r["model"], f"{r['dp']} x {r['tp']}", hosted, f"{r['dp_plan_ratio']:.3f}",
                     f"{r['before']:.3f}", f"{r['after']:.3f}", f"{r['after_vs_before']:.3f}", f"{r['bound']:.3f}",
                     r["auto"]])
    return _table(["model (layout \"mixed\", Muon)", "DP x TP", "owned TP-split / grid-hosted / DP-hosted",
                   "DP plan FLOPs max/mean", "cell FLOPs max/mean, before (unseeded)", "cell FLOPs max/mean, after",
                   "worst cell after / before", "bound (largest update / mean)", "auto picks"], rows)


# ============================================================================ moe.json
def moe_planned(d: Data) -> str:
    """bench_moe planned: FLOPs / memory max/mean with stacks whole vs per expert, at each EP size
    (EP 1: one plan over DP; EP > 1: DeepSpeed MoE's plans, experts over the expert-DP group)."""
    p = d["planned"]
    rows = []
    for model, rules in p["models"].items():
        for rule, entries in rules.items():
            for e in entries:
                w, x, j, m = e["whole"], e["per_expert"], e.get("joint"), e.get("per_expert_mixed")
                rows.append([model, rule, str(e["dp"]), str(e["ep"]),
                             f"**{w['flops_ratio']:.3f}** / {w['memory_ratio']:.3f}", _pct(w["padding_fraction"]),
                             f"{w['flops_lower_bound']:.3f}", f"**{x['flops_ratio']:.3f}** / {x['memory_ratio']:.3f}",
                             _pct(x["padding_fraction"]),
                             f"{m['flops_ratio']:.3f} / {m['memory_ratio']:.3f} ({_pct(m['padding_fraction'])})"
                             if m else "-",
                             f"{j['flops_ratio']:.3f} / {j['memory_ratio']:.3f} ({_pct(j['padding_fraction'])})"
                             if j else "-"])
    return _table(["model", "rule", "DP", "EP", f"whole stacks, E/EP per stack ({p['planner']}): FLOPs / memory "
                   "max/mean", "padding", "bound (largest unit)",
                   f"per expert ({p['per_expert_planner']} at EP 1, {p['planner']} at EP > 1): FLOPs / memory",
                   "padding", "per expert, layout \"mixed\" (each group hosts over its own DP group): FLOPs / "
                   "memory (padding)",
                   "per expert, dense and experts seeded by each other's loads (lpt), PLANNER ONLY: "
                   "FLOPs / memory (padding)"], rows)


def moe_measured(d: Data) -> str:
    """bench_moe measured: the matrix rule's thread CPU time per step, CanzonaMuon vs DeepSpeed's Muon."""
    m = d["measured"]
    rows = [[str(r["dp"]), f"{r['canzona']['busiest_ms']:.1f}", f"{r['deepspeed']['busiest_ms']:.1f}",
             f"{r['ratio']:.2f}x", f"{r['canzona']['total_ms']:.1f}", f"{r['deepspeed']['total_ms']:.1f}"]
            for r in m["rows"]]
    return _table(["DP", "CanzonaMuon, busiest rank (ms)", "DeepSpeed Muon, busiest rank (ms)",
                   "DeepSpeed / Canzona (busiest)", "CanzonaMuon, all ranks (ms)", "DeepSpeed Muon, all ranks (ms)"],
                  rows)


# ============================================================================ ns_dtype.json
def ns_dtype(d: Data) -> str:
    """bench_ns_dtype: one Newton-Schulz in bf16 vs fp32 per CPU kind, one thread, and the
    fp32 direction's distance from the bf16 one."""
    rows = []
    for kind, k in d["kinds"].items():
        for r in k["rows"]:
            rows.append([f"{kind} ({k['cpu_capability']})", "x".join(map(str, r["shape"])),
                         f"{1e3 * r['bf16_s']:,.1f}", f"{1e3 * r['fp32_s']:,.1f}", f"{r['bf16_over_fp32']:.1f}x",
                         f"{r['rel_distance']:.4f}", k["auto_chose"].replace("torch.", "")])
    return _table(["CPU kind", "matrix", "bf16 ms", "fp32 ms", "bf16 / fp32", "‖D_fp32 − D_bf16‖ / ‖D_bf16‖",
                   "\"auto\" chose"], rows)


def ns_batch(d: Data) -> str:
    """bench_ns_batch: the owner's matrix step with same-shape Newton-Schulz batched vs one at a
    time, busiest rank's thread CPU ms per DP size and ns_dtype."""
    rows = [[r["ns_dtype"], str(r["dp"]), f"{max(x['matrices'] for x in r['ranks'])}",
             f"{r['busiest_one_at_a_time_ms']:,.1f}", f"{r['busiest_batched_ms']:,.1f}", f"{r['batched_over_one']:.3f}"]
            for r in d["rows"]]
    return _table(["ns_dtype", "DP", "matrices (busiest rank)", "one at a time (ms)", "batched (ms)",
                   "batched / one at a time"], rows)


def qk_clip_overhead(d: Data) -> str:
    """bench_qk_clip: median step time with / without qk_clip, interleaved in one run, and the collective."""
    o = d["overhead"]
    return "\n".join([
        f"| | qk_clip off | qk_clip on (threshold {o['threshold']:g}: heads clip on {o['steps_with_clipped_heads']} "
        f"of {o['steps']} steps) |", "|---|---|---|",
        f"| median ms per step (steps {o['warmup_excluded'] + 1}-{o['steps']}) | {o['median_step_ms_off']:.0f} "
        f"| {o['median_step_ms_on']:.0f} (x{o['ratio_on_over_off']:.3f}) |",
        f"| collective per step | none | one all-reduce(MAX) of {o['collective_bytes_per_step']} bytes "
        "(fp32, one per query head and layer) |"])


def qk_clip_growth(d: Data) -> str:
    """bench_qk_clip: the largest logit per step at a high lr, recorded only vs clipped."""
    g = d["growth"]
    out = [f"| run (muon_lr {g['muon_lr']:g}, {len(next(iter(g['runs'].values()))['max_logit'])} steps) | max logit "
           "step 1 | peak | last step | final loss |", "|---|---|---|---|---|"]
    for name, r in g["runs"].items():
        m = r["max_logit"]
        out.append(f"| {name} | {m[0]:.3g} | {max(m):.3g} | {m[-1]:.3g} | {r['loss'][-1]:.3f} |")
    return "\n".join(out)


TABLES: dict[str, tuple[str, Callable[[Data], str]]] = {
    "ns_dtype": ("ns_dtype", ns_dtype),
    "ckpt_index": ("ckpt_index", ckpt_index),
    "ns_batch": ("ns_batch", ns_batch),
    "qk_clip_overhead": ("qk_clip", qk_clip_overhead),
    "qk_clip_growth": ("qk_clip", qk_clip_growth),
    "fig3_dp": ("paper_experiments", fig3_dp),
    "fig3_tp": ("paper_experiments", fig3_tp),
    "buckets": ("paper_experiments", buckets),
    "fig13_alpha": ("paper_experiments", fig13_alpha),
    "fig14_cmax": ("paper_experiments", fig14_cmax),
    "fig14_sensitivity": ("paper_experiments", fig14_sensitivity),
    "d5_numel_vs_flops": ("paper_experiments", d5_numel_vs_flops),
    "scaling_dp": ("paper_experiments", scaling_dp),
    "scaling_tp": ("paper_experiments", scaling_tp),
    "scaling_model": ("paper_experiments", scaling_model),
    "padding_worst": ("paper_experiments", padding_worst),
    "plan_sweep_numel_vs_flops": ("plan_sweep", plan_sweep_numel_vs_flops),
    "plan_sweep_default": ("plan_sweep", plan_sweep_default),
    "plan_sweep_planners": ("plan_sweep", plan_sweep_planners),
    "plan_rules_paper": ("plan_rules", plan_rules_paper),
    "plan_rules_detail": ("plan_rules", plan_rules_detail),
    "tp_measured": ("tp", tp_measured),
    "tp_simulated": ("tp", tp_simulated),
    "bench_rules": ("bench_rules", bench_rules),
    "bench_muon": ("bench_muon", bench_muon),
    "bench_muon_summary": ("bench_muon", bench_muon_summary),
    "bench_scaling": ("bench_scaling", bench_scaling),
    "bench_zero3": ("bench_zero3", bench_zero3),
    "bench_zero3_goals": ("bench_zero3", bench_zero3_goals),
    "bench_zero3_hosted": ("bench_zero3", bench_zero3_hosted),
    "config_fuzz": ("config_fuzz", config_fuzz),
    "faults": ("faults", _fault_table_entry),
    "dp_exactness": ("dp_exactness", dp_exactness),
    "main_job_run": ("main_job", main_job_run),
    "main_job_plan": ("main_job", main_job_plan),
    "main_job_reference": ("main_job", main_job_reference),
    "main_job_compare": ("main_job", main_job_compare),
    "elastic_rss": ("elastic_rss", elastic_rss),
    "pipeline_planned": ("pipeline", pipeline_planned),
    "pipeline_measured": ("pipeline", pipeline_measured),
    "layout_planned": ("layout_planned", layout_planned),
    "layout_measured": ("layout_measured", layout_measured),
    "layout_measured_tp": ("layout_measured", layout_measured_tp),
    "layout_grid": ("layout_grid", layout_grid),
    "moe_planned": ("moe", moe_planned),
    "moe_measured": ("moe", moe_measured),
}





def load(stem: str, results: Path | str | None = None) -> Data:
    path = Path(results or RESULTS) / f"{stem}.json"
    if not path.is_file():
        raise FileNotFoundError(f"results file {path} does not exist (run the benchmark that writes it)")
    return json.loads(path.read_text())


def render(name: str, results: Path | str | None = None) -> str:
    """The markdown table ``name`` from its results JSON (in ``results``, default benchmarks/results)."""
    if name not in TABLES:
        raise ValueError(f"Unknown table {name!r}. Known: {sorted(TABLES)}")
    stem, fn = TABLES[name]
    return fn(load(stem, results))


def _blocks(text: str) -> tuple[list[re.Match], list[str]]:
    """Complete blocks, and problems (unclosed or nested markers)."""
    blocks = list(BLOCK.finditer(text))
    covered = [(m.start(), m.end()) for m in blocks]
    problems = []
    for m in OPEN.finditer(text):
        inside = [a for a, b in covered if a <= m.start() < b]
        if not inside:
            problems.append(f"block {m.group('name')!r} at offset {m.start()} is not closed by "
                            f"<!-- /table:{m.group('name')} -->")
        elif inside[0] != m.start():
            problems.append(f"block {m.group('name')!r} at offset {m.start()} is nested in another block")
    return blocks, problems


def update_text(text: str, results: Path | str | None = None) -> str:
    """``text`` with every block's inside replaced by its fresh rendering."""
    blocks, problems = _blocks(text)
    if problems:
        raise ValueError("; ".join(problems))
    cache: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in cache:
            cache[name] = render(name, results)
        return f"<!-- table:{name} -->\n{cache[name]}\n<!-- /table:{name} -->"

    return BLOCK.sub(sub, text)


def check_text(text: str, results: Path | str | None = None) -> list[str]:
    """Names of stale blocks (and problems) in ``text``; empty when all are in sync."""
    blocks, problems = _blocks(text)
    stale = list(problems)
    for m in blocks:
        name = m.group("name")
        try:
            fresh = render(name, results)
        except (ValueError, FileNotFoundError, KeyError) as e:
            stale.append(f"{name}: cannot render ({e})")
            continue
        if m.group("body") != fresh + "\n":
            stale.append(f"{name}: stale (differs from its rendering of {TABLES[name][0]}.json)")
    return stale


def paper_experiments_markdown(d: Data) -> str:
    """benchmarks/results/paper_experiments.md, from its JSON."""
    f3 = d["fig3"]
    plans = {r["label"]: r for r in f3["plans"]}
    pn, pm = plans["paper_naive, DeepSpeed buckets"], plans["paper_naive, Megatron buckets"]
    an = plans["alpha_balanced (numel), DeepSpeed buckets"]
    de = plans[f"{d['default_dp_planner']} (default)"]
    bk = d["buckets"]
    alpha_span = [r["alpha_numel"]["flops_ratio"] for r in bk["rows"] if r["buckets"] > 1]
    f14 = d["fig14"]
    s14 = f14["summary"]
    rates = f14["rates"]
    claim = d["padding"]["claim"]
    paper14 = d["paper"]["fig14"]
    paper_set = f14["settings"][0]
    nofuse, dflt = paper_set["rows"][0], paper_set["rows"][1]
    lines = [
        "# The Canzona paper's experiments, side by side (generated by `python benchmarks/paper_experiments.py`)",
        "",
        f"Command: `{d['command']}`. Optimizer: Muon ({json.dumps(d['optimizer'])}). Every number below is in "
        "`paper_experiments.json` and is a property of plans (no GPU, no processes), except the Figure 14 step "
        "times, which come from a stated step-time model with ASSUMED rates "
        f"(R = {rates['tflops']:g} TFLOP/s, B = {rates['gbps']:g} GB/s, L = {rates['latency_us']:g} us per "
        f"collective; {f14['rate_source']}). The paper's numbers are measured on GPUs; ours are planned loads "
        "(R_LB = max/mean per rank, eq. 6), so they compare layouts, not wall time. Plots: "
        + ", ".join(f"`{p}`" for p in d.get("plots", [])) + ".",
        "",
        f"## Figure 3c: DP load ratios ({f3['model']}, DP={f3['dp']}, TP={f3['tp']}, {f3['matrices']} matrices "
        "per TP rank)",
        "",
        fig3_dp(d),
        "",
        f"The paper does not state its bucket size. Megatron-Core's default (overlap on) is max(40M, 1M x DP) = "
        f"{_bucket(f3['megatron_bucket_numel'])} elements at DP={f3['dp']}: eq. 1 then gives "
        f"{pm['flops_ratio']:.1f}x (the first matrix of each of the {pm.get('buckets', '?')} buckets lands on rank 0). "
        f"DeepSpeed's reduce_bucket_size ({_bucket(f3['deepspeed_bucket_numel'])}, our default for both "
        f"bucketed planners) gives {pn['flops_ratio']:.2f} / {pn['memory_ratio']:.2f} against the paper's "
        f"{d['paper']['fig3_dp']['naive']['flops_ratio']} / {d['paper']['fig3_dp']['naive']['memory_ratio']}; "
        "bucket sizes whose eq. 1 FLOPs ratio is within 0.4 of 3.24: "
        + (", ".join(_bucket(b) for b in bk["within_0.4_of_paper_naive"]) or "none") + ". No bucket size reproduces "
        f"the paper's alpha-balanced {d['paper']['fig3_dp']['alpha_balanced']['flops_ratio']}: Algorithm 1 with W = "
        f"numel gives {an['flops_ratio']:.3f} at {_bucket(f3['deepspeed_bucket_numel'])} and "
        f"{min(alpha_span):.2f}-{max(alpha_span):.2f} across the bucket sizes below one bucket (table below). "
        "The paper's memory "
        "ratio is measured peak GPU memory (diluted by replicated parameters and activations); ours counts only "
        f"what the DP owner holds (fp32 master + gradient + Muon momentum). Our default `{d['default_dp_planner']}` "
        f"reaches {de['flops_ratio']:.3f} / {de['memory_ratio']:.3f} with {_pct(de['padding_fraction'])} padding.",
        "",
        "### eq. 1 and Algorithm 1 over bucket sizes (same model and layout)",
        "",
        buckets(d),
        "",
        "## Figure 3b: TP load ratios",
        "",
        fig3_tp(d),
        "",
        f"The paper's TP pair ({d['paper']['fig3_tp']['naive']['flops_ratio']} naive, "
        f"{d['paper']['fig3_tp']['micro_group']['flops_ratio']} micro-groups) repeats its DP naive pair "
        f"({d['paper']['fig3_dp']['naive']['flops_ratio']} / {d['paper']['fig3_dp']['naive']['memory_ratio']}) digit "
        "for digit, which suggests a copy slip in its text. In the TP group of one DP rank the bound is set by that "
        "rank's largest full matrix against the mean of the few matrices it owns.",
        "",
        "## Figure 13: alpha sweep of Algorithm 1",
        "",
        "Cells: FLOPs R_LB (J_comm / elements, eq. 3). The paper's setting is Qwen3-32B on PP=8 x DP=16 (TP=1): one "
        "pipeline stage (layers 0-7) planned over 16 ranks.",
        "",
        fig13_alpha(d),
        "",
        "## Figure 14: C_max of the TP micro-groups (simulated)",
        "",
        fig14_cmax(d),
        "",
        fig14_sensitivity(d),
        "",
        f"Paper (§C.6, {paper14['setting']}): No-Fuse {paper14['no_fuse_s']} s, fused {paper14['fused_s']} s, plateau "
        f"from ~512 MB. Ours in its setting: No-Fuse {1e3 * nofuse['pipelined_s']:.0f} ms vs "
        f"{1e3 * dflt['pipelined_s']:.0f} ms fused (pipelined), and every C_max from the smallest valid value (the "
        f"largest task, a full fc1 = {_mib(paper_set['largest_task_mib'])} of fp32 gradient, already on the paper's "
        "plateau) gives one micro-group, so C_max has no effect there. Over all settings and "
        f"{s14['cells']} (latency, bandwidth) cells the default is within 1% of the best C_max for the pipelined "
        f"runtime in {s14['default_within_1pct_pipelined']} (worst "
        f"{s14['worst_pipelined']['default_over_best_pipelined']:.3f}, {s14['worst_pipelined']['setting']}, "
        f"L={s14['worst_pipelined']['latency_us']:g} us, B={s14['worst_pipelined']['gbps']:g} GB/s); the blocking "
        f"runtime prefers fewer, larger groups (worst default/best {s14['worst_blocking']['default_over_best_blocking']:.3f}, "
        f"{s14['worst_blocking']['setting']}, L={s14['worst_blocking']['latency_us']:g} us). Our No-Fuse is modelled "
        "as our runtime runs it: one matrix per group, so only its host computes while the others wait on the next "
        "collective.",
        "",
        "## §D.5: numel vs FLOPs as the planner's cost",
        "",
        d5_numel_vs_flops(d),
        "",
        f"Paper (§D.5, {d['paper']['d5']['setting']}): {d['paper']['d5']['flops_s']} s (FLOPs) vs "
        f"{d['paper']['d5']['numel_s']} s (numel), measured. Ours: planned FLOPs of the busiest DP rank; a ratio "
        "below 1 means the numel-planned plan happens to be better on FLOPs.",
        "",
        "## Figures 8 and 9: scaling (planned FLOPs R_LB, padding in parentheses)",
        "",
        "Figure 8a (Qwen3-32B, TP=4):",
        "",
        scaling_dp(d),
        "",
        "Figure 8b (Qwen3-32B, PP=4 stage 0, DP=4):",
        "",
        scaling_tp(d),
        "",
        "Figure 9 (DP=16, TP=4):",
        "",
        scaling_model(d),
        "",
        "`paper_naive`'s padding is what it would cost in our planned (equal-range) layout; the paper realises its "
        "plans with variable-size partitions, which have none.",
        "",
        "## Padding of the planned layout",
        "",
        "The planned layout gives every DP rank an equal range (DeepSpeed's equal-chunk code runs unchanged) and pays "
        "for it in padding: the replicated bf16 parameter buffer and the post-step all-gather carry "
        "`dp * P - S` extra elements. Padding is not a floor for every atomic layout: the paper's variable-size "
        "partitions (non-uniform reduce-scatter/all-gather) have none; the configuration-LP bound in plan_sweep is a "
        "floor for equal-range layouts only. Worst cases of the default plan over Qwen3 0.6B-32B x TP 1-8 x DP 8-128 "
        "(bf16 parameters, one TP rank's matrix buffer):",
        "",
        padding_worst(d),
        "",
        f"Padding > 2%: {claim['over_2pct']} of {claim['configs']} configurations; at DP <= 16: "
        + (", ".join(claim["dp_le_16_over_2pct"]) or "none") + "; Qwen3-32B: "
        + (", ".join(claim["qwen3_32b_over_2pct"]) or "none") + ".",
        "",
        f"Generated in {d['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--update", nargs="+", metavar="FILE", help="rewrite every table block in these files")
    group.add_argument("--check", nargs="+", metavar="FILE", help="exit 1 if a block in these files is stale")
    group.add_argument("--render", metavar="NAME", help="print one table")
    group.add_argument("--list", action="store_true", help="table names and their results files")
    ap.add_argument("--results", default=str(RESULTS), help="directory of the results JSON files")
    args = ap.parse_args(argv)
    if args.list:
        for name, (stem, fn) in TABLES.items():
            print(f"{name:28s} {stem}.json  {((fn.__doc__ or '').strip().splitlines() or [''])[0]}")
        return 0
    if args.render:
        try:
            print(render(args.render, args.results))
        except (ValueError, FileNotFoundError) as e:
            print(f"tables: error: {e}", file=sys.stderr)
            return 2
        return 0
    bad = 0
    for f in args.update or args.check:
        path = Path(f)
        text = path.read_text()
        if args.update:
            try:
                new = update_text(text, args.results)
            except (ValueError, FileNotFoundError) as e:
                print(f"{path}: {e}", file=sys.stderr)
                bad += 1
                continue
            if new != text:
                path.write_text(new)
                print(f"{path}: updated")
        else:
            for problem in check_text(text, args.results):
                print(f"{path}: {problem}", file=sys.stderr)
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

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

Every table is one :class:`Table` in :data:`TABLES`: its results file
(``benchmarks/results/<stem>.json``), where its rows come from (a dotted path into the JSON, or
a function of it returning one mapping per row) and its columns, each a :class:`Col` of a
header and a cell.  A cell is a ``str.format`` template over the row (``"{flops_ratio:.3f}"``,
``"{plans[0][flops_ratio]:.2f}"``) or a function of the row; a header is a template over the
whole JSON.  :func:`render_table` is the one renderer.  On top of Python's format specs a
template understands (see :class:`_CellFormatter`)::

    {x:pct}  {x:pct0}  {x:pct2}   100 x with 1 / 0 / 2 decimals and "%"
    {x:mib}  {x:gib}  {x:bucket}  MiB or GiB (x in MiB); GiB (x in bytes); 20M / 1G elements (None:
                                  "one bucket")
    {x:split}                     ", N split" (nothing when N is 0)
    {x:ms.1f}  {x:MB.2f}  {x:MiB,.3f}  {x:G.3f}   x * 1e3, x / 1e6, x / 2**20, x / 1e9, then the spec
    {x:x.2f}                      the spec, then "x" (a ratio)
    {xs:list.1f}                  every item with the spec, joined by ", "

A field that is None renders as the table's ``none`` ("-" unless it says otherwise), and a
field that is already text renders as is (rows mixing the paper's quoted figures, as text,
with ours, as numbers, share one column spec).  ``benchmarks/paper_experiments.py`` and
``benchmarks/bench_zero3.py`` build their markdown from the same tables
(:func:`paper_experiments_markdown`, :func:`bench_zero3_markdown`).
"""

import argparse
import json
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->\n(?P<body>.*?)<!-- /table:(?P=name) -->", re.S)
OPEN = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->")

Data = dict[str, Any]
Row = Mapping[str, Any]


def _pct(x: float, nd: int = 1) -> str:
    return f"{100 * x:.{nd}f}%"


def _mib(x: float) -> str:
    return f"{x:,.1f} MiB" if x < 1024 else f"{x / 1024:,.2f} GiB"


def _gb(b: float) -> str:
    return f"{b / 2**30:,.2f}" if b >= 2**30 else f"{b / 2**30:,.3f}"


def _bucket(b: int | None) -> str:
    if b is None:
        return "one bucket"
    return f"{b / 1e6:g}M" if b < 1e9 else f"{b / 1e9:g}G"


# ============================================================================ the renderer
class _CellFormatter(string.Formatter):
    """``str.format`` with the named specs of the module docstring; None -> ``none``, text as is."""

    NAMED: dict[str, Callable[[Any], str]] = {
        "pct": _pct, "pct0": lambda x: _pct(x, 0), "pct2": lambda x: _pct(x, 2), "mib": _mib, "gib": _gb,
        "bucket": _bucket, "split": lambda n: f", {n} split" if n else ""}
    SCALES: dict[str, Callable[[float], float]] = {
        "ms": lambda x: 1e3 * x, "MB": lambda x: x / 1e6, "MiB": lambda x: x / 2**20, "G": lambda x: x / 1e9}

    def __init__(self, none: str = "-") -> None:
        super().__init__()
        self.none = none

    def format_field(self, value: Any, spec: str) -> str:
        if spec.startswith("list"):
            return ", ".join(self.format_field(v, spec[4:]) for v in value)
        if value is None and spec != "bucket":  # _bucket names None: "one bucket"
            return self.none
        if isinstance(value, str):
            return value
        if spec in self.NAMED:
            return self.NAMED[spec](value)
        if spec.startswith("x"):
            return self.format_field(value, spec[1:]) + "x"
        for prefix, scale in self.SCALES.items():
            if spec.startswith(prefix):
                return format(scale(value), spec[len(prefix):])
        return format(value, spec)


@dataclass(frozen=True)
class Col:
    """One column: ``header`` (a template over the results JSON), ``cell`` (a template over the
    row, or a function of the row returning its text)."""

    header: str
    cell: str | Callable[[Row], str]


@dataclass(frozen=True)
class Table:
    """One markdown table from ``benchmarks/results/<stem>.json``.

    ``rows``: a dotted path to a list (or dict, its values) in the JSON, or a function of the
    JSON returning the rows; ``cols``: the columns, or a function of the JSON returning them
    (tables with a column per model, planner, alpha, ...); ``none``: the text of a None field."""

    stem: str
    doc: str
    rows: str | Callable[[Data], Iterable[Row]]
    cols: tuple[Col, ...] | Callable[[Data], tuple[Col, ...]]
    none: str = "-"


def _path(d: Data, path: str) -> Any:
    for key in path.split("."):
        d = d[key]
    return d


def render_table(table: Table, d: Data) -> str:
    """``table`` rendered from ``d``, the parsed JSON of its results file."""
    fmt = _CellFormatter(table.none)
    cols = table.cols(d) if callable(table.cols) else table.cols
    rows = table.rows(d) if callable(table.rows) else _path(d, table.rows)
    if isinstance(rows, Mapping):
        rows = rows.values()
    lines = ["| " + " | ".join(fmt.vformat(c.header, (), d) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(c.cell(r) if callable(c.cell) else fmt.vformat(c.cell, (), r) for c in cols)
                     + " |")
    return "\n".join(lines)


def _sub(key: str, template: str, none: str = "-") -> Callable[[Row], str]:
    """A cell formatting ``template`` over the row's ``key`` (a mapping), ``none`` when it is absent."""
    fmt = _CellFormatter(none)
    return lambda r: none if r.get(key) is None else fmt.vformat(template, (), r[key])


def _cols(*pairs: tuple[str, str | Callable[[Row], str]]) -> tuple[Col, ...]:
    return tuple(Col(h, c) for h, c in pairs)


# ============================================================================ paper_experiments.json
def _fig3_dp_rows(d: Data) -> Iterable[Row]:
    p = d["paper"]["fig3_dp"]
    for label, key, kind in (("paper: naive (eq. 1)", "naive", "measured (peak GPU memory)"),
                             ("paper: alpha-balanced (Alg. 1)", "alpha_balanced", "measured, W = numel")):
        yield {"layout": label, "flops": f"{p[key]['flops_ratio']:.2f}", "memory": f"{p[key]['memory_ratio']:.2f}",
               "padding": None, "split": None, "j": None, "kind": kind}
    for r in d["fig3"]["plans"]:
        cost = "-" if r["planner"] in ("paper_naive", "naive_atomic", "equal_chunk") else r["cost"]
        where = ""
        if r["planner"] in ("paper_naive", "alpha_balanced"):
            where = ", one bucket" if r["bucket_numel"] is None else f", {_bucket(r['bucket_numel'])} buckets"
        yield {"layout": f"ours: `{r['planner']}`{where}", "flops": r["flops_ratio"], "memory": r["memory_ratio"],
               "padding": r["padding_fraction"], "split": r["split_matrices"], "j": r["j_comm_fraction"],
               "kind": f"planned, cost {cost}"}
    b = d["fig3"]["bounds"]
    yield {"layout": "lower bound (largest matrix / mean)", "flops": b["flops"], "memory": b["memory"],
           "padding": b["numel"] - 1, "split": None, "j": None, "kind": "any atomic plan"}


_TP_SCHEDULES = (("round_robin", "naive (round-robin hosts)"), ("lpt_rollback", "micro-groups (Alg. 2-4)"))


def _fig3_tp_rows(d: Data) -> Iterable[Row]:
    p = d["paper"]["fig3_tp"]
    no_plan = {"scope": None, "micro_groups": None, "lower": None}
    yield {"schedule": "paper: naive", "flops_ratio": f"{p['naive']['flops_ratio']:.2f}", "memory_ratio": None,
           **no_plan}
    yield {"schedule": "paper: micro-group scheduling", "flops_ratio": f"{p['micro_group']['flops_ratio']:.2f}",
           "memory_ratio": f"{p['micro_group']['memory_ratio']:.2f}", **no_plan}
    for planner in (d["default_dp_planner"], "paper_naive"):
        v = d["fig3"]["tp_views"][planner]
        for name, label in _TP_SCHEDULES:
            r = v["schedulers"][name]
            yield {**r, "schedule": f"ours: {label}", "lower": r["flops_lower_bound"],
                   "scope": f"`{planner}`, rank {v['busiest_dp_rank']} ({v['matrices']} matrices)"}
    w = d["fig3"]["tp_views"]["whole_model"]
    for name, label in _TP_SCHEDULES:
        yield {**w[name], "schedule": f"ours: {label}", "scope": "whole model (DP=1 view)", "lower": None}


def _bucket_rows(d: Data) -> Iterable[Row]:
    b = d["buckets"]
    marks = {b["megatron_bucket_numel"]: " (Megatron default)", b["deepspeed_bucket_numel"]: " (DeepSpeed default)"}
    keep = {20_000_000, 100_000_000, 200_000_000, 300_000_000, 400_000_000, 1_000_000_000, 2_000_000_000,
            b["rows"][-1]["bucket_numel"]} | set(marks)
    return [{**r, "mark": marks.get(r["bucket_numel"], "")} for r in b["rows"] if r["bucket_numel"] in keep]


def _fig13_cols(d: Data) -> tuple[Col, ...]:
    return _cols(("setting", "{label}"), ("cost", "{cost}"), ("buckets", "{buckets} x {bucket_numel:bucket}"),
                 *((f"α={a:g}", f"{{rows[{i}][flops_ratio]:.2f}} ({{rows[{i}][j_comm_fraction]:.2f}})")
                   for i, a in enumerate(d["fig13"]["alphas"])))


def _fig14_sensitivity_rows(d: Data) -> Iterable[Row]:
    sens = d["fig14"]["sensitivity"]
    for label in dict.fromkeys(s["setting"] for s in sens):
        cells = [s for s in sens if s["setting"] == label]
        yield {"setting": label, "cells": len(cells),
               "within": sum(s["default_over_best_pipelined"] <= 1.01 for s in cells),
               "wp": max(cells, key=lambda s: s["default_over_best_pipelined"]),
               "wb": max(cells, key=lambda s: s["default_over_best_blocking"])}


def _scaling_table(key: str, doc: str) -> Table:
    """Figures 8 and 9: FLOPs R_LB (padding) per planner along ``key`` (dp, tp or model)."""
    def rows(d: Data) -> Iterable[Row]:
        labels = [p["label"] for p in d["scaling"]["plans"]]
        return [{**r, "plan": [r["plans"][lab] for lab in labels]} for r in d["scaling"][key]]

    def cols(d: Data) -> tuple[Col, ...]:
        return _cols((key, f"{{{key}}}"),
                     *((p["label"], f"{{plan[{i}][flops_ratio]:.2f}} ({{plan[{i}][padding_fraction]:pct}}"
                                    f"{{plan[{i}][split_matrices]:split}})")
                       for i, p in enumerate(d["scaling"]["plans"])),
                     ("DP LB", "{bounds[flops]:.2f}"),
                     ("TP round-robin / micro-groups (LB)",
                      _sub("tp_busiest", "{round_robin[flops_ratio]:.2f} / {lpt_rollback[flops_ratio]:.2f} "
                                         "({lpt_rollback[flops_lower_bound]:.2f})")))
    return Table("paper_experiments", doc, rows, cols)


def _padding_worst_rows(d: Data) -> Iterable[Row]:
    seen = set()
    for r in d["padding"]["worst_fraction"] + d["padding"]["worst_bytes"]:
        if (r["model"], r["tp"], r["dp"]) not in seen:
            seen.add((r["model"], r["tp"], r["dp"]))
            yield r


PAPER_EXPERIMENTS = {
    "fig3_dp": Table("paper_experiments", "Figure 3c: DP load ratios, Qwen3-32B DP=32 TP=8, paper beside ours.",
                     _fig3_dp_rows, _cols(
                         ("layout", "{layout}"), ("FLOPs R_LB", "{flops:.3f}"), ("memory R_LB", "{memory:.3f}"),
                         ("padding", "{padding:pct}"), ("split", "{split}"), ("J_comm / elements", "{j:.3f}"),
                         ("kind", "{kind}"))),
    "fig3_tp": Table("paper_experiments",
                     "Figure 3b: TP load ratios in the TP group of the busiest DP rank, paper beside ours.",
                     _fig3_tp_rows, _cols(
                         ("TP schedule", "{schedule}"), ("matrices scheduled (DP plan, busiest rank)", "{scope}"),
                         ("FLOPs R_LB", "{flops_ratio:.3f}"), ("memory R_LB", "{memory_ratio:.3f}"),
                         ("micro-groups", "{micro_groups}"), ("lower bound", "{lower:.3f}"))),
    "buckets": Table("paper_experiments", "R_LB of eq. 1 and Algorithm 1 over bucket sizes (Qwen3-32B DP=32 TP=8).",
                     _bucket_rows, _cols(
                         ("bucket (elements)", "{bucket_numel:bucket}{mark}"), ("buckets", "{buckets}"),
                         ("paper_naive FLOPs / memory R_LB",
                          "{paper_naive[flops_ratio]:.2f} / {paper_naive[memory_ratio]:.2f}"),
                         ("alpha_balanced (numel)",
                          "{alpha_numel[flops_ratio]:.2f} / {alpha_numel[memory_ratio]:.2f}"),
                         ("alpha_balanced (flops)",
                          "{alpha_flops[flops_ratio]:.2f} / {alpha_flops[memory_ratio]:.2f}"))),
    "fig13_alpha": Table("paper_experiments",
                         "Figure 13: alpha sweep of Algorithm 1 (FLOPs R_LB and J_comm per setting).",
                         "fig13.settings", _fig13_cols),
    "fig14_cmax": Table("paper_experiments", "Figure 14: simulated TP step per C_max (pipelined / blocking, ms) per "
                        "setting.", lambda d: [{**r, "setting": s["label"]} for s in d["fig14"]["settings"]
                                               for r in s["rows"]], _cols(
                            ("setting", "{setting}"), ("C_max", "{c_max}"),
                            ("C_max (fp32 grad per host)", "{c_max_mib:mib}"), ("groups", "{groups}"),
                            ("pipelined ms", "{pipelined_s:ms.1f}"), ("blocking ms", "{blocking_s:ms.1f}"),
                            ("serial FLOPs ratio", "{serial_ratio:.3f}"),
                            ("peak gathered per host", "{peak_host_mib:mib}"))),
    "fig14_sensitivity": Table("paper_experiments", "Figure 14 robustness: the default C_max (largest task) vs the "
                               "best, over latency x bandwidth.", _fig14_sensitivity_rows, _cols(
                                   ("setting", "{setting}"), ("(L, B) cells", "{cells}"),
                                   ("default within 1% of best, pipelined", "{within}"),
                                   ("worst default / best, pipelined", "{wp[default_over_best_pipelined]:.3f} "
                                    "(L={wp[latency_us]:g} us, B={wp[gbps]:g} GB/s)"),
                                   ("worst default / best, blocking", "{wb[default_over_best_blocking]:.3f} "
                                    "(L={wb[latency_us]:g} us, B={wb[gbps]:g} GB/s, best {wb[best_blocking]})"))),
    "d5_numel_vs_flops": Table("paper_experiments",
                               "§D.5: planned FLOPs makespan of numel-planned vs flops-planned plans.",
                               "d5.rows", _cols(
                                   ("model", "{model}"), ("DP", "{dp}"), ("TP", "{tp}"), ("planner", "{planner}"),
                                   ("max-rank TFLOP, W=numel", "{numel_planned_tflop:.2f}"),
                                   ("max-rank TFLOP, W=flops", "{flops_planned_tflop:.2f}"),
                                   ("numel / flops", "{ratio:.4f}"),
                                   ("Δ ms at {d5[tflops]:g} TFLOP/s", "{delta_ms_at_rate:+.2f}"))),
    "scaling_dp": _scaling_table("dp", "Figure 8a: Qwen3-32B TP=4, DP 8 -> 128: FLOPs R_LB (padding) per planner."),
    "scaling_tp": _scaling_table("tp", "Figure 8b: Qwen3-32B PP=4 (stage 0) DP=4, TP 1 -> 8."),
    "scaling_model": _scaling_table("model", "Figure 9: DP=16 TP=4, Qwen3 1.7B -> 32B."),
    "padding_worst": Table("paper_experiments", "The default plan's padding, worst configurations (by fraction and "
                           "by bytes), per GPU.", _padding_worst_rows, _cols(
                               ("model", "{model}"), ("DP", "{dp}"), ("TP", "{tp}"),
                               ("padding / matrix elements", "{padding_fraction:pct}"),
                               ("padding elements (one TP rank)", "{padding_elements:,}"),
                               ("replicated bf16 buffer, extra per GPU", "{replicated_mib_bf16:mib}"),
                               ("all-gather, extra received per GPU per step", "{allgather_extra_mib_bf16:mib}"))),
}


# ============================================================================ plan_sweep.json, plan_rules.json
def _plan_sweep_default_rows(d: Data) -> Iterable[Row]:
    key = f"dp.{d['default_dp_planner']}"
    for m in dict.fromkeys(r["model"] for r in d["rows"]):
        row: dict[str, Any] = {"model": m}
        for dp in sorted({r["dp"] for r in d["rows"]}):
            rs = [r for r in d["rows"] if r["model"] == m and r["dp"] == dp]
            row[f"dp{dp}"] = {"flops": max(r[key]["flops_ratio"] for r in rs),
                              "padding": max(r[key]["padding_fraction"] for r in rs)}
        yield row


def _plan_sweep_planner_rows(d: Data) -> Iterable[Row]:
    row = next(r for r in d["rows"] if (r["model"], r["dp"], r["tp"]) == ("qwen3-32b", 32, 8))
    for k, v in row.items():
        if k.startswith("dp.") and k != "dp.bound":
            yield {**v, "planner": f"`{k[3:]}`"}
    b = row["dp.bound"]
    yield {"planner": "lower bound", "flops_ratio": b["flops_lower_bound"], "memory_ratio": b["memory_lower_bound"],
           "padding_fraction": b["numel_lower_bound"] - 1, "split_matrices": None}


def _plan_rules_paper_rows(d: Data) -> Iterable[Row]:
    paper_naive = d["paper"]["naive_flops_ratio"]
    naive = [("naive, eq. 1 (`paper_naive`)", paper_naive, "paper_naive")] \
        if "paper_naive" in next(iter(d["whole_model"].values()))["planners"] else []
    for title, paper, planner in (*naive,
                                  ("atomic, unbalanced (`naive_atomic`)", "-" if naive else paper_naive,
                                   "naive_atomic"),
                                  ("DeepSpeed stock ZeRO-1 (`equal_chunk`)", "-", "equal_chunk"),
                                  (f"balanced (ours: `{d['default_dp_planner']}`)", d["paper"]["balanced_flops_ratio"],
                                   d["default_dp_planner"]),
                                  ("lower bound (LP)", "-", None)):
        pairs = {}
        for lab in d["whole_model"]:
            entries = [d[sec][lab] for sec in ("whole_model", "pp_stage0")]
            pairs[lab] = [e["lower_bound"]["flops_lp"] if planner is None else e["planners"][planner]["flops_ratio"]
                          for e in entries]
        yield {"title": title, "paper": paper, "pairs": pairs}


def _plan_rules_paper_cols(d: Data) -> tuple[Col, ...]:
    fmt = _CellFormatter()
    return _cols(("", "{title}"), ("paper (§C.4, Fig. 12)", "{paper}"),
                 *((f"ours: {lab}", lambda r, lab=lab: " / ".join(fmt.format_field(x, ".3f") for x in r["pairs"][lab]))
                   for lab in d["whole_model"]))


PLANS = {
    "plan_sweep_numel_vs_flops": Table(
        "plan_sweep", "plan_sweep: FLOPs makespan of numel-planned / flops-planned plans.",
        lambda d: [{"model": e["model"], "dp": e["dp"], "tp": e["tp"], "planner": planner, "ratio": v["ratio"]}
                   for e in d["numel_vs_flops"] for planner, v in e.items() if isinstance(v, dict)],
        _cols(("model", "{model}"), ("dp", "{dp}"), ("tp", "{tp}"), ("planner", "{planner}"),
              ("makespan numel-planned / flops-planned", "{ratio:.4f}"))),
    "plan_sweep_default": Table(
        "plan_sweep", "plan_sweep: the default planner's FLOPs R_LB (padding) per model x DP, worst over TP.",
        _plan_sweep_default_rows,
        lambda d: _cols(("model", "{model}"), *((f"DP={dp}", f"{{dp{dp}[flops]:.3f}} ({{dp{dp}[padding]:pct}})")
                                                for dp in sorted({r["dp"] for r in d["rows"]})))),
    "plan_sweep_planners": Table(
        "plan_sweep", "plan_sweep: every DP planner at Qwen3-32B DP=32 TP=8 (FLOPs / memory R_LB, padding).",
        _plan_sweep_planner_rows,
        _cols(("planner (Qwen3-32B DP=32 TP=8)", "{planner}"), ("FLOPs R_LB", "{flops_ratio:.3f}"),
              ("memory R_LB", "{memory_ratio:.3f}"), ("padding", "{padding_fraction:pct}"),
              ("split", "{split_matrices}"))),
    "plan_rules_paper": Table(
        "plan_rules", "plan_rules: Shampoo/SOAP DP FLOPs R_LB, paper (Fig. 12) beside ours, PP=1 / PP=2.",
        _plan_rules_paper_rows, _plan_rules_paper_cols),
    "plan_rules_detail": Table(
        "plan_rules", "plan_rules: every rule x planner over the whole model.",
        lambda d: [{**r, "rule": lab, "planner": name} for lab, e in d["whole_model"].items()
                   for name, r in e["planners"].items()],
        _cols(("rule", "{rule}"), ("planner", "{planner}"), ("FLOPs max/mean", "{flops_ratio:.3f}"),
              ("peak FLOPs max/mean", "{peak_flops_ratio:.3f}"), ("memory max/mean", "{memory_ratio:.3f}"),
              ("padding", "{padding_fraction:pct}{split_matrices:split}"))),
}


# ============================================================================ pipeline.json, tp.json
def _pipeline_planned_rows(d: Data) -> Iterable[Row]:
    p = d["planned"]
    for label, stages in p["rules"].items():
        for k, e in enumerate(stages):
            yield {**e, "rule": label, "stage": f"{k} of {p['pp']}"}


def _pipeline_planned_cols(d: Data) -> tuple[Col, ...]:
    default = d["planned"]["default_dp_planner"]

    def cell(name: str) -> str:  # the default planner's in bold
        pair = f"{{planners[{name}][flops_ratio]:.3f}} / {{planners[{name}][memory_ratio]:.3f}}"
        return f"**{pair}**" if name == default else pair

    return _cols(("rule", "{rule}"), ("stage", "{stage}"), ("matrices", "{matrices}"),
                 *((f"`{name}` FLOPs / memory", cell(name)) for name in ("naive_atomic", "equal_chunk", default)),
                 ("FLOPs LP bound", "{lower_bound[flops_lp]:.3f}"))


TP_LABELS = {"sc": "TP-SC (all-gather + redundant update)", "asc-blocking": "TP-ASC micro-groups, blocking",
             "asc-pipelined": "TP-ASC micro-groups, pipelined", "asc-no-fusion": "no fusion (one matrix per group)",
             "local": "shard-local (DeepSpeed Muon under AutoTP)"}


def _tp_measured_rows(d: Data) -> Iterable[Row]:
    m = d["measured"]
    for label in TP_LABELS:
        if label in m:
            r = m[label]
            yield {"strategy": TP_LABELS[label], "vs_sc": r["step_s"] / m["sc"]["step_s"],
                   "collectives": ", ".join(f"{v} {k}" for k, v in r["collectives"].items()) or "0",
                   "bytes": max(r["bytes_sent"]),
                   "exact": f"no: {100 * m['local_rel_dev']:.0f}% off" if label == "local" else "yes"}


def _tp_simulated_rows(d: Data) -> Iterable[Row]:
    for s in d["simulated"]:
        scope = "whole model" if s["dp"] == 1 else f"busiest DP rank of DP={s['dp']}"
        yield {"setting": f"{s['model']} TP={s['tp']}, {scope}", "schedule": "SC",
               "makespan_blocking_s": s["SC"]["makespan_s"], "makespan_pipelined_s": None,
               "collectives": s["SC"]["collectives"], "flops_ratio": "1.00"}
        for lab in ("ASC", "LB-ASC", "LB-ASC no-fuse"):
            yield {**s[lab], "setting": "", "schedule": lab}


PIPELINE_TP = {
    "pipeline_planned": Table(
        "pipeline", "bench_pipeline planned part: per-stage FLOPs / memory max/mean, Fig. 12 setting with PP=2.",
        _pipeline_planned_rows, _pipeline_planned_cols),
    "pipeline_measured": Table(
        "pipeline", "bench_pipeline measured part: PP=2 x DP=2, per stage busiest/mean rule CPU time beside the plan.",
        "measured.rows",
        _cols(("rule", "{rule}"), ("planner", "`{planner}`"), ("stage", "{stage}"),
              ("planned FLOPs max/mean", "{planned_flops_ratio:.3f}"),
              ("measured rule CPU max/mean", "{measured_ratio:.3f}"),
              ("rule CPU ms / step, DP rank 0, 1", "{rule_cpu_ms_per_step:list.1f}"),
              ("planned GFLOP / step, DP rank 0, 1", "{planned_gflop_per_rank:list.3f}"),
              ("matrices per rank", "{matrices_per_rank:list}"))),
    "tp_measured": Table(
        "tp", "bench_tp measured part: TP=2 step time vs TP-SC, collectives, bytes, exactness.", _tp_measured_rows,
        _cols(("strategy", "{strategy}"), ("step time vs TP-SC (median)", "{vs_sc:x.2f}"),
              ("collectives / step", "{collectives}"), ("bytes sent / rank", "{bytes:MiB.1f} MiB"),
              ("exact vs TP=1", "{exact}"))),
    "tp_simulated": Table(
        "tp", "bench_tp simulated part: SC / ASC / LB-ASC step per scope.", _tp_simulated_rows,
        _cols(("setting", "{setting}"), ("schedule", "{schedule}"), ("step blocking (s)", "{makespan_blocking_s:.3f}"),
              ("step pipelined (s)", "{makespan_pipelined_s:.3f}"), ("collectives", "{collectives}"),
              ("FLOPs max/avg", "{flops_ratio:.2f}"))),
}


# ============================================================================ bench_rules / bench_muon / bench_zero3
def _ratio(r: Row | None, base: Row | None, key: str) -> float | None:
    return r[key] / base[key] if r and base else None


def _bench_rules_rows(d: Data) -> Iterable[Row]:
    rows = d["rows"]
    for r in rows.values():
        rule, placement = r["kind"].split("/")
        yield {**r, "rule": rule, "placement": placement,
               "vs_replicated": _ratio(r, rows.get(f"{rule}/replicated@dp{r['dp']}"), "opt_cpu_busiest_ms"),
               "vs_naive": _ratio(r, rows.get(f"{rule}/naive@dp{r['dp']}"), "opt_cpu_busiest_ms"),
               "opt_cpu_mean_busiest_ms": r.get("opt_cpu_mean_busiest_ms")}


def _bench_muon_summary_rows(d: Data) -> Iterable[Row]:
    rows = d["rows"]

    def mb(*rs: Row | None) -> str:
        return " / ".join("-" if r is None else f"{r['bytes_max_rank'] / 1e6:.2f}" for r in rs)

    def row(setting: str, dp: int, ours: Row, theirs: Row, *others: Row | None) -> Row:
        return {"setting": setting, "dp": dp, "mat": ours["mat_cpu_busiest_ms"] / theirs["mat_cpu_busiest_ms"],
                "iter": ours["iter_ms"] / theirs["iter_ms"], "bytes": mb(ours, theirs, *others)}

    for dp in sorted({r["dp"] for r in rows.values() if r["dp"] > 1}):
        adamw, owner = rows.get(f"adamw/stage1@dp{dp}"), rows.get(f"adamw/stage1+reduce_to_owner@dp{dp}")
        for setting in ("stage1", "stage2", "stage1+offload", "stage2+offload"):
            ours, theirs = rows.get(f"canzona/{setting}@dp{dp}"), rows.get(f"ds_muon/{setting}@dp{dp}")
            if ours and theirs:
                yield row(f"ZeRO {setting}, vs DeepSpeed Muon", dp, ours, theirs, adamw, owner)
        lw, ours = rows.get(f"layerwise/stage0@dp{dp}"), rows.get(f"canzona/stage1@dp{dp}")
        if lw and ours:
            yield row("ZeRO stage1, vs NV-layerwise (ZeRO 0 + broadcast)", dp, ours, lw, None, None)


#: bench_zero3 kinds -> how the tables name them
ZERO3_KINDS = {"ds_muon": "DeepSpeed Muon, stage 3", "hosted": "Canzona hosted step",
               "engine": "Canzona ZeRO-3 engine", "replicated": "replicated, stage 3"}


def _zero3_rows(d: Data) -> Iterable[Row]:
    """Per DP and rule: Muon against DeepSpeed's Muon, the others against the replicated
    baseline; the baselines themselves (ratios 1)."""
    rows = d["rows"]
    for dp in sorted({r["dp"] for r in rows.values()}):
        for rule in d["rules"]:
            base = rows.get(f"ds_muon@dp{dp}" if rule == "muon" else f"replicated/{rule}@dp{dp}")
            if base:
                yield {**base, "rule": rule, "vs_base_cpu": 1.0, "vs_base_bytes": 1.0}
            kind = "engine" if f"engine/{rule}@dp{dp}" in rows else "hosted"
            r = rows.get(f"{kind}/{rule}@dp{dp}")
            if r:
                yield {**r, "rule": rule, "vs_base_cpu": _ratio(r, base, "rule_cpu_busiest_ms") if base else 1.0,
                       "vs_base_bytes": _ratio(r, base, "bytes_busiest") if base else 1.0}


def _zero3_hosted_rows(d: Data) -> Iterable[Row]:
    rows = d["rows"]
    for key, h in rows.items():
        if h["kind"].startswith("hosted/"):
            e = rows.get(key.replace("hosted/", "engine/")) or {}
            yield {**h, "rule": h["kind"].split("/")[1], "e_busiest": e.get("rule_cpu_busiest_ms"),
                   "e_total": e.get("rule_cpu_total_ms"), "e_bytes": e.get("bytes_busiest")}


def _zero3_goal_rows(d: Data) -> Iterable[Row]:
    """Issue 16's goals at the largest DP: (goal, target, measured, met)."""
    g, rows = d["goals"], d["rows"]
    top, low = g["dp"], min(r["dp"] for r in rows.values())

    def goal(what: str, target: str, measured: str, met: bool) -> Row:
        return {"goal": what, "target": target, "measured": measured, "met": "yes" if met else "no"}

    if "busiest_vs_ds_muon" in g:
        yield goal(f"Muon busiest rank vs DeepSpeed Muon's busiest, DP={top}", "<= 0.92x",
                   f"{g['busiest_vs_ds_muon']:.2f}x", g["busiest_vs_ds_muon"] <= 0.92)
        yield goal(f"Muon busiest rank vs its own mean, DP={top}", "<= 1.05x",
                   f"{g['busiest_vs_own_mean']:.2f}x (DeepSpeed Muon: {g['ds_busiest_vs_own_mean']:.2f}x)",
                   g["busiest_vs_own_mean"] <= 1.05)
    for rule in d["rules"]:
        ratios = g.get(f"{rule}_total_vs_dp{low}")
        if not ratios:
            continue
        ours = [r for r in rows.values() if r["kind"] == f"{g.get('source', 'hosted')}/{rule}"]
        calls = {sum(r["rule_calls_per_rank"]) for r in ours}
        flops = {round(sum(r["extra_per_rank"][0]["plan_load"]) / 1e9, 2) for r in ours}
        cpu = ", ".join(f"{v:.2f}x (DP={k})" for k, v in ratios.items() if int(k) != low)
        if rule == "muon":
            ds = {r["dp"]: r["rule_cpu_total_ms"] for r in rows.values() if r["kind"] == "ds_muon"}
            if low in ds and top in ds:
                cpu += f"; DeepSpeed Muon (same calls): {ds[top] / ds[low]:.2f}x (DP={top})"
        yield goal(f"{rule}: total rule work does not grow with DP", "rule calls and planned FLOPs per step constant",
                   f"{min(calls):.0f} calls, {min(flops):g} GFLOP planned (amortised) at every DP; CPU total vs "
                   f"DP={low}: {cpu}", len(calls) == 1 and len(flops) == 1)
    if "bytes_vs_ds_muon" in g:
        yield goal(f"bytes per step vs DeepSpeed Muon stage 3, DP={top}", "<= 0.8x", f"{g['bytes_vs_ds_muon']:.2f}x",
                   g["bytes_vs_ds_muon"] <= 0.8)


BENCH_ZERO = {
    "bench_rules": Table(
        "bench_rules", "bench_zero --suite rules: optimizer CPU ms of the busiest rank per rule x DP x placement.",
        _bench_rules_rows,
        _cols(("rule", "{rule}"), ("DP", "{dp}"), ("placement", "{placement}"),
              ("optimizer CPU ms, busiest rank (median)", "{opt_cpu_busiest_ms:.1f}"),
              ("vs replicated", "{vs_replicated:x.2f}"), ("vs naive", "{vs_naive:x.2f}"),
              ("mean (with refresh steps)", "{opt_cpu_mean_busiest_ms:.1f}"),
              ("optimizer CPU ms, total", "{opt_cpu_total_ms:.1f}"), ("iteration ms (wall)", "{iter_ms:.1f}"))),
    "bench_muon": Table(
        "bench_muon",
        "bench_zero --suite muon: CanzonaMuon vs DeepSpeed Muon vs AdamW, stages 1/2, offload, layerwise.", "rows",
        _cols(("kind", "{kind}"), ("DP", "{dp}"), ("iteration ms (wall)", "{iter_ms:.1f}"),
              ("matrix rule CPU ms, busiest rank", "{mat_cpu_busiest_ms:.1f}"),
              ("optimizer step CPU ms, busiest rank", "{opt_cpu_busiest_ms:.1f}"),
              ("MB sent / iteration, busiest rank", "{bytes_max_rank:MB.2f}"))),
    "bench_muon_summary": Table(
        "bench_muon", "bench_zero --suite muon, the ratios: CanzonaMuon over DeepSpeed's Muon per setting (DP > 1).",
        _bench_muon_summary_rows,
        _cols(("setting", "{setting}"), ("DP", "{dp}"),
              ("matrix rule CPU, busiest rank: CanzonaMuon / baseline", "{mat:x.2f}"),
              ("iteration (wall): CanzonaMuon / baseline", "{iter:x.2f}"),
              ("MB sent per iteration: CanzonaMuon / baseline / stock AdamW / AdamW reducing to owners", "{bytes}"))),
    "bench_scaling": Table(
        "bench_scaling", "bench_zero --suite scaling: the matrix optimizer's per-rank CPU time at DP 2/4/8.",
        lambda d: [{**r, "optimizer": r["kind"].split("/")[0],
                    "vs_ds": _ratio(r, d["rows"].get(f"ds_muon/stage1@dp{r['dp']}"), "mat_cpu_busiest_ms")}
                   for r in d["rows"].values()],
        _cols(("DP", "{dp}"), ("optimizer", "{optimizer}"), ("matrix CPU ms, busiest rank", "{mat_cpu_busiest_ms:.1f}"),
              ("total over ranks", "{mat_cpu_total_ms:.1f}"), ("per rank", "{mat_cpu_per_rank_ms:list.0f}"),
              ("busiest vs DeepSpeed Muon", "{vs_ds:x.2f}"))),
    "bench_zero3": Table(
        "bench_zero3", "bench_zero3: rule work and bytes per optimizer step at ZeRO stage 3, DP 2/4/8.", _zero3_rows,
        _cols(("DP", "{dp}"), ("rule", "{rule}"), ("optimizer", lambda r: ZERO3_KINDS[r["kind"].split("/")[0]]),
              ("rule CPU ms / step, busiest rank", "{rule_cpu_busiest_ms:.1f}"),
              ("mean over ranks", "{rule_cpu_mean_ms:.1f}"),
              ("busiest / mean", lambda r: f"{r['rule_cpu_busiest_ms'] / r['rule_cpu_mean_ms']:.2f}x"),
              ("total over ranks", "{rule_cpu_total_ms:.1f}"), ("busiest vs baseline", "{vs_base_cpu:x.2f}"),
              ("MB sent / step, busiest rank", "{bytes_busiest:MB.2f}"),
              ("bytes vs baseline", "{vs_base_bytes:x.2f}"))),
    "bench_zero3_goals": Table("bench_zero3", "bench_zero3: issue 16's goals at the largest DP, measured.",
                               _zero3_goal_rows,
                               _cols(("goal (issue 16)", "{goal}"), ("target", "{target}"), ("measured", "{measured}"),
                                     ("met", "{met}"))),
    "bench_zero3_hosted": Table(
        "bench_zero3", "bench_zero3: the engine-free hosted step beside the engine (a cross-check of the engine's "
        "rule work; its bytes = stock ZeRO-3's + the hosted all-to-alls, no clipping norm).", _zero3_hosted_rows,
        _cols(("DP", "{dp}"), ("rule", "{rule}"), ("hosted step: rule CPU ms, busiest", "{rule_cpu_busiest_ms:.1f}"),
              ("engine: busiest", "{e_busiest:.1f}"), ("hosted: total over ranks", "{rule_cpu_total_ms:.1f}"),
              ("engine: total", "{e_total:.1f}"), ("hosted: MB / step, busiest", "{bytes_busiest:MB.2f}"),
              ("engine: MB / step, busiest", "{e_bytes:MB.2f}"))),
}


# ============================================================================ config_fuzz, faults, dp_exactness
def _config_fuzz_rows(d: Data) -> Iterable[Row]:
    n = d["invalid_settings"]
    yield {"bad": f"invalid optimizer settings ({n} generated from the config dataclasses)",
           "what": f"{d['refused_naming_the_key']} of {n} refused with an error naming the key"}
    for name, m in d["rank_mismatches"].items():
        what = "every rank refused, naming the setting" if m["refused_on_every_rank"] else "NOT refused on every rank"
        yield {"bad": f"2 ranks, {name}", "what": f"{what}, {m['seconds']} s"}


def _short(reason: str) -> str:
    """``file: sha256 mismatch (expected ..., got ...)`` -> ``file: sha256 mismatch``."""
    return re.sub(r" \((expected|\d+ bytes, manifest|the save was)[^)]*\)", "", reason)


def _fault_what_happened(r: Row) -> str:
    if r["exit"] != 0:
        err = next((s for s in r["said"] if "checkpoint error" in s), "")
        found = err.split(": ", 2)[-1].split(": ", 1)[-1] if "no intact checkpoint in" in err else err
        return f"exit {r['exit']}, refused: no intact checkpoint; `{_short(found)}`"
    out = f"exit 0, resumed from {r['resumed_from']}"
    for s in r["said"]:
        m = re.search(r"checkpoint (\S+) is corrupt or incomplete \((.*)\); skipped", s)
        if m:
            out += f"; {m.group(1)} skipped: `{_short(m.group(2))}`"
        elif "no 'latest' file" in s:
            out += "; no `latest`: newest published tag"
    return out


def _fault_nothing_lost(r: Row) -> str:
    if r["exit"] != 0:
        return "yes: checkpoints untouched" if r["untouched_on_refusal"] else "NO"
    ok = r["losses_identical"] and r["source_untouched"] and r["final_checkpoint_same_state_as_uninterrupted"] is True
    return ("yes" if ok else
            f"NO (losses identical={r['losses_identical']}, source untouched={r['source_untouched']}, "
            f"final={r['final_checkpoint_same_state_as_uninterrupted']})")


MISC = {
    "config_fuzz": Table("config_fuzz", "config_fuzz: generated invalid settings and rank mismatches, what happened.",
                         _config_fuzz_rows, _cols(("bad input", "{bad}"), ("what happened", "{what}"))),
    "faults": Table("faults", "fault_injection: checkpoint faults injected into a real run and what --resume did.",
                    "faults", _cols(("fault injected", "{injected}"), ("what happened", _fault_what_happened),
                                    ("nothing lost", _fault_nothing_lost),
                                    ("/dev/shm left", lambda r: str(len(r["shm_left"]))))),
    "dp_exactness": Table("dp_exactness", "dp_exactness: CanzonaMuon and plain DP against the single-process "
                          "reference, max abs weight difference.", "rows",
                          _cols(("DP", "{dp}"), ("run", "{run}"), ("vs", "{reference}"),
                                ("max abs diff, matrices", "{max_abs_diff_matrices:.2g}"),
                                ("max abs diff, other params", "{max_abs_diff_other:.2g}"))),
}


# ============================================================================ main_job.json
MAIN_JOB = {
    "main_job_run": Table(
        "main_job", "main_job: the default run of launch/train.sh.", lambda d: [{**d["run"], "machine": d["machine"]}],
        _cols(("command", "`{command}`"), ("model", "{model}, {optimizer}"), ("ranks", "{ranks}"), ("steps", "{steps}"),
              ("wall time", "{wall_s:.0f} s"), ("loss (first → last)", "{first_loss:.2f} → {final_loss:.2f}"),
              ("held-out loss", "{final_val_loss:.2f}"), ("median tokens/s", "{median_tokens_per_s:,.0f}"),
              ("median step", "{median_step_ms:.0f} ms"), ("machine", "{machine}"))),
    "main_job_plan": Table(
        "main_job", "main_job: Newton-Schulz GFLOP per rank per step of each layout the run printed.",
        lambda d: [{**lay, "busiest": max(lay["rank_flops"])} for lay in d["plan"]["layouts"]],
        _cols(("layout (dp={plan[world_size]})", "{name}"),
              ("Newton–Schulz GFLOP per rank per step", "{rank_flops:listG.3f}"), ("busiest", "{busiest:G.3f}"),
              ("max/mean", "{imbalance:.2f}"), ("padding", "{padding_fraction:pct2}"))),
    "main_job_reference": Table(
        "main_job", "main_job --compare: the first losses of every run beside the single-process reference.",
        lambda d: [{**ref, "runs": [c[i] if i < len(c) else None for c in d["compare"]["losses"].values()]}
                   for i, ref in enumerate(d["compare"]["reference"])],
        lambda d: _cols(("step", "{step}"), ("reference", "{loss:.5f}"),
                        *((name, f"{{runs[{i}]:.5f}}") for i, name in enumerate(d["compare"]["losses"]))),
        none="n/a"),
    "main_job_compare": Table(
        "main_job", "main_job --compare: final losses and median step times per run.",
        lambda d: [{**r, "name": name} for name, r in d["compare"]["runs"].items()],
        _cols(("run (`{compare[command]}`)", "{name}"), ("loss", "{final_loss:.3f}"),
              ("held-out", "{final_val_loss:.3f}"),
              ("median step ms", "{median_step_ms:.0f}"), ("tokens/s", "{median_tokens_per_s:,.0f}"),
              ("fwd+bwd", "{median_fwd_bwd_ms:.0f}"), ("reduce", "{median_grad_reduce_ms:.0f}"),
              ("opt", "{median_optimizer_ms:.0f}"), ("allgather", "{median_allgather_ms:.0f}")),
        none="n/a"),
}


# ============================================================================ ckpt_index
def _same(r: Row) -> str:
    return {True: "yes", False: "NO", None: ""}[r.get("same_state")]


_CKPT_INDEX_COLS = _cols(("change", "{change}"), ("path", "{path}"),
                         ("peak RSS increment per rank, MiB", "{peak_mib:list,.0f}"),
                         ("load wall s, slowest rank", "{wall_s_max:.2f}"), ("same state as the other path", _same))

CHECKPOINTS = {
    "ckpt_index": Table(
        "ckpt_index", "bench_ckpt_index: load through the checkpoint index vs the per-layout reader, per rank.", "rows",
        _CKPT_INDEX_COLS),
    "ckpt_index_large": Table(
        "ckpt_index_large", "bench_ckpt_index --size large: the same, 310M parameters.", "rows", _CKPT_INDEX_COLS),
    "safe_load": Table(
        "safe_load", "bench_safe_load: a tag's files read by torch.load(weights_only=False) and by the safe loader.",
        "rows", _cols(("read ({files} files, {bytes:MB.0f} MB, {params:,} parameters; load average {load_avg_1min_at_end:.0f} on {cpu} cores)", "{read}"),
                      ("weights_only=False, ms", "{today_s:ms.1f}"), ("safe loader, ms", "{safe_s:ms.1f}"),
                      ("safe / today", "{ratio:.3f}")), none="-"),
}


# ============================================================================ layout_*.json
def _bytes_by_op(r: Row) -> str:
    return ", ".join(f"{op} {b / 2**20:,.3f}" for op, b in sorted(r["bytes_by_op_total"].items()) if b)


def _layout_measured_rows(d: Data) -> Iterable[Row]:
    k = d["kinds"]
    names = {"owned": 'CanzonaMuon, layout "owned"', "mixed": 'CanzonaMuon, layout "mixed"', "adamw": "DeepSpeed AdamW"}
    for kind in ("owned", "mixed", "adamw"):
        r = k[kind]
        yield {**r, "name": names[kind], "matrix_padding": r.get("matrix_padding"),
               "hosted": len(r["hosted"]) if "hosted" in r else None, "by_op": _bytes_by_op(r),
               "vs_owned": r["bytes_total"] / k["owned"]["bytes_total"],
               "diff": f"{r['max_abs_diff_matrices']:.2g} / {r['max_abs_diff_aux']:.2g}"
               if "max_abs_diff_matrices" in r else None}


def _layout_measured_tp_rows(d: Data) -> Iterable[Row]:
    k = d["tp"]["kinds"]
    for kind in ("owned", "mixed"):
        r = k[kind]
        hosted = f"{len(r['grid_hosted'])} over the grid, {len(r['dp_hosted'])} over DP" if r["hosted"] else "0"
        yield {**r, "name": f'CanzonaMuon, layout "{kind}"', "by_op": _bytes_by_op(r), "hosted": hosted,
               "vs_owned_bytes": r["bytes_total"] / k["owned"]["bytes_total"], "vs_owned": r.get("vs_owned")}


_BUFFER = "{bit16_buffer:,} / {params:,} = {ratio:.3f}"

LAYOUTS = {
    "layout_planned": Table(
        "layout_planned", "bench_layout --suite planned: owned (planned padding) vs mixed, Qwen3 at TP=8, Muon.",
        "rows",
        _cols(("model", "{model}"), ("DP", "{dp}"), ("padding owned", "{owned[padding]:pct}"),
              ("padding mixed", "{mixed[padding]:pct2}"),
              ("FLOPs max/avg owned / mixed (bound)",
               "{owned[flops_ratio]:.3f} / {mixed[flops_ratio]:.3f} ({owned[flops_lower_bound]:.3f})"),
              ("memory max/avg owned / mixed", "{owned[memory_ratio]:.2f} / {mixed[memory_ratio]:.2f}"),
              ("hosted matrices (elements)", "{mixed[hosted]} ({mixed[hosted_share]:pct0})"),
              ("all-gather GiB owned / mixed", "{owned[all_gather_bytes]:gib} / {mixed[all_gather_bytes]:gib}"),
              ("hosted all-to-all GiB, busiest rank (collectives)",
               "{mixed[hosted_sent_max]:gib} ({mixed[hosted_collectives]})"),
              ("step cost GiB-eq. owned / mixed", "{owned[rank_cost]:gib} / {mixed[rank_cost]:gib}"),
              ("auto picks", lambda r: "mixed" if r["choice"] == "mixed" else "owned"))),
    "layout_measured": Table(
        "layout_measured", "bench_layout --suite measured: the one-layer Qwen3-shaped model under ZeRO-1 at 8 CPU "
        "ranks.", _layout_measured_rows,
        _cols(("optimizer (ZeRO-1, DP=8)", "{name}"), ("bit16 buffer / parameters", _BUFFER),
              ("matrix padding", "{matrix_padding:pct2}"), ("hosted matrices", "{hosted}"),
              ("MiB sent per step, busiest rank", "{bytes_max_rank:MiB,.3f}"),
              ("MiB sent per step, all ranks", "{bytes_total:MiB,.3f}"), ("all ranks vs owned", "{vs_owned:.3f}"),
              ("MiB by collective, all ranks", "{by_op}"),
              ("max abs(weight - reference), matrices / AdamW", "{diff}"))),
    "layout_measured_tp": Table(
        "layout_measured", "bench_layout --suite measured, DP=4 x TP=2: the Megatron stand-in under ZeRO-1, owned vs "
        "mixed (hosted TP-split matrices over the DP x TP grid).", _layout_measured_tp_rows,
        _cols(("optimizer (ZeRO-1, DP={tp[dp]} x TP={tp[tp]})", "{name}"),
              ("bit16 buffer / parameters (one rank)", _BUFFER), ("matrix padding", "{matrix_padding:pct2}"),
              ("hosted matrices", "{hosted}"),
              ("optimizer-step all-to-alls, busiest rank", "{step_collectives_max_rank}"),
              ("MiB sent per step, busiest rank", "{bytes_max_rank:MiB,.3f}"),
              ("MiB sent per step, all ranks", "{bytes_total:MiB,.3f}"), ("all ranks vs owned", "{vs_owned_bytes:.3f}"),
              ("MiB by collective, all ranks", "{by_op}"), ("max abs(weight - owned layout's)", "{vs_owned:.2g}"))),
    "layout_grid": Table(
        "layout_grid", "bench_layout --suite grid: per (dp, tp) cell FLOPs max/mean of the mixed layout under TP, the "
        "grid hosts' TP ranks picked without (before) and with (after) the owned TP runtime's load.", "rows",
        _cols(('model (layout "mixed", Muon)', "{model}"), ("DP x TP", "{dp} x {tp}"),
              ("owned TP-split / grid-hosted / DP-hosted",
               "{owned_tp} / {grid_hosted} ({grid_moved} at another TP rank) / {dp_hosted}"),
              ("DP plan FLOPs max/mean", "{dp_plan_ratio:.3f}"),
              ("cell FLOPs max/mean, before (unseeded)", "{before:.3f}"), ("cell FLOPs max/mean, after", "{after:.3f}"),
              ("worst cell after / before", "{after_vs_before:.3f}"), ("bound (largest update / mean)", "{bound:.3f}"),
              ("auto picks", "{auto}"))),
}


# ============================================================================ moe.json, ns_*.json, qk_clip.json
_PAIR = "{flops_ratio:.3f} / {memory_ratio:.3f} ({padding_fraction:pct})"


def _qk_overhead_rows(d: Data) -> Iterable[Row]:
    o = d["overhead"]
    yield {"what": f"median ms per step (steps {o['warmup_excluded'] + 1}-{o['steps']})",
           "off": o["median_step_ms_off"], "on": f"{o['median_step_ms_on']:.0f} (x{o['ratio_on_over_off']:.3f})"}
    yield {"what": "collective per step", "off": "none",
           "on": f"one all-reduce(MAX) of {o['collective_bytes_per_step']} bytes (fp32, one per query head and layer)"}

def _metrics_rows(d: Data) -> Iterable[Row]:
    for name, r in d["rows"].items():
        yield {**r, "name": name, "interval": d["setup"]["variants"][name].get("interval", 10),
               "what": "nothing recorded" if d["setup"]["variants"][name].get("enabled", True) is False else
               ("recorded; all_gather every step" if d["setup"]["variants"][name].get("interval", 10) == 1 else
                f"recorded; all_gather every {d['setup']['variants'][name].get('interval', 10)} steps")}


METRICS = {
    "metrics_overhead": Table(
        "metrics", "bench_metrics: the whole training step with the optimizer's step metrics off / on / reduced every "
        "step, interleaved in one run.",
        _metrics_rows,
        lambda d: _cols(("canzona_metrics", "{name}: {what}"),
                        (f"median ms per step (steps {d['setup']['warmup_excluded'] + 1}-{d['setup']['steps']})",
                         "{median_step_ms:.1f}"),
                        ("quartiles (ms)", "{q1_step_ms:.1f} - {q3_step_ms:.1f}"),
                        ("median / off", "{median_over_off:.3f}"),
                        ("per-step ratio to off (median)", "{paired_median_ratio:.3f}"),
                        ("DP reductions in the run", "{dp_reductions}"),
                        ("final loss", "{final_loss:.6f}"))),
}

MOE_NS_QK = {
    "moe_planned": Table(
        "moe", "bench_moe planned: FLOPs / memory max/mean with stacks whole vs per expert, at each EP size (EP 1: one "
        "plan over DP; EP > 1: DeepSpeed MoE's plans, experts over the expert-DP group).",
        lambda d: [{**e, "model": model, "rule": rule} for model, rules in d["planned"]["models"].items()
                   for rule, entries in rules.items() for e in entries],
        _cols(("model", "{model}"), ("rule", "{rule}"), ("DP", "{dp}"), ("EP", "{ep}"),
              ("whole stacks, E/EP per stack ({planned[planner]}): FLOPs / memory max/mean",
               "**{whole[flops_ratio]:.3f}** / {whole[memory_ratio]:.3f}"),
              ("padding", "{whole[padding_fraction]:pct}"), ("bound (largest unit)", "{whole[flops_lower_bound]:.3f}"),
              ("per expert ({planned[per_expert_planner]} at EP 1, {planned[planner]} at EP > 1): FLOPs / memory",
               "**{per_expert[flops_ratio]:.3f}** / {per_expert[memory_ratio]:.3f}"),
              ("padding", "{per_expert[padding_fraction]:pct}"),
              ('per expert, layout "mixed" (each group hosts over its own DP group): FLOPs / memory (padding)',
               _sub("per_expert_mixed", _PAIR)),
              ("per expert, dense and experts seeded by each other's loads (lpt), PLANNER ONLY: FLOPs / memory "
               "(padding)", _sub("joint", _PAIR)))),
    "moe_measured": Table(
        "moe", "bench_moe measured: the matrix rule's thread CPU time per step, CanzonaMuon vs DeepSpeed's Muon.",
        "measured.rows",
        _cols(("DP", "{dp}"), ("CanzonaMuon, busiest rank (ms)", "{canzona[busiest_ms]:.1f}"),
              ("DeepSpeed Muon, busiest rank (ms)", "{deepspeed[busiest_ms]:.1f}"),
              ("DeepSpeed / Canzona (busiest)", "{ratio:x.2f}"),
              ("CanzonaMuon, all ranks (ms)", "{canzona[total_ms]:.1f}"),
              ("DeepSpeed Muon, all ranks (ms)", "{deepspeed[total_ms]:.1f}"))),
    "ns_dtype": Table(
        "ns_dtype", "bench_ns_dtype: one Newton-Schulz in bf16 vs fp32 per CPU kind, one thread, and the fp32 "
        "direction's distance from the bf16 one.",
        lambda d: [{**r, "kind": f"{kind} ({k['cpu_capability']})", "matrix": "x".join(map(str, r["shape"])),
                    "chose": k["auto_chose"].replace("torch.", "")}
                   for kind, k in d["kinds"].items() for r in k["rows"]],
        _cols(("CPU kind", "{kind}"), ("matrix", "{matrix}"), ("bf16 ms", "{bf16_s:ms,.1f}"),
              ("fp32 ms", "{fp32_s:ms,.1f}"), ("bf16 / fp32", "{bf16_over_fp32:.1f}x"),
              ("‖D_fp32 − D_bf16‖ / ‖D_bf16‖", "{rel_distance:.4f}"), ('"auto" chose', "{chose}"))),
    "ns_batch": Table(
        "ns_batch", "bench_ns_batch: the owner's matrix step with same-shape Newton-Schulz batched vs one at a time, "
        "busiest rank's thread CPU ms per DP size and ns_dtype.",
        lambda d: [{**r, "matrices": max(x["matrices"] for x in r["ranks"])} for r in d["rows"]],
        _cols(("ns_dtype", "{ns_dtype}"), ("DP", "{dp}"), ("matrices (busiest rank)", "{matrices}"),
              ("one at a time (ms)", "{busiest_one_at_a_time_ms:,.1f}"), ("batched (ms)", "{busiest_batched_ms:,.1f}"),
              ("batched / one at a time", "{batched_over_one:.3f}"))),
    "qk_clip_overhead": Table(
        "qk_clip",
        "bench_qk_clip: median step time with / without qk_clip, interleaved in one run, and the collective.",
        _qk_overhead_rows,
        _cols(("", "{what}"), ("qk_clip off", "{off:.0f}"),
              ("qk_clip on (threshold {overhead[threshold]:g}: heads clip on {overhead[steps_with_clipped_heads]} of "
               "{overhead[steps]} steps)", "{on}"))),
    "qk_clip_growth": Table(
        "qk_clip", "bench_qk_clip: the largest logit per step at a high lr, recorded only vs clipped.",
        lambda d: [{"name": name, "first": r["max_logit"][0], "peak": max(r["max_logit"]), "last": r["max_logit"][-1],
                    "loss": r["loss"][-1]} for name, r in d["growth"]["runs"].items()],
        lambda d: _cols((f"run (muon_lr {d['growth']['muon_lr']:g}, "
                         f"{len(next(iter(d['growth']['runs'].values()))['max_logit'])} steps)", "{name}"),
                        ("max logit step 1", "{first:.3g}"), ("peak", "{peak:.3g}"), ("last step", "{last:.3g}"),
                        ("final loss", "{loss:.3f}"))),
}


# ============================================================================ startup.json
def _startup_rows(d: Data) -> Iterable[Row]:
    for name, summary in d["summary"].items():
        yield {**summary, "tree": f"{name} ({d['commits'][name]})", "walls": [r["wall_s"] for r in d["runs"][name]]}


STARTUP = {
    "startup": Table(
        "startup", "bench_startup: wall time of a 2-step launch/train.sh per code tree, interleaved, and its phases.",
        _startup_rows,
        lambda d: _cols(("code", "{tree}"), ("wall s, each run", "{walls:list.1f}"),
                        ("median wall s", "{median_wall_s:.1f}"),
                        *((f"{phase} (median s)", f"{{median_phases_s[{phase}]:.2f}}")
                          for phase in next(iter(d["summary"].values()))["median_phases_s"]))),
    "startup_trace": Table(
        "startup", "bench_startup --trace: the launcher's and rank 0's imports and calls, timed, in one run.",
        "traced.spans",
        _cols(("process", "{process}"), ("what", "`{what}`"), ("starts at s", "{start_s:.2f}"),
              ("takes s", "{duration_s:.2f}"))),
}


# ============================================================================ cpu_kernels.json
CPU_KERNELS = {
    "cpu_kernels": Table(
        "cpu_kernels", "bench_cpu_kernels: heavy tests natively and under the AVX2 kernels, interleaved, wall and CPU s.",
        lambda d: [*d["rows"], {**d["total"], "test": "**all of the above**"}],
        lambda d: _cols(("test", lambda r: r["test"] if r["test"].startswith("**") else f"`{r['test'].split('::', 1)[1]}`"),
                        ("native wall s", "{native_wall_s:.1f}"), ("AVX2 wall s", "{avx2_wall_s:.1f}"),
                        ("native CPU s", "{native_cpu_s:.1f}"), ("AVX2 CPU s", "{avx2_cpu_s:.1f}"),
                        ("AVX2 / native, CPU", "{cpu_ratio:.2f}"))),
}


def _stage_cell(r: Row) -> str:
    return ", ".join(f"{st['stage']} {st['minutes']:.1f}" + ("" if not st["exit"] else f" (exit {st['exit']})")
                     for st in r["stages"])


def _profile_phase_rows(d: Data) -> Iterable[Row]:
    for run in d["runs"]:
        for ph in run["phases"] if run["rank_runs"] else ():  # (a profile made without rank phases)
            yield {"label": run["label"], **ph}


SUITE = {
    "ci_stages": Table(
        "suite_time", "ci_stages: .ci/run's closing table, minutes per stage (python benchmarks/suite_time.py --from-log).",
        "ci_runs",
        _cols(("run", "{label}"), ("CPU, cores", "{cpu}, {cores}"), ("stages, minutes", _stage_cell),
              ("all of .ci/run, minutes", "{total_minutes:.1f}"))),
    "suite_profile_files": Table(
        "suite_profile", "suite_profile_files: the suite's slowest files (python benchmarks/suite_profile.py).",
        lambda d: ({"label": run["label"], **f} for run in d["runs"] for f in run["files"]),
        _cols(("run", "{label}"), ("file", "`{file}`"), ("tests", "{tests}"), ("minutes", "{minutes:.2f}"),
              ("share of the suite", "{share:pct}"), ("waiting on ranks", "{in_ranks:pct0}"),
              ("CPU minutes (pytest, children, ranks)", "{cpu_minutes:.2f}"))),
    "suite_profile_phases": Table(
        "suite_profile", "suite_profile_phases: rank 0's wall time per phase over every run_distributed run.",
        _profile_phase_rows,
        _cols(("run", "{label}"), ("phase", "{phase}"), ("minutes", "{rank0_minutes:.2f}"),
              ("seconds per run", "{per_run_s:.2f}"))),
    "suite_time": Table(
        "suite_time", "suite_time: the suite's pytest sessions as CI runs them (pytest's own summary per session).",
        "runs",
        _cols(("run", "{label}"), ("what", "{what}"), ("kernels", "{kernels}"), ("CPU, cores", "{cpu}, {cores}"),
              ("passed", "{passed}"), ("skipped", "{skipped}"), ("failed", "{failed}"), ("minutes", "{minutes:.1f}"))),
}


# ============================================================================ ds_range.json
DS_RANGE = {
    "ds_range": Table(
        "ds_range", "ds_range: the integration tier (tests/ds_range_tier.txt) per DeepSpeed release (pytest's summary).",
        "runs",
        _cols(("deepspeed", "{deepspeed}"), ("torch", "{torch}"), ("where", "{where}"), ("run", "{label}"),
              ("CPU, cores", "{cpu}, {cores}"), ("passed", "{passed}"), ("skipped", "{skipped}"),
              ("of them refused by name", lambda r: str(r["refused"]) if "refused" in r else "–"),
              ("failed", "{failed}"), ("minutes", "{minutes:.1f}"))),
}


# ============================================================================ megatron.json
MEGATRON = {
    "megatron": Table(
        "megatron", "bench_megatron: the real Megatron-DeepSpeed, Megatron's Adam vs the shipped CanzonaMuon config, "
        "interleaved (CPU, gloo).",
        "runs",
        _cols(("layout", "{layout}"), ("optimizer", lambda r: "Megatron's Adam" if r["optimizer"] == "adam"
                                       else "CanzonaMuon (configs/ds_megatron_tp.json)"),
              ("iterations", "{iters}"), ("lm loss, mean of last 5", "{loss_last5:.3f}"),
              ("ms / iteration (median from 3)", "{iter_ms_median:.0f}"),
              ("peak RSS of a rank, MB", "{peak_rss_mb:.0f}"))),
}


#: table name -> its spec
TABLES: dict[str, Table] = {**PAPER_EXPERIMENTS, **PLANS, **PIPELINE_TP, **BENCH_ZERO, **MISC, **MAIN_JOB,
                            **CHECKPOINTS, **LAYOUTS, **MOE_NS_QK, **METRICS, **STARTUP, **CPU_KERNELS, **SUITE, **DS_RANGE, **MEGATRON}


def load(stem: str, results: Path | str | None = None) -> Data:
    path = Path(results or RESULTS) / f"{stem}.json"
    if not path.is_file():
        raise FileNotFoundError(f"results file {path} does not exist (run the benchmark that writes it)")
    return json.loads(path.read_text())


def render(name: str, results: Path | str | None = None) -> str:
    """The markdown table ``name`` from its results JSON (in ``results``, default benchmarks/results)."""
    if name not in TABLES:
        raise ValueError(f"Unknown table {name!r}. Known: {sorted(TABLES)}")
    return render_table(TABLES[name], load(TABLES[name].stem, results))


def render_data(name: str, d: Data) -> str:
    """The markdown table ``name`` from ``d``, its results JSON already parsed."""
    return render_table(TABLES[name], d)


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
        except (ValueError, FileNotFoundError, KeyError, IndexError, TypeError) as e:  # also a JSON the spec misfits
            stale.append(f"{name}: cannot render ({e})")
            continue
        if m.group("body") != fresh + "\n":
            stale.append(f"{name}: stale (differs from its rendering of {TABLES[name].stem}.json)")
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
        render_data("fig3_dp", d),
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
        render_data("buckets", d),
        "",
        "## Figure 3b: TP load ratios",
        "",
        render_data("fig3_tp", d),
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
        render_data("fig13_alpha", d),
        "",
        "## Figure 14: C_max of the TP micro-groups (simulated)",
        "",
        render_data("fig14_cmax", d),
        "",
        render_data("fig14_sensitivity", d),
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
        render_data("d5_numel_vs_flops", d),
        "",
        f"Paper (§D.5, {d['paper']['d5']['setting']}): {d['paper']['d5']['flops_s']} s (FLOPs) vs "
        f"{d['paper']['d5']['numel_s']} s (numel), measured. Ours: planned FLOPs of the busiest DP rank; a ratio "
        "below 1 means the numel-planned plan happens to be better on FLOPs.",
        "",
        "## Figures 8 and 9: scaling (planned FLOPs R_LB, padding in parentheses)",
        "",
        "Figure 8a (Qwen3-32B, TP=4):",
        "",
        render_data("scaling_dp", d),
        "",
        "Figure 8b (Qwen3-32B, PP=4 stage 0, DP=4):",
        "",
        render_data("scaling_tp", d),
        "",
        "Figure 9 (DP=16, TP=4):",
        "",
        render_data("scaling_model", d),
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
        render_data("padding_worst", d),
        "",
        f"Padding > 2%: {claim['over_2pct']} of {claim['configs']} configurations; at DP <= 16: "
        + (", ".join(claim["dp_le_16_over_2pct"]) or "none") + "; Qwen3-32B: "
        + (", ".join(claim["qwen3_32b_over_2pct"]) or "none") + ".",
        "",
        f"Generated in {d['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


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
        render_data("bench_zero3", d), "", render_data("bench_zero3_goals", d), "",
        "The engine-free hosted step (the same micro-group runtime over `FlatSplit.even` pieces, without "
        "DeepSpeed around it; its bytes = stock ZeRO-3's + its all-to-alls) beside the engine:", "",
        render_data("bench_zero3_hosted", d), "",
        "Baselines: Muon against DeepSpeed 0.19.8's own Muon at stage 3 (`\"type\": \"Muon\"`, "
        "`\"reduce_scatter\": false`, which it requires): full gradients all-reduced, then gradients and momenta "
        "all-gathered, matrices dealt round-robin, updates and momenta all-gathered. Shampoo and SOAP against "
        "the stage-3 replicated baseline: every rank all-gathers every matrix's reduce-scattered gradient and "
        "runs the rule on every whole matrix (rule state on every rank), keeping its piece of each update. "
        f"Rules: {json.dumps(d['rules'])}.", "",
    ])



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
        for name, table in TABLES.items():
            print(f"{name:28s} {table.stem}.json  {table.doc}")
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

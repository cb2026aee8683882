"""``--compare``: the same job (seed, data, schedule) under several ds_configs, then a
single-process exact Muon reference for the first few steps; curves and times side by side.

    for ds_config in run.compare_ds_configs:      all ranks, one run after another
        train(...) -> <log_dir>/compare/<optimizer type>/metrics.jsonl
    rank 0: run_reference(...) -> <log_dir>/compare/reference.jsonl   (others wait)
    rank 0: table, loss / step-time plots, compare.json
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from canzona_ds.train.config import RunConfig
from canzona_ds.train.metrics import (MATPLOTLIB_MISSING, have_matplotlib, plot_loss, plot_step_times, read_metrics,
                                      summary_table)
from canzona_ds.train.reference import run_reference
from canzona_ds.train.trainer import OptimizerUnavailable, data_parallel_size, is_rank0, load_ds_config, train

#: runs whose optimizer the single-process reference can reproduce (lower-cased types)
REFERENCE_TYPES = ("canzonamuon", "canzonashampoo", "canzonasoap", "muon")
REFERENCE_LABEL = "single-process reference"


def run_compare(cfg: RunConfig, progress: bool = True) -> dict:
    out_dir = Path(cfg.log_dir) / "compare"
    world = dist.get_world_size() if dist.is_initialized() else 1
    runs, skipped = {}, {}
    for ds_path in cfg.compare_ds_configs:
        opt_type = str(load_ds_config(ds_path)["optimizer"]["type"])
        sub = replace(cfg, ds_config=ds_path, log_dir=str(out_dir / opt_type), checkpoint_every=0, resume=False)
        try:
            runs[opt_type] = train(sub, name=opt_type, progress=progress)
        except OptimizerUnavailable as e:
            skipped[opt_type] = str(e)
            if is_rank0():
                print(f"[compare] skipping {opt_type}: {e}", flush=True)

    report: dict = {"runs": {}, "skipped": skipped, "reference": None, "artifacts": {}}
    if is_rank0():
        curves = {n: read_metrics(r.metrics_path) for n, r in runs.items()}
        report["runs"] = {n: {"ds_config": _ds_path_of(cfg, n), **r.summary} for n, r in runs.items()}
        muon_run = next((n for n in runs if n.lower() in REFERENCE_TYPES), None)
        if cfg.reference_steps and muon_run is not None:
            section = load_ds_config(_ds_path_of(cfg, muon_run))["optimizer"]
            dp = data_parallel_size(_ds_path_of(cfg, muon_run), world)
            ref = run_reference(cfg, dp, section, cfg.reference_steps)
            (out_dir / "reference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref))
            report["reference"] = {"steps": len(ref), "hparams_from": muon_run,
                                   "max_abs_loss_diff": {n: max(abs(a["loss"] - b["loss"]) for a, b in zip(c, ref))
                                                         for n, c in curves.items() if n.lower() in REFERENCE_TYPES}}
            print(_reference_table(curves, ref), flush=True)
        print(summary_table({n: r.summary for n, r in runs.items()}), flush=True)
        if have_matplotlib():
            # DeepSpeed's Muon follows CanzonaMuon to ~1e-4: dashed on top, so neither hides the other
            plotted = dict(curves)
            if report["reference"] is not None:
                plotted[REFERENCE_LABEL] = ref
            report["artifacts"]["loss_png"] = str(plot_loss(
                plotted, out_dir / "loss_compare.png", f"{cfg.model}: same seed and data, {world} ranks",
                dashed=tuple(n for n in curves if n.lower() in REFERENCE_TYPES and not n.startswith("Canzona")),
                markers_only=(REFERENCE_LABEL,)))
            report["artifacts"]["step_time_png"] = str(plot_step_times(
                {n: r.summary for n, r in runs.items()}, out_dir / "step_time_compare.png",
                f"{cfg.model}: median time per optimizer step, {world} ranks"))
        else:
            print(f"[compare] {MATPLOTLIB_MISSING}", flush=True)
        report["artifacts"]["compare_json"] = str(out_dir / "compare.json")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "compare.json").write_text(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.barrier()  # the other ranks wait for rank 0's reference run
    return report


def _ds_path_of(cfg: RunConfig, opt_type: str) -> str:
    for p in cfg.compare_ds_configs:
        if str(load_ds_config(p)["optimizer"]["type"]) == opt_type:
            return p
    raise ValueError(f"no ds_config with optimizer type {opt_type!r} in {cfg.compare_ds_configs}")


def _reference_table(curves: dict[str, list[dict]], ref: list[dict]) -> str:
    names = [n for n in curves if n.lower() in REFERENCE_TYPES]
    lines = ["single-process reference (canzona_ds.reference: the rule on whole matrices + AdamW) vs the ZeRO runs, "
             "loss per step:",
             "step".rjust(5) + "reference".rjust(12) + "".join(n.rjust(14) for n in names)]
    for i, r in enumerate(ref):
        lines.append(f"{r['step']:5d}{r['loss']:12.5f}" + "".join(
            (f"{curves[n][i]['loss']:14.5f}" if i < len(curves[n]) else "n/a".rjust(14)) for n in names))
    return "\n".join(lines)

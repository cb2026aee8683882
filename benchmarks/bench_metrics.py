"""Measured: what the optimizer's step metrics cost a step (canzona_ds/step_metrics.py).

The main job's tiny preset, seq_len 128, micro-batch 8, CanzonaMuon (configs/ds_cpu_canzona.json's
hyper-parameters), ZeRO-1, 2 CPU ranks (gloo).  Three engines from the same initial weights train
on the same batches, their steps interleaved (A, B, C, B, C, A, C, A, B, ...: the order rotated
every step, so each variant runs first, second and last as often) so the shared machine's noise
falls on all alike:

    off         "canzona_metrics": {"enabled": false}   nothing recorded
    on          the default (interval 10)               recorded; one all_gather every 10th step
    interval 1  "canzona_metrics": {"interval": 1}      an all_gather every step (the worst case)

-> median and quartiles of the whole training step (forward, backward, engine.step), first
   WARMUP steps excluded; each variant's median over "off"'s, and the median over steps of the
   paired ratio (a step's time over the same step's "off" time); the DP reductions the run's
   metrics records show, and the final loss (the same in all three: metrics change no number).

    PYTHONPATH=. python benchmarks/bench_metrics.py   # -> results/metrics.json (~3 min)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DP, MICRO, SEQ = 2, 8, 128
WARMUP = 3
VARIANTS = {"off": {"enabled": False}, "on": {}, "interval 1": {"interval": 1}}


def _ds(section: dict) -> dict:
    base = json.loads((HERE.parent / "configs" / "ds_cpu_canzona.json").read_text())
    base.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1, train_batch_size=MICRO * DP,
                canzona_metrics=section)
    return base


def _worker(rank: int, dp: int, steps: int) -> dict:
    import canzona_ds  # noqa: F401
    import deepspeed
    import torch

    from canzona_ds.data import BatchSampler, DataConfig
    from canzona_ds.integration.runtime_info import canzona_optimizer
    from canzona_ds.models.qwen3 import build_model, preset

    torch.set_num_threads(1)
    sampler = BatchSampler(DataConfig(corpus="austen", seq_len=SEQ, seed=1234))
    engines = {}
    for name, section in VARIANTS.items():
        model = build_model(preset("tiny"), seed=1234)
        engines[name], *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds(section))
        engines[name].train()
    out = {n: {"ms": [], "reductions": 0, "loss": []} for n in VARIANTS}
    for step in range(steps):
        x, y = sampler.micro_batch(step, 0, rank, dp, MICRO, 1)
        names = list(VARIANTS)
        for name in names[step % 3:] + names[:step % 3]:  # each variant first, second, last alike
            engine = engines[name]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            torch.distributed.barrier()
            out[name]["ms"].append((time.perf_counter() - t0) * 1e3)
            out[name]["loss"].append(loss.item())
            m = canzona_optimizer(engine).metrics()
            out[name]["reductions"] += m is not None and m.dp_max_step_ms is not None
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    from canzona_testkit.dist import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--out", default=str(HERE / "results" / "metrics.json"))
    args = ap.parse_args()
    out = run_distributed(_worker, DP, args.steps, timeout=1800)[0]
    rows = {}
    for name, v in out.items():
        q1, med, q3 = _quartiles(v["ms"][WARMUP:])
        rows[name] = {"median_step_ms": med, "q1_step_ms": q1, "q3_step_ms": q3, "dp_reductions": v["reductions"],
                      "final_loss": v["loss"][-1]}
    off = out["off"]["ms"][WARMUP:]
    for name, r in rows.items():
        r["median_over_off"] = r["median_step_ms"] / rows["off"]["median_step_ms"]
        # paired: the same step's time over "off"'s (the steps ran back to back), the median
        # of those ratios, which the machine's drift between steps does not reach
        r["paired_median_ratio"] = statistics.median(a / b for a, b in zip(out[name]["ms"][WARMUP:], off))
    result = {
        "command": "PYTHONPATH=. python benchmarks/bench_metrics.py",
        "setup": {"model": "tiny", "dp": DP, "micro_batch": MICRO, "seq_len": SEQ, "zero_stage": 1,
                  "optimizer": "CanzonaMuon (configs/ds_cpu_canzona.json)", "device": "CPU, gloo, 1 thread per rank",
                  "steps": args.steps, "warmup_excluded": WARMUP, "variants": VARIANTS},
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

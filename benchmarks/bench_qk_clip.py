"""Measured: what QK-clip costs a step, and what it does to growing logits.

The main job's tiny preset made Llama-style (``qk_norm: false``), seq_len 128, micro-batch 8,
CanzonaMuon (configs/ds_cpu_canzona.json's hyper-parameters), ZeRO-1, 2 CPU ranks (gloo).  Two
engines from the same initial weights train on the same batches, their steps interleaved
(A, B, A, B, ...) so the shared machine's noise falls on both alike:

    overhead   A: qk_clip off            B: qk_clip threshold TAU_OVERHEAD (clips: work included)
               -> median ms per step of each (first WARMUP steps excluded), ratio B / A, and the
                  bytes of the one all-reduce(MAX) per step
    growth     muon_lr x LR_MULT, C: qk_clip threshold 1e30 (records, never clips)
                                  D: qk_clip threshold TAU_GROWTH
               -> each step's largest logit over the global batch, and heads clipped

    PYTHONPATH=. python benchmarks/bench_qk_clip.py   # -> results/qk_clip.json, results/qk_clip.png (~3 min)
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
TAU_OVERHEAD = 0.2
LR_MULT = 5.0
TAU_GROWTH = 10.0


def _ds(params: dict) -> dict:
    base = json.loads((HERE.parent / "configs" / "ds_cpu_canzona.json").read_text())
    base["optimizer"]["params"].update(params)
    base.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1, train_batch_size=MICRO * DP)
    return base


def _worker(rank: int, dp: int, steps: int, variants: dict) -> dict:
    import canzona_ds  # noqa: F401
    import deepspeed
    import torch

    from canzona_ds.data import BatchSampler, DataConfig
    from canzona_ds.integration.runtime_info import canzona_optimizer
    from canzona_ds.models.qwen3 import build_model, preset

    cfg = preset("tiny", qk_norm=False)
    sampler = BatchSampler(DataConfig(corpus="austen", seq_len=SEQ, seed=1234))
    engines = {}
    for name, params in variants.items():
        model = build_model(cfg, seed=1234)
        engines[name], *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds(params))
        engines[name].train()
    out = {n: {"ms": [], "max_logit": [], "clipped": [], "loss": []} for n in variants}
    for step in range(steps):
        x, y = sampler.micro_batch(step, 0, rank, dp, MICRO, 1)
        for name, engine in engines.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            torch.distributed.barrier()
            out[name]["ms"].append((time.perf_counter() - t0) * 1e3)
            qk = canzona_optimizer(engine).qk_clip
            out[name]["loss"].append(loss.item())
            if qk is not None:
                out[name]["max_logit"].append(qk.stats.max_logit)
                out[name]["clipped"].append(qk.stats.clipped_heads)
                out[name]["collective_bytes"] = qk.collective_bytes
    return out


def main() -> None:
    from canzona_testkit.dist import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--growth-steps", type=int, default=120)
    ap.add_argument("--out", default=str(HERE / "results" / "qk_clip.json"))
    args = ap.parse_args()
    lr = json.loads((HERE.parent / "configs" / "ds_cpu_canzona.json").read_text())["optimizer"]["params"]["muon_lr"]

    over = run_distributed(_worker, DP, args.steps, {"off": {}, "on": {"qk_clip": {"threshold": TAU_OVERHEAD}}},
                           timeout=1800)[0]
    med = {n: statistics.median(v["ms"][WARMUP:]) for n, v in over.items()}
    grow = run_distributed(_worker, DP, args.growth_steps,
                           {"record only": {"muon_lr": lr * LR_MULT, "qk_clip": {"threshold": 1e30}},
                            f"clip {TAU_GROWTH:g}": {"muon_lr": lr * LR_MULT, "qk_clip": {"threshold": TAU_GROWTH}}},
                           timeout=1800)[0]
    result = {
        "command": "PYTHONPATH=. python benchmarks/bench_qk_clip.py",
        "setup": {"model": "tiny, qk_norm false", "dp": DP, "micro_batch": MICRO, "seq_len": SEQ, "zero_stage": 1,
                  "optimizer": "CanzonaMuon (configs/ds_cpu_canzona.json)", "device": "CPU, gloo, 1 thread per rank"},
        "overhead": {"steps": args.steps, "warmup_excluded": WARMUP, "threshold": TAU_OVERHEAD,
                     "median_step_ms_off": med["off"], "median_step_ms_on": med["on"],
                     "ratio_on_over_off": med["on"] / med["off"],
                     "steps_with_clipped_heads": sum(c > 0 for c in over["on"]["clipped"]),
                     "collective_bytes_per_step": over["on"]["collective_bytes"]},
        "growth": {"muon_lr": lr * LR_MULT, "threshold": TAU_GROWTH,
                   "runs": {n: {"max_logit": v["max_logit"], "clipped_heads": v["clipped"], "loss": v["loss"]}
                            for n, v in grow.items()}},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "growth"}, indent=1))
    for n, v in grow.items():
        print(f"growth {n}: max logit first {v['max_logit'][0]:.3g} peak {max(v['max_logit']):.3g} "
              f"last {v['max_logit'][-1]:.3g}; final loss {v['loss'][-1]:.4f}")
    try:
        from canzona_ds.train.metrics import plot_qk_logits

        curves = {n: [{"step": i + 1, "qk_max_logit": m} for i, m in enumerate(v["max_logit"])]
                  for n, v in grow.items()}
        plot_qk_logits(curves, Path(args.out).with_suffix(".png"), TAU_GROWTH,
                       f"tiny Llama-style, CanzonaMuon lr {lr * LR_MULT:g}: largest logit per step")
    except ImportError:
        pass


if __name__ == "__main__":
    main()

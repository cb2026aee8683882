"""Megatron's own Adam vs the shipped Canzona config in the real Megatron-DeepSpeed, interleaved:
``benchmarks/results/megatron.json`` (docs/tp.md, "Megatron-DeepSpeed hook", renders it).

    python benchmarks/bench_megatron.py [--iters 30] [--rounds 1]

Megatron-DeepSpeed from ``MEGATRON_DEEPSPEED`` or the snapshot in ../shared/third_party
(canzona_testkit/megatron_real.py: the test tier's patched, built copy and byte-token dataset).
Every run is the documented launch (``deepspeed --num_gpus N launch/megatron_pretrain_gpt.py
pretrain_gpt.py ...``) on CPU over gloo, a small GPT (2 layers, hidden 128, 4 heads, sequence 128,
default GPT: biases, fused QKV), ``--lr 0.02 --min-lr 0.002`` cosine with 3 warmup iterations,
``--weight-decay 0.1``, Adam betas (0.9, 0.95), ZeRO stage 1, fp32, gradient clipping 1.0:

* ``adam``: Megatron's ``--optimizer adam`` (ds_config without an optimizer section);
* ``canzona``: ``configs/ds_megatron_tp.json`` as shipped (CanzonaMuon; its ``optimizer.params``).

Layouts TP=2 and DP=2 x TP=2; per round the four runs alternate (adam, canzona per layout), so
load on the machine hits both alike.  Per run: Megatron's logged ``lm loss`` (mean of the last 5
iterations, and the last), the median of Megatron's ``elapsed time per iteration`` over
iterations 3.. (the first two include warm-up), and the peak resident memory of the largest
process of the launch (GNU time's ``%M`` of the launcher, which covers the ranks it waits for;
DeepSpeed's CPU accelerator has no other peak-memory counter).  CPU time on a shared machine is
noisy: the ratios within a round are what the table shows.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from canzona_testkit import megatron_real as mr  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "megatron.json"
SHIPPED = ROOT / "configs" / "ds_megatron_tp.json"
LAYOUTS = {"TP=2": (1, 2), "DP=2 x TP=2": (2, 2)}
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "1", "--seed", "1234",
         "--lr", "0.02", "--min-lr", "0.002", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
         "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "98,2,0", "--no-pipeline-parallel"]
ITER_MS = r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"


def run(meg: Path, work: Path, layout: str, optimizer: str, iters: int) -> dict:
    import re

    dp, tp = LAYOUTS[layout]
    shipped = json.loads(SHIPPED.read_text())
    cfg = dict(shipped) if optimizer == "canzona" else {k: v for k, v in shipped.items()
                                                        if k not in ("optimizer", "canzona_tp")}
    path = work / f"{optimizer}-{tp}-{dp}.json"
    path.write_text(json.dumps(cfg))
    args = [*MODEL, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1",
            "--global-batch-size", str(dp), "--train-iters", str(iters), "--data-path", mr.data_prefix(meg),
            "--data-cache-path", str(work / "index-cache")]
    cmd = ["/usr/bin/time", "-f", "MAXRSS_KB=%M", *mr.command(meg, dp * tp, args, str(path))]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=mr.env(), capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{layout} {optimizer}: the launch failed (rc {proc.returncode}):\n{log[-4000:]}")
    its = mr.iterations(log)
    losses = [its[i][1] for i in sorted(its)]
    ms = {int(i): float(v) for i, v in re.findall(ITER_MS, log)}
    rss = [int(x) for x in re.findall(r"MAXRSS_KB=(\d+)", log)]
    start = mr.start_lines(log)
    return {"layout": layout, "optimizer": optimizer, "iters": len(losses),
            "loss_last5": statistics.fmean(losses[-5:]), "loss_last": losses[-1],
            "iter_ms_median": statistics.median(ms[i] for i in ms if i >= 3),
            "peak_rss_mb": rss[-1] / 1024 if rss else None, "wall_s": time.monotonic() - t0,
            "start_line": start[0] if start else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    src, why = mr.source()
    if src is None:
        raise SystemExit(why)
    meg = mr.prepare()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_megatron_") as tmp:
        for r in range(a.rounds):
            for layout in LAYOUTS:
                for optimizer in ("adam", "canzona"):
                    rec = run(meg, Path(tmp), layout, optimizer, a.iters)
                    rec["round"] = r
                    runs.append(rec)
                    print(json.dumps(rec), flush=True)
    shipped = json.loads(SHIPPED.read_text())
    OUT.write_text(json.dumps({
        "command": "python benchmarks/bench_megatron.py" + (f" --iters {a.iters}" if a.iters != 30 else "")
                   + (f" --rounds {a.rounds}" if a.rounds != 1 else ""),
        "megatron_deepspeed": why, "machine": f"{platform.processor() or platform.machine()}, "
                                              f"{__import__('os').cpu_count()} cores (shared: other jobs ran)",
        "shipped_config": {"type": shipped["optimizer"]["type"], **shipped["optimizer"]["params"],
                           "zero_stage": shipped["zero_optimization"]["stage"]},
        "runs": runs}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

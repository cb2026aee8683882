"""Measured: load time and peak RSS per rank of a resume through the checkpoint index, side by
side with the per-layout reader it replaces where that reader runs.

The FFN stack of bench_elastic_rss.py, smaller (``--blocks``, ``--ffn``; default 6 blocks of
256 x 8192: ~30M parameters), fp32, CanzonaMuon.  One run:

    save    ZeRO 1, DP=2, one optimizer step                          -> tag z1dp2
    resize  ZeRO 1, DP=2 -> 4:  the index loop (ckpt_index.load)      (what engine.load_checkpoint takes)
                                the per-layout reader (elastic.load)   (the route before; same state checked)
    stage   ZeRO 1, DP=2 -> ZeRO 3, DP=2: the index loop               (before: a crash inside DeepSpeed)

Each load is a fresh set of rank processes; per rank ``gc.collect()``, VmHWM reset to VmRSS
(``5 > /proc/self/clear_refs``), the load, then peak = VmHWM - VmRSS(before) and the wall
time.  The two resize paths must leave every rank with the same sha256 of its fp32 partitions,
AdamW and rule state.

    python benchmarks/bench_ckpt_index.py     # -> results/ckpt_index.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MUON = {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01}


def _engine(dp: int, stage: int, size: tuple[int, int]):
    import deepspeed

    import canzona_ds  # noqa: F401
    from bench_elastic_rss import FFNStack

    torch.manual_seed(0)
    model = FFNStack(*size)
    zero = {"stage": stage, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dp,
           "optimizer": {"type": "CanzonaMuon", "params": MUON}, "gradient_clipping": 0.0,
           "zero_optimization": zero, "steps_per_print": 10 ** 9}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _save(rank, world, ckpt, size):
    from bench_elastic_rss import VOCAB

    engine = _engine(world, 1, size)
    tokens = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens))
    engine.step()
    engine.save_checkpoint(ckpt, tag="z1dp2")
    return sum(p.numel() for p in engine.module.parameters())


def _digest(engine) -> str:
    import hashlib

    from canzona_ds.integration.runtime_info import canzona_optimizer

    h = hashlib.sha256()
    zopt, opt = engine.optimizer, canzona_optimizer(engine)
    for flat in zopt.single_partition_of_fp32_groups:
        h.update(flat.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for _, v in sorted(opt.state.get(flat, {}).items()):
            h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for name in sorted(opt.matrix_state):
        for _, v in sorted(opt.matrix_state[name].items()):
            h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _load(rank, world, ckpt, stage, path, size):
    from bench_elastic_rss import _status_kib

    from canzona_ds.integration import ckpt_index, elastic

    engine = _engine(world, stage, size)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if path == "index":
        index = ckpt_index.index_route(engine, ckpt, "z1dp2")
        assert index is not None, "the index loop was not chosen"
        ckpt_index.load(engine, ckpt, "z1dp2", index)
    else:
        elastic.load(engine, ckpt, "z1dp2")
    wall = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"wall_s": wall, "peak_mib": (peak - before) / 1024,
            "digest": _digest(engine) if stage in (1, 2) else None}


def main() -> int:
    from canzona_testkit.dist import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ckpt_index.json"))
    args = ap.parse_args()
    size = (args.blocks, args.ffn)
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_index_")
    try:
        ckpt = os.path.join(tmp, "ckpt")
        params = run_distributed(_save, 2, ckpt, size, timeout=1200)[0]
        rows = []
        for label, world, stage, path in (("ZeRO 1 DP 2 -> 4", 4, 1, "index"), ("ZeRO 1 DP 2 -> 4", 4, 1, "reader"),
                                          ("ZeRO 1 DP 2 -> ZeRO 3 DP 2", 2, 3, "index")):
            res = run_distributed(_load, world, ckpt, stage, path, size, timeout=1200)
            rows.append({"change": label, "path": "index loop" if path == "index" else "per-layout reader (before)",
                         "wall_s_max": max(r["wall_s"] for r in res), "peak_mib": [r["peak_mib"] for r in res],
                         "digests": [r["digest"] for r in res]})
            print(rows[-1]["change"], rows[-1]["path"], f"{rows[-1]['wall_s_max']:.2f} s",
                  [f"{m:.0f}" for m in rows[-1]["peak_mib"]], "MiB")
        same = rows[0]["digests"] == rows[1]["digests"]
        out = {"command": "python benchmarks/bench_ckpt_index.py", "params": params, "blocks": args.blocks,
               "ffn": args.ffn, "same_state_index_vs_reader": same, "rows": rows,
               "cpu": os.cpu_count(), "torch": torch.__version__}
        Path(args.out).write_text(json.dumps(out, indent=1))
        print("same state (index vs reader):", same, "->", args.out)
        return 0 if same else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())

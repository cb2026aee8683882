"""Measured: what an elastic resume costs a rank in memory, reading its share (now) vs the whole model (before).

A ~310M-parameter model (fp32, CanzonaMuon, ZeRO stage 1, CPU/gloo): 18 FFN blocks of two
256 x 32768 matrices (Muon) and a 32768 x 256 embedding plus norms (AdamW).  One run:

    save   DP=2, one optimizer step (tiny batch)                  -> tag dp2
    2 -> 4 resume tag dp2 at DP=4: new path, then save it again    -> tag dp4 (the lossless round trip
           that tests/test_elastic.py checks; a 4-rank training step would need ~13 GB here)
           resume tag dp2 at DP=4: old path
    4 -> 2 resume tag dp4 at DP=2: new path, then old path

Each resume is a fresh set of rank processes building a fresh engine, then
``canzona_ds.integration.elastic.load(engine, dir, tag, whole=...)``:

    new  (whole=False)  SavedCheckpoint: files memory-mapped, each rank copies out its share
    old  (whole=True)   every file read into memory and every parameter rebuilt whole on
                        every rank (the reader before), then the same writer

Per rank: ``gc.collect()``, then ``5 > /proc/self/clear_refs`` resets VmHWM to the current
RSS (VmRSS); after the load, peak = VmHWM - VmRSS(before) is the load's peak increment and
retained = VmRSS(after) - VmRSS(before) what it keeps (the rank's new optimizer state).  RSS
counts the checkpoint pages a rank touches through its mappings as well as copies.  Old-path
loads run one rank at a time (a barrier between turns: the old reader has no collectives, so
a rank's peak is the same; this machine cannot hold four whole-model loads at once), new-path
loads run together as in real use (they end in a collective), so the new path's wall time
includes waiting for cores shared by all ranks.  Both paths must leave every rank with the same
state (sha256 of its fp32 partitions, AdamW and rule state, and the module's weights).

    python benchmarks/bench_elastic_rss.py   # -> results/elastic_rss.json (~3 min on 2 cores; ~12 GB RAM at peak)
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
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

D, FFN, BLOCKS, VOCAB = 256, 32768, 18, 32768
MUON = {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01}


class FFNStack(nn.Module):
    """Embedding, then residual FFN blocks (norm, up, GELU, down): cheap to build and step."""

    def __init__(self, blocks: int = BLOCKS, ffn: int = FFN) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(blocks))
        self.up = nn.ModuleList(nn.Linear(D, ffn, bias=False) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(ffn, D, bias=False) for _ in range(blocks))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, up, down in zip(self.norms, self.up, self.down):
            x = x + down(F.gelu(up(norm(x))))
        return x.pow(2).mean()


def _engine(dp: int, size: tuple[int, int]):
    import canzona_ds  # noqa: F401  (registers the optimizers and the elastic load)
    import deepspeed

    torch.manual_seed(0)
    model = FFNStack(*size)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dp,
           "optimizer": {"type": "CanzonaMuon", "params": MUON}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
           "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _measured_load(engine, ckpt: str, tag: str, whole: bool) -> dict:
    from canzona_ds.integration import elastic

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    elastic.load(engine, ckpt, tag, whole=whole)
    wall = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    gc.collect()
    after = _status_kib("VmRSS")
    return {"wall_s": wall, "peak_mib": (peak - before) / 1024, "retained_mib": (after - before) / 1024,
            "rss_before_mib": before / 1024}


def _digest(engine, rank: int) -> str:
    """sha256 of what this rank holds after loading (module weights on rank 0 only)."""
    import hashlib

    from canzona_ds.integration.runtime_info import canzona_optimizer

    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())

    zopt, opt = engine.optimizer, canzona_optimizer(engine)
    for flat in zopt.single_partition_of_fp32_groups:
        add(flat)
        for key, value in sorted(opt.state.get(flat, {}).items()):
            add(value.reshape(-1))
    for name in sorted(opt.matrix_state):
        for key, value in sorted(opt.matrix_state[name].items()):
            if torch.is_tensor(value):
                add(value)
    if rank == 0:
        for _, p in sorted(engine.module.named_parameters()):
            add(p)
    return h.hexdigest()


def _save(rank, world, ckpt, size):
    engine = _engine(world, size)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (1, 8), generator=g)
    t0 = time.perf_counter()
    engine.backward(engine(tokens))
    engine.step()
    step_s = time.perf_counter() - t0
    engine.save_checkpoint(ckpt, tag=f"dp{world}")
    return {"params": sum(p.numel() for p in engine.module.parameters()), "step_s": step_s,
            "matrices": len(engine.optimizer.optimizer.matrix_names)}


def _resume(rank, world, ckpt, tag, whole, save_as, size):
    from deepspeed import comm as dist

    engine = _engine(world, size)
    if whole:  # one rank at a time: no collectives in the old path
        out = None
        for turn in range(world):
            if turn == rank:
                out = _measured_load(engine, ckpt, tag, whole=True)
            dist.barrier()
    else:
        out = _measured_load(engine, ckpt, tag, whole=False)
    out["digest"] = _digest(engine, rank)
    if save_as:
        engine.save_checkpoint(ckpt, tag=save_as)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "elastic_rss.json"))
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="smaller for a smoke run (then pass --out elsewhere)")
    ap.add_argument("--ffn", type=int, default=FFN)
    args = ap.parse_args()
    size = (args.blocks, args.ffn)
    from canzona_testkit.dist import run_distributed

    t_all = time.perf_counter()
    work = tempfile.mkdtemp(prefix="elastic_rss_", dir=args.dir)
    ckpt = os.path.join(work, "ckpt")
    try:
        saved = run_distributed(_save, 2, ckpt, size, timeout=1800)[0]
        print(f"saved DP=2: {saved['params'] / 1e6:.1f}M parameters, step {saved['step_s']:.1f} s", flush=True)
        cases = []
        for n, m, tag, save_as in ((2, 4, "dp2", "dp4"), (4, 2, "dp4", None)):
            row = {"from_dp": n, "to_dp": m}
            for path, whole in (("new", False), ("old", True)):
                ranks = run_distributed(_resume, m, ckpt, tag, whole, save_as if path == "new" else None,
                                        size, timeout=1800)
                row[path] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "digest"}
                             for r in ranks]
                row[f"{path}_digests"] = [r["digest"] for r in ranks]
                print(f"DP {n} -> {m} {path}: peak +MiB per rank "
                      f"{[round(r['peak_mib']) for r in ranks]}, wall s {[round(r['wall_s'], 1) for r in ranks]}",
                      flush=True)
            row["identical"] = row.pop("new_digests") == row.pop("old_digests")
            cases.append(row)
        files = {f: os.path.getsize(os.path.join(ckpt, "dp2", f)) for f in sorted(os.listdir(os.path.join(ckpt, "dp2")))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": "python benchmarks/bench_elastic_rss.py",
        "model": {"params": saved["params"], "matrices": saved["matrices"], "dtype": "fp32", "optimizer": "CanzonaMuon",
                  "zero_stage": 1, "shape": f"{args.blocks} x (LayerNorm {D}, {D}x{args.ffn} up, {args.ffn}x{D} down), "
                                            f"embedding {VOCAB}x{D}"},
        "dp2_checkpoint_mib": {f: round(s / 2 ** 20, 1) for f, s in files.items()},
        "measure": "per rank: VmHWM after the load minus VmRSS before it (VmHWM reset by /proc/self/clear_refs); "
                   "old-path loads one rank at a time, new-path loads together",
        "cases": cases,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

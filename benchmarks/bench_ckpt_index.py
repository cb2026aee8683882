"""Measured: load time and peak RSS per rank of a resume through the checkpoint index, side by
side with the per-layout reader it replaced (``elastic.load``, run from the last tree that had
it, ``--before``; the reader is gone from this tree).

An FFN stack (embedding, then blocks of LayerNorm, ``D x ffn`` up, ``ffn x D`` down), fp32,
CanzonaMuon.  ``--size small`` (6 blocks of 256 x 8192: 33.6M parameters) or ``--size large``
(18 blocks of 256 x 32768: the 310M-parameter model of the memory figures before the index;
~12 GB RAM at peak, ~4 min on 2 cores).  One run:

    save     ZeRO 1, DP=2 (and DP=4 for the large size), one optimizer step
    resize   ZeRO 1, DP 2 -> 4 (and 4 -> 2):  the index loop (engine.load_checkpoint's route)
                                              the per-layout reader (before; same state checked)
    stage    ZeRO 1, DP 2 -> ZeRO 3, DP 2:    the index loop (before: a crash inside DeepSpeed)

Each load is a fresh set of rank processes, all ranks loading together; per rank
``gc.collect()``, VmHWM reset to VmRSS (``5 > /proc/self/clear_refs``), the load, then
peak = VmHWM - VmRSS(before) (the checkpoint pages a rank touches through its mappings count
as well as its copies) and the wall time.  The two resize paths must leave every rank with the
same sha256 of its fp32 partitions, AdamW and rule state.

    python benchmarks/bench_ckpt_index.py                   # -> results/ckpt_index.json
    python benchmarks/bench_ckpt_index.py --size large      # -> results/ckpt_index_large.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
#: the tree whose canzona_ds this process imports (the --before tree's, for the reader's loads)
TREE = Path(os.environ.get("CANZONA_BENCH_TREE") or ROOT)
sys.path.insert(0, str(TREE))
sys.path.insert(1, str(ROOT / "benchmarks"))

#: the last commit with the per-layout reader (integration/elastic.load)
BEFORE = "5a72feed806ecbedf585c8a98b651e6814b02ea1"
D, VOCAB = 256, 32768
SIZES = {"small": (6, 8192), "large": (18, 32768), "tiny": (2, 1024)}  # (tiny: a smoke run, with --out)
MUON = {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01}


class FFNStack(nn.Module):
    """Embedding, then residual FFN blocks (norm, up, GELU, down): cheap to build and step."""

    def __init__(self, blocks: int, ffn: int) -> None:
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


def _engine(dp: int, stage: int, size: tuple[int, int]):
    import deepspeed

    import canzona_ds  # noqa: F401

    torch.manual_seed(0)
    model = FFNStack(*size)
    zero = {"stage": stage, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": dp,
           "optimizer": {"type": "CanzonaMuon", "params": MUON}, "gradient_clipping": 0.0,
           "zero_optimization": zero, "steps_per_print": 10 ** 9}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _save(rank, world, ckpt, size):
    engine = _engine(world, 1, size)
    tokens = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens))
    engine.step()
    engine.save_checkpoint(ckpt, tag=f"z1dp{world}")
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


def _load(rank, world, ckpt, tag, stage, path, size):
    import canzona_ds

    assert Path(canzona_ds.__file__).resolve().is_relative_to(TREE.resolve()), (canzona_ds.__file__, TREE)
    engine = _engine(world, stage, size)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if path == "index":
        from canzona_ds.integration.ckpt import route as ckpt_index

        index = ckpt_index.index_route(engine, ckpt, tag)
        assert index is not None, "the index loop was not chosen"
        ckpt_index.load(engine, ckpt, tag, index)
    else:  # (only in the --before tree)
        from canzona_ds.integration import elastic

        elastic.load(engine, ckpt, tag)
    wall = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"wall_s": wall, "peak_mib": (peak - before) / 1024,
            "digest": _digest(engine) if stage in (1, 2) else None}


def _child(argv: list[str]) -> int:
    """``--child WORLD CKPT TAG STAGE PATH BLOCKS FFN``: one load, its ranks' results as JSON."""
    from canzona_testkit.dist import run_distributed

    world, ckpt, tag, stage, path, blocks, ffn = argv
    res = run_distributed(_load, int(world), ckpt, tag, int(stage), path, (int(blocks), int(ffn)), timeout=1800)
    print("RESULT " + json.dumps(res))
    return 0


def _run(tree: Path, *args) -> list[dict]:
    """One load in fresh processes importing ``tree``'s canzona_ds."""
    env = dict(os.environ, CANZONA_BENCH_TREE=str(tree))
    # (cwd too: the rank processes' fork server puts its working directory first on sys.path)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *map(str, args)], env=env,
                       cwd=str(tree), capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"load {args} in {tree} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    from canzona_testkit.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--before", default=BEFORE, help="the commit whose per-layout reader is measured (default %(default)s)")
    ap.add_argument("--out", default=None, help="default results/ckpt_index.json (small), ckpt_index_large.json (large)")
    args = ap.parse_args()
    size = SIZES[args.size]
    out_path = Path(args.out or ROOT / "benchmarks" / "results" /
                    ("ckpt_index.json" if args.size == "small" else "ckpt_index_large.json"))
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_index_")
    before = Path(tmp) / "before"
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before],
                       check=True)
        ckpt = os.path.join(tmp, "ckpt")
        params = run_distributed(_save, 2, ckpt, size, timeout=1800)[0]
        plan = [("ZeRO 1 DP 2 -> 4", 4, "z1dp2", 1)]
        if args.size == "large":
            run_distributed(_save, 4, ckpt, size, timeout=1800)
            plan.append(("ZeRO 1 DP 4 -> 2", 2, "z1dp4", 1))
        rows = []
        for label, world, tag, stage in plan:
            pair = []
            for path, tree in (("index", ROOT), ("reader", before)):
                res = _run(tree, world, ckpt, tag, stage, path, *size)
                pair.append(res)
                rows.append({"change": label, "path": "index loop" if path == "index" else "per-layout reader (before)",
                             "wall_s_max": max(r["wall_s"] for r in res), "peak_mib": [r["peak_mib"] for r in res]})
                print(label, rows[-1]["path"], f"{rows[-1]['wall_s_max']:.2f} s",
                      [f"{m:.0f}" for m in rows[-1]["peak_mib"]], "MiB", flush=True)
            same = [r["digest"] for r in pair[0]] == [r["digest"] for r in pair[1]]
            rows[-2]["same_state"] = rows[-1]["same_state"] = same
        res = _run(ROOT, 2, ckpt, "z1dp2", 3, "index", *size)
        rows.append({"change": "ZeRO 1 DP 2 -> ZeRO 3 DP 2", "path": "index loop", "same_state": None,
                     "wall_s_max": max(r["wall_s"] for r in res), "peak_mib": [r["peak_mib"] for r in res]})
        same = all(r["same_state"] is not False for r in rows)
        out = {"command": "python benchmarks/bench_ckpt_index.py" + (" --size large" if args.size == "large" else ""),
               "before": args.before, "params": params, "blocks": size[0], "ffn": size[1],
               "same_state_index_vs_reader": same, "rows": rows, "cpu": os.cpu_count(), "torch": torch.__version__}
        out_path.write_text(json.dumps(out, indent=1) + "\n")
        print("same state (index vs reader):", same, "->", out_path)
        return 0 if same else 1
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        raise SystemExit(_child(sys.argv[2:]))
    raise SystemExit(main())

"""Measured: reading a tag's files through the safe loader (canzona_ds/ckpt/safe_load.py) against
today's ``torch.load(weights_only=False)``, side by side in one run, at the bench_ckpt_index sizes.

The tag is bench_ckpt_index's (its FFN stack, CanzonaMuon, ZeRO 1, DP 2, one optimizer step:
``--size small`` 33.6M parameters, ``--size large`` 310M).  Every ``.pt`` file of the tag is read
whole, in two ways, each with both loaders:

    eager          torch.load(f, map_location="cpu")           DeepSpeed's checkpoint engine
    memory-mapped  torch.load(f, map_location="cpu", mmap=True)  the checkpoint index's reader

the safe loader's check alone (``safe_load.check``: every file read memory-mapped by the same
restricted unpickler, no tensor data: the resume's collective check, ``canzona-ckpt verify`` /
``convert``), and a whole resume: the tag loaded
by ``engine.load_checkpoint`` at DP 4 (manifest verified, files checked, the index loop; 4
rank processes, one engine, the safe loader and ``canzona_checkpoint.allow_unsafe_pickle``
(today's reads) alternating, the slowest rank's wall time).  ``--rounds`` rounds, the two loaders
alternating which goes first; the page cache is warm (every file read once before); the figure
is the median over the rounds of the time to read all the files.

    python benchmarks/bench_safe_load.py                 # -> results/safe_load.json
    python benchmarks/bench_safe_load.py --size large    # -> results/safe_load_large.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

from bench_ckpt_index import SIZES, _engine, _save  # noqa: E402


def _resume(rank, world, ckpt, size, rounds):
    """``engine.load_checkpoint`` of the DP 2 tag at DP ``world`` (manifest verified, files
    checked, the index loop), the safe loader and the opt-in (today's reads) alternating; this
    rank's wall times."""
    import torch.distributed as dist

    engine = _engine(world, 1, size)
    walls = {"today": [], "safe": []}
    for i in range(rounds):
        for mode in (("today", "safe") if i % 2 == 0 else ("safe", "today")):
            engine._config._param_dict["canzona_checkpoint"] = {"allow_unsafe_pickle": mode == "today"}
            dist.barrier()
            t0 = time.perf_counter()
            engine.load_checkpoint(ckpt, tag="z1dp2")
            walls[mode].append(time.perf_counter() - t0)
    return walls


def _time(fn, files) -> float:
    t = time.perf_counter()
    for f in files:
        fn(f)
    return time.perf_counter() - t


def main() -> int:
    from canzona_ds.ckpt import safe_load
    from canzona_testkit.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--resume-rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="default results/safe_load.json (small), safe_load_large.json (large)")
    args = ap.parse_args()
    size = SIZES[args.size]
    out_path = Path(args.out or ROOT / "benchmarks" / "results" /
                    ("safe_load.json" if args.size == "small" else "safe_load_large.json"))
    tmp = tempfile.mkdtemp(prefix="bench_safe_load_")
    try:
        params = run_distributed(_save, 2, tmp, size, timeout=1800)[0]
        tag = os.path.join(tmp, "z1dp2")
        files = [os.path.join(tag, f) for f in sorted(os.listdir(tag)) if f.endswith(".pt")]
        nbytes = sum(os.path.getsize(f) for f in files)
        for f in files:  # the page cache warm for every round
            Path(f).read_bytes()
        modes = {
            "eager": (lambda f: torch.load(f, map_location="cpu", weights_only=False),
                      lambda f: safe_load.load(f, map_location="cpu")),
            "memory-mapped": (lambda f: torch.load(f, map_location="cpu", weights_only=False, mmap=True),
                              lambda f: safe_load.load(f, map_location="cpu", mmap=True)),
        }
        rows = []
        for mode, (today, safe) in modes.items():
            t_today, t_safe = [], []
            for i in range(args.rounds):
                pair = [(t_today, today), (t_safe, safe)]
                for times, fn in (pair if i % 2 == 0 else pair[::-1]):
                    times.append(_time(fn, files))
            a, b = statistics.median(t_today), statistics.median(t_safe)
            rows.append({"read": mode, "today_s": a, "safe_s": b, "ratio": b / a,
                         "today_all_s": t_today, "safe_all_s": t_safe})
            print(f"{mode}: weights_only=False {a * 1e3:.1f} ms, safe loader {b * 1e3:.1f} ms, ratio {b / a:.3f}",
                  flush=True)
        res = run_distributed(_resume, 4, tmp, size, args.resume_rounds, timeout=3600)
        slowest = {m: [max(r[m][i] for r in res) for i in range(args.resume_rounds)] for m in ("today", "safe")}
        a, b = statistics.median(slowest["today"]), statistics.median(slowest["safe"])
        rows.append({"read": "resume ZeRO 1 DP 2 -> 4, slowest rank", "today_s": a, "safe_s": b, "ratio": b / a,
                     "today_all_s": slowest["today"], "safe_all_s": slowest["safe"]})
        print(f"resume: weights_only=False {a:.3f} s, safe loader {b:.3f} s, ratio {b / a:.3f}", flush=True)
        checks = [_time(safe_load.check, files) for _ in range(args.rounds)]
        rows.append({"read": "check only (memory-mapped, no tensor read)", "today_s": None, "safe_s": statistics.median(checks),
                     "ratio": None, "safe_all_s": checks})
        out = {"command": "python benchmarks/bench_safe_load.py" + (" --size large" if args.size == "large" else ""),
               "params": params, "blocks": size[0], "ffn": size[1], "files": len(files), "bytes": nbytes,
               "rounds": args.rounds, "rows": rows, "cpu": os.cpu_count(), "torch": torch.__version__,
               "load_avg_1min_at_end": os.getloadavg()[0]}
        out_path.write_text(json.dumps(out, indent=1) + "\n")
        print("->", out_path)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())

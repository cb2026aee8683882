"""Newton-Schulz in bf16 vs fp32 (MuonRule ``ns_dtype``), side by side, per CPU kind.

    python benchmarks/bench_ns_dtype.py            # writes benchmarks/results/ns_dtype.json

Each CPU kind runs in its own child process, one thread, the same shapes, bf16 and fp32
interleaved: "native" (this machine as it is) and "avx2" (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``: what an AVX2-only AMD CPU gets, where
oneDNN has no bf16 matrix kernel).  Per shape: the median seconds of one Newton-Schulz
(5 steps, standard, the rule's ``orthogonalise``: bf16 direction out) per dtype, their ratio,
the relative Frobenius distance of the fp32 direction from the bf16 one, and what
``ns_dtype: "auto"`` chose in that process (from its probe).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "ns_dtype.json"
#: 384x1024: the issue's example; 256x1024 and 768x768: the bench model's kinds of matrices
SHAPES = [(256, 1024), (384, 1024), (768, 768)]
KINDS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                 "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def child(repeats: int) -> dict:
    import torch

    from canzona_ds.optim import muon

    torch.set_num_threads(1)
    rules = {d: muon.MuonRule(ns_dtype=d) for d in ("bf16", "fp32")}
    rows = []
    for shape in SHAPES:
        G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {d: [] for d in rules}
        out = {}
        for r in range(repeats + 1):  # the first round warms up
            for d in (rules if r % 2 else reversed(list(rules))):
                t0 = time.perf_counter()
                out[d] = rules[d].orthogonalise(G)
                if r:
                    times[d].append(time.perf_counter() - t0)
        med = {d: statistics.median(t) for d, t in times.items()}
        rows.append({"shape": list(shape), "bf16_s": med["bf16"], "fp32_s": med["fp32"],
                     "bf16_over_fp32": med["bf16"] / med["fp32"],
                     "rel_distance": ((out["fp32"].float() - out["bf16"].float()).norm()
                                      / out["bf16"].float().norm()).item()})
    probe = muon.probe_matmul_seconds("cpu")
    return {"rows": rows, "probe_s": probe, "auto_chose": str(muon.resolve_ns_dtype("auto", "cpu")),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats)))
        return
    result = {"command": "python benchmarks/bench_ns_dtype.py", "machine": platform.processor() or platform.machine(),
              "threads": 1, "ns_steps": 5, "ns_method": "standard", "kinds": {}}
    for kind, env in KINDS.items():
        proc = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)],
                              env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              check=True)
        result["kinds"][kind] = {"env": env, **json.loads(proc.stdout)}
        print(kind, json.dumps(result["kinds"][kind]["rows"]), file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

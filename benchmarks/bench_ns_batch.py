"""Batched Newton-Schulz on the owner (MuonRule ``ns_batch``), measured side by side on CPU.

    python benchmarks/bench_ns_batch.py        # writes benchmarks/results/ns_batch.json

The model: the 49 projection matrices of bench_zero3's 7-layer Qwen3 (hidden 320, 4 query heads
of 80, 2 key/value heads, SwiGLU 864): per layer q/o 320x320, k/v 160x320, gate/up 864x320,
down 320x864.  For DP = 1, 2, 4 the default plan (``_plan``: what CanzonaOptimizer builds at
ZeRO-1/2) gives each rank its matrices; every rank's step (``rule_steps`` over them, the
owner's path) runs in this one process, one thread, with ``ns_batch`` true and false
interleaved (alternating order) on the same gradients.  Recorded per rank: the median thread
CPU time (``time.thread_time``) of the step over the timed steps; reported: the busiest rank
(the step ends when it is done) per setting and their ratio, for ns_dtype bf16 (the default)
and fp32.  The results are checked equal bit for bit between the two settings every step.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canzona_ds.config import CanzonaConfig  # noqa: E402
from canzona_ds.optimizer import _plan  # noqa: E402
from canzona_ds.optim.rule import MatrixInfo, rule_steps  # noqa: E402
from canzona_ds.planning.params import specs_from_named_shapes  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "ns_batch.json"
LAYERS, HIDDEN, FFN, HEADS, KV, HEAD_DIM = 7, 320, 864, 4, 2, 80


def model_shapes(layers: int = LAYERS) -> list[tuple[str, tuple[int, int]]]:
    per = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV * HEAD_DIM, HIDDEN), "v_proj": (KV * HEAD_DIM, HIDDEN),
           "o_proj": (HIDDEN, HEADS * HEAD_DIM), "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN),
           "down_proj": (HIDDEN, FFN)}
    return [(f"layers.{i}.{k}.weight", s) for i in range(layers) for k, s in per.items()]


def run(dps: list[int], steps: int, ns_dtypes: list[str], layers: int) -> dict:
    torch.set_num_threads(1)
    shapes = model_shapes(layers)
    specs = specs_from_named_shapes(shapes)
    out = {"command": "python benchmarks/bench_ns_batch.py", "machine": platform.processor() or platform.machine(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": 1, "steps": steps,
           "model": f"{layers} Qwen3 layers, hidden {HIDDEN}, SwiGLU {FFN}: {len(shapes)} matrices", "rows": []}
    g = torch.Generator().manual_seed(0)
    for ns_dtype in ns_dtypes:
        cfgs = {b: CanzonaConfig.from_ds("CanzonaMuon", {"ns_dtype": ns_dtype, "ns_batch": b}) for b in (True, False)}
        for dp in dps:
            plan = _plan(specs, dp, cfgs[True], cfgs[True].rule)
            ranks = []
            for r, idx in enumerate(plan.rank_params):
                names = [shapes[i] for i in idx]
                W0 = [torch.randn(s, generator=g) for _, s in names]
                params = {b: [w.clone() for w in W0] for b in cfgs}
                states: dict[bool, dict] = {b: {} for b in cfgs}
                infos = [MatrixInfo(n, s) for n, s in names]
                cpu: dict[bool, list[float]] = {b: [] for b in cfgs}
                for t in range(1, steps + 2):  # step 1 warms up (state creation, the batch probe)
                    grads = [torch.randn(s, generator=g) for _, s in names]
                    for b in ((True, False) if t % 2 else (False, True)):
                        c = time.thread_time()
                        rule_steps(cfgs[b].rule, list(zip(params[b], grads, infos)), states[b], t, 0.02, 0.0)
                        if t > 1:
                            cpu[b].append(time.thread_time() - c)
                    if not all(torch.equal(x, y) for x, y in zip(params[True], params[False])):
                        raise RuntimeError(f"ns_batch changed the result (dp={dp}, rank {r}, step {t})")
                groups = {}
                for _, s in names:
                    groups[s] = groups.get(s, 0) + 1
                ranks.append({"rank": r, "matrices": len(names), "shape_groups": len(groups),
                              "batched_ms": 1e3 * statistics.median(cpu[True]),
                              "one_at_a_time_ms": 1e3 * statistics.median(cpu[False])})
            busy_b = max(x["batched_ms"] for x in ranks)
            busy_o = max(x["one_at_a_time_ms"] for x in ranks)
            out["rows"].append({"ns_dtype": ns_dtype, "dp": dp, "ranks": ranks, "busiest_batched_ms": busy_b,
                                "busiest_one_at_a_time_ms": busy_o, "batched_over_one": busy_b / busy_o})
            print(json.dumps(out["rows"][-1]), file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ns-dtype", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32", "auto"])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    result = run(args.dp, args.steps, args.ns_dtype, args.layers)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Mixture-of-experts: the DP plan with expert stacks kept whole, at Qwen3-30B-A3B and
DeepSeek-V2-Lite scale, and (``--measured``) the busiest rank's rule time on a tiny MoE.

    python benchmarks/bench_moe.py              # planned part -> benchmarks/results/moe.json
    python benchmarks/bench_moe.py --measured   # also the measured part (gloo, DP 2/4/8; minutes)

Planned (pure planning, no processes): ``canzona_ds.planning.compare`` for DP 8-128, tp=1,
cost "flops" (amortised) from each rule's own cost model.  ``whole``: the default planner
(multi_lpt) with every expert stack one unit of ownership, which is what the ZeRO-1/2 layout
realises; ``per_expert``: each expert a unit of its own (lpt), what splitting stacks across
owners could reach; ``bound``: the largest stack's load over the mean (no whole-stack plan
beats it).  ``ep`` > 1 (rows for ep in EPS where ep divides DP and the experts): DeepSpeed MoE's
expert parallelism (``compare(ep=...)``, ``canzona-plan --ep``): each expert-parallel rank
holds E/ep experts of every stack, planned over its expert-data-parallel group (DP/ep ranks),
the dense matrices over all DP ranks; a DP rank's load is its dense share plus its expert
share, ratios max/mean over all DP ranks.  There ``per_expert`` is what the runtime realises
(DeepSpeed MoE's experts are separate matrices, planned by the default multi_lpt in the owned
layout) and ``whole`` an HF-style stack of E/ep per expert-parallel rank, kept whole; ``joint``
(PLANNER ONLY, the runtime does not do it) the per-expert units with the dense and expert
partitions planned by LPT, each seeded with the other's per-rank loads
(``compare.plan_expert_parallel(joint=True)``); ``per_expert_mixed`` the runtime's plans with
``layout: "mixed"`` forced (each partition in the mixed layout, its hosted matrices over its
own DP group: ``compare.plan_expert_parallel(mixed=True)``).

Measured: the tiny transformers ``Qwen3MoeForCausalLM`` of ``canzona_testkit.hf_moe`` (4 layers,
16 experts per stack: gate_up [16, 64, 64], down [16, 64, 32]) under ZeRO-1 at DP 2, 4, 8 with CanzonaMuon and
with DeepSpeed's own ``"Muon"`` (its Newton-Schulz is batched over a 3-D stack's dim 0; its
results are not compared here, only its cost: every rank all-gathers and orthogonalises each
matrix its partition touches).  Per rank: thread CPU time of the
matrix rule (``time.thread_time`` around our matrix step and around DeepSpeed's ``muon_update``
calls: the rule's work on this rank, free of oversubscription; both engines in the same
processes, steps interleaved), median over the steps after a warm-up; the table reports the
busiest rank's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("qwen3-30b-a3b", "deepseek-v2-lite")
DPS = (8, 16, 32, 64, 128)
#: expert-parallel sizes (rows where ep divides DP and the number of experts)
EPS = (1, 8, 32)
RULES = ("muon", "shampoo", "soap")
MEASURED_DPS = (2, 4, 8)
STEPS, WARMUP = 8, 2


def planned() -> dict:
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.compare import compare

    out: dict = {}
    for model in MODELS:
        for rule in RULES:
            rows = []
            for ep in EPS:
                for dp in DPS:
                    if dp % ep:
                        continue
                    t = time.perf_counter()
                    s = compare(model, dp, cost_model=cost_model(rule), cost="flops", ep=ep).summary
                    x = s["expert_stacks"]
                    rows.append({"dp": dp, "ep": x["ep"], "expert_dp": x["expert_dp"],
                                 "per_expert_planner": x["per_expert_planner"], "whole": x["whole"],
                                 "per_expert": x["per_expert"], "joint": x.get("joint"),
                                 "per_expert_mixed": x.get("per_expert_mixed"), "stacks": x["stacks"],
                                 "experts_per_stack": x["experts_per_stack"],
                                 "largest_stack_numel": x["largest_stack_numel"],
                                 "plan_s": round(time.perf_counter() - t, 2)})
            out.setdefault(model, {})[rule] = rows
    return {"models": out, "planner": "multi_lpt", "per_expert_planner": "lpt", "cost": "flops",
            "command": "python benchmarks/bench_moe.py"}


# ------------------------------------------------------------------------- measured
KINDS = {"canzona": "CanzonaMuon", "deepspeed": "Muon"}


def _measure_worker(rank, dp):
    """Both engines in the same processes, their steps interleaved (alternating order) so they see
    the same background load; per step, the thread CPU time of the matrix rule: ours inside
    ``CanzonaOptimizer._matrix_step``, DeepSpeed's inside every ``muon_update`` call (which its
    ZeRO runs on the matrices this rank's partition touches)."""
    import canzona_ds  # noqa: F401
    import deepspeed
    import torch
    from deepspeed.runtime.zero.muon import original_muon

    from canzona_testkit.models import ds_config
    from canzona_testkit.hf_moe import make_moe_model, moe_batches

    torch.set_num_threads(1)
    spent = [0.0]

    def wrap(fn):
        def timed(*a, **k):
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.thread_time() - c
        return timed

    original_muon.muon_update = wrap(original_muon.muon_update)
    engines = {}
    for label, opt_type in KINDS.items():
        model = make_moe_model(0, **MEASURED_SHAPE)
        section = {"type": opt_type, "params": {"lr": 0.02, "weight_decay": 0.1}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(dp, micro=2, optimizer=section, stage=1))
        inner = engine.optimizer.optimizer
        if label == "canzona":
            inner._matrix_step = wrap(inner._matrix_step)
        engines[label] = engine
    times = {label: [] for label in KINDS}
    labels = list(KINDS)
    for s, (x, y) in enumerate(moe_batches(WARMUP + STEPS, 2 * dp)):
        x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
        for label in (labels if s % 2 else labels[::-1]):
            engine = engines[label]
            torch.distributed.barrier()
            spent[0] = 0.0
            engine.backward(engine(x, y))
            engine.step()
            if s >= WARMUP:
                times[label].append(spent[0])
    return {label: statistics.median(t) for label, t in times.items()}


#: the measured model: canzona_testkit.hf_moe's tiny Qwen3MoeForCausalLM, larger
MEASURED_SHAPE = dict(layers=4, experts=16, hidden=64, moe_intermediate=32)


def measured() -> dict:
    from canzona_testkit.dist import run_distributed

    rows = []
    for dp in MEASURED_DPS:
        per_rank = run_distributed(_measure_worker, dp, timeout=1200)
        row = {"dp": dp}
        for label in KINDS:
            ms = [1e3 * r[label] for r in per_rank]
            row[label] = {"busiest_ms": max(ms), "total_ms": sum(ms), "per_rank_ms": ms}
        row["ratio"] = row["deepspeed"]["busiest_ms"] / row["canzona"]["busiest_ms"]
        rows.append(row)
        print(f"DP={dp}: busiest rank rule CPU ms: canzona {row['canzona']['busiest_ms']:.1f}, "
              f"deepspeed {row['deepspeed']['busiest_ms']:.1f}", flush=True)
    return {"rows": rows, "steps": STEPS, "warmup": WARMUP, "zero_stage": 1, "shape": MEASURED_SHAPE,
            "metric": "per rank: median over steps of the matrix rule's thread CPU time; busiest = max over ranks",
            "command": "python benchmarks/bench_moe.py --measured"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", action="store_true", help="also run the measured part (gloo processes)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe.json"))
    args = ap.parse_args(argv)
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.is_file() else {}
    data = {"planned": planned(), "measured": measured() if args.measured else old.get("measured")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

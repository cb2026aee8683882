"""Pipeline parallelism: per-stage load balance, planned (the paper's Figure 12 setting) and measured.

    python benchmarks/bench_pipeline.py      # -> benchmarks/results/pipeline.json (~1 min on 2 cores)

Planned.  Qwen3-14B, DP=32, TP=4, PP=2 (the paper's Figure 12 runs): each pipeline stage plans
its own matrices over its DP group (``planning.models.pipeline_stage``: Megatron's even split
of the layers).  Per stage and rule, every planner's busiest-rank / mean ratio of amortised
FLOPs and of memory, and the LP lower bound, from ``plan_rules.evaluate`` (the same rules,
planners and cost models as ``benchmarks/plan_rules.py``).  The embedding and output layer
are AdamW's, so both stages plan the same 80 matrices.

Measured.  A real PP=2 x DP=2 run (world 4, gloo, ZeRO-1, DeepSpeed ``PipelineEngine``) of a
small decoder whose blocks have different MLP widths (``FFN``: matrices of heterogeneous
shapes), with CanzonaMuon, CanzonaShampoo and CanzonaSOAP, each under the default planner
and under ``naive_atomic`` (one flat buffer cut into equal element ranges at the nearest
matrix boundary: atomic, but blind to the rule's cost).  All six engines live in the same
four processes and their ``train_batch`` calls are interleaved (alternating order), so they
see the same background load.  Per rank we record the thread CPU time
(``time.thread_time``) spent in ``placement.step``, the matrix rule's step (no collective
without TP), summed over the timed iterations (steps 5-24 by default: all of them past
Shampoo's start_preconditioning_step, with four Shampoo and four SOAP refreshes, so the sum is
the amortised cost the planner balances); per stage we report busiest rank / mean of the
stage, beside that stage's planned ratio from the optimizer's own plan
(``opt.plan``, costed by ``planning.report.dp_report`` with the optimizer's rule).

4 ranks on 2 cores oversubscribe the machine: wall time measures the scheduler as much as
the ranks, so the comparison is per-rank CPU time (waiting for a core is not CPU time; cache
and memory contention still add noise, alike for every kind).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_rules  # noqa: E402
from bench_zero import RULE_PARAMS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: the measured model: hidden D, vocab, sequence, and the MLP width of each block (3 per stage)
D, VOCAB, SEQ = 256, 256, 32
FFN = (512, 1536, 256, 1536, 256, 128)
PP, DP = 2, 2
PLANNERS = ("multi_lpt", "naive_atomic")


# ------------------------------------------------------------------------------- planned
def planned() -> dict:
    """Per stage of the Figure 12 setting with PP=2: plan_rules' evaluation of every rule."""
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.models import matrix_specs, model_specs, pipeline_stage

    specs = model_specs(plan_rules.MODEL, tp=plan_rules.TP)
    out = {"model": plan_rules.MODEL, "dp": plan_rules.DP, "tp": plan_rules.TP, "pp": plan_rules.PP,
           "default_dp_planner": plan_rules.DEFAULT_DP_PLANNER, "rules": {}}
    for label, (name, kw) in plan_rules.RULES.items():
        rule = cost_model(name, **kw)
        out["rules"][label] = [plan_rules.evaluate(matrix_specs(pipeline_stage(specs, plan_rules.PP, k)), rule,
                                                   plan_rules.DP) for k in range(plan_rules.PP)]
    return out


# ------------------------------------------------------------------------------- measured model
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)  # "embed" in the name: AdamW's

    def forward(self, x):
        return self.embed(x)


class Block(nn.Module):
    """Residual block: fused qkv [3D, D], proj [D, D], fc1 [ffn, D], fc2 [D, ffn]."""

    def __init__(self, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.fc1 = nn.Linear(D, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, D, bias=False)

    def forward(self, h):
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        h = h + self.proj(F.silu(q) * k + v)
        return h + self.fc2(F.gelu(self.fc1(h)))


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, h):
        return self.norm(h)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, VOCAB, bias=False)  # an output head: AdamW's

    def forward(self, h):
        return self.head(h)


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def kinds() -> dict[str, dict]:
    out = {}
    for opt_type, params in RULE_PARAMS.items():
        for planner in PLANNERS:
            out[f"{opt_type.removeprefix('Canzona').lower()}/{planner}"] = {
                "type": opt_type, "params": dict(params, planner=planner)}
    return out


def _worker(rank: int, world: int, steps: int, warmup: int, micro: int, gas: int) -> dict:
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from canzona_ds.optimizer import CanzonaOptimizer
    from canzona_ds.planning.report import dp_report, rank_costs

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    specs = [LayerSpec(Embed), *(LayerSpec(Block, f) for f in FFN), LayerSpec(Norm), LayerSpec(Head)]
    engines, cpu, info = {}, {}, {}
    for label, section in kinds().items():
        torch.manual_seed(0)
        module = PipelineModule(layers=specs, num_stages=PP, loss_fn=_loss, partition_method="type:^Block$")
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
               "train_batch_size": micro * gas * DP, "optimizer": section, "zero_optimization": {"stage": 1},
               "gradient_clipping": 0.0, "steps_per_print": 10 ** 9}
        engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()], config=cfg)
        opt = engine.optimizer.optimizer
        assert isinstance(opt, CanzonaOptimizer) and opt.plan is not None, type(opt)
        grid = module.mpu()
        stage, dp_rank = grid.get_stage_id(), grid.get_data_parallel_rank()
        plan = opt.plan
        held = sorted(opt.placement.held_names())
        planned_held = sorted(plan.specs[i].name for i in plan.rank_params[dp_rank])
        report = dp_report(plan, opt.rule)
        info[label] = {"stage": stage, "dp_rank": dp_rank, "held": held, "planned_held": planned_held,
                       "matrices": len(plan.specs), "shapes": {s.name: list(s.shape) for s in plan.specs},
                       "planner": plan.planner, "planned_flops": rank_costs(plan, "flops", opt.rule),
                       "planned_memory": rank_costs(plan, "memory", opt.rule),
                       "planned_flops_ratio": report.flops_ratio, "planned_memory_ratio": report.memory_ratio}
        rec: list[float] = []

        def timed(group, ctx, _stock=opt.placement.step, _rec=rec):
            c = time.thread_time()
            try:
                return _stock(group, ctx)
            finally:
                _rec.append(time.thread_time() - c)

        opt.placement.step = timed
        engines[label], cpu[label] = engine, rec
    g = torch.Generator().manual_seed(1)
    n = (warmup + steps) * gas
    x = torch.randint(0, VOCAB, (n * DP, micro, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n * DP, micro, SEQ), generator=g)
    mine = [(x[i], y[i]) for i in range(dp_rank, n * DP, DP)]  # the last loop's dp_rank: the same grid
    iters = {label: iter(mine) for label in engines}
    per_step: dict[str, list[float]] = {label: [] for label in engines}
    labels = list(engines)
    for s in range(warmup + steps):
        for label in (labels if s % 2 else labels[::-1]):
            cpu[label].clear()
            torch.distributed.barrier()
            engines[label].train_batch(iters[label])
            if s >= warmup:
                per_step[label].append(sum(cpu[label]))
    return {label: dict(info[label], rule_cpu_s=per_step[label]) for label in engines}


def measured(steps: int, warmup: int, micro: int, gas: int) -> dict:
    from canzona_testkit.dist import run_distributed

    out = run_distributed(_worker, PP * DP, steps, warmup, micro, gas, timeout=900)
    rows, shapes = [], {}
    for label in kinds():
        rule, planner = label.split("/")
        for stage in range(PP):
            ranks = sorted((o[label] for o in out if o[label]["stage"] == stage), key=lambda r: r["dp_rank"])
            assert [r["dp_rank"] for r in ranks] == list(range(DP)), ranks
            for r in ranks:  # the plan's rank r is DP rank r: it holds exactly the planned matrices
                assert r["held"] == r["planned_held"], (label, stage, r["held"], r["planned_held"])
            first = ranks[0]
            assert all(r["planned_flops"] == first["planned_flops"] for r in ranks)
            total = [sum(r["rule_cpu_s"]) for r in ranks]
            mean = statistics.fmean(total)
            rows.append({
                "rule": rule, "planner": first["planner"], "stage": stage, "matrices": first["matrices"],
                "planned_flops_ratio": first["planned_flops_ratio"],
                "planned_memory_ratio": first["planned_memory_ratio"],
                "planned_gflop_per_rank": [f / 1e9 for f in first["planned_flops"]],
                "measured_ratio": max(total) / mean if mean > 0 else 1.0,
                "rule_cpu_ms_per_step": [1e3 * t / steps for t in total],
                "rule_cpu_ms_per_step_median": [1e3 * statistics.median(r["rule_cpu_s"]) for r in ranks],
                "matrices_per_rank": [len(r["held"]) for r in ranks],
                "held": [r["held"] for r in ranks],
            })
            shapes[stage] = first["shapes"]
            row = rows[-1]
            print(f"{label:22s} stage {stage}: planned {row['planned_flops_ratio']:.3f}  measured "
                  f"{row['measured_ratio']:.3f}  per rank ms/step "
                  f"{', '.join(f'{v:.1f}' for v in row['rule_cpu_ms_per_step'])}", flush=True)
    return {"pp": PP, "dp": DP, "world": PP * DP, "hidden": D, "vocab": VOCAB, "seq": SEQ, "ffn": list(FFN),
            "micro": micro, "gas": gas, "steps": steps, "warmup": warmup, "zero_stage": 1, "backend": "gloo",
            "cpu_cores": os.cpu_count(), "torch": torch.__version__,
            "rule_params": dict(RULE_PARAMS), "stage_matrix_shapes": [shapes[k] for k in range(PP)],
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed iterations (keep a multiple of the refresh period, 5)")
    ap.add_argument("--warmup", type=int, default=4,
                    help="untimed iterations: 4 puts Shampoo's first refresh (step 5) in the timed window")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "pipeline.json"))
    args = ap.parse_args()
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    t0 = time.perf_counter()
    data = {"command": cmd, "planned": planned()}
    data["planned_s"] = time.perf_counter() - t0
    data["measured"] = measured(args.steps, args.warmup, args.micro, args.gas)
    data["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    import tables
    print(tables.render_data("pipeline_planned", data))
    print()
    print(tables.render_data("pipeline_measured", data))
    print(f"\nwrote {out} in {data['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

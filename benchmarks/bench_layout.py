"""The owned (planned-padding) and mixed ZeRO-1/2 layouts side by side: planned and measured.

    python benchmarks/bench_layout.py --suite planned    # -> results/layout_planned.{md,json}
    python benchmarks/bench_layout.py --suite measured   # -> results/layout_measured.{md,json}
    python benchmarks/bench_layout.py --suite grid       # -> results/layout_grid.{md,json}

planned   Qwen3 1.7B / 8B / 32B at TP=8 (the matrices of one TP rank), DP 32 ... 1024, Muon's
          cost model: for the atomic plan of the default planner (multi_lpt, the owned layout)
          and the mixed plan (planning/mixed.py), the padding, FLOPs and optimizer-memory
          max/avg, the hosted share, the busiest rank's per-step cost (bytes: its share of
          ZeRO's gradient reduction and all-gather plus the hosted all-to-alls, and their
          latency, planning/mixed.step_bytes) and what ``layout: "auto"`` picks.  Pure
          planning, no processes.
measured  A one-layer Qwen3-shaped model (models/qwen3.py preset "tiny" with num_layers=1: q, k,
          v, o, gate, up, down = 7 matrices) under ZeRO-1 with CanzonaMuon at 8 CPU ranks
          (gloo), ``layout: "owned"`` and ``layout: "mixed"`` (and DeepSpeed's AdamW) built in
          the same rank processes and stepped alternately: the bit16 buffer ZeRO allocates
          over the model's parameters, the bytes every rank sends per step by collective
          (canzona_testkit.comm.CommCounter over forward + backward + step: deepspeed.comm's
          collectives and the hosted all-to-alls), and each layout's final weights against the
          single-process reference (canzona_ds.reference on ZeRO's averaged gradients, computed in a
          rank process), matrices and AdamW parameters apart: gloo's 8-rank sum differs from
          the reference's by ulps, which AdamW turns into ~lr on parameters whose gradient is
          rounding noise, and which Muon's bf16 Newton-Schulz can flip (tests/test_layout_mixed.py
          checks exactness at DP=2 and DP=4).
          Then the same two layouts under tensor parallelism: DP=4 x TP=2 on the 8 ranks, the
          Megatron stand-in (canzona_testkit/megatron_standin.TinyGPTBlock at TP_CFG: 4 TP-split
          matrices and one replicated; mixed hosts the TP-split ones over the DP x TP grid), the
          bit16 buffer of one rank over its TP-local parameters, the bytes per step as above, and
          the mixed layout's final weights against the owned layout's (bit for bit at DP2 x TP2
          in tests/test_layout_mixed_tp.py; gloo's 4-rank DP sums can differ by ulps here).
grid      The mixed layout under DP x TP, per (dp, tp) cell: the rule's FLOPs (Muon's cost model,
          amortised, whole matrices) of everything a cell updates, as the runtime places it
          (planning/mixed.tp_cells: owned TP-split matrices where the owned TP runtime hosts
          them, grid-hosted TP-split ones at the plan's DP host and the TP rank grid_tp_hosts
          picks, replicated owned and DP-hosted ones on every TP rank of their DP index).  The
          baseline ("before") picks the grid hosts' TP ranks without the owned TP runtime's
          load, as versions before the seed did; "after" seeds each TP rank with it.  Qwen3
          1.7B / 8B / 32B at TP=8 (layout "mixed", DP 4 ... 64), sizes where "auto" itself
          picks the mixed layout (GRID_AUTO) and the measured suite's Megatron stand-in
          (TP_CFG at TP=2).  Pure planning, no processes; ratios, both
          choices of one plan side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

MODELS = ("qwen3-1.7b", "qwen3-8b", "qwen3-32b")
DPS = (32, 64, 128, 256, 512, 1024)
TP = 8


def planned() -> dict:
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.dp import DEFAULT_DP_PLANNER, DEFAULT_MAX_PADDING, choose_layout, owned_step_bytes, \
        plan_mixed_dp
    from canzona_ds.planning.cost import cost_vector
    from canzona_ds.planning.mixed import LATENCY_BYTES
    from canzona_ds.planning.models import matrix_specs, model_specs
    from canzona_ds.planning.report import dp_report

    rule = cost_model("muon")
    rows = []
    for model in MODELS:
        specs = matrix_specs(model_specs(model, TP))
        for dp in DPS:
            chosen, atomic, why = choose_layout(specs, dp, cost="flops", model=rule)
            mixed = chosen if chosen.mixed else plan_mixed_dp(specs, dp, cost_vector(specs, "flops", rule), "flops",
                                                              rule)
            row = {"model": model, "dp": dp, "tp": TP, "matrices": len(specs), "choice": chosen.planner, "why": why}
            for key, plan, sb in (("owned", atomic, owned_step_bytes(atomic)),
                                  ("mixed", mixed, mixed.extra["step_bytes"])):
                r = dp_report(plan, rule)
                row[key] = {"padding": r.padding_fraction, "flops_ratio": r.flops_ratio,
                            "flops_lower_bound": r.flops_lower_bound, "memory_ratio": r.memory_ratio,
                            "memory_lower_bound": r.memory_lower_bound,
                            "hosted": len(plan.hosted), "hosted_share": plan.extra.get("hosted_numel", 0) /
                            sum(s.numel for s in specs), "all_gather_bytes": sb["all_gather"],
                            "hosted_sent_max": sb["hosted_sent_max"], "hosted_collectives": sb["hosted_collectives"],
                            "rank_cost": sb["rank_cost"]}
            rows.append(row)
    return {"optimizer": "muon", "tp": TP, "default_dp_planner": DEFAULT_DP_PLANNER,
            "max_padding": DEFAULT_MAX_PADDING, "latency_bytes": LATENCY_BYTES, "rows": rows}


# ------------------------------------------------------------------------------ grid
GRID_DPS = (4, 8, 16, 32, 64)
#: (model, TP, DP) where ``layout: "auto"`` itself picks the mixed layout and the seed matters
GRID_AUTO = (("qwen3-1.7b", 2, 32), ("qwen3-1.7b", 4, 32), ("llama-3-70b", 2, 128), ("llama-3-70b", 4, 128),
             ("llama-3-70b", 8, 128))
#: the measured suite's DP x TP stand-in at these (DP, TP) sizes
GRID_STANDIN = ((2, 2), (4, 2))


def standin_specs(tp: int) -> list:
    """The matrices of canzona_testkit/megatron_standin.TinyGPTBlock at TP_CFG, as one TP rank holds them
    (model order: fused qkv and fc1 column-parallel, proj and fc2 row-parallel, mix replicated)."""
    from canzona_ds.planning.params import ParamSpec

    c = TP_CFG
    col, row = dict(tp_partition_dim=0, tp_size=tp), dict(tp_partition_dim=1, tp_size=tp)
    return [ParamSpec("qkv.weight", ((c["heads"] + 2 * c["kv_heads"]) * c["head_dim"] // tp, c["hidden"]), **col),
            ParamSpec("proj.weight", (c["hidden"], c["heads"] * c["head_dim"] // tp), **row),
            ParamSpec("fc1.weight", (2 * c["ffn"] // tp, c["hidden"]), **col),
            ParamSpec("fc2.weight", (c["hidden"], c["ffn"] // tp), **row),
            ParamSpec("mix.weight", (c["hidden"], c["hidden"]))]


def _grid_row(model: str, specs: list, dp: int, tp: int, rule) -> dict:
    from canzona_ds.planning.cost import cost_vector
    from canzona_ds.planning.dp import choose_layout, plan_mixed_dp
    from canzona_ds.planning.mixed import full_matrix_flops, tp_cells

    plan = plan_mixed_dp(specs, dp, cost_vector(specs, "flops", rule), "flops", rule)
    before, after = tp_cells(plan, tp, rule, seed_owned=False), tp_cells(plan, tp, rule)
    cells = [f for row in after["cell_flops"] for f in row]
    mean = sum(cells) / len(cells)
    largest = max(full_matrix_flops(s, rule) for s in specs)
    worst = {k: max(map(max, got["cell_flops"])) for k, got in (("before", before), ("after", after))}
    auto = "mixed" if choose_layout(specs, dp, cost="flops", model=rule)[0].mixed else "owned"
    return {"model": model, "dp": dp, "tp": tp, "matrices": len(specs), "auto": auto,
            "owned_tp": len(after["owned_tp"]), "grid_hosted": len(after["grid_tp"]),
            "dp_hosted": sum(1 for i in plan.hosted if not specs[i].is_tp_split),
            "grid_moved": sum(1 for i, t in after["grid_tp"].items() if before["grid_tp"][i] != t),
            "dp_plan_ratio": max(plan.rank_load) / (sum(plan.rank_load) / dp),
            "before": worst["before"] / mean, "after": worst["after"] / mean,
            "after_vs_before": worst["after"] / worst["before"], "bound": max(largest, mean) / mean}


def grid() -> dict:
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.models import matrix_specs, model_specs

    rule = cost_model("muon")
    rows = [_grid_row(model, matrix_specs(model_specs(model, TP)), dp, TP, rule) for model in MODELS for dp in GRID_DPS]
    rows += [_grid_row(model, matrix_specs(model_specs(model, tp)), dp, tp, rule) for model, tp, dp in GRID_AUTO]
    rows += [_grid_row("Megatron stand-in", standin_specs(tp), dp, tp, rule) for dp, tp in GRID_STANDIN]
    return {"optimizer": "muon", "layout": "mixed", "standin": TP_CFG, "rows": rows}


# ------------------------------------------------------------------------------ measured
DP, STEPS, MICRO = 8, 3, 2
KINDS = ("owned", "mixed", "adamw")


def _cfg(kind: str) -> dict:
    from canzona_testkit.models import HP

    if kind == "adamw":
        opt = {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    else:
        opt = {"type": "CanzonaMuon", "params": dict(HP["CanzonaMuon"], layout=kind)}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "train_batch_size": MICRO * DP,
            "optimizer": opt, "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9}


def _model():
    from canzona_ds.models.qwen3 import build_model, preset

    return build_model(preset("tiny", num_layers=1), seed=0)


def _data(steps: int):
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (MICRO * DP, 17), generator=g) for _ in range(steps)]


def _loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:])[1]


def _worker(rank: int, world: int) -> dict:
    import numpy as np
    import torch

    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed
    from canzona_testkit.comm import CommCounter

    engines = {}
    for kind in KINDS:
        model = _model()
        engines[kind], _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config=_cfg(kind))
    out = {}
    for kind, engine in engines.items():
        z = engine.optimizer
        n_params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        buf = sum(f.numel() for f in z.bit16_groups_flat)
        out[kind] = {"params": n_params, "bit16_buffer": buf, "ratio": buf / n_params, "bytes": [], "by_op": []}
        layout = getattr(z, "canzona_layout", None)
        if layout is not None:
            opt = z.optimizer
            out[kind].update(matrix_padding=layout.padding_fraction, hosted=[opt.matrix_names[k] for k in
                                                                             layout.hosted_indices()],
                             matrix_buffer=layout.buffer_numel, matrix_numel=layout.total_numel,
                             planned=opt.plan.extra.get("step_bytes"))
    data = _data(STEPS)
    for s, tokens in enumerate(data):
        order = KINDS if s % 2 == 0 else tuple(reversed(KINDS))  # alternate: the same background for all
        for kind in order:
            engine = engines[kind]
            with CommCounter() as c:
                loss = _loss(engine, tokens[rank * MICRO:(rank + 1) * MICRO])
                engine.backward(loss)
                engine.step()
            # ZeRO's collectives go through deepspeed.comm; the hosted all-to-alls straight to torch
            ops = {op: wb for op, (_, _, wb) in c.by_op("deepspeed").items()}
            a2a = c.wire_bytes("torch", ops=("all_to_all_single",))
            if a2a:
                ops["all_to_all_single (hosted)"] = a2a
            out[kind]["bytes"].append(sum(ops.values()))
            out[kind]["by_op"].append(ops)
    for kind, engine in engines.items():
        out[kind]["final"] = {n: p.detach().float().numpy().copy() for n, p in engine.module.named_parameters()}
    if rank == 0:
        ref = _reference(data)
        matrices = set(engines["owned"].optimizer.optimizer.matrix_names)

        def diff(a: dict, b: dict, names) -> float:
            return max(float(np.abs(a[n] - b[n]).max()) for n in names)

        for kind in ("owned", "mixed"):
            final = out[kind]["final"]
            out[kind]["max_abs_diff_matrices"] = diff(final, ref, matrices)
            out[kind]["max_abs_diff_aux"] = diff(final, ref, set(ref) - matrices)
        out["mixed"]["vs_owned_matrices"] = diff(out["mixed"]["final"], out["owned"]["final"], matrices)
    for kind in KINDS:
        del out[kind]["final"]
    return out


#: DP x TP row: the stand-in's sizes (hidden 64, GQA 4/2 heads of 16, SwiGLU 160)
TP_DP, TP_TP = 4, 2
TP_CFG = dict(vocab=128, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=160)


def _worker_tp(rank: int, world: int) -> dict:
    import numpy as np
    import torch

    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed
    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.comm import CommCounter
    from canzona_testkit.models import HP

    ms.initialize_model_parallel(TP_TP)
    tp_rank, dp_rank = ms.get_tensor_model_parallel_rank(), ms.get_data_parallel_rank()
    engines = {}
    for kind in ("owned", "mixed"):
        model = ms.TinyGPTBlock(**TP_CFG)
        model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(TP_CFG), TP_CFG, TP_TP, tp_rank))
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "CanzonaMuon", "params": dict(HP["CanzonaMuon"], layout=kind)},
               "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9}
        engines[kind], *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                                 mpu=ms.mpu)
    out = {}
    for kind, engine in engines.items():
        z, opt = engine.optimizer, engine.optimizer.optimizer
        layout = z.canzona_layout
        hosted = opt.placement.hosted
        kinds = {n: type(m).__name__ for n, m in (hosted.split.items() if hosted is not None else ())}
        out[kind] = {"params": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
                     "bit16_buffer": sum(f.numel() for f in z.bit16_groups_flat), "bytes": [], "by_op": [],
                     "matrix_padding": layout.padding_fraction,
                     "hosted": [opt.matrix_names[k] for k in layout.hosted_indices()],
                     "grid_hosted": sorted(n for n, k in kinds.items() if k == "GridSplit"),
                     "dp_hosted": sorted(n for n, k in kinds.items() if k == "FlatSplit"),
                     "step_collectives": opt.expected_collectives()}
        out[kind]["ratio"] = out[kind]["bit16_buffer"] / out[kind]["params"]
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, TP_CFG["vocab"], (MICRO * TP_DP, 16), generator=g) for _ in range(STEPS)]
    for s, tokens in enumerate(data):
        for kind in (("owned", "mixed") if s % 2 == 0 else ("mixed", "owned")):
            engine = engines[kind]
            with CommCounter() as c:
                engine.backward(engine(tokens[dp_rank * MICRO:(dp_rank + 1) * MICRO]).pow(2).mean())
                engine.step()
            ops = {op: wb for op, (_, _, wb) in c.by_op("deepspeed").items()}
            a2a = c.wire_bytes("torch", ops=("all_to_all_single",))
            if a2a:
                ops["all_to_all_single (hosted)"] = a2a
            out[kind]["bytes"].append(sum(ops.values()))
            out[kind]["by_op"].append(ops)
    final = {k: {n: p.detach().float().numpy() for n, p in e.module.named_parameters()} for k, e in engines.items()}
    out["mixed"]["vs_owned"] = max(float(np.abs(final["mixed"][n] - final["owned"][n]).max()) for n in final["owned"])
    return out


def _reference(data) -> dict:
    import torch

    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer, zero_average
    from canzona_testkit.models import HP

    torch.set_num_threads(1)
    model = _model()
    opt = ReferenceOptimizer(model.named_parameters(), CanzonaConfig.from_ds("CanzonaMuon", HP["CanzonaMuon"]))
    for tokens in data:
        per_rank = []
        for r in range(DP):
            model.zero_grad(set_to_none=True)
            _loss(model, tokens[r * MICRO:(r + 1) * MICRO]).backward()
            per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
        avg = zero_average(per_rank)
        for n, p in model.named_parameters():
            p.grad = avg[n]
        opt.step()
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def measured() -> dict:
    from canzona_testkit.dist import run_distributed

    res = run_distributed(_worker, DP)
    kinds = {}
    for kind in KINDS:
        per_rank = [r[kind] for r in res]
        r0 = per_rank[0]
        kinds[kind] = {k: r0[k] for k in ("params", "bit16_buffer", "ratio", "matrix_padding", "hosted",
                                          "matrix_buffer", "matrix_numel", "planned", "max_abs_diff_matrices",
                                          "max_abs_diff_aux", "vs_owned_matrices") if k in r0}
        # per step: the busiest rank's bytes and the sum over ranks (median over steps: identical here)
        steps = len(r0["bytes"])
        kinds[kind]["bytes_max_rank"] = sorted(max(r["bytes"][s] for r in per_rank) for s in range(steps))[steps // 2]
        kinds[kind]["bytes_total"] = sorted(sum(r["bytes"][s] for r in per_rank) for s in range(steps))[steps // 2]
        ops = sorted({op for r in per_rank for o in r["by_op"] for op in o})
        kinds[kind]["bytes_by_op_total"] = {op: sum(r["by_op"][-1].get(op, 0.0) for r in per_rank) for op in ops}
    res_tp = run_distributed(_worker_tp, TP_DP * TP_TP)
    tp_kinds = {}
    for kind in ("owned", "mixed"):
        per_rank = [r[kind] for r in res_tp]
        r0 = per_rank[0]
        tp_kinds[kind] = {k: r0[k] for k in ("params", "bit16_buffer", "ratio", "matrix_padding", "hosted",
                                             "grid_hosted", "dp_hosted", "vs_owned") if k in r0}
        if kind == "mixed":
            tp_kinds[kind]["vs_owned"] = max(r["vs_owned"] for r in per_rank)
        tp_kinds[kind]["step_collectives_max_rank"] = max(sum(r["step_collectives"].values()) for r in per_rank)
        steps = len(r0["bytes"])
        tp_kinds[kind]["bytes_max_rank"] = sorted(max(r["bytes"][s] for r in per_rank) for s in range(steps))[steps // 2]
        tp_kinds[kind]["bytes_total"] = sorted(sum(r["bytes"][s] for r in per_rank) for s in range(steps))[steps // 2]
        ops = sorted({op for r in per_rank for o in r["by_op"] for op in o})
        tp_kinds[kind]["bytes_by_op_total"] = {op: sum(r["by_op"][-1].get(op, 0.0) for r in per_rank) for op in ops}
    return {"dp": DP, "steps": STEPS, "model": "qwen3 preset 'tiny', num_layers=1 (7 matrices)", "zero_stage": 1,
            "kinds": kinds,
            "tp": {"dp": TP_DP, "tp": TP_TP, "model": f"Megatron stand-in TinyGPTBlock {TP_CFG}", "kinds": tp_kinds}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("planned", "measured", "grid"), required=True)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    data = {"planned": planned, "measured": measured, "grid": grid}[args.suite]()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"layout_{args.suite}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tables

    names = [stem] + (["layout_measured_tp"] if args.suite == "measured" else [])
    text = "\n\n".join(tables.render(name, out) for name in names)
    (out / f"{stem}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

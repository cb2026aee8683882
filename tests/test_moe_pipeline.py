"""DeepSpeed MoE layers in a PipelineModule (world 4 = PP 2 x DP 2, ep_size 2), the layouts
DeepSpeed 0.19.8 itself runs (docs/moe.md, "MoE and pipeline parallelism"):

    z0  ZeRO stage 0, MoE in stage 0 only      (build_moe_pipe(1): stage 1 holds the head)
    z1  ZeRO stage 1, one MoE layer per stage  (build_moe_pipe(2): the same expert group "ep_size_2")

Each stage's expert-parallel group is its two ranks (DeepSpeed's pipeline-aware expert groups),
so every rank holds 2 of a layer's 4 experts and each expert-DP group is one rank.  Per scenario
(3 ``train_batch`` calls, gradient clipping that clips on every step):

- every owner's matrix updates replay bit for bit from the gradients it saw (MatrixStepRecorder);
- every matrix of the whole model is updated by exactly one rank of its planning group: an expert
  by one rank of its expert-DP group, a dense one by one rank of its stage's DP group at ZeRO 1
  (at ZeRO 0 every DP rank steps every dense matrix it holds, placement "local");
- the global gradient norm each rank clipped with equals ``torch.nn.utils.clip_grad_norm_`` over
  the whole model's gradients (every stage, every expert of every expert-parallel rank, in the
  whole model's order), gathered from the ranks' gradients before the clip, bit for bit;
- the loss falls.

At ZeRO 1 (one MoE layer per stage), the same checks with (each run against the plain fp32 run):

- bf16 (Muon, Shampoo; and Muon with ``grad_accum_dtype`` fp32): the replay, the one-updater and the clip-norm checks (torch's norm over the
  gathered gradients upcast to fp32) bit for bit, the losses within 0.02 of the fp32 run's;
- ZeRO-Offload (``offload_optimizer`` cpu, Muon): every parameter of every rank equal to the run
  without offload, bit for bit;
- the mixed layout (Muon, Shampoo): a matrix hosted in each stage's dense group (stage 0
  ``proj.weight``, stage 1 the gate, its group's only matrix); every parameter equal to the owned
  layout's run bit for bit;
- fp16 with dynamic loss scaling (Muon, clipping): an overflow in one expert's gradient on one
  rank of stage 1 only skips the step on all 4 ranks (weights and rule state unchanged, the
  scale halved, the step not counted), the other updates replay bit for bit.

bf16 at ZeRO 0 is refused by name on every rank (DeepSpeed's BF16_Optimizer would flatten the
matrices; with MoE in one stage DeepSpeed's own AdamW deadlocks there: probe_moe_pipeline.py).

One distributed run per scenario (ZeRO stage x optimizer x mode), one test each.  The refusal of
the layout DeepSpeed deadlocks on at ZeRO 1 is tested in tests/test_moe.py.

Cost: 14 rank runs; 18 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import functools

import pytest

from canzona_testkit.dist import run_distributed
from canzona_testkit.kernels import assert_bits

EP, CLIP, STEPS = 2, 0.05, 3
OPTIMIZERS = ("CanzonaMuon", "CanzonaShampoo")
LAYOUTS = {0: 1, 1: 2}  # ZeRO stage -> MoE layers (1: stage 0 only; 2: one per stage)
#: mode -> what it adds to the ds_config (""; the plain fp32 run of the owned layout)
MODES = {"": {},
         "bf16": {"config": {"bf16": {"enabled": True}}},
         "bf16_fp32acc": {"config": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}},
         "offload": {"zero": {"offload_optimizer": {"device": "cpu"}}},
         "mixed": {"params": {"layout": "mixed"}}}


def _run(rank, stage, opt_type, mode=""):
    import deepspeed
    import torch.distributed as tdist

    import canzona_ds  # noqa: F401
    from canzona_ds.integration.clip import TorchClip
    from canzona_testkit.models import HP, MatrixStepRecorder, batches
    from canzona_testkit.moe import build_moe_pipe

    module = build_moe_pipe(LAYOUTS[stage], ep_size=EP)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "gradient_clipping": CLIP, "zero_optimization": dict(stage=stage, **MODES[mode].get("zero", {})),
           "optimizer": {"type": opt_type, "params": dict(HP[opt_type], **MODES[mode].get("params", {}))},
           **MODES[mode].get("config", {})}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    opt = engine.basic_optimizer
    grid = module.mpu()
    pp_rank, dp_rank = grid.get_stage_id(), grid.get_data_parallel_rank()
    moe = opt.moe
    rename = moe.global_names if moe is not None and moe.active else {}
    whole = lambda n: rename.get(n, n)  # noqa: E731
    order = list(moe.global_order) if rename else [n for n, p in module.named_parameters() if p.requires_grad]
    shapes = {whole(n): tuple(p.shape) for n, p in module.named_parameters()}
    recorder = MatrixStepRecorder(opt)
    seen, norms = [], []  # per step: this rank's gradients before the clip; the norm it clipped with
    grad_dtypes = set()  # ZeRO 1: the dtype of the partitions' gradients (bf16, or fp32 with fp32 accumulation)

    if stage == 0:
        stock = engine.clip_fp32_gradients

        def clip():
            seen.append({whole(n): [(0, p.grad.detach().reshape(-1).clone())]
                         for n, p in module.named_parameters() if p.grad is not None})
            stock()
            norms.append(engine._canzona_clip_norm.detach().clone())
        engine.clip_fp32_gradients = clip
    else:
        zero = engine.optimizer
        stock = zero.scaled_global_norm

        def scaled_global_norm(norm_type=2):
            pieces = {}
            for i in range(len(zero.bit16_groups)):
                r = tdist.get_rank(group=zero.real_dp_process_group[i])
                for pid, g in TorchClip.partition_pieces(zero, i).items():
                    p = next(q for grp in zero.bit16_groups for q in grp if zero.get_param_id(q) == pid)
                    start = int(zero.grad_start_offset[i][r][pid])
                    pieces.setdefault(whole(zero.param_names[p]), []).append((start, g.detach().clone()))
                    grad_dtypes.add(str(g.dtype))
            seen.append(pieces)
            norm = stock(norm_type)
            norms.append(norm.detach().clone())
            return norm
        zero.scaled_global_norm = scaled_global_norm

    micro, dp = 2, 2
    xs = [(x[dp_rank * micro:(dp_rank + 1) * micro], y[dp_rank * micro:(dp_rank + 1) * micro])
          for _ in range(STEPS) for x, y in batches(2, micro * dp)]  # the same batch each step: the loss falls
    data = iter(xs)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]

    # who updated which matrix, in its planning group (a dense matrix: the stage's DP group; an
    # expert: its expert-DP group, named by its members)
    has_matrices = any(g["canzona_role"] == "matrix" for g in opt.param_groups)  # stage 1 of z0: the head (AdamW)
    hosted = set()
    if stage:  # the mixed layout's hosted matrices: stepped in pieces over their group (compared with owned below)
        zero = engine.optimizer
        hosted = {opt.partition_matrices[zero._canzona_partition(i)][k]
                  for i, lay in zero.canzona_layouts.items() for k in lay.hosted_indices()}
        for record in recorder.steps:
            for n in hosted:
                record.pop(n, None)
    replay = recorder.summary() if has_matrices else {"steps": 0, "matrices": [], "replay_max_diff": 0.0}
    if rename:
        edp = {part: sorted(tdist.get_process_group_ranks(opt.groups.expert(part).edp_group))
               for part in set(moe.partitions.values())}
    else:
        edp = {}
    updated = {whole(n): (f"expert-DP {edp[moe.partitions[n]]}" if rename and n in moe.partitions
                          else f"stage {pp_rank} DP") for n in replay["matrices"]}
    seen = [{n: [(start, g.float().numpy()) for start, g in pieces] for n, pieces in step.items()} for step in seen]
    norms = [n.numpy() for n in norms]  # (host arrays: the result crosses a process queue)
    g = opt.groups  # the pipeline grid and the expert groups in one ParallelGroups
    ranks = tdist.get_process_group_ranks
    planned = dict(pp=(g.pp_size, g.pp_rank), dp=sorted(ranks(g.dp_group)),
                   experts={e.name: (sorted(ranks(e.ep_group)), sorted(ranks(e.edp_group))) for e in g.experts})
    mine = dict(pp=pp_rank, dp=dp_rank, rank=rank, order=order, shapes=shapes, seen=seen, norms=norms, planned=planned,
                matrices=sorted({whole(n) for n in opt.infos}), updated=updated)
    everyone: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, mine)
    facts = {}
    if stage:
        zero = engine.optimizer
        facts = dict(cpu_offload=bool(zero.cpu_offload), zero_class=type(zero).__name__,
                     dtypes=sorted({str(p.dtype) for p in module.parameters()}), grad_dtypes=sorted(grad_dtypes),
                     mixed=sorted(bool(lay.mixed) for lay in zero.canzona_layouts.values()),
                     hosted=sorted(whole(n) for n in hosted))
    params = {whole(n): p.detach().float().numpy().copy() for n, p in module.named_parameters()}
    return dict(rank=rank, losses=losses, replay=replay, everyone=everyone, params=params, facts=facts)


def _check(results, stage):
    import torch

    by_stage = {}
    for r in results[0]["everyone"]:
        by_stage.setdefault(r["pp"], []).append(r)
    for rank, res in enumerate(results):
        if res["replay"]["matrices"]:
            assert res["replay"]["steps"] == STEPS, (rank, res["replay"])
        assert_bits(res["replay"]["replay_max_diff"], 0.0, (rank, res["replay"]))
        assert res["losses"][-1] < res["losses"][0], (rank, res["losses"])
        assert_bits(res["losses"], results[0]["losses"], (rank, res["losses"]))
    # the groups planned over: the stage's DP group; the stage's expert-parallel group, expert-DP groups of one
    for r in results[0]["everyone"]:
        stage_ranks = sorted(q["rank"] for q in by_stage[r["pp"]])
        has_moe = stage == 1 or r["pp"] == 0
        want = {"ep_size_2": (stage_ranks, [r["rank"]])} if has_moe else {}
        assert r["planned"] == dict(pp=(2, r["pp"]), dp=stage_ranks, experts=want), (r["rank"], r["planned"])
    # every matrix of the whole model: updated by exactly one rank of its planning group
    counts: dict = {}
    for r in results[0]["everyone"]:
        for name, where in r["updated"].items():
            counts.setdefault((name, where), []).append(r["rank"])
    every = {n for r in results[0]["everyone"] for n in r["matrices"]}
    matrices = every - {n for r in results for n in r["facts"].get("hosted", [])}  # hosted: in pieces (mixed)
    assert {n for n, _ in counts} == matrices, sorted(matrices - {n for n, _ in counts})
    # ZeRO 0 steps every matrix on every rank that holds it (placement "local"): a dense matrix on
    # both DP ranks of its stage; ZeRO 1 on its one owner.  An expert: one rank of its expert-DP group
    want = {n: (2 if stage == 0 and ".deepspeed_experts." not in n else 1) for n in matrices}
    assert all(len(v) == want[n] for (n, _), v in counts.items()), \
        {k: v for k, v in counts.items() if len(v) != want[k[0]]}
    assert any(".deepspeed_experts." not in n for n in every)
    experts = [n for n in every if ".deepspeed_experts." in n]
    assert len(experts) == (2 if stage == 1 else 1) * 4 * 2, sorted(experts)  # layers x experts x (2 weights)
    # the global norm: torch's over the whole model's gradients (stage order, every expert)
    order = [n for s in sorted(by_stage) for n in by_stage[s][0]["order"]]
    shapes = {n: s for r in results[0]["everyone"] for n, s in r["shapes"].items()}
    assert len(order) == len(set(order)) and set(order) == set(shapes), "whole-model order"
    for t in range(STEPS):
        grads = {}
        for r in results[0]["everyone"]:
            if stage == 0 and r["dp"] != 0 and not any(".deepspeed_experts." in n for n in r["seen"][t]):
                continue
            for name, pieces in r["seen"][t].items():
                grads.setdefault(name, {}).update({start: torch.from_numpy(g) for start, g in pieces})
        whole = []
        for name in order:
            pieces = grads[name]
            flat = torch.cat([pieces[s] for s in sorted(pieces)])
            whole.append(flat.reshape(shapes[name]))
        leaves = [torch.zeros_like(g, requires_grad=True) for g in whole]
        for leaf, g in zip(leaves, whole):
            leaf.grad = g.clone()
        ref = torch.nn.utils.clip_grad_norm_(leaves, CLIP)
        assert ref > CLIP, (t, float(ref))  # the clip clips
        for r in results[0]["everyone"]:
            got = torch.from_numpy(r["norms"][t]).reshape(()).float()
            assert torch.equal(got, ref), (t, r["rank"], float(got), float(ref))


def _worker(rank, world, stage, opt_type, mode=""):
    try:
        return "ok", _run(rank, stage, opt_type, mode)
    except Exception as e:  # noqa: BLE001
        import traceback

        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


@functools.lru_cache(maxsize=None)
def _runs(stage, opt_type, mode=""):
    # one run per scenario (a second PipelineEngine built in the same processes hung when tried)
    return run_distributed(_worker, 4, stage, opt_type, mode, timeout=240)


def _results(stage, opt_type, mode=""):
    results = []
    for rank, (status, res) in enumerate(_runs(stage, opt_type, mode)):
        assert status == "ok", (rank, res)
        results.append(res)
    return results


@pytest.mark.parametrize("stage", sorted(LAYOUTS))
@pytest.mark.parametrize("opt_type", OPTIMIZERS)
def test_moe_pipeline(stage, opt_type):
    _check(_results(stage, opt_type), stage)


# --------------------------------------------- ZeRO 1: bf16, ZeRO-Offload, the mixed layout
def _same_params(got: list, want: list, what: str) -> None:
    import numpy as np

    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g["params"]) == sorted(w["params"]), (what, rank)
        for n in w["params"]:
            np.testing.assert_array_equal(g["params"][n], w["params"][n], err_msg=f"{what} rank {rank}: {n}")


BF16 = {"bf16": "torch.bfloat16", "bf16_fp32acc": "torch.float32"}  # mode -> the gradients' dtype at ZeRO 1


@pytest.mark.parametrize("opt_type,mode", [("CanzonaMuon", "bf16"), ("CanzonaShampoo", "bf16"),
                                           ("CanzonaMuon", "bf16_fp32acc")])
def test_moe_pipeline_bf16(opt_type, mode):
    """bf16 at ZeRO 1 (bf16 gradients; and with ``data_types.grad_accum_dtype: fp32``, which
    DeepSpeed sends to its BF16_Optimizer and canzona-ds to its ZeRO-1 path with fp32 gradients):
    the checks of the fp32 run (every owner's updates replayed bit for bit from its fp32 master
    weights and gradients, one updater per matrix, the clip norm equal to torch's over the
    whole model's gradients, upcast to fp32, bit for bit; the loss falls), and the losses near
    the fp32 run's."""
    res = _results(1, opt_type, mode)
    for r in res:  # bf16 is active: bf16 weights in the module, the ZeRO-1 Canzona optimizer
        assert r["facts"]["dtypes"] == ["torch.bfloat16"] and r["facts"]["zero_class"] == "CanzonaZeroOptimizer"
        assert r["facts"]["grad_dtypes"] == [BF16[mode]], r["facts"]
    _check(res, 1)
    fp32 = _results(1, opt_type)
    dev = max(abs(a - b) for r, f in zip(res, fp32) for a, b in zip(r["losses"], f["losses"]))
    print(f"MoE x PP {mode} {opt_type}: max |loss - fp32 loss| = {dev:.3g}")
    assert 0 < dev < 0.02, dev  # bf16 rounding shows, and stays small


def test_moe_pipeline_offload_equals_plain():
    """ZeRO-Offload (offload_optimizer cpu, ZeRO 1): bit for bit the run without offload, every
    parameter of every rank; the fp32 run's checks hold."""
    res = _results(1, "CanzonaMuon", "offload")
    assert all(r["facts"]["cpu_offload"] for r in res) and not any(r["facts"]["cpu_offload"]
                                                                    for r in _results(1, "CanzonaMuon"))
    _check(res, 1)
    _same_params(res, _results(1, "CanzonaMuon"), "offload vs plain")


@pytest.mark.parametrize("opt_type", OPTIMIZERS)
def test_moe_pipeline_mixed_equals_owned(opt_type):
    """The mixed layout (ZeRO 1): each stage's dense matrix group hosts a matrix over its DP pair
    (stage 0 ``proj.weight``: larger than half the group; stage 1 the gate, its group's only
    matrix), the expert groups (expert-DP groups of one rank) host nothing; every parameter of
    every rank equals the owned layout's run bit for bit."""
    res = _results(1, opt_type, "mixed")
    for r in res:
        assert r["facts"]["mixed"] == [True, True], r["facts"]  # the dense and the expert group
    assert [r["facts"]["hosted"] for r in res] == [["0.proj.weight"]] * 2 + [["2.moe.deepspeed_moe.gate.wg.weight"]] * 2
    _check(res, 1)
    _same_params(res, _results(1, opt_type), "mixed vs owned")


# ---------------------------------------------------------------------------- fp16
POISON = 3  # the rank whose gradient overflows (stage 1, DP rank 1), in train_batch 1 of 4 only


def _fp16_worker(rank, world):
    """fp16 with dynamic loss scaling, ZeRO 1, CanzonaMuon with clipping, 4 ``train_batch`` calls on
    the same batch; in the second one an expert weight's gradient on rank POISON alone is made inf
    (a tensor hook), so one stage's one rank overflows.  Every rank must skip that step (weights
    and rule state unchanged, the loss scale halved, the step not counted)."""
    import deepspeed
    import torch

    import canzona_ds  # noqa: F401
    from canzona_ds.integration.accelerator import allow_fp16
    from canzona_testkit.models import HP, MatrixStepRecorder, batches
    from canzona_testkit.moe import build_moe_pipe

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "gradient_clipping": CLIP, "zero_optimization": {"stage": 1},
           "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1},
           "optimizer": {"type": "CanzonaMuon", "params": HP["CanzonaMuon"]}}
    with allow_fp16():
        module = build_moe_pipe(LAYOUTS[1], ep_size=EP)
        engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        inner = engine.optimizer.optimizer
        recorder = MatrixStepRecorder(inner)
        grid = module.mpu()
        poison = [False]
        target = next(p for n, p in module.named_parameters() if ".deepspeed_experts." in n)
        if rank == POISON:
            target.register_hook(lambda g: g * float("inf") if poison[0] else g)

        def snapshot():
            return ({n: p.detach().float().clone() for n, p in module.named_parameters()},
                    {n: {k: v.clone() for k, v in st.items()} for n, st in inner.matrix_state.items()},
                    float(engine.optimizer.loss_scale), int(engine.skipped_steps))

        dp = grid.get_data_parallel_rank()
        xs = [(x[dp * 2:dp * 2 + 2], y[dp * 2:dp * 2 + 2]) for _ in range(4) for x, y in batches(2, 4)]
        data = iter(xs)
        snaps, losses = [snapshot()], []
        for t in range(4):
            poison[0] = t == 1
            losses.append(float(engine.train_batch(data)))
            snaps.append(snapshot())

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    return dict(rank=rank, stage=grid.get_stage_id(), losses=losses, scales=[s[2] for s in snaps],
                skipped=[s[3] for s in snaps], dtype=str(target.dtype),
                params_same=[same(a[0], b[0]) for a, b in zip(snaps, snaps[1:])],
                state_same=[a[1].keys() == b[1].keys() and all(same(a[1][n], b[1][n]) for n in a[1])
                            for a, b in zip(snaps, snaps[1:])],
                steps=[g["step"] for g in inner.param_groups if g["canzona_role"] == "matrix"],
                replay=recorder.summary())


@functools.lru_cache(maxsize=None)
def _fp16_runs():
    return run_distributed(_fp16_worker, 4, timeout=240)


def test_moe_pipeline_fp16_overflow_on_one_rank_skipped_everywhere():
    res = _fp16_runs()
    fp32 = _results(1, "CanzonaMuon")
    for r in res:
        assert r["dtype"] == "torch.float16", r["dtype"]
        # step 2 skipped on every rank (the overflow was on rank POISON's stage only): weights and
        # rule state unchanged, the scale halved, the skip counted; the other steps train
        assert r["params_same"] == [False, True, False, False], (r["rank"], r["params_same"])
        assert r["state_same"][1], r["rank"]
        assert r["skipped"] == [0, 0, 1, 1, 1], (r["rank"], r["skipped"])
        assert r["scales"][2] == r["scales"][1] / 2 and r["scales"][3] == r["scales"][2], (r["rank"], r["scales"])
        assert r["steps"] == [3, 3], r  # dense and expert matrix groups: 4 calls, one skipped
        assert_bits(r["replay"]["replay_max_diff"], 0.0, (r["rank"], r["replay"]))
        assert r["replay"]["steps"] == 3, (r["rank"], r["replay"])
        assert_bits(r["losses"], res[0]["losses"])
        assert_bits(r["losses"][2], r["losses"][1])  # same batch, skipped step
        # before the skipped step both runs saw the same updates (fp32's: 3 calls on the same batch)
        assert max(abs(a - b) for a, b in zip(r["losses"][:2], fp32[0]["losses"][:2])) < 0.01, r["losses"]
        assert r["losses"][3] < r["losses"][0], r["losses"]
    assert sorted(r["stage"] for r in res) == [0, 0, 1, 1] and res[POISON]["stage"] == 1


def _stage0_bf16_worker(rank, world):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit.models import HP
    from canzona_testkit.moe import build_moe_pipe

    module = build_moe_pipe(LAYOUTS[0], ep_size=EP)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
           "optimizer": {"type": "CanzonaMuon", "params": HP["CanzonaMuon"]}}
    try:
        deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_moe_pipeline_bf16_at_stage0_refused_on_every_rank():
    """bf16 at ZeRO 0 (DeepSpeed's BF16_Optimizer would flatten the matrices; with MoE in one stage
    of two DeepSpeed's own AdamW deadlocks there, benchmarks/results/moe_pipeline_probe.json):
    refused by name on every rank, before any collective."""
    for rank, msg in enumerate(run_distributed(_stage0_bf16_worker, 4, timeout=120)):
        assert msg is not None and msg.startswith(
            "ValueError: CanzonaMuon with bf16.enabled=true needs zero_optimization.stage 1, 2 or 3"), (rank, msg)


# ----------------------------------------------------------- same-size checkpoint round trip
def _checkpoint_worker(rank, world, stage, folder):
    """2 steps, save, 2 more steps; load the checkpoint into the same engine and run the same 2
    steps again: losses and every parameter bit for bit (Shampoo: its factors and
    preconditioners, refreshed at step 4, come back from the checkpoint)."""
    import deepspeed
    import torch

    import canzona_ds  # noqa: F401
    from canzona_testkit.models import HP, batches
    from canzona_testkit.moe import build_moe_pipe

    module = build_moe_pipe(LAYOUTS[stage], ep_size=EP)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "CanzonaShampoo", "params": HP["CanzonaShampoo"]}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    dp = module.mpu().get_data_parallel_rank()
    xs = [(x[dp * 2:dp * 2 + 2], y[dp * 2:dp * 2 + 2]) for x, y in batches(8, 4)]
    data = iter(xs)
    for _ in range(2):
        engine.train_batch(data)
    engine.save_checkpoint(folder, tag="t")
    after = [float(engine.train_batch(data)) for _ in range(2)]
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    engine.load_checkpoint(folder, tag="t")
    data = iter(xs[4:])
    again = [float(engine.train_batch(data)) for _ in range(2)]
    differ = [n for n, p in module.named_parameters() if not torch.equal(params[n], p.detach())]
    return dict(after=after, again=again, differ=differ)


@pytest.mark.parametrize("stage", sorted(LAYOUTS))
def test_moe_pipeline_checkpoint_round_trip(stage, tmp_path):
    for rank, r in enumerate(run_distributed(_checkpoint_worker, 4, stage, str(tmp_path), timeout=240)):
        assert r["after"] == r["again"] and not r["differ"], (rank, r)


def test_moe_with_pipeline_and_tensor_parallelism_is_refused_by_name():
    from types import SimpleNamespace

    from canzona_ds.integration.moe import check_moe
    from canzona_ds.parallel import ParallelGroups

    groups = ParallelGroups(dp_size=2, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1, source="mpu")
    settings = SimpleNamespace(optimizer_type="CanzonaMuon", zero_stage=1)
    with pytest.raises(ValueError, match=r"pipeline AND tensor parallelism \(pp_size=2, tp_size=2\)"):
        check_moe(settings, groups, {})

"""Families ``moepipe`` (DeepSpeed MoE x pipeline parallelism: ``testkit.moe.build_moe_pipe``'s
2-stage PipelineModule, one MoE layer of 4 experts in each stage) and ``moepipe-s0`` (one MoE
layer, in stage 0 only: stage 1 holds the head, AdamW, no matrix): ``pp2``, ZeRO 0/1, ``dp``,
``ep``; gradient clipping that clips (``CLIP``).

Each stage's ranks read their own stage's files: DeepSpeed numbers every file of a stage by its
model-parallel rank, which on a pipeline grid is the stage (``zero_pp_rank_{dp}_mp_rank_{stage}``,
``expp_rank_{k}_mp_rank_{stage}``, ``layer_{i}_expert_{e}_mp_rank_{stage}``, the layer index
counted within the stage); each stage's chunks in the checkpoint index name its experts by
whole-model name.

Continuation: the saving run's own continuation in memory (``save`` trains ``AFTER`` more steps
on the same global batches after saving, records what it did next to the tag: an independent
reference, no checkpoint read) -- each step's global batch is two 4-row batches, 2 rows per
micro-batch (DP 2: 2 micro-batches per rank; DP 1: all 4, in the same order).  The resumed run:

* every matrix update replays bit for bit from its gradients and the loaded state
  (``MatrixStepRecorder``, the reference of tests/test_moe_pipeline.py);
* the first step's gradients within ``GRAD_TOL`` of the saving run's (the same sums in another
  order: micro-batch accumulation vs the DP all-reduce, experts' tokens by all-to-all vs the
  expert-DP all-reduce); Muon: every matrix after the first step within one step's bf16
  Newton-Schulz flip bound (``muon_reordered_sum_tolerance(1)``: reordered sums, not the same
  operations);
* every parameter after ``AFTER`` steps within ``TOL`` (and below a tenth of how far the steps
  moved them).
"""
from __future__ import annotations

import os

import numpy as np

from ..models import muon_reordered_sum_tolerance
from . import AFTER, BEFORE, CLIP, MICRO, Layout, assert_same_state, assert_steps, index_route_only
from canzona_testkit.kernels import assert_bits

#: the largest |gradient - the saving run's| in the first continued step (gradients ~3e-3;
#: measured 2.3e-10: the same sums in another order)
GRAD_TOL = 1e-9
#: the largest |param - the saving run's continuation| after AFTER steps, by type.  Muon: measured
#: 1.2e-4 when written, on one expert matrix whose rank-deficient gradient's rounding Newton-Schulz
#: amplifies (the rule applied to either run's gradients from the saved state reproduces it; the
#: steps move parameters ~3e-2); measured now 3e-8 (on AdamW parameters, every matrix bit for
#: bit), but which bits flip depends on the CPU's kernels; Shampoo (no refresh in these 2 steps):
#: measured 6e-8 (steps ~6e-2)
TOL = {"CanzonaMuon": 5e-4, "CanzonaShampoo": 1e-6}


def _layers(model: str) -> int:
    return 1 if model == "moepipe-s0" else 2


def _steps(start: int, count: int, dp: int, dp_rank: int) -> list:
    """Micro-batches of steps [start, start + count) for DP rank ``dp_rank`` of ``dp`` (see above)."""
    from canzona_testkit.models import batches

    data = batches(2 * (BEFORE + AFTER), 4, seed=3)
    out = []
    for s in range(start, start + count):
        for x, y in data[2 * s:2 * s + 2]:
            for d in range(dp_rank, 2, dp) if dp == 2 else range(2):
                out.append((x[d * MICRO:(d + 1) * MICRO], y[d * MICRO:(d + 1) * MICRO]))
    return out


def _engine(model: str, lay: Layout, opt_type: str):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit.models import HP
    from canzona_testkit.moe import build_moe_pipe

    if lay.pp != 2 or lay.dp not in (1, 2) or lay.tp != 1:
        raise ValueError(f"{model}: layout {lay} -- expected pp2, dp1 or dp2, tp1")
    module = build_moe_pipe(_layers(model), ep_size=lay.ep)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 4 // lay.dp,
           "steps_per_print": 10 ** 6, "gradient_clipping": CLIP, "zero_optimization": {"stage": lay.stage},
           "optimizer": {"type": opt_type, "params": HP[opt_type]}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    grid = module.mpu()
    return engine, module, grid.get_data_parallel_rank(), grid.get_stage_id()


def _glob(opt) -> dict:
    """Local -> whole-model parameter names (a stage without MoE layers: its own)."""
    return opt.moe.global_names if opt.moe is not None and opt.moe.active else {}


def _np(t):
    return np.array(t.detach().float().numpy(), copy=True)


def _params(module, opt) -> dict:
    glob = _glob(opt)
    return {glob.get(n, n): _np(p) for n, p in module.named_parameters()}


def _grads(recorder, opt) -> list:
    """Per continued step: the gradient each matrix's owner stepped with and the matrix after the
    step, by whole-model name."""
    glob = _glob(opt)
    return [{glob.get(n, n): (_np(g), _np(w)) for n, (g, _, w) in step.items()} for step in recorder.steps]


def continuation_file(ckpt: str, rank: int) -> str:
    return os.path.join(ckpt, "continuation", f"rank{rank}.pt")


def save(rank, world, model, lay, opt_type, ckpt):
    """Train BEFORE steps, save; record what this rank held (its stage's module weights, by
    whole-model name, and its matrices' rule state), then the saving run's own AFTER-step
    continuation, into ``continuation_file``."""
    import torch

    from canzona_testkit.models import MatrixStepRecorder

    engine, module, dp_rank, stage = _engine(model, lay, opt_type)
    data = iter(_steps(0, BEFORE, lay.dp, dp_rank))
    for _ in range(BEFORE):
        engine.train_batch(data)
    engine.save_checkpoint(ckpt, tag="saved")
    opt = engine.basic_optimizer
    glob = _glob(opt)
    held = dict(module=_params(module, opt),
                rule_state={glob.get(n, n): {k: _np(v) for k, v in st.items() if hasattr(v, "numpy")}
                            for n, st in opt.matrix_state.items()})
    recorder = MatrixStepRecorder(opt)
    data = iter(_steps(BEFORE, AFTER, lay.dp, dp_rank))
    for _ in range(AFTER):
        engine.train_batch(data)
    os.makedirs(os.path.dirname(continuation_file(ckpt, rank)), exist_ok=True)
    torch.save(dict(stage=stage, held=held, after=_params(module, opt), grads=_grads(recorder, opt)),
               continuation_file(ckpt, rank))
    return True


def saving_run(ckpt: str, world: int) -> list:
    """Every saving rank's record (``save``)."""
    import torch

    return [torch.load(continuation_file(ckpt, r), weights_only=False) for r in range(world)]


def resume(rank, world, model, lay, opt_type, ckpt, out):
    import torch.distributed as tdist

    from canzona_testkit.models import MatrixStepRecorder

    index_route_only()
    engine, module, dp_rank, stage = _engine(model, lay, opt_type)
    engine.load_checkpoint(ckpt, tag="saved")
    engine.save_checkpoint(out, tag="reloaded")  # what this rank holds right after the load
    steps_at_load = engine.global_steps
    opt = engine.basic_optimizer
    recorder = MatrixStepRecorder(opt)
    data = iter(_steps(BEFORE, AFTER, lay.dp, dp_rank))
    for _ in range(AFTER):
        engine.train_batch(data)
    edp = {str(e.name): sorted(tdist.get_process_group_ranks(e.edp_group)) for e in opt.groups.experts}
    has_matrices = any(g["canzona_role"] == "matrix" for g in opt.param_groups)
    summary = recorder.summary() if has_matrices else {"steps": 0, "matrices": [], "replay_max_diff": 0.0}
    return dict(stage=stage, params=_params(module, opt), steps=engine.global_steps, steps_at_load=steps_at_load,
                edp=edp, ep=opt.groups.ep_size, replay={k: summary[k] for k in ("steps", "matrices", "replay_max_diff")},
                grads=_grads(recorder, opt))


def check(model, opt_type, saved, running, ckpt, out, results):
    from canzona_ds.ckpt import Index

    folder = os.path.join(ckpt, "saved")
    layers = _layers(model)
    # DeepSpeed numbers every file by the stage's model-parallel rank (experts: layer_<i>_expert_<e>_mp_rank_<stage>)
    files = set(os.listdir(folder))
    optim = "zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt" if saved.stage else "expp_rank_{}_mp_rank_{:02d}_optim_states.pt"
    ranks = range(saved.dp if saved.stage else saved.ep)  # by DP / expert-parallel rank
    assert {optim.format(r, s) for r in ranks for s in range(layers)} <= files, sorted(files)
    assert {f"layer_0_expert_{e}_mp_rank_{s:02d}_model_states.pt" for e in range(4) for s in range(layers)} <= files
    roles = Index.read(folder).meta["roles"]
    matrices = sorted(n for n, role in roles.items() if role == "matrix")
    assert len([n for n in matrices if ".deepspeed_experts." in n]) == layers * 4 * 2, matrices  # x 4 experts x 2
    # lossless: every (whole-model name, state) of both stages as saved, bit for bit
    assert assert_same_state(folder, os.path.join(out, "reloaded")) >= len(matrices)
    assert_steps(results)
    assert all(r["steps_at_load"] == BEFORE for r in results)
    assert sorted(r["stage"] for r in results) == sorted([0, 1] * running.dp)
    for r in results:
        if r["stage"] < layers:  # a stage with a MoE layer: the running ep_size's expert-DP groups
            assert list(r["edp"]) == [f"ep_size_{running.ep}"] and len(r["edp"][f"ep_size_{running.ep}"]) \
                == running.dp // running.ep, r["edp"]
        else:
            assert r["edp"] == {}, r["edp"]
    # every update replays bit for bit from the loaded state and the run's gradients
    for rank, r in enumerate(results):
        if not r["grads"]:  # (moepipe-s0: stage 1 holds the head only, AdamW)
            assert layers == 1 and r["stage"] == 1 and r["replay"]["steps"] == 0, (rank, r["replay"])
            continue
        assert_bits(r["replay"]["replay_max_diff"], 0.0, (rank, r["replay"]))
        assert r["replay"]["steps"] == AFTER, (rank, r["replay"])
    # against the saving run's own continuation
    saving = saving_run(ckpt, saved.world)
    held = {n: w for s in saving for n, w in s["held"]["module"].items()}
    want = {n: v for s in saving if s["grads"] for n, v in s["grads"][0].items()}
    have = {n: v for r in results if r["grads"] for n, v in r["grads"][0].items()}
    assert sorted(have) == sorted(want) == matrices, sorted(set(have) ^ set(want))
    grad_dev = max(float(np.abs(have[n][0] - want[n][0]).max()) for n in want)
    first_dev = max(float(np.abs(have[n][1] - want[n][1]).max()) for n in want)
    if opt_type == "CanzonaMuon":
        # the first step's gradients are the saving run's sums in another order (GRAD_TOL above), so
        # Muon's bf16 Newton-Schulz may round them to other bf16 values: within one step's flip
        # bound (muon_reordered_sum_tolerance's derivation), bit for bit only by luck (it was on
        # AVX-512 Xeons, 3.3e-4 off under the AVX2 kernels); the replays above are the exact part
        assert first_dev <= muon_reordered_sum_tolerance(1), (first_dev, muon_reordered_sum_tolerance(1))
    ref = {n: w for s in saving for n, w in s["after"].items()}
    got = {n: w for r in results for n, w in r["params"].items()}
    assert sorted(got) == sorted(ref)
    moved = max(float(np.abs(ref[n] - held[n]).max()) for n in ref)
    dev = max(float(np.abs(got[n] - ref[n]).max()) for n in ref)
    same = sum(not (got[n] != ref[n]).any() for n in matrices)  # (informational: the bound below is the check)
    print(f"{model} {saved} -> {running}: first-step gradients within {grad_dev:.3g} of the saving run's, matrices "
          f"after it within {first_dev:.3g}; after {AFTER} steps max |param - its continuation| = {dev:.3g} "
          f"({same} of {len(matrices)} matrices bit for bit; the steps moved parameters by up to {moved:.3g})")
    assert grad_dev <= GRAD_TOL and dev <= TOL[opt_type] < moved / 10, (grad_dev, dev, moved)

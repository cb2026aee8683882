"""DeepSpeed MoE x pipeline parallelism resumed at another size (the PipelineModule of
tests/test_moe_pipeline.py with one MoE layer in each of its 2 stages, CanzonaMuon with gradient
clipping that clips; and CanzonaShampoo): saved at PP 2 x DP 2 with ep_size 2 (world 4), resumed at

    z1_dp1_ep1   ZeRO 1, PP 2 x DP 1, ep_size 1 (world 2): another DP size and ep_size
    z1_dp2_ep1   ZeRO 1, PP 2 x DP 2, ep_size 1 (world 4): another ep_size at the same DP size
    z0_dp1_ep1   ZeRO 0, PP 2 x DP 1, ep_size 1 (world 2): DeepSpeed's expp_rank files, through
                 the checkpoint index
    z1_dp1_ep1_shampoo   the first with CanzonaShampoo (its whole rule state by key)
    z0_dp1_ep1_moe_in_stage0   the z0 one with MoE in stage 0 only (stage 1: the head, AdamW, no
                 matrix), through the checkpoint index

Each stage's ranks read their own stage's files: DeepSpeed numbers every file of a stage by its
model-parallel rank, which on a pipeline grid is the stage (``zero_pp_rank_{dp}_mp_rank_{stage}``,
``expp_rank_{k}_mp_rank_{stage}``, ``layer_{i}_expert_{e}_mp_rank_{stage}``, the layer index
counted within the stage); each stage's chunks in the checkpoint index name its experts by
whole-model name.  Per scenario:

  (a) right after ``engine.load_checkpoint``: every matrix's fp32 master and Muon state (dense
      and each expert, by whole-model name), every AdamW piece and every module weight equal
      what the saving ranks held in memory, bit for bit; each matrix on exactly one rank, the
      planned owner of its new (expert-)DP group (``layout.owners()``, ZeRO 1) in its own stage,
      an expert on the rank of its new expert-parallel rank; the steps as saved;
  (b) 2 more ``train_batch`` calls on the batches the saving run continued with (the same global
      batch: DP 1 takes 4 micro-batches of 2 where DP 2 took 2 per rank): every matrix update the
      owner made replays bit for bit from its gradients and the loaded state (MatrixStepRecorder,
      the reference of tests/test_moe_pipeline.py); against the saving run's own 2-step
      continuation in memory (an independent reference: no checkpoint read), the first step's
      gradients are within 1e-9 (measured 2.3e-10 on gradients ~3e-3: the same sums in another
      order, micro-batch accumulation vs the DP all-reduce, experts' tokens by all-to-all vs the
      expert-DP all-reduce); Muon: every matrix after the first step bit for bit, and every
      parameter after 2 steps within 5e-4 (measured 1.2e-4 on one expert matrix, the other 18 bit
      for bit; Newton-Schulz amplifies the rounding of that expert's rank-deficient gradient: Muon
      applied in one process to either run's gradients from the saved state gives the same
      1.2e-4); Shampoo: every parameter after 2 steps within 1e-6 (measured 6e-8).

Another PP size goes through the same index (tests/test_ckpt_resume.py's pipeline rows); the
offline form of a MoE x PP checkpoint reads every stage by whole-model name (tested here).
One ``run_distributed`` per run (a second PipelineEngine in the same processes hung when tried);
one test per scenario.
"""
from __future__ import annotations

import functools
import os
import traceback

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed, scratch_dir

SAVE_STEPS, MORE, CLIP, MICRO = 2, 2, 0.05, 2
#: scenario -> (new world, new ep_size, ZeRO stage, type[, MoE layers: 2, one per stage, default]) (saved
#: at that stage with that type and layers: world 4 = PP 2 x DP 2, ep_size 2)
SCENARIOS = {"z1_dp1_ep1": (2, 1, 1, "CanzonaMuon"), "z1_dp2_ep1": (4, 1, 1, "CanzonaMuon"),
             "z0_dp1_ep1": (2, 1, 0, "CanzonaMuon"), "z1_dp1_ep1_shampoo": (2, 1, 1, "CanzonaShampoo"),
             "z0_dp1_ep1_moe_in_stage0": (2, 1, 0, "CanzonaMuon", 1)}
#: the largest |gradient - the saving run's| in the first continued step (gradients ~3e-3;
#: measured 2.3e-10: the same sums in another order)
GRAD_TOL = 1e-9
#: the largest |param - the saving run's continuation| after MORE steps, by type.  Muon: measured
#: 1.2e-4, on one expert matrix whose rank-deficient gradient's rounding Newton-Schulz amplifies
#: (the rule applied to either run's gradients from the saved state reproduces it; the steps move
#: parameters ~3e-2); Shampoo (no refresh in these 2 steps): measured 6e-8 (steps ~6e-2)
TOL = {"CanzonaMuon": 5e-4, "CanzonaShampoo": 1e-6}


def _steps(start: int, count: int, dp: int, dp_rank: int) -> list:
    """Micro-batches of steps [start, start + count) for DP rank ``dp_rank`` of ``dp``: each step's
    global batch is two 4-row batches, 2 rows per micro-batch (DP 2: 2 micro-batches per rank;
    DP 1: all 4, in the same order)."""
    from canzona_testkit.models import batches

    data = batches(2 * (SAVE_STEPS + MORE), 4, seed=3)
    out = []
    for s in range(start, start + count):
        for x, y in data[2 * s:2 * s + 2]:
            for d in range(dp_rank, 2, dp) if dp == 2 else range(2):
                out.append((x[d * MICRO:(d + 1) * MICRO], y[d * MICRO:(d + 1) * MICRO]))
    return out


def _engine(world: int, ep: int, zero: int, opt: str, layers: int = 2):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit.models import HP
    from canzona_testkit.moe import build_moe_pipe

    module = build_moe_pipe(layers, ep_size=ep)
    dp = world // 2
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 4 // dp,
           "steps_per_print": 10 ** 6, "gradient_clipping": CLIP, "zero_optimization": {"stage": zero},
           "optimizer": {"type": opt, "params": HP[opt]}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    grid = module.mpu()
    return engine, module, dp, grid.get_data_parallel_rank(), grid.get_stage_id()


def _glob(opt) -> dict:
    """Local -> whole-model parameter names (a stage without MoE layers: its own)."""
    return opt.moe.global_names if opt.moe is not None and opt.moe.active else {}


def _snapshot(engine) -> dict:
    from types import SimpleNamespace

    from test_moe_elastic import _snapshot as snapshot

    opt = engine.basic_optimizer
    if opt.moe is not None:
        return snapshot(engine)
    opt.moe = SimpleNamespace(global_names={})  # (a stage without MoE layers: its names are whole-model names)
    try:
        return snapshot(engine)
    finally:
        opt.moe = None


def _params(module, opt) -> dict:
    glob = _glob(opt)
    return {glob.get(n, n): np.array(p.detach().float().numpy(), copy=True) for n, p in module.named_parameters()}


def _grads(recorder, opt) -> list:
    """Per continued step: the gradient each matrix's owner stepped with and the matrix after the
    step, by whole-model name."""
    glob = _glob(opt)
    return [{glob.get(n, n): (np.array(g.float().numpy(), copy=True), np.array(w.float().numpy(), copy=True))
             for n, (g, _, w) in step.items()} for step in recorder.steps]


def _save_worker(rank, world, root, zero, opt, layers=2):
    try:
        engine, module, dp, dp_rank, stage = _engine(world, 2, zero, opt, layers)
        data = iter(_steps(0, SAVE_STEPS, dp, dp_rank))
        for _ in range(SAVE_STEPS):
            engine.train_batch(data)
        engine.save_checkpoint(root, tag="saved")
        snap = _snapshot(engine)
        from canzona_testkit.models import MatrixStepRecorder

        recorder = MatrixStepRecorder(engine.basic_optimizer)
        data = iter(_steps(SAVE_STEPS, MORE, dp, dp_rank))
        for _ in range(MORE):
            engine.train_batch(data)
        files = sorted(os.listdir(os.path.join(root, "saved")))
        return dict(stage=stage, snap=snap, after=_params(module, engine.basic_optimizer), files=files,
                    grads=_grads(recorder, engine.basic_optimizer))
    except Exception:  # noqa: BLE001
        return traceback.format_exc()


def _load_worker(rank, world, root, ep, zero, opt, layers=2):
    try:
        import torch.distributed as tdist

        from canzona_testkit.models import MatrixStepRecorder

        engine, module, dp, dp_rank, stage = _engine(world, ep, zero, opt, layers)
        engine.load_checkpoint(root, tag="saved")
        opt = engine.basic_optimizer
        loaded = _snapshot(engine)
        recorder = MatrixStepRecorder(opt)
        data = iter(_steps(SAVE_STEPS, MORE, dp, dp_rank))
        for _ in range(MORE):
            engine.train_batch(data)
        edp = {str(e.name): sorted(tdist.get_process_group_ranks(e.edp_group)) for e in opt.groups.experts}
        has_matrices = any(g["canzona_role"] == "matrix" for g in opt.param_groups)
        replay = recorder.summary() if has_matrices else {"steps": 0, "matrices": [], "replay_max_diff": 0.0}
        return dict(stage=stage, loaded=loaded, after=_params(module, opt), replay=replay, edp=edp,
                    grads=_grads(recorder, opt))
    except Exception:  # noqa: BLE001
        return traceback.format_exc()


@functools.lru_cache(maxsize=None)
def _root(zero: int, opt: str, layers: int) -> str:
    return scratch_dir(f"canzona_moe_pp_elastic_z{zero}_{opt}_{layers}_")


@functools.lru_cache(maxsize=None)
def _saved(zero: int, opt: str, layers: int) -> list:
    return run_distributed(_save_worker, 4, _root(zero, opt, layers), zero, opt, layers, timeout=240)


@functools.lru_cache(maxsize=None)
def _loaded(name: str) -> list:
    world, ep, zero, opt, *layers = SCENARIOS[name]
    layers = layers[0] if layers else 2
    return run_distributed(_load_worker, world, _root(zero, opt, layers), ep, zero, opt, layers, timeout=240)


def _results(runs: list, what: str) -> list:
    for r in runs:
        if isinstance(r, str):
            pytest.fail(f"{what}:\n{r}")
    return runs


def _stage_of(name: str) -> int:
    return 0 if int(name.split(".")[0]) < 2 else 1  # layers 0 (dense), 1 (MoE) | 2 (MoE), 3 (head)


def _eq(got, want, what: str) -> None:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_moe_pipeline_resume_at_new_size(name):
    from test_moe_elastic import _merge

    world, ep, zero, opt, *layers = SCENARIOS[name]
    layers = layers[0] if layers else 2
    saved_runs = _results(_saved(zero, opt, layers), "saving")
    res = _results(_loaded(name), "loading")
    saved = _merge([r["snap"] for r in saved_runs])
    # DeepSpeed numbers every file by the stage's model-parallel rank (experts: layer_<i>_expert_<e>_mp_rank_<stage>)
    files = saved_runs[0]["files"]
    optim = "zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt" if zero else "expp_rank_{}_mp_rank_{:02d}_optim_states.pt"
    moe_stages = range(layers)  # (one MoE layer: in stage 0 only)
    assert {optim.format(r, s) for r in range(2) for s in moe_stages} <= set(files), files  # by DP / expert-parallel rank
    assert {f"layer_0_expert_{e}_mp_rank_{s:02d}_model_states.pt" for e in range(4) for s in moe_stages} <= set(files)
    experts = [n for n in saved.rule_state if ".deepspeed_experts." in n]
    assert len(experts) == layers * 4 * 2, sorted(saved.rule_state)  # MoE layers x 4 experts x 2 matrices
    assert sorted(r["stage"] for r in res) == sorted([0, 1] * (world // 2))
    # (a) the state as saved, on the planned owner of the new (expert-)DP group of its own stage
    holders: dict = {}
    for rank, r in enumerate(res):
        got = r["loaded"]
        assert got["ep"][0] == ep, got["ep"]
        assert got["adam_step"] == saved.adam_step and saved.matrix_step == SAVE_STEPS
        assert got["matrix_step"] == (SAVE_STEPS if got["master"] else None), got["matrix_step"]  # (a stage without matrices)
        if r["stage"] in moe_stages:
            assert list(r["edp"]) == [f"ep_size_{ep}"] and len(r["edp"][f"ep_size_{ep}"]) == world // 2 // ep, r["edp"]
        else:
            assert r["edp"] == {}, r["edp"]
        for n, w in got["master"].items():
            holders.setdefault(n, []).append(rank)
            assert _stage_of(n) == r["stage"], (n, rank, r["stage"])
            _eq(w, saved.params[n], f"{name}: fp32 master of {n} on rank {rank}")
            if zero:
                key = f"ep_size_{ep}" if ".deepspeed_experts." in n else "None"
                edp_rank, _ = got["groups"][key]
                assert got["owners"][n] == edp_rank, (n, rank, got["owners"][n], edp_rank)  # its planned owner
            if ".deepspeed_experts." in n:  # an expert of this rank's new expert-parallel rank
                e = int(n.split("deepspeed_experts.")[1].split(".")[0])
                assert e // (4 // ep) == got["ep"][1], (n, rank, got["ep"])
        assert set(got["rule_state"]) == set(got["master"]), (rank, sorted(got["rule_state"]))
        for n, st in got["rule_state"].items():
            assert set(st) == set(saved.rule_state[n]) and st, n
            for k, v in st.items():
                _eq(v, saved.rule_state[n][k], f"{name}: {opt} state {k} of {n} on rank {rank}")
        for n, a, b, m, ea, eas in got["adam"]:
            assert _stage_of(n) == r["stage"], (n, rank)
            for value, want in ((m, saved.params[n]), (ea, saved.adam[n]["exp_avg"]),
                                (eas, saved.adam[n]["exp_avg_sq"])):
                _eq(value, np.asarray(want).reshape(-1)[a:b], f"{name}: AdamW piece [{a}, {b}) of {n} on rank {rank}")
        for n, w in got["module"].items():
            _eq(w, saved.params[n], f"{name}: module weight {n} on rank {rank}")
    # every matrix of the whole model (both stages, every expert) owned by exactly one rank
    assert sorted(holders) == sorted(saved.rule_state), sorted(set(saved.rule_state) ^ set(holders))
    assert all(len(v) == 1 for v in holders.values()), holders
    # (b) 2 more steps: every update replays bit for bit from the loaded state; against the saving
    # run's own continuation: the first step's gradients within GRAD_TOL, every matrix after it
    # bit for bit, every parameter after MORE steps within TOL
    for rank, r in enumerate(res):
        if not r["loaded"]["master"]:  # (one MoE layer: stage 1 holds the head only, AdamW)
            assert layers == 1 and r["stage"] == 1 and not r["grads"], (rank, r["replay"])
            continue
        assert r["replay"]["steps"] == MORE and r["replay"]["replay_max_diff"] == 0.0, (rank, r["replay"])
        assert r["replay"]["matrices"], rank
    for step in range(MORE):
        want = {n: v for r in saved_runs if r["grads"] for n, v in r["grads"][step].items()}
        have = {n: v for r in res if r["grads"] for n, v in r["grads"][step].items()}
        assert sorted(have) == sorted(want) == sorted(saved.rule_state), step
        if step == 0:
            grad_dev = max(float(np.abs(have[n][0] - want[n][0]).max()) for n in want)
            first_dev = max(float(np.abs(have[n][1] - want[n][1]).max()) for n in want)
            if opt == "CanzonaMuon":
                for n in want:
                    _eq(have[n][1], want[n][1], f"{name}: {n} after the first step")
    ref = {n: w for r in saved_runs for n, w in r["after"].items()}
    got = {n: w for r in res for n, w in r["after"].items()}
    assert sorted(got) == sorted(ref)
    moved = max(float(np.abs(ref[n] - saved.params[n]).max()) for n in ref)
    dev = max(float(np.abs(got[n] - ref[n]).max()) for n in ref)
    same = sum(np.array_equal(got[n], ref[n]) for n in saved.rule_state)
    print(f"MoE x PP {name}: first-step gradients within {grad_dev:.3g} of the saving run's, matrices after it "
          f"within {first_dev:.3g}; after {MORE} steps "
          f"max |param - its continuation| = {dev:.3g} ({same} of {len(saved.rule_state)} matrices bit for bit; "
          f"the steps moved parameters by up to {moved:.3g})")
    assert grad_dev <= GRAD_TOL and dev <= TOL[opt] < moved / 10, (grad_dev, dev, moved)


def test_moe_pipeline_checkpoint_read_whole_by_name():
    """The offline form (``canzona_testkit.ckpt.read``, what ``canzona-ckpt convert`` writes): a
    MoE x PP checkpoint read through its index, every stage's parameters and every expert by
    whole-model name, equal to what the saving ranks held, bit for bit."""
    from test_moe_elastic import _merge

    from canzona_testkit.ckpt import read

    saved = _merge([r["snap"] for r in _results(_saved(1, "CanzonaMuon", 2), "saving")])
    got = read(_root(1, "CanzonaMuon", 2), "saved")
    assert set(saved.rule_state) <= set(got.rule_state), sorted(set(saved.rule_state) - set(got.rule_state))
    for n, st in saved.rule_state.items():
        _eq(got.params[n], saved.params[n], f"fp32 master of {n}")
        for k, v in st.items():
            _eq(got.rule_state[n][k], v, f"state {k} of {n}")
    for n, moments in saved.adam.items():
        for k, v in moments.items():
            _eq(got.adam[n][k], v, f"{k} of {n}")


def _pp_change_worker(rank, world, root):
    """The ZeRO-1 MoE x PP checkpoint into the tiny MoE model without pipeline parallelism (PP 1 x
    DP 2, ep_size 2): another model (its parameters are not the pipeline's ``<layer>.<name>``)."""
    from canzona_ds.ckpt import CheckpointIndexError as CheckpointIndexError
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    def load(engine):
        engine.load_checkpoint(root, tag="saved")

    try:
        run_moe_engine(rank, world, 2, moe_ds_config(world, optimizer="CanzonaMuon", stage=1), 1, after_init=load)
    except CheckpointIndexError as e:
        return str(e)
    except Exception:  # noqa: BLE001
        return "not an CheckpointIndexError:\n" + traceback.format_exc()
    return None


def test_moe_pipeline_checkpoint_into_another_model_is_refused():
    """The pipeline's checkpoint loaded by a model without pipeline parallelism (other parameter
    names) goes through the checkpoint index (MoE at ZeRO 1/2 describes its chunks), which refuses
    it by name on every rank, naming the parameters, before anything loads."""
    _results(_saved(1, "CanzonaMuon", 2), "saving")
    for rank, msg in enumerate(run_distributed(_pp_change_worker, 2, _root(1, "CanzonaMuon", 2), timeout=240)):
        assert msg is not None and "parameters differ from the model's" in msg and "1.moe." in msg, (rank, msg)

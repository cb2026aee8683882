"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``, 4 experts, ep_size=2) with expert parallelism
under ZeRO 0/1/2, every Canzona type, on real gloo processes, against the single-process
reference of ``canzona_testkit.moe`` (the whole model, every expert, the rule applied to
each expert matrix; the ranks' forward and backward reproduced exactly, then ZeRO's averages:
dense over DP, experts over their expert-DP group, both divided by the DP size).

Tolerances (fp32):
  * world 2, ep_size 2 (expert-DP groups of one rank, dense sums of two terms): bit-exact
    (rtol=atol=0) for every type at ZeRO 1 and 2, through DeepSpeed's own MoE grouping and the
    model.parameters() path, with a Megatron-style mpu (TP=1), and with gradient clipping
    active (torch's clip_grad_norm_ over the whole model); ZeRO 0 likewise, also with
    Megatron-DeepSpeed's stage-0 client optimizer (build_tp_optimizer before deepspeed.initialize:
    it creates DeepSpeed's expert groups, which the engine must reuse, same objects and ranks).  bf16: each
    owner's updates replayed bit for bit, losses within 0.02 of the fp32 run's.
    fp16 (ZeRO 1 and 2): an overflow on one rank is skipped on every rank, the other updates
    replayed bit for bit.
  * world 4, ep_size 2: the expert-DP sums have two terms, the dense sums four (gloo's order,
    ~1 ulp): after the first step every expert matrix is bit-exact; over 3 steps each owner's
    updates replay bit for bit in one process (MatrixStepRecorder), Muon stays within the reordered-sum bound of
    the reference end to end (Shampoo's and SOAP's preconditioners amplify the ulps: printed).
  * the inner optimizer's step makes no collective call (CommCounter); every matrix is owned
    by exactly one rank of its group (dense: the DP group; experts: their expert-DP group).

One ``run_distributed`` per world size; each scenario runs in its own ``try``, so one failing
scenario fails one test.

Cost: 9 rank runs; 12 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from functools import lru_cache

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import TYPES, muon_reordered_sum_tolerance
from canzona_testkit.kernels import assert_bits

STEPS = 3  # Shampoo/SOAP in HP refresh every 2 steps
CLIP = 0.05  # well below the gradient norm (~1): every step clips
EP = 2

# world 2: (stage, type, options)
SCENARIOS_2 = {f"z{stage}_{t}": (stage, t, {}) for stage in (1, 2) for t in TYPES}
SCENARIOS_2.update({
    "z1_muon_ds_groups": (1, "CanzonaMuon", {"groups": True}),   # the user's own MoE param groups
    "z2_shampoo_mpu": (2, "CanzonaShampoo", {"mpu": True}),       # Megatron-DeepSpeed: an mpu at TP=1
    "z1_muon_bf16": (1, "CanzonaMuon", {"bf16": True}),           # replayed bit for bit, losses near fp32's
    "z2_soap_clip": (2, "CanzonaSOAP", {"clip": CLIP}),
    "z1_muon_clip": (1, "CanzonaMuon", {"clip": CLIP}),
    "z0_muon_clip": (0, "CanzonaMuon", {"clip": CLIP}),
    "z0_shampoo": (0, "CanzonaShampoo", {}),
    # Megatron-DeepSpeed's stage-0 client optimizer (build_tp_optimizer before deepspeed.initialize):
    # with its mpu and clipping, and without an mpu (DeepSpeed's own groups)
    "z0_muon_client_mpu_clip": (0, "CanzonaMuon", {"client": True, "mpu": True, "clip": CLIP}),
    "z0_soap_client": (0, "CanzonaSOAP", {"client": True}),
})
SCENARIOS_4 = {f"z{stage}_{t}": (stage, t, {}) for stage in (1, 2) for t in TYPES}
SCENARIOS_4["z1_muon_clip"] = (1, "CanzonaMuon", {"clip": CLIP})
SCENARIOS_4["z0_muon_client_mpu"] = (0, "CanzonaMuon", {"client": True, "mpu": True})


def _train(rank, world, stage, opt_type, options):
    from canzona_testkit.comm import CommCounter
    from canzona_testkit.models import MatrixStepRecorder
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    inner_calls, recorder, first = [], [], {}

    def attach(engine):
        inner = engine.optimizer.optimizer if stage else engine.optimizer
        stock = inner.step

        def counted(*a, **k):
            with CommCounter() as c:
                out = stock(*a, **k)
            inner_calls.append(c.count("torch") + c.count("deepspeed"))
            return out

        inner.step = counted
        if stage:
            recorder.append(MatrixStepRecorder(inner))

    def after_step(step, params):
        if step == 1:
            first.update(params)

    built = {}
    if options.get("client"):
        # the expert groups must not exist yet (an earlier scenario of this process made them):
        # build_tp_optimizer creates them, deepspeed.initialize must reuse the same objects
        from deepspeed.utils import groups as ds_groups

        for d in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS,
                  ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
            d.clear()
        if not options.get("mpu"):  # nor an mpu an earlier scenario handed DeepSpeed (a fresh process has none)
            ds_groups.mpu = None

    def after_build(model, optimizer):
        from deepspeed.utils import groups as ds_groups

        built.update(ep=dict(ds_groups._EXPERT_PARALLEL_GROUP), edp=dict(ds_groups._EXPERT_DATA_PARALLEL_GROUP),
                     ranks=[list(ds_groups._get_expert_parallel_group_ranks("ep_size_2")),
                            list(ds_groups._get_expert_data_parallel_group_ranks("ep_size_2"))],
                     planned=(optimizer.groups.expert("ep_size_2").ep_group,
                              optimizer.groups.expert("ep_size_2").edp_group))

    mpu = None
    if options.get("mpu"):
        from canzona_testkit import megatron_standin

        megatron_standin.initialize_model_parallel(1)
        mpu = megatron_standin.mpu
    extra = {"bf16": {"enabled": True}} if options.get("bf16") else {}
    cfg = moe_ds_config(world, optimizer=opt_type, stage=stage, gradient_clipping=options.get("clip", 0.0), **extra)
    params, losses, engine = run_moe_engine(rank, world, EP, cfg, STEPS, groups=options.get("groups", False),
                                            after_init=attach, after_step=after_step, mpu=mpu,
                                            client=options.get("client", False), after_build=after_build)
    inner = engine.optimizer.optimizer if stage else engine.optimizer
    same_groups = None
    if options.get("client"):  # the engine found and reused the groups build_tp_optimizer created
        ep, edp = built["ep"]["ep_size_2"], built["edp"]["ep_size_2"]
        same_groups = dict(ranks=built["ranks"], names=sorted(built["ep"]),
                           same=[engine.expert_parallel_group["ep_size_2"] is ep,
                                 engine.expert_data_parallel_group["ep_size_2"] is edp,
                                 engine.module.moe.deepspeed_moe.ep_group is ep,
                                 built["planned"][0] is ep, built["planned"][1] is edp,
                                 inner is engine.basic_optimizer])
    source = inner.groups.source
    parts = {name: [g.get("canzona_role"), g.get("moe", False)] for name, g in
             zip(["g%d" % i for i in range(len(inner.param_groups))], inner.param_groups)}
    return dict(params=params, first=first, losses=losses, inner_calls=inner_calls, groups=parts,
                owned=sorted(inner.handled_names()) if stage else [],
                replay=recorder[0].summary() if recorder else None,
                plans={str(k): v.world_size for k, v in inner.plans.items()},
                zero_class=type(engine.optimizer).__name__, source=source, same_groups=same_groups)


def _world_worker(rank, world, scenarios):
    from canzona_testkit.moe import reference_run

    out = {}
    refs: dict = {}
    for name, (stage, opt_type, options) in scenarios.items():
        try:
            res = _train(rank, world, stage, opt_type, options)
            if rank == 0:
                key = (opt_type, options.get("clip", 0.0))
                if key not in refs:
                    refs[key] = (reference_run(world, EP, STEPS, opt_type, clip=key[1]),
                                 reference_run(world, EP, 1, opt_type, clip=key[1]))
                res["ref"], res["ref_first"] = refs[key]
            out[name] = res
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _run(world: int) -> list:
    return run_distributed(_world_worker, world, SCENARIOS_2 if world == 2 else SCENARIOS_4, timeout=900)


def _results(world: int, name: str) -> list:
    res = [r[name] for r in _run(world)]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    return res


def _check_structure(res: list, world: int, stage: int) -> None:
    for r in res:
        assert r["inner_calls"] and set(r["inner_calls"]) == {0}, r["inner_calls"]  # no collective in the step
        if stage:
            assert r["zero_class"] == "CanzonaZeroOptimizer"
            # one matrix + one AdamW group for the dense parameters and for the expert group
            assert list(r["groups"].values()) == [["matrix", False], ["aux", False], ["matrix", True], ["aux", True]]
            assert r["plans"] == {"None": world, "ep_size_2": world // EP}  # dense over DP, experts over EDP
    if not stage:
        return
    # dense matrices: each owned by one rank of the DP group; expert matrices by one rank of
    # each expert-DP group ({0, 2} and {1, 3} at world 4; {0} and {1} at world 2)
    dense = [n for r in res for n in r["owned"] if ".experts." not in n]
    assert sorted(dense) == sorted(set(dense)) == ["moe.deepspeed_moe.gate.wg.weight", "proj.weight"]
    for k in range(EP):
        edp = [n for r in res[k::EP] for n in r["owned"] if ".experts." in n]
        assert len(edp) == len(set(edp)) == 4, edp  # 2 local experts x 2 matrices, each once
        for r in res[k::EP]:
            assert len([n for n in r["owned"] if ".experts." in n]) == 4 // (world // EP)


def _assert_equal(got: dict, ref: dict, what: str) -> None:
    assert set(got) <= set(ref)
    for n in got:
        np.testing.assert_array_equal(got[n], ref[n], err_msg=f"{what}: {n}")


@pytest.mark.parametrize("name", sorted(SCENARIOS_2))
def test_world2_ep2_bit_exact(name):
    stage = SCENARIOS_2[name][0]
    res = _results(2, name)
    ref = res[0]["ref"]
    for r in res:
        if SCENARIOS_2[name][2].get("bf16"):  # bf16 weights: the machinery exact, the losses near fp32's
            assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
            assert r["replay"]["steps"] == STEPS, r["replay"]
            continue
        _assert_equal(r["params"], ref, name)
        options = SCENARIOS_2[name][2]
        assert r["source"] == ("mpu" if options.get("mpu") else "dp")
    for rank, r in enumerate(res):
        if SCENARIOS_2[name][2].get("client"):  # world 2, ep 2: expert-parallel {0, 1}, expert-DP {rank}
            assert r["same_groups"] == dict(ranks=[[0, 1], [rank]], names=["ep_size_2"], same=[True] * 6), \
                r["same_groups"]
    _check_structure(res, 2, stage)
    if SCENARIOS_2[name][2].get("bf16"):
        fp32 = _results(2, "z1_CanzonaMuon")
        dev = max(abs(a - b) for r, f in zip(res, fp32) for a, b in zip(r["losses"], f["losses"]))
        print(f"{name}: max |loss - fp32 loss| = {dev:.3g}")
        assert dev < 0.02


@pytest.mark.parametrize("name", sorted(SCENARIOS_4))
def test_world4_ep2(name):
    stage, opt_type, _ = SCENARIOS_4[name]
    res = _results(4, name)
    ref, ref_first = res[0]["ref"], res[0]["ref_first"]
    for r in res:  # after one step the experts (two-term expert-DP sums) are bit-exact
        _assert_equal({n: v for n, v in r["first"].items() if ".experts." in n}, ref_first, f"{name} step 1")
        if stage:
            assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
            assert r["replay"]["steps"] == STEPS, r["replay"]
    for rank, r in enumerate(res):
        if SCENARIOS_4[name][2].get("client"):  # expert-parallel {0,1} {2,3}, expert-DP {0,2} {1,3}
            assert r["same_groups"] == dict(ranks=[[rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]],
                                            names=["ep_size_2"], same=[True] * 6), r["same_groups"]
    dev = max(float(np.abs(r["params"][n] - ref[n]).max()) for r in res for n in r["params"])
    print(f"{name} world 4: max |param - reference| after {STEPS} steps = {dev:.3g}")
    if opt_type == "CanzonaMuon":  # dense 4-rank sums: another association (muon_reordered_sum_tolerance)
        assert dev <= muon_reordered_sum_tolerance(STEPS), dev
    _check_structure(res, 4, stage)


def _two_groups_worker(rank, world):
    """Two MoE layers of different ep_size (1 and 2): three partitions, three plans."""
    import deepspeed
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE

    import canzona_ds  # noqa: F401
    from canzona_testkit.comm import CommCounter
    from canzona_testkit.models import VOCAB, MatrixStepRecorder, batches
    from canzona_testkit.moe import moe_ds_config

    torch.manual_seed(0)

    class TwoMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 16)
            expert = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
            self.m1 = MoE(16, expert, num_experts=2, ep_size=1, k=1, capacity_factor=2.0, min_capacity=0,
                          use_rts=False)
            self.m2 = MoE(16, expert, num_experts=4, ep_size=EP, k=1, capacity_factor=4.0, min_capacity=0,
                          use_rts=False)
            self.head = nn.Linear(16, VOCAB, bias=False)

        def forward(self, x, y):
            h = self.embed(x)
            out1, aux1, _ = self.m1(h)
            h = h + out1
            out2, aux2, _ = self.m2(h)
            h = h + out2
            return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten()) + 0.01 * (aux1 + aux2)

    model = TwoMoE()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=moe_ds_config(world, stage=2, gradient_clipping=CLIP))
    inner = engine.optimizer.optimizer
    recorder = MatrixStepRecorder(inner)
    calls = []
    for x, y in batches(STEPS, 2 * world):
        loss = engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
        engine.backward(loss)
        stock = inner.step

        def counted(*a, **k):
            with CommCounter() as c:
                out = stock(*a, **k)
            calls.append(c.count("torch") + c.count("deepspeed"))
            return out

        inner.step = counted
        engine.step()
        inner.step = stock
    return dict(groups=[(g["canzona_role"], g.get("name")) for g in inner.param_groups],
                plans={str(k): v.world_size for k, v in inner.plans.items()}, owned=sorted(inner.handled_names()),
                replay=recorder.summary(), calls=calls, ep=(inner.groups.ep_size, inner.groups.ep_rank))


def test_two_expert_groups():
    """ep_size 1 and 2 in one model at world 4: the ep_size_1 experts are planned over all 4 ranks,
    the ep_size_2 ones over their expert-DP pairs; the machinery replays bit for bit, with clipping."""
    res = run_distributed(_two_groups_worker, 4)
    for rank, r in enumerate(res):
        assert [n for _, n in r["groups"]] == [None, None, "ep_size_1", "ep_size_1", "ep_size_2", "ep_size_2"]
        assert r["plans"] == {"None": 4, "ep_size_1": 4, "ep_size_2": 2}
        assert_bits(r["replay"]["replay_max_diff"], 0.0)
        assert r["replay"]["steps"] == STEPS
        assert r["calls"] and set(r["calls"]) == {0} and r["ep"] == (EP, rank % EP)  # no collective in the step
    m1 = [n for r in res for n in r["owned"] if n.startswith("m1.deepspeed_moe.experts.")]
    assert sorted(m1) == sorted(set(m1)) and len(m1) == 4  # 2 experts x 2 matrices over the 4 ranks
    for k in range(EP):
        m2 = [n for r in res[k::EP] for n in r["owned"] if n.startswith("m2.deepspeed_moe.experts.")]
        assert sorted(m2) == sorted(set(m2)) and len(m2) == 4


# ---------------------------------------------------------------------------- checkpoints
def _checkpoint_worker(rank, world, ckpt, opt_type, stage=2):
    """Train 2 steps, save, train 1 more; a fresh engine loads and trains the same step."""
    import torch

    from canzona_testkit.moe import moe_ds_config, run_moe_engine
    from canzona_testkit.models import batches

    data = batches(3, 2 * world)
    cfg = moe_ds_config(world, optimizer=opt_type, stage=stage)
    saved = {}

    def after_step(step, params):
        if step == 2:
            saved["engine"].save_checkpoint(ckpt, tag="two")

    def keep(engine):
        saved["engine"] = engine

    straight, _, engine = run_moe_engine(rank, world, EP, cfg, 3, after_init=keep, after_step=after_step, data=data)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = {n: {k: v.clone() for k, v in st.items()} for n, st in inner.matrix_state.items()}
    files = sorted(os.listdir(os.path.join(ckpt, "two")))

    def load(engine):
        engine.load_checkpoint(ckpt, tag="two")

    resumed, _, engine2 = run_moe_engine(rank, world, EP, cfg, 1, after_init=load, data=data[2:])
    state2 = getattr(engine2.optimizer, "optimizer", engine2.optimizer).matrix_state
    same_state = state.keys() == state2.keys() and all(torch.equal(state[n][k], state2[n][k])
                                                        for n in state for k in state[n])
    return dict(straight=straight, resumed=resumed, same_state=same_state, files=files,
                experts=sorted(n for n in state if ".experts." in n))


def test_checkpoint_round_trip():
    """ZeRO-2, world 2, ep_size 2: DeepSpeed writes the experts' weights to their own files and
    each rank's optimizer partition (dense and expert groups, the rule state of the matrices it
    owns) to its ZeRO file; a resumed run continues bit for bit.  (Resuming at another DP size or
    ep_size: tests/test_ckpt_resume.py's scenario table.)"""
    with tempfile.TemporaryDirectory() as ckpt:
        res = run_distributed(_checkpoint_worker, 2, ckpt, "CanzonaSOAP")
    for r in res:
        _assert_equal(r["resumed"], r["straight"], "resumed")
        assert r["same_state"]
    assert any("expert" in f for f in res[0]["files"]), res[0]["files"]  # DeepSpeed's expert files
    for r in res:  # expert-DP groups of one rank: each rank keeps the state of its 2 local experts' matrices
        assert len(r["experts"]) == 4, r["experts"]


def test_checkpoint_round_trip_stage0():
    """ZeRO stage 0: DeepSpeed writes each expert-parallel rank's whole optimizer state (dense and
    its experts' rule state) to expp_rank_<k> files; a resumed run continues bit for bit."""
    with tempfile.TemporaryDirectory() as ckpt:
        res = run_distributed(_checkpoint_worker, 2, ckpt, "CanzonaShampoo", 0)
    for r in res:
        _assert_equal(r["resumed"], r["straight"], "resumed")
        assert r["same_state"] and len(r["experts"]) == 4
    assert "expp_rank_1_mp_rank_00_optim_states.pt" in res[0]["files"], res[0]["files"]


# ---------------------------------------------------------------------------- refusals
REFUSALS = {
    "zero3": ({"zero_optimization": {"stage": 3}}, "stage=3"),
    "stage2_no_contiguous": ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}},
                             "contiguous_gradients"),
    "no_reduce_scatter": ({"zero_optimization": {"stage": 1, "reduce_scatter": False}}, "reduce_scatter"),
    # offload_optimizer.device='cpu' works with MoE (tests/test_moe_offload.py); NVMe is refused as without MoE
    "offload_nvme": ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
                     "offload_optimizer.device='nvme'"),
    "group_settings": ({"zero_optimization": {"stage": 1}, "_groups": "weight_decay"}, "'weight_decay'"),
    "moe_group_with_dense": ({"zero_optimization": {"stage": 1}, "_groups": "bad_moe"}, "non-expert parameters"),
    # the stage-0 client optimizer creates the expert groups with its mpu: another one already in DeepSpeed
    "client_other_mpu": ({"zero_optimization": {"stage": 0}, "_groups": "client_other_mpu"}, "already another mpu"),
}


def _refusal_worker(rank, world):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit.moe import TinyMoE, moe_ds_config

    out = {}
    for name, (extra, _) in REFUSALS.items():
        extra = dict(extra)
        groups = extra.pop("_groups", None)
        model = TinyMoE(EP, rank % EP)
        params = list(model.parameters())
        if groups == "weight_decay":
            params = [{"params": params, "name": "dense", "weight_decay": 0.0}]
        elif groups == "bad_moe":
            params = [{"params": params, "name": "ep_size_2", "moe": True}]
        try:
            if groups == "client_other_mpu":
                from deepspeed.utils import groups as ds_groups

                from canzona_ds.integration.megatron import build_tp_optimizer
                from canzona_testkit import megatron_standin

                megatron_standin.initialize_model_parallel(1)
                saved, ds_groups.mpu = ds_groups.mpu, object()
                try:
                    build_tp_optimizer(model, moe_ds_config(world, **extra), mpu=megatron_standin.mpu)
                finally:
                    ds_groups.mpu = saved
            deepspeed.initialize(model=model, model_parameters=params, config=moe_ds_config(world, **extra))
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


@lru_cache(maxsize=None)
def _refusals() -> dict:
    return run_distributed(_refusal_worker, 2)[0]


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused_by_name(name):
    got = _refusals()[name]
    assert got is not None and REFUSALS[name][1] in got, got


# ------------------------------------------------------------ pipeline parallelism: one layout refused
# MoE layers in a PipelineModule (world 4 = PP 2 x DP 2, ep_size 2).  DeepSpeed 0.19.8 runs MoE in
# any stages at ZeRO 0 and at ZeRO 1 when every stage holds the same expert groups (both tested in
# tests/test_moe_pipeline.py); at ZeRO 1 with MoE in one stage of two its own "AdamW" deadlocks in
# the first train_batch (its optimizer all-reduces one gradient norm per parameter group over the
# pipeline, get_grad_norm_direct; docs/moe.md, "MoE and pipeline parallelism";
# benchmarks/probe_moe_pipeline.py reproduces it).  That layout is refused on EVERY rank, the stage
# without MoE layers included (it would otherwise wait).
PIPE_REFUSALS = {  # name -> (MoE layers: 1 = stage 0 only, 2 = one per stage; ZeRO stage; stages named)
    "one_stage_z1": (1, 1, "MoE layers on stage 0 (ranks [0, 1])) at zero_optimization.stage=1",
                     "stage 0: ['ep_size_2']; stage 1: no expert groups"),
}


def _pipe_refusal_worker(rank, world, moe_layers, stage):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit.models import HP
    from canzona_testkit.moe import build_moe_pipe

    module = build_moe_pipe(moe_layers, ep_size=EP)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "CanzonaMuon", "params": HP["CanzonaMuon"]}}
    try:
        deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("name", sorted(PIPE_REFUSALS))
def test_pipeline_refused_on_every_rank(name):
    moe_layers, stage, where, holds = PIPE_REFUSALS[name]
    got = run_distributed(_pipe_refusal_worker, 4, moe_layers, stage, timeout=120)
    for rank, msg in enumerate(got):
        assert msg is not None and msg.startswith("ValueError: CanzonaMuon: DeepSpeed MoE layers"), (rank, msg)
        assert "pipeline parallelism (pp_size=2; " + where in msg, (rank, msg)
        assert f"(got {holds})" in msg, (rank, msg)
        assert "get_grad_norm_direct" in msg and "ZeRO stage 0" in msg and "pp=1" in msg, (rank, msg)


# ---------------------------------------------------------------------------- fp16
def _fp16_worker(rank, world, stage):
    """fp16 with dynamic loss scaling, world 2, ep_size 2: 4 iterations, the second one's loss made
    inf on rank 0 only (its gradients overflow there; the experts of rank 1 see it through the
    all-to-all): every rank must skip that step (weights and rule state unchanged, the scale
    halved), and every owner's other updates replay bit for bit."""
    import deepspeed
    import torch

    import canzona_ds  # noqa: F401
    from canzona_ds.integration.accelerator import allow_fp16
    from canzona_testkit.models import MatrixStepRecorder, batches
    from canzona_testkit.moe import TinyMoE, global_name, moe_ds_config, run_moe_engine

    cfg = moe_ds_config(world, stage=stage, fp16={"enabled": True, "initial_scale_power": 8,
                                                  "loss_scale_window": 1000, "hysteresis": 1})
    with allow_fp16():
        model = TinyMoE(EP, rank % EP)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        inner = engine.optimizer.optimizer
        recorder = MatrixStepRecorder(inner)

        def params():
            return {global_name(n, rank % EP, 2): p.detach().float().clone()
                    for n, p in engine.module.named_parameters()}

        def state():
            return {n: {k: v.clone() for k, v in st.items()} for n, st in inner.matrix_state.items()}

        snaps, losses = [], []
        for s, (x, y) in enumerate(batches(4, 2 * world)):
            x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
            loss = engine(x, y)
            losses.append(float(loss.detach()))
            if s == 1 and rank == 0:
                loss = loss * torch.tensor(float("inf"))
            engine.backward(loss)
            before = (params(), state(), engine.optimizer.loss_scale)
            engine.step()
            snaps.append((before, (params(), state(), engine.optimizer.loss_scale), engine.skipped_steps))
    # the fp32 run's first two losses (before the skipped step both runs see the same updates)
    _, fp32_losses, _ = run_moe_engine(rank, world, EP, moe_ds_config(world, stage=stage), 2)
    (bp, bs, bscale), (ap, as_, ascale), skipped = snaps[1]
    same = all(torch.equal(bp[n], ap[n]) for n in bp) and bs.keys() == as_.keys() and \
        all(torch.equal(bs[n][k], as_[n][k]) for n in bs for k in bs[n])
    changed = [any(not torch.equal(b[0][n], a[0][n]) for n in b[0] if ".experts." in n) for b, a, _ in snaps]
    return dict(same=same, scale=(bscale, ascale), skipped=skipped, changed=changed,
                finite=all(torch.isfinite(v).all() for v in snaps[-1][1][0].values()),
                losses=losses, fp32_losses=fp32_losses, replay=recorder.summary(),
                steps=[g["step"] for g in inner.param_groups if g["canzona_role"] == "matrix"],
                owned=sorted(inner.handled_names()))


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skipped_and_replayed(stage):
    res = run_distributed(_fp16_worker, 2, stage)
    for r in res:
        assert r["same"] and r["skipped"] == 1 and r["scale"][1] < r["scale"][0], r
        assert r["changed"] == [True, False, True, True] and r["finite"], r  # experts trained, step 2 skipped
        assert r["steps"] == [3, 3], r  # dense and expert matrix groups: 4 iterations, one skipped
        assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
        assert r["replay"]["steps"] == 3, r["replay"]
        assert all(np.isfinite(v) for v in r["losses"]), r["losses"]
        assert max(abs(a - b) for a, b in zip(r["losses"], r["fp32_losses"])) < 0.01, (r["losses"], r["fp32_losses"])
    for r in res:  # expert-DP groups of one rank: each rank owns its 2 local experts' 2 matrices
        assert len([n for n in r["owned"] if ".experts." in n]) == 4, r["owned"]
    print(f"fp16 ZeRO-{stage} losses: {[round(v, 4) for v in res[0]['losses']]}")

"""DeepSpeed MoE with ``use_data_before_expert_parallelism: true`` (ds_config, top level; the engine
reads it into ``engine._config.use_data_before_expert_parallel_`` and passes it to every
``MoE.set_deepspeed_parallelism``), on real gloo processes.

DeepSpeed 0.19.8 (``deepspeed/utils/groups.py: _create_expert_and_data_parallel``, no TP/PP) lays
the expert groups out D + E instead of E + D; at world 4, ep_size 2 (printed by this run)::

    default               expert-parallel {0,1} {2,3}   expert-DP {0,2} {1,3}   rank r: ep_rank r % 2
    data before expert    expert-parallel {0,2} {1,3}   expert-DP {0,1} {2,3}   rank r: ep_rank r // 2

so ranks 0, 1 hold experts 0, 1 and ranks 2, 3 experts 2, 3, and each expert group is planned
over {0,1} or {2,3}.  The tiny MoE model (``canzona_testkit.moe``; ``run_moe_engine`` and
``reference_run(before=True)`` follow the same layout) at world 4, ep_size 2, per scenario (each in
its own ``try``; one failing scenario fails one test):

* training, ZeRO 1 and 2, Muon, Shampoo, SOAP, clipping that clips (0.05, the norm ~1):
  - DeepSpeed's groups are the D + E ones above; the optimizer's expert groups, its plan's group
    and ZeRO's partition group of the expert partition are that expert-DP group;
  - every rank's parameters equal, bit for bit (rtol = atol = 0), after 3 steps, the
    single-process ``ReferenceOptimizer`` (the rule on every whole matrix, torch AdamW, torch's
    ``clip_grad_norm_`` over the whole model) fed the run's own averaged gradients (every
    rank's pre-clip flat partitions gathered over their ZeRO group, every copy checked equal);
    the clip norm is torch's, bit for bit;
  - against the independent reference ``reference_run(before=True)`` (the ranks' forward,
    all-to-alls and ZeRO's averages reproduced in one process): every expert matrix bit for bit
    after the first step (its expert-DP sums have two terms; the dense sums four, associated in
    gloo's order, ~1 ulp: as tests/test_moe.py at world 4), Muon within the reordered-sum bound after 3 steps.  (An
    expert's gradient is the same sum of every rank's tokens in either layout; what the layout
    decides, and what is checked here, is which ranks hold, average and own which experts: rank 1
    holds experts 0, 1, not 2, 3, and its weights are those experts' by whole-model name.);
  - each expert matrix is owned by exactly one rank, of its expert-DP group ({0,1} for experts 0,
    1; {2,3} for 2, 3), each dense matrix by one rank of the 4; the step makes no collective call;
* a same-size checkpoint round trip (ZeRO 2 Shampoo): DeepSpeed's own load (the index loop not
  taken), 2 more steps bit for bit with the uninterrupted run, the rule state equal;
  (The layout flipped either way at the same size, which puts other experts in ranks 1's and 2's
  files, and resized: rows of tests/test_ckpt_resume.py's scenario table, through the index
  loop, the layout fingerprints differing);
* Megatron-DeepSpeed's ZeRO-0 client optimizer (``build_tp_optimizer`` before
  ``deepspeed.initialize``, with the stand-in mpu): ``create_expert_groups`` builds the D + E
  groups, and the engine, its MoE layer and the optimizer's plan use the same group objects;
  experts bit for bit after the first step, Muon within the reordered-sum bound after 3;
* refused by name (untested): the setting with pipeline parallelism (every rank, the stage without
  MoE layers too) and with tensor parallelism.

Cost: 1 rank run; 4 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import bits_differ, test_threads
import os
import traceback
from functools import lru_cache

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed, scratch_dir
from canzona_testkit.models import muon_reordered_sum_tolerance

EP, WORLD = 2, 4
STEPS = 3  # Shampoo/SOAP in HP refresh every 2 steps
SAVE_STEPS, MORE = 2, 2
CLIP = 0.05  # well below the gradient norm (~1): every step clips
BEFORE = {"use_data_before_expert_parallelism": True}
EXPERT_RANKS = {0: [0, 1], 1: [2, 3]}  # expert-parallel rank -> the ranks holding its experts (D + E)

#: training at world 4: name -> (ZeRO stage, type, clip)
TRAIN = {
    "z1_CanzonaMuon_clip": (1, "CanzonaMuon", CLIP),
    "z2_CanzonaMuon": (2, "CanzonaMuon", 0.0),
    "z2_CanzonaSOAP_clip": (2, "CanzonaSOAP", CLIP),
    "z1_CanzonaShampoo": (1, "CanzonaShampoo", 0.0),
}


def _cfg(world: int, opt_type: str, stage: int, before: bool = True, clip: float = 0.0) -> dict:
    from canzona_testkit.moe import moe_ds_config

    return moe_ds_config(world, optimizer=opt_type, stage=stage, gradient_clipping=clip, **(BEFORE if before else {}))


def _fresh_expert_groups() -> None:
    """Forget DeepSpeed's expert groups (it creates a group name once per process and would reuse
    the previous scenario's layout); every rank calls this at the same point."""
    from deepspeed.utils import groups as ds_groups

    for d in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS,
              ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        d.clear()


def _ds_groups() -> dict:
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups

    return dict(ep=dist.get_process_group_ranks(ds_groups._get_expert_parallel_group("ep_size_2")),
                edp=dist.get_process_group_ranks(ds_groups._get_expert_data_parallel_group("ep_size_2")))


def _train(rank: int, world: int, stage: int, opt_type: str, clip: float) -> dict:
    import torch.distributed as dist

    from test_moe_tp import _gather_partitions  # (this rank's gradients, gathered over each ZeRO group)

    from canzona_testkit.comm import CommCounter
    from canzona_testkit.moe import run_moe_engine

    _fresh_expert_groups()
    state: dict = {"calls": [], "captured": [], "norms": [], "initial": {}, "first": {}}

    def attach(engine):
        zero, inner = engine.optimizer, engine.optimizer.optimizer
        state["initial"] = {n: p.detach().float().numpy().copy() for n, p in engine.module.named_parameters()}
        stock_step, stock_clip, stock_norm = inner.step, zero.unscale_and_clip_grads, zero.scaled_global_norm

        def step(*a, **k):
            with CommCounter() as c:
                out = stock_step(*a, **k)
            state["calls"].append(c.count("torch") + c.count("deepspeed"))
            return out

        def norm(*a, **k):  # once per step, before the groups' unscale_and_clip_grads
            state["captured"].append({})
            total = stock_norm(*a, **k)
            state["norms"].append(float(total))
            return total

        def unscale_and_clip(grad_groups_flat, total_norm):  # the averaged gradients, before the clip
            for g in grad_groups_flat:  # (DeepSpeed calls it per param group)
                i = next(j for j, p in enumerate(zero.single_partition_of_fp32_groups) if p.grad is g)
                state["captured"][-1][i] = g.detach().clone()
            return stock_clip(grad_groups_flat, total_norm)

        inner.step, zero.scaled_global_norm, zero.unscale_and_clip_grads = step, norm, unscale_and_clip

    def after_step(step, params):
        if step == 1:
            state["first"].update(params)

    params, _, engine = run_moe_engine(rank, world, EP, _cfg(world, opt_type, stage, clip=clip), STEPS,
                                       after_init=attach, after_step=after_step)
    zero, inner = engine.optimizer, engine.optimizer.optimizer
    glob = inner.moe.global_names
    eg = inner.groups.expert("ep_size_2")
    zero_groups = {str(zero._canzona_partition(i)): dist.get_process_group_ranks(zero.real_dp_process_group[i])
                   for i in zero._canzona_groups}

    def rename(values: dict) -> dict:
        return {glob.get(n, n): v for n, v in values.items()}

    return dict(params=params, first=state["first"], initial=rename(state["initial"]),
                grads=[rename(g) for g in _gather_partitions(zero, state["captured"])], norms=state["norms"],
                calls=state["calls"], owned=sorted(glob.get(n, n) for n in inner.handled_names()),
                plans={str(k): v.world_size for k, v in inner.plans.items()}, zero_groups=zero_groups,
                planned=dict(ep=dist.get_process_group_ranks(eg.ep_group),
                             edp=dist.get_process_group_ranks(eg.edp_group), ep_rank=eg.ep_rank),
                ds=_ds_groups(), engine_flag=bool(engine._config.use_data_before_expert_parallel_),
                zero_class=type(zero).__name__)


def _own_gradient_reference(results: list, opt_type: str, clip: float) -> dict:
    """Rank 0: ReferenceOptimizer (+ torch's clip_grad_norm_ over the whole model, in its order)
    from the gathered initial weights, fed the gathered gradients of every step."""
    import torch
    import torch.nn as nn

    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer
    from canzona_testkit.models import HP
    from canzona_testkit.moe import whole_names

    torch.set_num_threads(test_threads())
    problems = []

    def whole(per_rank: list, what: str) -> dict:
        out = {}
        for rank, values in enumerate(per_rank):
            for n, v in values.items():
                if n in out and bits_differ(out[n], v):
                    problems.append(f"{what}: copies of {n} differ (rank {rank})")
                out.setdefault(n, v)
        return out

    order = whole_names()
    initial = whole([r["initial"] for r in results], "initial weights")
    if sorted(initial) != sorted(order):
        problems.append(f"initial weights cover {sorted(initial)}, not the whole model")
    master = {n: nn.Parameter(torch.from_numpy(initial[n].copy())) for n in order}
    opt = ReferenceOptimizer([(n, master[n]) for n in order], CanzonaConfig.from_ds(opt_type, dict(HP[opt_type])))
    norms = []
    for t in range(STEPS):
        grads = whole([r["grads"][t] for r in results], f"step {t + 1} gradients")
        for n in order:
            master[n].grad = torch.from_numpy(grads[n].copy())
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_([master[n] for n in order], clip)))
        opt.step()
    return dict(params={n: p.detach().numpy().copy() for n, p in master.items()}, norms=norms, problems=problems,
                matrices=sorted(n for n, _ in opt.matrices))


def _roundtrip(rank: int, world: int, root: str) -> dict:
    """ZeRO 2 Shampoo with D + E: 2 steps, save, 2 more; a fresh engine loads and takes the same 2."""
    import torch

    from canzona_ds.integration.ckpt.route import index_route
    from canzona_testkit.models import batches
    from canzona_testkit.moe import run_moe_engine

    _fresh_expert_groups()
    ckpt = os.path.join(root, "roundtrip")
    data = batches(SAVE_STEPS + MORE, 2 * world)
    cfg = _cfg(world, "CanzonaShampoo", 2)
    keep = {}

    def after_step(step, params):
        if step == SAVE_STEPS:
            keep["engine"].save_checkpoint(ckpt, tag="two")

    straight, _, engine = run_moe_engine(rank, world, EP, cfg, SAVE_STEPS + MORE, data=data,
                                         after_init=lambda e: keep.update(engine=e), after_step=after_step)
    state = {n: {k: v.clone() for k, v in st.items()} for n, st in engine.optimizer.optimizer.matrix_state.items()}
    verdict = {}

    def load(e):
        verdict["elastic"] = index_route(e, ckpt, "two") is not None
        e.load_checkpoint(ckpt, tag="two")

    resumed, _, engine2 = run_moe_engine(rank, world, EP, cfg, MORE, data=data[SAVE_STEPS:], after_init=load)
    state2 = engine2.optimizer.optimizer.matrix_state
    same_state = state.keys() == state2.keys() and all(torch.equal(state[n][k], state2[n][k])
                                                        for n in state for k in state[n])
    return dict(straight=straight, resumed=resumed, same_state=same_state, elastic=verdict["elastic"],
                experts=sorted(n for n in state if ".experts." in n), ds=_ds_groups())


def _client(rank: int, world: int) -> dict:
    """Megatron-DeepSpeed's ZeRO-0 client optimizer with D + E (build_tp_optimizer creates the groups)."""
    from deepspeed.utils import groups as ds_groups

    from canzona_testkit import megatron_standin
    from canzona_testkit.moe import reference_run, run_moe_engine

    _fresh_expert_groups()
    megatron_standin.initialize_model_parallel(1)
    built, first = {}, {}

    def after_build(model, optimizer):
        built.update(ep=ds_groups._EXPERT_PARALLEL_GROUP["ep_size_2"],
                     edp=ds_groups._EXPERT_DATA_PARALLEL_GROUP["ep_size_2"], ds=_ds_groups(),
                     planned=(optimizer.groups.expert("ep_size_2").ep_group,
                              optimizer.groups.expert("ep_size_2").edp_group))

    def after_step(step, params):
        if step == 1:
            first.update(params)

    params, _, engine = run_moe_engine(rank, world, EP, _cfg(world, "CanzonaMuon", 0), STEPS, client=True,
                                       mpu=megatron_standin.mpu, after_build=after_build, after_step=after_step)
    ep, edp = built["ep"], built["edp"]
    res = dict(params=params, first=first, built=built["ds"], ds=_ds_groups(),
               same=[engine.expert_parallel_group["ep_size_2"] is ep,
                     engine.expert_data_parallel_group["ep_size_2"] is edp,
                     engine.module.moe.deepspeed_moe.ep_group is ep,
                     built["planned"][0] is ep, built["planned"][1] is edp, engine.optimizer is engine.basic_optimizer],
               source=engine.optimizer.groups.source)
    if rank == 0:
        res["ref"] = reference_run(world, EP, STEPS, "CanzonaMuon", before=True)
        res["ref_first"] = reference_run(world, EP, 1, "CanzonaMuon", before=True)
    return res


def _pipe_refusal(rank: int, world: int) -> str | None:
    """A PipelineModule (PP 2 x DP 2) with an MoE layer in stage 0 only, ZeRO 0, D + E: the error of
    every rank (the stage without MoE layers too), or None."""
    import deepspeed

    from canzona_testkit.models import HP
    from canzona_testkit.moe import build_moe_pipe

    _fresh_expert_groups()
    module = build_moe_pipe(1, ep_size=EP)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 0}, "optimizer": {"type": "CanzonaMuon", "params": HP["CanzonaMuon"]},
           **BEFORE}
    try:
        deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _world4_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from canzona_testkit.moe import reference_run

    out = {}
    for name, (stage, opt_type, clip) in TRAIN.items():
        try:
            res = _train(rank, world, stage, opt_type, clip)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, res)
            if rank == 0:
                res["own_ref"] = _own_gradient_reference(gathered, opt_type, clip)
                res["ref"] = reference_run(world, EP, STEPS, opt_type, clip=clip, before=True)
                res["ref_first"] = reference_run(world, EP, 1, opt_type, clip=clip, before=True)
            out[name] = res
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    for name, fn in [("roundtrip", lambda: _roundtrip(rank, world, root)),
                     ("client_z0_CanzonaMuon", lambda: _client(rank, world)),
             ("refuse_pipeline", lambda: _pipe_refusal(rank, world))]:  # (last: it leaves a pipeline grid)
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _root() -> str:
    return scratch_dir("canzona_moe_data_before_")


@lru_cache(maxsize=None)
def _run() -> dict:
    res = run_distributed(_world4_worker, WORLD, _root(), timeout=900)
    return {n: [r[n] for r in res] for n in res[0]}


def _results(name: str) -> list:
    res = _run()[name]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    return res


def _eq(got, want, what: str) -> None:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


def _expert(n: str) -> int | None:
    return int(n.split("deepspeed_experts.")[1].split(".")[0]) if ".experts." in n else None


def _check_ds_groups(ds: dict, rank: int, before: bool = True) -> None:
    """DeepSpeed's own expert groups at world 4, ep_size 2 (module docstring)."""
    if before:
        assert ds == dict(ep=[rank % 2, rank % 2 + 2], edp=EXPERT_RANKS[rank // 2]), (rank, ds)
    else:
        assert ds == dict(ep=[rank // 2 * 2, rank // 2 * 2 + 1], edp=[rank % 2, rank % 2 + 2]), (rank, ds)


@pytest.mark.parametrize("name", sorted(TRAIN))
def test_data_before_expert_training(name):
    stage, opt_type, clip = TRAIN[name]
    res = _results(name)
    r0 = res[0]
    own = r0["own_ref"]
    assert not own["problems"], own["problems"]
    assert "moe.deepspeed_moe.experts.deepspeed_experts.3.2.weight" in own["matrices"] and \
        "proj.weight" in own["matrices"]
    print(f"{name}: DeepSpeed's groups per rank: {[r['ds'] for r in res]}")
    for rank, r in enumerate(res):
        assert r["engine_flag"] is True and r["zero_class"] == "CanzonaZeroOptimizer"
        _check_ds_groups(r["ds"], rank)
        # the optimizer's expert groups, its plan and ZeRO's partition of the expert group: expert-DP
        assert r["planned"] == dict(ep=r["ds"]["ep"], edp=r["ds"]["edp"], ep_rank=rank // 2), r["planned"]
        assert r["zero_groups"] == {"None": [0, 1, 2, 3], "ep_size_2": EXPERT_RANKS[rank // 2]}, r["zero_groups"]
        assert r["plans"] == {"None": WORLD, "ep_size_2": 2}
        assert len(r["calls"]) >= STEPS and set(r["calls"]) == {0}, r["calls"]  # no collective in the step
        # bit for bit against the reference on the run's own gradients, every parameter, every rank
        assert sorted(r["params"]) == sorted(n for n in own["params"] if _expert(n) is None
                                             or _expert(n) // 2 == rank // 2)
        for n, v in r["params"].items():
            _eq(v, own["params"][n], f"{name}: rank {rank} {n} after {STEPS} steps (own gradients)")
        # the independent reference: experts bit for bit after the first step
        for n, v in r["first"].items():
            if ".experts." in n:
                _eq(v, r0["ref_first"][n], f"{name}: rank {rank} {n} after 1 step (reference_run)")
    if clip:
        assert all(b > 2 * clip for b in own["norms"]), own["norms"]  # every step clips
        for r in res:
            assert r["norms"] == own["norms"], (r["norms"], own["norms"])  # torch's clip_grad_norm_, bit for bit
    dev = max(float(np.abs(r["params"][n] - r0["ref"][n]).max()) for r in res for n in r["params"])
    print(f"{name}: max |param - reference_run| after {STEPS} steps = {dev:.3g}")
    if opt_type == "CanzonaMuon":  # dense 4-rank sums: another association (muon_reordered_sum_tolerance)
        assert dev <= muon_reordered_sum_tolerance(STEPS), dev
    # ownership: each expert matrix once, on a rank of its expert-DP group; each dense matrix once
    holders: dict[str, list[int]] = {}
    for rank, r in enumerate(res):
        for n in r["owned"]:
            holders.setdefault(n, []).append(rank)
    experts = {n: ranks for n, ranks in holders.items() if ".experts." in n}
    assert len(experts) == 8, sorted(experts)  # 4 experts x 2 matrices
    for n, ranks in holders.items():
        assert len(ranks) == 1, (n, ranks)
        if ".experts." in n:
            assert ranks[0] in EXPERT_RANKS[_expert(n) // 2], (n, ranks)
    for k, ranks in EXPERT_RANKS.items():  # both ranks of each expert-DP group own some
        assert all(any(ranks_ == [r] for n, ranks_ in experts.items() if _expert(n) // 2 == k) for r in ranks)


def test_data_before_expert_checkpoint_round_trip():
    res = _results("roundtrip")
    for rank, r in enumerate(res):
        _check_ds_groups(r["ds"], rank)
        assert r["elastic"] is False  # same size and layout: DeepSpeed's own load
        assert r["same_state"]
        assert len(r["experts"]) == 2, r["experts"]  # 2 local experts x 2 matrices over 2 expert-DP ranks
        for n, v in r["resumed"].items():
            _eq(v, r["straight"][n], f"rank {rank} {n} resumed")


def test_data_before_expert_client_optimizer_groups():
    res = _results("client_z0_CanzonaMuon")
    ref, ref_first = res[0]["ref"], res[0]["ref_first"]
    for rank, r in enumerate(res):
        _check_ds_groups(r["built"], rank)  # create_expert_groups built DeepSpeed's D + E groups
        assert r["ds"] == r["built"] and r["same"] == [True] * 6, (r["ds"], r["same"])
        assert r["source"] == "mpu"
        for n, v in r["first"].items():
            if ".experts." in n:
                _eq(v, ref_first[n], f"client: rank {rank} {n} after 1 step")
    dev = max(float(np.abs(r["params"][n] - ref[n]).max()) for r in res for n in r["params"])
    print(f"client ZeRO-0 Muon: max |param - reference_run| after {STEPS} steps = {dev:.3g}")
    assert dev <= muon_reordered_sum_tolerance(STEPS), dev  # dense 4-rank sums: another association


def test_data_before_expert_with_pipeline_refused_on_every_rank():
    """Untested with pipeline parallelism: refused by name on every rank, the stage without MoE
    layers included (it would otherwise wait for the other)."""
    for rank, msg in enumerate(_run()["refuse_pipeline"]):  # (a traceback here fails the startswith)
        assert msg is not None and msg.startswith("ValueError: CanzonaMuon: DeepSpeed MoE with "
                                                  "use_data_before_expert_parallelism=true and pipeline parallelism "
                                                  "(pp_size=2) is not supported yet"), (rank, msg)


def test_data_before_expert_with_tensor_parallelism_refused():
    """Untested with a Megatron mpu of TP > 1 (DeepSpeed's D + E groups would make the TP peers one
    expert-DP group): refused by name; without TP the same settings pass."""
    from types import SimpleNamespace

    from canzona_ds.integration.moe import check_moe
    from canzona_ds.parallel import ParallelGroups

    settings = SimpleNamespace(optimizer_type="CanzonaSOAP", zero_stage=2, offload_optimizer=False,
                               expert_data_before=True)
    with pytest.raises(ValueError, match=r"CanzonaSOAP: DeepSpeed MoE with use_data_before_expert_parallelism=true "
                                         r"and tensor parallelism \(tp_size=2\) is not supported yet"):
        check_moe(settings, ParallelGroups(dp_size=2, tp_size=2, tp_rank=0, source="mpu"), {})
    check_moe(settings, ParallelGroups(dp_size=4, source="dp"), {})


def test_data_before_expert_setting_read():
    """The builder reads DeepSpeed's key from a ds_config (the stage-0 client path; from an engine:
    engine._config.use_data_before_expert_parallel_, checked through the refusals above)."""
    from canzona_ds.integration.builder import RunSettings
    from canzona_testkit.moe import moe_ds_config

    assert RunSettings.from_ds_config(moe_ds_config(4, **BEFORE)).expert_data_before is True
    assert RunSettings.from_ds_config(moe_ds_config(4)).expert_data_before is False

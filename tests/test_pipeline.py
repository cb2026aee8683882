"""Pipeline parallelism (DeepSpeed ``PipelineModule`` + ``PipelineEngine``) with the Canzona types,
in real gloo processes, against the single-process reference.

The reference (``canzona_testkit/pipeline.run_pipe_reference``) is the same layers in ONE plain module,
fed every DP rank's micro-batches with ``gradient_accumulation_steps`` = 2, gradients averaged
in the pipeline's order, the tied embedding receiving both uses' gradients (one shared
parameter), then ``ReferenceOptimizer`` (for Muon: torch.optim.Muon + AdamW bit for bit,
test_optim_muon).  Each stage plans its own matrices over its own DP group; everything is
bit-exact in fp32 (rtol = atol = 0): the arithmetic is the same, only placed differently.

Cost: 28 rank runs; 34 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, TYPES, max_abs_diff
from canzona_testkit.pipeline import merge_stages, run_pipe_engine, run_pipe_reference
from canzona_testkit.kernels import assert_bits

STEPS, GAS, MICRO = 3, 2, 2


def pipe_config(opt_type: str, dp: int, stage: int = 1, params: dict | None = None, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "train_batch_size": MICRO * GAS * dp,
           "optimizer": {"type": opt_type, "params": dict(HP.get(opt_type, {}) if params is None else params)},
           "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9}
    cfg.update(extra)
    return cfg


def _tied_pipe_engine(pp: int, cfg: dict):
    """(module, engine): the tied tiny decoder as a PipelineModule of ``pp`` stages under ``cfg``."""
    import deepspeed

    from canzona_testkit.pipeline import build_pipe

    module = build_pipe(pp, True, 0)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    return module, engine


def _load_error(engine, ckpt: str) -> str | None:
    """The error ``engine.load_checkpoint(ckpt, tag="t")`` raises, as text (None if it loads)."""
    try:
        engine.load_checkpoint(ckpt, tag="t")
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


def _reference(opt_type: str, dp: int, tied: bool, stage: int = 1, params: dict | None = None) -> dict:
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    cfg = CanzonaConfig.from_ds(opt_type, dict(HP[opt_type] if params is None else params))
    return run_pipe_reference(STEPS, dp, GAS, lambda named: ReferenceOptimizer(named, cfg), micro=MICRO, tied=tied,
                              stage=stage)["params"]


def _worker(rank, world, cfg, pp, tied):
    def describe(engine):
        opt = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
        describe.out = {"groups": opt.groups.degrees, "coords": opt.groups.coordinates,
                        "plan_dp": None if opt.plan is None else opt.plan.world_size}

    out = run_pipe_engine(rank, world, cfg, pp, STEPS, tied=tied, after_init=describe)
    out.update(describe.out)
    return out


SCENARIOS = {  # name -> (world, pp, ZeRO stage, tied embedding)
    "pp2": (2, 2, 1, False),
    "pp2xdp2-tied": (4, 2, 1, True),
    "pp2xdp2-stage0-tied": (4, 2, 0, True),
    # 7 layers over 4 stages: the last holds the final norm and the head only (no matrices, one
    # param group where the others have two; DeepSpeed's per-group norm reduction deadlocked here)
    "pp4-stage-without-matrices": (4, 4, 1, False),
}


@pytest.mark.dist
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("opt_type", TYPES)
def test_pipeline_equals_single_process_reference(opt_type, scenario):
    world, pp, stage, tied = SCENARIOS[scenario]
    dp = world // pp
    res = run_distributed(_worker, world, pipe_config(opt_type, dp, stage), pp, tied)
    for r in res:  # every rank read its stage's groups from the PipelineModule's grid
        assert r["groups"] == {"dp": dp, "tp": 1, "pp": pp, "ep": 1}
        assert r["coords"]["pp"] == r["stage"] and r["coords"]["dp"] == r["dp_rank"]
        no_matrices = scenario == "pp4-stage-without-matrices" and r["stage"] == 3
        assert r["plan_dp"] == (dp if stage and not no_matrices else None)
    ref = _reference(opt_type, dp, tied, stage)
    got = merge_stages(res)
    assert set(got) == set(ref)
    assert_bits(max_abs_diff(got, ref), 0.0)
    if tied:  # the first and the last stage hold the tied embedding: identical after every update
        copies = [r["params"]["embed.weight"] for r in res if "embed.weight" in r["params"]]
        assert len(copies) == 2 * dp
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])


CLIP = 0.5  # active on every step of these runs (gradient norm ~1.3)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_clipping_equals_torch_clip_grad_norm(stage, tied):
    """gradient_clipping under PP=2 x DP=2: the norm covers every stage (the tied weight once),
    in torch's arithmetic; DeepSpeed's own stage-0 clip under a pipeline counts only the first
    stage's gradients."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    res = run_distributed(_worker, 4, pipe_config("CanzonaMuon", 2, stage, gradient_clipping=CLIP), 2, tied)
    cfg = CanzonaConfig.from_ds("CanzonaMuon", dict(HP["CanzonaMuon"]))
    ref = run_pipe_reference(STEPS, 2, GAS, lambda named: ReferenceOptimizer(named, cfg), micro=MICRO, tied=tied,
                             stage=stage, clip=CLIP)["params"]
    unclipped = _reference("CanzonaMuon", 2, tied, stage)
    assert max_abs_diff(ref, unclipped) > 1e-4  # the clip is active
    assert_bits(max_abs_diff(merge_stages(res), ref), 0.0)


def _resume_worker(rank, world, pp, ckpt, new_dp_ranks):
    """Train STEPS; a second engine loads the checkpoint written after CUT steps and trains the rest."""
    from canzona_testkit.models import params_of
    from canzona_testkit.pipeline import canonical_name, dataset, rank_micro_batches

    dp = world // pp
    cfg = pipe_config("CanzonaMuon", dp)
    module, engine = _tied_pipe_engine(pp, cfg)
    grid = module.mpu()
    x, y = dataset(STEPS * GAS * MICRO * dp, 1)
    batches = rank_micro_batches(x, y, dp, grid.get_data_parallel_rank(), MICRO)
    data = iter(batches)
    engine.train_batch(data)
    engine.save_checkpoint(ckpt, tag="cut")
    for _ in range(STEPS - 1):
        engine.train_batch(data)
    straight = {canonical_name(n): v for n, v in params_of(module).items()}
    module2, engine2 = _tied_pipe_engine(pp, cfg)
    engine2.load_checkpoint(ckpt, tag="cut")
    data2 = iter(batches[GAS:])
    for _ in range(STEPS - 1):
        engine2.train_batch(data2)
    resumed = {canonical_name(n): v for n, v in params_of(module2).items()}
    return {"straight": straight, "resumed": resumed}


@pytest.mark.dist
def test_pipeline_checkpoint_round_trip_is_bit_exact(tmp_path):
    """PP=2 x DP=2, tied: save after one step, a fresh engine resumes; both runs end equal
    (each stage checks its own layout: the stages' layouts differ)."""
    res = run_distributed(_resume_worker, 4, 2, str(tmp_path), None)
    for r in res:
        assert_bits(max_abs_diff(r["resumed"], r["straight"]), 0.0)
    assert os.path.isfile(tmp_path / "cut" / "canzona_manifest.json")


def _toy_worker(rank, world, cfg, pp):
    import tests.test_optim_interface  # noqa: F401 - registers the toy rule in this process

    return run_pipe_engine(rank, world, cfg, pp, STEPS)


@pytest.mark.dist
def test_toy_rule_defined_in_a_test_file_runs_under_pipeline():
    """The interface test's toy rule (tests/test_optim_interface.py) under PP=2 x DP=2, exact."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer
    from tests.test_optim_interface import PARAMS

    res = run_distributed(_toy_worker, 4, pipe_config("CanzonaToy", 2, params=PARAMS), 2)
    cfg = CanzonaConfig.from_ds("CanzonaToy", dict(PARAMS))
    ref = run_pipe_reference(STEPS, 2, GAS, lambda named: ReferenceOptimizer(named, cfg), micro=MICRO)["params"]
    assert_bits(max_abs_diff(merge_stages(res), ref), 0.0)


def _disagree_worker(rank, world, cfgs, pp):
    os.environ["CANZONA_AGREEMENT_TIMEOUT"] = "60"
    try:
        run_pipe_engine(rank, world, cfgs[rank], pp, 1)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.dist
def test_pipeline_ranks_with_another_lr_are_refused_naming_it():
    """Stages hold different layers (not an error); a rank with another lr is, named as such,
    and the model is not blamed."""
    cfgs = [pipe_config("CanzonaMuon", 1), pipe_config("CanzonaMuon", 1, params=dict(HP["CanzonaMuon"], lr=0.05))]
    msgs = run_distributed(_disagree_worker, 2, cfgs, 2)
    for m in msgs:
        assert m is not None and "Ranks disagree" in m and "lr (rank 0: 0.02" in m, m
        assert "model parameters" not in m, m


# ---------------------------------------------------------------------------- PP x TP (3D)
TP_FFN = 32


class TPBlock(torch.nn.Module):
    """A Megatron-style MLP block (ColumnParallel fc1, RowParallel fc2) over the stand-in's TP
    group: full weights from a seed, this rank's shards kept."""

    def __init__(self, seed: int) -> None:
        from canzona_testkit import megatron_standin as ms
        from canzona_testkit.models import D

        super().__init__()
        self.fc1 = ms.ColumnParallelLinear(D, TP_FFN)
        self.fc2 = ms.RowParallelLinear(TP_FFN, D)
        g = torch.Generator().manual_seed(seed)
        full1, full2 = torch.randn(TP_FFN, D, generator=g) * 0.3, torch.randn(D, TP_FFN, generator=g) * 0.3
        r, tp = ms.get_tensor_model_parallel_rank(), ms.get_tensor_model_parallel_world_size()
        with torch.no_grad():
            self.fc1.weight.copy_(full1.chunk(tp, 0)[r])
            self.fc2.weight.copy_(full2.chunk(tp, 1)[r])

    def forward(self, h):
        import torch.nn.functional as F

        return h + self.fc2(F.gelu(self.fc1(h)))


def _pp_tp_worker(rank, world, opt_type, pp, tp):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.pipeline import Embedding, Head, dataset, loss_fn, rank_micro_batches

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
    grid = PipelineParallelGrid(topology=topo)  # the stand-in's TP layers use the grid's slice group
    ms._TP_GROUP, ms._TP_SIZE, ms._DP_GROUP = grid.get_slice_parallel_group(), tp, grid.get_data_parallel_group()
    layers = [LayerSpec(Embedding, 0), LayerSpec(TPBlock, 1), LayerSpec(TPBlock, 2),
              LayerSpec(Head, 3)]
    module = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
    cfg = pipe_config(opt_type, 1)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    opt = engine.optimizer.optimizer
    hosted = opt.placement.hosted
    records = []
    stock = hosted.step

    def recorded(held, ctx):
        before = {n: (p.detach().clone(), g.detach().clone()) for n, (p, g) in held.items()}
        stock(held, ctx)
        records.append({n: (b.numpy(), g.numpy(), held[n][0].detach().clone().numpy(), ctx.step, ctx.lr,
                            ctx.weight_decay) for n, (b, g) in before.items()})

    hosted.step = recorded
    x, y = dataset(STEPS * GAS * MICRO, 1)
    data = iter(rank_micro_batches(x, y, 1, 0, MICRO))
    for _ in range(STEPS):
        engine.train_batch(data)
    torch.distributed.barrier()
    return {"groups": opt.groups.degrees, "coords": opt.groups.coordinates, "records": records,
            "split": {n: (m.partition_dim, list(m.full_shape)) for n, m in opt.tp_matrices.items()},
            "hosted": sorted(opt.handled_names())}


@pytest.mark.dist
@pytest.mark.parametrize("opt_type", TYPES)
def test_pipeline_with_tensor_parallel_hosts_whole_matrices(opt_type):
    """Megatron-DeepSpeed's 3D layout at PP=2 x TP=2: each stage's TP-split matrices are updated
    whole on a host of that stage's TP (slice) group, never across stages.  Replayed bit for bit:
    the rule on the concatenated gradient of the two shards, from the shards' own values."""
    import torch

    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optim.rule import MatrixInfo, rule_step

    res = run_distributed(_pp_tp_worker, 4, opt_type, 2, 2)
    rule = CanzonaConfig.from_ds(opt_type, dict(HP[opt_type])).rule
    for r in res:
        assert r["groups"] == {"dp": 1, "tp": 2, "pp": 2, "ep": 1}
        assert len(r["split"]) == 2 and len(r["records"]) == STEPS
    for stage in range(2):
        peers = [r for r in res if r["coords"]["pp"] == stage]
        assert sorted(r["coords"]["tp"] for r in peers) == [0, 1]
        peers.sort(key=lambda r: r["coords"]["tp"])
        assert sorted(n for r in peers for n in r["hosted"]) == sorted(peers[0]["split"])  # one host each
        for name, (dim, full_shape) in peers[0]["split"].items():
            states: dict = {}
            info = MatrixInfo(name, tuple(full_shape))
            for s in range(STEPS):
                parts = [p["records"][s][name] for p in peers]
                W = torch.cat([torch.from_numpy(p[0]) for p in parts], dim=dim)
                G = torch.cat([torch.from_numpy(p[1]) for p in parts], dim=dim)
                after = torch.cat([torch.from_numpy(p[2]) for p in parts], dim=dim)
                step, lr, wd = parts[0][3:]
                rule_step(rule, W, G, states, info, step, lr, wd)
                assert torch.equal(W, after), (stage, name, s)


# ---------------------------------------------------------------------------- another DP size under PP
def _elastic_worker(rank, world, pp, ckpt_in, ckpt_out):
    """ckpt_in None: one step at this size, then save.  Else: load ckpt_in (written at another DP
    size, same PP), save it again at once, then train one more step."""
    from canzona_testkit.pipeline import dataset, rank_micro_batches

    dp = world // pp
    module, engine = _tied_pipe_engine(pp, pipe_config("CanzonaSOAP", dp))
    x, y = dataset(2 * GAS * MICRO * dp, 1)
    data = iter(rank_micro_batches(x, y, dp, module.mpu().get_data_parallel_rank(), MICRO))
    if ckpt_in is None:
        engine.train_batch(data)
    else:
        engine.load_checkpoint(ckpt_in, tag="t")
    engine.save_checkpoint(ckpt_out, tag="t")
    return float(engine.train_batch(data))


def _state(ckpt: str):
    """Every stage's parameters and state by name, read through the checkpoint index."""
    from canzona_testkit.ckpt import read

    return read(ckpt, "t")


def _assert_same_state(a, b) -> None:
    assert set(a.params) == set(b.params) and a.matrix_step == b.matrix_step and a.adam_step == b.adam_step
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    for name, moments in a.adam.items():
        for key, value in moments.items():
            assert torch.equal(value, b.adam[name][key]), (name, key)
    assert set(a.rule_state) == set(b.rule_state)
    for name, state in a.rule_state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b.rule_state[name][key]), (name, key)


@pytest.mark.dist
@pytest.mark.parametrize("sizes", [(4, 2), (2, 4)], ids=["pp2xdp2-to-pp2xdp1", "pp2xdp1-to-pp2xdp2"])
def test_pipeline_resume_at_another_dp_size_moves_every_state(tmp_path, sizes):
    """Each stage resumes from its own files at the new DP size (SOAP: the richest rule state):
    saved again right away, every stage's parameters, AdamW moments and rule state are unchanged,
    and training goes on."""
    before, after = sizes
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run_distributed(_elastic_worker, before, 2, None, first)
    losses = run_distributed(_elastic_worker, after, 2, first, second)
    assert all(np.isfinite(losses))
    _assert_same_state(_state(first), _state(second))


def _replan_worker(rank, world, ckpt, params):
    from canzona_testkit.pipeline import dataset, rank_micro_batches

    # 7 layers over 4 stages: the last stage holds the final norm and the tied head only
    _, engine = _tied_pipe_engine(4, pipe_config("CanzonaMuon", 1, params=params))
    if params is not None:
        return _load_error(engine, ckpt)
    x, y = dataset(GAS * MICRO, 1)
    engine.train_batch(iter(rank_micro_batches(x, y, 1, 0, MICRO)))
    engine.save_checkpoint(ckpt, tag="t")
    return None


@pytest.mark.dist
def test_pipeline_resize_with_a_stage_without_matrices_is_refused_on_every_rank(tmp_path):
    """Another plan (fc2 moved to AdamW) changes fc2's optimizer role: every rank refuses, naming
    the parameter and the role change (the checkpoint index's check, before the index loop that
    a stage running DeepSpeed's own ZeRO, without matrices, could not take); none hangs."""
    run_distributed(_replan_worker, 4, str(tmp_path), None)
    params = dict(HP["CanzonaMuon"], matrix_exclude=["embed", "lm_head", "output_layer", "wte", "wpe", "fc2"])
    msgs = run_distributed(_replan_worker, 4, str(tmp_path), params, timeout=120)
    for m in msgs:
        assert m is not None and "reinit_changed_roles" in m, m
        assert all(f"'{i}.fc2.weight' (matrix -> adamw)" in m for i in range(1, 5)), m  # every stage's, on every rank

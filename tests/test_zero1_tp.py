"""DP x TP through DeepSpeed ZeRO-1: ``deepspeed.initialize(..., mpu=mpu)`` with
``"optimizer": {"type": "CanzonaMuon"}`` and ``"zero_optimization": {"stage": 1}``.

4 processes = DP2 x TP2 on the Megatron stand-in (VocabParallelEmbedding, fused QKV,
row-parallel proj, fused SwiGLU fc1 (stride 2), row-parallel fc2, replicated norms and a
replicated matrix).  The DP plan is made over the TP-local shapes; each DP rank's owned
TP-split matrices go through one TPMuonRuntime on the fp32 master-partition views.

Checks: parameters after 3 steps equal the TP=1 model trained with torch.optim.Muon +
AdamW (same tolerance and reasoning as test_tp_megatron.py); the Muon step issues exactly
the plan's all_to_all_single calls, all on the TP group, nothing on the DP group; a
checkpoint resumes bit-exactly (module weights, ZeRO state and the runtime's host momentum).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import test_tp_megatron as tm
from _dist import run_distributed
from canzona_ds.testing import megatron_standin as ms

TP = 2
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "all_gather_object", "barrier")


def ds_config(**extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,  # the TP=1 reference does not clip
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "CanzonaMuon", "params": {"muon_lr": tm.LR, "adam_lr": tm.ADAM_LR, "momentum": 0.95,
                                                         "weight_decay": tm.WD, "betas": [0.9, 0.95],
                                                         "eps": 1e-10}},
        "canzona_tp": {"scheduler": "lpt_rollback", "pipelined": True},
    }
    cfg.update(extra)
    return cfg


def _engine(cfg):
    import canzona_ds  # noqa: F401
    import deepspeed

    model = ms.TinyGPTBlock(**tm.CFG)
    model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(tm.CFG), tm.CFG, TP,
                                              ms.get_tensor_model_parallel_rank()))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=ms.mpu)
    return engine


class _Count:
    """Collectives issued inside the Muon optimizer step, by op and group ranks."""

    def __init__(self):
        self.calls = []

    def wrap(self, opt):
        import torch.distributed as dist

        inner_step = opt.step

        def step(*a, **k):
            saved = {op: getattr(dist, op) for op in COLLECTIVES}

            def mk(op, fn):
                def f(*args, **kw):
                    g = kw.get("group")
                    self.calls.append((op, tuple(dist.get_process_group_ranks(g)) if g is not None else "world"))
                    return fn(*args, **kw)
                return f

            for op, fn in saved.items():
                setattr(dist, op, mk(op, fn))
            try:
                return inner_step(*a, **k)
            finally:
                for op, fn in saved.items():
                    setattr(dist, op, fn)

        opt.step = step


def _train(engine, steps, dp_rank):
    for s in steps:
        engine.backward(engine(tm.batch(s, dp_rank)).pow(2).mean())
        engine.step()


def _worker(rank, world, ckpt_dir):
    import torch.distributed as dist

    ms.initialize_model_parallel(TP)
    dp_rank = ms.get_data_parallel_rank()
    a = _engine(ds_config())
    inner = a.optimizer.optimizer
    rt = inner.tp_runtime
    count = _Count()
    count.wrap(inner)
    _train(a, [0, 1], dp_rank)
    per_step = len(count.calls) // 2
    calls, total_calls = list(count.calls[:per_step]), len(count.calls)
    a.save_checkpoint(ckpt_dir, tag="s2")
    _train(a, [2], dp_rank)
    sd3 = tm._numpy_sd(a.module)
    _train(a, [3], dp_rank)
    b = _engine(ds_config())
    b.load_checkpoint(ckpt_dir, tag="s2")
    _train(b, [2, 3], dp_rank)
    dist.barrier()
    return {"sd": sd3, "a": tm._numpy_sd(a.module), "b": tm._numpy_sd(b.module),
            "state_a": {k: v.numpy() for k, v in rt.state_dict()["momentum"].items()},
            "state_b": {k: v.numpy() for k, v in b.optimizer.optimizer.tp_runtime.state_dict()["momentum"].items()},
            "calls": calls, "total_calls": total_calls, "expected": rt.expected_collectives(),
            "owned_split": [m.name for m in rt.matrices], "hosted": [rt.matrices[i].name for i in rt.hosted()],
            "tp_ranks": tuple(dist.get_process_group_ranks(ms.get_tensor_model_parallel_group()))}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("ckpt_tp")))


def test_zero1_dp2_tp2_matches_tp1(result):
    tm._check_equal(result, 4, TP, tm._reference(2))
    # shards of one matrix are owned by the same DP index on both TP ranks; the DP indices split the work
    assert result[0]["owned_split"] == result[1]["owned_split"] and result[2]["owned_split"] == result[3]["owned_split"]
    assert set(result[0]["owned_split"]).isdisjoint(result[2]["owned_split"])
    assert set(result[0]["owned_split"]) | set(result[2]["owned_split"]) == {"qkv.weight", "proj.weight", "fc1.weight",
                                                                              "fc2.weight"}


def test_zero1_tp_step_collectives_are_tp_all_to_all_only(result):
    for r in result:
        n = r["expected"].get("all_to_all_single", 0)
        assert r["calls"] == [("all_to_all_single", r["tp_ranks"])] * n, r["calls"]
        assert r["total_calls"] == 2 * n  # two steps, the same calls each
    assert any(r["expected"].get("all_to_all_single", 0) >= 2 for r in result)


def test_zero1_tp_checkpoint_resume_bit_exact(result):
    for r in result:
        for n in r["a"]:
            np.testing.assert_array_equal(r["b"][n], r["a"][n], err_msg=n)
        assert r["state_a"].keys() == r["state_b"].keys()
        for n in r["state_a"]:
            np.testing.assert_array_equal(r["state_b"][n], r["state_a"][n], err_msg=n)
    assert any(r["state_a"] for r in result)  # some rank hosts momentum


def _worker_mixed(rank, world):
    ms.initialize_model_parallel(TP)
    out = {}
    for key, extra in (("bf16", {}), ("fp16", {"initial_scale_power": 8})):  # scale 2^8: no skipped step
        e = _engine(ds_config(**{key: dict(enabled=True, **extra)}))
        _train(e, range(tm.STEPS), ms.get_data_parallel_rank())
        out[key] = {n: p.detach().float().numpy() for n, p in e.module.named_parameters()}
    return out


def test_zero1_tp_bf16_fp16():
    """Mixed precision: the fp32 master partitions are what the TP runtime updates, so bf16 and
    fp16 work unchanged.  Muon matrices' 3-step update within 15% of the fp32 TP=1 reference
    (measured <= 11% bf16, <= 6% fp16); the AdamW params are not compared (their 1e-3 updates
    are below bf16's spacing near 1.0 in the module copy)."""
    res = run_distributed(_worker_mixed, 4)
    ref, init = tm._reference(2), ms.init_full_state_dict(tm.CFG)
    for key in ("bf16", "fp16"):
        got = ms.unshard_state_dict([{n: torch.from_numpy(a) for n, a in res[r][key].items()} for r in range(TP)],
                                    tm.CFG)
        for n in ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight", "mix.weight"):
            d, u = got[n] - init[n], ref[n] - init[n]
            assert (d - u).norm() / u.norm() < 0.15, (key, n)
        for r in range(4):  # DP replicas identical, replicated params identical across TP
            for n, a in res[r][key].items():
                assert (a == res[r % TP][key][n]).all(), (key, r, n)
                if n in ("norm1", "norm2", "mix.weight"):
                    assert (a == res[0][key][n]).all(), (key, r, n)


# ---------------------------------------------------------------- Megatron-DeepSpeed hook, stage 1
#: a fake Megatron-DeepSpeed tree with the real module names and the control flow of
#: megatron/training.py setup_model_and_optimizer (optimizer -> scheduler against it ->
#: deepspeed.initialize(model=model[0], optimizer=, args=, lr_scheduler=, mpu=, config=)).
#: The scheduler is written here (cosine decay, no warmup), with Megatron's step(increment)
#: contract: group['lr'] = lr * group.get('lr_mult', 1), group['weight_decay'] = wd * wd_mult.
FAKE_MEGATRON = {
    "megatron/__init__.py": "_ARGS = None\ndef get_args():\n    return _ARGS\n",
    "megatron/core/__init__.py": "from canzona_ds.testing.megatron_standin import mpu\n",
    "megatron/optimizer/__init__.py": "def get_megatron_optimizer(model, *a, **k):\n    raise AssertionError('not patched')\n",
    "megatron/optimizer_param_scheduler.py": '''import math
class OptimizerParamScheduler:
    def __init__(self, optimizer, max_lr, min_lr, decay_steps, wd):
        self.optimizer, self.max_lr, self.min_lr, self.decay_steps, self.wd = optimizer, max_lr, min_lr, decay_steps, wd
        self.num_steps = 0
        self.step(0)
    def get_lr(self):
        c = 0.5 * (1 + math.cos(math.pi * min(self.num_steps, self.decay_steps) / self.decay_steps))
        return self.min_lr + (self.max_lr - self.min_lr) * c
    def step(self, increment):
        self.num_steps += increment
        lr = self.get_lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
            g["weight_decay"] = self.wd * g.get("wd_mult", 1.0)
''',
    "megatron/training.py": '''import deepspeed
from megatron import get_args
from megatron.core import mpu
from megatron.optimizer import get_megatron_optimizer
from megatron.optimizer_param_scheduler import OptimizerParamScheduler

def get_optimizer_param_scheduler(optimizer):
    a = get_args()
    return OptimizerParamScheduler(optimizer, a.lr, a.min_lr, a.lr_decay_iters, a.weight_decay)

def setup_model_and_optimizer(model_provider_func):
    args = get_args()
    model = [model_provider_func()]
    optimizer = get_megatron_optimizer(model)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    model, optimizer, _, opt_param_scheduler = deepspeed.initialize(
        model=model[0], optimizer=optimizer, args=args, lr_scheduler=opt_param_scheduler,
        mpu=mpu if args.no_pipeline_parallel else None, config=args.deepspeed_config_dict)
    return [model], optimizer, opt_param_scheduler
''',
    # what the test runs through launch/megatron_pretrain_gpt.py
    "pretrain_gpt.py": '''import json, sys, types
import megatron
import test_zero1_tp as t
from canzona_ds.testing import megatron_standin as ms
cfg = json.load(open(sys.argv[sys.argv.index("--deepspeed_config") + 1]))
megatron._ARGS = types.SimpleNamespace(deepspeed_config=None, deepspeed_config_dict=cfg, no_pipeline_parallel=True,
                                       lr=t.tm.LR, min_lr=t.HOOK_MIN_LR, lr_decay_iters=t.HOOK_DECAY, weight_decay=t.tm.WD)
from megatron import training
ms.initialize_model_parallel(t.TP)
model, optimizer, sched = training.setup_model_and_optimizer(t._stage1_model)
megatron.RESULT = t._stage1_train(model[0], optimizer, sched)
''',
}
HOOK_MIN_LR, HOOK_DECAY = 0.002, 4


def _stage1_model():
    model = ms.TinyGPTBlock(**tm.CFG)
    model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(tm.CFG), tm.CFG, TP,
                                              ms.get_tensor_model_parallel_rank()))
    return model


def _stage1_train(engine, optimizer, sched):
    from canzona_ds.integration.deepspeed_zero1 import CanzonaMuon

    inner = engine.optimizer.optimizer
    lrs, wds = [], []
    for s in range(tm.STEPS):
        lrs.append([g["lr"] for g in inner.param_groups])
        wds.append(inner.tp_runtime.config.weight_decay)
        engine.backward(engine(tm.batch(s, ms.get_data_parallel_rank())).pow(2).mean())
        engine.step(lr_kwargs={"increment": 1})  # as Megatron-DeepSpeed's train_step
    return {"sd": tm._numpy_sd(engine.module), "lrs": lrs, "wds": wds, "sched_steps": sched.num_steps,
            "types": [type(inner).__name__, type(engine.optimizer).__name__, isinstance(inner, CanzonaMuon)],
            "roles": [g["canzona_role"] for g in inner.param_groups], "ret_is_engine_opt": optimizer is engine.optimizer}


def _worker_hook_stage1(rank, world, root):
    import os
    import runpy
    import sys

    sys.path[:0] = [root, os.path.dirname(__file__)]
    cfg_path = os.path.join(root, "ds.json")
    shim = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch/megatron_pretrain_gpt.py")
    sys.argv = [shim, os.path.join(root, "pretrain_gpt.py"), "--deepspeed", "--deepspeed_config", cfg_path]
    runpy.run_path(shim, run_name="__main__")
    import megatron

    return {**megatron.RESULT, "refusals": _refusals()}


def _hook_lr(n: int) -> float:
    import math

    return HOOK_MIN_LR + (tm.LR - HOOK_MIN_LR) * 0.5 * (1 + math.cos(math.pi * min(n, HOOK_DECAY) / HOOK_DECAY))


def _reference_scheduled(dp: int) -> dict:
    """TP=1 torch.optim.Muon + AdamW with the same lr schedule (AdamW lr scaled adam_lr/muon_lr)."""
    torch.set_num_threads(1)
    from canzona_ds.planning.params import default_is_matrix

    model = ms.TinyGPTBlock(**tm.CFG)
    model.load_state_dict(ms.init_full_state_dict(tm.CFG))
    mats = [p for n, p in model.named_parameters() if default_is_matrix(n, tuple(p.shape))]
    aux = [p for n, p in model.named_parameters() if not default_is_matrix(n, tuple(p.shape))]
    muon = torch.optim.Muon(mats, lr=tm.LR, weight_decay=tm.WD, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW(aux, lr=tm.ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=tm.WD)
    for s in range(tm.STEPS):
        muon.param_groups[0]["lr"] = _hook_lr(s)
        adamw.param_groups[0]["lr"] = _hook_lr(s) * tm.ADAM_LR / tm.LR
        model.zero_grad()
        model(torch.cat([tm.batch(s, d) for d in range(dp)])).pow(2).mean().backward()
        muon.step()
        adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def hook_result(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("fake_megatron")
    for rel, text in FAKE_MEGATRON.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    cfg = ds_config()
    cfg["optimizer"]["params"]["weight_decay"] = 0.0  # overridden by Megatron's scheduler
    (root / "ds.json").write_text(json.dumps(cfg))
    return run_distributed(_worker_hook_stage1, 4, str(root))


def test_megatron_hook_stage1_routes_to_zero1_tp(hook_result):
    """launch/megatron_pretrain_gpt.py + a fake Megatron-DeepSpeed (real module names and
    setup_model_and_optimizer control flow), ds_config CanzonaMuon at ZeRO stage 1, DP2 x TP2:
    deepspeed.initialize got no client optimizer (the engine's is CanzonaZeroOneOptimizer over
    CanzonaMuon), Megatron's scheduler drives the lr (cosine, 3 steps) and weight decay (ds_config
    says 0, Megatron says WD: the TP runtime follows Megatron), parameters equal the scheduled
    TP=1 reference."""
    res = hook_result
    tm._check_equal(res, 4, TP, _reference_scheduled(2))
    for r in res:
        assert r["types"] == ["CanzonaMuon", "CanzonaZeroOneOptimizer", True] and r["ret_is_engine_opt"]
        assert r["sched_steps"] == tm.STEPS
        assert r["wds"] == [tm.WD] * tm.STEPS
        mult = {"matrix": 1.0, "aux": tm.ADAM_LR / tm.LR}
        for s, lrs in enumerate(r["lrs"]):
            assert lrs == pytest.approx([_hook_lr(s) * mult[role] for role in r["roles"]], rel=1e-12)
    assert len({round(r["lrs"][s][0], 9) for s in range(tm.STEPS) for r in res[:1]}) == tm.STEPS  # lr changes


def _refusals():
    """After the hook run (DP2 x TP2): a DP plan that differs on one TP rank, and non-default
    NS settings under TP, each through deepspeed.initialize(..., mpu=mpu)."""
    out = {}
    cfg = ds_config()
    if ms.get_tensor_model_parallel_rank() == 1:  # one TP rank plans with another planner
        cfg["optimizer"]["params"]["planner"] = "lpt"
    try:
        _engine(cfg)
        out["plan"] = None
    except ValueError as e:
        out["plan"] = str(e)
    for key, val in (("ns_coefficients", [3.0, -4.0, 2.0]), ("ns_eps", 1e-6)):
        cfg = ds_config()
        cfg["optimizer"]["params"][key] = val
        try:
            _engine(cfg)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def test_zero1_tp_refusals_are_clear_errors_not_hangs(hook_result):
    for r in (h["refusals"] for h in hook_result):  # every rank raises (the fingerprints are all-gathered, then compared)
        assert r["plan"] is not None and "CanzonaMuon DP ownership plan" in r["plan"], r["plan"]
        assert "differs across the group" in r["plan"]
        for key in ("ns_coefficients", "ns_eps"):
            assert r[key] is not None and "supports only the default ns_coefficients and ns_eps" in r[key], r[key]

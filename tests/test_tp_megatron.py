"""End to end on the Megatron stand-in: a TP (and DP x TP) model trained with the TP
runtime equals the same model at TP=1 trained with torch.optim.Muon + AdamW.

The TP=1 reference holds fused weights in the normal layout ([q; k; v], [gate; up]);
the TP ranks hold Megatron's per-rank layout.  Forward/backward at TP=2 differs from
TP=1 by fp32 summation order (row-parallel all-reduce) and Newton-Schulz runs in bf16,
so the comparison uses the state tolerance below; the optimizer-level bit-exact proofs
are in test_tp_runtime.py.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from canzona_ds.testing import megatron_standin as ms

CFG = dict(vocab=64, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48)
STEPS, LR, ADAM_LR, WD = 3, 0.02, 1e-3, 0.01
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 0},
    "optimizer": {"type": "CanzonaMuon", "params": {"muon_lr": LR, "adam_lr": ADAM_LR, "momentum": 0.95,
                                                     "weight_decay": WD}},
    "canzona_tp": {"scheduler": "lpt_rollback", "pipelined": True},
}
#: fp32 forward/backward reordering, amplified by bf16 Newton-Schulz and Adam's
#: normalisation over STEPS steps; shard-local Muon misses by > 10x this.
STATE_TOL = 3e-3


def batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randint(0, CFG["vocab"], (2, 8), generator=g)


def _numpy_sd(model) -> dict:
    return {n: p.detach().clone().numpy() for n, p in model.named_parameters()}


def _worker_hook(rank, world, tp, strategy="asc"):
    """TP=tp, DP=world/tp, optimizer built through the Megatron-DeepSpeed hook."""
    ms.initialize_model_parallel(tp)
    groups_rank = ms.get_tensor_model_parallel_rank()
    model = ms.TinyGPTBlock(**CFG)
    model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(CFG), CFG, tp, groups_rank))
    # the stand-in of megatron.training / megatron.get_args
    original = lambda model, *a, **k: "megatron's own optimizer"  # noqa: E731
    training = types.SimpleNamespace(get_megatron_optimizer=original)
    args = types.SimpleNamespace(deepspeed_config_dict=dict(DS_CONFIG, canzona_tp=dict(DS_CONFIG["canzona_tp"], strategy=strategy)))
    from canzona_ds.integration.megatron import patch_megatron_training

    patch_megatron_training(training, get_args=lambda: args, mpu=ms.mpu)
    opt = training.get_megatron_optimizer([model])
    dp_group, dp_size = ms.get_data_parallel_group(), ms.get_data_parallel_world_size()
    counts = []
    for s in range(STEPS):
        opt.zero_grad()
        model(batch(s, ms.get_data_parallel_rank())).pow(2).mean().backward()
        for p in model.parameters():  # what DeepSpeed's engine does at ZeRO stage 0
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp_size)
        opt.step()
        counts.append(dict(opt.runtime.stats.collectives))
    return {"sd": _numpy_sd(model), "counts": counts, "expected": opt.runtime.expected_collectives(),
            "matrices": opt.matrix_names, "aux": opt.aux_names}


def _worker_dp_tp_owned(rank, world, tp):
    """DP x TP with a DP ownership plan (ZeRO-1 style): each DP index runs the TP runtime
    over the matrices it owns, then owners broadcast their updated shards over DP."""
    from canzona_ds.integration.megatron import groups_from_mpu
    from canzona_ds.planning import plan_dp
    from canzona_ds.planning.params import specs_from_module
    from canzona_ds.tp import TPMatrix, TPMuonConfig, TPMuonRuntime, verify_same_across_group

    ms.initialize_model_parallel(tp)
    g = groups_from_mpu(ms.mpu)
    model = ms.TinyGPTBlock(**CFG)
    model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(CFG), CFG, tp, g.tp_rank))
    params = dict(model.named_parameters())
    specs = [s for s in specs_from_module(model) if s.is_matrix]
    dp_plan = plan_dp(specs, g.dp_size)
    verify_same_across_group(dp_plan.fingerprint(), g.tp_group, what="DP ownership plan")
    # the check must catch a plan that differs on one TP rank
    try:
        verify_same_across_group(dp_plan.fingerprint() + ("x" if g.tp_rank == 1 else ""), g.tp_group, "DP plan")
        caught = False
    except ValueError:
        caught = True
    owned = [specs[i].name for i in dp_plan.rank_params[g.dp_rank]]
    rt = TPMuonRuntime([TPMatrix.from_param(n, params[n], g.tp_size) for n in owned], g.tp_group,
                       TPMuonConfig(lr=LR, weight_decay=WD, pipelined=True))
    aux = [p for n, p in params.items() if n not in {s.name for s in specs}]
    adamw = torch.optim.AdamW(aux, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=WD)
    dp_ranks = [r for r in range(world) if r % tp == rank % tp]  # Megatron layout: DP stride tp
    for s in range(STEPS):
        model.zero_grad()
        model(batch(s, g.dp_rank)).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=g.dp_group)
            p.grad.div_(g.dp_size)
        with torch.no_grad():
            rt.step([params[n] for n in owned], [params[n].grad for n in owned])
            adamw.step()
            for i, spec in enumerate(dp_plan.specs):
                dist.broadcast(params[spec.name], src=dp_ranks[dp_plan.owner[i]], group=g.dp_group)
    return {"sd": _numpy_sd(model), "caught": caught, "owned": owned, "hosted": [rt.matrices[i].name for i in rt.hosted()]}


def _reference(dp: int) -> dict:
    torch.set_num_threads(1)
    model = ms.TinyGPTBlock(**CFG)
    model.load_state_dict(ms.init_full_state_dict(CFG))
    from canzona_ds.planning.params import default_is_matrix

    mats = [p for n, p in model.named_parameters() if default_is_matrix(n, tuple(p.shape))]
    aux = [p for n, p in model.named_parameters() if not default_is_matrix(n, tuple(p.shape))]
    muon = torch.optim.Muon(mats, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW(aux, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=WD)
    for s in range(STEPS):
        model.zero_grad()
        ids = torch.cat([batch(s, d) for d in range(dp)])
        model(ids).pow(2).mean().backward()
        muon.step()
        adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assemble(results, tp: int) -> dict:
    shard_sds = [{n: torch.from_numpy(a) for n, a in results[r]["sd"].items()} for r in range(tp)]
    return ms.unshard_state_dict(shard_sds, CFG)


def _check_equal(results, world, tp, ref):
    for dp_idx in range(world // tp):
        got = _assemble(results[dp_idx * tp:(dp_idx + 1) * tp], tp)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=STATE_TOL, msg=f"dp {dp_idx}: {n}")
    # DP replicas end identical; replicated params are identical across TP ranks
    for r in range(world):
        for n, a in results[r]["sd"].items():
            assert (a == results[r % tp]["sd"][n]).all(), (r, n)
            if n in ("norm1", "norm2", "mix.weight"):
                assert (a == results[0]["sd"][n]).all(), (r, n)


def test_tp2_megatron_hook_matches_tp1():
    res = run_distributed(_worker_hook, 2, 2)
    assert res[0]["matrices"] == ["qkv.weight", "proj.weight", "fc1.weight", "fc2.weight", "mix.weight"]
    assert set(res[0]["aux"]) == {"embed.weight", "norm1", "norm2"}
    for r in range(2):
        assert res[r]["expected"]["all_to_all_single"] >= 2
        assert all(c == res[r]["expected"] for c in res[r]["counts"])
    _check_equal(res, 2, 2, _reference(1))


def test_dp2_tp2_owned_matrices_match_tp1():
    res = run_distributed(_worker_dp_tp_owned, 4, 2)
    assert all(r["caught"] for r in res)
    # DP ownership: shards of one matrix sit on the same DP index on both TP ranks
    assert res[0]["owned"] == res[1]["owned"] and res[2]["owned"] == res[3]["owned"]
    assert set(res[0]["owned"]).isdisjoint(res[2]["owned"])
    _check_equal(res, 4, 2, _reference(2))


def test_hook_falls_back_and_rejects_zero():
    from canzona_ds.integration.megatron import build_tp_optimizer, patch_megatron_training, tp_config_from_ds_config

    training = types.SimpleNamespace(get_megatron_optimizer=lambda model, *a, **k: "orig")
    args = types.SimpleNamespace(deepspeed_config_dict={"optimizer": {"type": "Adam"}})
    orig = patch_megatron_training(training, get_args=lambda: args, mpu=ms.mpu)
    assert training.get_megatron_optimizer(None) == "orig" and orig(None) == "orig"
    assert patch_megatron_training(training, get_args=lambda: args, mpu=ms.mpu) is orig  # idempotent
    bad = dict(DS_CONFIG, zero_optimization={"stage": 1})
    with pytest.raises(ValueError, match="zero_optimization.stage=1"):
        build_tp_optimizer(None, bad, mpu=ms.mpu)
    # stage 1 through the hook: a placeholder; the wrapped deepspeed.initialize passes other calls through
    from canzona_ds.integration.megatron import DeferredCanzonaMuon

    fake_ds = types.SimpleNamespace(initialize=lambda **k: ("stock", k))
    training = types.SimpleNamespace(get_megatron_optimizer=lambda model, *a, **k: "orig", deepspeed=fake_ds)
    args = types.SimpleNamespace(deepspeed_config_dict=bad)
    patch_megatron_training(training, get_args=lambda: args, mpu=ms.mpu)
    ph = training.get_megatron_optimizer([None])
    assert isinstance(ph, DeferredCanzonaMuon)
    with pytest.raises(RuntimeError, match="placeholder"):
        ph.step()
    assert fake_ds.initialize(model=1, optimizer="x") == ("stock", {"model": 1, "optimizer": "x"})
    with pytest.raises(ValueError, match="--no-pipeline-parallel"):
        fake_ds.initialize(model=1, optimizer=ph, mpu=None)
    args.deepspeed_config_dict = dict(DS_CONFIG, zero_optimization={"stage": 2})
    with pytest.raises(ValueError, match="stages 2 and 3 are not supported"):
        training.get_megatron_optimizer([None])
    with pytest.raises(ValueError, match="c_mx"):
        tp_config_from_ds_config(dict(DS_CONFIG, canzona_tp={"c_mx": 5}))


def test_shard_local_muon_misses_tp1_by_far_more_than_tolerance():
    """DeepSpeed-AutoTP-style shard-local Muon: the tolerance above must reject it."""
    res = run_distributed(_worker_hook, 2, 2, "local")
    got, ref = _assemble(res, 2), _reference(1)
    dev = max((got[n] - ref[n]).abs().max().item() for n in ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))
    assert dev > 3 * STATE_TOL


def test_launch_shim_patches_real_import_path(tmp_path):
    """launch/megatron_pretrain_gpt.py against a fake Megatron-DeepSpeed tree with the real
    module names (megatron.training.get_megatron_optimizer, megatron.get_args, megatron.core.mpu)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # the shipped config (ZeRO stage 1 -> tests/test_zero1_tp.py) at stage 0: the TPMuon route
    stage0 = tmp_path / "ds_stage0.json"
    stage0.write_text(json.dumps(dict(json.loads((root / "configs/ds_megatron_tp.json").read_text()),
                                      zero_optimization={"stage": 0})))
    meg = tmp_path / "megatron"
    (meg / "core").mkdir(parents=True)
    (meg / "__init__.py").write_text(
        "import types\n"
        f"_args = types.SimpleNamespace(deepspeed_config={str(stage0)!r})\n"
        "def get_args():\n    return _args\n")
    (meg / "training.py").write_text("import types\ndeepspeed = types.SimpleNamespace(initialize=None)\n"
                                     "def get_megatron_optimizer(model, *a, **k):\n    return 'megatron-own'\n")
    (meg / "core" / "__init__.py").write_text(
        "class mpu:\n"
        "    get_tensor_model_parallel_group = staticmethod(lambda: None)\n"
        "    get_tensor_model_parallel_rank = staticmethod(lambda: 0)\n"
        "    get_tensor_model_parallel_world_size = staticmethod(lambda: 1)\n"
        "    get_data_parallel_group = staticmethod(lambda: None)\n"
        "    get_data_parallel_rank = staticmethod(lambda: 0)\n"
        "    get_data_parallel_world_size = staticmethod(lambda: 1)\n")
    out = tmp_path / "out.json"
    (tmp_path / "pretrain_gpt.py").write_text(
        "import json, sys\n"
        "from megatron import training\n"
        "from canzona_ds.testing.megatron_standin import TinyGPTBlock\n"
        "opt = training.get_megatron_optimizer([TinyGPTBlock()])\n"
        f"json.dump({{'type': type(opt).__name__, 'mult': [g['lr_mult'] for g in opt.param_groups],"
        f" 'argv': sys.argv[1:]}}, open({str(out)!r}, 'w'))\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, str(root / "launch/megatron_pretrain_gpt.py"), str(tmp_path / "pretrain_gpt.py"),
                    "--foo", "1"], check=True, env=env, cwd=tmp_path, timeout=120)
    got = json.loads(out.read_text())
    assert got["type"] == "TPMuon" and got["argv"] == ["--foo", "1"]
    assert got["mult"] == pytest.approx([1.0, 3e-4 / 0.02])

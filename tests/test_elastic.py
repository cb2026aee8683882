"""Elastic resume: save at DP=N, resume at DP=M (both directions, M=1 included) through the plain
``engine.load_checkpoint``, every matrix's state following it.

Two checks per case:
  * lossless: the checkpoint re-read from the engine right after loading at M (saved again,
    nothing stepped) equals the one written at N, parameter by parameter and state by state,
    bit for bit (``canzona_testkit.ckpt.read`` gives both by whole-model name, through the index);
  * exact continuation: the resumed run equals the single-process reference that saw N-rank
    batches before the checkpoint and M-rank batches after; bit for bit where both sides
    average over at most 2 ranks (fp32), within the reordered-sum bound for Muon when a 4-rank sum is involved
    (gloo's summation order), and the replayed rule updates bit for bit for every rule.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, batches, ds_config, make_model, muon_reordered_sum_tolerance, params_of, run_engine

BEFORE, AFTER, MICRO = 3, 3, 2


def _data(dp: int, steps: int, seed: int) -> list:
    return batches(steps, MICRO * dp, seed=seed)


def _save(rank, dp, ckpt, opt_type, stage):
    params, _, engine = run_engine(rank, dp, ds_config(dp, optimizer=opt_type, stage=stage), BEFORE,
                                   data=_data(dp, BEFORE, 1))
    engine.save_checkpoint(ckpt, tag="before")
    return params


def _resume(rank, dp, ckpt, opt_type, stage):
    from canzona_testkit.models import MatrixStepRecorder

    _, _, engine = run_engine(rank, dp, ds_config(dp, optimizer=opt_type, stage=stage), 0)
    path, client = engine.load_checkpoint(ckpt, tag="before")
    engine.save_checkpoint(ckpt, tag="reloaded")  # what the engine holds right after loading
    recorder = MatrixStepRecorder(engine.optimizer.optimizer)
    step_before = engine.optimizer.optimizer.param_groups[0]["step"]
    data = _data(dp, AFTER, 2)
    for x, y in data:
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(x, y))
        engine.step()
    return dict(params=params_of(engine.module), step_before=step_before, replay=recorder.replay(),
                global_steps=engine.global_steps, path=path)


def _reference(n: int, m: int, opt_type: str) -> dict:
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer
    from canzona_testkit.models import reference_grads

    torch.set_num_threads(1)
    model = make_model(0)
    opt = ReferenceOptimizer(model.named_parameters(), CanzonaConfig.from_ds(opt_type, HP[opt_type]))
    for dp, data in ((n, _data(n, BEFORE, 1)), (m, _data(m, AFTER, 2))):
        for x, y in data:
            grads = reference_grads(model, [x], [y], dp, MICRO)
            for name, p in model.named_parameters():
                p.grad = grads[name]
            opt.step()
    return params_of(model)


def _assert_lossless(ckpt: str) -> None:
    from canzona_testkit.ckpt import read

    a, b = read(ckpt, "before"), read(ckpt, "reloaded")
    assert a.source["dp"] != b.source["dp"]
    assert a.params.keys() == b.params.keys() and a.rule_state.keys() == b.rule_state.keys()
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    for name in a.adam:
        for k in a.adam[name]:
            assert torch.equal(a.adam[name][k], b.adam[name][k]), (name, k)
    for name, st in a.rule_state.items():
        assert st.keys() == b.rule_state[name].keys(), name
        for k, v in st.items():
            assert torch.equal(v, b.rule_state[name][k]), (name, k)
    assert (a.matrix_step, a.adam_step) == (b.matrix_step, b.adam_step)


#: the 4-rank resizes; DP 2 <-> 1 at stage 1 and 2 are rows of the scenario table
#: (tests/test_ckpt_resume.py), which also continues bit for bit with clipping
CASES = [(4, 2, "CanzonaMuon", 1), (2, 4, "CanzonaSOAP", 1), (2, 4, "CanzonaMuon", 2)]


@pytest.mark.parametrize("n,m,opt_type,stage", CASES, ids=[f"{t}-dp{n}to{m}-stage{s}" for n, m, t, s in CASES])
def test_resume_at_another_dp(tmp_path, n, m, opt_type, stage):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save, n, ckpt, opt_type, stage)
    res = run_distributed(_resume, m, ckpt, opt_type, stage)
    _assert_lossless(ckpt)
    ref = _reference(n, m, opt_type)
    for r in res:
        assert r["step_before"] == BEFORE and r["global_steps"] == BEFORE + AFTER
        assert r["replay"] == 0.0
    dev = max(float(np.abs(res[0]["params"][k] - ref[k]).max()) for k in ref)
    print(f"{opt_type} DP {n} -> {m}: max |param - reference| = {dev:.3g}")
    if max(n, m) <= 2:
        for k in ref:
            np.testing.assert_array_equal(res[0]["params"][k], ref[k], err_msg=k)
    elif opt_type == "CanzonaMuon":  # 4-rank sums: another association (muon_reordered_sum_tolerance)
        assert dev <= muon_reordered_sum_tolerance(BEFORE + AFTER), dev


def test_offline_converter_round_trip(tmp_path):
    """`canzona-ckpt convert` writes the weights by name (safetensors) and every state by name:
    the weights of the DP=2 run, bit for bit."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "conv")
    saved = run_distributed(_save, 2, ckpt, "CanzonaMuon", 1)[0]
    proc = subprocess.run([sys.executable, "-m", "canzona_ds.cli.ckpt", "convert", ckpt, out, "--tag", "before"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DP=2 TP=1" in proc.stdout
    weights = load_file(str(tmp_path / "conv" / "model.safetensors"))
    for k in saved:
        np.testing.assert_array_equal(weights[k].numpy(), saved[k], err_msg=k)


def test_converter_errors_name_the_problem(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "canzona_ds.cli.ckpt", "convert", str(tmp_path), str(tmp_path / "o"),
                           "--tag", "nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nope" in proc.stderr


# ------------------------------------------------------------------------------ memory
def _resume_counting(rank, dp, ckpt):
    """Load through the checkpoint index and count what this rank copied out of the files."""
    from canzona_ds.integration import ckpt_fill, ckpt_index
    from canzona_ds.integration.runtime_info import canzona_optimizer

    _, _, engine = run_engine(rank, dp, ds_config(dp), 0)
    folder = os.path.join(ckpt, "before")
    src = ckpt_index.IndexSource(folder, ckpt_index.read_index(folder))
    opened = src.reader.elements_read
    ckpt_fill.fill_zero12(engine, src)
    zopt, opt = engine.optimizer, canzona_optimizer(engine)
    share = 0  # what this rank holds in the new layout: fp32 master, AdamW moments, rule state
    for i, group in enumerate(opt.param_groups):
        flat = zopt.single_partition_of_fp32_groups[i]
        if group["canzona_role"] == "matrix":
            share += sum(v.numel for v in opt.placement.views[id(flat)])
            continue
        lo, hi = rank * zopt.partition_size[i], (rank + 1) * zopt.partition_size[i]
        held = sum(max(0, min(off + p.numel(), hi) - max(off, lo))
                   for p, off in zip(zopt.round_robin_bit16_groups[i], zopt.round_robin_bit16_offsets[i]))
        share += 3 * held  # master, exp_avg, exp_avg_sq
    share += sum(v.numel() for st in opt.matrix_state.values() for v in st.values() if torch.is_tensor(v))
    return dict(opened=opened, read=src.reader.elements_read, share=share, params=params_of(engine.module))


def test_each_rank_reads_only_its_share(tmp_path):
    """Resuming DP 2 -> 4 through the checkpoint index, a rank copies out of the checkpoint
    exactly the elements it holds in the new layout (its matrices, its AdamW range and moments,
    its matrices' rule state), none when the files are opened; the four shares together are the
    checkpoint (every chunk of its index), read once."""
    from canzona_ds.ckpt import Index

    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, ckpt, "CanzonaMuon", 1)[0]
    res = run_distributed(_resume_counting, 4, ckpt)
    total = sum(c.length for c in Index.read(os.path.join(ckpt, "before")).chunks)  # every element, once
    for r in res:
        assert r["opened"] == 0
        assert r["read"] == r["share"] and 0 < r["read"] < total / 2, (r["read"], r["share"], total)
    print("elements read per rank", [r["read"] for r in res], "checkpoint", total)
    assert sum(r["read"] for r in res) == total
    for k in saved:
        np.testing.assert_array_equal(res[3]["params"][k], saved[k], err_msg=k)


# ------------------------------------------------------------------------------ DP x TP
TP_CFG = dict(vocab=64, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48)
TP_PARAMS = {"CanzonaMuon": {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01},
             "CanzonaSOAP": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01, "precondition_frequency": 2},
             # blocks of 16 rows cut the fused qkv and fc1 differently at TP=2 and TP=1
             "CanzonaShampoo": {"lr": 0.02, "adam_lr": 1e-3, "precondition_frequency": 2,
                                "start_preconditioning_step": 2, "max_preconditioner_dim": 16}}


def _tp_batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randint(0, TP_CFG["vocab"], (2, 16), generator=g)


def _tp_engine(tp: int, opt_type: str):
    import canzona_ds  # noqa: F401
    import deepspeed

    from canzona_testkit import megatron_standin as ms

    ms.initialize_model_parallel(tp)
    model = ms.TinyGPTBlock(**TP_CFG)
    model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(TP_CFG), TP_CFG, tp,
                                              ms.get_tensor_model_parallel_rank()))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
           "optimizer": {"type": opt_type, "params": TP_PARAMS[opt_type]}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=ms.mpu)
    return engine, ms


def _tp_train(engine, ms, steps: range) -> None:
    for s in steps:
        engine.backward(engine(_tp_batch(s, ms.get_data_parallel_rank())).pow(2).mean())
        engine.step()


def _tp_save(rank, world, ckpt, opt_type):
    engine, ms = _tp_engine(2, opt_type)
    _tp_train(engine, ms, range(2))
    engine.save_checkpoint(ckpt, tag="before")
    return ms.get_data_parallel_world_size()


def _tp_resume(rank, world, ckpt, opt_type):
    from test_ckpt_resume import _index_route_only

    _index_route_only()  # TP 2 -> 1 goes through the checkpoint index (TP shard frames)
    engine, ms = _tp_engine(1, opt_type)
    try:
        engine.load_checkpoint(ckpt, tag="before")
    except ValueError as err:
        return {"error": str(err)}
    engine.save_checkpoint(ckpt, tag="reloaded")
    _tp_train(engine, ms, range(2, 4))
    return {"error": None, "sd": {n: p.detach().numpy().copy() for n, p in engine.module.named_parameters()},
            "dp": ms.get_data_parallel_world_size()}


@pytest.mark.parametrize("opt_type", ["CanzonaMuon", "CanzonaSOAP"])
def test_dp2_tp2_to_dp4_tp1(tmp_path, opt_type):
    """The fused qkv ([q; k; v] per TP rank) and fc1 ([gate; up], partition_stride 2) reach TP=1
    through their TP-layout permutation; hosted rule state (SOAP's factors and eigenbases
    included) follows it exactly."""
    ckpt = str(tmp_path / "ckpt")
    assert run_distributed(_tp_save, 4, ckpt, opt_type)[0] == 2
    res = run_distributed(_tp_resume, 4, ckpt, opt_type)
    assert all(r["error"] is None for r in res), res[0]["error"]
    assert res[0]["dp"] == 4
    _assert_lossless(ckpt)
    from canzona_testkit.ckpt import read

    uni = read(ckpt, "before")
    assert (uni.source["dp"], uni.source["tp"]) == (2, 2), uni.source
    assert uni.params["qkv.weight"].shape == (64, 32) and uni.params["fc1.weight"].shape == (96, 32)
    # the TP=1 weights the resumed run started from are the TP=1 layout of the saved shards
    from canzona_testkit import megatron_standin as ms

    assert set(uni.rule_state) == set(MATRICES_TP)
    for r in res[1:]:
        for n in r["sd"]:
            np.testing.assert_array_equal(r["sd"][n], res[0]["sd"][n], err_msg=n)  # replicas agree
    del ms


MATRICES_TP = ["qkv.weight", "proj.weight", "fc1.weight", "fc2.weight", "mix.weight"]


def test_tp_change_refuses_state_that_cannot_follow(tmp_path):
    """Blocked Shampoo factors of a fused layout cannot be permuted into another TP size: refused
    by name, on every rank, without a hang."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_tp_save, 4, ckpt, "CanzonaShampoo")
    res = run_distributed(_tp_resume, 4, ckpt, "CanzonaShampoo")
    for r in res:
        msg = r["error"]
        assert msg is not None and "tensor-parallel size" in msg and ("'qkv.weight'" in msg or "'fc1.weight'" in msg), r


def _tp_load(rank, world, ckpt, tp):
    engine, ms = _tp_engine(tp, "CanzonaMuon")
    try:
        engine.load_checkpoint(ckpt, tag="before")
    except ValueError as err:
        return str(err)
    return None


def test_pre_index_tp_tag_resumes_at_its_size_and_refuses_another_by_name(tmp_path):
    """A TP=2 tag as written before the checkpoint index (no index, no manifest): the index built
    from its records (integration/ckpt_legacy.py) does not describe TP layouts, so the same
    sizes take DeepSpeed's stock load and another TP size is refused by name on every rank."""
    from canzona_ds import checkpoint as ck

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_tp_save, 4, ckpt, "CanzonaMuon")
    for name in (ck.INDEX, ck.MANIFEST):
        os.remove(os.path.join(ckpt, "before", name))
    assert run_distributed(_tp_load, 4, ckpt, 2) == [None] * 4
    for msg in run_distributed(_tp_load, 4, ckpt, 1):
        assert msg is not None and "tensor parallelism (TP=2), written before the checkpoint index" in msg, msg
        assert "This run has ZeRO stage 1, DP=4, TP=1" in msg, msg

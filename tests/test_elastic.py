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

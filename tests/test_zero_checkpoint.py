"""Checkpoints of the Canzona optimizers under ZeRO stage 1/2: bit-exact resume at the same DP
(weights, fp32 masters, AdamW state and every matrix's rule state), zero_to_fp32 understands
the planned-padding layout.  Resuming at another DP or TP size: tests/test_ckpt_resume.py.

Cost: subprocesses; 2 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import batches, ds_config, make_model, params_of

MICRO = 2


def _train(engine, rank, dp, data):
    for x, y in data:
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(x, y))
        engine.step()


def _init(dp, opt_type="CanzonaMuon", stage=1):
    import canzona_ds  # noqa: F401
    import deepspeed

    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(dp, optimizer=opt_type, stage=stage))
    return engine


def _state(engine):
    """AdamW state (torch's per-flat-param state) and every matrix's rule state, as numpy."""
    inner = engine.optimizer.optimizer
    out = {f"adamw{i}.{k}": v.clone().numpy() for i, st in enumerate(inner.state.values()) for k, v in st.items()}
    out.update({f"{n}.{k}": v.clone().numpy() for n, st in inner.matrix_state.items() for k, v in st.items()})
    return out


def _save_and_resume(rank, dp, ckpt_dir, opt_type, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    import torch.distributed as dist

    data = batches(5, MICRO * dp)
    a = _init(dp, opt_type, stage)
    _train(a, rank, dp, data[:3])
    saved = params_of(a.module)
    a.save_checkpoint(ckpt_dir, tag="t2")
    _train(a, rank, dp, data[3:])
    b = _init(dp, opt_type, stage)
    b.load_checkpoint(ckpt_dir, tag="t2")
    resumed_at = params_of(b.module)
    step_after_load = b.optimizer.optimizer.param_groups[0]["step"]
    _train(b, rank, dp, data[3:])
    dist.barrier()
    fp32 = None
    if rank == 0:
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="t2")
        fp32 = {k: v.detach().float().numpy() for k, v in sd.items()}
    return dict(saved=saved, resumed_at=resumed_at, a=params_of(a.module), b=params_of(b.module),
                state_a=_state(a), state_b=_state(b), fp32=fp32, step_after_load=step_after_load)


CASES = [("CanzonaMuon", 1), ("CanzonaShampoo", 1), ("CanzonaSOAP", 1), ("CanzonaMuon", 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-stage{s}" for t, s in CASES])
def ckpt(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt"))
    return d, run_distributed(_save_and_resume, 2, d, *request.param)


def test_resume_bit_exact(ckpt):
    _, res = ckpt
    for r in res:
        assert r["step_after_load"] == 3
        for n in r["saved"]:
            np.testing.assert_array_equal(r["resumed_at"][n], r["saved"][n], err_msg=n)
            np.testing.assert_array_equal(r["b"][n], r["a"][n], err_msg=n)
        assert r["state_a"].keys() == r["state_b"].keys() and r["state_a"]
        for k in r["state_a"]:
            np.testing.assert_array_equal(r["state_b"][k], r["state_a"][k], err_msg=k)


def test_zero_to_fp32_reads_planned_padding(ckpt):
    _, res = ckpt
    fp32, saved = res[0]["fp32"], res[0]["saved"]
    assert set(fp32) == set(saved)
    for n in saved:
        np.testing.assert_array_equal(fp32[n], saved[n], err_msg=n)

"""Resume through the checkpoint index: one scenario table (saved layout x running layout).

Each scenario saves (real gloo processes, gradient clipping that clips on every step), loads
at another ZeRO stage (and DP size) through the plain ``engine.load_checkpoint``, and checks:

  * lossless: right after the load the engine saves again; every (whole-model name, state key)
    the first index holds (fp32 master, AdamW moments, every rule-state entry) reads back bit
    for bit from the second, whatever the two layouts, and the step counts agree;
  * exact continuation: the resumed run equals the single-process reference (torch's
    clip_grad_norm_, the reference optimizer) that saw the saved run's batches before the
    checkpoint and the resumed run's after it, bit for bit: both sides average over at most 2
    ranks in fp32 (a sum of two is exact in either order) and run the same kernels.

Saved checkpoints are shared between the scenarios that start from the same layout.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from canzona_ds.testing.dist import run_distributed
from canzona_ds.testing.models import HP, batches, ds_config, make_model, params_of

BEFORE, AFTER, MICRO = 2, 2, 2
#: below the tiny model's gradient norm on every step (~1): every step clips
CLIP = 0.05


def _cfg(dp: int, stage: int, opt_type: str) -> dict:
    from canzona_ds.testing.zero3 import zero3_config

    kw = dict(optimizer=opt_type, gradient_clipping=CLIP)
    return zero3_config(dp, **kw) if stage == 3 else ds_config(dp, stage=stage, **kw)


def _data(dp: int, steps: int, seed: int) -> list:
    return batches(steps, MICRO * dp, seed=seed)


def _train(engine, rank: int, data: list) -> None:
    for x, y in data:
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(x, y))
        engine.step()


def _engine(dp: int, stage: int, opt_type: str):
    import deepspeed

    import canzona_ds  # noqa: F401

    model = make_model(0)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_cfg(dp, stage, opt_type))[0]


def _params(engine, stage: int) -> dict:
    if stage == 3:
        from canzona_ds.testing.zero3 import gathered_params

        return gathered_params(engine.module)
    return params_of(engine.module)


def _save(rank, dp, ckpt, stage, opt_type):
    engine = _engine(dp, stage, opt_type)
    _train(engine, rank, _data(dp, BEFORE, 1))
    engine.save_checkpoint(ckpt, tag="saved")
    return True


def _resume(rank, dp, ckpt, stage, opt_type, out):
    engine = _engine(dp, stage, opt_type)
    engine.load_checkpoint(ckpt, tag="saved")
    engine.save_checkpoint(out, tag="reloaded")  # what this rank holds right after the load
    steps = engine.global_steps
    _train(engine, rank, _data(dp, AFTER, 2))
    return dict(params=_params(engine, stage), steps_at_load=steps, steps=engine.global_steps)


def _reference(n: int, m: int, opt_type: str) -> dict:
    from canzona_ds.optim.config import CanzonaConfig
    from canzona_ds.optim.reference import ReferenceOptimizer
    from canzona_ds.testing.models import reference_grads

    torch.set_num_threads(1)
    model = make_model(0)
    opt = ReferenceOptimizer(model.named_parameters(), CanzonaConfig.from_ds(opt_type, HP[opt_type]))
    for dp, data in ((n, _data(n, BEFORE, 1)), (m, _data(m, AFTER, 2))):
        for x, y in data:
            grads = reference_grads(model, [x], [y], dp, MICRO)
            for name, p in model.named_parameters():
                p.grad = grads[name]
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            assert norm > 2 * CLIP, f"the clipping must clip (norm {float(norm):.3g})"
            opt.step()
    return params_of(model)


def assert_same_state(a_dir: str, b_dir: str) -> int:
    """Every (name, state) of checkpoint ``a_dir``'s index equals ``b_dir``'s, bit for bit, read
    through each one's own index (whatever layout wrote it); returns how many were compared."""
    from canzona_ds.ckpt import Index, Reader

    a, b = Index.read(a_dir), Index.read(b_dir)
    ra, rb = Reader(a_dir, a), Reader(b_dir, b)
    assert set(a.by_key()) == set(b.by_key()), sorted(set(a.by_key()) ^ set(b.by_key()))[:5]
    for name, state in a.by_key():
        x, y = ra.whole(name, state), rb.whole(name, state)
        assert torch.equal(x, y), (name, state, float((x - y).abs().max()))
    for key in ("rule", "matrix_step", "adam_step", "roles"):
        assert a.meta[key] == b.meta[key], key
    return len(a.by_key())


#: (saved stage, saved DP, running stage, running DP, optimizer)
SCENARIOS = [
    (1, 2, 3, 2, "CanzonaMuon"), (3, 2, 1, 2, "CanzonaSOAP"), (2, 2, 0, 2, "CanzonaShampoo"), (0, 2, 3, 2, "CanzonaMuon"),
    (1, 2, 3, 1, "CanzonaMuon"), (3, 1, 1, 2, "CanzonaSOAP"), (2, 2, 0, 1, "CanzonaShampoo"), (0, 1, 3, 2, "CanzonaMuon"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved checkpoint per saved layout, shared by its scenarios."""
    made = {}

    def get(stage: int, dp: int, opt_type: str) -> str:
        key = (stage, dp, opt_type)
        if key not in made:
            ckpt = str(tmp_path_factory.mktemp(f"saved-z{stage}-dp{dp}-{opt_type}"))
            run_distributed(_save, dp, ckpt, stage, opt_type)
            made[key] = ckpt
        return made[key]

    return get


@pytest.mark.parametrize("s0,n,s1,m,opt_type", SCENARIOS,
                         ids=[f"{t}-z{a}dp{n}-to-z{b}dp{m}" for a, n, b, m, t in SCENARIOS])
def test_resume_across_layouts(saved, tmp_path, s0, n, s1, m, opt_type):
    ckpt = saved(s0, n, opt_type)
    out = str(tmp_path / "out")
    res = run_distributed(_resume, m, ckpt, s1, opt_type, out)
    compared = assert_same_state(os.path.join(ckpt, "saved"), os.path.join(out, "reloaded"))
    assert compared >= 9 + 2 * 5  # every parameter's master, the AdamW moments of the 5 AdamW ones, rule state
    for r in res:
        assert (r["steps_at_load"], r["steps"]) == (BEFORE, BEFORE + AFTER)
    ref = _reference(n, m, opt_type)
    for k in ref:
        np.testing.assert_array_equal(res[0]["params"][k], ref[k], err_msg=k)

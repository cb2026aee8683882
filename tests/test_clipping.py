"""Gradient clipping equals ``torch.nn.utils.clip_grad_norm_`` bit for bit (real gloo processes).

The reference is a single process: ZeRO's averaged gradient (exact at DP <= 2), clipped by
torch's own ``clip_grad_norm_(model.parameters(), CLIP)``, then the rule (for Muon, the rule is
``torch.optim.Muon`` bit for bit: test_optim_muon) and ``torch.optim.AdamW``.

Why the suite once missed a clipping defect: its reference re-implemented DeepSpeed's clip
(``1 / ((norm + 1e-6) / clip)`` over an fp64 norm) instead of calling torch's, compared with a
1e-6 tolerance, and clipped hard (0.05 against norms ~1.4), where this tiny model happened not to
amplify the one-ulp difference.  With ``CLIP`` = 0.5 (active on every step, factor ~0.36) the
ulp that DeepSpeed's ZeRO-1/2 arithmetic leaves in the clip factor becomes 1e-3 in the weights
after five steps (bf16 Newton-Schulz flips roundings), so only bit-exactness is a real check.

Cost: 31 rank runs; 18 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import pytest
import torch

from canzona_ds.optim.clip import clip_coefficient, per_tensor_norms, stack_order, total_norm
from canzona_testkit.dist import run_distributed
from canzona_testkit.models import TYPES, ds_config, max_abs_diff, run_engine, run_reference
from canzona_testkit.kernels import assert_bits

STEPS = 5
CLIP = 0.5  # below the gradient norm (~1.3-1.4) on every step, so every step is clipped

SETTINGS = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage1-offload": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    "stage2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


def _clipped_worker(rank, dp, opt_type, zero):
    params, _, engine = run_engine(rank, dp, ds_config(dp, optimizer=opt_type, zero_optimization=zero,
                                                       gradient_clipping=CLIP), STEPS)
    clip = getattr(engine.optimizer, "_canzona_clip", None)
    return dict(params=params, norm=float(engine.get_global_grad_norm() or 0.0),
                straddlers=None if clip is None else [len(s) for s in clip.straddlers])


@pytest.mark.dist
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("opt_type", TYPES)
def test_clipped_run_equals_torch_clip_grad_norm(opt_type, setting, dp):
    res = run_distributed(_clipped_worker, dp, opt_type, SETTINGS[setting])
    ref = run_reference(dp, STEPS, opt_type, clip=CLIP)
    for r in res:
        assert_bits(max_abs_diff(r["params"], ref), 0.0, f"rank params differ from clip_grad_norm_ + {opt_type}")
    if setting != "stage0":
        # the ZeRO path ran torch's arithmetic (integration/clip.py), not DeepSpeed's own
        assert all(r["straddlers"] is not None for r in res)
    if setting != "stage0" and dp == 2:
        # TinyLM's AdamW group is cut by DeepSpeed's equal chunks at DP=2: the assembled-norm path ran
        assert sum(res[0]["straddlers"]) >= 1


@pytest.mark.parametrize("opt_type", TYPES)
def test_clip_is_active_in_these_settings(opt_type):
    """The settings above clip: the clipped reference differs from the unclipped one."""
    assert max_abs_diff(run_reference(2, STEPS, opt_type, clip=CLIP), run_reference(2, STEPS, opt_type)) > 1e-4


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 16), (16,), (40, 16), (3, 5, 7), (12345,), (1,), (256, 129)]
    return [torch.randn(s, generator=g) * 10 ** (k % 3 - 1) for k, s in enumerate(shapes)]


@pytest.mark.parametrize("seed", range(5))
def test_norm_and_coefficient_equal_torch(seed):
    """optim/clip.py reproduces torch's get_total_norm and clip_grad_norm_ bit for bit, also on
    1-D views of a flat buffer (how ZeRO holds gradients)."""
    ts = _tensors(seed)
    ref = torch.nn.utils.get_total_norm(ts)
    flat = torch.cat([t.reshape(-1) for t in ts] + [torch.zeros(5)])
    offsets = torch.tensor([0] + [t.numel() for t in ts]).cumsum(0).tolist()
    views = [flat[a:b] for a, b in zip(offsets, offsets[1:])]
    assert torch.equal(total_norm(per_tensor_norms(ts)), ref)
    assert torch.equal(total_norm(per_tensor_norms(views)), ref)
    params = [torch.nn.Parameter(t.clone()) for t in ts]
    for p, t in zip(params, ts):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    coef = clip_coefficient(ref, 0.5)
    for p, t in zip(params, ts):
        assert torch.equal(p.grad, t * coef)


def test_stack_order_groups_like_torch():
    """torch stacks per-tensor norms group by group ((device, dtype) in first-appearance order)."""
    keys = [("cpu", "f32"), ("cpu", "bf16"), ("cpu", "f32"), ("cpu", "bf16"), ("cpu", "f64")]
    assert stack_order(keys) == [0, 2, 1, 3, 4]


def _one_matrix_worker(rank, dp, hp):
    params, _, engine = run_engine(rank, dp, ds_config(dp, params=hp, gradient_clipping=CLIP), STEPS)
    return dict(params=params, owned=sorted(engine.optimizer.optimizer.handled_names()))


def test_clipping_with_a_rank_owning_no_matrix():
    """One matrix at DP=2: rank 1's partition of the matrix group is padding only (DeepSpeed does
    not flag its gradient buffer as padding); the clipped run stays bit for bit."""
    from canzona_testkit.models import HP

    hp = dict(HP["CanzonaMuon"], matrix_exclude=["embed", "lm_head", "qkv", "proj", "fc2"])
    res = run_distributed(_one_matrix_worker, 2, hp)
    ref = run_reference(2, STEPS, params=hp, clip=CLIP)
    assert [len(r["owned"]) for r in res] == [1, 0]
    for r in res:
        assert_bits(max_abs_diff(r["params"], ref), 0.0)

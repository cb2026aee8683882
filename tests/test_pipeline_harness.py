"""The pipeline test kit (canzona_testkit/pipeline.py) checked with DeepSpeed's own optimizer.

A real ``PipelineEngine`` (gloo processes, ``train_batch`` with 2 micro-batches) running stock
``"AdamW"`` (``torch_adam``: torch.optim.AdamW inside DeepSpeed; fp32, no clipping) must equal the
single-process reference with ``torch.optim.AdamW`` bit for bit (rtol=atol=0), parameters and
reported losses, at PP=2 (world 2), PP=2 x DP=2 (world 4) and PP=4, ZeRO 0 and 1, tied and
untied embeddings.  Exact because DP <= 2 (division by 2 is exact, a two-term sum commutes)
and the reference accumulates the tied weight's two uses separately, as the two stages do.

Measured: a reference whose tied weight is one shared ``nn.Parameter`` (autograd adds both uses
every micro-batch: sum_m (e_m + h_m) instead of the pipeline's sum_m e_m + sum_m h_m) differs by
up to ~1e-7 after 3 steps (PP=2, gas 2), on every parameter once the first step's embedding
differs; test_tied_shared_parameter_order_differs_by_rounding pins that down.

Clipping: ZeRO-1's pipeline clip equals torch's clip_grad_norm_ within rounding; ZeRO-0's counts
only the first stage's gradients in the norm (a DeepSpeed behaviour, reproduced exactly by
``clip_fn`` in the reference).

Cost: 15 rank runs; 9 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from canzona_ds.planning.params import default_is_matrix
from canzona_testkit.dist import run_distributed
from canzona_testkit.models import ds_config
from canzona_testkit.pipeline import (CANONICAL, ReferenceDecoder, canonical_name, merge_stages,
                                         rank_micro_batches, run_pipe_engine, run_pipe_reference, dataset)
from canzona_testkit.kernels import assert_bits

STEPS, MICRO, GAS = 3, 2, 2
ADAMW = {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _cfg(dp: int, stage: int) -> dict:
    return ds_config(dp, micro=MICRO, gas=GAS, stage=stage,
                     optimizer={"type": "AdamW", "params": dict(ADAMW, torch_adam=True)})


def _torch_adamw(named):
    return torch.optim.AdamW([p for _, p in named], **ADAMW)


def _run(world: int, pp: int, stage: int, tied: bool) -> tuple[list, dict]:
    dp = world // pp
    results = run_distributed(run_pipe_engine, world, _cfg(dp, stage), pp, STEPS, tied)
    ref = run_pipe_reference(STEPS, dp, GAS, _torch_adamw, micro=MICRO, tied=tied, stage=stage)
    return results, ref


#: (world, pp, ZeRO stage); PP=4 (DP=1, two middle stages that read no data) once
SCENARIOS = [pytest.param(w, pp, st, id=f"{name}-zero{st}") for w, pp, name in ((2, 2, "pp2"), (4, 2, "pp2xdp2"))
             for st in (0, 1)] + [pytest.param(4, 4, 1, id="pp4-zero1")]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("world,pp,stage", SCENARIOS)
def test_pipeline_adamw_equals_reference(world, pp, stage, tied):
    results, ref = _run(world, pp, stage, tied)
    got = merge_stages(results)  # DP replicas and both copies of a tied weight agree exactly
    assert set(got) == set(ref["params"])
    diff = {n: float(np.abs(got[n] - ref["params"][n]).max()) for n in got}
    assert_bits(max(diff.values()), 0.0, {n: d for n, d in diff.items() if d})
    for r in results:
        assert_bits(r["losses"], ref["losses"], (r["losses"], ref["losses"]))
    stages = {r["stage"] for r in results}
    assert stages == set(range(pp)) and {r["dp_rank"] for r in results} == set(range(world // pp))
    # the tied weight lives on the first and last stage; only the last stage's copy is replicated
    tie = "tied_modules.embed.embed.weight"
    for r in results:
        assert (tie in r["names"]) == (tied and r["stage"] in (0, pp - 1))
        assert r["replicated"] == ([tie] if tied and r["stage"] == pp - 1 else [])
        # a stage name gets the role its canonical name gets from the default matrix filter
        for stage_name, name in r["names"].items():
            shape = r["params"][name].shape
            assert default_is_matrix(stage_name, shape) == default_is_matrix(name, shape), stage_name


def test_tied_shared_parameter_order_differs_by_rounding():
    """The reason the reference keeps the tied weight's uses apart: one shared parameter sums
    in a different order and drifts by rounding (measured ~1e-7 after 3 steps)."""
    per_use = run_pipe_reference(STEPS, 1, GAS, _torch_adamw, micro=MICRO, tied=True)
    shared = run_pipe_reference(STEPS, 1, GAS, _torch_adamw, micro=MICRO, tied=True, tied_grad="shared")
    diff = max(float(np.abs(per_use["params"][n] - shared["params"][n]).max()) for n in per_use["params"])
    print(f"shared vs per-use tied gradient after {STEPS} steps: max |diff| = {diff:.3g}")
    assert 0.0 < diff < 1e-6


def test_reference_names_are_canonical():
    untied = dict(ReferenceDecoder(tied=False).named_parameters())
    tied = dict(ReferenceDecoder(tied=True).named_parameters())
    assert set(untied) - set(tied) == {"head.weight"}
    assert {".".join(n.split(".")[:-2]) for n in untied if n.startswith("blocks.")} == {
        m for m in CANONICAL if m.startswith("blocks")}
    assert canonical_name("tied_modules.embed.embed.weight") == "embed.weight"
    assert canonical_name("0.embed.weight") == "embed.weight" and canonical_name("5.norm.bias") == "norm.bias"
    assert canonical_name("3.fc1.weight") == "blocks.2.fc1.weight" and canonical_name("6.head.weight") == "head.weight"
    shapes = {tuple(untied[f"blocks.{i}.fc1.weight"].shape) for i in range(4)}
    assert len(shapes) == 2  # blocks differ in shape


def test_micro_batches_partition_the_samples_like_distributed_sampler():
    x, y = dataset(16)
    seen = []
    for r in range(2):
        mbs = rank_micro_batches(x, y, 2, r, 2)
        assert len(mbs) == 4
        seen += [row for xb, _ in mbs for row in xb.tolist()]
    assert sorted(seen) == sorted(x.tolist())
    first = rank_micro_batches(x, y, 2, 1, 2)[0][0]
    assert torch.equal(first, x[[1, 3]])  # rank d reads rows d, d+dp, ...


# ---------------------------------------------------------------------------- gradient clipping
CLIP = 0.5  # active: the gradient norms here are well above it


def _first_stage_norm_clip(named):
    """DeepSpeed 0.19.8's ZeRO-0 fp32 clip under a pipeline (runtime/utils.py clip_grad_norm_):
    a parameter counts only where ``mpu.get_model_parallel_rank() == 0`` or it is flagged
    model-parallel; the PipelineParallelGrid's model-parallel group is all stages of one DP
    replica, so its rank is the stage id and every later stage's gradients drop out of the
    norm.  The coefficient still scales every stage."""
    first = [p for n, p in named if n.startswith(("embed.", "blocks.0.", "blocks.1.", "blocks.2."))]
    total = torch.stack([p.grad.norm() for p in first]).pow(2).sum().pow(0.5)
    coef = torch.clamp(CLIP / (total + 1e-6), max=1.0)
    for _, p in named:
        p.grad.mul_(coef)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero0_pipeline_clipping_counts_only_the_first_stage(tied):
    """A DeepSpeed behaviour to know (not ours): with ZeRO-0 + pipeline, "gradient_clipping" uses
    the first stage's gradient norm only.  Measured: against torch's clip_grad_norm_ over all
    parameters the run differs by ~4e-4..8e-4 after 3 steps; against the first-stage-only rule,
    by 0."""
    cfg = _cfg(1, 0)
    cfg["gradient_clipping"] = CLIP
    got = merge_stages(run_distributed(run_pipe_engine, 2, cfg, 2, STEPS, tied))
    ref = run_pipe_reference(STEPS, 1, GAS, _torch_adamw, micro=MICRO, tied=tied, stage=0,
                             clip_fn=_first_stage_norm_clip)
    assert_bits(max(float(np.abs(got[n] - ref["params"][n]).max()) for n in got), 0.0)
    full = run_pipe_reference(STEPS, 1, GAS, _torch_adamw, micro=MICRO, tied=tied, stage=0, clip=CLIP)
    assert max(float(np.abs(got[n] - full["params"][n]).max()) for n in got) > 1e-5


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero1_pipeline_clipping_is_torch_clip_within_rounding(tied):
    """ZeRO-1 sums squared norms over all stages (skipping the last stage's replicated copy of the
    tied weight) with an all-reduce: torch's clip_grad_norm_ over all parameters up to rounding
    (measured after 3 steps: 0 untied, 6e-8 tied)."""
    cfg = _cfg(1, 1)
    cfg["gradient_clipping"] = CLIP
    got = merge_stages(run_distributed(run_pipe_engine, 2, cfg, 2, STEPS, tied))
    ref = run_pipe_reference(STEPS, 1, GAS, _torch_adamw, micro=MICRO, tied=tied, stage=1, clip=CLIP)
    diff = max(float(np.abs(got[n] - ref["params"][n]).max()) for n in got)
    print(f"ZeRO-1 pipeline clip vs torch clip_grad_norm_: max |diff| = {diff:.3g}")
    assert diff < 1e-6


def test_stock_adamw_without_torch_adam_is_fused_adam_within_rounding():
    """Without ``torch_adam`` DeepSpeed's "AdamW" is FusedAdam (on CPU its JIT-built C++ kernel,
    csrc/adam/cpu_adam_impl.cpp), which orders the update's arithmetic differently from
    torch.optim.AdamW: measured ~4e-7 after 3 steps.  That is why the exact tests use torch_adam."""
    cfg = ds_config(1, micro=MICRO, gas=GAS, stage=1, optimizer={"type": "AdamW", "params": dict(ADAMW)})
    got = merge_stages(run_distributed(run_pipe_engine, 2, cfg, 2, STEPS, False))
    ref = run_pipe_reference(STEPS, 1, GAS, _torch_adamw, micro=MICRO, stage=1)
    diff = max(float(np.abs(got[n] - ref["params"][n]).max()) for n in got)
    print(f"FusedAdam vs torch.optim.AdamW after {STEPS} steps: max |diff| = {diff:.3g}")
    assert 0.0 < diff < 1e-5

"""The matrix-optimizer interface: a toy rule defined HERE (not in the package) runs under DeepSpeed
ZeRO at DP=2 and through the TP micro-group runtime at TP=2, exactly, with no package change.

The toy rule needs the whole matrix: it normalises its momentum by the matrix's Frobenius
norm, so a shard-local update is a different update (checked below).

Cost: 3 rank runs; 1 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from canzona_ds.optim import register_rule
from canzona_ds.optim.rule import Flops, MatrixInfo, MatrixRule, check_number
from canzona_testkit.dist import device_params, rank_device, run_distributed
from canzona_testkit.models import ds_config, run_engine, run_reference


@dataclass(frozen=True)
class NormalizedMomentum(MatrixRule):
    """D = sqrt(numel) * M / ||M||_F with M an EMA of the gradient."""

    name: ClassVar[str] = "toy_normalized_momentum"
    default_lr: ClassVar[float] = 0.01
    default_adam_lr: ClassVar[float] = 0.01

    #: EMA coefficient of the momentum, in [0, 1)
    beta: float = 0.9

    def __post_init__(self) -> None:
        check_number("beta", self.beta, 0.0, 1.0, high_open=True)

    def init_state(self, info: MatrixInfo, like: torch.Tensor) -> dict:
        return {"m": torch.zeros(info.shape, dtype=like.dtype, device=like.device)}

    def direction(self, grad, state, info, step):
        m = state["m"]
        m.lerp_(grad, 1 - self.beta)
        return m * (math.sqrt(m.numel()) / m.norm().clamp(min=1e-12))

    def flops(self, shape, num_heads=None) -> Flops:
        return Flops(4.0 * shape[0] * shape[1], 4.0 * shape[0] * shape[1])

    def state_bytes(self, shape, num_heads=None) -> float:
        return 4.0 * shape[0] * shape[1]


register_rule(NormalizedMomentum, "CanzonaToy")  # the only line a new optimizer adds besides its file
PARAMS = {"lr": 0.02, "adam_lr": 0.01, "beta": 0.8, "weight_decay": 0.1}


def _zero_worker(rank, dp):
    params, _, engine = run_engine(rank, dp, ds_config(dp, optimizer="CanzonaToy", params=PARAMS), 3)
    return params, sorted(engine.optimizer.optimizer.handled_names())


def test_toy_rule_under_zero_dp2_is_exact():
    res = run_distributed(_zero_worker, 2)
    ref = run_reference(2, 3, "CanzonaToy", params=PARAMS)
    for params, _ in res:
        for n in ref:
            np.testing.assert_array_equal(params[n], ref[n], err_msg=n)
    assert len(res[0][1]) + len(res[1][1]) == 4 and set(res[0][1]).isdisjoint(res[1][1])


FULL = {"col": ((12, 6), 0), "row": ((6, 10), 1), "col2": ((8, 6), 0)}


def _tp_worker(rank, tp, local, device="cpu"):
    import torch.distributed as dist

    from canzona_ds.config import TPConfig
    from canzona_testkit.baselines import ShardLocalTP
    from canzona_ds.tp.runtime import MicroGroupRuntime, TPMatrix

    rule = NormalizedMomentum(beta=0.8)
    mats = [TPMatrix(n, shape, dim, (shape[dim] // tp,) * tp) for n, (shape, dim) in FULL.items()]
    runtime = (ShardLocalTP(mats, rule, None) if local else MicroGroupRuntime(mats, rule, None, TPConfig()))
    dev = rank_device(device, rank)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(shape, generator=g) for n, (shape, _) in FULL.items()}
    params = [full[m.name].chunk(tp, dim=m.partition_dim)[rank].clone().to(dev) for m in mats]
    for step in range(1, 4):
        grads = {n: torch.randn(shape, generator=g) for n, (shape, _) in FULL.items()}
        runtime.step(params, [grads[m.name].chunk(tp, dim=m.partition_dim)[rank].to(dev) for m in mats], lr=0.05,
                     weight_decay=0.1, step=step)
    dist.barrier()
    return {m.name: p.cpu().numpy() for m, p in zip(mats, params)}


def _tp_reference() -> dict:
    from canzona_ds.optim.rule import apply_update

    rule = NormalizedMomentum(beta=0.8)
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(shape, generator=g) for n, (shape, _) in FULL.items()}
    states = {n: rule.init_state(MatrixInfo(n, shape), like=params[n]) for n, (shape, _) in FULL.items()}
    for step in range(1, 4):
        grads = {n: torch.randn(shape, generator=g) for n, (shape, _) in FULL.items()}
        for n, (shape, _) in FULL.items():
            info = MatrixInfo(n, shape)
            D = rule.direction(grads[n], states[n], info, step)
            apply_update(params[n], D, *rule.scales(0.05, 0.1, info, step))
    return {n: p.numpy() for n, p in params.items()}


@pytest.mark.parametrize("device", device_params(2))
def test_toy_rule_through_tp_micro_groups_is_exact(device):
    """cpu: bit for bit against the single-process rule; cuda (NCCL, 2 GPUs): the rule's
    arithmetic runs on GPU kernels, compared to the CPU reference to fp32 rounding."""
    res = run_distributed(_tp_worker, 2, False, device, device=device)
    ref = _tp_reference()
    for n, (_, dim) in FULL.items():
        got = np.concatenate([res[r][n] for r in range(2)], axis=dim)
        if device == "cpu":
            np.testing.assert_array_equal(got, ref[n], err_msg=n)
        else:
            np.testing.assert_allclose(got, ref[n], rtol=0, atol=1e-5, err_msg=n)


def test_shard_local_toy_rule_is_a_different_update():
    res = run_distributed(_tp_worker, 2, True)
    ref = _tp_reference()
    dev = max(float(np.abs(np.concatenate([res[r][n] for r in range(2)], axis=dim) - ref[n]).max())
              for n, (_, dim) in FULL.items())
    assert dev > 1e-3

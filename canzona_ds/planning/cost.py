"""Cost models: the load W(p) a planner balances.

``numel``            elements of the (local) parameter; the paper's default proxy.
``flops``            FLOPs of the optimizer's matrix step (see ``muon_flops``).
``memory``           optimizer-state bytes held by the owner (see ``state_bytes``).

Muon's Newton-Schulz iteration (``canzona_ds.optim.muon.newton_schulz``) works on
X of shape (m, n) with m <= n (it transposes tall matrices).  One iteration is

    A = X @ X.T          2*m*m*n FLOPs
    B = b*A + c*A @ A    2*m*m*m
    X = a*X + B @ X      2*m*m*n

so ``steps * (4*m*m*n + 2*m**3)``; element-wise work (momentum, scaling) is O(mn)
and ignored.
"""
from __future__ import annotations

from typing import Sequence

from .params import ParamSpec

COST_MODELS = ("numel", "flops", "memory")
OPTIMIZERS = ("muon",)


def muon_flops(shape: tuple[int, int], ns_steps: int = 5) -> float:
    m, n = sorted(shape)
    return float(ns_steps) * (4.0 * m * m * n + 2.0 * m**3)


def flops(spec: ParamSpec, optimizer: str = "muon") -> float:
    if not spec.is_matrix:
        return 0.0
    if optimizer == "muon":
        return muon_flops(spec.matrix_shape)
    raise ValueError(f"Unknown optimizer={optimizer!r}. Allowed: {list(OPTIMIZERS)}")


def state_bytes(spec: ParamSpec, optimizer: str = "muon") -> float:
    """fp32 master weight + fp32 gradient partition + optimizer state, per element."""
    if optimizer == "muon":
        return float(spec.numel) * (4 + 4 + 4)  # master, grad, momentum
    raise ValueError(f"Unknown optimizer={optimizer!r}. Allowed: {list(OPTIMIZERS)}")


def cost_vector(specs: Sequence[ParamSpec], cost: str = "numel", optimizer: str = "muon") -> list[float]:
    if cost == "numel":
        return [float(s.numel) for s in specs]
    if cost == "flops":
        return [flops(s, optimizer) for s in specs]
    if cost == "memory":
        return [state_bytes(s, optimizer) for s in specs]
    raise ValueError(f"Unknown cost model={cost!r}. Allowed: {list(COST_MODELS)}")

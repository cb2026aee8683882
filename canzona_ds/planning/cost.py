"""Cost models: the load W(p) a planner balances.

``numel``            elements of the (local) parameter; the paper's default proxy.
``flops``            FLOPs of the optimizer's matrix step for one parameter.
``memory``           bytes the owner holds for it (master + grad + optimizer state).

Both ``flops`` and ``memory`` depend on the optimizer (``OPTIMIZER_FLOPS`` /
``OPTIMIZER_STATE_BYTES``, name -> function of the 2-D shape).  ``COST_FUNCTIONS`` maps
a cost model name to ``fn(spec, optimizer) -> float``; add an entry to plug in another.

Muon's Newton-Schulz iteration (``canzona_ds.optim.muon.newton_schulz``) works on
X of shape (m, n) with m <= n (it transposes tall matrices).  One iteration is

    A = X @ X.T          2*m*m*n FLOPs
    B = b*A + c*A @ A    2*m*m*m
    X = a*X + B @ X      2*m*m*n

so ``steps * (4*m*m*n + 2*m**3)``; element-wise work (momentum, scaling) is O(mn)
and ignored.

Shampoo on G (m, n), left factor L (m, m), right factor R (n, n):

    L += G G^T, R += G^T G                 2*m*m*n + 2*m*n*n
    L^-1/4, R^-1/4 by eigendecomposition   (EIGH_FLOPS + 2) * (m^3 + n^3) / f
      (symmetric eigh ~ 9 k^3: tridiagonalisation + accumulating Q + QR sweeps,
       Golub & Van Loan; rebuilding Q diag Q^T ~ 2 k^3), f = precondition_frequency
    L^-1/4 G R^-1/4                        2*m*m*n + 2*m*n*n

SOAP (Vyas et al.) on G (m, n): the same two factor updates, an eigendecomposition of
both factors every f steps (default 10), and rotations into and out of the eigenbasis:

    factors                                2*m*m*n + 2*m*n*n
    eigenbases                             EIGH_FLOPS * (m^3 + n^3) / f
    Q_L^T G Q_R, and Q_L U Q_R^T back      2 * (2*m*m*n + 2*m*n*n)
    Adam moments in the rotated space      O(mn), ignored
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from .params import ParamSpec

#: FLOPs of a symmetric eigendecomposition with eigenvectors, per k^3 (k x k matrix)
EIGH_FLOPS = 9.0
#: Shampoo recomputes its inverse roots every step by default (amortise with frequency)
SHAMPOO_PRECONDITION_FREQUENCY = 1
#: SOAP refreshes its eigenbases every 10 steps (the paper's default)
SOAP_PRECONDITION_FREQUENCY = 10
#: bytes per element of fp32 master weight + fp32 gradient partition
MASTER_GRAD_BYTES = 4 + 4
FP32 = 4


def muon_flops(shape: tuple[int, int], ns_steps: int = 5) -> float:
    m, n = sorted(shape)
    return float(ns_steps) * (4.0 * m * m * n + 2.0 * m**3)


def shampoo_flops(shape: tuple[int, int], precondition_frequency: int = SHAMPOO_PRECONDITION_FREQUENCY) -> float:
    m, n = shape
    factors = 2.0 * m * m * n + 2.0 * m * n * n
    roots = (EIGH_FLOPS + 2.0) * (m**3 + n**3) / precondition_frequency
    precondition = 2.0 * m * m * n + 2.0 * m * n * n
    return factors + roots + precondition


def soap_flops(shape: tuple[int, int], precondition_frequency: int = SOAP_PRECONDITION_FREQUENCY) -> float:
    m, n = shape
    factors = 2.0 * m * m * n + 2.0 * m * n * n
    eigenbases = EIGH_FLOPS * (m**3 + n**3) / precondition_frequency
    rotations = 2.0 * (2.0 * m * m * n + 2.0 * m * n * n)
    return factors + eigenbases + rotations


def muon_state_bytes(shape: tuple[int, int]) -> float:
    m, n = shape
    return float(m * n) * (MASTER_GRAD_BYTES + FP32)  # + momentum


def shampoo_state_bytes(shape: tuple[int, int]) -> float:
    m, n = shape
    # two factors L, R and their inverse roots, fp32
    return float(m * n) * MASTER_GRAD_BYTES + 2.0 * FP32 * (m * m + n * n)


def soap_state_bytes(shape: tuple[int, int]) -> float:
    m, n = shape
    # factors + eigenbases (m^2 + n^2 each) + Adam first and second moments (m*n each)
    return float(m * n) * (MASTER_GRAD_BYTES + 2 * FP32) + 2.0 * FP32 * (m * m + n * n)


#: optimizer name -> FLOPs of one step on a 2-D matrix shape
OPTIMIZER_FLOPS: dict[str, Callable[[tuple[int, int]], float]] = {
    "muon": muon_flops,
    "shampoo": shampoo_flops,
    "soap": soap_flops,
}
#: optimizer name -> bytes held by the owner for a 2-D matrix shape
OPTIMIZER_STATE_BYTES: dict[str, Callable[[tuple[int, int]], float]] = {
    "muon": muon_state_bytes,
    "shampoo": shampoo_state_bytes,
    "soap": soap_state_bytes,
}
OPTIMIZERS = tuple(OPTIMIZER_FLOPS)
#: element-wise optimizer (AdamW) of aux parameters: master + grad + two moments
AUX_BYTES_PER_ELEMENT = MASTER_GRAD_BYTES + 2 * FP32


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZER_FLOPS:
        raise ValueError(f"Unknown optimizer={optimizer!r}. Allowed: {list(OPTIMIZERS)}")


def _shape(spec: ParamSpec, full: bool) -> tuple[int, int]:
    if not full:
        return spec.matrix_shape
    shape = spec.full_shape
    return (shape[0], math.prod(shape[1:]))


def numel(spec: ParamSpec, optimizer: str = "muon", full: bool = False) -> float:
    return float(spec.numel * (spec.tp_size if full else 1))


def flops(spec: ParamSpec, optimizer: str = "muon", full: bool = False) -> float:
    """Optimizer-step FLOPs of ``spec`` (0 for aux params); ``full``: of the whole TP matrix."""
    check_optimizer(optimizer)
    if not spec.is_matrix:
        return 0.0
    return OPTIMIZER_FLOPS[optimizer](_shape(spec, full))


def state_bytes(spec: ParamSpec, optimizer: str = "muon", full: bool = False) -> float:
    """fp32 master weight + fp32 gradient partition + optimizer state."""
    check_optimizer(optimizer)
    if not spec.is_matrix:
        return numel(spec, optimizer, full) * AUX_BYTES_PER_ELEMENT
    return OPTIMIZER_STATE_BYTES[optimizer](_shape(spec, full))


#: cost model name -> fn(spec, optimizer, full) -> load
COST_FUNCTIONS: dict[str, Callable[..., float]] = {"numel": numel, "flops": flops, "memory": state_bytes}
COST_MODELS = tuple(COST_FUNCTIONS)


def check_cost(cost: str) -> None:
    if cost not in COST_FUNCTIONS:
        raise ValueError(f"Unknown cost model={cost!r}. Allowed: {list(COST_MODELS)}")


def cost_vector(
    specs: Sequence[ParamSpec], cost: str = "numel", optimizer: str = "muon", full: bool = False
) -> list[float]:
    """Load of every spec under ``cost``; ``full=True`` costs the whole (un-TP-split) matrix."""
    check_cost(cost)
    check_optimizer(optimizer)
    fn = COST_FUNCTIONS[cost]
    return [fn(s, optimizer, full) for s in specs]

"""Muon math: one small function each, shared by every runtime (single process, ZeRO-1, TP).

``muon_update`` is bit-for-bit the update of ``torch.optim.Muon`` (torch 2.13) when called
with the same settings: momentum as ``buf.lerp_(grad, 1 - momentum)``, Nesterov as
``grad.lerp(buf, momentum)``, Newton-Schulz in bfloat16 on the wide orientation, the
``adjust_lr_fn`` scaling, then decoupled weight decay.  The reference test checks that.

``ns_method``:
    "standard"  torch.optim.Muon's quintic iteration (default; exact match)
    "gram"      the same polynomial evaluated with the Gram matrix kept small: for a wide
                X (m <= n) the iteration only ever multiplies (m, m) matrices until the last
                product with X.  Faster for wide matrices; equal in exact arithmetic,
                differs in bf16 rounding, so it is opt-in.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
NS_METHODS = ("standard", "gram")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "none")


def newton_schulz(
    G: Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    method: str = "standard",
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximate the orthogonal factor U V^T of G (2-D) by a quintic Newton-Schulz."""
    if G.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    # Ensure spectral norm is at most 1
    X = X.div(X.norm().clamp(min=eps))
    if method == "standard":
        for _ in range(steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    elif method == "gram":
        # X_k = Q_k X_0 with Q_k (m x m): Q_{k+1} = (a I + b A_k + c A_k^2) Q_k,
        # A_k = X_k X_k^T = Q_k A_0 Q_k^T.  Only the final product touches n.
        A0 = X @ X.T
        Q = torch.eye(X.size(0), dtype=X.dtype, device=X.device)
        for _ in range(steps):
            A = Q @ A0 @ Q.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            Q = torch.addmm(Q, B, Q, beta=a)
        X = Q @ X
    else:
        raise ValueError(f"Unknown ns_method={method!r}. Allowed: {list(NS_METHODS)}")
    if tall:
        X = X.T
    return X


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate scaling by matrix shape."""
    A, B = shape[0], math.prod(shape[1:])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    if adjust_lr_fn == "none":
        return lr
    raise ValueError(f"Unknown adjust_lr_fn={adjust_lr_fn!r}. Allowed: {list(ADJUST_LR_FNS)}")


def muon_direction(
    grad: Tensor,
    momentum_buffer: Tensor,
    momentum: float,
    nesterov: bool = True,
    ns_steps: int = NS_STEPS,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    ns_method: str = "standard",
) -> Tensor:
    """Update momentum in place and return the orthogonalised direction (grad's shape)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    shape = update.shape
    O = newton_schulz(update.reshape(shape[0], -1), ns_steps, ns_coefficients, eps, ns_method)
    return O.reshape(shape)


def apply_update(param: Tensor, direction: Tensor, lr: float, weight_decay: float, adjust_lr_fn: str | None, shape=None) -> None:
    """Decoupled weight decay, then ``param -= adjusted_lr * direction`` (in param's dtype)."""
    shape = tuple(param.shape) if shape is None else tuple(shape)
    param.mul_(1 - lr * weight_decay)
    param.add_(direction.to(param.dtype), alpha=-adjusted_lr(lr, adjust_lr_fn, shape))


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool = True,
    ns_steps: int = NS_STEPS,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    adjust_lr_fn: str | None = None,
    ns_method: str = "standard",
) -> None:
    """One Muon step for one matrix, in place (param, momentum_buffer)."""
    O = muon_direction(grad, momentum_buffer, momentum, nesterov, ns_steps, ns_coefficients, eps, ns_method)
    apply_update(param, O, lr, weight_decay, adjust_lr_fn)

"""Shampoo (Gupta et al. 2018; Anil et al. 2020): Kronecker-factored preconditioning of
one whole matrix, with grafting for the step size.

For a gradient G (m x n; trailing dims flattened) at step t (from 1), per block (see
``max_preconditioner_dim``):

    M <- b1 M + (1 - b1) G,   M^ = M / (1 - b1^t)                first moment ("momentum")
    L <- b2 L + (1 - b2) G G^T,   R <- b2 R + (1 - b2) G^T G     factor statistics
         (b2 = 1: plain sums L += G G^T, R += G^T G, as in Gupta et al.)
    every ``precondition_frequency`` steps from ``start_preconditioning_step`` on:
         L^-1/4, R^-1/4 = Q diag((max(lambda, 0) + epsilon)^-1/4) Q^T   (eigh of L and R)
    graft = M^ / (sqrt(V^) + grafting_epsilon)                    Adam:    V <- g2 V + (1-g2) G^2, V^ = V/(1-g2^t)
                                                                  AdaGrad: V <- V + G^2,           V^ = V
    S     = L^-1/4 M^ R^-1/4                                      (once inverse roots exist)
    D     = S * ||graft||_F / ||S||_F                             grafting: Shampoo's direction,
                                                                  the grafted optimizer's step size
    (before the first inverse roots, D = graft; with grafting "none", D = S and before it M^)
    W <- (1 - lr * weight_decay) W - lr * D                       decoupled weight decay

``max_preconditioner_dim``: a side longer than this is cut into blocks of at most that
many rows/columns; each block (i, j) of the matrix has its own L_ij, R_ij and is
preconditioned on its own (blocked Shampoo, Anil et al. 2020), and grafting rescales each
block by its own norm.  The blocks are part of the matrix's state, so they stay with the
matrix's owner (DP) or host (TP).

Precision: the moments and factor statistics are fp32 (the master weight's dtype under
ZeRO); the eigendecomposition runs in ``eigh_dtype`` ("fp32" default, "fp64" for
ill-conditioned statistics; a failed fp32 solve is retried in fp64).  The direction is
fp32, so TP hosts scatter fp32 update shards and hosting is bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .rule import (EIGH_FLOPS_PER_K3, Flops, MatrixInfo, MatrixRule, check_choice, check_int, check_number,
                   eigh_descending, matmul_flops)

GRAFTINGS = ("adam", "adagrad", "none")
EIGH_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
#: upper bound of every step-count setting (a larger value would never happen in a run)
MAX_STEPS_SETTING = 10**9
#: blocks larger than this are refused: an eigendecomposition of a 65536-dim factor takes minutes
MAX_PRECONDITIONER_DIM = 65536


def split_sizes(n: int, block: int) -> list[int]:
    """Sizes of ``n`` cut into blocks of at most ``block`` (the last one shorter)."""
    return [block] * (n // block) + ([n % block] if n % block else [])


def inverse_root(matrix: Tensor, root: int, epsilon: float, dtype: torch.dtype) -> Tensor:
    """``(matrix + epsilon I)^(-1/root)`` of a symmetric PSD matrix via eigh (negative
    eigenvalues from rounding are clamped to 0 first), in ``matrix``'s dtype."""
    vals, vecs = eigh_descending(matrix, dtype)
    vals = vals.clamp(min=0).add_(epsilon).pow_(-1.0 / root)
    return ((vecs * vals) @ vecs.mT).to(matrix.dtype)


@dataclass(frozen=True)
class ShampooRule(MatrixRule):
    name: ClassVar[str] = "shampoo"
    default_lr: ClassVar[float] = 1e-3  # with Adam grafting the step size is Adam's
    default_adam_lr: ClassVar[float] = 1e-3

    #: (b1, b2): first-moment EMA, in [0, 1); factor-statistics EMA, in (0, 1] (1 = sums)
    betas: tuple[float, float] = (0.9, 1.0)
    #: added to the factors' eigenvalues before the inverse 4th root, in (0, 1]
    epsilon: float = 1e-12
    #: recompute the inverse roots every this many steps, integer in [1, 1e9]
    precondition_frequency: int = 10
    #: first step that computes inverse roots (before it: the grafting direction), integer in [1, 1e9]
    start_preconditioning_step: int = 10
    #: longest side of a preconditioned block; longer sides are blocked, integer in [1, 65536]
    max_preconditioner_dim: int = 1024
    #: step-size grafting: "adam", "adagrad" or "none"
    grafting: str = "adam"
    #: second-moment EMA of Adam grafting, in [0, 1)
    grafting_beta2: float = 0.999
    #: epsilon of the grafting direction's denominator, in (0, 1]
    grafting_epsilon: float = 1e-8
    #: dtype of the eigendecomposition: "fp32" or "fp64"
    eigh_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"Invalid betas={self.betas!r}. Must be two numbers (b1, b2).")
        check_number("betas[0]", self.betas[0], 0.0, 1.0, high_open=True)
        check_number("betas[1]", self.betas[1], 0.0, 1.0, low_open=True)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        check_number("epsilon", self.epsilon, 0.0, 1.0, low_open=True)
        check_int("precondition_frequency", self.precondition_frequency, 1, MAX_STEPS_SETTING)
        check_int("start_preconditioning_step", self.start_preconditioning_step, 1, MAX_STEPS_SETTING)
        check_int("max_preconditioner_dim", self.max_preconditioner_dim, 1, MAX_PRECONDITIONER_DIM)
        check_choice("grafting", self.grafting, GRAFTINGS)
        check_number("grafting_beta2", self.grafting_beta2, 0.0, 1.0, high_open=True)
        check_number("grafting_epsilon", self.grafting_epsilon, 0.0, 1.0, low_open=True)
        check_choice("eigh_dtype", self.eigh_dtype, tuple(EIGH_DTYPES))

    # ---------------------------------------------------------------- blocks
    def blocks(self, shape: tuple[int, int]) -> tuple[list[int], list[int]]:
        B = self.max_preconditioner_dim
        return split_sizes(shape[0], B), split_sizes(shape[1], B)

    def _refresh(self, step: int) -> bool:
        start = self.start_preconditioning_step
        return step >= start and (step - start) % self.precondition_frequency == 0

    # ---------------------------------------------------------------- the math
    def init_state(self, info: MatrixInfo, like: Tensor) -> dict[str, Tensor]:
        m, n = info.shape2d
        kw = dict(dtype=like.dtype, device=like.device)
        state = {"exp_avg": torch.zeros((m, n), **kw)}
        if self.grafting != "none":
            state["graft_sq"] = torch.zeros((m, n), **kw)
        rows, cols = self.blocks((m, n))
        for i, bm in enumerate(rows):
            for j, bn in enumerate(cols):
                state[f"L.{i}.{j}"] = torch.zeros((bm, bm), **kw)
                state[f"R.{i}.{j}"] = torch.zeros((bn, bn), **kw)
        return state

    def direction(self, grad: Tensor, state: dict[str, Tensor], info: MatrixInfo, step: int) -> Tensor:
        b1, b2 = self.betas
        G = grad.reshape(info.shape2d)
        M = state["exp_avg"]
        M.lerp_(G, 1 - b1)
        M_hat = M / (1 - b1**step) if b1 > 0 else M
        if self.grafting == "adam":
            V = state["graft_sq"]
            V.mul_(self.grafting_beta2).addcmul_(G, G, value=1 - self.grafting_beta2)
            graft = M_hat / (V / (1 - self.grafting_beta2**step)).sqrt_().add_(self.grafting_epsilon)
        elif self.grafting == "adagrad":
            V = state["graft_sq"]
            V.addcmul_(G, G)
            graft = M_hat / V.sqrt().add_(self.grafting_epsilon)
        else:
            graft = M_hat
        refresh = self._refresh(step)
        eigh_dtype = EIGH_DTYPES[self.eigh_dtype]
        rows, cols = self.blocks(info.shape2d)
        out = torch.empty_like(M)
        r0 = 0
        for i, bm in enumerate(rows):
            c0 = 0
            for j, bn in enumerate(cols):
                Gb = G[r0:r0 + bm, c0:c0 + bn]
                L, R = state[f"L.{i}.{j}"], state[f"R.{i}.{j}"]
                if b2 < 1.0:
                    L.mul_(b2).addmm_(Gb, Gb.mT, alpha=1 - b2)
                    R.mul_(b2).addmm_(Gb.mT, Gb, alpha=1 - b2)
                else:
                    L.addmm_(Gb, Gb.mT)
                    R.addmm_(Gb.mT, Gb)
                if refresh:
                    state[f"Linv.{i}.{j}"] = inverse_root(L, 4, self.epsilon, eigh_dtype)
                    state[f"Rinv.{i}.{j}"] = inverse_root(R, 4, self.epsilon, eigh_dtype)
                Db = out[r0:r0 + bm, c0:c0 + bn]
                graft_b = graft[r0:r0 + bm, c0:c0 + bn]
                if f"Linv.{i}.{j}" in state:
                    S = state[f"Linv.{i}.{j}"] @ M_hat[r0:r0 + bm, c0:c0 + bn] @ state[f"Rinv.{i}.{j}"]
                    if self.grafting != "none":
                        # step size of the grafted optimizer, direction of Shampoo (no host sync)
                        S = S * (graft_b.norm() / S.norm().clamp(min=torch.finfo(S.dtype).tiny))
                    Db.copy_(S)
                else:
                    Db.copy_(graft_b)
                c0 += bn
            r0 += bm
        return out.reshape(grad.shape)

    def state_axes(self, key: str, shape: tuple[int, ...], info: MatrixInfo) -> tuple[str, ...] | None:
        rows, cols = self.blocks(info.shape2d)
        kind = key.split(".")[0]
        if kind in ("exp_avg", "graft_sq"):
            return ("row", "col")
        # a factor follows a permutation of its side only when that side is one block
        if kind in ("L", "Linv"):
            return ("row", "row") if len(rows) == 1 else None
        if kind in ("R", "Rinv"):
            return ("col", "col") if len(cols) == 1 else None
        return None

    # ---------------------------------------------------------------- the cost
    def flops(self, shape: tuple[int, int], num_heads: int | None = None) -> Flops:
        rows, cols = self.blocks(shape)
        per_step, roots = 0.0, 0.0
        for bm in rows:
            for bn in cols:
                per_step += matmul_flops(bm, bn, bm) + matmul_flops(bn, bm, bn)  # L, R statistics
                per_step += matmul_flops(bm, bm, bn) + matmul_flops(bm, bn, bn)  # L^-1/4 M R^-1/4
                # eigh + rebuilding Q diag Q^T, for both factors
                roots += (EIGH_FLOPS_PER_K3 + 2.0) * (bm**3 + bn**3)
        return Flops(per_step + roots / self.precondition_frequency, per_step + roots)

    def state_bytes(self, shape: tuple[int, int], num_heads: int | None = None) -> float:
        m, n = shape
        rows, cols = self.blocks(shape)
        moments = (2 if self.grafting != "none" else 1) * m * n
        factors = sum(2 * (bm * bm + bn * bn) for bm in rows for bn in cols)  # statistics + inverse roots
        return 4.0 * (moments + factors)

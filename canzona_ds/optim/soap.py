"""SOAP (Vyas et al. 2024, Algorithm 3): Adam run in the eigenbasis of Shampoo's factors.

For a gradient G (m x n; trailing dims flattened) at optimizer step t (from 1):

    step 1:    L = (1 - bs) G G^T, R = (1 - bs) G^T G;  Q_L, Q_R = eigenvectors (eigh,
               eigenvalues descending); no update (the reference implementation's first
               step: the basis never sees the gradient it is applied to)
    step t>1:  k = t - 1 (updates so far, counting this one)
        G' = Q_L^T G Q_R                                       gradient in the eigenbasis
        M  <- b1 M + (1 - b1) G ;  M' = Q_L^T M Q_R            first moment, original space
        V  <- b2 V + (1 - b2) G' * G'                          second moment, eigenbasis
        N  = Q_L (M' / (sqrt(V) + eps)) Q_R^T
        W  <- (1 - lr * weight_decay) W - lr * sqrt(1 - b2^k) / (1 - b1^k) * N
        L  <- bs L + (1 - bs) G G^T ;  R <- bs R + (1 - bs) G^T G
        every ``precondition_frequency`` updates (k % f == 0), per side (Algorithm 4):
            e = diag(Q^T L Q);  order = argsort(e, descending)
            Q <- QR(L Q[:, order]).Q     one power iteration + QR
            V is permuted along that side by ``order``, so each entry stays with its
            eigen-direction; M needs nothing (it lives in the original space).

A side longer than ``max_precond_dim`` is not rotated (Q = identity on that side), as in
the reference implementation.  ``bs`` is ``shampoo_beta`` (default: b2).

Differences from the reference code (nikhilvyas/SOAP): the paper's first moment in the
original space (the code keeps it in the eigenbasis); decoupled weight decay applied
before the step (the code applies it after: O(lr^2 * wd) apart).  State is fp32; eigh
runs in fp32 (retried in fp64 if it fails) and QR in fp32.  Directions are fp32, so TP
hosts scatter fp32 update shards and hosting is bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .rule import (EIGH_FLOPS_PER_K3, QR_FLOPS_PER_K3, Flops, MatrixInfo, MatrixRule, check_bool, check_int,
                   check_number, eigh_descending, matmul_flops)
from .shampoo import MAX_PRECONDITIONER_DIM, MAX_STEPS_SETTING


@dataclass(frozen=True)
class SOAPRule(MatrixRule):
    name: ClassVar[str] = "soap"
    default_lr: ClassVar[float] = 3e-3  # the reference implementation's defaults
    default_adam_lr: ClassVar[float] = 3e-3

    #: (b1, b2): Adam's first and second moment EMAs in the eigenbasis, each in [0, 1)
    betas: tuple[float, float] = (0.95, 0.95)
    #: Adam epsilon, in (0, 1]
    eps: float = 1e-8
    #: EMA of the factor statistics L and R, in [0, 1); null = b2
    shampoo_beta: float | None = None
    #: refresh the eigenbasis every this many updates, integer in [1, 1e9]
    precondition_frequency: int = 10
    #: sides longer than this are not rotated, integer in [1, 65536]
    max_precond_dim: int = 10000
    #: Adam bias correction of the step size
    correct_bias: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"Invalid betas={self.betas!r}. Must be two numbers (b1, b2).")
        for i, b in enumerate(self.betas):
            check_number(f"betas[{i}]", b, 0.0, 1.0, high_open=True)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        check_number("eps", self.eps, 0.0, 1.0, low_open=True)
        if self.shampoo_beta is not None:
            check_number("shampoo_beta", self.shampoo_beta, 0.0, 1.0, high_open=True)
        check_int("precondition_frequency", self.precondition_frequency, 1, MAX_STEPS_SETTING)
        check_int("max_precond_dim", self.max_precond_dim, 1, MAX_PRECONDITIONER_DIM)
        check_bool("correct_bias", self.correct_bias)

    @property
    def factor_beta(self) -> float:
        return self.betas[1] if self.shampoo_beta is None else self.shampoo_beta

    def rotated(self, shape: tuple[int, int]) -> tuple[bool, bool]:
        return shape[0] <= self.max_precond_dim, shape[1] <= self.max_precond_dim

    # ---------------------------------------------------------------- the math
    def init_state(self, info: MatrixInfo, like: Tensor) -> dict[str, Tensor]:
        m, n = info.shape2d
        kw = dict(dtype=like.dtype, device=like.device)
        state = {"exp_avg": torch.zeros((m, n), **kw), "exp_avg_sq": torch.zeros((m, n), **kw)}
        rot_l, rot_r = self.rotated((m, n))
        if rot_l:
            state["L"] = torch.zeros((m, m), **kw)
        if rot_r:
            state["R"] = torch.zeros((n, n), **kw)
        return state

    def _update_factors(self, G: Tensor, state: dict[str, Tensor]) -> None:
        w = 1 - self.factor_beta
        if "L" in state:
            state["L"].lerp_(G @ G.mT, w)
        if "R" in state:
            state["R"].lerp_(G.mT @ G, w)

    @staticmethod
    def _project(X: Tensor, state: dict[str, Tensor]) -> Tensor:
        if "Q_L" in state:
            X = state["Q_L"].mT @ X
        if "Q_R" in state:
            X = X @ state["Q_R"]
        return X

    @staticmethod
    def _project_back(X: Tensor, state: dict[str, Tensor]) -> Tensor:
        if "Q_L" in state:
            X = state["Q_L"] @ X
        if "Q_R" in state:
            X = X @ state["Q_R"].mT
        return X

    def _refresh_basis(self, state: dict[str, Tensor]) -> None:
        V = state["exp_avg_sq"]
        for side, key, dim in (("L", "Q_L", 0), ("R", "Q_R", 1)):
            if key not in state:
                continue
            F, Q = state[side], state[key]
            FQ = F @ Q
            order = torch.argsort((Q * FQ).sum(dim=0), descending=True)  # diag(Q^T F Q)
            V = V.index_select(dim, order)
            state[key] = torch.linalg.qr(FQ.index_select(1, order)).Q
        state["exp_avg_sq"] = V

    def direction(self, grad: Tensor, state: dict[str, Tensor], info: MatrixInfo, step: int) -> Tensor:
        G = grad.reshape(info.shape2d)
        if step == 1:
            self._update_factors(G, state)
            for side, key in (("L", "Q_L"), ("R", "Q_R")):
                if side in state:
                    state[key] = eigh_descending(state[side], torch.float32)[1].to(G.dtype)
            return torch.zeros_like(grad)
        b1, b2 = self.betas
        G_rot = self._project(G, state)
        M, V = state["exp_avg"], state["exp_avg_sq"]
        M.lerp_(G, 1 - b1)
        V.mul_(b2).addcmul_(G_rot, G_rot, value=1 - b2)
        N = self._project_back(self._project(M, state) / V.sqrt().add_(self.eps), state)
        self._update_factors(G, state)
        if (step - 1) % self.precondition_frequency == 0:
            self._refresh_basis(state)
        return N.reshape(grad.shape)

    def scales(self, lr: float, weight_decay: float, info: MatrixInfo, step: int) -> tuple[float, float]:
        if step == 1:
            return 1.0, 0.0  # the first step only builds the eigenbasis
        k = step - 1
        b1, b2 = self.betas
        step_size = lr * (1 - b2**k) ** 0.5 / (1 - b1**k) if self.correct_bias else lr
        return 1.0 - lr * weight_decay, step_size

    def state_axes(self, key: str, shape: tuple[int, ...], info: MatrixInfo) -> tuple[str, ...] | None:
        # M lives in the original space; V in eigen-coordinates on the rotated sides (an
        # unrotated side is the original one); a basis maps eigen-coordinates to original ones
        rot_l, rot_r = self.rotated(info.shape2d)
        return {"exp_avg": ("row", "col"),
                "exp_avg_sq": ("fixed" if rot_l else "row", "fixed" if rot_r else "col"),
                "L": ("row", "row"), "R": ("col", "col"),
                "Q_L": ("row", "fixed"), "Q_R": ("col", "fixed")}.get(key)

    # ---------------------------------------------------------------- the cost
    def flops(self, shape: tuple[int, int], num_heads: int | None = None) -> Flops:
        m, n = shape
        rot_l, rot_r = self.rotated(shape)
        side_l = matmul_flops(m, m, n) if rot_l else 0.0  # one rotation on the left
        side_r = matmul_flops(m, n, n) if rot_r else 0.0
        stats = (matmul_flops(m, n, m) if rot_l else 0.0) + (matmul_flops(n, m, n) if rot_r else 0.0)  # L, R
        per_step = 3 * (side_l + side_r) + stats  # G', M', and N back; the statistics
        refresh = sum(matmul_flops(k, k, k) + QR_FLOPS_PER_K3 * k**3 for k, rot in ((m, rot_l), (n, rot_r)) if rot)
        first = stats + sum(EIGH_FLOPS_PER_K3 * k**3 for k, rot in ((m, rot_l), (n, rot_r)) if rot)
        return Flops(per_step + refresh / self.precondition_frequency, max(per_step + refresh, first))

    def state_bytes(self, shape: tuple[int, int], num_heads: int | None = None) -> float:
        m, n = shape
        rot_l, rot_r = self.rotated(shape)
        factors = (2 * m * m if rot_l else 0) + (2 * n * n if rot_r else 0)  # statistics + eigenbasis
        return 4.0 * (2 * m * n + factors)

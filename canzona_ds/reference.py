"""The single-process reference: the oracle every distributed test and benchmark compares to.

:class:`ReferenceOptimizer` is the plainest possible use of a rule: one process, every
matrix whole (the TP=1 model), no plan, no flat buffers, no collectives::

    for every matrix W with gradient G:   D = rule.direction(G, state[W], info, t)
                                           W <- decay * W - step_size * D
    the other parameters:                 torch.optim.AdamW

With the Muon rule it equals ``torch.optim.Muon`` + ``torch.optim.AdamW`` bit for bit
(tests/test_optim_muon.py), so for Muon the distributed results are checked against torch
itself.  SOAP's rule is cross-checked against heavyball 3.2.1's SOAP, and Shampoo's against
an independent from-the-paper Kronecker-product implementation (heavyball has no plain
Shampoo): tests/test_optim_crosscheck.py, with every difference explained there.

:func:`zero_average` reproduces ZeRO's average over DP ranks (each rank's gradient divided
by dp, then summed in rank order), so a single process can feed the reference the gradients a
DP run computes.  Gradient clipping in the reference is torch's own
``torch.nn.utils.clip_grad_norm_`` (what a single-process user runs), never a re-implementation
of DeepSpeed's path: ``gradient_clipping`` must equal it (integration/clip.py).

A parameter without a gradient is stepped with a zero gradient, as in
:class:`~canzona_ds.optimizer.CanzonaOptimizer` (DeepSpeed ZeRO's semantics).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor

from .config import CanzonaConfig
from .optim.rule import MatrixInfo, rule_step


class ReferenceOptimizer:
    """Rule on every whole matrix + torch.optim.AdamW on the rest, one process."""

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], config: CanzonaConfig,
                 num_experts: int | None = None) -> None:
        self.config = config
        self.rule = config.rule
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.matrices, aux = [], []
        for n, p in named:
            (self.matrices if config.is_matrix(n, tuple(p.shape), getattr(p, "use_muon", None)) else aux).append((n, p))
        self.infos = {}
        for n, p in self.matrices:
            experts = config.experts_of(n, tuple(p.shape), num_experts)  # a stack: rule_step per expert
            heads = getattr(p, "muon_num_heads", None) if config.per_head_muon and experts is None else None
            self.infos[n] = MatrixInfo(n, tuple(p.shape), heads, experts)
        self.aux = [p for _, p in aux]
        self.state: dict[str, dict[str, Tensor]] = {}
        self.step_count = 0
        self.lr, self.weight_decay = config.lr, config.weight_decay
        self.adamw = torch.optim.AdamW(self.aux, lr=config.adam_lr, betas=config.adam_betas, eps=config.adam_eps,
                                       weight_decay=config.weight_decay) if self.aux else None

    def set_lr(self, matrix_lr: float, adam_lr: float) -> None:
        self.lr = matrix_lr
        if self.adamw is not None:
            for g in self.adamw.param_groups:
                g["lr"] = adam_lr

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        t = self.step_count
        for name, p in self.matrices:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            rule_step(self.rule, p, grad, self.state, self.infos[name], t, self.lr, self.weight_decay)
        if self.adamw is not None:
            for p in self.aux:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.adamw.step()

    def zero_grad(self) -> None:
        for _, p in self.matrices:
            p.grad = None
        for p in self.aux:
            p.grad = None


def zero_average(per_rank_grads: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """ZeRO's DP average: every rank's gradient divided by dp, then summed in rank order
    (bit-identical to gloo's reduction for dp <= 2; within rounding beyond)."""
    dp = len(per_rank_grads)
    out = {n: torch.zeros_like(g) for n, g in per_rank_grads[0].items()}
    for grads in per_rank_grads:
        for n, g in grads.items():
            out[n] += g / dp
    return out

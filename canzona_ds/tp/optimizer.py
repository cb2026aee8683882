"""``TPMuon``: a torch optimizer over one TP rank's parameters (matrices exact via TP-ASC).

Matrices (``default_is_matrix``: ndim >= 2, not an embedding/head) go through one
:class:`~canzona_ds.tp.runtime.TPMuonRuntime`; everything else (norms, biases, embeddings,
vocab-parallel shards) through ``torch.optim.AdamW``, which is element-wise and hence
exact on shards.  Gradients must already be reduced over data parallelism (DeepSpeed
does that for a client optimizer at ZeRO stage 0); every DP rank then computes the same
update.  Sharding the *matrices* over DP too is the ZeRO-1 integration's job: it calls
the runtime with only the matrices its DP plan owns (see docs/tp.md).

Param groups: ``param_groups[0]`` = Muon matrices, ``param_groups[1]`` = AdamW params,
so Megatron's / DeepSpeed's lr schedulers can drive both ``lr`` values; each carries
``lr_mult`` (1 and adamw_lr / muon_lr) for Megatron's scheduler, which sets
``lr = schedule_lr * lr_mult``: pass Megatron ``--lr`` equal to the Muon lr.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import Tensor

from ..planning.params import default_is_matrix
from .runtime import TPMatrix, TPMuonConfig, TPMuonRuntime


class TPMuon(torch.optim.Optimizer):
    def __init__(self, named_params: Iterable[tuple[str, Tensor]], tp_group=None,
                 config: TPMuonConfig | None = None, *, adamw_lr: float = 1e-3,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.0, tp_size: int | None = None,
                 matrix_filter: Callable[[str, tuple[int, ...]], bool] = default_is_matrix) -> None:
        import torch.distributed as dist

        self.config = config or TPMuonConfig()
        tp_size = tp_size or (dist.get_world_size(tp_group) if dist.is_initialized() else 1)
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("TPMuon got no trainable parameters")
        mats = [(n, p) for n, p in named if matrix_filter(n, tuple(p.shape))]
        aux = [(n, p) for n, p in named if not matrix_filter(n, tuple(p.shape))]
        self.matrix_names = [n for n, _ in mats]
        self.aux_names = [n for n, _ in aux]
        # lr_mult: Megatron's OptimizerParamScheduler sets every group's lr to
        # schedule_lr * lr_mult, so with --lr = Muon's lr the AdamW group keeps its ratio
        groups = [{"params": [p for _, p in mats], "lr": self.config.lr, "kind": "muon", "lr_mult": 1.0}]
        if aux:
            mult = adamw_lr / self.config.lr if self.config.lr > 0 else 1.0
            groups.append({"params": [p for _, p in aux], "lr": adamw_lr, "kind": "adamw", "lr_mult": mult})
        super().__init__(groups, {})
        self.runtime = TPMuonRuntime([TPMatrix.from_param(n, p, tp_size) for n, p in mats], tp_group, self.config) if mats else None
        self.adamw = torch.optim.AdamW([p for _, p in aux], lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                       weight_decay=adamw_weight_decay) if aux else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.runtime is not None:
            params = self.param_groups[0]["params"]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            self.runtime.step(params, grads, lr=self.param_groups[0]["lr"])
        if self.adamw is not None:
            self.adamw.param_groups[0]["lr"] = self.param_groups[1]["lr"]
            self.adamw.step()
        return loss

    def state_dict(self):
        return {"tp_muon": self.runtime.state_dict() if self.runtime else None,
                "adamw": self.adamw.state_dict() if self.adamw else None,
                "lrs": [g["lr"] for g in self.param_groups]}

    def load_state_dict(self, sd):
        if self.runtime is not None:
            self.runtime.load_state_dict(sd["tp_muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(sd["adamw"])
        for g, lr in zip(self.param_groups, sd["lrs"]):
            g["lr"] = lr

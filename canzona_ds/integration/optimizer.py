"""``CanzonaMuon``: Muon for matrices + AdamW for the rest, in one torch optimizer.

It is the "basic optimizer" DeepSpeed wraps.  Two param groups, each tagged with
``canzona_role``:

    group "matrix"  Muon   params in the ownership plan's buffer order (rank 0's first)
    group "aux"     AdamW  everything else, model order

Alone (single process, or ZeRO stage 0 with ``replicated``) it steps real parameters:
the update equals ``torch.optim.Muon`` on the matrices plus ``torch.optim.AdamW`` on the
rest, bit for bit.  Under ZeRO-1 the wrapper (``deepspeed_zero1.CanzonaZeroOneOptimizer``)
replaces each group's params with this rank's flat fp32 partition and calls
:meth:`bind_flat_partition` with where every owned matrix lies inside it:

    flat fp32 partition of the matrix group on rank r (P elements)
    | W_a (rows_a x cols_a) | pad | W_d (...) |   pad to P   |
      ^ view(offset=0)            ^ view(offset=k)

``step`` then runs ``muon_update`` on views of that partition (its grad and momentum have
the same layout): every matrix is whole on its owner, so the step makes no collective
call.  The AdamW half is element-wise, so it runs on the flat partition directly.

Parameters are never tagged ``use_muon``: DeepSpeed's ZeRO runs its own Newton-Schulz
for optimizers whose class name contains "muon" when parameters carry that flag.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch.optim.adamw import adamw as _adamw_functional
from torch import Tensor

from canzona_ds.integration.config import CanzonaMuonConfig
from canzona_ds.optim.muon import muon_update
from canzona_ds.planning.params import ParamSpec

MATRIX, AUX = "matrix", "aux"


@dataclass(frozen=True)
class FlatView:
    """One matrix inside a flat partition."""

    offset: int
    shape: tuple[int, ...]
    name: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class CanzonaMuon(torch.optim.Optimizer):
    """Muon (matrices) + AdamW (rest), with an exact ZeRO-1 ownership plan.

    Args:
        named_parameters: ``(name, parameter)`` pairs; frozen parameters are skipped.
        config: a :class:`CanzonaMuonConfig` or a ds_config ``optimizer.params`` dict.
        dp_world_size: data-parallel ranks the matrices are planned over (1 = no ZeRO).
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        config: CanzonaMuonConfig | Mapping[str, Any] | None = None,
        dp_world_size: int = 1,
    ) -> None:
        cfg = config if isinstance(config, CanzonaMuonConfig) else CanzonaMuonConfig.from_params(config)
        if not isinstance(dp_world_size, int) or dp_world_size < 1:
            raise ValueError(f"Invalid dp_world_size={dp_world_size!r}. Must be an int >= 1.")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError("A parameter appears twice in named_parameters (tied weights must be passed once).")
        for _, p in named:
            # Keep DeepSpeed's stock Newton-Schulz path off (stage_1_and_2._is_muon_group).
            if hasattr(p, "use_muon"):
                del p.use_muon
        matrices = [(n, p) for n, p in named if cfg.is_matrix(n, tuple(p.shape))]
        aux = [(n, p) for n, p in named if not cfg.is_matrix(n, tuple(p.shape))]
        self.config = cfg
        self.dp_world_size = dp_world_size
        self.plan = None
        if not matrices:
            warnings.warn(
                "CanzonaMuon: no parameter qualifies as a Muon matrix (ndim >= 2, name without "
                f"{list(cfg.matrix_exclude)}); every parameter uses AdamW. Set matrix_include to change this.",
                stacklevel=2,
            )
        elif not cfg.replicated:
            from canzona_ds.planning.dp import plan_dp

            specs = [ParamSpec(name=n, shape=tuple(p.shape), role="matrix") for n, p in matrices]
            self.plan = plan_dp(specs, dp_world_size, planner=cfg.planner, alpha=cfg.alpha, cost=cfg.cost_model)
            if self.plan.split_params:
                raise ValueError(
                    f"planner={cfg.planner!r} cuts matrices across ranks ({len(self.plan.split_params)} split); "
                    "CanzonaMuon needs an atomic planner (every matrix whole on one rank), e.g. 'lpt'."
                )
            if sorted(self.plan.buffer_order()) != list(range(len(matrices))):
                raise RuntimeError(f"Planner {cfg.planner!r} did not assign every matrix exactly once.")
            matrices = [matrices[i] for i in self.plan.buffer_order()]
        self.param_names = {id(p): n for n, p in named}
        self.matrix_names = [n for n, _ in matrices]
        groups = []
        if matrices:
            groups.append(dict(
                params=[p for _, p in matrices], canzona_role=MATRIX, lr=cfg.muon_lr, momentum=cfg.momentum,
                weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                ns_coefficients=tuple(cfg.ns_coefficients), ns_eps=cfg.ns_eps, adjust_lr_fn=cfg.adjust_lr_fn,
                ns_method=cfg.ns_method,
            ))
        if aux:
            groups.append(dict(
                params=[p for _, p in aux], canzona_role=AUX, lr=cfg.adam_lr, betas=tuple(cfg.betas), eps=cfg.eps,
                weight_decay=cfg.weight_decay,
            ))
        if not groups:
            raise ValueError("CanzonaMuon got no trainable parameters.")
        super().__init__(groups, {})
        #: id(flat partition) -> matrices inside it (set by the ZeRO-1 wrapper)
        self._flat_views: dict[int, tuple[FlatView, ...]] = {}
        #: DP x TP (set by the ZeRO-1 wrapper when deepspeed.initialize got an mpu with TP > 1):
        #: a canzona_ds.tp.TPMuonRuntime over the TP-split matrices this DP rank owns, and
        #: their names; those matrices are stepped by it instead of local muon_update.
        self.tp_runtime = None
        self._tp_names: frozenset = frozenset()

    # ------------------------------------------------------------------ ZeRO-1 hook
    def bind_flat_partition(self, flat_param: Tensor, views: Iterable[FlatView]) -> None:
        """Declare that ``flat_param`` (a matrix-group partition) holds these matrices."""
        views = tuple(views)
        for v in views:
            if v.offset < 0 or v.offset + v.numel > flat_param.numel():
                raise RuntimeError(f"Matrix {v.name} at offset {v.offset} does not fit in a partition of "
                                   f"{flat_param.numel()} elements.")
        self._flat_views[id(flat_param)] = views

    def bind_tp_runtime(self, runtime, names: Iterable[str]) -> None:
        """Step the owned TP-split matrices ``names`` (runtime order) through ``runtime``."""
        names = tuple(names)
        if [m.name for m in runtime.matrices] != list(names):
            raise RuntimeError("TP runtime matrices differ from the names bound to it.")
        self.tp_runtime, self._tp_names = runtime, frozenset(names)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["canzona_role"] == MATRIX:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        kw = dict(
            lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
            nesterov=group["nesterov"], ns_steps=group["ns_steps"], ns_coefficients=tuple(group["ns_coefficients"]),
            eps=group["ns_eps"], adjust_lr_fn=group["adjust_lr_fn"], ns_method=group["ns_method"],
        )
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            views = self._flat_views.get(id(p))
            if views is None:  # a real matrix (no ZeRO)
                muon_update(p, p.grad, buf, **kw)
                continue
            tp_params, tp_grads = [], []
            for v in views:  # whole matrices inside this rank's flat partition
                sl = slice(v.offset, v.offset + v.numel)
                if v.name in self._tp_names:  # TP shard: updated holistically by the TP runtime
                    tp_params.append(p[sl].view(v.shape))
                    tp_grads.append(p.grad[sl].view(v.shape))
                    continue
                muon_update(p[sl].view(v.shape), p.grad[sl].view(v.shape), buf[sl].view(v.shape), **kw)
            if self.tp_runtime is not None:
                # every rank of the TP group calls this (same owned list by the DP plan)
                self.tp_runtime.step(tp_params, tp_grads, lr=group["lr"])

    def _adamw_group(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                # same state layout as torch.optim.AdamW
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adamw_functional(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
            differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )

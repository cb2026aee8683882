"""``CanzonaOptimizer``: one matrix rule on the matrices this rank owns or hosts, AdamW on the rest.

One class serves every placement; where a matrix is updated is a strategy it delegates to:

* **local** (one process, or ZeRO stage 0 where every DP rank steps everything): the
  matrix group holds the real parameters; each matrix is updated in place.
* **DP ownership** (ZeRO stage 1/2): the ZeRO integration replaces the matrix group's
  parameters by this rank's flat fp32 partition and calls :meth:`bind_partition` with
  where each owned matrix lies in it (the layout of ``planning/layout.py``)::

      flat fp32 partition of rank r (P elements)
      | W_a (rows_a x cols_a) | W_d (...) |   pad to P   |
        ^ view(offset=0)        ^ view(offset=k)

  Every matrix is whole on its owner, so the step makes no collective call.
* **TP hosting**: matrices split by tensor parallelism (Megatron ``tensor_model_parallel``,
  DeepSpeed AutoTP) go through a :class:`~canzona_ds.tp.runtime.MicroGroupRuntime`: shards
  are gathered to a host, the rule runs on the full matrix, update shards come back.

Param groups (``canzona_role``)::

    "matrix"  the matrix rule; params in the DP plan's buffer order (rank 0's first)
    "aux"     AdamW (torch's functional AdamW, bit-exact vs torch.optim.AdamW)

Both groups carry ``lr`` and ``weight_decay`` read at every step, so any lr scheduler
drives them.  The optimizer's step count (``param_groups[matrix]["step"]``) is the
``step`` the rules see.  A parameter without a gradient is stepped with a zero gradient
(momentum and weight decay still apply): DeepSpeed's ZeRO does the same for every
optimizer, since its flat gradient partition has no "None", and the single-process
reference (``optim/reference.py``) follows the same rule so that results stay equal.

Per-matrix rule state lives in ``matrix_state`` (name -> dict of tensors, on the matrix's
device), saved under ``"canzona"`` in :meth:`state_dict`.  Keyed by name, it can follow
its matrix to another rank when the DP or TP size changes.

Parameters are never tagged ``use_muon`` here, and the class name contains no "muon":
DeepSpeed's ZeRO would otherwise run its own Newton-Schulz on them.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _adamw_functional

from ..planning.dp import OwnershipPlan, plan_dp
from ..planning.params import ParamSpec
from .config import CanzonaConfig
from .rule import MatrixInfo, apply_update

MATRIX, AUX = "matrix", "aux"
STATE_KEY = "canzona"


@dataclass(frozen=True)
class FlatView:
    """One matrix inside a flat partition."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class CanzonaOptimizer(torch.optim.Optimizer):
    """A matrix rule (Muon, Shampoo, SOAP, ...) + AdamW, placed by DP ownership / TP hosting.

    Args:
        named_parameters: ``(name, parameter)`` pairs; frozen parameters are skipped.
        config: a :class:`CanzonaConfig` (``CanzonaConfig.from_ds(type, params)``).
        dp_world_size: DP ranks the matrices are planned over.
        zero: the matrices are partitioned by ZeRO (stage 1/2): plan ownership even at
            ``dp_world_size`` 1 and wait for :meth:`bind_partition`; otherwise every matrix
            is updated here (one process, or ZeRO stage 0).
        tp_group, tp_size: the tensor-parallel group; matrices tagged ``tensor_model_parallel``
            are updated through the micro-group runtime (needs ``tp_size`` >= 2).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], config: CanzonaConfig,
                 dp_world_size: int = 1, zero: bool = False, tp_group: Any = None, tp_size: int = 1) -> None:
        if not isinstance(config, CanzonaConfig):
            raise TypeError(f"config must be a CanzonaConfig, got {type(config).__name__}")
        for name, v in (("dp_world_size", dp_world_size), ("tp_size", tp_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Invalid {name}={v!r}. Must be an int >= 1.")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("CanzonaOptimizer got no trainable parameters.")
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError("A parameter appears twice in named_parameters (tied weights must be passed once).")
        self.config = config
        self.rule = config.rule
        #: trainable parameter names in the order given (the model's): the order in which
        #: gradient clipping stacks per-parameter norms, as clip_grad_norm_(model.parameters())
        self.param_order = [n for n, _ in named]
        self.dp_world_size = dp_world_size
        self.tp_group, self.tp_size = tp_group, tp_size
        matrices, aux = [], []
        for n, p in named:
            (matrices if config.is_matrix(n, tuple(p.shape), getattr(p, "use_muon", None)) else aux).append((n, p))
        #: every matrix's description, by name (full shape for TP-split matrices)
        self.infos: dict[str, MatrixInfo] = {}
        self.tp_matrices: dict = {}
        specs = []
        for n, p in matrices:
            spec, info, tpm = self._describe(n, p)
            specs.append(spec)
            self.infos[n] = info
            if tpm is not None:
                self.tp_matrices[n] = tpm
        if not matrices:
            warnings.warn(
                f"CanzonaOptimizer({self.rule.name}): no parameter qualifies as a matrix (ndim >= 2, name without "
                f"{list(config.placement.matrix_exclude)}); every parameter uses AdamW. Set matrix_include to "
                "change this.", stacklevel=2)
        #: the DP ownership plan (None: every matrix is updated on this rank)
        self.plan: OwnershipPlan | None = None
        if dp_world_size > 1 and not zero:
            raise ValueError(f"dp_world_size={dp_world_size} without zero=True: only ZeRO partitions matrices over DP "
                             "ranks; without it every rank updates every matrix (pass dp_world_size=1).")
        self.zero = zero
        if matrices and zero:
            self.plan = _plan(specs, dp_world_size, config, self.rule)
            matrices = [matrices[i] for i in self.plan.buffer_order()]
        self.matrix_names = [n for n, _ in matrices]
        self.aux_names = [n for n, _ in aux]
        groups = []
        if matrices:
            groups.append(dict(params=[p for _, p in matrices], canzona_role=MATRIX, lr=config.lr,
                               weight_decay=config.weight_decay, step=0))
        if aux:
            groups.append(dict(params=[p for _, p in aux], canzona_role=AUX, lr=config.adam_lr,
                               betas=tuple(config.adam_betas), eps=config.adam_eps, weight_decay=config.weight_decay))
        super().__init__(groups, {})
        #: rule state by matrix name (this rank's owned/local matrices and hosted TP matrices)
        self.matrix_state: dict[str, dict[str, Tensor]] = {}
        #: id(flat partition) -> the matrices inside it (ZeRO)
        self._flat_views: dict[int, tuple[FlatView, ...]] = {}
        self.tp_runtime = None
        if self.tp_matrices and not zero:
            self._build_tp_runtime([n for n, _ in matrices if n in self.tp_matrices])

    # ------------------------------------------------------------------ setup
    def _describe(self, name: str, p: Tensor):
        from ..tp.runtime import TPMatrix

        heads = getattr(p, "muon_num_heads", None) if self.config.per_head_muon else None
        if TPMatrix.is_split(p, self.tp_size):
            tpm = TPMatrix.from_param(name, p, self.tp_size)
            if not self.config.per_head_muon:
                tpm = TPMatrix(tpm.name, tpm.full_shape, tpm.partition_dim, tpm.shard_sizes, None)
            spec = ParamSpec(name, tuple(p.shape), "matrix", tp_partition_dim=tpm.partition_dim, tp_size=self.tp_size,
                             num_heads=tpm.num_heads)
            return spec, tpm.info, tpm
        spec = ParamSpec(name, tuple(p.shape), "matrix", num_heads=heads)
        return spec, MatrixInfo(name, tuple(p.shape), heads), None

    def _build_tp_runtime(self, names: list[str]) -> None:
        from ..tp.runtime import MicroGroupRuntime

        if self.tp_size < 2:
            raise ValueError(f"{len(names)} matrices are tensor-parallel but tp_size={self.tp_size}")
        self.tp_runtime = MicroGroupRuntime([self.tp_matrices[n] for n in names], self.rule, self.tp_group,
                                            self.config.tp, state=self.matrix_state)

    def bind_partition(self, flat_param: Tensor, views: Iterable[FlatView]) -> None:
        """ZeRO: ``flat_param`` (this rank's partition of the matrix group) holds ``views``."""
        views = tuple(views)
        for v in views:
            if v.name not in self.infos:
                raise RuntimeError(f"bind_partition: {v.name!r} is not one of this optimizer's matrices.")
            if v.offset < 0 or v.offset + v.numel > flat_param.numel():
                raise RuntimeError(f"Matrix {v.name} at offset {v.offset} does not fit in a partition of "
                                   f"{flat_param.numel()} elements.")
        self._flat_views[id(flat_param)] = views
        split = [v.name for v in views if v.name in self.tp_matrices]
        if split:
            self._build_tp_runtime(split)

    def handled_names(self) -> list[str]:
        """Matrices whose rule state this rank keeps: owned/local ones that are not TP-split,
        and the TP-split ones it hosts."""
        if self._flat_views:
            mine = [v.name for views in self._flat_views.values() for v in views]
        else:
            mine = list(self.matrix_names)
        out = [n for n in mine if n not in self.tp_matrices]
        if self.tp_runtime is not None:
            out += self.tp_runtime.hosted_names()
        return out

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["canzona_role"] == MATRIX:
                self._matrix_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _matrix_items(self, group: dict) -> list[tuple[str, Tensor, Tensor]]:
        """(name, parameter, gradient) of every matrix this rank updates or co-hosts."""
        if not self._flat_views:  # local: the group holds the real matrices, in matrix_names order
            return [(n, p, p.grad if p.grad is not None else torch.zeros_like(p))
                    for n, p in zip(self.matrix_names, group["params"])]
        items = []
        for p in group["params"]:  # ZeRO: views of this rank's flat partition
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            for v in self._flat_views.get(id(p), ()):
                sl = slice(v.offset, v.offset + v.numel)
                items.append((v.name, p[sl].view(v.shape), grad[sl].view(v.shape)))
        return items

    def _matrix_step(self, group: dict) -> None:
        group["step"] += 1
        step, lr, wd = group["step"], group["lr"], group["weight_decay"]
        rule = self.rule
        tp_params, tp_grads = [], []
        for name, param, grad in self._matrix_items(group):
            if name in self.tp_matrices:
                tp_params.append(param)
                tp_grads.append(grad)
                continue
            info = self.infos[name]
            state = self.matrix_state.get(name)
            if state is None:
                state = self.matrix_state[name] = rule.init_state(info, like=param)
            direction = rule.direction(grad, state, info, step)
            decay, step_size = rule.scales(lr, wd, info, step)
            apply_update(param, direction, decay, step_size)
        if self.tp_runtime is not None:
            # every rank of the TP group calls this (the same owned list, by the DP plan)
            self.tp_runtime.step(tp_params, tp_grads, lr=lr, weight_decay=wd, step=step)

    def _adamw_step(self, group: dict) -> None:
        adamw_group_step(group, self.state)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd[STATE_KEY] = {
            "rule": self.rule.name,
            "matrix_state": {n: dict(st) for n, st in self.matrix_state.items()},
            "config": self.config.describe(),
        }
        return sd

    def load_state_dict(self, state_dict: Mapping) -> None:
        state_dict = dict(state_dict)
        canzona = state_dict.pop(STATE_KEY, None)
        super().load_state_dict(state_dict)
        if canzona is None:
            return
        if canzona.get("rule") != self.rule.name:
            raise ValueError(f"This optimizer state was written by rule {canzona.get('rule')!r}; this optimizer runs "
                             f"{self.rule.name!r}. Load it with the same optimizer type.")
        self.load_matrix_state(canzona["matrix_state"])

    def load_matrix_state(self, matrix_state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Replace the rule state of the matrices named in ``matrix_state``, each tensor moved
        to that matrix's device (keeping its dtype)."""
        device = self._device()
        for name, st in matrix_state.items():
            if name not in self.infos:
                raise ValueError(f"Saved optimizer state has matrix {name!r}, which this model does not have.")
            self.matrix_state[name] = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in st.items()}

    def _device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")


def _plan(specs: list[ParamSpec], dp: int, config: CanzonaConfig, rule) -> OwnershipPlan:
    placement = config.placement
    plan = plan_dp(specs, dp, planner=placement.planner, alpha=placement.alpha, cost=placement.cost_model,
                   model=rule, bucket_numel=placement.bucket_numel)
    if plan.split_params:
        raise ValueError(f"planner={placement.planner!r} cut {len(plan.split_params)} matrices across ranks; "
                         "a matrix optimizer needs every matrix whole on one rank.")
    if sorted(plan.buffer_order()) != list(range(len(specs))):
        raise RuntimeError(f"Planner {placement.planner!r} did not assign every matrix exactly once.")
    return plan.nonempty_first()  # rank 0 must own a matrix (planning/layout.py): relabel ranks


def adamw_group_step(group: dict, state_of) -> None:
    """One torch.optim.AdamW step (bit-exact) of a param group; ``state_of[p]`` is p's state dict.

    A parameter without a gradient steps with a zero one (DeepSpeed ZeRO's semantics)."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        state = state_of[p]
        if len(state) == 0:
            # torch.optim.AdamW's state layout: the step count is a host scalar, as torch keeps it
            # (capturable=False), so reading it never syncs with the device
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    beta1, beta2 = group["betas"]
    _adamw_functional(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
        differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=False,
    )

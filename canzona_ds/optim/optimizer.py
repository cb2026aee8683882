"""``CanzonaOptimizer``: one matrix rule on the matrices this rank updates, AdamW on the rest.

The optimizer holds no placement logic: it chooses a strategy (``canzona_ds/placement/``) and
runs it::

    placement="local"  every matrix is updated here (one process; ZeRO stage 0, where every
                       DP rank steps everything)
    placement="owned"  ZeRO stage 1/2: the DP ownership plan (planning/dp.py) over
                       ``groups.dp_size``; ZeRO lays the matrix group out by it and binds this
                       rank's flat fp32 partition (:meth:`bind_partition`); no collective
    placement="sharded" ZeRO stage 3: every matrix in flat pieces over the DP group
                       (``groups.dp_group``); ZeRO binds this rank's flat fp32 partition and
                       the pieces (:meth:`bind_sharded`); per micro-group the pieces go to a
                       planned host, which runs the rule on the whole matrix (placement/sharded.py)
    + hosted           matrices split by tensor parallelism (``groups.tp_size`` > 1; Megatron
                       ``tensor_model_parallel``, AutoTP) go through the micro-group runtime

Process groups come in one :class:`~canzona_ds.parallel.ParallelGroups`; nothing here
discovers them.

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
from typing import Iterable, Mapping

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _adamw_functional

from ..parallel import ParallelGroups
from ..placement import HOLDING, FlatView, HostedPlacement, StepContext, describe_matrix
from ..planning.dp import OwnershipPlan, plan_dp
from ..planning.params import ParamSpec, expert_stack
from .config import CanzonaConfig
from .rule import MatrixInfo

MATRIX, AUX = "matrix", "aux"
STATE_KEY = "canzona"

__all__ = ["AUX", "MATRIX", "STATE_KEY", "CanzonaOptimizer", "FlatView", "adamw_group_step"]


class CanzonaOptimizer(torch.optim.Optimizer):
    """A matrix rule (Muon, Shampoo, SOAP, ...) + AdamW, placed by a strategy.

    Args:
        named_parameters: ``(name, parameter)`` pairs in the model's order; frozen ones are skipped.
        config: a :class:`CanzonaConfig` (``CanzonaConfig.from_ds(type, params)``).
        groups: the process groups (default: one process).  ``dp_size`` is what the
            "owned" plan balances over; ``tp_group``/``tp_size`` host the TP-split matrices.
        placement: "local", "owned" or "sharded" (module docstring).
        shapes: the whole shape of parameters whose tensor does not show it (ZeRO-3 partitions
            parameters built under ``deepspeed.zero.Init``), by name.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], config: CanzonaConfig,
                 groups: ParallelGroups | None = None, placement: str = "local",
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        if not isinstance(config, CanzonaConfig):
            raise TypeError(f"config must be a CanzonaConfig, got {type(config).__name__}")
        groups = ParallelGroups.single() if groups is None else groups
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a canzona_ds.parallel.ParallelGroups, got {type(groups).__name__}")
        if placement not in HOLDING:
            raise ValueError(f"Invalid placement={placement!r}. Allowed: {sorted(HOLDING)}.")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        shapes = dict(shapes or {})
        shape_of = {n: tuple(shapes.get(n, tuple(p.shape))) for n, p in named}
        if not named:
            raise ValueError("CanzonaOptimizer got no trainable parameters.")
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError("A parameter appears twice in named_parameters (tied weights must be passed once).")
        self.config = config
        self.rule = config.rule
        self.groups = groups
        #: trainable parameter names in the order given (the model's): the order in which
        #: gradient clipping stacks per-parameter norms, as clip_grad_norm_(model.parameters())
        self.param_order = [n for n, _ in named]
        matrices, aux = [], []
        for n, p in named:
            (matrices if config.is_matrix(n, shape_of[n], getattr(p, "use_muon", None)) else aux).append((n, p))
        stacks = [(n, shape_of[n]) for n, p in matrices if expert_stack(n, shape_of[n])]
        if stacks:
            n, shape = stacks[0]
            raise ValueError(
                f"{len(stacks)} parameter(s) are stacks of expert matrices, e.g. {n!r} {list(shape)}: {shape[0]} "
                f"experts of {list(shape[1:])}. {self.rule.name} would update each stack as ONE "
                f"[{shape[0]}, {math.prod(shape[1:])}] matrix, not per expert, and per-expert updates are not "
                "implemented yet. Send the experts to AdamW: add \"experts\" to the optimizer params' "
                f"matrix_exclude (now {list(config.placement.matrix_exclude)}).")
        #: every matrix's description, by name (full shape for TP-split matrices)
        self.infos: dict[str, MatrixInfo] = {}
        #: TP-split matrices (name -> TPMatrix), hosted over the TP group
        self.tp_matrices: dict = {}
        specs = []
        if placement == "sharded" and groups.tp_size > 1:
            raise ValueError(f"placement='sharded' (ZeRO stage 3) with tp_size={groups.tp_size}: ZeRO-3 x tensor "
                             "parallelism is not implemented; use ZeRO stage 1 with TP.")
        for n, p in matrices:
            if placement == "sharded":  # ZeRO-3: the whole shape, pieces over DP (no TP split)
                heads = getattr(p, "muon_num_heads", None) if config.per_head_muon else None
                self.infos[n] = MatrixInfo(n, shape_of[n], heads)
                continue
            spec, info, tpm = describe_matrix(n, p, groups.tp_size, config.per_head_muon)
            specs.append(spec)
            self.infos[n] = info
            if tpm is not None:
                self.tp_matrices[n] = tpm
        if self.tp_matrices and groups.tp_size < 2:
            raise ValueError(f"{len(self.tp_matrices)} matrices are tensor-parallel but tp_size={groups.tp_size}")
        if not matrices:
            warnings.warn(
                f"CanzonaOptimizer({self.rule.name}): no parameter qualifies as a matrix (ndim >= 2, name without "
                f"{list(config.placement.matrix_exclude)}); every parameter uses AdamW. Set matrix_include to "
                "change this.", stacklevel=2)
        #: the DP ownership plan ("owned" placement; None: every matrix is updated on this rank)
        self.plan: OwnershipPlan | None = None
        if matrices and placement == "owned":
            self.plan = _plan(specs, groups.dp_size, config, self.rule)
            matrices = [matrices[i] for i in self.plan.buffer_order()]
        self.matrix_names = [n for n, _ in matrices]
        self.aux_names = [n for n, _ in aux]
        param_groups = []
        if matrices:
            param_groups.append(dict(params=[p for _, p in matrices], canzona_role=MATRIX, lr=config.lr,
                                     weight_decay=config.weight_decay, step=0))
        if aux:
            param_groups.append(dict(params=[p for _, p in aux], canzona_role=AUX, lr=config.adam_lr,
                                     betas=tuple(config.adam_betas), eps=config.adam_eps,
                                     weight_decay=config.weight_decay))
        super().__init__(param_groups, {})
        #: rule state by matrix name (this rank's owned/local matrices and hosted TP matrices)
        self.matrix_state: dict[str, dict[str, Tensor]] = {}
        #: whole shape of every trainable parameter, by name
        self.shapes = shape_of
        self.placement = HOLDING[placement](self.matrix_names)
        if placement == "local":
            self.placement.hosted = self._hosted(self.matrix_names)

    # ------------------------------------------------------------------ placement
    @property
    def tp_group(self):
        return self.groups.tp_group

    @property
    def tp_size(self) -> int:
        return self.groups.tp_size

    @property
    def tp_runtime(self):
        """The micro-group runtime of the hosted TP matrices (None without any)."""
        return None if self.placement.hosted is None else self.placement.hosted.runtime

    @tp_runtime.setter
    def tp_runtime(self, runtime) -> None:  # benchmarks and tests swap in a baseline runtime
        if self.placement.hosted is None:
            raise RuntimeError("This optimizer hosts no TP-split matrices.")
        self.placement.hosted.runtime = runtime

    def _hosted(self, names: list[str]) -> HostedPlacement | None:
        """The hosted strategy for the split matrices among ``names`` (None if there are none)."""
        split = [self.tp_matrices[n] for n in names if n in self.tp_matrices]
        if not split:
            return None
        return HostedPlacement(split, self.rule, self.groups.tp_group, self.config.tp, self.matrix_state)

    def bind_partition(self, flat_param: Tensor, views: Iterable[FlatView]) -> None:
        """ZeRO: ``flat_param`` (this rank's partition of the matrix group) holds ``views``."""
        if self.placement.kind != "owned":
            raise RuntimeError(f"bind_partition on a CanzonaOptimizer with placement={self.placement.kind!r}; ZeRO "
                               "stage 1/2 needs placement='owned'.")
        self.placement.bind(flat_param, views, make_hosted=self._hosted)

    def bind_sharded(self, partition_numel: int, pieces: Iterable, splits: Iterable, group=None) -> None:
        """ZeRO-3: the matrix group's flat fp32 partition (``partition_numel`` elements) holds
        ``pieces`` (:class:`~canzona_ds.placement.FlatPiece`, in ``matrix_names`` order); every
        matrix is cut over ``group`` (default: the DP group) as ``splits``
        (:class:`~canzona_ds.tp.FlatSplit`)."""
        if self.placement.kind != "sharded":
            raise RuntimeError(f"bind_sharded on a CanzonaOptimizer with placement={self.placement.kind!r}; ZeRO "
                               "stage 3 needs placement='sharded'.")
        self.placement.bind(partition_numel, list(pieces), list(splits), self.rule,
                            self.groups.dp_group if group is None else group, self.config.tp, self.matrix_state)

    @property
    def step_stats(self):
        """What the last step's hosted runtime did on this rank (``StepStats``: collectives,
        bytes_sent, flops), or None without hosted matrices."""
        runtime = self.tp_runtime
        return None if runtime is None else runtime.stats

    def expected_collectives(self) -> dict[str, int]:
        """Collectives one step of the hosted runtime issues, from its plan alone."""
        runtime = self.tp_runtime
        return {} if runtime is None else runtime.expected_collectives()

    def handled_names(self) -> list[str]:
        """Matrices whose rule state this rank keeps: owned/local ones that are not TP-split,
        and the TP-split ones it hosts."""
        return self.placement.handled_names()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["params"]:  # ZeRO-3 steps one sub-group at a time, the other groups empty
                continue
            if group["canzona_role"] == MATRIX:
                self._matrix_step(group)
            else:
                adamw_group_step(group, self.state)
        return loss

    def _matrix_step(self, group: dict) -> None:
        group["step"] += 1
        self.placement.step(group, StepContext(self.rule, self.infos, self.matrix_state, group["step"], group["lr"],
                                               group["weight_decay"]))

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

"""Baselines canzona-ds is measured against (benchmarks and tests only, never the product).

Tensor parallelism, same ``step(params, grads, lr, weight_decay, step)`` interface as
:class:`~canzona_ds.tp.runtime.MicroGroupRuntime`, any matrix rule:

* :class:`SynchronousTP` - TP-SC (the paper's synchronous baseline, NVIDIA layer-wise
  style): every split matrix's gradient is all-gathered and EVERY TP rank computes the
  full update, with full optimizer state on every rank.  Exact, redundant.
* :class:`ShardLocalTP` - what DeepSpeed's own Muon does under AutoTP: each rank updates
  its shard as if it were the whole matrix.  No communication, and not the TP=1 update.

Data parallelism:

* :class:`LayerwiseOptimizer` - NVIDIA's layer-wise distributed optimizer (the paper's
  "NV-layerwise", §3.1 Paradigm 2): a torch optimizer for ``deepspeed.initialize(
  optimizer=...)`` at ZeRO stage 0 (DeepSpeed all-reduces every gradient).  Whole layers
  are owned by DP ranks (``planning.dp.plan_layerwise``); each rank runs the matrix rule
  on the matrices of the layers it owns, AdamW on every non-matrix parameter (replicated,
  element-wise, so every rank computes the same values), then every owner broadcasts its
  updated matrices to the other ranks.  Exact: equals the single-process reference.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from canzona_ds.config import CanzonaConfig
from canzona_ds.optim.adamw import adamw_group_step
from canzona_ds.optim.rule import MatrixInfo, MatrixRule, apply_rule_update, rule_state, rule_step
from canzona_ds.planning.dp import OwnershipPlan, plan_dp
from canzona_ds.planning.params import ParamSpec
from canzona_ds.tp.async_tasks import Task, run_blocking, run_pipelined
from canzona_ds.tp.runtime import StepStats, TPMatrix


class SynchronousTP:
    """TP-SC: all-gather + redundant full-matrix update on every TP rank."""

    def __init__(self, matrices: Sequence[TPMatrix], rule: MatrixRule, tp_group=None, pipelined: bool = False) -> None:
        self.matrices, self.rule, self.group, self.pipelined = tuple(matrices), rule, tp_group, pipelined
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        self.state: dict = {}
        self.stats = StepStats()

    def expected_collectives(self) -> dict[str, int]:
        return {"all_gather_into_tensor": len(self.matrices)} if self.matrices else {}

    def step(self, params, grads, lr: float, weight_decay: float, step: int) -> StepStats:
        self.stats = StepStats()
        tasks = [self._task(i, params, grads, lr, weight_decay, step) for i in range(len(self.matrices))]
        (run_pipelined if self.pipelined else run_blocking)(tasks)
        return self.stats

    def _task(self, i: int, params, grads, lr: float, weight_decay: float, step: int) -> Task:
        me, tp, m = self.tp_rank, self.tp_size, self.matrices[i]
        n_max = max(m.local_numel(r) for r in range(tp))
        g = grads[i].detach().reshape(-1)
        if g.numel() < n_max:  # uneven shards: pad to the largest
            g = torch.cat([g, g.new_zeros(n_max - g.numel())])
        out = torch.empty(n_max * tp, dtype=g.dtype, device=g.device)
        self.stats.count("all_gather_into_tensor", g.numel() * g.element_size() * (tp - 1))
        work = dist.all_gather_into_tensor(out, g.contiguous(), group=self.group, async_op=self.pipelined)
        yield
        if work is not None:
            work.wait()
        G = torch.cat([out[r * n_max: r * n_max + m.local_numel(r)].view(m.local_shape(r)) for r in range(tp)],
                      dim=m.partition_dim)
        D = self.rule.direction(G, rule_state(self.state, m.name, self.rule, m.info, like=G), m.info, step)
        self.stats.flops += self.rule.flops(m.info.shape2d, m.num_heads).amortised
        off = sum(m.shard_sizes[:me])
        apply_rule_update(params[i], D.narrow(m.partition_dim, off, m.shard_sizes[me]), self.rule, m.info, step, lr,
                          weight_decay)


class ShardLocalTP:
    """Each TP rank updates its own shard as a whole matrix (DeepSpeed's Muon under AutoTP)."""

    def __init__(self, matrices: Sequence[TPMatrix], rule: MatrixRule, tp_group=None) -> None:
        self.matrices, self.rule = tuple(matrices), rule
        self.tp_rank = dist.get_rank(tp_group) if dist.is_initialized() else 0
        self.state: dict = {}
        self.stats = StepStats()

    def expected_collectives(self) -> dict[str, int]:
        return {}

    def step(self, params, grads: Sequence[Tensor], lr: float, weight_decay: float, step: int) -> StepStats:
        self.stats = StepStats()
        for m, p, g in zip(self.matrices, params, grads):
            info = MatrixInfo(m.name, tuple(p.shape))  # the shard's own shape
            rule_step(self.rule, p, g, self.state, info, step, lr, weight_decay)
            self.stats.flops += self.rule.flops(info.shape2d).amortised
        return self.stats


class LayerwiseOptimizer(torch.optim.Optimizer):
    """NV-layerwise: whole layers owned by DP ranks, the rule on owned matrices, broadcast after.

    For ``deepspeed.initialize(model=..., optimizer=LayerwiseOptimizer(...), config=...)`` with
    ``zero_optimization.stage`` 0 (DeepSpeed all-reduces and averages every gradient, as the
    layer-wise optimizer's DDP mode does; §D.2 "Option A").  One step on rank r:

    1. the matrix rule (``rule_step``: ``init_state`` / ``direction`` / ``scales`` + ``apply_update``,
       as :class:`~canzona_ds.optimizer.CanzonaOptimizer` runs it) on the matrices of
       the layers r owns -- their rule state lives only on r;
    2. AdamW (torch's functional AdamW, bit-exact vs ``torch.optim.AdamW``) on every
       non-matrix parameter, on every rank (replicated: identical inputs, identical results);
    3. for every owner in rank order: its updated matrices are flattened into one buffer per
       dtype and ``dist.broadcast`` from it; the other ranks copy the buffer back into their
       matrices (Megatron's layer-wise optimizer does the same with a flattened all-gatherv).

    One broadcast per owner (and dtype), not one per matrix: the same bytes in ``dp`` calls
    instead of one per matrix (hundreds for an LLM), so the baseline pays bandwidth, not
    per-call latency, for its extra collective -- the stronger, fairer baseline.

    Ownership: ``plan_dp(specs, dp, planner="layerwise", cost=cost, model=rule)``, the same
    pure function on every rank (layers by name prefix up to the layer index, LPT of layers
    by the rule's cost).  ``param_groups``: ``canzona_role`` "matrix" (lr = the rule's lr;
    ``step`` counts optimizer steps) and "aux" (AdamW), so lr schedulers drive both.
    TP-split parameters are not supported (DP only).

    Args:
        named_parameters: ``(name, parameter)`` pairs; frozen ones are skipped.
        config: :class:`CanzonaConfig` (rule, lrs, AdamW settings, which parameters are matrices).
        group: the DP process group (default: the world).
        cost: the cost the layer LPT balances ("flops", "numel", ...).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], config: CanzonaConfig, group=None,
                 cost: str = "flops") -> None:
        if not isinstance(config, CanzonaConfig):
            raise TypeError(f"config must be a CanzonaConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("LayerwiseOptimizer needs torch.distributed initialised (it broadcasts owned matrices).")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("LayerwiseOptimizer got no trainable parameters.")
        self.config, self.rule, self.group = config, config.rule, group
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        matrices, aux = [], []
        for n, p in named:
            if getattr(p, "tensor_model_parallel", False):
                raise ValueError(f"LayerwiseOptimizer is a DP baseline: {n!r} is tensor-parallel (not supported).")
            (matrices if config.is_matrix(n, tuple(p.shape), getattr(p, "use_muon", None)) else aux).append((n, p))
        experts = {n: config.experts_of(n, tuple(p.shape)) for n, p in matrices}  # stacks: per expert
        self.infos = {n: MatrixInfo(n, tuple(p.shape), getattr(p, "muon_num_heads", None)
                                    if config.per_head_muon and experts[n] is None else None, experts[n])
                      for n, p in matrices}
        #: the layer-wise ownership plan (None without matrices)
        self.plan: OwnershipPlan | None = None
        self.owner: dict[str, int] = {}
        if matrices:
            specs = [ParamSpec(n, tuple(p.shape), "matrix", num_heads=self.infos[n].num_heads,
                               num_experts=experts[n]) for n, p in matrices]
            self.plan = plan_dp(specs, self.dp_size, planner="layerwise", cost=cost, model=self.rule)
            self.owner = {n: self.plan.owner[i] for i, (n, _) in enumerate(matrices)}
        self.matrix_names = [n for n, _ in matrices]
        groups = []
        if matrices:
            groups.append(dict(params=[p for _, p in matrices], canzona_role="matrix", lr=config.lr,
                               weight_decay=config.weight_decay, step=0))
        if aux:
            groups.append(dict(params=[p for _, p in aux], canzona_role="aux", lr=config.adam_lr,
                               betas=tuple(config.adam_betas), eps=config.adam_eps, weight_decay=config.weight_decay))
        super().__init__(groups, {})
        #: rule state of the matrices this rank owns, by name
        self.matrix_state: dict[str, dict[str, Tensor]] = {}
        #: collectives of the last step, by name (the broadcasts)
        self.collectives: dict[str, int] = {}

    def owned_names(self, rank: int | None = None) -> list[str]:
        """Matrices DP rank ``rank`` (default: this one) owns and updates."""
        r = self.dp_rank if rank is None else rank
        return [n for n in self.matrix_names if self.owner[n] == r]

    def expected_collectives(self) -> dict[str, int]:
        """Broadcasts per step: one per (owner with matrices, dtype)."""
        group = next((g for g in self.param_groups if g["canzona_role"] == "matrix"), None)
        if group is None:
            return {}
        keys = {(self.owner[n], p.dtype) for n, p in zip(self.matrix_names, group["params"])}
        return {"broadcast": len(keys)} if self.dp_size > 1 and keys else {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.collectives = {}
        for group in self.param_groups:
            if group["canzona_role"] == "matrix":
                self._matrix_step(group)
            else:
                adamw_group_step(group, self.state)
        return loss

    def _matrix_step(self, group: dict) -> None:
        group["step"] += 1
        step, lr, wd = group["step"], group["lr"], group["weight_decay"]
        params = dict(zip(self.matrix_names, group["params"]))
        for name in self.owned_names():
            p = params[name]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            rule_step(self.rule, p, grad, self.matrix_state, self.infos[name], step, lr, wd)
        if self.dp_size == 1:
            return
        for owner in range(self.dp_size):
            mine = [params[n] for n in self.owned_names(owner)]
            for dtype in dict.fromkeys(p.dtype for p in mine):
                tensors = [p for p in mine if p.dtype == dtype]
                flat = _flatten_dense_tensors([t.data for t in tensors])
                dist.broadcast(flat, src=dist.get_global_rank(self.group, owner) if self.group is not None else owner,
                               group=self.group)
                self.collectives["broadcast"] = self.collectives.get("broadcast", 0) + 1
                if owner != self.dp_rank:
                    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, [t.data for t in tensors])):
                        t.data.copy_(synced)


"""Baselines canzona-ds is measured against (benchmarks and tests only, never the product).

Tensor parallelism, same ``step(params, grads, lr, weight_decay, step)`` interface as
:class:`~canzona_ds.tp.runtime.MicroGroupRuntime`, any matrix rule:

* :class:`SynchronousTP` - TP-SC (the paper's synchronous baseline, NVIDIA layer-wise
  style): every split matrix's gradient is all-gathered and EVERY TP rank computes the
  full update, with full optimizer state on every rank.  Exact, redundant.
* :class:`ShardLocalTP` - what DeepSpeed's own Muon does under AutoTP: each rank updates
  its shard as if it were the whole matrix.  No communication, and not the TP=1 update.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.rule import MatrixInfo, MatrixRule, apply_update
from ..tp.async_tasks import Task, run_blocking, run_pipelined
from ..tp.runtime import StepStats, TPMatrix


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
        st = self.state.get(m.name)
        if st is None:  # once: setdefault would build (and drop) a fresh state every step
            st = self.state[m.name] = self.rule.init_state(m.info, like=G)
        D = self.rule.direction(G, st, m.info, step)
        self.stats.flops += self.rule.flops(m.info.shape2d, m.num_heads).amortised
        decay, step_size = self.rule.scales(lr, weight_decay, m.info, step)
        off = sum(m.shard_sizes[:me])
        apply_update(params[i], D.narrow(m.partition_dim, off, m.shard_sizes[me]), decay, step_size)


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
            st = self.state.get(m.name)
            if st is None:
                st = self.state[m.name] = self.rule.init_state(info, like=g)
            D = self.rule.direction(g, st, info, step)
            self.stats.flops += self.rule.flops(info.shape2d).amortised
            decay, step_size = self.rule.scales(lr, weight_decay, info, step)
            apply_update(p, D, decay, step_size)
        return self.stats

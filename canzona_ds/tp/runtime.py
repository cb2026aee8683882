"""TP-ASC runtime: exact Muon for Megatron-style tensor-parallel matrices (paper §4).

Interface (what an optimizer step calls; ZeRO-1 or not, DeepSpeed or not)::

    matrices = [TPMatrix.from_param(name, p, tp_size) for name, p in owned_matrices]
    runtime  = TPMuonRuntime(matrices, tp_group, TPMuonConfig(lr=..., c_max=...))
    ...
    runtime.step(params, grads)      # same order as ``matrices``; updates params in place

* Call it on every rank of one TP group with the *same* ``matrices`` list (same names,
  full shapes, split dims, in the same order).  With Megatron TP that holds by
  construction: every TP rank's model has the same parameters, only shards differ.  Under
  DP x TP each DP index runs its own runtime over the matrices its DP plan owns; the DP
  plan must give every shard of a matrix the same DP index across the TP group
  (:func:`canzona_ds.tp.verify.verify_same_across_group` checks the plan fingerprint).
* ``params[i]`` is this rank's shard of matrix i (a view into a flat buffer is fine),
  ``grads[i]`` its reduced (DP-averaged) gradient shard, same shape.
* Replicated matrices (``partition_dim=None``, e.g. a norm weight made 2-D, or an
  un-split Linear) are updated by plain local Muon on every TP rank: identical inputs,
  identical deterministic math, zero communication, and they stay identical.

Data layout, TP=2, one micro-group with two split matrices (A hosted by rank 0, B by 1)::

    rank 0 holds  A0 B0          rank 1 holds  A1 B1          (shards along partition_dim)

    all_to_all_single #1 (grads)  send r0: [A0 | B0] splits (A0, B0)
                                  send r1: [A1 | B1] splits (A1, B1)
      host 0 receives [A0 | A1] -> G_A = cat(A0, A1, dim=d); momentum_A (full) lives here
      host 1 receives [B0 | B1] -> G_B = cat(B0, B1, dim=d); momentum_B (full) lives here
    hosts: O = muon_direction(G, momentum)           (Newton-Schulz on the FULL matrix)
    all_to_all_single #2 (bf16 directions)  host h slices O along d, shard r -> rank r
    every rank: p.mul_(1 - lr*wd); p.add_(O_r, alpha=-adjusted_lr(lr, FULL shape))

Exactness.  ``cat(shards, dim=d)`` is the full matrix in Megatron's TP layout; for plain
column/row-parallel layers that is the TP=1 matrix itself, for fused layouts (SwiGLU fc1
holds [gate_r; up_r] per rank, QKV holds per-rank q/k/v blocks) it is a row permutation
P of the TP=1 fused matrix.  Momentum is element-wise and Newton-Schulz is equivariant,
NS(P G Q) = P NS(G) Q for permutations P, Q, so the hosted update is the TP=1 update
permuted the same way, i.e. each rank receives exactly its shard of the TP=1 update.
Bit-for-bit equal to single-process Muon on the concatenated matrix; equal up to
float summation order to the TP=1 fused layout (tests/test_tp_runtime.py proves both).
``partition_stride`` > 1 only changes which rows form a shard, so it needs no handling.

Strategies (``TPMuonConfig.strategy``), all through the same interface:
    "asc"    TP-ASC above (default): 2 all_to_all_single per micro-group
    "sc"     TP-SC baseline: all_gather of every shard, redundant Newton-Schulz on every
             rank, full momentum on every rank (NVIDIA layerwise-style); exact
    "local"  shard-local Muon (what DeepSpeed's built-in Muon does under AutoTP):
             no communication, NOT the TP=1 update; kept for measuring that deviation
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.muon import ADJUST_LR_FNS, NS_METHODS, apply_update, muon_direction
from ..planning.cost import COST_MODELS, muon_flops
from ..planning.params import ParamSpec
from ..planning.tp import DEFAULT_TP_SCHEDULER, TP_SCHEDULERS, MicroGroup, MicroGroupPlan, plan_tp
from .async_tasks import Task, run_blocking, run_pipelined

#: dtype Newton-Schulz returns (optim.muon.newton_schulz computes in bf16); update shards
#: travel in it, which halves the scatter volume and loses nothing (apply_update casts it).
DIRECTION_DTYPE = torch.bfloat16

STRATEGIES = ("asc", "sc", "local")


@dataclass(frozen=True)
class TPMatrix:
    """One matrix as every TP rank of the group sees it."""

    name: str
    #: shape of the whole (TP=1) matrix
    full_shape: tuple[int, ...]
    #: dimension Megatron split (0 column-parallel, 1 row-parallel); None = replicated
    partition_dim: int | None
    #: size along ``partition_dim`` of each TP rank's shard (AutoTP allows uneven sizes)
    shard_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.full_shape) < 2:
            raise ValueError(f"{self.name!r}: Muon needs a matrix, got full_shape={self.full_shape}")
        if self.partition_dim is not None:
            if self.partition_dim not in (0, 1):
                raise ValueError(f"{self.name!r}: invalid partition_dim={self.partition_dim!r}. Must be 0, 1 or None.")
            if sum(self.shard_sizes) != self.full_shape[self.partition_dim] or len(self.shard_sizes) < 1:
                raise ValueError(
                    f"{self.name!r}: shard_sizes={self.shard_sizes} do not add up to "
                    f"full_shape[{self.partition_dim}]={self.full_shape[self.partition_dim]}"
                )

    @property
    def is_split(self) -> bool:
        return self.partition_dim is not None and len(self.shard_sizes) > 1

    def local_shape(self, tp_rank: int) -> tuple[int, ...]:
        if not self.is_split:
            return self.full_shape
        s = list(self.full_shape)
        s[self.partition_dim] = self.shard_sizes[tp_rank]
        return tuple(s)

    def local_numel(self, tp_rank: int) -> int:
        return math.prod(self.local_shape(tp_rank))

    @classmethod
    def from_param(cls, name: str, param: Tensor, tp_size: int) -> "TPMatrix":
        """From Megatron attributes (``tensor_model_parallel``, ``partition_dim``) or
        DeepSpeed AutoTP's (``tensor_model_parallel`` + ``ds_autotp_universal_checkpoint_meta``).
        Untagged parameters are replicated."""
        shape = tuple(param.shape)
        if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
            return cls(name, shape, None)
        meta = getattr(param, "ds_autotp_universal_checkpoint_meta", None)
        if hasattr(param, "partition_dim"):
            dim = int(param.partition_dim)
            sizes: tuple[int, ...] = (shape[dim],) * tp_size
        elif isinstance(meta, dict) and meta.get("partition_dim") is not None:
            dim = int(meta["partition_dim"])
            sizes = tuple(int(s) for s in (meta.get("partition_sizes") or (shape[dim],) * tp_size))
        else:
            raise ValueError(f"{name!r} is tagged tensor_model_parallel but carries no partition_dim")
        full = list(shape)
        full[dim] = sum(sizes)
        return cls(name, tuple(full), dim, sizes)


@dataclass(frozen=True)
class TPMuonConfig:
    """Muon hyper-parameters and TP scheduling, validated at construction."""

    #: learning rate (torch.optim.Muon semantics, adjusted by the FULL matrix shape)
    lr: float = 0.02
    #: decoupled weight decay
    weight_decay: float = 0.1
    #: momentum coefficient in [0, 1)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_method: str = "standard"
    #: "asc" (TP-ASC, default), "sc" (all-gather + redundant compute), "local" (inexact)
    strategy: str = "asc"
    #: micro-group scheduler, a name in planning.tp.TP_SCHEDULERS: "lpt_rollback"
    #: (Algorithm 2/3, default), "no_fusion" (one matrix per all-to-all: Figure 14's
    #: "No-Fuse"), "round_robin" (ASC without load balancing)
    scheduler: str = DEFAULT_TP_SCHEDULER
    #: per-host makespan cap of one micro-group, in ``cost`` units of the FULL matrices
    #: (numel: elements each host receives per group).  None = planning.tp's default, the
    #: largest task (smallest valid groups, the most pipelining).  An explicit value
    #: smaller than one matrix's cost is a ValueError naming that matrix.
    c_max: float | None = None
    #: cost model the scheduler balances ("numel", "flops", "memory")
    cost: str = "numel"
    #: overlap gather(k+1) and scatter(k-1) with compute(k); False = one group at a time
    pipelined: bool = True

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"Invalid lr={self.lr!r}. Must be >= 0.")
        if not self.weight_decay >= 0:
            raise ValueError(f"Invalid weight_decay={self.weight_decay!r}. Must be >= 0.")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"Invalid momentum={self.momentum!r}. Must be within [0.0, 1.0).")
        if not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            raise ValueError(f"Invalid ns_steps={self.ns_steps!r}. Must be an int >= 1.")
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn={self.adjust_lr_fn!r}. Allowed: {list(ADJUST_LR_FNS)}")
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"Invalid ns_method={self.ns_method!r}. Allowed: {list(NS_METHODS)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Invalid strategy={self.strategy!r}. Allowed: {list(STRATEGIES)}")
        if self.scheduler not in TP_SCHEDULERS:
            raise ValueError(f"Unknown TP scheduler={self.scheduler!r}. Allowed: {sorted(TP_SCHEDULERS)}")
        if self.cost not in COST_MODELS:
            raise ValueError(f"Invalid cost={self.cost!r}. Allowed: {list(COST_MODELS)}")
        if self.c_max is not None and not self.c_max > 0:
            raise ValueError(f"Invalid c_max={self.c_max!r}. Must be > 0 (or None for auto).")

    @classmethod
    def from_dict(cls, d: dict) -> "TPMuonConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown TP Muon config keys {unknown}. Allowed: {sorted(known)}")
        return cls(**d)


@dataclass
class StepStats:
    """What one ``step`` did on this rank (reset every step)."""

    collectives: dict[str, int] = field(default_factory=dict)
    #: bytes this rank put on the wire (self-sends excluded)
    bytes_sent: int = 0
    #: Newton-Schulz FLOPs this rank computed
    flops: float = 0.0

    def count(self, op: str, nbytes: int) -> None:
        self.collectives[op] = self.collectives.get(op, 0) + 1
        self.bytes_sent += nbytes


def build_plan(matrices: Sequence[TPMatrix], split_idx: Sequence[int], tp_size: int, config: TPMuonConfig) -> MicroGroupPlan | None:
    """Micro-group plan over the split matrices (spec j = matrices[split_idx[j]]).

    Specs carry the FULL shape (a task is the full-matrix update on its host), so AutoTP's
    uneven shards give the same specs, hence the same plan, on every TP rank.
    """
    if not split_idx:
        return None
    specs = [ParamSpec(name=matrices[i].name, shape=tuple(matrices[i].full_shape), role="matrix") for i in split_idx]
    return plan_tp(specs, tp_size, scheduler=config.scheduler, c_max=config.c_max, cost=config.cost)


class TPMuonRuntime:
    """Runs one TP group's Muon step for a fixed list of matrices (see module doc)."""

    def __init__(self, matrices: Sequence[TPMatrix], tp_group=None, config: TPMuonConfig | None = None,
                 *, verify: bool = True) -> None:
        self.config = config or TPMuonConfig()
        self.matrices = tuple(matrices)
        self.group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(tp_group) if dist.is_initialized() else 0
        for m in self.matrices:
            if m.is_split and len(m.shard_sizes) != self.tp_size:
                raise ValueError(f"{m.name!r} has {len(m.shard_sizes)} shards but the TP group has {self.tp_size} ranks")
        names = [m.name for m in self.matrices]
        if len(set(names)) != len(names):
            raise ValueError("TPMatrix names must be unique within one runtime")
        self.split_idx = tuple(i for i, m in enumerate(self.matrices) if m.is_split)
        self.local_idx = tuple(i for i, m in enumerate(self.matrices) if not m.is_split)
        self.plan = build_plan(self.matrices, self.split_idx, self.tp_size, self.config) if self.config.strategy == "asc" else None
        #: momentum buffers by matrix index: full matrices this rank hosts (asc) or all
        #: full matrices (sc), shards (local), and every replicated matrix
        self.state: dict[int, Tensor] = {}
        self.stats = StepStats()
        if verify and self.tp_size > 1:
            from .verify import verify_same_across_group

            verify_same_across_group(self.fingerprint(), self.group, what="TP matrix list / micro-group plan")

    # ---- introspection ---------------------------------------------------------------
    def fingerprint(self) -> str:
        import hashlib
        import json

        payload = {
            "matrices": [(m.name, list(m.full_shape), m.partition_dim, list(m.shard_sizes)) for m in self.matrices],
            "strategy": self.config.strategy,
            "plan": self.plan.fingerprint() if self.plan is not None else None,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def hosted(self, tp_rank: int | None = None) -> list[int]:
        """Matrix indices whose full update ``tp_rank`` computes (asc)."""
        r = self.tp_rank if tp_rank is None else tp_rank
        if self.plan is None:
            return []
        return [self.split_idx[j] for j, h in enumerate(self.plan.host) if h == r]

    def expected_collectives(self) -> dict[str, int]:
        """Collectives one ``step`` issues on this TP group, from the plan alone."""
        if self.tp_size == 1 or self.config.strategy == "local" or not self.split_idx:
            return {}
        if self.config.strategy == "sc":
            return {"all_gather_into_tensor": len(self.split_idx)}
        return {"all_to_all_single": 2 * len(self.plan.groups)}

    # ---- the step ----------------------------------------------------------------------
    def step(self, params: Sequence[Tensor], grads: Sequence[Tensor], lr: float | None = None) -> StepStats:
        if len(params) != len(self.matrices) or len(grads) != len(self.matrices):
            raise ValueError(f"step got {len(params)} params / {len(grads)} grads for {len(self.matrices)} matrices")
        for i, m in enumerate(self.matrices):
            want = m.local_shape(self.tp_rank)
            if tuple(params[i].shape) != want or tuple(grads[i].shape) != want:
                raise ValueError(f"{m.name!r}: expected local shape {want}, got param {tuple(params[i].shape)} "
                                 f"grad {tuple(grads[i].shape)} on TP rank {self.tp_rank}")
        self.stats = StepStats()
        lr = self.config.lr if lr is None else lr
        strategy = self.config.strategy
        if strategy == "local" or self.tp_size == 1:
            for i in range(len(self.matrices)):
                self._local_update(i, params[i], grads[i], lr)
            return self.stats
        if strategy == "sc":
            tasks: list[Task] = [self._sc_task(i, params, grads, lr) for i in self.split_idx]
        else:
            tasks = [self._group_task(g, params, grads, lr) for g in self.plan.groups]
        # replicated matrices: computed while the first collective is in flight
        tasks.insert(min(1, len(tasks)), self._replicated_task(params, grads, lr))
        (run_pipelined if self.config.pipelined else run_blocking)(tasks)
        return self.stats

    # ---- pieces --------------------------------------------------------------------------
    def _direction(self, i: int, G: Tensor) -> Tensor:
        c = self.config
        buf = self.state.get(i)
        if buf is None:
            buf = self.state[i] = torch.zeros_like(G)
        self.stats.flops += muon_flops((G.shape[0], math.prod(G.shape[1:])), c.ns_steps)
        return muon_direction(G, buf, c.momentum, c.nesterov, c.ns_steps, ns_method=c.ns_method)

    def _apply(self, i: int, param: Tensor, direction: Tensor, lr: float) -> None:
        c = self.config
        apply_update(param, direction, lr, c.weight_decay, c.adjust_lr_fn, shape=self.matrices[i].full_shape)

    def _local_update(self, i: int, param: Tensor, grad: Tensor, lr: float) -> None:
        c = self.config
        O = self._direction(i, grad)
        # shard-local ("local" strategy) adjusts lr by the shard's shape, as DeepSpeed does
        apply_update(param, O, lr, c.weight_decay, c.adjust_lr_fn, shape=tuple(param.shape))

    def _replicated_task(self, params, grads, lr) -> Task:
        for i in self.local_idx:
            self._local_update(i, params[i], grads[i], lr)
        return
        yield  # noqa: unreachable - makes this a generator

    def _a2a(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]):
        self.stats.count("all_to_all_single", (inp.numel() - in_splits[self.tp_rank]) * inp.element_size())
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=self.config.pipelined)

    def _group_task(self, group: MicroGroup, params, grads, lr) -> Task:
        """One micro-group: gather grads to hosts, hosts compute, scatter update shards."""
        me, tp = self.tp_rank, self.tp_size
        tasks = [(self.split_idx[j], h) for j, h in group.tasks]
        by_host = [[i for i, h in tasks if h == r] for r in range(tp)]
        mine = by_host[me]
        # stage 1: my gradient shards, grouped by destination host
        gdtype = _common_dtype([grads[i] for i, _ in tasks])
        send_order = [i for r in range(tp) for i in by_host[r]]
        send = torch.cat([grads[i].detach().reshape(-1).to(gdtype) for i in send_order])
        in_splits = [sum(self.matrices[i].local_numel(me) for i in by_host[r]) for r in range(tp)]
        out_splits = [sum(self.matrices[i].local_numel(r) for i in mine) for r in range(tp)]
        recv = torch.empty(sum(out_splits), dtype=gdtype)
        work = self._a2a(recv, send, out_splits, in_splits)
        yield
        if work is not None:
            work.wait()
        # stage 2: hosts rebuild full gradients (TP layout), Muon, slice update shards
        pieces = list(recv.split(out_splits))
        directions: dict[int, Tensor] = {}
        cursors = [0] * tp
        for i in mine:
            m = self.matrices[i]
            shards = []
            for r in range(tp):
                n = m.local_numel(r)
                shards.append(pieces[r][cursors[r]:cursors[r] + n].view(m.local_shape(r)))
                cursors[r] += n
            G = torch.cat(shards, dim=m.partition_dim).to(grads[i].dtype)
            directions[i] = self._direction(i, G)
        send2_parts = []
        for r in range(tp):
            for i in mine:
                m = self.matrices[i]
                O = directions[i]
                if O.dtype != DIRECTION_DTYPE:
                    raise RuntimeError(f"Newton-Schulz returned {O.dtype}, runtime expects {DIRECTION_DTYPE}")
                off = sum(m.shard_sizes[:r])
                send2_parts.append(O.narrow(m.partition_dim, off, m.shard_sizes[r]).reshape(-1))
        send2 = torch.cat(send2_parts) if send2_parts else torch.empty(0, dtype=DIRECTION_DTYPE)
        in2 = [sum(self.matrices[i].local_numel(r) for i in mine) for r in range(tp)]
        out2 = [sum(self.matrices[i].local_numel(me) for i in by_host[r]) for r in range(tp)]
        recv2 = torch.empty(sum(out2), dtype=DIRECTION_DTYPE)
        work2 = self._a2a(recv2, send2, out2, in2)
        yield
        if work2 is not None:
            work2.wait()
        # stage 3: apply my shard of every matrix in the group
        off = 0
        for i in send_order:
            n = self.matrices[i].local_numel(me)
            self._apply(i, params[i], recv2[off:off + n].view(params[i].shape), lr)
            off += n

    def _sc_task(self, i: int, params, grads, lr) -> Task:
        """TP-SC baseline: all-gather one matrix, every rank computes the full update."""
        me, tp = self.tp_rank, self.tp_size
        m = self.matrices[i]
        n_max = max(m.local_numel(r) for r in range(tp))
        g = grads[i].detach().reshape(-1)
        if g.numel() < n_max:  # uneven shards: pad to the largest
            g = torch.cat([g, g.new_zeros(n_max - g.numel())])
        out = torch.empty(n_max * tp, dtype=g.dtype)
        self.stats.count("all_gather_into_tensor", g.numel() * g.element_size() * (tp - 1))
        work = dist.all_gather_into_tensor(out, g.contiguous(), group=self.group, async_op=self.config.pipelined)
        yield
        if work is not None:
            work.wait()
        shards = [out[r * n_max: r * n_max + m.local_numel(r)].view(m.local_shape(r)) for r in range(tp)]
        O = self._direction(i, torch.cat(shards, dim=m.partition_dim))
        off = sum(m.shard_sizes[:me])
        self._apply(i, params[i], O.narrow(m.partition_dim, off, m.shard_sizes[me]), lr)

    # ---- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Momentum this rank holds, by matrix name (hosted full matrices + replicated)."""
        return {"momentum": {self.matrices[i].name: t.clone() for i, t in self.state.items()},
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("fingerprint") != self.fingerprint():
            raise ValueError(f"TP Muon state was saved under plan {sd.get('fingerprint')!r}, "
                             f"this runtime has {self.fingerprint()!r}")
        index = {m.name: i for i, m in enumerate(self.matrices)}
        self.state = {index[n]: t.clone() for n, t in sd["momentum"].items()}


def _common_dtype(ts: Sequence[Tensor]) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype

"""TP-ASC runtime: any matrix rule on Megatron-style tensor-parallel matrices (paper §4).

Interface (what an optimizer step calls; ZeRO or not, DeepSpeed or not)::

    matrices = [TPMatrix.from_param(name, p, tp_size) for name, p in split_matrices]
    runtime  = MicroGroupRuntime(matrices, rule, tp_group, TPConfig(...), state={})
    ...
    runtime.step(params, grads, lr=..., weight_decay=..., step=t)   # updates params in place

* Every rank of one TP group calls it with the *same* ``matrices`` list (same names, full
  shapes, split dims, order).  With Megatron TP that holds by construction: every TP
  rank's model has the same parameters, only the shards differ.  Under DP x TP each DP
  index runs a runtime over the matrices its DP plan owns; the DP plan must give every
  shard of a matrix the same DP index across the TP group (the ZeRO integration checks
  the plan fingerprint across the TP group).
* ``params[i]`` is this rank's shard of matrix i (a view into a flat buffer is fine),
  ``grads[i]`` its reduced (DP-averaged) gradient shard, same shape.
* ``state`` is the optimizer's per-matrix state dict (name -> rule state); the runtime
  fills in the entries of the matrices this rank hosts.

Data layout, TP=2, one micro-group with two split matrices (A hosted by rank 0, B by 1)::

    rank 0 holds  A0 B0          rank 1 holds  A1 B1          (shards along partition_dim)

    all_to_all_single #1 (grads)  send r0: [A0 | B0] splits (A0, B0)
                                  send r1: [A1 | B1] splits (A1, B1)
      host 0 receives [A0 | A1] -> G_A = cat(A0, A1, dim=d); rule state of A lives here
      host 1 receives [B0 | B1] -> G_B = cat(B0, B1, dim=d); rule state of B lives here
    hosts: D = rule.direction(G, state, info, step)          (the FULL matrix)
    all_to_all_single #2 (directions in rule.direction_dtype) host h slices D along d
    every rank: decay, step_size = rule.scales(lr, wd, info(FULL shape), step)
                apply_update(shard, D_r, decay, step_size)

Exactness.  ``cat(shards, dim=d)`` is the full matrix in Megatron's TP layout; for plain
column/row-parallel layers that is the TP=1 matrix itself, for fused layouts (SwiGLU fc1
holds [gate_r; up_r] per rank, QKV holds per-rank q/k/v blocks) it is a row permutation P
of the TP=1 fused matrix.  ``apply_update`` is element-wise and directions travel in the
dtype the rule produced, so every rank receives exactly its shard of the single-process
update of the concatenated matrix: bit-exact (tests/test_tp_runtime.py).  For Muon,
Newton-Schulz is permutation-equivariant, NS(P G Q) = P NS(G) Q, so the update also equals
the TP=1 fused layout's up to float summation order.  Shampoo's and SOAP's factors are
not permutation-equivariant block-wise, so for fused layouts they precondition the TP
layout's matrix (the same matrix on every TP size for plain column/row layers).

Device: every buffer is allocated on the device of the gradients it carries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import TPConfig
from ..optim.rule import MatrixInfo, MatrixRule, apply_rule_update, rule_direction
from ..planning.params import ParamSpec
from ..planning.tp import MicroGroup, MicroGroupPlan, plan_tp
from .async_tasks import Task, run_blocking, run_pipelined


def tp_split(name: str, param: Tensor, tp_size: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(partition_dim, every TP rank's size along it, the whole (TP=1) shape)`` of a TP-split
    parameter of any rank (a matrix, or a 1-D bias split with its layer), from Megatron attributes
    (``tensor_model_parallel``, ``partition_dim``) or DeepSpeed AutoTP's
    (``tensor_model_parallel`` + ``ds_autotp_universal_checkpoint_meta``)."""
    shape = tuple(param.shape)
    meta = getattr(param, "ds_autotp_universal_checkpoint_meta", None)
    if hasattr(param, "partition_dim"):
        dim = int(param.partition_dim)
        sizes: tuple[int, ...] = (shape[dim],) * tp_size
    elif isinstance(meta, dict) and meta.get("partition_dim") is not None:
        dim = int(meta["partition_dim"])
        sizes = tuple(int(s) for s in (meta.get("partition_sizes") or (shape[dim],) * tp_size))
    else:
        raise ValueError(f"{name!r} is tagged tensor_model_parallel but carries no partition_dim")
    if not 0 <= dim < len(shape):
        raise ValueError(f"{name!r}: partition_dim={dim} outside its shape {list(shape)}")
    full = list(shape)
    full[dim] = sum(sizes)
    return dim, sizes, tuple(full)


@dataclass(frozen=True)
class TPMatrix:
    """One TP-split matrix as every TP rank of the group sees it."""

    name: str
    #: shape of the whole (TP=1) matrix
    full_shape: tuple[int, ...]
    #: dimension Megatron split (0 column-parallel, 1 row-parallel)
    partition_dim: int
    #: size along ``partition_dim`` of each TP rank's shard (AutoTP allows uneven sizes)
    shard_sizes: tuple[int, ...]
    #: Muon per-head: heads along dim 0 of the full matrix
    num_heads: int | None = None

    def __post_init__(self) -> None:
        if len(self.full_shape) < 2:
            raise ValueError(f"{self.name!r}: a matrix rule needs a matrix, got full_shape={self.full_shape}")
        if self.partition_dim not in (0, 1):
            raise ValueError(f"{self.name!r}: invalid partition_dim={self.partition_dim!r}. Must be 0 or 1.")
        if len(self.shard_sizes) < 2 or sum(self.shard_sizes) != self.full_shape[self.partition_dim]:
            raise ValueError(f"{self.name!r}: shard_sizes={self.shard_sizes} do not add up to "
                             f"full_shape[{self.partition_dim}]={self.full_shape[self.partition_dim]} over >= 2 ranks")

    @property
    def info(self) -> MatrixInfo:
        return MatrixInfo(self.name, self.full_shape, self.num_heads)

    def local_shape(self, tp_rank: int) -> tuple[int, ...]:
        s = list(self.full_shape)
        s[self.partition_dim] = self.shard_sizes[tp_rank]
        return tuple(s)

    def local_numel(self, tp_rank: int) -> int:
        return math.prod(self.local_shape(tp_rank))

    # -- the split protocol the runtime uses (shared with FlatSplit) ---------------------
    def assemble(self, pieces: Sequence[Tensor]) -> Tensor:
        """The whole matrix from every rank's flat piece (group-rank order)."""
        return torch.cat([x.view(self.local_shape(r)) for r, x in enumerate(pieces)], dim=self.partition_dim)

    def piece(self, whole: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s piece of a whole-matrix tensor, flat."""
        off = sum(self.shard_sizes[:rank])
        return whole.narrow(self.partition_dim, off, self.shard_sizes[rank]).reshape(-1)

    def describe(self) -> list:
        return [self.name, list(self.full_shape), "tp", self.partition_dim, list(self.shard_sizes), self.num_heads]

    @staticmethod
    def is_split(param: Tensor, tp_size: int) -> bool:
        return bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1 and (
            hasattr(param, "partition_dim")
            or (getattr(param, "ds_autotp_universal_checkpoint_meta", None) or {}).get("partition_dim") is not None)

    @classmethod
    def from_param(cls, name: str, param: Tensor, tp_size: int) -> "TPMatrix":
        """From Megatron attributes (``tensor_model_parallel``, ``partition_dim``) or
        DeepSpeed AutoTP's (``tensor_model_parallel`` + ``ds_autotp_universal_checkpoint_meta``)."""
        dim, sizes, full = tp_split(name, param, tp_size)
        heads = getattr(param, "muon_num_heads", None)
        head_dim = getattr(param, "muon_head_dim", None)
        if heads is not None:
            heads = full[0] // head_dim if head_dim else (heads * tp_size if dim == 0 else heads)
        return cls(name, full, dim, sizes, heads)


@dataclass(frozen=True)
class FlatSplit:
    """One matrix whose row-major flat elements are cut into contiguous pieces over a group:
    rank r holds elements ``[starts[r], starts[r] + lengths[r])`` (possibly none).  ZeRO-3's
    per-parameter partitions and ZeRO-1/2's equal chunks cut matrices this way::

        matrix (2 x 5), flat:  a a a a a b b b b b
        ZeRO-3 over 3 ranks:   | a a a a | a b b b | b b . . |   (the last rank's tail is padding)
        starts (0, 4, 8), lengths (4, 4, 2)

    The host rebuilds the whole matrix by concatenating the pieces in rank order, and sends
    every rank back its piece of the direction, so an element-wise update of a piece equals the
    same elements of the whole matrix's update: bit-exact.
    """

    name: str
    #: shape of the whole matrix (>= 2-D; trailing dims are flattened by the rule's shape2d)
    full_shape: tuple[int, ...]
    #: first flat element of every rank's piece
    starts: tuple[int, ...]
    #: element count of every rank's piece (0: the rank holds none of it)
    lengths: tuple[int, ...]
    num_heads: int | None = None
    #: a stack of this many experts along dim 0 (:attr:`MatrixInfo.num_experts`): the host runs
    #: the rule per expert (:func:`~canzona_ds.optim.rule.rule_direction`)
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if len(self.full_shape) < 2:
            raise ValueError(f"{self.name!r}: a matrix rule needs a matrix, got full_shape={self.full_shape}")
        if len(self.starts) != len(self.lengths) or not self.starts:
            raise ValueError(f"{self.name!r}: starts={self.starts} and lengths={self.lengths} must have one entry "
                             "per rank of the group")
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"{self.name!r}: negative piece length in lengths={self.lengths}")
        cover = sorted((s, n) for s, n in zip(self.starts, self.lengths) if n)
        pos = 0
        for s, n in cover:
            if s != pos:
                break
            pos += n
        if pos != math.prod(self.full_shape) or [s for s, _ in cover] != \
                [s for s, n in zip(self.starts, self.lengths) if n]:
            raise ValueError(f"{self.name!r}: pieces starts={self.starts} lengths={self.lengths} must cover the "
                             f"{math.prod(self.full_shape)} elements of {self.full_shape} once, in rank order")

    @classmethod
    def even(cls, name: str, full_shape: Sequence[int], world: int, num_heads: int | None = None,
             num_experts: int | None = None) -> "FlatSplit":
        """ZeRO-3's cut: rank r holds ``[r*P, (r+1)*P)`` clipped to the matrix, P = ceil(numel/world)."""
        n = math.prod(full_shape)
        per = -(-n // world)
        starts = tuple(min(r * per, n) for r in range(world))
        lengths = tuple(max(0, min(n, (r + 1) * per) - r * per) for r in range(world))
        return cls(name, tuple(full_shape), starts, lengths, num_heads, num_experts)

    @property
    def info(self) -> MatrixInfo:
        return MatrixInfo(self.name, self.full_shape, self.num_heads, self.num_experts)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return (self.lengths[rank],)

    def local_numel(self, rank: int) -> int:
        return self.lengths[rank]

    def assemble(self, pieces: Sequence[Tensor]) -> Tensor:
        return torch.cat([x.reshape(-1) for x in pieces]).view(self.full_shape)

    def piece(self, whole: Tensor, rank: int) -> Tensor:
        return whole.reshape(-1).narrow(0, self.starts[rank], self.lengths[rank])

    def describe(self) -> list:
        out = [self.name, list(self.full_shape), "flat", list(self.starts), list(self.lengths), self.num_heads]
        return out if self.num_experts is None else out + [self.num_experts]


@dataclass(frozen=True)
class GridSplit:
    """A tensor-parallel matrix of the mixed ZeRO-1/2 layout, cut twice: into TP shards along
    ``partition_dim`` (as :class:`TPMatrix`), and each shard's row-major flat elements into
    contiguous DP pieces, the same ``starts``/``lengths`` on every TP rank (every TP rank's ZeRO
    buffer is laid out by the same DP plan over its TP-local shards).  The group is the DP x TP
    grid of one pipeline stage; ``cells[g]`` is the (tp_rank, dp_rank) of group rank g, whose
    piece is DP piece d of TP shard t::

        TP=2, DP=2, partition_dim 0          grid rank g -> cell (t, d) -> piece
        shard 0: | a a a a a | a a a |       (0, 0): a[0:5]   (0, 1): a[5:8]
        shard 1: | b b b b b | b b b |       (1, 0): b[0:5]   (1, 1): b[5:8]

    :meth:`assemble` rebuilds each shard from its DP pieces and concatenates the shards along
    ``partition_dim``: exactly :meth:`TPMatrix.assemble`'s matrix, so the host's update is the
    owned layout's TP update bit for bit, and every piece of it is applied element-wise.
    """

    name: str
    #: shape of the whole (TP=1) matrix
    full_shape: tuple[int, ...]
    partition_dim: int
    #: size along ``partition_dim`` of each TP rank's shard
    shard_sizes: tuple[int, ...]
    #: per DP rank: first element of its piece inside a shard's flat elements
    starts: tuple[int, ...]
    #: per DP rank: element count of its piece (0: none)
    lengths: tuple[int, ...]
    #: per grid-group rank: (tp_rank, dp_rank)
    cells: tuple[tuple[int, int], ...]
    num_heads: int | None = None

    def __post_init__(self) -> None:
        tpm = TPMatrix(self.name, self.full_shape, self.partition_dim, self.shard_sizes, self.num_heads)  # validates
        flat = FlatSplit(self.name, tpm.local_shape(0), self.starts, self.lengths)  # validates the DP cut
        for t in range(len(self.shard_sizes)):
            if tpm.local_numel(t) != math.prod(flat.full_shape):
                raise ValueError(f"{self.name!r}: TP shard {t} has {tpm.local_numel(t)} elements, shard 0 "
                                 f"{math.prod(flat.full_shape)}; one DP cut needs equal shards")
        want = sorted((t, d) for t in range(len(self.shard_sizes)) for d in range(len(self.lengths)))
        if sorted(tuple(c) for c in self.cells) != want:
            raise ValueError(f"{self.name!r}: cells={list(self.cells)} must hold every (tp_rank, dp_rank) of "
                             f"{len(self.shard_sizes)} x {len(self.lengths)} once")

    @property
    def num_experts(self) -> None:  # the split protocol's attribute (TP-split expert stacks are refused)
        return None

    @property
    def tp_size(self) -> int:
        return len(self.shard_sizes)

    @property
    def info(self) -> MatrixInfo:
        return MatrixInfo(self.name, self.full_shape, self.num_heads)

    def shard_shape(self, tp_rank: int) -> tuple[int, ...]:
        s = list(self.full_shape)
        s[self.partition_dim] = self.shard_sizes[tp_rank]
        return tuple(s)

    def rank_of(self, tp_rank: int, dp_rank: int) -> int:
        """The grid-group rank at cell (tp_rank, dp_rank)."""
        return [tuple(c) for c in self.cells].index((tp_rank, dp_rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return (self.lengths[self.cells[rank][1]],)

    def local_numel(self, rank: int) -> int:
        return self.lengths[self.cells[rank][1]]

    def assemble(self, pieces: Sequence[Tensor]) -> Tensor:
        at = {tuple(c): r for r, c in enumerate(self.cells)}
        shards = [torch.cat([pieces[at[(t, d)]].reshape(-1) for d in range(len(self.lengths))]).view(self.shard_shape(t))
                  for t in range(self.tp_size)]
        return torch.cat(shards, dim=self.partition_dim)

    def piece(self, whole: Tensor, rank: int) -> Tensor:
        t, d = self.cells[rank]
        off = sum(self.shard_sizes[:t])
        shard = whole.narrow(self.partition_dim, off, self.shard_sizes[t]).reshape(-1)
        return shard.narrow(0, self.starts[d], self.lengths[d])

    def describe(self) -> list:
        return [self.name, list(self.full_shape), "grid", self.partition_dim, list(self.shard_sizes),
                list(self.starts), list(self.lengths), [list(c) for c in self.cells], self.num_heads]


@dataclass
class StepStats:
    """What one ``step`` did on this rank (reset every step)."""

    collectives: dict[str, int] = field(default_factory=dict)
    #: bytes this rank put on the wire (self-sends excluded)
    bytes_sent: int = 0
    #: the rule's FLOPs (amortised) this rank computed as a host
    flops: float = 0.0

    def count(self, op: str, nbytes: int) -> None:
        self.collectives[op] = self.collectives.get(op, 0) + 1
        self.bytes_sent += nbytes


def plan_groups(matrices: Sequence["SplitMatrix"], rule: MatrixRule, tp_size: int, config: TPConfig) -> MicroGroupPlan:
    """Micro-group plan; specs carry the FULL shape (a task is the full-matrix update on its
    host), so AutoTP's uneven shards give the same plan on every TP rank."""
    specs = [ParamSpec(name=m.name, shape=tuple(m.full_shape), role="matrix", num_heads=m.num_heads,
                       num_experts=getattr(m, "num_experts", None)) for m in matrices]
    return plan_tp(specs, tp_size, scheduler=config.scheduler, c_max=config.c_max, cost=config.cost, model=rule)


#: a matrix cut over a group: Megatron TP shards along a dim, contiguous flat pieces (ZeRO), or
#: both (the mixed layout's TP-split matrices over the DP x TP grid)
SplitMatrix = "TPMatrix | FlatSplit | GridSplit"


def piece_count(m: "SplitMatrix") -> int:
    """How many group ranks ``m`` is cut over."""
    if isinstance(m, TPMatrix):
        return len(m.shard_sizes)
    return len(m.cells) if isinstance(m, GridSplit) else len(m.lengths)


class MicroGroupRuntime:
    """Runs one group's matrix-rule step for a fixed list of split matrices (TP shards along a
    dim, :class:`TPMatrix`; flat pieces over a DP group, :class:`FlatSplit`; TP shards' flat
    pieces over the DP x TP grid, :class:`GridSplit`; mixed is fine)."""

    def __init__(self, matrices: Sequence["SplitMatrix"], rule: MatrixRule, tp_group=None, config: TPConfig | None = None,
                 state: dict | None = None, *, verify: bool = True, hosts: Sequence[int] | None = None,
                 piece_state: dict | None = None) -> None:
        """``hosts``: the host (group rank) of every matrix, planned elsewhere (the mixed DP
        layout); default: the micro-group scheduler of ``config`` chooses.  ``piece_state``
        (name -> state): where the rule's :attr:`~canzona_ds.optim.rule.MatrixRule.elementwise_state`
        of the :class:`FlatSplit` matrices lives, cut like this rank's piece: every rank runs
        ``rule.pre_direction`` on its piece and sends that, the host runs ``rule.direction_from``
        on the whole and keeps only the other state keys (None: the host keeps all of it)."""
        self.rule = rule
        self.config = config or TPConfig()
        self.matrices = tuple(matrices)
        self.group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(tp_group) if dist.is_initialized() else 0
        for m in self.matrices:
            pieces = piece_count(m)
            if pieces != self.tp_size:
                raise ValueError(f"{m.name!r} is cut into {pieces} pieces but the group has {self.tp_size} ranks")
        names = [m.name for m in self.matrices]
        if len(set(names)) != len(names):
            raise ValueError("TPMatrix names must be unique within one runtime")
        if hosts is not None and self.matrices:
            from ..planning.tp import plan_fixed_hosts

            specs = [ParamSpec(name=m.name, shape=tuple(m.full_shape), role="matrix", num_heads=m.num_heads,
                               num_experts=getattr(m, "num_experts", None)) for m in self.matrices]
            self.plan = plan_fixed_hosts(specs, list(hosts), self.tp_size)
        else:
            self.plan = plan_groups(self.matrices, rule, self.tp_size, self.config) if self.matrices else None
        #: rule state of the matrices this rank hosts, by name (shared with the optimizer)
        self.state: dict = {} if state is None else state
        #: this rank's piece of the element-wise state of its FlatSplit and GridSplit matrices, by name
        self.piece_state = piece_state
        # an expert stack keeps all its state (per expert, "<stack>[e]") on its host
        self._piecewise = {m.name for m in self.matrices
                           if isinstance(m, (FlatSplit, GridSplit)) and m.num_experts is None} \
            if piece_state is not None and rule.elementwise_state else set()
        self.stats = StepStats()
        #: where the all-to-all buffers live (None: the gradients' device).  ZeRO-3 with CPU
        #: offload on an accelerator sets the accelerator: the pieces and the rule stay on the
        #: host memory, only the exchanged buffers visit the device NCCL needs.
        self.comm_device: torch.device | None = None
        #: True: every step's gradients reach their hosts before the step, through another
        #: all-to-all (ZeRO-3's torch-exact clipping norm, integration/zero3.TorchNorm3, which
        #: moves every gradient piece to its matrix's host anyway): the step skips its own
        #: gradient all-to-all and takes :attr:`gathered` (one all-to-all per micro-group, not two)
        self.pregathered = False
        #: pregathered: this rank's hosted matrices' gradient pieces, name -> one flat piece per
        #: group rank (rank order), ready for the rule (unscaled and clipped); set before each step,
        #: consumed by it; ranks hosting nothing set {}
        self.gathered: dict[str, list[Tensor]] | None = None
        if verify:
            from .verify import verify_same_across_group

            verify_same_across_group(self.fingerprint(), self.group, what="TP matrix list / micro-group plan")

    # ---- introspection ---------------------------------------------------------------
    def fingerprint(self) -> str:
        import hashlib
        import json

        payload = {
            "matrices": [m.describe() for m in self.matrices],
            "rule": self.rule.describe(),
            "plan": self.plan.fingerprint() if self.plan is not None else None,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def hosted(self, tp_rank: int | None = None) -> list[int]:
        """Matrix indices whose full update ``tp_rank`` computes."""
        r = self.tp_rank if tp_rank is None else tp_rank
        return [] if self.plan is None else [j for j, h in enumerate(self.plan.host) if h == r]

    def hosted_names(self, tp_rank: int | None = None) -> list[str]:
        return [self.matrices[i].name for i in self.hosted(tp_rank)]

    def expected_collectives(self) -> dict[str, int]:
        """Collectives one ``step`` issues on this TP group, from the plan alone."""
        per_group = 1 if self.pregathered else 2
        return {} if self.plan is None else {"all_to_all_single": per_group * len(self.plan.groups)}

    # ---- the step ----------------------------------------------------------------------
    def step(self, params: Sequence[Tensor], grads: Sequence[Tensor], lr: float, weight_decay: float,
             step: int) -> StepStats:
        if len(params) != len(self.matrices) or len(grads) != len(self.matrices):
            raise ValueError(f"step got {len(params)} params / {len(grads)} grads for {len(self.matrices)} matrices")
        for i, m in enumerate(self.matrices):
            want = m.local_shape(self.tp_rank)
            if tuple(params[i].shape) != want or tuple(grads[i].shape) != want:
                raise ValueError(f"{m.name!r}: expected local shape {want}, got param {tuple(params[i].shape)} "
                                 f"grad {tuple(grads[i].shape)} on TP rank {self.tp_rank}")
        self.stats = StepStats()
        if self.plan is None:
            return self.stats
        if self.pregathered:
            missing = None if self.gathered is None else [n for n in self.hosted_names() if n not in self.gathered]
            if missing is None or missing:
                raise RuntimeError(f"MicroGroupRuntime.pregathered is set but this step's gradients of "
                                   f"{missing if missing else 'every hosted matrix'} were not gathered to this host "
                                   "(the ZeRO-3 clipping norm gathers them before the step)")
            if any(self._piecewise):
                raise RuntimeError("pregathered gradients with element-wise state kept with the pieces: the pieces "
                                   "would skip rule.pre_direction")
        tasks: list[Task] = [self._group_task(g, params, grads, lr, weight_decay, step) for g in self.plan.groups]
        try:
            (run_pipelined if self.config.pipelined else run_blocking)(tasks)
        finally:
            self.gathered = None  # one step's gradients: never reused
        return self.stats

    def _outgoing(self, i: int, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """What this rank sends its host for matrix i: its gradient piece, or (element-wise state
        kept with the pieces) ``rule.pre_direction`` of it, which updates that state."""
        g = grad.detach().reshape(-1).to(dtype)
        m = self.matrices[i]
        if m.name not in self._piecewise:
            return g
        st = self.piece_state.get(m.name)
        if st is None:
            st = self.piece_state[m.name] = {k: torch.zeros(g.numel(), dtype=g.dtype, device=g.device)
                                             for k in self.rule.elementwise_state}
        return self.rule.pre_direction(g, st).reshape(-1)

    def _a2a(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]):
        self.stats.count("all_to_all_single", (inp.numel() - in_splits[self.tp_rank]) * inp.element_size())
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=self.config.pipelined)

    def _group_task(self, group: MicroGroup, params, grads, lr: float, weight_decay: float, step: int) -> Task:
        """One micro-group: gather grads to hosts, hosts compute, scatter direction shards."""
        me, tp = self.tp_rank, self.tp_size
        by_host = [[i for i, h in group.tasks if h == r] for r in range(tp)]
        mine = by_host[me]
        send_order = [i for r in range(tp) for i in by_host[r]]
        # stage 1: my gradient shards, grouped by destination host (pregathered: already there)
        gdtype = _common_dtype([grads[i] for i, _ in group.tasks])
        device = grads[group.tasks[0][0]].device
        comm = device if self.comm_device is None else self.comm_device
        if self.pregathered:
            yield
            shards_of = {i: [x.to(device) for x in self.gathered[self.matrices[i].name]] for i in mine}
        else:
            send = torch.cat([self._outgoing(i, grads[i], gdtype) for i in send_order]).to(comm)
            in_splits = [sum(self.matrices[i].local_numel(me) for i in by_host[r]) for r in range(tp)]
            out_splits = [sum(self.matrices[i].local_numel(r) for i in mine) for r in range(tp)]
            recv = torch.empty(sum(out_splits), dtype=gdtype, device=comm)
            work = self._a2a(recv, send, out_splits, in_splits)
            yield
            if work is not None:
                work.wait()
            pieces = list(recv.to(device).split(out_splits))
            cursors = [0] * tp
            shards_of = {}
            for i in mine:
                shards_of[i] = []
                for r in range(tp):
                    n = self.matrices[i].local_numel(r)
                    shards_of[i].append(pieces[r][cursors[r]:cursors[r] + n])
                    cursors[r] += n
        # stage 2: hosts rebuild full gradients (TP layout), run the rule, slice direction shards
        ddtype = self.rule.direction_dtype(gdtype)
        send2_parts: list[list[Tensor]] = [[] for _ in range(tp)]
        for i in mine:
            m = self.matrices[i]
            G = m.assemble(shards_of.pop(i)).to(grads[i].dtype)
            if m.name in self._piecewise:  # G is pre_direction's result, the element-wise state is with the pieces
                state = self.state.get(m.name)
                if state is None:
                    state = self.state[m.name] = {k: v for k, v in self.rule.init_state(m.info, like=G).items()
                                                  if k not in self.rule.elementwise_state}
                D = self.rule.direction_from(G, state, m.info, step)
            else:
                D = rule_direction(self.rule, G, self.state, m.info, step)  # per expert for a stack
            if D.dtype != ddtype:
                raise RuntimeError(f"rule {self.rule.name!r} returned a {D.dtype} direction for {m.name!r}; its "
                                   f"direction_dtype({gdtype}) says {ddtype}")
            info = m.info  # a stack: E experts of shape2d
            self.stats.flops += self.rule.flops(info.shape2d, m.num_heads).amortised * (info.num_experts or 1)
            for r in range(tp):
                send2_parts[r].append(m.piece(D, r))
        flat = [t for r in range(tp) for t in send2_parts[r]]
        send2 = (torch.cat(flat) if flat else torch.empty(0, dtype=ddtype, device=device)).to(comm)
        in2 = [sum(self.matrices[i].local_numel(r) for i in mine) for r in range(tp)]
        out2 = [sum(self.matrices[i].local_numel(me) for i in by_host[r]) for r in range(tp)]
        recv2 = torch.empty(sum(out2), dtype=ddtype, device=comm)
        work2 = self._a2a(recv2, send2, out2, in2)
        yield
        if work2 is not None:
            work2.wait()
        recv2 = recv2.to(device)
        # stage 3: apply my shard of every matrix in the group
        off = 0
        for i in send_order:
            m = self.matrices[i]
            n = m.local_numel(me)
            apply_rule_update(params[i], recv2[off:off + n].view(params[i].shape), self.rule, m.info, step, lr,
                              weight_decay)
            off += n


def _common_dtype(ts: Sequence[Tensor]) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype

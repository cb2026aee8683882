"""DP ownership planners: which rank owns (updates, stores state for) each matrix.

The runtime realises a plan in DeepSpeed's flat buffer like this ("planned padding"):

    flat buffer of the matrix param group, dp = 3, every rank's range padded to P

      rank 0 range (P)              rank 1 range (P)              rank 2 range (P)
    |  W_a  |   W_d   |  pad |   W_b     | W_e | pad...  |  W_c  |  W_f  | W_g |pad|
      ^ rank_params[0] in order   ^ rank_params[1]             ^ rank_params[2]

Every matrix lies wholly inside one rank's range, so DeepSpeed's stock equal-chunk
code (reduce to owner, partitioned step, all-gather) keeps working unchanged and the
optimizer step needs no communication.  The cost is ``padding = dp*P - S`` elements in
the replicated buffer and the post-step all-gather (computed in ONE place,
``planning/layout.py``); the planners keep it small by balancing ``numel`` together with
the compute cost.

Planners are pure functions of (specs, world size, settings): every rank computes the
same plan; :meth:`OwnershipPlan.fingerprint` lets the runtime verify that.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from .params import ParamSpec


@dataclass(frozen=True)
class OwnershipPlan:
    """Result of a DP planner over one parameter group (the matrices)."""

    planner: str
    world_size: int
    specs: tuple[ParamSpec, ...]
    #: owner rank of spec i (for ``equal_chunk``: the rank holding its first element)
    owner: tuple[int, ...]
    #: per rank, spec indices in buffer order
    rank_params: tuple[tuple[int, ...], ...]
    #: per rank, the cost-model load (e.g. Newton-Schulz FLOPs)
    rank_load: tuple[float, ...]
    #: per rank, elements of its parameters (before padding)
    rank_numel: tuple[int, ...]
    #: matrices cut by a rank boundary (only ``equal_chunk`` has any)
    split_params: tuple[int, ...] = ()
    cost_model: str = "numel"
    alpha: float | None = None
    plan_ms: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    #: mixed layout (``planner == "mixed"``, planning/mixed.py): the explicit buffer order
    order: tuple[int, ...] = ()
    #: mixed layout: per spec, the DP rank that computes its update (its owner, or the host of
    #: a hosted matrix); ``owner`` is -1 for hosted matrices
    host: tuple[int, ...] = ()

    @property
    def mixed(self) -> bool:
        return self.planner == MIXED

    @property
    def hosted(self) -> tuple[int, ...]:
        """Spec indices updated through the hosted step over the DP group (mixed layout)."""
        return tuple(i for i in self.order if self.owner[i] < 0) if self.mixed else ()

    @property
    def total_numel(self) -> int:
        return sum(s.numel for s in self.specs) if self.mixed else sum(self.rank_numel)

    def layout(self, param_alignment: int = 1, start_alignment: int | None = None):
        """The planned-padding layout of this plan (:func:`canzona_ds.planning.layout.plan_layout`,
        the one place padding is computed); defaults: DeepSpeed ZeRO's alignment."""
        from .layout import DS_START_ALIGNMENT, plan_layout

        if self.mixed:
            from .mixed import place

            return place([self.owner[i] for i in self.order], [self.specs[i].numel for i in self.order],
                         self.world_size, param_alignment,
                         DS_START_ALIGNMENT if start_alignment is None else start_alignment)
        if self.split_params:
            raise ValueError(f"planner {self.planner!r} splits matrices: it has no planned-padding layout.")
        return plan_layout([len(r) for r in self.rank_params], [self.specs[i].numel for i in self.buffer_order()],
                           param_alignment, DS_START_ALIGNMENT if start_alignment is None else start_alignment)

    @property
    def padding_fraction(self) -> float:
        """Padding of the planned layout (DeepSpeed's alignment) / useful elements; for
        ``equal_chunk`` the stock layout's tail padding.

        A plan whose rank 0 owns nothing (possible for ``naive_atomic``/``alpha_balanced``
        when a big matrix sits first) has no layout as labelled; the runtime relabels its
        ranks with :func:`~canzona_ds.planning.layout.nonempty_first` first, which changes
        no rank's contents, so the padding is that of the relabelled plan."""
        if self.mixed:
            return self.layout().padding_fraction
        if self.split_params or self.planner == "equal_chunk":
            chunk = -(-self.total_numel // self.world_size)
            return (chunk * self.world_size - self.total_numel) / self.total_numel if self.total_numel else 0.0
        return self.nonempty_first().layout().padding_fraction

    def nonempty_first(self) -> "OwnershipPlan":
        """This plan with its ranks relabelled by :func:`~canzona_ds.planning.layout.nonempty_first`
        (ranks that own something keep their order, empty ones move last), so that rank 0
        owns a matrix as the planned layout needs; ``self`` when that is already so.  No
        rank's contents change, so every balance metric is the same."""
        from .layout import nonempty_first

        if self.mixed:  # the first buffer parameter is rank 0's or hosted: no relabelling needed
            return self
        order = nonempty_first(self.rank_params)
        if order == list(range(self.world_size)):
            return self
        if self.split_params:
            raise ValueError(f"planner {self.planner!r} splits matrices: its ranks cannot be relabelled.")
        new_of = {old: new for new, old in enumerate(order)}
        extra = dict(self.extra)
        if "bucket_rank_numel" in extra:
            extra["bucket_rank_numel"] = [[row[r] for r in order] for row in extra["bucket_rank_numel"]]
        return replace(self, rank_params=tuple(self.rank_params[r] for r in order),
                       rank_load=tuple(self.rank_load[r] for r in order),
                       rank_numel=tuple(self.rank_numel[r] for r in order),
                       owner=tuple(new_of[o] for o in self.owner), extra=extra)

    def rank_offsets(self, rank: int) -> list[tuple[int, int]]:
        """(spec index, element offset inside the rank's range) in buffer order."""
        out, off = [], 0
        for i in self.rank_params[rank]:
            out.append((i, off))
            off += self.specs[i].numel
        return out

    def buffer_order(self) -> list[int]:
        """All spec indices in flat-buffer order (rank 0's first)."""
        if self.order:
            return list(self.order)
        return [i for r in range(self.world_size) for i in self.rank_params[r]]

    def fingerprint(self) -> str:
        """Stable hash of everything the runtime layout depends on."""
        payload = {
            "planner": self.planner,
            "world_size": self.world_size,
            "specs": [(s.name, list(s.shape)) for s in self.specs],
            "rank_params": [list(r) for r in self.rank_params],
        }
        if self.mixed:
            payload["order"], payload["host"] = list(self.order), list(self.host)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _validate(specs: Sequence[ParamSpec], world_size: int, alpha: float | None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}. Must be an int >= 1.")
    if len(specs) == 0:
        raise ValueError("Empty parameter list: nothing to plan (specs=[]).")
    if alpha is not None and not (0.0 <= alpha <= 1.0):
        raise ValueError(f"Invalid alpha={alpha!r}. Must be within [0, 1].")


def _finish(
    planner: str,
    specs: Sequence[ParamSpec],
    world_size: int,
    rank_params: list[list[int]],
    loads: Sequence[float],
    t0: float,
    cost_model: str,
    alpha: float | None = None,
    split_params: tuple[int, ...] = (),
    owner: list[int] | None = None,
    rank_numel: list[int] | None = None,
    rank_load: list[float] | None = None,
    extra: dict | None = None,
) -> OwnershipPlan:
    if owner is None:
        owner = [-1] * len(specs)
        for r, idxs in enumerate(rank_params):
            for i in idxs:
                owner[i] = r
    if rank_numel is None:
        rank_numel = [sum(specs[i].numel for i in idxs) for idxs in rank_params]
    if rank_load is None:
        rank_load = [sum(loads[i] for i in idxs) for idxs in rank_params]
    return OwnershipPlan(
        planner=planner,
        world_size=world_size,
        specs=tuple(specs),
        owner=tuple(owner),
        rank_params=tuple(tuple(r) for r in rank_params),
        rank_load=tuple(float(x) for x in rank_load),
        rank_numel=tuple(rank_numel),
        split_params=split_params,
        cost_model=cost_model,
        alpha=alpha,
        plan_ms=(time.perf_counter() - t0) * 1e3,
        extra=dict(extra or {}),
    )


def plan_lpt(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
    initial: Sequence[float] | None = None,
) -> OwnershipPlan:
    """Global LPT: heaviest matrix first onto the least-loaded rank (ties: lower numel, rank).

    Inside a rank, parameters keep their original model order.  ``initial``: a load each rank
    already carries from elsewhere (another partition's plan), counted when choosing the
    least-loaded rank and not part of the plan's own loads.
    """
    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    if initial is not None and len(initial) != world_size:
        raise ValueError(f"plan_lpt: initial has {len(initial)} loads for world_size={world_size}.")
    order = sorted(range(len(specs)), key=lambda i: (-loads[i], -specs[i].numel, i))
    heap = [(float(initial[r]) if initial is not None else 0.0, 0, r) for r in range(world_size)]
    heapq.heapify(heap)
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, numel, r = heapq.heappop(heap)
        rank_params[r].append(i)
        heapq.heappush(heap, (load + loads[i], numel + specs[i].numel, r))
    for r in rank_params:
        r.sort()
    return _finish("lpt", specs, world_size, rank_params, loads, t0, cost_model)


def plan_equal_chunk(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
) -> OwnershipPlan:
    """DeepSpeed's stock ZeRO-1 slicing: model-order buffer cut into ``ceil(S/dp)`` chunks.

    Matrices crossing a chunk boundary are split (``split_params``); their owner is the
    rank holding the first element.  ``rank_numel`` counts the actual slices.  A split
    matrix is charged by :func:`canzona_ds.planning.cost.slice_cost`: its FLOPs (amortised
    and peak) and optimizer state in full to every rank it touches (DeepSpeed's built-in
    Muon runs the redundant whole-matrix step on each), its master weight and gradient and
    ``numel`` pro rata to the slice (the same rule as ``report.rank_costs``).
    ``extra["slices"][i]`` = ((rank, elements), ...) of every split matrix i.
    """
    from .cost import slice_cost

    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    total = sum(s.numel for s in specs)
    chunk = max(-(-total // world_size), 1)
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    rank_numel = [0] * world_size
    rank_load = [0.0] * world_size
    owner, split, slices = [], [], {}
    start = 0
    for i, spec in enumerate(specs):
        end = start + spec.numel
        first = min(start // chunk, world_size - 1)
        last = max(first, min((end - 1) // chunk, world_size - 1))
        owner.append(first)
        rank_params[first].append(i)
        parts = []
        for r in range(first, last + 1):
            n = min(end, (r + 1) * chunk) - max(start, r * chunk)
            parts.append((r, max(n, 0)))
            rank_numel[r] += max(n, 0)
            rank_load[r] += slice_cost(spec, cost_model, loads[i], max(n, 0))
        if len(parts) > 1:
            split.append(i)
            slices[i] = tuple(parts)
        start = end
    return _finish(
        "equal_chunk", specs, world_size, rank_params, loads, t0, cost_model,
        split_params=tuple(split), owner=owner, rank_numel=rank_numel, rank_load=rank_load,
        extra={"slices": slices},
    )


def _nearest_cut(prefix: Sequence[float], target: float, lo: int) -> int:
    """Index u >= lo of ``prefix`` (non-decreasing) closest to ``target`` (ties: lower u)."""
    j = bisect.bisect_left(prefix, target, lo=lo)
    if j >= len(prefix):
        return len(prefix) - 1
    if j > lo and target - prefix[j - 1] <= prefix[j] - target:
        return j - 1
    return j


def plan_naive_atomic(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
) -> OwnershipPlan:
    """One flat buffer cut into ``dp`` equal ranges, each cut ``r*S/dp`` snapped to the
    NEAREST parameter boundary; model order preserved, every matrix atomic.  Not the
    paper's naive assignment: eq. 1 gives a matrix to the rank its *start* falls in, per
    bucket (:func:`plan_paper_naive`); over one buffer of equal layers (Qwen3-32B at
    DP=32) both come out perfectly balanced, over buckets eq. 1 does not."""
    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    prefix = list(itertools.accumulate((s.numel for s in specs), initial=0))
    total = prefix[-1]
    cuts = [0]
    for r in range(1, world_size):
        cuts.append(_nearest_cut(prefix, total * r / world_size, cuts[-1]))
    cuts.append(len(specs))
    rank_params = [list(range(cuts[r], cuts[r + 1])) for r in range(world_size)]
    return _finish("naive_atomic", specs, world_size, rank_params, loads, t0, cost_model)


def make_buckets(specs: Sequence[ParamSpec], bucket_numel: int | None) -> list[tuple[int, int]]:
    """Split the model-ordered list into ``[start, end)`` buckets of at most
    ``bucket_numel`` elements (a bigger single parameter gets a bucket of its own), the
    way DeepSpeed fills ``reduce_bucket_size``.  ``None``: one bucket."""
    if bucket_numel is None:
        return [(0, len(specs))]
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"Invalid bucket_numel={bucket_numel!r}. Must be an int >= 1 or None.")
    buckets, start, size = [], 0, 0
    for i, spec in enumerate(specs):
        if size and size + spec.numel > bucket_numel:
            buckets.append((start, i))
            start, size = i, 0
        size += spec.numel
    buckets.append((start, len(specs)))
    return buckets


#: DeepSpeed's default ``reduce_bucket_size`` (elements); the default bucket of
#: ``alpha_balanced`` and ``paper_naive`` (the same buckets for both, as in the paper)
DEFAULT_BUCKET_NUMEL = 500_000_000


def megatron_bucket_numel(dp: int) -> int:
    """Megatron-Core's default DDP bucket size (elements) with ``overlap_grad_reduce``:
    ``max(40_000_000, 1_000_000 * dp)`` (``DistributedDataParallelConfig.bucket_size``).
    The Canzona paper runs Megatron but does not state its bucket size; this is the value
    its default configuration would use (40M elements at DP=32)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"Invalid dp={dp!r}. Must be an int >= 1.")
    return max(40_000_000, 1_000_000 * dp)


def _bucket_plan(
    planner: str,
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str,
    buckets: list[tuple[int, int]],
    cuts_of: dict[int, list[int]],
    t0: float,
    alpha: float | None = None,
) -> OwnershipPlan:
    """A plan from per-bucket cut vectors ``cuts_of[k] = [s_0 = a, s_1, ..., s_R = b]``
    (absolute spec indices): rank r owns ``[s_r, s_{r+1})`` of every bucket, concatenated
    in bucket (= model) order.  ``extra``: ``buckets`` and ``bucket_rank_numel`` (S_{i,r},
    for J_comm)."""
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    bucket_rank_numel = []
    for k in range(len(buckets)):
        cuts = cuts_of[k]
        row = []
        for r in range(world_size):
            rank_params[r].extend(range(cuts[r], cuts[r + 1]))
            row.append(sum(specs[i].numel for i in range(cuts[r], cuts[r + 1])))
        bucket_rank_numel.append(row)
    return _finish(
        planner, specs, world_size, rank_params, loads, t0, cost_model, alpha=alpha,
        extra={"buckets": buckets, "bucket_rank_numel": bucket_rank_numel},
    )


def plan_paper_naive(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
) -> OwnershipPlan:
    """The paper's naive atomic assignment (eq. 1, "ASC" without load balancing), per bucket.

    Buckets as :func:`make_buckets` (model order).  In a bucket of ``|B|`` elements the
    stride is ``S = |B| / R``; a parameter whose first element sits at offset ``o`` inside
    the bucket belongs to rank ``r`` with ``r*S <= o < (r+1)*S``, i.e. ``r = floor(o*R/|B|)``
    (exact integer arithmetic).  Every matrix stays whole on the rank its *start* falls
    in, so the first matrix of every bucket goes to rank 0 and a rank whose stride window
    holds no parameter start owns nothing of that bucket: with few large matrices per
    bucket the load piles up on the low ranks.  The cost model plays no part (``loads``
    only fills ``rank_load``).  ``bucket_numel=None``: one bucket (then it differs from
    ``naive_atomic``, which snaps each equal cut to the NEAREST boundary, only in how a
    straddling matrix is resolved)."""
    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    buckets = make_buckets(specs, bucket_numel)
    cuts_of: dict[int, list[int]] = {}
    for k, (a, b) in enumerate(buckets):
        size = sum(specs[i].numel for i in range(a, b))
        owners, off = [], 0
        for i in range(a, b):
            owners.append(min(off * world_size // size, world_size - 1) if size else 0)
            off += specs[i].numel
        # owners are non-decreasing: rank r owns [first index with owner >= r, first with owner > r)
        cuts_of[k] = [a + bisect.bisect_left(owners, r) for r in range(world_size)] + [b]
    return _bucket_plan("paper_naive", specs, world_size, loads, cost_model, buckets, cuts_of, t0)


def plan_alpha_balanced(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
    alpha: float = 1.0,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
) -> OwnershipPlan:
    """Paper Algorithm 1 (alpha-Balanced Greedy LPT), exactly.

    Buckets (see :func:`make_buckets`) are visited heaviest first; each is cut into
    ``world_size`` contiguous, parameter-aligned slices whose loads follow
    ``(1-alpha)*even + alpha*deficit-fill``.  A rank's parameters from several buckets are
    concatenated in bucket (= model) order.  ``extra``: ``buckets`` and
    ``bucket_rank_numel`` (S_{i,r}, for J_comm).
    """
    t0 = time.perf_counter()
    _validate(specs, world_size, alpha)
    buckets = make_buckets(specs, bucket_numel)
    bucket_load = [sum(loads[a:b]) for a, b in buckets]
    mu = sum(bucket_load) / world_size
    global_load = [0.0] * world_size
    cuts_of: dict[int, list[int]] = {}
    for k in sorted(range(len(buckets)), key=lambda k: (-bucket_load[k], k)):
        a, b = buckets[k]
        deficit = [max(0.0, mu - x) for x in global_load]
        d_total = sum(deficit)
        fill = [d / d_total for d in deficit] if d_total > 0 else [1.0 / world_size] * world_size
        target = [bucket_load[k] * ((1 - alpha) / world_size + alpha * f) for f in fill]
        prefix = list(itertools.accumulate(loads[a:b], initial=0.0))
        cuts, c = [0], 0.0
        for r in range(world_size - 1):
            c += target[r]
            cuts.append(_nearest_cut(prefix, c, cuts[-1]))
        cuts.append(b - a)
        for r in range(world_size):
            global_load[r] += prefix[cuts[r + 1]] - prefix[cuts[r]]
        cuts_of[k] = [a + u for u in cuts]
    return _bucket_plan("alpha_balanced", specs, world_size, loads, cost_model, buckets, cuts_of, t0, alpha=alpha)


def layer_key(name: str) -> str | None:
    """The layer a parameter belongs to: its name up to and including the first dotted
    component that is a non-negative integer, with a trailing dot
    (``decoder.layers.7.mlp.linear_fc1.weight`` -> ``decoder.layers.7.``,
    ``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3.``); None when no
    component is one (an embedding, a head, ``qkv.weight``)."""
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: k + 1]) + "."
    return None


def layer_groups(specs: Sequence[ParamSpec]) -> list[list[int]]:
    """Spec indices grouped by :func:`layer_key`, groups in order of first appearance;
    a spec without a layer is a group of its own."""
    groups: list[list[int]] = []
    by_key: dict[str, int] = {}
    for i, spec in enumerate(specs):
        key = layer_key(spec.name)
        if key is None:
            groups.append([i])
        elif key in by_key:
            groups[by_key[key]].append(i)
        else:
            by_key[key] = len(groups)
            groups.append([i])
    return groups


def plan_layerwise(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
) -> OwnershipPlan:
    """NVIDIA's layer-wise optimizer as the Canzona paper describes it (§3.1 Paradigm 2,
    §D.2): whole layers are the unit of ownership, assigned by global load balancing.

    Matrices are grouped by :func:`layer_groups` (name prefix up to the layer index; a
    matrix outside any layer is its own group); groups are placed heaviest first (by
    the summed cost-model load, then numel, then first index) onto the least-loaded rank
    (ties: lower numel, then lower rank), i.e. LPT over layers.  Inside a rank parameters
    keep model order.  The assignment ignores where parameters sit in the buffer, which
    is why the paper's layer-wise baseline cannot use bucketed reduce-scatter (§D.2);
    here the plan is still realisable with planned padding like any atomic plan.
    ``extra["layer_groups"]``: the groups (spec indices)."""
    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    groups = layer_groups(specs)
    g_load = [sum(loads[i] for i in g) for g in groups]
    g_numel = [sum(specs[i].numel for i in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda k: (-g_load[k], -g_numel[k], groups[k][0]))
    heap = [(0.0, 0, r) for r in range(world_size)]
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    for k in order:
        load, numel, r = heapq.heappop(heap)
        rank_params[r].extend(groups[k])
        heapq.heappush(heap, (load + g_load[k], numel + g_numel[k], r))
    for r in rank_params:
        r.sort()
    return _finish("layerwise", specs, world_size, rank_params, loads, t0, cost_model,
                   extra={"layer_groups": [list(g) for g in groups]})


def _criteria(specs: Sequence[ParamSpec], loads: Sequence[float], model) -> np.ndarray:
    """Columns to balance together: the planner's load, numel (= padding), and, with a cost
    model, the optimizer's FLOPs and memory; columns proportional to an earlier one are
    dropped."""
    from .cost import cost_vector

    columns = [[float(s.numel) for s in specs], list(loads)]
    if model is not None:
        columns += [cost_vector(specs, "flops", model), cost_vector(specs, "memory", model)]
    kept: list[np.ndarray] = []
    for col in columns:
        v = np.asarray(col, dtype=np.float64)
        if v.sum() <= 0:
            continue
        v = v / v.sum()
        if any(np.allclose(v, k, rtol=1e-9, atol=1e-15) for k in kept):
            continue
        kept.append(v)
    if not kept:  # nothing has any cost: balance the count of parameters
        kept.append(np.full(len(specs), 1.0 / len(specs)))
    return np.stack(kept, axis=1)


def _refine(
    assign: np.ndarray, X: np.ndarray, world_size: int, max_iters: int,
    columns: Sequence[int] | None = None, cap: float | np.ndarray | None = None,
) -> int:
    """Move/swap local search lowering the worst rank's score ``max_c(load_c)`` over
    ``columns`` (default all); with ``cap`` (a number, or one per column), no rank may
    exceed it in ANY column.  In place.

    Every accepted step lowers the worst rank below the current maximum without raising
    another rank to it, so it terminates; ``max_iters`` bounds it.  Returns steps taken.
    """
    cols = list(range(X.shape[1])) if columns is None else list(columns)
    rank_sum = np.zeros((world_size, X.shape[1]))
    np.add.at(rank_sum, assign, X)
    limit = np.inf if cap is None else np.asarray(cap, dtype=np.float64) * (1 + 1e-12)

    def pair_max(new_a: np.ndarray, new_b: np.ndarray) -> np.ndarray:
        pm = np.maximum(new_a[..., cols].max(axis=-1), new_b[..., cols].max(axis=-1))
        if cap is not None:
            over = (new_a > limit).any(axis=-1) | (new_b > limit).any(axis=-1)
            pm = np.where(over, np.inf, pm)
        return pm

    for step in range(max_iters):
        scores = rank_sum[:, cols].max(axis=1)
        w = int(np.argmax(scores))
        current = scores[w]
        mine = np.flatnonzero(assign == w)
        others = np.flatnonzero(assign != w)
        best = (current - 1e-12 * max(current, 1.0), None)
        for i in mine:
            # move i from w to any other rank r
            pm = pair_max(np.broadcast_to(rank_sum[w] - X[i], rank_sum.shape), rank_sum + X[i])
            pm[w] = np.inf
            r = int(np.argmin(pm))
            if pm[r] < best[0]:
                best = (pm[r], ("move", int(i), r))
            if others.size:
                # swap i with an item j on another rank
                delta = X[others] - X[i]
                pm = pair_max(rank_sum[w] + delta, rank_sum[assign[others]] - delta)
                j = int(np.argmin(pm))
                if pm[j] < best[0]:
                    best = (pm[j], ("swap", int(i), int(others[j])))
        if best[1] is None:
            return step
        kind, i, other = best[1]
        if kind == "move":
            rank_sum[w] -= X[i]
            rank_sum[other] += X[i]
            assign[i] = other
        else:
            r = int(assign[other])
            d = X[other] - X[i]
            rank_sum[w] += d
            rank_sum[r] -= d
            assign[i], assign[other] = r, w
    return max_iters


#: most (give set, take set) candidates :func:`_exchange` evaluates in one step
_EXCHANGE_LIMIT = 1 << 18


def _exchange(
    assign: np.ndarray, X: np.ndarray, world_size: int, max_iters: int, col: int, cap: np.ndarray,
) -> int:
    """Local search lowering the worst rank in column ``col`` by exchanging up to two of
    its items for up to two items of ONE other rank (moves, 1-1, 2-1, 1-2, 2-2 swaps),
    with no rank above ``cap`` in any column.  In place; returns steps taken.

    Every step lowers the worst rank strictly below the current maximum without raising
    the partner to it (so it terminates); the best exchange wins (lowest new maximum of
    the two ranks), ties to the first in a fixed enumeration (give: none, one, two items
    by index; take: none by rank, one, two items by index): deterministic.  Past
    ``_EXCHANGE_LIMIT`` candidates the two-item sets are dropped (plain move/swap).
    """
    k = X.shape[1]
    rank_sum = np.zeros((world_size, k))
    np.add.at(rank_sum, assign, X)
    limit = np.asarray(cap, dtype=np.float64) * (1 + 1e-12)
    zero = np.zeros((1, k))
    for step in range(max_iters):
        w = int(np.argmax(rank_sum[:, col]))
        current = rank_sum[w, col]
        mine = np.flatnonzero(assign == w)
        pairs = np.array(list(itertools.combinations(mine, 2)), dtype=np.int64).reshape(-1, 2)
        give = np.concatenate([zero, X[mine], X[pairs[:, 0]] + X[pairs[:, 1]]])
        give_ids = [()] + [(int(i),) for i in mine] + [(int(a), int(b)) for a, b in pairs]
        others = np.flatnonzero(assign != w)
        ranks = np.array([r for r in range(world_size) if r != w], dtype=np.int64)
        if others.size:
            same = assign[others][:, None] == assign[others][None, :]
            ia, ib = np.triu_indices(others.size, 1)
            keep = same[ia, ib]
            tp = np.stack([others[ia[keep]], others[ib[keep]]], axis=1)
        else:
            tp = np.zeros((0, 2), dtype=np.int64)
        if give.shape[0] * (ranks.size + others.size + tp.shape[0]) > _EXCHANGE_LIMIT:
            tp = tp[:0]  # too many candidates (many items per rank): no 1-2 / 2-2 swaps
        if give.shape[0] * (ranks.size + others.size) > _EXCHANGE_LIMIT:
            give, give_ids = give[: 1 + mine.size], give_ids[: 1 + mine.size]  # nor 2-1
        take_rows = [np.zeros((ranks.size, k)), X[others], X[tp[:, 0]] + X[tp[:, 1]]]
        take_rank = np.concatenate([ranks, assign[others], assign[tp[:, 0]]])
        n_move, n_one = ranks.size, others.size
        if not take_rank.size:
            return step
        take = np.concatenate(take_rows)
        partner = rank_sum[take_rank]
        new_w = rank_sum[w] - give[:, None, :] + take[None, :, :]
        new_r = partner[None, :, :] + give[:, None, :] - take[None, :, :]
        ok = (new_w <= limit).all(axis=-1) & (new_r <= limit).all(axis=-1)
        pm = np.where(ok, np.maximum(new_w[..., col], new_r[..., col]), np.inf)
        flat = int(np.argmin(pm))
        g, t = divmod(flat, pm.shape[1])
        if not pm[g, t] < current - 1e-12 * max(current, 1.0):
            return step
        r = int(take_rank[t])
        if t < n_move:
            taken: tuple[int, ...] = ()
        elif t < n_move + n_one:
            taken = (int(others[t - n_move]),)
        else:
            taken = tuple(int(j) for j in tp[t - n_move - n_one])
        for i in give_ids[g]:
            assign[i] = r
        for j in taken:
            assign[j] = w
        rank_sum[w] = new_w[g, t]
        rank_sum[r] = new_r[g, t]
    return max_iters


def _score(assign: np.ndarray, X: np.ndarray, world_size: int) -> tuple[float, float]:
    rank_sum = np.zeros((world_size, X.shape[1]))
    np.add.at(rank_sum, assign, X)
    scores = rank_sum.max(axis=1)
    return (round(float(scores.max()), 12), round(float((scores**2).sum()), 9))


def _greedy_min_max(X: np.ndarray, specs: Sequence[ParamSpec], loads: Sequence[float], world_size: int) -> np.ndarray:
    """Heaviest first onto the rank with the lowest max-criterion after placement."""
    order = sorted(range(len(specs)), key=lambda i: (-loads[i], -specs[i].numel, i))
    rank_sum = np.zeros((world_size, X.shape[1]))
    assign = np.zeros(len(specs), dtype=np.int64)
    for i in order:
        cand = rank_sum + X[i]
        worst = cand.max(axis=1)
        tied = worst <= worst.min() * (1 + 1e-12)
        r = int(np.argmin(np.where(tied, cand.sum(axis=1), np.inf)))
        assign[i] = r
        rank_sum[r] = cand[r]
    return assign


def _first_fit(X: np.ndarray, order: np.ndarray, world_size: int, capacity: float | np.ndarray) -> np.ndarray | None:
    rank_sum = np.zeros((world_size, X.shape[1]))
    assign = np.zeros(len(X), dtype=np.int64)
    for i in order:
        fits = np.flatnonzero((rank_sum + X[i] <= capacity * (1 + 1e-12)).all(axis=1))
        if fits.size == 0:
            return None
        r = int(fits[0])
        assign[i] = r
        rank_sum[r] += X[i]
    return assign


def _multifit(X: np.ndarray, world_size: int, upper: float, rounds: int = 14) -> np.ndarray | None:
    """MULTIFIT (Coffman, Garey & Johnson 1978), vector form: binary-search the smallest
    per-rank capacity (every criterion) at which first-fit-decreasing packs all items."""
    order = np.array(sorted(range(len(X)), key=lambda i: (-float(X[i].max()), -float(X[i].sum()), i)), dtype=np.int64)
    lo, hi = max(1.0, float(X.max())), upper
    best = None
    for _ in range(rounds):
        if hi - lo <= 1e-4:
            break
        mid = (lo + hi) / 2
        packed = _first_fit(X, order, world_size, mid)
        if packed is None:
            lo = mid
        else:
            best, hi = packed, mid
    return best


def _column_max(assign: np.ndarray, X: np.ndarray, world_size: int) -> np.ndarray:
    rank_sum = np.zeros((world_size, X.shape[1]))
    np.add.at(rank_sum, assign, X)
    return rank_sum.max(axis=0)


def _capped_min(assign: np.ndarray, X: np.ndarray, world_size: int, col: int, max_iters: int) -> int:
    """Lexicographic refinement of one criterion: lower column ``col``'s worst rank by
    :func:`_exchange` while no column's worst rank rises above its current value (the
    other criteria, and ``col`` itself, are caps).  In place; returns steps taken."""
    caps = _column_max(assign, X, world_size)
    floor = max(1.0, float(X[:, col].max()))  # the mean (X is scaled so it is 1), the largest item
    if caps[col] <= floor * (1 + 1e-9):
        return 0
    return _exchange(assign, X, world_size, max_iters, col, caps)


def plan_multi_lpt(
    specs: Sequence[ParamSpec],
    world_size: int,
    loads: Sequence[float],
    cost_model: str = "numel",
    model=None,
    refine_iters: int | None = None,
    lexicographic: bool = True,
) -> OwnershipPlan:
    """Multi-criteria LPT with swap refinement, for the planned-padding geometry where any
    global reordering is allowed.

    Criteria (normalised so a perfect rank carries 1/dp of each): the cost-model load,
    numel (memory, hence padding = dp*max - S), the optimizer's FLOPs and state bytes.
    Two starts: (1) heaviest first (by load, then numel), each matrix onto the rank
    minimising ``max_c`` of its criteria after placement; (2) vector MULTIFIT
    (first-fit-decreasing under a binary-searched capacity).  Each is improved by a
    move/swap local search on the worst rank's ``max_c``; the better one is kept.

    Then, lexicographically, one criterion at a time (numel first: it is the padding):
    lower that criterion's worst rank by exchanges of up to two matrices between two
    ranks (:func:`_exchange`) while every criterion's worst rank, its own included, is
    capped at its current value.  So the min-max score and the FLOPs ratio never get
    worse, and padding drops where the FLOPs floor (e.g. one large matrix per rank) left
    numel slack.  This runs on the first-pass plan and on a copy improved by per-criterion
    move/swap under the min-max score as a cap on every criterion (which may lower that
    score while raising another criterion); the lower (min-max score, numel max, next
    criterion's max, ...) wins.  ``lexicographic=False``: only that relaxed pass (the
    earlier behaviour), for comparison.

    Deterministic: index tiebreaks, iteration cap instead of a time limit.  Parameters
    keep model order inside a rank.  ``extra``: ``minmax_score`` (after the first pass)
    and ``criterion_max`` (final worst rank per criterion, mean = 1).
    """
    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    X = _criteria(specs, loads, model) * world_size
    iters = refine_iters if refine_iters is not None else 4 * (len(specs) + world_size)
    candidates = [_greedy_min_max(X, specs, loads, world_size)]
    packed = _multifit(X, world_size, upper=_score(candidates[0], X, world_size)[0])
    if packed is not None:
        candidates.append(packed)
    steps = [_refine(a, X, world_size, iters) for a in candidates]
    # best = lowest worst-rank score, then lowest sum of squared scores; first on ties
    best = min(range(len(candidates)), key=lambda k: (_score(candidates[k], X, world_size), k))
    assign = candidates[best]
    minimax = _score(assign, X, world_size)[0]
    steps = steps[best]
    # second pass, one criterion at a time (numel first: it is the padding), every rank
    # capped at the min-max score in every criterion: can still lower that score
    relaxed = assign.copy()
    relaxed_steps = sum(_refine(relaxed, X, world_size, iters, columns=[c], cap=minimax) for c in range(X.shape[1]))
    if lexicographic:
        # lexicographic pass on both: lower one criterion's worst rank at a time with
        # every criterion's worst rank capped at its current value (so none gets worse),
        # then keep the lower (min-max score, numel max, next criterion max, ...)
        outcomes = []
        for a, k in ((assign, steps), (relaxed, steps + relaxed_steps)):
            for c in range(X.shape[1]):
                k += _capped_min(a, X, world_size, c, iters)
            m = _column_max(a, X, world_size)
            outcomes.append(((round(float(m.max()), 12), *(round(float(v), 12) for v in m)), a, k))
        _, assign, steps = min(outcomes, key=lambda o: o[0])  # min() keeps the first on ties
    else:
        assign, steps = relaxed, steps + relaxed_steps
    final = _column_max(assign, X, world_size)
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    for i in range(len(specs)):
        rank_params[int(assign[i])].append(i)
    return _finish(
        "multi_lpt", specs, world_size, rank_params, loads, t0, cost_model,
        extra={"refine_steps": steps, "criteria": X.shape[1], "start": ("lpt", "multifit")[best],
               "minmax_score": minimax, "criterion_max": [round(float(v), 12) for v in final]},
    )


@dataclass(frozen=True)
class DPRequest:
    """Everything a DP planner may use; each registry entry picks what it needs."""

    specs: Sequence[ParamSpec]
    world_size: int
    #: per spec, the cost-model load
    loads: Sequence[float]
    cost_model: str
    alpha: float
    #: the optimizer's cost model (planning.cost.CostModel), or None (numel only)
    model: object
    #: bucket size of ``alpha_balanced`` and ``paper_naive`` (elements); None = one bucket
    bucket_numel: int | None


#: planner name -> fn(DPRequest) -> OwnershipPlan
DP_PLANNERS: dict[str, Callable[[DPRequest], OwnershipPlan]] = {
    "equal_chunk": lambda q: plan_equal_chunk(q.specs, q.world_size, q.loads, q.cost_model),
    "naive_atomic": lambda q: plan_naive_atomic(q.specs, q.world_size, q.loads, q.cost_model),
    "alpha_balanced": lambda q: plan_alpha_balanced(
        q.specs, q.world_size, q.loads, q.cost_model, alpha=q.alpha, bucket_numel=q.bucket_numel
    ),
    "lpt": lambda q: plan_lpt(q.specs, q.world_size, q.loads, q.cost_model),
    "multi_lpt": lambda q: plan_multi_lpt(q.specs, q.world_size, q.loads, q.cost_model, q.model),
    "paper_naive": lambda q: plan_paper_naive(q.specs, q.world_size, q.loads, q.cost_model,
                                              bucket_numel=q.bucket_numel),
    "layerwise": lambda q: plan_layerwise(q.specs, q.world_size, q.loads, q.cost_model),
}
#: planners that keep every matrix whole on one rank
ATOMIC_DP_PLANNERS = ("naive_atomic", "alpha_balanced", "lpt", "multi_lpt", "paper_naive", "layerwise")
#: planners whose plan depends on the bucket size (``bucket_numel``)
BUCKETED_DP_PLANNERS = ("alpha_balanced", "paper_naive")
DEFAULT_DP_PLANNER = "multi_lpt"


def plan_dp(
    specs: Sequence[ParamSpec],
    world_size: int,
    planner: str = DEFAULT_DP_PLANNER,
    alpha: float = 1.0,
    cost: str = "numel",
    model=None,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
) -> OwnershipPlan:
    """Plan ownership of ``specs`` (all atomic) over ``world_size`` DP ranks.

    Args:
        planner: planner name (see ``DP_PLANNERS``).
        alpha: balance factor of ``alpha_balanced`` (ignored by the others), in [0, 1].
        cost: cost name the planner balances (``planning.cost.COST_MODELS``).
        model: the optimizer's cost model (e.g. ``canzona_ds.optim.cost_model("muon")``);
            needed for every cost but ``numel``; ``multi_lpt`` also balances its FLOPs and
            memory.  TP-split specs are charged the DP owner's share of the full matrix.
        bucket_numel: bucket size of ``alpha_balanced`` and ``paper_naive`` in elements
            (None: one bucket); default DeepSpeed's ``reduce_bucket_size``.
    """
    from .cost import check_cost, cost_vector  # local import keeps the module graph one-way

    _validate(specs, world_size, alpha)
    check_cost(cost)
    if planner not in DP_PLANNERS:
        raise ValueError(f"Unknown DP planner={planner!r}. Allowed: {sorted(DP_PLANNERS)}")
    loads = cost_vector(specs, cost=cost, model=model)
    request = DPRequest(specs, world_size, loads, cost, alpha, model, bucket_numel)
    return DP_PLANNERS[planner](request)


#: the mixed layout's planner name (planning/mixed.py); not an atomic planner
MIXED = "mixed"
#: ``layout`` settings: "owned" (atomic ownership, planned padding), "mixed" (owned + hosted
#: over DP, no padding), "auto" (owned unless its padding exceeds ``max_padding``)
LAYOUTS = ("auto", "owned", "mixed")
#: the default ``max_padding`` of ``layout="auto"`` (padding / useful elements of the owned layout)
DEFAULT_MAX_PADDING = 0.02


def plan_mixed_dp(specs: Sequence[ParamSpec], world_size: int, loads: Sequence[float], cost_model: str = "numel",
                  model=None, param_alignment: int = 1) -> OwnershipPlan:
    """The mixed layout's plan (planning/mixed.py): owned matrices whole in equal chunks, the
    rest hosted over the DP group.  ``rank_params``: owned matrices per rank (buffer order);
    ``owner``: -1 for hosted ones; ``host``: who computes each update; ``rank_load``: the
    cost-model load of everything a rank computes (owned + hosted); ``rank_numel``: elements
    of its range.  ``extra["step_bytes"]``: per-step communication (mixed.step_bytes)."""
    from .cost import cost_vector
    from .mixed import plan_mixed, step_bytes

    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    if model is not None:
        flops = cost_vector(specs, "flops", model)
        memory = cost_vector(specs, "memory", model)
        state = [m - s.numel * 8 for m, s in zip(memory, specs)]  # planning.cost.MASTER_GRAD_BYTES
    else:
        flops, state = [float(s.numel) for s in specs], [0.0] * len(specs)
    direction_bytes = 4  # fp32 gradients travel to the host; directions come back in the rule's dtype
    if model is not None and hasattr(model, "direction_dtype"):
        import torch  # only with a rule object, which is torch code itself

        direction_bytes = model.direction_dtype(torch.float32).itemsize
    # the rule's element-wise state (Muon's momentum, fp32) stays with a hosted matrix's pieces
    elementwise_bytes = 4.0 * len(getattr(model, "elementwise_state", ()))
    got = plan_mixed(specs, world_size, flops, state, param_alignment=param_alignment,
                     direction_bytes=direction_bytes, elementwise_bytes=elementwise_bytes)
    order, owner, host, layout = got["order"], got["owner"], got["host"], got["layout"]
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        if owner[i] >= 0:
            rank_params[owner[i]].append(i)
    rank_load = [0.0] * world_size
    for i, h in enumerate(host):
        rank_load[h] += loads[i]
    P = layout.shard_numel
    rank_numel = [0] * world_size
    for off, n in zip(layout.offsets, layout.numels):
        for r in range(off // P, min(world_size - 1, (off + max(n, 1) - 1) // P) + 1):
            rank_numel[r] += max(0, min(off + n, (r + 1) * P) - max(off, r * P))
    host_at = [host[i] if owner[i] < 0 else -1 for i in order]
    rank_hosted = [0] * world_size  # hosted elements in each rank's range (their element-wise state)
    for off, n, o in zip(layout.offsets, layout.numels, layout.owner_at):
        if o < 0:
            for r in range(off // P, min(world_size - 1, (off + max(n, 1) - 1) // P) + 1):
                rank_hosted[r] += max(0, min(off + n, (r + 1) * P) - max(off, r * P))
    extra = {"elementwise_bytes": elementwise_bytes, "rank_hosted_numel": rank_hosted, "step_bytes": step_bytes(layout, host_at, direction_bytes=direction_bytes), "hosted_numel": sum(specs[i].numel for i in order
                                                                               if owner[i] < 0)}
    plan = _finish(MIXED, specs, world_size, rank_params, loads, t0, cost_model, owner=list(owner),
                   rank_numel=rank_numel, rank_load=rank_load, extra=extra)
    return replace(plan, order=tuple(order), host=tuple(host))


def owned_step_bytes(plan: OwnershipPlan) -> dict:
    """Per-step communication of an atomic plan's planned-padding layout (no hosted step):
    :func:`canzona_ds.planning.mixed.step_bytes`."""
    from .mixed import step_bytes

    return step_bytes(plan.nonempty_first().layout())


def choose_layout(specs: Sequence[ParamSpec], world_size: int, layout: str = "auto",
                  max_padding: float = DEFAULT_MAX_PADDING, planner: str = DEFAULT_DP_PLANNER, alpha: float = 1.0,
                  cost: str = "numel", model=None, bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
                  allow_mixed: bool = True, blocked: str = "tensor-parallel ones without a DP x TP grid group"
                  ) -> tuple[OwnershipPlan, OwnershipPlan | None, str]:
    """The documented rule: ``layout="owned"`` is the atomic plan of ``planner``; ``"mixed"``
    the mixed layout; ``"auto"`` the atomic plan unless BOTH its planned padding (DeepSpeed's
    default alignment) exceeds ``max_padding`` AND the mixed layout's step is cheaper for the
    busiest rank (``step_bytes(...)["rank_cost"]``: its share of ZeRO's gradient reduction and
    all-gather of the buffer, padded or not, plus the hosted all-to-alls' bytes and latency,
    planning/mixed.py); then the mixed one.  ``allow_mixed=False``
    (tensor-parallel matrices without a DP x TP grid group, which cannot be hosted) keeps the
    atomic plan under "auto".  Under DeepSpeed MoE each matrix group (dense, each expert group)
    is chosen by this rule on its own.  Returns (chosen plan, the atomic plan or None, why)."""
    if layout not in LAYOUTS:
        raise ValueError(f"Invalid layout={layout!r}. Allowed: {list(LAYOUTS)}.")
    if isinstance(max_padding, bool) or not isinstance(max_padding, (int, float)) or not max_padding >= 0:
        raise ValueError(f"Invalid max_padding={max_padding!r}. Must be a number >= 0 (a fraction: 0.02 = 2%).")
    from .cost import cost_vector

    if layout == "mixed":
        return plan_mixed_dp(specs, world_size, cost_vector(specs, cost, model), cost, model), None, "layout=mixed"
    atomic = plan_dp(specs, world_size, planner=planner, alpha=alpha, cost=cost, model=model,
                     bucket_numel=bucket_numel)
    if layout == "owned" or atomic.split_params:
        return atomic, atomic, "layout=owned"
    pad = atomic.padding_fraction
    if pad <= max_padding:
        return atomic, atomic, f"owned padding {pad:.2%} <= max_padding {max_padding:.2%}"
    mixed = plan_mixed_dp(specs, world_size, cost_vector(specs, cost, model), cost, model)
    owned_cost, mixed_cost = owned_step_bytes(atomic)["rank_cost"], mixed.extra["step_bytes"]["rank_cost"]
    if mixed_cost >= owned_cost:
        return atomic, atomic, f"owned padding {pad:.2%} > max_padding {max_padding:.2%}, but the mixed step costs " \
                               f"more ({mixed_cost:,} >= {owned_cost:,} byte-equivalents per rank): owned kept"
    why = f"owned padding {pad:.2%} > max_padding {max_padding:.2%} and the mixed step costs less " \
          f"({mixed_cost:,} < {owned_cost:,} byte-equivalents per rank)"
    if not allow_mixed:
        return atomic, atomic, f"{why}, but the mixed layout cannot host these matrices ({blocked}): owned kept"
    return mixed, atomic, f"{why}: mixed"

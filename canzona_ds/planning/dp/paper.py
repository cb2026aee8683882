"""The paper's planners: its Algorithm 1 (``alpha_balanced``) and the baselines it is measured
against, plus the buckets they cut:

    equal_chunk     DeepSpeed's stock ZeRO-1 slicing (splits matrices)
    naive_atomic    equal ranges snapped to the nearest matrix boundary
    paper_naive     eq. 1: a matrix goes to the rank its start falls in, per bucket
    alpha_balanced  Algorithm 1: alpha-balanced greedy LPT, per bucket
    lpt             global LPT on one cost
    layerwise       NVIDIA's layer-wise optimizer: whole layers, LPT over layers

The production planner is ``multi_lpt`` (multi_lpt.py)."""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from typing import Sequence

from ..params import ParamSpec
from .plan import OwnershipPlan, _finish, _validate


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
    from ..cost import slice_cost

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

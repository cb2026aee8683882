"""The mixed layout: equal ZeRO chunks with owned matrices whole inside them and *hosted*
matrices filling the rest, straddling chunk boundaries (no padding for them).

Atomic ownership (``planning/layout.py``) pads every rank's range to the largest rank's load;
when ranks outnumber a fair share of matrices that padding explodes (Qwen3-8B at TP=8, DP=256:
271%), and ZeRO-1/2 replicate and all-gather the padded buffer every step.  The mixed layout
keeps the chunk P as small as the alignments allow (``ceil(S/dp)``) and lets the matrices that
do not fit be cut::

    dp = 3, P = 8     owned: A (rank 0), C (rank 1), E (rank 2); hosted: H1 (cut 0|1), H2 (cut 1|2)

    | A A A A A H1 H1 H1 | H1 H1 C C C C H2 H2 | H2 H2 H2 E E E E . |
      rank 0 (P)           rank 1 (P)            rank 2 (P)

A hosted matrix is a :class:`~canzona_ds.tp.runtime.FlatSplit` of its pieces over the DP group:
each step its gradient pieces go to a planned host (one fused all-to-all per micro-group), the
rule runs on the whole matrix there, and every rank gets back its piece of the direction and
applies it to its fp32 partition (tp/runtime.py; bit-exact).  That costs ~2x the hosted
matrices' bytes over DP per step, which the plan reports next to the all-gather bytes the
padding would have cost.  A rule's element-wise state (``MatrixRule.elementwise_state``, Muon's
momentum) stays with the pieces: every rank updates its piece and sends ``pre_direction``'s
result, so the host keeps only the rest, and the planner counts that state per piece.

Under tensor parallelism the plan is made over the TP-local shapes and every TP rank's buffer
follows it, so a hosted TP-split matrix is cut twice: into TP shards, and each shard into these
DP pieces (:class:`~canzona_ds.tp.runtime.GridSplit` over the DP x TP grid).  Its host is the
grid cell (the plan's DP host, the TP rank :func:`grid_tp_hosts` picks, each TP rank starting
from what the owned TP runtime already updates there: :func:`tp_cells`); the bytes here are one
TP rank's (its TP-local pieces)::

    DP=2 x TP=2; d=0 owns the TP-split A and hosts the TP-split B, C; d=1 owns the replicated D
                  tp=0     tp=1
      dp=0        A        B C      A where the owned TP runtime put it; B and C start from it
      dp=1        D        D        a replicated matrix: every TP rank updates its replica

The planner (:func:`plan_mixed`) walks the buffer rank by rank:

1. rank r's range starts where the previous hosted matrix ended (``c``); the largest matrices
   that fit in ``[c, (r+1)P)`` become rank r's owned ones (first-fit decreasing by element
   count), as long as rank r's owned FLOPs stay under the FLOPs cap (the mean, or the largest
   matrix where that is bigger);
2. the rest of the range is filled by hosted matrices (first those too big for any chunk, then
   the smallest), the last one running on into the next range;
3. the hosts of the hosted matrices are chosen afterwards, heaviest first onto the rank with
   the lowest worst criterion (FLOPs, then optimizer memory), starting from the owned loads,
   then improved by moves and swaps of hosted matrices only (owned ones are pinned by the
   layout).

So no range has a gap and padding is only the alignment's.  Deterministic: every rank
computes the same plan from the same specs.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .layout import DS_START_ALIGNMENT, Layout
from .params import ParamSpec

#: what one collective's latency is worth in bytes when the auto rule compares layouts (the
#: alpha-beta model: ~20 us of launch and synchronisation at ~25 GB/s per rank); a hosted step
#: pays it twice per micro-group, so a model whose padding is a few kilobytes keeps the owned
#: layout (dp.choose_layout)
LATENCY_BYTES = 1 << 19
#: element size of the replicated bit16 buffer (bf16/fp16) and of the fp32 pieces the hosted
#: step sends (gradients there, directions back)
BIT16_BYTES, FP32_BYTES = 2, 4


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def place(owner_at: Sequence[int], numels: Sequence[int], world_size: int, param_alignment: int = 1,
          start_alignment: int = DS_START_ALIGNMENT) -> Layout:
    """The mixed layout of a buffer order: ``owner_at[k]`` is the owner rank of the k-th
    parameter (-1: hosted), ``numels[k]`` its size.  Owned parameters must lie whole in their
    owner's range; hosted ones go where the cursor is.  The smallest P (a multiple of both
    alignments, from ``ceil(S/dp)`` up) at which that works."""
    for name, v in (("param_alignment", param_alignment), ("start_alignment", start_alignment)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Invalid {name}={v!r}. Must be an int >= 1.")
    if len(owner_at) != len(numels) or not numels:
        raise ValueError(f"owner_at ({len(owner_at)}) and numels ({len(numels)}) must be one per parameter, >= 1.")
    if any(not -1 <= o < world_size for o in owner_at):
        raise ValueError(f"owner_at must hold ranks in [0, {world_size}) or -1 (hosted), got {list(owner_at)}")
    a = param_alignment
    lcm = math.lcm(param_alignment, start_alignment)
    P = _round_up(max(1, -(-sum(_round_up(int(n), a) for n in numels) // world_size)), lcm)
    step = lcm
    for attempt in range(10_000):
        got = _try_place(owner_at, numels, world_size, a, P)
        if got is not None:
            offsets, padding = got
            counts = [sum(1 for o in owner_at if o == r) for r in range(world_size)]
            return Layout(world_size=world_size, rank_counts=tuple(counts), numels=tuple(int(n) for n in numels),
                          shard_numel=P, offsets=tuple(offsets), padding=tuple(padding), param_alignment=a,
                          start_alignment=start_alignment, owner_at=tuple(int(o) for o in owner_at))
        P += step
        if attempt >= 64:
            step *= 2
    raise RuntimeError("no mixed layout found")  # unreachable: P >= S always works in rank order


def _try_place(owner_at, numels, dp, a, P):
    offsets, c = [], 0
    for own, n in zip(owner_at, numels):
        if own >= 0:
            lo, hi = own * P, (own + 1) * P
            start = max(c, lo)
            if start + n > hi or (start > c and not offsets):
                return None
        else:
            start = c
        offsets.append(start)
        c = _round_up(start + int(n), a)
    if c > dp * P:
        return None
    padding = [(offsets[k + 1] if k + 1 < len(offsets) else dp * P) - offsets[k] - int(numels[k])
               for k in range(len(offsets))]
    return offsets, padding


def hosted_pieces(layout: Layout, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(starts, lengths) per rank of buffer parameter ``k``'s elements, the cut of its
    :class:`~canzona_ds.tp.runtime.FlatSplit`."""
    P, off, n = layout.shard_numel, layout.offsets[k], layout.numels[k]
    starts, lengths = [], []
    for r in range(layout.world_size):
        a, b = max(off, r * P), min(off + n, (r + 1) * P)
        starts.append(min(max(a - off, 0), n))
        lengths.append(max(0, b - a))
    return tuple(starts), tuple(lengths)


def plan_mixed(specs: Sequence[ParamSpec], world_size: int, flops: Sequence[float], state: Sequence[float],
               param_alignment: int = 1, start_alignment: int = DS_START_ALIGNMENT,
               master_grad_bytes: int = 8, refine_iters: int | None = None, direction_bytes: int = FP32_BYTES,
               elementwise_bytes: float = 0.0) -> dict:
    """Choose owned vs hosted per matrix, the buffer order and the hosts (module doc).

    ``flops``/``state``: per spec, the rule's FLOPs (amortised) and state bytes of the whole
    matrix (its host's or owner's); ``elementwise_bytes``: bytes per element of the rule's
    element-wise state (``MatrixRule.elementwise_state``), which a hosted matrix keeps with its
    pieces (its host holds ``state - elementwise_bytes * numel``).  The owned FLOPs cap of step 1 is tried at
    ``OWNED_CAPS`` x the mean; the candidate with the lowest (worst rank's FLOPs over the
    mean, rounded to 0.1%; the busiest rank's step cost, :func:`step_bytes`; worst rank's
    memory over the mean) wins, so hosting (communication) is only added where it buys FLOPs
    balance.  Returns a dict: ``order`` (buffer order, spec indices), ``owner`` (per spec:
    owner rank, -1 hosted), ``host`` (per spec: the rank computing its update), ``layout``
    (:class:`Layout` at the given alignments)."""
    best = None
    for k, factor in enumerate(OWNED_CAPS):
        got = _plan_with_cap(specs, world_size, flops, state, param_alignment, start_alignment, master_grad_bytes,
                             refine_iters, factor, elementwise_bytes)
        order, owner, host = got["order"], got["owner"], got["host"]
        cost = step_bytes(got["layout"], [host[i] if owner[i] < 0 else -1 for i in order],
                          direction_bytes=direction_bytes)["rank_cost"]
        key = (round(got.pop("flops_score"), 3), cost, round(got.pop("score"), 3), k)
        if best is None or key < best[0]:
            best = (key, got)
    return best[1]


#: owned-FLOPs caps tried by :func:`plan_mixed`, as multiples of the mean rank's FLOPs (the
#: largest matrix's FLOPs where that is more); 0 hosts every matrix
OWNED_CAPS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)


def _plan_with_cap(specs, world_size, flops, state, param_alignment, start_alignment, master_grad_bytes,
                   refine_iters, factor, elementwise_bytes=0.0) -> dict:
    n_specs = len(specs)
    a = param_alignment
    lcm = math.lcm(param_alignment, start_alignment)
    sizes = [_round_up(s.numel, a) for s in specs]
    P = _round_up(max(1, -(-sum(sizes) // world_size)), lcm)
    total_flops = sum(flops)
    cap = max(total_flops / world_size, max(flops) if flops else 0.0) * factor * (1 + 1e-12)
    pool = sorted(range(n_specs), key=lambda i: (-sizes[i], i))
    owner = [-1] * n_specs
    order: list[int] = []
    c = 0
    for r in range(world_size):
        lo, hi = r * P, (r + 1) * P
        if not pool:
            break
        if c < hi:
            room, f = hi - max(c, lo), 0.0
            taken = []
            for i in pool:
                if sizes[i] <= room and f + flops[i] <= cap:
                    taken.append(i)
                    room -= sizes[i]
                    f += flops[i]
            for i in sorted(taken):  # model order inside the rank
                owner[i] = r
                order.append(i)
                pool.remove(i)
            if taken:
                c = max(c, lo) + sum(sizes[i] for i in taken)
        # fill the rest of the range with hosted matrices, the last running on
        while c < hi and pool:
            big = [i for i in pool if sizes[i] > P]
            i = big[0] if big else pool[-1]
            pool.remove(i)
            order.append(i)
            c += sizes[i]
    order.extend(pool)  # only when every range is full (alignment rounding)
    layout = place([owner[i] for i in order], [specs[i].numel for i in order], world_size, a, start_alignment)
    # hosts: owned matrices on their owner; hosted ones balanced over (FLOPs, memory)
    P = layout.shard_numel
    f_load = [0.0] * world_size
    m_load = [0.0] * world_size
    # the fp32 master + gradient of each range, and the element-wise state of the hosted pieces in it
    # (an expert stack's host keeps all of its state: tp/runtime.py)
    piecewise = [owner[i] < 0 and specs[i].num_experts is None for i in range(n_specs)]
    for i, off, n in zip(order, layout.offsets, layout.numels):
        per = master_grad_bytes + (elementwise_bytes if piecewise[i] else 0.0)
        for r in range(off // P, min(world_size - 1, (off + max(n, 1) - 1) // P) + 1):
            m_load[r] += max(0, min(off + n, (r + 1) * P) - max(off, r * P)) * per
    state = [st - (elementwise_bytes * specs[i].numel if piecewise[i] else 0.0) for i, st in enumerate(state)]
    for i in range(n_specs):
        if owner[i] >= 0:
            f_load[owner[i]] += flops[i]
            m_load[owner[i]] += state[i]
    host = list(owner)
    hosted = [i for i in range(n_specs) if owner[i] < 0]
    f_mean = max(total_flops / world_size, 1e-300)
    m_mean = max((sum(m_load) + sum(state[i] for i in hosted)) / world_size, 1e-300)

    def score(f: float, m: float) -> tuple[float, float]:
        return (max(f / f_mean, m / m_mean), f / f_mean + m / m_mean)

    for i in sorted(hosted, key=lambda i: (-flops[i], -state[i], i)):
        r = min(range(world_size), key=lambda r: (score(f_load[r] + flops[i], m_load[r] + state[i]), r))
        host[i] = r
        f_load[r] += flops[i]
        m_load[r] += state[i]
    _refine_hosts(hosted, host, flops, state, f_load, m_load, f_mean, m_mean, world_size,
                  refine_iters if refine_iters is not None else 4 * (n_specs + world_size))
    worst = max(max(f / f_mean, m / m_mean) for f, m in zip(f_load, m_load))
    return {"order": order, "owner": owner, "host": host, "layout": layout, "score": worst,
            "flops_score": max(f_load) / f_mean,
            "hosted_numel": sum(specs[i].numel for i in hosted)}


def _refine_hosts(hosted, host, flops, state, f_load, m_load, f_mean, m_mean, dp, iters) -> None:
    """Lower the worst rank's max(FLOPs/mean, memory/mean) by moving or swapping hosted
    matrices (owned ones are pinned); strict improvement only, first best on ties."""
    def worst(r: int) -> float:
        return max(f_load[r] / f_mean, m_load[r] / m_mean)

    for _ in range(iters):
        w = max(range(dp), key=lambda r: (worst(r), -r))
        cur = worst(w)
        mine = [i for i in hosted if host[i] == w]
        best = (cur, None)
        for i in mine:
            for r in range(dp):
                if r == w:
                    continue
                nw = max((f_load[w] - flops[i]) / f_mean, (m_load[w] - state[i]) / m_mean)
                nr = max((f_load[r] + flops[i]) / f_mean, (m_load[r] + state[i]) / m_mean)
                if max(nw, nr) < best[0] - 1e-12:
                    best = (max(nw, nr), ("move", i, r))
            for j in hosted:
                r = host[j]
                if r == w:
                    continue
                df, dm = flops[j] - flops[i], state[j] - state[i]
                nw = max((f_load[w] + df) / f_mean, (m_load[w] + dm) / m_mean)
                nr = max((f_load[r] - df) / f_mean, (m_load[r] - dm) / m_mean)
                if max(nw, nr) < best[0] - 1e-12:
                    best = (max(nw, nr), ("swap", i, j))
        if best[1] is None:
            return
        kind, i, x = best[1]
        if kind == "move":
            f_load[w] -= flops[i]; m_load[w] -= state[i]  # noqa: E702
            f_load[x] += flops[i]; m_load[x] += state[i]  # noqa: E702
            host[i] = x
        else:
            r = host[x]
            df, dm = flops[x] - flops[i], state[x] - state[i]
            f_load[w] += df; m_load[w] += dm  # noqa: E702
            f_load[r] -= df; m_load[r] -= dm  # noqa: E702
            host[i], host[x] = r, w


def step_bytes(layout: Layout, host_of_k: Sequence[int] | None = None, grad_bytes: int = FP32_BYTES,
               direction_bytes: int = FP32_BYTES, bit16_bytes: int = BIT16_BYTES) -> dict:
    """Per-step communication of a layout, from the plan alone (bytes).

    ``all_gather``: the replicated bit16 buffer (``dp * P`` elements, the padding included),
    which ZeRO's post-step all-gather delivers to every rank; ``zero_total``: the wire bytes of
    ZeRO's gradient reduction and all-gather together over all ranks, ``(dp - 1) * (S + dp *
    P) * bit16`` (ring algorithms; gradients reduced in the bit16 dtype, slice by slice to
    their owners, so the padding is not reduced, only gathered: measured in
    benchmarks/results/layout_measured.md); ``hosted_sent``: what
    each rank sends in the hosted step's all-to-alls (its gradient pieces of matrices hosted
    elsewhere, and as a host every other rank's direction piece), as
    :class:`~canzona_ds.tp.runtime.StepStats` counts them; ``total`` = ``zero_total`` + the
    hosted bytes of all ranks; ``hosted_collectives``: the hosted step's all-to-alls (two per
    micro-group, a micro-group per matrix of the busiest host); ``rank_cost``: the busiest
    rank's step in bytes, ``zero_total / dp + hosted_sent_max + hosted_collectives *
    LATENCY_BYTES`` (what the auto rule compares).  ``host_of_k``: per buffer parameter, its host rank (-1: owned;
    None: no hosted matrix, the atomic layout)."""
    dp = layout.world_size
    sent = [0] * dp
    for k, h in enumerate(host_of_k or ()):
        if h < 0:
            continue
        _, lengths = hosted_pieces(layout, k)
        for r in range(dp):
            if r != h:
                sent[r] += lengths[r] * grad_bytes
                sent[h] += lengths[r] * direction_bytes
    zero_total = (dp - 1) * (layout.total_numel + layout.buffer_numel) * bit16_bytes
    hosts = [h for h in (host_of_k or ()) if h >= 0]
    collectives = 2 * max((hosts.count(r) for r in set(hosts)), default=0)
    return {"all_gather": layout.buffer_numel * bit16_bytes, "zero_total": zero_total, "hosted_sent": sent,
            "hosted_sent_max": max(sent), "hosted_sent_total": sum(sent), "total": zero_total + sum(sent),
            "hosted_collectives": collectives,
            "rank_cost": zero_total // dp + max(sent) + collectives * LATENCY_BYTES}


def grid_tp_hosts(dp_hosts: Sequence[int], costs: Sequence[float], tp_size: int,
                  seed: Mapping[tuple[int, int], float] | None = None) -> list[int]:
    """The TP rank of each tensor-parallel hosted matrix's host (the mixed layout under DP x
    TP): the matrix's update runs at grid cell (its DP host, this TP rank).  Every TP rank at one
    DP index shares that index's hosted matrices: heaviest first (``costs``: the full matrix's
    cost), each onto the least-loaded TP rank at its DP host, lowest rank on ties;
    deterministic, the same on every rank.  ``seed``: the load already on cell (dp, tp) before
    any of these (:func:`tp_cells` passes the owned TP runtime's FLOPs there, so a TP rank that
    already hosts owned TP-split matrices takes fewer grid ones); None: every cell starts at 0."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"Invalid tp_size={tp_size!r}. Must be an int >= 1.")
    if len(dp_hosts) != len(costs):
        raise ValueError(f"dp_hosts ({len(dp_hosts)}) and costs ({len(costs)}) must be one per matrix.")
    load: dict[tuple[int, int], float] = {}
    for cell, v in (seed or {}).items():
        ok = isinstance(cell, tuple) and len(cell) == 2 and all(isinstance(c, int) and c >= 0 for c in cell)
        if not ok or cell[1] >= tp_size or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"Invalid seed entry {cell!r}: {v!r}. Keys must be (dp_rank, tp_rank) cells with "
                             f"0 <= tp_rank < {tp_size}, values finite loads >= 0.")
        load[cell] = float(v)
    out = [0] * len(dp_hosts)
    for j in sorted(range(len(dp_hosts)), key=lambda j: (-costs[j], j)):
        h = dp_hosts[j]
        t = min(range(tp_size), key=lambda t: (load.get((h, t), 0.0), t))
        out[j] = t
        load[(h, t)] = load.get((h, t), 0.0) + costs[j]
    return out


def full_matrix_flops(spec: ParamSpec, model, full_shape: Sequence[int] | None = None) -> float:
    """The rule's amortised FLOPs of one whole update of ``spec`` on its host: the whole (TP=1)
    matrix of a TP-split one (``full_shape``: its real full shape, e.g. AutoTP's uneven shards
    summed; default ``spec.full_shape``), every expert of a stack."""
    if spec.is_tp_split:
        shape = tuple(full_shape) if full_shape is not None else spec.full_shape
        return float(model.flops((shape[0], math.prod(shape[1:])), spec.num_heads).amortised)
    return float(spec.matrix_count * model.flops(spec.matrix_shape, spec.num_heads).amortised)


def owned_tp_hosts(plan, tp_size: int, model, scheduler: str | None = None, c_max: float | None = None,
                   cost: str = "numel", full_shapes: Mapping[str, Sequence[int]] | None = None) -> dict[int, int]:
    """Spec index -> TP rank of every owned TP-split matrix of a DP plan, where the owned TP
    runtime hosts it: each DP rank's owned TP-split matrices (buffer order) scheduled over its
    TP group by ``planning/tp.plan_tp`` with the runtime's settings (``canzona_tp``: scheduler,
    c_max, cost) on the whole matrices, as ``tp/runtime.plan_groups`` does.  From the plan alone."""
    from .tp import DEFAULT_TP_SCHEDULER, plan_tp

    full_shapes = full_shapes or {}
    by_dp: dict[int, list[int]] = {}
    for i in plan.buffer_order():
        o, spec = plan.owner[i], plan.specs[i]
        if o >= 0 and spec.is_tp_split:
            by_dp.setdefault(o, []).append(i)
    out = {}
    for idx in by_dp.values():
        specs = [ParamSpec(plan.specs[i].name, tuple(full_shapes.get(plan.specs[i].name, plan.specs[i].full_shape)),
                           "matrix", num_heads=plan.specs[i].num_heads) for i in idx]
        got = plan_tp(specs, tp_size, scheduler=scheduler or DEFAULT_TP_SCHEDULER, c_max=c_max, cost=cost,
                      model=model)
        out.update(zip(idx, got.host))
    return out


def tp_cells(plan, tp_size: int, model, scheduler: str | None = None, c_max: float | None = None,
             cost: str = "numel", full_shapes: Mapping[str, Sequence[int]] | None = None,
             seed_owned: bool = True) -> dict:
    """Where every matrix of a DP plan is updated on the DP x TP grid, and each cell's FLOPs (the
    rule's amortised FLOPs of the whole matrices it updates), from the plan alone: every rank
    computes the same.

    ``owned_tp``: spec index -> TP rank of each owned TP-split matrix (:func:`owned_tp_hosts`,
    the owned TP runtime's hosts over its owner's TP group); ``grid_tp``: spec index -> TP rank
    of each hosted TP-split matrix (:func:`grid_tp_hosts` at the plan's DP host, each TP rank
    seeded with its owned TP runtime's FLOPs at that DP index; ``seed_owned=False``: unseeded,
    the choice before the seed); ``cell_flops[d][t]``: FLOPs of cell (d, t): owned TP-split and
    grid-hosted matrices at their cell, owned and DP-hosted replicated matrices on every TP rank
    of their DP index (each TP rank updates its replica)."""
    dp = plan.world_size
    full_shapes = full_shapes or {}
    order = plan.buffer_order()
    flops = {i: full_matrix_flops(plan.specs[i], model, full_shapes.get(plan.specs[i].name)) for i in order}
    host = plan.host if plan.mixed else plan.owner
    owned_tp = owned_tp_hosts(plan, tp_size, model, scheduler, c_max, cost, full_shapes)
    cells = [[0.0] * tp_size for _ in range(dp)]
    for i in order:
        if plan.specs[i].is_tp_split:
            if i in owned_tp:
                cells[plan.owner[i]][owned_tp[i]] += flops[i]
        else:
            for t in range(tp_size):
                cells[host[i]][t] += flops[i]
    seed = None
    if seed_owned:  # (replicated matrices load every TP rank of a DP index alike: only these differ)
        seed = {}
        for i, t in owned_tp.items():
            seed[(plan.owner[i], t)] = seed.get((plan.owner[i], t), 0.0) + flops[i]
    grid = [i for i in order if plan.owner[i] < 0 and plan.specs[i].is_tp_split]
    tps = grid_tp_hosts([host[i] for i in grid], [flops[i] for i in grid], tp_size, seed)
    for i, t in zip(grid, tps):
        cells[host[i]][t] += flops[i]
    return {"owned_tp": owned_tp, "grid_tp": dict(zip(grid, tps)), "cell_flops": cells}

"""The production planner (``DEFAULT_DP_PLANNER``): multi-criteria LPT with swap refinement,
balancing the cost-model load, ``numel`` (hence the planned padding), and the rule's FLOPs and
state bytes together; deterministic (index tiebreaks, an iteration cap, no time limit)."""
from __future__ import annotations

import itertools
import time
from typing import Sequence

import numpy as np

from ..params import ParamSpec
from .plan import OwnershipPlan, _finish, _validate


def _criteria(specs: Sequence[ParamSpec], loads: Sequence[float], model) -> np.ndarray:
    """Columns to balance together: the planner's load, numel (= padding), and, with a cost
    model, the optimizer's FLOPs and memory; columns proportional to an earlier one are
    dropped."""
    from ..cost import cost_vector

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

"""planning/layout.py: the planned-padding layout, without DeepSpeed.

Every test checks the layout's invariants (``check_layout``): each rank's range is exactly
P elements, no parameter crosses a range boundary, offsets and padding agree, alignments
hold, and P is the smallest valid size.  A second, independent construction of the
layout (``reference_layout``: place parameters one by one, then pick P) must give the same
offsets on random plans.
"""
from __future__ import annotations

import math
import random

import pytest

from canzona_ds.planning.dp import ATOMIC_DP_PLANNERS, plan_dp
from canzona_ds.planning.layout import DS_START_ALIGNMENT, Layout, nonempty_first, plan_layout
from canzona_ds.planning.params import ParamSpec
from canzona_testkit.kernels import assert_bits


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def check_layout(lay: Layout) -> None:
    """Every invariant the ZeRO integration relies on."""
    dp, P, n = lay.world_size, lay.shard_numel, len(lay.numels)
    assert len(lay.offsets) == len(lay.padding) == n == sum(lay.rank_counts)
    assert len(lay.rank_counts) == dp
    assert P >= 1 and P % math.lcm(lay.param_alignment, lay.start_alignment) == 0
    # offsets and padding chain through the whole buffer, which is dp ranges of exactly P
    assert lay.offsets[0] == 0
    for j in range(n - 1):
        assert lay.offsets[j + 1] == lay.offsets[j] + lay.numels[j] + lay.padding[j]
    assert lay.offsets[-1] + lay.numels[-1] + lay.padding[-1] == dp * P == lay.buffer_numel
    assert all(p >= 0 for p in lay.padding)
    assert lay.total_padding == sum(lay.padding) == dp * P - sum(lay.numels)
    assert lay.padding_fraction == pytest.approx(lay.total_padding / sum(lay.numels) if sum(lay.numels) else 0.0)
    owners = lay.owners()
    assert owners == sorted(owners) and len(owners) == n
    assert [owners.count(r) for r in range(dp)] == list(lay.rank_counts)
    used = [0] * dp
    for j, (off, numel, r) in enumerate(zip(lay.offsets, lay.numels, owners)):
        # inside its owner's range [r*P, (r+1)*P): no parameter crosses a boundary
        assert r * P <= off and off + numel <= (r + 1) * P, f"parameter {j} crosses a range boundary"
        assert off % lay.param_alignment == 0
        used[r] = off + numel - r * P
    for r in range(dp):
        views = lay.rank_views(r)
        assert [j for j, _ in views] == [j for j, o in enumerate(owners) if o == r]
        if views:  # a rank's first parameter starts its range (DeepSpeed: first_offset 0)
            assert views[0][1] == 0
            assert all(0 <= v and v + lay.numels[j] <= P for j, v in views)
    # P is the smallest multiple of both alignments holding the fullest rank
    assert P == _round_up(max(max(used), 1), math.lcm(lay.param_alignment, lay.start_alignment))


def reference_layout(counts: list[int], numels: list[int], pa: int, sa: int) -> tuple[int, list[int]]:
    """Independent construction: place each rank's parameters from its range start, each
    on a multiple of ``pa``; P = the fullest rank rounded up to lcm(pa, sa)."""
    rel, used, k = [], [], 0
    for c in counts:
        pos = 0
        for j in range(k, k + c):
            pos = _round_up(pos, pa)
            rel.append(pos)
            pos += numels[j]
        used.append(pos)
        k += c
    P = _round_up(max(max(used), 1), math.lcm(pa, sa))
    owners = [r for r, c in enumerate(counts) for _ in range(c)]
    return P, [r * P + o for r, o in zip(owners, rel)]


def test_docstring_worked_example():
    lay = plan_layout([2, 1], [5, 3, 6], param_alignment=2, start_alignment=2)
    check_layout(lay)
    assert lay.shard_numel == 10
    assert lay.offsets == (0, 6, 10)
    assert lay.padding == (1, 1, 4)
    assert lay.buffer_numel == 20 and lay.total_numel == 14
    assert lay.total_padding == 6
    assert lay.padding_fraction == pytest.approx(6 / 14)
    assert_bits(round(100 * lay.padding_fraction, 1), 42.9)
    assert lay.owners() == [0, 0, 1]
    assert lay.rank_views(0) == [(0, 0), (1, 6)] and lay.rank_views(1) == [(2, 0)]
    # the picture: | A A A A A . B B B . | C C C C C C . . . . |
    cells = ["."] * lay.buffer_numel
    for name, off, n in zip("ABC", lay.offsets, lay.numels):
        cells[off:off + n] = name * n
    assert "".join(cells) == "AAAAA.BBB.CCCCCC...."


def test_default_alignment_is_deepspeeds():
    assert DS_START_ALIGNMENT == 2
    lay = plan_layout([1, 1], [7, 4])  # param_alignment 1, start alignment 2
    check_layout(lay)
    assert lay.shard_numel == 8 and lay.offsets == (0, 8) and lay.padding == (1, 4)


def test_no_padding_when_ranks_are_equal_and_aligned():
    lay = plan_layout([2, 2, 2], [4, 6, 5, 5, 10, 0], param_alignment=1, start_alignment=2)
    check_layout(lay)
    assert lay.shard_numel == 10 and lay.total_padding == 0 and lay.padding == (0,) * 6


def test_trailing_empty_ranks_are_all_padding():
    lay = plan_layout([2, 1, 0, 0], [3, 3, 4], start_alignment=2)
    check_layout(lay)
    assert lay.shard_numel == 6
    assert lay.offsets == (0, 3, 6)
    # the last parameter pads through rank 1's rest and the two empty ranges
    assert lay.padding == (0, 0, 2 + 6 + 6)
    assert lay.rank_views(2) == [] and lay.rank_views(3) == []
    assert lay.buffer_numel == 24 and lay.total_padding == 14


def test_empty_ranks_in_the_middle():
    lay = plan_layout([1, 0, 0, 2, 0, 1], [4, 2, 2, 3], param_alignment=1, start_alignment=1)
    check_layout(lay)
    assert lay.shard_numel == 4
    # rank 0's parameter pads over ranks 1 and 2 to rank 3's start
    assert lay.offsets == (0, 12, 14, 20)
    assert lay.padding == (0 + 4 + 4, 0, 0 + 4, 1)  # C ends rank 3's range; rank 4 is all padding
    assert lay.owners() == [0, 3, 3, 5]
    for r in (1, 2, 4):
        assert lay.rank_views(r) == []


def test_rank_zero_empty_is_refused():
    with pytest.raises(ValueError, match="rank 0 owns no parameter"):
        plan_layout([0, 2], [3, 3])


def test_param_alignment_within_a_rank():
    lay = plan_layout([3, 1], [5, 1, 7, 2], param_alignment=4, start_alignment=2)
    check_layout(lay)
    # rank 0: 5 -> pad 3, 1 at 8 -> pad 3, 7 at 12 -> used 19; P = round_up(19, lcm(4, 2)) = 20
    assert lay.shard_numel == 20
    assert lay.offsets == (0, 8, 12, 20)
    assert lay.padding == (3, 3, 1, 18)


@pytest.mark.parametrize("pa, sa", [(1, 1), (1, 2), (2, 2), (4, 6), (3, 8), (16, 2), (5, 7)])
def test_shard_is_multiple_of_both_alignments(pa, sa):
    lay = plan_layout([2, 3, 1], [7, 9, 1, 2, 3, 11], param_alignment=pa, start_alignment=sa)
    check_layout(lay)
    assert lay.shard_numel % pa == 0 and lay.shard_numel % sa == 0
    assert lay.shard_numel % math.lcm(pa, sa) == 0


def test_single_rank_and_single_parameter():
    lay = plan_layout([1], [13], start_alignment=8)
    check_layout(lay)
    assert lay.shard_numel == 16 and lay.padding == (3,)
    zero = plan_layout([1], [0])  # a zero-size parameter still gets a range of at least 1 aligned unit
    check_layout(zero)
    assert zero.shard_numel == 2 and zero.padding == (2,)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([1], [3]), {"param_alignment": 0}, "param_alignment=0"),
        (([1], [3]), {"param_alignment": True}, "param_alignment=True"),
        (([1], [3]), {"start_alignment": 2.0}, "start_alignment=2.0"),
        (([1], [3]), {"start_alignment": -4}, "start_alignment=-4"),
        (([2], [3]), {}, r"rank_counts=\[2\].*1 parameters"),
        (([1, -1, 1], [3]), {}, r"rank_counts=\[1, -1, 1\]"),
        (([1.5, 0.5], [3, 4]), {}, r"rank_counts=\[1.5, 0.5\]"),
        (([], []), {}, r"rank_counts=\[\]"),
        (([0], []), {}, "at least one parameter"),
        (([1, 1], [3, -2]), {}, r"numels\[1\]=-2"),
        (([1], [2.5]), {}, r"numels\[0\]=2.5"),
    ],
)
def test_bad_input_is_named(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout(*args, **kwargs)


def test_fingerprint_is_stable_and_sensitive():
    a = plan_layout([2, 1], [5, 3, 6], 2, 2)
    assert a.fingerprint() == plan_layout((2, 1), (5, 3, 6), 2, 2).fingerprint()
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() != plan_layout([2, 1], [5, 3, 6], 4, 2).fingerprint()  # other padding
    assert a.fingerprint() != plan_layout([1, 2], [5, 3, 6], 2, 2).fingerprint()  # other owners


def test_nonempty_first():
    assert nonempty_first([[0], [1, 2], [3]]) == [0, 1, 2]
    assert nonempty_first([[], [0], [], [1, 2], []]) == [1, 3, 0, 2, 4]
    assert nonempty_first([(), ()]) == [0, 1]
    order = nonempty_first([[], [], [5]])
    assert order == [2, 0, 1]
    # relabelled, the layout exists and keeps every rank's contents
    lay = plan_layout([1, 0, 0], [9])
    check_layout(lay)


def test_random_layouts_match_reference():
    rng = random.Random(20260101)
    for trial in range(600):
        dp = rng.randint(1, 9)
        rank_params = [[] for _ in range(dp)]
        n = rng.randint(1, 25)
        for j in range(n):
            rank_params[rng.randrange(dp) if rng.random() < 0.8 else 0].append(j)
        order = nonempty_first(rank_params)
        counts = [len(rank_params[r]) for r in order]
        numels = [rng.choice([0, 1, 2, 3, rng.randint(1, 100), rng.randint(100, 5000)]) for _ in range(n)]
        pa = rng.choice([1, 2, 4, 8, 3])
        sa = rng.choice([1, 2, 8, 6])
        lay = plan_layout(counts, numels, param_alignment=pa, start_alignment=sa)
        check_layout(lay)
        P, offsets = reference_layout(counts, numels, pa, sa)
        assert (lay.shard_numel, list(lay.offsets)) == (P, offsets), f"trial {trial}"


def _plan_specs() -> list[ParamSpec]:
    rng = random.Random(7)
    return [ParamSpec(f"w{i}", (rng.choice([8, 16, 24, 40]), rng.choice([8, 16, 33]))) for i in range(23)]


@pytest.mark.parametrize("planner", ATOMIC_DP_PLANNERS)
@pytest.mark.parametrize("world", [1, 2, 5, 16])
def test_plan_padding_fraction_is_its_layouts(planner, world):
    specs = _plan_specs()
    plan = plan_dp(specs, world, planner=planner, bucket_numel=1500).nonempty_first()
    lay = plan.layout()
    check_layout(lay)
    assert plan.padding_fraction == lay.padding_fraction
    assert lay.numels == tuple(specs[i].numel for i in plan.buffer_order())
    assert lay.rank_counts == tuple(len(r) for r in plan.rank_params)
    aligned = plan.layout(param_alignment=8, start_alignment=16)
    check_layout(aligned)
    assert aligned.shard_numel % 16 == 0 and aligned.total_padding >= lay.total_padding


def test_plan_with_empty_rank_zero_is_relabelled():
    # naive_atomic snaps the first cut to 0: rank 0 owns nothing as planned
    specs = [ParamSpec("big", (100, 10)), ParamSpec("b", (10, 10)), ParamSpec("c", (10, 10))]
    plan = plan_dp(specs, 3, planner="naive_atomic")
    assert plan.rank_params == ((), (0,), (1, 2))
    with pytest.raises(ValueError, match="rank 0 owns no parameter"):
        plan.layout()
    relabelled = plan.nonempty_first()
    assert relabelled.rank_params == ((0,), (1, 2), ())
    assert relabelled.owner == (0, 1, 1) and relabelled.rank_numel == (1000, 200, 0)
    lay = relabelled.layout()
    check_layout(lay)
    assert plan.padding_fraction == lay.padding_fraction == pytest.approx((3 * 1000 - 1200) / 1200)
    assert plan_dp(specs, 3, planner="lpt").nonempty_first().rank_params == ((0,), (1,), (2,))


def test_equal_chunk_has_no_planned_layout():
    specs = [ParamSpec("a", (3, 5))]
    plan = plan_dp(specs, 2, planner="equal_chunk")
    assert plan.split_params == (0,)
    with pytest.raises(ValueError, match="equal_chunk.*splits matrices"):
        plan.layout()
    assert plan.padding_fraction == pytest.approx(1 / 15)  # ceil(15 / 2) * 2 - 15

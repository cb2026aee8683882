"""DP planners: atomicity, contiguity, balance, determinism, edge ranks, bad input."""
from __future__ import annotations

import pytest

from canzona_ds.planning.cost import cost_vector, muon_flops
from canzona_ds.planning.dp import ATOMIC_DP_PLANNERS, DP_PLANNERS, make_buckets, plan_dp
from canzona_ds.planning.models import matrix_specs, model_specs
from canzona_ds.planning.params import ParamSpec
from canzona_ds.planning.report import dp_report, rank_costs


def mixed_specs(n_layers: int = 6) -> list[ParamSpec]:
    out = []
    for i in range(n_layers):
        out += [
            ParamSpec(f"l{i}.qkv", (96, 64)),
            ParamSpec(f"l{i}.proj", (64, 64)),
            ParamSpec(f"l{i}.fc1", (256, 64)),
            ParamSpec(f"l{i}.fc2", (64, 128)),
        ]
    return out


def check_valid(plan, specs) -> None:
    assert plan.world_size == len(plan.rank_params) == len(plan.rank_numel)
    seen = sorted(i for r in plan.rank_params for i in r)
    assert seen == list(range(len(specs))), "every matrix owned exactly once"
    for r, idxs in enumerate(plan.rank_params):
        assert list(idxs) == sorted(idxs), "model order inside a rank"
        offsets = plan.rank_offsets(r)
        end = 0
        for i, off in offsets:  # contiguous, non-overlapping, inside the padded range
            assert off == end and plan.owner[i] == r
            end += specs[i].numel
        assert end == plan.rank_numel[r] <= plan.shard_numel
    assert plan.padding == plan.world_size * plan.shard_numel - sum(s.numel for s in specs) >= 0


@pytest.mark.parametrize("planner", ATOMIC_DP_PLANNERS)
@pytest.mark.parametrize("world", [1, 3, 8, 30])
def test_atomic_planners_valid(planner, world):
    specs = mixed_specs()
    plan = plan_dp(specs, world, planner=planner, cost="flops", bucket_numel=20_000)
    check_valid(plan, specs)
    assert plan.split_params == ()


def test_equal_chunk_splits_and_charges_redundant_flops():
    specs = [ParamSpec("a", (10, 10)), ParamSpec("b", (10, 10)), ParamSpec("c", (10, 10))]
    plan = plan_dp(specs, 2, planner="equal_chunk", cost="flops")
    assert plan.shard_numel == 150 and plan.rank_numel == (150, 150)
    assert plan.split_params == (1,) and plan.owner == (0, 0, 1)
    f = muon_flops((10, 10))
    assert plan.rank_load == (2 * f, 2 * f)  # b's Newton-Schulz runs on both ranks
    assert rank_costs(plan, "flops") == [2 * f, 2 * f]
    assert rank_costs(plan, "numel") == [150, 150]
    assert dp_report(plan).flops_ratio == pytest.approx(4 / 3)
    aligned = plan_dp(specs, 2, planner="equal_chunk", align=64)
    assert aligned.shard_numel == 192 and aligned.rank_numel == (192, 108)


def test_naive_atomic_snaps_to_nearest_boundary():
    specs = [ParamSpec(n, (1, k)) for n, k in zip("abcd", (10, 30, 20, 40))]
    plan = plan_dp(specs, 2, planner="naive_atomic")  # equal cut at 50: boundaries 40 | 60 -> 40 (tie: lower)
    assert plan.rank_params == ((0, 1), (2, 3))
    assert plan_dp(specs, 4, planner="naive_atomic").rank_params == ((0,), (1,), (2,), (3,))


def test_alpha_zero_even_alpha_one_balances():
    # 6 buckets of 4 equal matrices on 3 ranks: an even split gives 1/2/1 in every bucket
    specs = [ParamSpec(f"l{i}.w{j}", (16, 16)) for i in range(6) for j in range(4)]
    buckets = 16 * 16 * 4
    even = plan_dp(specs, 3, planner="alpha_balanced", alpha=0.0, bucket_numel=buckets)
    bal = plan_dp(specs, 3, planner="alpha_balanced", alpha=1.0, bucket_numel=buckets)
    check_valid(even, specs)
    check_valid(bal, specs)
    e, b = dp_report(even), dp_report(bal)
    assert b.j_dp < e.j_dp and b.numel_ratio < e.numel_ratio
    assert b.numel_ratio <= 1.05
    assert e.j_comm <= b.j_comm  # alpha -> 0: buckets split evenly
    assert len(even.extra["bucket_rank_numel"]) == len(make_buckets(specs, buckets))


def test_alpha_balanced_one_bucket_equals_naive_at_start():
    specs = mixed_specs()
    one = plan_dp(specs, 4, planner="alpha_balanced", bucket_numel=None)
    check_valid(one, specs)
    assert one.rank_params == plan_dp(specs, 4, planner="naive_atomic").rank_params


def test_default_planner_balances_flops_and_numel():
    specs = matrix_specs(model_specs("qwen3-32b", tp=8))
    r = dp_report(plan_dp(specs, 32, cost="flops"))
    assert r.flops_ratio <= 1.05 and r.memory_ratio <= 1.05 and r.padding_fraction <= 0.05
    a = dp_report(plan_dp(specs, 32, planner="alpha_balanced"))
    assert r.flops_ratio <= a.flops_ratio


@pytest.mark.parametrize("planner", sorted(DP_PLANNERS))
def test_deterministic(planner):
    specs = mixed_specs()
    p1 = plan_dp(specs, 5, planner=planner, cost="flops", bucket_numel=30_000)
    p2 = plan_dp(list(specs), 5, planner=planner, cost="flops", bucket_numel=30_000)
    assert p1.rank_params == p2.rank_params and p1.fingerprint() == p2.fingerprint()


@pytest.mark.parametrize("planner", sorted(DP_PLANNERS))
def test_more_ranks_than_matrices(planner):
    specs = mixed_specs(1)
    plan = plan_dp(specs, 7, planner=planner)
    assert sum(1 for r in plan.rank_params if not r) >= 3
    if planner != "equal_chunk":
        check_valid(plan, specs)


@pytest.mark.parametrize("planner", ATOMIC_DP_PLANNERS)
def test_one_matrix_larger_than_fair_share(planner):
    specs = [ParamSpec("huge", (1000, 100))] + [ParamSpec(f"s{i}", (10, 10)) for i in range(9)]
    plan = plan_dp(specs, 4, planner=planner, bucket_numel=None)
    check_valid(plan, specs)
    assert plan.shard_numel == 100_000
    r = dp_report(plan)
    assert r.numel_ratio == pytest.approx(r.numel_lower_bound)
    if planner in ("lpt", "multi_lpt"):
        assert len(plan.rank_params[plan.owner[0]]) == 1  # nothing else on the straggler


@pytest.mark.parametrize("planner", sorted(DP_PLANNERS))
def test_single_parameter(planner):
    specs = [ParamSpec("w", (3, 5))]
    plan = plan_dp(specs, 2, planner=planner, align=8)
    assert sum(len(r) for r in plan.rank_params) == 1 and 0 <= plan.owner[0] < 2
    assert plan.shard_numel % 8 == 0 and plan.shard_numel >= 8


def test_align_rounds_shard():
    specs = mixed_specs()
    plan = plan_dp(specs, 3, align=512)
    assert plan.shard_numel % 512 == 0 and plan.shard_numel >= max(plan.rank_numel)


def test_all_1d_model_has_no_matrices():
    specs = [ParamSpec("norm", (8,), "aux"), ParamSpec("bias", (8,), "aux")]
    with pytest.raises(ValueError, match="specs=\\[\\]"):
        plan_dp(matrix_specs(specs), 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 1.5}, "alpha=1.5"),
        ({"alpha": -0.1}, "alpha=-0.1"),
        ({"world_size": 0}, "world_size=0"),
        ({"planner": "magic"}, "planner='magic'.*Allowed"),
        ({"cost": "bytes"}, "cost model='bytes'.*Allowed"),
        ({"optimizer": "adam"}, "optimizer='adam'.*Allowed"),
        ({"align": 0}, "align=0"),
        ({"planner": "alpha_balanced", "bucket_numel": -5}, "bucket_numel=-5"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"specs": mixed_specs(1), "world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_dp(**args)


def test_cost_models():
    s = ParamSpec("w", (64, 256), tp_partition_dim=0, tp_size=4)
    assert cost_vector([s], "numel") == [64 * 256]
    assert cost_vector([s], "numel", full=True) == [4 * 64 * 256]
    assert cost_vector([s], "flops", "muon", full=True) == [muon_flops((256, 256))]
    for opt in ("muon", "shampoo", "soap"):
        f_small, f_big = cost_vector([ParamSpec("a", (64, 64)), ParamSpec("b", (128, 128))], "flops", opt)
        assert f_big == pytest.approx(8 * f_small)  # cubic in the size
        assert cost_vector([s], "memory", opt)[0] > 8 * s.numel
    assert cost_vector([ParamSpec("n", (8,), "aux")], "flops") == [0.0]


def test_multi_lpt_lexicographic_cuts_padding_without_raising_flops():
    # qwen3-4b dp=64 tp=8: every rank holding a gate_up matrix is at the FLOPs floor, so
    # min-max(FLOPs, numel) left numel slack; the lexicographic pass removes it
    from canzona_ds.planning.dp import plan_multi_lpt
    from canzona_ds.planning.report import numel_lp_bound

    specs = matrix_specs(model_specs("qwen3-4b", tp=8))
    loads = cost_vector(specs, "flops")
    old = dp_report(plan_multi_lpt(specs, 64, loads, cost_model="flops", lexicographic=False))
    new_plan = plan_multi_lpt(specs, 64, loads, cost_model="flops")
    check_valid(new_plan, specs)
    new = dp_report(new_plan)
    assert new.flops_ratio <= old.flops_ratio * (1 + 1e-12)
    assert max(new.flops_ratio, new.numel_ratio) <= max(old.flops_ratio, old.numel_ratio) * (1 + 1e-12)
    assert new.padding_fraction <= 0.8 * old.padding_fraction
    lp = numel_lp_bound([s.numel for s in specs], 64)
    if lp is not None:  # generous: within 4x the provable padding floor of any atomic plan
        assert lp - 1 - 1e-9 <= new.padding_fraction <= 4 * (lp - 1)
    assert new_plan.fingerprint() == plan_multi_lpt(specs, 64, loads, cost_model="flops").fingerprint()

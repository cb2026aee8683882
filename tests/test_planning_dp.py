"""DP planners: atomicity, contiguity, balance, determinism, edge ranks, bad input."""
from __future__ import annotations

import math

import pytest

from canzona_ds.optim import cost_model
from canzona_ds.planning.cost import MASTER_GRAD_BYTES, cost_vector
from canzona_ds.planning.dp import (
    ATOMIC_DP_PLANNERS, BUCKETED_DP_PLANNERS, DP_PLANNERS, OwnershipPlan, layer_groups, layer_key, make_buckets,
    megatron_bucket_numel, plan_dp,
)
from canzona_ds.planning.layout import plan_layout
from canzona_ds.planning.models import matrix_specs, model_specs
from canzona_ds.planning.params import ParamSpec
from canzona_ds.planning.report import dp_report, rank_costs
from canzona_testkit.kernels import assert_bits

MUON = cost_model("muon")
SHAMPOO = cost_model("shampoo")
SOAP = cost_model("soap")


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


def check_valid(plan: OwnershipPlan, specs: list[ParamSpec]) -> None:
    assert plan.world_size == len(plan.rank_params) == len(plan.rank_numel)
    seen = sorted(i for r in plan.rank_params for i in r)
    assert seen == list(range(len(specs))), "every matrix owned exactly once"
    layout = plan.nonempty_first().layout(start_alignment=1)  # no alignment: P = the fullest rank
    for r, idxs in enumerate(plan.rank_params):
        assert list(idxs) == sorted(idxs), "model order inside a rank"
        offsets = plan.rank_offsets(r)
        end = 0
        for i, off in offsets:  # contiguous, non-overlapping, inside the padded range
            assert off == end and plan.owner[i] == r
            end += specs[i].numel
        assert end == plan.rank_numel[r] <= layout.shard_numel
    assert layout.shard_numel == max(plan.rank_numel)
    assert layout.total_padding == plan.world_size * max(plan.rank_numel) - sum(s.numel for s in specs) >= 0
    assert plan.padding_fraction == plan.nonempty_first().layout().padding_fraction


@pytest.mark.parametrize("planner", ATOMIC_DP_PLANNERS)
@pytest.mark.parametrize("world", [1, 3, 8, 30])
def test_atomic_planners_valid(planner, world):
    specs = mixed_specs()
    plan = plan_dp(specs, world, planner=planner, cost="flops", model=MUON, bucket_numel=20_000)
    check_valid(plan, specs)
    assert plan.split_params == ()
    assert plan.cost_model == "flops"
    assert plan.rank_load == pytest.approx([sum(cost_vector([specs[i] for i in r], "flops", MUON))
                                           for r in plan.rank_params])


def test_equal_chunk_splits_and_charges_redundant_flops():
    specs = [ParamSpec("a", (10, 10)), ParamSpec("b", (10, 10)), ParamSpec("c", (10, 10))]
    plan = plan_dp(specs, 2, planner="equal_chunk", cost="flops", model=MUON)
    assert_bits(plan.padding_fraction, 0.0)
    assert plan.rank_numel == (150, 150)
    assert plan.split_params == (1,) and plan.owner == (0, 0, 1)
    assert plan.extra["slices"] == {1: ((0, 50), (1, 50))}
    f = MUON.flops((10, 10)).amortised
    assert plan.rank_load == (2 * f, 2 * f)  # b's Newton-Schulz runs on both ranks
    assert rank_costs(plan, "flops", MUON) == [2 * f, 2 * f]
    assert rank_costs(plan, "peak_flops", MUON) == [2 * f, 2 * f]
    assert rank_costs(plan, "numel") == [150, 150]
    # memory: master + grad pro rata, b's momentum in full on both ranks
    state = MUON.state_bytes((10, 10))
    assert rank_costs(plan, "memory", MUON) == [150 * MASTER_GRAD_BYTES + 2 * state] * 2
    assert dp_report(plan, MUON).flops_ratio == pytest.approx(4 / 3)
    assert dp_report(plan, MUON).peak_flops_ratio == pytest.approx(4 / 3)
    assert dp_report(plan, MUON).memory_ratio == pytest.approx((150 * 8 + 2 * state) / (150 * 8 + 1.5 * state))
    assert dp_report(plan, MUON).split_matrices == 1
    # the planner's own rank_load follows the same rule under every cost
    for cost in ("peak_flops", "memory", "numel"):
        p = plan_dp(specs, 2, planner="equal_chunk", cost=cost, model=MUON)
        assert list(p.rank_load) == pytest.approx(rank_costs(p, cost, MUON))
    with pytest.raises(ValueError, match="splits matrices"):
        plan.layout()


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
    e, b = dp_report(even, MUON), dp_report(bal, MUON)
    assert b.j_dp < e.j_dp and b.numel_ratio < e.numel_ratio
    assert b.numel_ratio <= 1.05
    assert e.j_comm <= b.j_comm  # alpha -> 0: buckets split evenly
    assert len(even.extra["bucket_rank_numel"]) == len(make_buckets(specs, buckets))


def test_alpha_balanced_one_bucket_equals_naive_at_start():
    specs = mixed_specs()
    one = plan_dp(specs, 4, planner="alpha_balanced", bucket_numel=None)
    check_valid(one, specs)
    assert one.rank_params == plan_dp(specs, 4, planner="naive_atomic").rank_params


@pytest.mark.parametrize("model", [MUON, SOAP, cost_model("shampoo", max_preconditioner_dim=65536)],
                         ids=["muon", "soap", "shampoo-full"])
def test_default_planner_balances_flops_and_numel(model):
    specs = matrix_specs(model_specs("qwen3-32b", tp=8))
    r = dp_report(plan_dp(specs, 32, cost="flops", model=model), model)
    assert r.planner == "multi_lpt"
    assert r.flops_ratio <= 1.05 and r.memory_ratio <= 1.05 and r.padding_fraction <= 0.05
    a = dp_report(plan_dp(specs, 32, planner="alpha_balanced", cost="flops", model=model), model)
    assert r.flops_ratio <= a.flops_ratio
    n = dp_report(plan_dp(specs, 32, planner="naive_atomic", cost="flops", model=model), model)
    assert r.flops_ratio <= n.flops_ratio and r.memory_ratio <= n.memory_ratio
    for rep in (r, a, n):  # no plan beats the lower bounds
        assert rep.flops_ratio >= rep.flops_lower_bound - 1e-9
        assert rep.memory_ratio >= rep.memory_lower_bound - 1e-9
        assert rep.numel_ratio >= rep.numel_lower_bound - 1e-9
        assert rep.peak_flops_ratio >= 1.0 - 1e-12


@pytest.mark.parametrize("planner", sorted(DP_PLANNERS))
def test_deterministic(planner):
    specs = mixed_specs()
    p1 = plan_dp(specs, 5, planner=planner, cost="flops", model=MUON, bucket_numel=30_000)
    p2 = plan_dp(list(specs), 5, planner=planner, cost="flops", model=cost_model("muon"), bucket_numel=30_000)
    assert p1.rank_params == p2.rank_params and p1.fingerprint() == p2.fingerprint()


@pytest.mark.parametrize("planner", sorted(DP_PLANNERS))
def test_more_ranks_than_matrices(planner):
    specs = mixed_specs(1)
    plan = plan_dp(specs, 7, planner=planner)
    assert sum(1 for r in plan.rank_params if not r) >= 3
    if planner != "equal_chunk":
        check_valid(plan, specs)
    r = dp_report(plan, MUON)  # reports work with empty ranks (and an empty rank 0)
    assert r.flops_ratio >= r.flops_lower_bound - 1e-9 and r.padding_fraction >= 0


@pytest.mark.parametrize("planner", ATOMIC_DP_PLANNERS)
def test_one_matrix_larger_than_fair_share(planner):
    specs = [ParamSpec("huge", (1000, 100))] + [ParamSpec(f"s{i}", (10, 10)) for i in range(9)]
    plan = plan_dp(specs, 4, planner=planner, bucket_numel=None)
    check_valid(plan, specs)
    assert plan.nonempty_first().layout().shard_numel == 100_000
    r = dp_report(plan, MUON)
    assert r.numel_ratio == pytest.approx(r.numel_lower_bound)
    if planner in ("lpt", "multi_lpt"):
        assert len(plan.rank_params[plan.owner[0]]) == 1  # nothing else on the straggler


@pytest.mark.parametrize("planner", sorted(DP_PLANNERS))
def test_single_parameter(planner):
    specs = [ParamSpec("w", (3, 5))]
    plan = plan_dp(specs, 2, planner=planner)
    assert sum(len(r) for r in plan.rank_params) == 1 and 0 <= plan.owner[0] < 2
    if planner == "equal_chunk":  # cut in two: DeepSpeed's stock layout, tail padding only
        assert plan.split_params == (0,) and plan.rank_numel == (8, 7)
        assert plan.padding_fraction == pytest.approx(1 / 15)
        return
    layout = plan.nonempty_first().layout(start_alignment=8)
    assert layout.shard_numel == 16 and layout.total_padding == 17
    assert plan.padding_fraction == pytest.approx((2 * 16 - 15) / 15)  # default alignment 2: P = 16


@pytest.mark.parametrize("param_alignment, start_alignment", [(1, 512), (16, 2), (8, 12)])
def test_layout_alignment_rounds_shard(param_alignment, start_alignment):
    specs = mixed_specs()
    plan = plan_dp(specs, 3)
    layout = plan.layout(param_alignment, start_alignment)
    unit = math.lcm(param_alignment, start_alignment)
    assert layout.shard_numel % unit == 0 and layout.shard_numel >= max(plan.rank_numel)
    assert layout.shard_numel - unit < max(plan.rank_numel) + param_alignment * max(len(r) for r in plan.rank_params)
    assert layout == plan_layout([len(r) for r in plan.rank_params], [specs[i].numel for i in plan.buffer_order()],
                                 param_alignment, start_alignment)


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
        ({"cost": "flops"}, "cost model 'flops' needs the optimizer's cost model"),
        ({"cost": "memory", "planner": "lpt"}, "cost model 'memory' needs"),
        ({"world_size": 2.0}, "world_size=2.0"),
        ({"world_size": True}, "world_size=True"),
        ({"planner": "alpha_balanced", "bucket_numel": -5}, "bucket_numel=-5"),
        ({"planner": "alpha_balanced", "bucket_numel": 1.5}, "bucket_numel=1.5"),
        ({"planner": "paper_naive", "bucket_numel": 0}, "bucket_numel=0"),
        ({"planner": "paper_naive", "world_size": 0}, "world_size=0"),
        ({"planner": "layerwise", "world_size": -2}, "world_size=-2"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"specs": mixed_specs(1), "world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_dp(**args)


def test_cost_models():
    s = ParamSpec("w", (64, 256), tp_partition_dim=0, tp_size=4)
    assert cost_vector([s], "numel") == [64 * 256]
    assert cost_vector([s], "numel", hosted=True) == [4 * 64 * 256]
    assert cost_vector([s], "flops", MUON, hosted=True) == [MUON.flops((256, 256)).amortised]
    assert cost_vector([s], "flops", MUON) == [MUON.flops((256, 256)).amortised / 4]
    for model in (MUON, SHAMPOO, SOAP):
        f_small, f_big = cost_vector([ParamSpec("a", (64, 64)), ParamSpec("b", (128, 128))], "flops", model)
        assert f_big == pytest.approx(8 * f_small)  # cubic in the size
        assert cost_vector([s], "memory", model)[0] > 8 * s.numel
    assert cost_vector([ParamSpec("n", (8,), "aux")], "flops", MUON) == [0.0]


def test_plan_dp_balances_the_given_cost():
    # a model that weighs one matrix 10x: lpt must give it a rank of its own
    specs = [ParamSpec(f"w{i}", (16, 16)) for i in range(6)] + [ParamSpec("big", (32, 32))]
    loads_m = cost_vector(specs, "flops", MUON)
    plan = plan_dp(specs, 3, planner="lpt", cost="flops", model=MUON)
    assert list(plan.rank_load) == pytest.approx([sum(loads_m[i] for i in r) for r in plan.rank_params])
    assert plan.rank_params[plan.owner[6]] == (6,)  # 8x a small one: alone on its rank
    by_numel = plan_dp(specs, 3, planner="lpt", cost="numel")
    assert by_numel.rank_load == tuple(float(sum(specs[i].numel for i in r)) for r in by_numel.rank_params)
    assert by_numel.cost_model == "numel" and plan.cost_model == "flops"


def test_multi_lpt_uses_the_models_criteria():
    # numel alone vs numel + the model's FLOPs and memory: more criteria with a model
    specs = mixed_specs()
    plain = plan_dp(specs, 4, cost="numel")
    with_model = plan_dp(specs, 4, cost="numel", model=MUON)
    assert plain.extra["criteria"] == 1
    # numel and FLOPs; the load (= numel) and Muon's memory (12 bytes per element) are
    # proportional to numel and dropped
    assert with_model.extra["criteria"] == 2
    assert plan_dp(specs, 4, cost="numel", model=SOAP).extra["criteria"] == 3  # SOAP's memory has m^2 + n^2
    assert dp_report(with_model, MUON).flops_ratio <= dp_report(plain, MUON).flops_ratio + 1e-12
    # blocked Shampoo: FLOPs and memory both proportional to numel here -> one criterion
    blocked = cost_model("shampoo", max_preconditioner_dim=16)
    square = [ParamSpec(f"w{i}", (16 * (1 + i % 3), 32)) for i in range(9)]
    assert plan_dp(square, 3, cost="flops", model=blocked).extra["criteria"] == 1


def test_multi_lpt_lexicographic_cuts_padding_without_raising_flops():
    # qwen3-4b dp=32 tp=8 (Muon, owner's share of the full matrices): min-max(FLOPs, numel)
    # stops at 2.7% padding; the lexicographic pass takes it to the configuration-LP floor
    # (1.6%) without raising any criterion's worst rank
    from canzona_ds.planning.dp import plan_multi_lpt
    from canzona_ds.planning.report import numel_lp_bound

    specs = matrix_specs(model_specs("qwen3-4b", tp=8))
    loads = cost_vector(specs, "flops", MUON)
    old = dp_report(plan_multi_lpt(specs, 32, loads, cost_model="flops", model=MUON, lexicographic=False), MUON)
    new_plan = plan_multi_lpt(specs, 32, loads, cost_model="flops", model=MUON)
    check_valid(new_plan, specs)
    new = dp_report(new_plan, MUON)
    assert new.flops_ratio <= old.flops_ratio * (1 + 1e-12)
    assert max(new.flops_ratio, new.numel_ratio) <= max(old.flops_ratio, old.numel_ratio) * (1 + 1e-12)
    assert new.padding_fraction <= 0.8 * old.padding_fraction
    lp = numel_lp_bound([s.numel for s in specs], 32)
    if lp is not None:  # generous: within 4x the provable padding floor of any atomic plan
        assert lp - 1 - 1e-9 <= new.padding_fraction <= 4 * (lp - 1)
    assert new_plan.fingerprint() == plan_multi_lpt(specs, 32, loads, cost_model="flops", model=MUON).fingerprint()


# --------------------------------------------------------------------------- paper_naive (eq. 1)
def test_paper_naive_is_eq1_per_bucket():
    # bucket 0: a(30) b(30) c(40) = 100 elements, R = 4, S = 25: starts 0, 30, 60 -> ranks 0, 1, 2
    # bucket 1: d(50) e(10) = 60, S = 15: starts 0, 50 -> ranks 0, 3
    specs = [ParamSpec(n, (1, k)) for n, k in zip("abcde", (30, 30, 40, 50, 10))]
    plan = plan_dp(specs, 4, planner="paper_naive", bucket_numel=100)
    assert plan.extra["buckets"] == [(0, 3), (3, 5)] == make_buckets(specs, 100)
    assert plan.owner == (0, 1, 2, 0, 3)
    assert plan.rank_params == ((0, 3), (1,), (2,), (4,))  # bucket (= model) order inside a rank
    assert plan.extra["bucket_rank_numel"] == [[30, 30, 40, 0], [50, 0, 0, 10]]
    check_valid(plan, specs)
    # a start exactly on a stride boundary belongs to the higher rank: r*S <= start < (r+1)*S
    edge = [ParamSpec(n, (1, 25)) for n in "wxyz"]
    assert plan_dp(edge, 4, planner="paper_naive", bucket_numel=None).owner == (0, 1, 2, 3)
    # the cost model plays no part in where eq. 1 puts a matrix
    assert plan_dp(specs, 4, planner="paper_naive", cost="flops", model=MUON, bucket_numel=100).owner == plan.owner


def test_paper_naive_first_matrix_of_every_bucket_on_rank_zero():
    specs = matrix_specs(model_specs("qwen3-32b", tp=8))
    mega = megatron_bucket_numel(32)
    assert mega == 40_000_000 and megatron_bucket_numel(128) == 128_000_000
    for bucket in (mega, 500_000_000):
        plan = plan_dp(specs, 32, planner="paper_naive", bucket_numel=bucket)
        assert all(plan.owner[a] == 0 for a, _ in plan.extra["buckets"])
        check_valid(plan, specs)
    small = dp_report(plan_dp(specs, 32, planner="paper_naive", cost="flops", model=MUON, bucket_numel=mega), MUON)
    big = dp_report(plan_dp(specs, 32, planner="paper_naive", cost="flops", model=MUON), MUON)  # DeepSpeed's 5e8
    one = dp_report(plan_dp(specs, 32, planner="paper_naive", bucket_numel=None), MUON)
    # 129 buckets of 1-3 matrices: rank 0 gets ~half of all matrices; 8 buckets: 2-3x; one buffer: balanced
    assert small.flops_ratio > 20 and 2.0 < big.flops_ratio < 3.0 and one.flops_ratio == pytest.approx(1.0)
    balanced = dp_report(plan_dp(specs, 32, planner="alpha_balanced", cost="numel", model=MUON), MUON)
    assert balanced.flops_ratio < big.flops_ratio / 1.8  # Algorithm 1 over the same buckets


def test_megatron_bucket_numel_bad_input():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"dp={bad!r}"):
            megatron_bucket_numel(bad)


# --------------------------------------------------------------------------- layerwise
def test_layer_key_and_groups():
    assert layer_key("decoder.layers.7.mlp.linear_fc1.weight") == "decoder.layers.7."
    assert layer_key("transformer.h.3.attn.c_attn.weight") == "transformer.h.3."
    assert layer_key("model.layers.12.self_attn.q_proj.weight") == "model.layers.12."
    assert layer_key("qkv.weight") is None and layer_key("output_layer.weight") is None
    assert layer_key("layers.10.fc.weight") != layer_key("layers.1.fc.weight")
    names = ["head.weight", "layers.0.a.weight", "layers.1.a.weight", "layers.0.b.weight", "proj.weight",
             "layers.1.b.weight"]
    specs = [ParamSpec(n, (4, 4)) for n in names]
    assert layer_groups(specs) == [[0], [1, 3], [2, 5], [4]]


def test_layerwise_keeps_layers_whole_and_balances_them():
    specs = matrix_specs(model_specs("qwen3-1.7b", tp=4))  # 28 identical layers of 4 matrices
    plan = plan_dp(specs, 8, planner="layerwise", cost="flops", model=MUON)
    check_valid(plan, specs)
    for group in plan.extra["layer_groups"]:
        assert len(group) == 4 and len({plan.owner[i] for i in group}) == 1
    assert sorted(len(r) // 4 for r in plan.rank_params) == [3, 3, 3, 3, 4, 4, 4, 4]  # LPT of 28 equal layers
    assert dp_report(plan, MUON).flops_ratio == pytest.approx(4 / 3.5)
    # more ranks than layers: the rest own nothing (the paper's point: layer granularity)
    wide = plan_dp(matrix_specs(model_specs("qwen3-32b", tp=8)), 128, planner="layerwise", cost="flops", model=MUON)
    assert sum(1 for r in wide.rank_params if not r) == 64
    assert dp_report(wide, MUON).flops_ratio == pytest.approx(2.0)
    # the heaviest layer first, onto rank 0; ties broken by numel, then the first index
    specs = [ParamSpec("layers.0.w", (8, 8)), ParamSpec("layers.1.w", (16, 16)), ParamSpec("layers.2.w", (8, 8))]
    plan = plan_dp(specs, 2, planner="layerwise", cost="flops", model=MUON)
    assert plan.owner == (1, 0, 1)


@pytest.mark.parametrize("planner", BUCKETED_DP_PLANNERS)
def test_bucketed_planners_cut_the_same_buckets(planner):
    specs = mixed_specs()
    plan = plan_dp(specs, 3, planner=planner, cost="flops", model=MUON, bucket_numel=20_000)
    assert plan.extra["buckets"] == make_buckets(specs, 20_000)
    sizes = [sum(specs[i].numel for i in range(a, b)) for a, b in plan.extra["buckets"]]
    assert [sum(row) for row in plan.extra["bucket_rank_numel"]] == sizes  # S_{i,r} cover each bucket
    for (a, b), row in zip(plan.extra["buckets"], plan.extra["bucket_rank_numel"]):
        for r in range(3):  # rank r's slice of bucket (a, b) is one contiguous run of its parameters
            mine = [i for i in plan.rank_params[r] if a <= i < b]
            assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else row[r] == 0
            assert sum(specs[i].numel for i in mine) == row[r]

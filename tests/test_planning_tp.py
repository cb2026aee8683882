"""TP schedulers: capacity, each task once, valid hosts, bad input."""
from __future__ import annotations

import pytest

from canzona_ds.optim import cost_model
from canzona_ds.planning.cost import cost_vector
from canzona_ds.planning.models import matrix_specs, model_specs
from canzona_ds.planning.params import ParamSpec
from canzona_ds.planning.report import tp_report
from canzona_ds.planning.tp import TP_SCHEDULERS, plan_tp
from canzona_testkit.kernels import bits_differ

MUON = cost_model("muon")


def tp_specs(tp: int = 4, layers: int = 5) -> list[ParamSpec]:
    return matrix_specs(model_specs("qwen3-0.6b", tp=tp))[: 4 * layers]


@pytest.mark.parametrize("scheduler", sorted(TP_SCHEDULERS))
@pytest.mark.parametrize("factor", [1.0, 1.7, 100.0])
def test_groups_respect_capacity_and_cover_tasks(scheduler, factor):
    specs = tp_specs()
    loads = cost_vector(specs, "flops", MUON, hosted=True)
    c_max = max(loads) * factor
    plan = plan_tp(specs, 4, scheduler=scheduler, c_max=c_max, cost="flops", model=MUON)
    tasks = [i for g in plan.groups for i, _ in g.tasks]
    assert sorted(tasks) == list(range(len(specs)))
    for g in plan.groups:
        assert g.makespan <= c_max * (1 + 1e-12)
        assert all(0 <= r < 4 for _, r in g.tasks)
        per_rank = [0.0] * 4
        for i, r in g.tasks:
            per_rank[r] += loads[i]
        assert per_rank == pytest.approx(list(g.rank_load))
    assert all(plan.host[i] == r for g in plan.groups for i, r in g.tasks)
    assert list(plan.rank_load) == pytest.approx([sum(loads[i] for i in range(len(specs)) if plan.host[i] == r)
                                                  for r in range(4)])
    if scheduler == "no_fusion":
        assert len(plan.groups) == len(specs)


@pytest.mark.parametrize("cost", ["flops", "peak_flops", "memory", "numel"])
def test_tasks_are_charged_the_full_matrix(cost):
    # the host reassembles the matrix and runs the optimizer on all of it
    specs = tp_specs()
    model = cost_model("soap")
    plan = plan_tp(specs, 4, cost=cost, model=model)
    full = cost_vector(specs, cost, model, hosted=True)
    assert sum(plan.rank_load) == pytest.approx(sum(full))
    assert sum(plan.rank_load) == pytest.approx(4 * sum(cost_vector(specs, cost, model)))  # = tp x the DP shares
    if cost in ("flops", "peak_flops"):
        f = model.flops(specs[0].full_matrix_shape)
        assert full[0] == (f.amortised if cost == "flops" else f.peak)
    assert plan.c_max == max(full)  # default capacity: the largest task


def test_lpt_rollback_balances_better_than_round_robin():
    specs = matrix_specs(model_specs("qwen3-1.7b", tp=4))
    lpt = tp_report(plan_tp(specs, 4, scheduler="lpt_rollback", cost="flops", model=MUON), MUON)
    rr = tp_report(plan_tp(specs, 4, scheduler="round_robin", cost="flops", model=MUON), MUON)
    assert lpt.flops_ratio <= 1.05 < rr.flops_ratio
    assert lpt.micro_groups < len(specs)
    assert lpt.flops_ratio >= lpt.flops_lower_bound - 1e-12 or not bits_differ(lpt.flops_lower_bound, 1.0)
    assert lpt.serial_ratio >= lpt.flops_ratio - 1e-12 and lpt.tasks == len(specs)
    nf = tp_report(plan_tp(specs, 4, scheduler="no_fusion", cost="flops", model=MUON), MUON)
    assert nf.micro_groups == len(specs) and nf.serial_ratio == pytest.approx(4.0)  # one host busy at a time


def test_deterministic_fingerprint():
    a = plan_tp(tp_specs(), 4, cost="flops", model=MUON)
    b = plan_tp(list(tp_specs()), 4, cost="flops", model=cost_model("muon"))
    assert a.groups == b.groups and a.fingerprint() == b.fingerprint()


def test_c_max_below_largest_task_names_it():
    specs = tp_specs()
    with pytest.raises(ValueError, match="linear_fc1"):
        plan_tp(specs, 4, c_max=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"scheduler": "magic"}, "scheduler='magic'"), ({"cost": "bytes"}, "cost model='bytes'"),
     ({"cost": "flops"}, "cost model 'flops' needs the optimizer's cost model"), ({"tp_size": 0}, "tp_size=0"),
     ({"tp_size": 2.5}, "tp_size=2.5"), ({"c_max": -1.0}, "c_max=-1.0")],
)
def test_bad_input(kwargs, match):
    args = {"specs": tp_specs(), "tp_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_tp(**args)
    with pytest.raises(ValueError, match="specs=\\[\\]"):
        plan_tp([], 4)


def _paper_experiments():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "paper_experiments.py"
    spec = importlib.util.spec_from_file_location("canzona_benchmarks_paper_experiments", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_time_replay_hand_computed():
    # two micro-groups on two TP ranks: gather 1, host 0 computes 2 (group 0), host 1 computes 3 (group 1),
    # scatter 1.  Blocking: 1 + 2 + 1 | 1 + 3 + 1 = 9.  Pipelined: gather(1) overlaps compute(0) and
    # compute(1) on rank 1 overlaps nothing else: 6 (see the timeline in the replay's doc).
    pe = _paper_experiments()
    G, C, S = [1.0, 1.0], [[2.0, 0.0], [0.0, 3.0]], [1.0, 1.0]
    assert pe.replay(G, C, S, 2, pipelined=False) == pytest.approx(9.0)
    assert pe.replay(G, C, S, 2, pipelined=True) == pytest.approx(6.0)
    assert pe.replay([1.0], [[2.0, 5.0]], [1.0], 2, pipelined=True) == pytest.approx(7.0)  # one group: no overlap


def test_step_time_model_of_micro_groups():
    pe = _paper_experiments()
    specs = tp_specs(tp=4, layers=3)
    rates = dict(tflops=400.0, gbps=150.0, latency_us=30.0)
    nofuse = pe.simulate_tp(specs, 4, MUON, "no_fusion", None, direction_bytes=2, **rates)
    default = pe.simulate_tp(specs, 4, MUON, "lpt_rollback", None, direction_bytes=2, **rates)
    one = pe.simulate_tp(specs, 4, MUON, "lpt_rollback", 1e12, direction_bytes=2, **rates)
    assert nofuse["groups"] == len(specs) and nofuse["serial_ratio"] == pytest.approx(4.0)
    assert default["groups"] == len(plan_tp(specs, 4).groups) and one["groups"] == 1
    assert default["pipelined_s"] <= default["blocking_s"] + 1e-12
    assert one["pipelined_s"] == pytest.approx(one["blocking_s"])  # nothing to overlap
    assert default["pipelined_s"] < nofuse["pipelined_s"]
    # more latency per collective costs the schedule with more collectives more
    slow = dict(rates, latency_us=3000.0)
    d_slow = pe.simulate_tp(specs, 4, MUON, "lpt_rollback", None, direction_bytes=2, **slow)
    o_slow = pe.simulate_tp(specs, 4, MUON, "lpt_rollback", 1e12, direction_bytes=2, **slow)
    assert d_slow["blocking_s"] - default["blocking_s"] > o_slow["blocking_s"] - one["blocking_s"]

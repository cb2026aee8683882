"""benchmarks/bench_zero3.py at its smallest (DP=2, a 1-layer model, one timed step; Muon
for DeepSpeed's Muon, the Canzona engine and the hosted step, Shampoo for the replicated baseline): what the
harness counts is right.  No timing is asserted; the checks are that every number the
benchmark reports is the quantity it claims:

* the hosted step issues the collectives and sends the bytes its micro-group plan predicts
  (``MicroGroupRuntime.expected_collectives`` and :func:`bench_zero3.plan_bytes`), and hosts
  every matrix exactly once (the rule runs once per matrix per step, summed over ranks);
* the replicated baseline runs the rule on every matrix on every rank and sends exactly one
  all-gather of the padded gradient pieces;
* DeepSpeed's Muon at stage 3 calls ``muon_update`` once per matrix per step, dealt round-robin;
* the ``backend`` layer of ``canzona_testkit.comm.CommCounter`` sees DeepSpeed's ZeRO-3 gradient
  reduce-scatter with its true size (the ``deepspeed`` and ``torch`` layers miss it).

Cost: 1 rank run; 2 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=32, max_seq_len=32)
DP = 2
RULES = ("muon",)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_zero3", ROOT / "benchmarks" / "bench_zero3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _run():
    from canzona_testkit.dist import run_distributed

    bench = _bench()
    out = run_distributed(_worker, DP, timeout=240)
    return bench, out, bench.summarize(out, DP)


def _worker(rank: int, world: int) -> dict:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_zero3

    bench_zero3.MODEL = TINY
    return bench_zero3._worker(rank, world, TINY, list(RULES), 1, 1, 1, 16, True, replicated=["shampoo"])


def _matrices():
    from canzona_ds.models.qwen3 import Qwen3Config, build_model

    bench = _bench()
    return bench.matrices_of(build_model(Qwen3Config(**TINY), seed=0))


def test_hosted_step_sends_what_its_plan_predicts():
    _, out, rows = _run()
    for rule in RULES:
        for rank, extra in enumerate(rows[f"hosted/{rule}@dp{DP}"]["extra_per_rank"]):
            assert extra["collectives"] == extra["expected"] == extra["counted"], (rule, rank, extra)
            assert out[rank]["res"][f"hosted/{rule}"]["bytes"] == [extra["plan_bytes"]], (rule, rank)
            assert extra["runtime_bytes"] == extra["plan_bytes"] > 0


def test_engine_hosted_all_to_alls_are_the_plans():
    """The Canzona ZeRO-3 engine: the runtime's collectives and bytes equal its plan's (the
    benchmark also checks the torch-layer count of all_to_all_single against them every step)."""
    _, _, rows = _run()
    for rule in RULES:
        for rank, extra in enumerate(rows[f"engine/{rule}@dp{DP}"]["extra_per_rank"]):
            assert extra["collectives"] == extra["expected"], (rule, rank, extra)
            assert extra["runtime_bytes"] == extra["plan_bytes"] > 0, (rule, rank, extra)


@pytest.mark.parametrize("kind", ["hosted", "engine"])
def test_the_rule_runs_once_per_matrix_on_its_host(kind):
    _, _, rows = _run()
    n = len(_matrices())
    for rule in RULES:
        r = rows[f"{kind}/{rule}@dp{DP}"]
        assert sum(r["rule_calls_per_rank"]) == n, (rule, r["rule_calls_per_rank"])
        assert sum(e["hosted"] for e in r["extra_per_rank"]) == n
        assert all(c > 0 for c in r["rule_calls_per_rank"]), "both ranks host"


def test_engine_bytes_are_stock_zero3_plus_the_hosted_all_to_alls_and_the_norm():
    """Same model, same ZeRO-3 settings: the engine's DeepSpeed collectives are stock ZeRO-3's
    (parameter all-gathers, gradient reduce-scatter) without DeepSpeed's norm all-reduce; outside
    DeepSpeed it issues the hosted all-to-alls and the torch-exact norm (one all-to-all of the
    gradient pieces, one all-reduce of the norms): nothing else."""
    _, _, rows = _run()
    for rule in RULES:
        eng, stock = rows[f"engine/{rule}@dp{DP}"], rows[f"zero3_adamw@dp{DP}"]
        for rank in range(DP):
            e, z = eng["extra_per_rank"][rank], stock["extra_per_rank"][rank]
            ds_norm = {op: n - (op == "all_reduce") for op, n in z["counted"].items()}
            assert e["counted"] == {op: n for op, n in ds_norm.items() if n}, (rule, rank, e["counted"], z["counted"])
            assert e["direct_counted"] == {"all_to_all_single": e["expected"]["all_to_all_single"] + 1,
                                           "all_reduce": 1}, (rule, rank, e)
            assert e["runtime_bytes"] <= e["direct_wire_by_op"]["all_to_all_single"]


def test_replicated_baseline_runs_every_matrix_on_every_rank_after_one_all_gather():
    _, _, rows = _run()
    mats = _matrices()
    r = rows[f"replicated/shampoo@dp{DP}"]
    assert r["rule_calls_per_rank"] == [len(mats)] * DP
    padded = sum(-(-math.prod(s) // DP) for _, s in mats) * DP * 4
    assert r["own_bytes_per_rank"] == [padded * (DP - 1) / DP] * DP
    assert all(e["counted"] == {"all_gather_into_tensor": 1} for e in r["extra_per_rank"])


def test_deepspeed_muon_stage3_deals_matrices_round_robin():
    _, _, rows = _run()
    n = len(_matrices())
    calls = rows[f"ds_muon@dp{DP}"]["rule_calls_per_rank"]
    assert calls == [len(range(r, n, DP)) for r in range(DP)], calls


def test_backend_counter_sees_the_zero3_gradient_reduce_scatter():
    from canzona_ds.models.qwen3 import Qwen3Config, build_model

    _, _, rows = _run()
    numel = sum(p.numel() for p in build_model(Qwen3Config(**TINY), seed=0).parameters())
    for e in rows[f"zero3_adamw@dp{DP}"]["extra_per_rank"]:
        # stock ZeRO-3 reduce-scatters every gradient (padded to DP equal pieces): (DP-1)/DP of it on the wire
        assert e["counted"].get("reduce_scatter_tensor", 0) >= 1, e
        assert numel * 4 * (DP - 1) / DP <= e["wire_by_op"]["reduce_scatter_tensor"] <= 1.05 * numel * 4 * (DP - 1) / DP, (e, numel)
    for e in rows[f"ds_muon@dp{DP}"]["extra_per_rank"]:
        # DeepSpeed's Muon needs reduce_scatter off: the full gradient is all-reduced instead
        assert "reduce_scatter_tensor" not in e["counted"] and e["wire_by_op"]["all_reduce"] >= numel * 4 * 2 * (DP - 1) / DP, e

"""Ranks started with different settings fail together, with the difference named, and fast;
nothing trains with mixed settings and nothing hangs.

Cost: 7 rank runs; 12 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

import os
import time

import pytest

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, ds_config, run_engine

MUON = HP["CanzonaMuon"]


def _per_rank(rank, world, cfgs, timeout):
    os.environ["CANZONA_AGREEMENT_TIMEOUT"] = str(timeout)
    try:
        run_engine(rank, world, cfgs[rank], 1)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


CASES = {
    "lr": ([ds_config(2, params=dict(MUON, lr=0.02)), ds_config(2, params=dict(MUON, lr=0.05))],
           ["lr (rank 0: 0.02", "0.05"]),
    "momentum": ([ds_config(2), ds_config(2, params=dict(MUON, momentum=0.5))], ["rule.momentum"]),
    "ns_steps": ([ds_config(2), ds_config(2, params=dict(MUON, ns_steps=6))], ["rule.ns_steps"]),
    "weight_decay": ([ds_config(2), ds_config(2, params=dict(MUON, weight_decay=0.0))], ["weight_decay"]),
    "stage_1_vs_0": ([ds_config(2, stage=1), ds_config(2, stage=0)], ["zero_optimization.stage"]),
    "rule": ([ds_config(2), ds_config(2, optimizer="CanzonaSOAP")], ["optimizer.type"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ranks_with_different_settings_fail_together_naming_it(name):
    cfgs, needles = CASES[name]
    t0 = time.perf_counter()
    msgs = run_distributed(_per_rank, 2, cfgs, 120, timeout=120)
    elapsed = time.perf_counter() - t0
    for m in msgs:
        assert m is not None and "Ranks disagree" in m, m
        for needle in needles:
            assert needle in m, (needle, m)
    print(f"{name}: both ranks refused in {elapsed:.1f} s")


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    """Rank 1 runs DeepSpeed's own Muon: it never reaches the Canzona setup; rank 0 reports it
    after CANZONA_AGREEMENT_TIMEOUT (5 s here) instead of waiting forever."""
    cfgs = [ds_config(2), ds_config(2, optimizer={"type": "Muon", "params": dict(MUON, torch_adam=True)})]
    try:
        msgs = run_distributed(_per_rank, 2, cfgs, 5, timeout=120)
        first = msgs[0]
    except RuntimeError as err:  # rank 1 may die in a collective once rank 0 has left
        first = str(err)
    assert "Ranks [1] did not reach the Canzona optimizer setup" in first, first

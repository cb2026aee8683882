"""A model with two DeepSpeed MoE layers of different ``ep_size`` (two expert groups, each its own
buffer partitioned over its own expert-DP group) resumed at another DP size, TP=1, ZeRO 1 and 2;
real gloo processes.

``canzona_testkit.moe.TinyMoE(ep2=...)``: the tiny MoE model with a second MoE layer ``moe2``
(4 experts each).  Saved at world 4 with ``moe`` at ep_size 2 and ``moe2`` at ep_size 1 (groups
``ep_size_2``: expert-DP pairs; ``ep_size_1``: every expert on every rank, planned over all 4),
resumed at world 2 with the same ep_sizes, and with them swapped (``moe`` at 1, ``moe2`` at 2: each
layer's experts change group, expert-parallel rank and expert-DP size at once).

As in tests/test_moe_elastic.py (its snapshot and merge are reused): every saving rank hands back,
by whole-model name, what it held in memory; after ``engine.load_checkpoint`` at world 2
  (a) every matrix's fp32 master and rule state (dense and each expert of both layers), every
      AdamW piece and module weight equal the saved ones bit for bit; every matrix lives on exactly
      one rank, the planned owner in its layer's new expert-DP group (or the DP group), each expert
      on its layer's new expert-parallel rank;
  (b) 2 more steps equal ``reference_run(start=<the saved state>, ep2=...)`` (both layers, the
      ranks' forward/backward and ZeRO's averages at world 2: sums of two terms) bit for bit.

One ``run_distributed`` per phase; each scenario in its own ``try``: one failing scenario fails one
test.
"""
from __future__ import annotations

import os
import traceback
from functools import lru_cache

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed, scratch_dir

SAVE_STEPS, MORE, SAVED_WORLD, WORLD = 2, 2, 4, 2

#: name -> (saved (ep, ep2), new (ep, ep2), ZeRO stage, type)
SCENARIOS = {
    "w4_to_w2_ep2ep1_z1_muon": ((2, 1), (2, 1), 1, "CanzonaMuon"),
    "w4_to_w2_ep2ep1_z2_soap": ((2, 1), (2, 1), 2, "CanzonaSOAP"),
    "w4_ep2ep1_to_w2_ep1ep2_z2_shampoo": ((2, 1), (1, 2), 2, "CanzonaShampoo"),
}


def _save_worker(rank, world, root):
    from test_moe_elastic import _snapshot

    from canzona_testkit.models import batches
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    out = {}
    for name, ((ep, ep2), _, stage, opt_type) in SCENARIOS.items():
        try:
            cfg = moe_ds_config(world, optimizer=opt_type, stage=stage)
            _, _, engine = run_moe_engine(rank, world, ep, cfg, SAVE_STEPS, data=batches(SAVE_STEPS, 2 * world, seed=1),
                                          ep2=ep2)
            engine.save_checkpoint(os.path.join(root, name), tag="saved")
            out[name] = _snapshot(engine)
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    return out


def _load_worker(rank, world, root, jobs):
    from test_moe_elastic import _as_torch, _snapshot

    from canzona_testkit.models import batches
    from canzona_testkit.moe import moe_ds_config, reference_run, run_moe_engine

    out = {}
    for name, start in jobs.items():
        _, (ep, ep2), stage, opt_type = SCENARIOS[name]
        try:
            loaded = {}

            def load(engine):
                engine.load_checkpoint(os.path.join(root, name), tag="saved")
                loaded.update(_snapshot(engine))

            data = batches(MORE, 2 * world, seed=7)
            cfg = moe_ds_config(world, optimizer=opt_type, stage=stage)
            params, _, _ = run_moe_engine(rank, world, ep, cfg, MORE, after_init=load, data=data, ep2=ep2)
            res = dict(loaded=loaded, params=params)
            if rank == 0:
                res["ref"] = reference_run(world, ep, MORE, opt_type, data=data, start=_as_torch(start), ep2=ep2)
            out[name] = res
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _root() -> str:
    return scratch_dir("canzona_moe_two_groups_")


@lru_cache(maxsize=None)
def _saved() -> dict:
    res = run_distributed(_save_worker, SAVED_WORLD, _root(), timeout=900)
    return {n: [r[n] for r in res] for n in SCENARIOS}


@lru_cache(maxsize=None)
def _loaded() -> dict:
    from test_moe_elastic import _merge

    jobs, failed = {}, {}
    for name in SCENARIOS:
        bad = next((r for r in _saved()[name] if isinstance(r, str)), None)
        if bad is not None:
            failed[name] = "saving failed:\n" + bad
        else:
            jobs[name] = _merge(_saved()[name])
    res = run_distributed(_load_worker, WORLD, _root(), jobs, timeout=900) if jobs else []
    out = {n: [r[n] for r in res] for n in jobs}
    out.update({n: [msg] for n, msg in failed.items()})
    return out


def _eq(got, want, what: str) -> None:
    got, want = (v.detach().numpy() if hasattr(v, "detach") else v for v in (got, want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


def _expert(name: str, eps: tuple[int, int]):
    """(the layer's ep_size, the global expert number) of an expert parameter, else None."""
    from canzona_testkit.moe import EXPERTS, EXPERTS2, NUM_EXPERTS

    for prefix, ep in zip((EXPERTS, EXPERTS2), eps):
        if name.startswith(prefix):
            e = int(name[len(prefix):].split(".")[0])
            assert 0 <= e < NUM_EXPERTS, name
            return ep, e
    return None


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_expert_groups_resume_at_new_dp(name):
    from test_moe_elastic import _merge

    from canzona_testkit.moe import NUM_EXPERTS

    _, eps, stage, opt_type = SCENARIOS[name]
    res = _loaded()[name]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    saved = _merge(_saved()[name])
    experts = [n for n in saved.rule_state if _expert(n, eps) is not None]
    assert len(experts) == 2 * 2 * NUM_EXPERTS, sorted(saved.rule_state)  # 2 layers x 4 experts x 2 matrices
    holders: dict[str, list[int]] = {}
    for rank, r in enumerate(res):
        got = r["loaded"]
        assert got["matrix_step"] == saved.matrix_step == SAVE_STEPS and got["adam_step"] == saved.adam_step
        assert set(got["groups"]) == {"None", "ep_size_1", "ep_size_2"}, got["groups"]
        for n, w in got["master"].items():
            holders.setdefault(n, []).append(rank)
            _eq(w, saved.params[n], f"{name}: fp32 master of {n} on rank {rank}")
            where = _expert(n, eps)
            key = "None" if where is None else "ep_size_%d" % where[0]
            edp_rank, edp_size = got["groups"][key]
            assert got["owners"][n] == edp_rank, (n, rank, got["owners"][n], edp_rank)  # its planned owner
            if where is not None:  # an expert of this rank's expert-parallel rank in its layer
                ep, e = where
                assert e // (NUM_EXPERTS // ep) == rank % ep and edp_size == WORLD // ep, (n, rank, edp_size)
        assert set(got["rule_state"]) == set(got["master"]), (rank, sorted(got["rule_state"]))
        for n, st in got["rule_state"].items():
            assert set(st) == set(saved.rule_state[n]), n
            for k, v in st.items():
                _eq(v, saved.rule_state[n][k], f"{name}: {opt_type} state {k} of {n} on rank {rank}")
        for n, a, b, m, ea, eas in got["adam"]:
            for value, want in ((m, saved.params[n]), (ea, saved.adam[n]["exp_avg"]),
                                (eas, saved.adam[n]["exp_avg_sq"])):
                _eq(value, np.asarray(want).reshape(-1)[a:b], f"{name}: AdamW piece [{a}, {b}) of {n} on rank {rank}")
        for n, w in got["module"].items():
            _eq(w, saved.params[n], f"{name}: module weight {n} on rank {rank}")
    assert sorted(holders) == sorted(saved.rule_state), sorted(holders)
    assert all(len(v) == 1 for v in holders.values()), holders  # every matrix owned by exactly one rank
    ref = res[0]["ref"]
    assert sorted({n for r in res for n in r["params"]}) == sorted(ref)  # (each rank: its experts)
    for rank, r in enumerate(res):
        for n, w in r["params"].items():
            _eq(w, ref[n], f"{name}: {n} after {MORE} steps on rank {rank}")

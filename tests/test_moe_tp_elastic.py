"""DeepSpeed MoE x tensor-parallel checkpoints resumed at another size (ZeRO 1 and 2; real gloo
processes).

Saved at world 4 = TP 2 x DP 2 (the Megatron stand-in's mpu; ``canzona_testkit.moe.TinyMoETP``:
a column-/row-parallel MLP, TP-split and hosted over the TP group, before a MoE layer of 4 whole
experts), ``ep_size`` 2 (DeepSpeed's expert-parallel groups {0,1} {2,3} are the TP groups: TP rank
0's files hold experts 0-1, TP rank 1's experts 2-3) or 1 (the expert-DP group spans all four
ranks, TP peers included), and resumed as a Megatron-DeepSpeed user would resize:

* TP 2 -> 1 at the same DP size (world 2 = TP 1 x DP 2, ``ep_size`` 2; from ``ep_size`` 1 too);
* half the nodes (world 2 = TP 2 x DP 1, ``ep_size`` 2: the expert-parallel group is the TP group);
* the same size with another ``ep_size`` (TP 2 x DP 2, ``ep_size`` 2 -> 1);
* TP 1 -> 2 on twice the nodes (TP 1 x DP 2 -> TP 2 x DP 2, ``ep_size`` 2);
* TP 2 -> 1 with ZeRO-Offload (``offload_optimizer`` cpu) saved and resumed;
* refused by name: a ZeRO stage 0 checkpoint (DeepSpeed's own files) at another TP size.

Each scenario trains 2 steps at the saved size and saves; every saving rank hands back, by
whole-model name, what it held in memory (``tests/test_moe_elastic._snapshot``: fp32 masters
and rule state of the matrices it owns or hosts, its AdamW pieces; TP shards joined here along
their split dimension).  A fresh engine at the new size ``engine.load_checkpoint``s the tag and:

  (a) every matrix's fp32 master (its TP shard at TP 2) and rule state, every AdamW piece and
      every module weight equal the saved ones bit for bit; every expert matrix lives on exactly
      one rank, the planned owner in its new expert-DP group, on its new expert-parallel rank; an
      unsplit dense matrix on one rank per TP rank (its DP group's planned owner); a TP-split
      one's state on exactly one host.  The offline converter's form (``canzona_testkit.ckpt.read``) of the
      TP 2 checkpoint equals the saved state too;
  (b) it trains 2 more steps against ``reference_run(start=<the saved state>, tp_mlp=True)`` (the
      whole TP=1 model with its MLP, the ranks' forward/backward and ZeRO's averages at the new DP
      size, the rule per expert, continued from the saved weights, moments, rule state, steps):
        TP 1 x DP 2 (every sum of two terms, no TP): every parameter bit for bit;
        TP 2: the row-parallel partial sums and DeepSpeed's TP split of each expert's capacity
        associate differently from the TP=1 model (as in tests/test_moe_tp.py's closed loop):
        after 1 step every parameter within 1e-6 (measured 6e-8; SOAP, whose normalised update
        in the eigenbasis amplifies the ulps, within 1e-4, measured 1.5e-5); after 2 steps Muon
        within 1e-6 (measured 6e-8), Shampoo within 1e-4 (measured 3e-6); SOAP's refresh turns
        the ulps into 6e-3, printed (its state is checked bit for bit in (a), its TP 2 -> 1
        continuation bit for bit).

One ``run_distributed`` per (phase, world, TP); each scenario in its own ``try``: one failing
scenario fails one test.
"""
from __future__ import annotations

import os
import traceback
from functools import lru_cache

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed, scratch_dir
from canzona_testkit.models import muon_reordered_sum_tolerance

SAVE_STEPS, MORE, MICRO = 2, 2, 2

#: name -> ((saved TP, DP, ep_size), (new TP, DP, ep_size), ZeRO stage, type)
SCENARIOS = {
    "tp2dp2_to_tp1dp2_z1_muon": ((2, 2, 2), (1, 2, 2), 1, "CanzonaMuon"),
    "tp2dp2_to_tp1dp2_z2_soap": ((2, 2, 2), (1, 2, 2), 2, "CanzonaSOAP"),
    "tp2dp2ep1_to_tp1dp2ep2_z2_muon": ((2, 2, 1), (1, 2, 2), 2, "CanzonaMuon"),
    "tp2dp2_to_tp2dp1_z2_muon": ((2, 2, 2), (2, 1, 2), 2, "CanzonaMuon"),
    "tp2dp2_to_tp2dp1_z1_shampoo": ((2, 2, 2), (2, 1, 2), 1, "CanzonaShampoo"),
    "tp2dp2ep2_to_ep1_z1_muon": ((2, 2, 2), (2, 2, 1), 1, "CanzonaMuon"),
    # TP 1 -> 2 on twice the nodes (the MLP's TP layout rebuilt, the experts to their new ranks)
    "tp1dp2_to_tp2dp2_z1_soap": ((1, 2, 2), (2, 2, 2), 1, "CanzonaSOAP"),
    # ZeRO-Offload (offload_optimizer cpu) saved and resumed: the fp32 partitions on the host
    "tp2dp2_to_tp1dp2_z2_shampoo_offload": ((2, 2, 2), (1, 2, 2), 2, "CanzonaShampoo"),
}


#: name -> (saved (TP, DP, ep_size), new (TP, DP, ep_size), ZeRO stage, type): refused by name
REFUSED = {
    # ZeRO 0 keeps DeepSpeed's own files (the module per TP rank, expp_rank optimizer files): its
    # load cannot change TP
    "z0_tp2dp2_to_tp1dp2_refused": ((2, 2, 2), (1, 2, 2), 0, "CanzonaMuon"),
}
REFUSAL_TEXT = {"z0_tp2dp2_to_tp1dp2_refused": ("saved at ZeRO stage 0, DP=2, TP=2", "tensor parallelism at ZeRO stage 0",
                                                "this run has ZeRO stage 0, DP=2, TP=1")}


def _spec(name: str) -> tuple:
    return SCENARIOS[name] if name in SCENARIOS else REFUSED[name]


def _cfg(name: str, dp: int) -> dict:
    from canzona_testkit.moe import moe_ds_config

    _, _, stage, opt_type = _spec(name)
    extra = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}} \
        if name.endswith("_offload") else {}
    return moe_ds_config(dp, optimizer=opt_type, stage=stage, micro=MICRO, **extra)


def _split_dim(name: str):
    from canzona_testkit.moe import TP_SPLIT

    return TP_SPLIT[name][1] if name in TP_SPLIT else None


def _save_worker(rank, world, root, tp, names):
    import torch.distributed as dist

    from test_moe_elastic import _snapshot

    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.models import batches
    from canzona_testkit.moe import run_moe_tp_engine

    ms.initialize_model_parallel(tp)
    out = {}
    for name in names:
        (_, dp, ep), _, _, _ = _spec(name)
        try:
            cfg = _cfg(name, dp)
            data = batches(SAVE_STEPS, MICRO * dp, seed=1)
            _, _, engine = run_moe_tp_engine(rank, tp, ep, cfg, SAVE_STEPS, data, micro=MICRO)
            engine.save_checkpoint(os.path.join(root, name), tag="saved")
            dist.barrier()
            out[name] = dict(_snapshot(engine), tp_rank=ms.get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    return out


def _merge(snaps: list):
    """The whole model's saved state by whole-model name (test_moe_elastic._merge), the TP-split
    matrices' fp32 masters and module weights joined from their TP shards."""
    from test_moe_elastic import _merge as merge

    state = merge(snaps)
    for n in {n for s in snaps for n in s["module"] if _split_dim(n) is not None}:
        for what, where in (("master", state.params), ("module", None)):
            shards = {}
            for s in snaps:
                if n in s[what]:
                    shards.setdefault(s["tp_rank"], s[what][n])
            joined = np.concatenate([shards[t] for t in sorted(shards)], axis=_split_dim(n))
            if where is not None:
                where[n] = joined
            else:
                state.module_joined = getattr(state, "module_joined", {})
                state.module_joined[n] = joined
    return state


def _refused_worker(rank, name: str, root: str, tp: int) -> str | None:
    from canzona_ds.ckpt.index import CheckpointIndexError
    from canzona_testkit.models import batches
    from canzona_testkit.moe import run_moe_tp_engine

    _, (_, dp, ep), _, _ = REFUSED[name]
    try:
        run_moe_tp_engine(rank, tp, ep, _cfg(name, dp), 1, batches(1, MICRO * dp), micro=MICRO,
                          after_init=lambda e: e.load_checkpoint(os.path.join(root, name), tag="saved"))
    except CheckpointIndexError as e:
        return str(e)
    except Exception:  # noqa: BLE001
        return "not an CheckpointIndexError:\n" + traceback.format_exc()
    return None


def _load_worker(rank, world, root, tp, jobs, refused=()):
    from test_moe_elastic import _as_torch, _snapshot

    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.models import batches
    from canzona_testkit.moe import reference_run, run_moe_tp_engine

    ms.initialize_model_parallel(tp)
    out = {name: _refused_worker(rank, name, root, tp) for name in refused}
    from test_ckpt_resume import _index_route_only

    _index_route_only()  # every resize below goes through the checkpoint index (TP shard frames)
    for name, start in sorted(jobs.items(), key=lambda job: SCENARIOS[job[0]][1][2]):
        _, (_, dp, ep), _, opt_type = SCENARIOS[name]
        start = _as_torch(start)
        try:
            loaded = {}

            def load(engine):
                engine.load_checkpoint(os.path.join(root, name), tag="saved")
                loaded.update(_snapshot(engine), offload=bool(getattr(engine.optimizer, "cpu_offload", False)))

            data = batches(MORE, MICRO * dp, seed=7)
            cfg = _cfg(name, dp)
            first = {}

            def after_step(step, params):
                if step == 1:
                    first.update(params)

            params, _, _ = run_moe_tp_engine(rank, tp, ep, cfg, MORE, data, micro=MICRO, after_init=load,
                                             after_step=after_step)
            res = dict(loaded=loaded, first=first, params=params, tp_rank=ms.get_tensor_model_parallel_rank(),
                       dp_rank=ms.get_data_parallel_rank())
            if rank == 0:  # the TP=1 model at the new DP size (the ranks' ep groups at TP 1)
                ref_ep = ep if tp == 1 else 1
                res["ref"] = reference_run(dp, ref_ep, MORE, opt_type, data=data, start=start, tp_mlp=True)
                res["ref_first"] = reference_run(dp, ref_ep, 1, opt_type, data=data, start=start, tp_mlp=True)
            out[name] = res
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _root() -> str:
    return scratch_dir("canzona_moe_tp_elastic_")


@lru_cache(maxsize=None)
def _saved_at(tp: int, dp: int) -> dict:
    names = [n for n, s in {**SCENARIOS, **REFUSED}.items() if s[0][:2] == (tp, dp)]
    res = run_distributed(_save_worker, tp * dp, _root(), tp, names, timeout=900)
    return {n: [r[n] for r in res] for n in names}


def _saved(name: str) -> list:
    return _saved_at(*_spec(name)[0][:2])[name]


@lru_cache(maxsize=None)
def _loaded(tp: int, dp: int) -> dict:
    jobs, failed = {}, {}
    for name, s in SCENARIOS.items():
        if s[1][:2] != (tp, dp):
            continue
        snaps = _saved(name)
        bad = next((r for r in snaps if isinstance(r, str)), None)
        if bad is not None:
            failed[name] = "saving failed:\n" + bad
        else:
            jobs[name] = _merge(snaps)
    refused = [n for n, s in REFUSED.items() if s[1][:2] == (tp, dp)
               and not any(isinstance(r, str) for r in _saved(n))]
    failed.update({n: "saving failed:\n" + next(r for r in _saved(n) if isinstance(r, str))
                   for n, s in REFUSED.items() if s[1][:2] == (tp, dp) and n not in refused})
    res = run_distributed(_load_worker, tp * dp, _root(), tp, jobs, refused, timeout=900) if jobs or refused else []
    out = {n: [r[n] for r in res] for n in list(jobs) + refused}
    out.update({n: [msg] for n, msg in failed.items()})
    return out


def _eq(got, want, what: str) -> None:
    got, want = (v.detach().numpy() if hasattr(v, "detach") else v for v in (got, want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


def _shard(whole, name: str, tp: int, tp_rank: int):
    dim = _split_dim(name)
    return whole if dim is None or tp == 1 else np.split(whole, tp, axis=dim)[tp_rank]


def _joined(res: list, key: str, tp: int) -> dict:
    """DP rank 0's parameters (``key``) by whole-model name, TP shards joined; every DP rank and TP
    peer agreeing on its copy is checked by comparing each rank with its own shard."""
    out = {}
    for r in res:
        for n, w in r[key].items():
            if _split_dim(n) is None:
                out.setdefault(n, w)
    for n in {n for n in res[0][key] if _split_dim(n) is not None}:
        shards = [next(r[key][n] for r in res if r["tp_rank"] == t and r["dp_rank"] == 0) for t in range(tp)]
        out[n] = np.concatenate(shards, axis=_split_dim(n))
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_moe_tp_resume_at_new_size(name):
    from canzona_testkit.moe import NUM_EXPERTS

    _, (tp, dp, ep), stage, opt_type = SCENARIOS[name]
    res = _loaded(tp, dp)[name]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    saved = _merge(_saved(name))
    matrices = sorted(saved.rule_state)
    assert len([n for n in matrices if ".experts." in n]) == 2 * NUM_EXPERTS, matrices
    assert {"up.weight", "down.weight"} <= set(matrices), matrices
    # (a) the state as saved, on the planned owner of the new (expert-)DP group
    masters: dict[str, list[int]] = {}
    states: dict[str, list[int]] = {}
    for rank, r in enumerate(res):
        got, tp_rank = r["loaded"], r["tp_rank"]
        assert got["offload"] == name.endswith("_offload"), got["offload"]  # DeepSpeed's offload path taken
        assert got["ep"] == (ep, rank % ep), got["ep"]
        assert got["matrix_step"] == saved.matrix_step == SAVE_STEPS and got["adam_step"] == saved.adam_step
        for n, w in got["master"].items():
            masters.setdefault(n, []).append(rank)
            _eq(w, _shard(saved.params[n], n, tp, tp_rank), f"{name}: fp32 master of {n} on rank {rank}")
            if _split_dim(n) is not None and tp > 1:
                continue  # hosted over the TP group (its state on one host, below)
            key = "ep_size_%d" % ep if ".experts." in n else "None"
            edp_rank, edp_size = got["groups"][key]
            assert got["owners"][n] == edp_rank, (n, rank, got["owners"][n], edp_rank)  # its planned owner
            if ".experts." in n:  # an expert of this rank's new expert-parallel rank
                e = int(n.split("deepspeed_experts.")[1].split(".")[0])
                assert e // (NUM_EXPERTS // ep) == rank % ep, (n, rank)
                assert edp_size == tp * dp // ep
        for n, st in got["rule_state"].items():
            states.setdefault(n, []).append(rank)
            assert set(st) == set(saved.rule_state[n]), n
            for k, v in st.items():
                _eq(v, saved.rule_state[n][k], f"{name}: {opt_type} state {k} of {n} on rank {rank}")
        for n, a, b, m, ea, eas in got["adam"]:
            for value, want in ((m, saved.params[n]), (ea, saved.adam[n]["exp_avg"]),
                                (eas, saved.adam[n]["exp_avg_sq"])):
                _eq(value, np.asarray(want).reshape(-1)[a:b], f"{name}: AdamW piece [{a}, {b}) of {n} on rank {rank}")
        for n, w in got["module"].items():
            whole = saved.module_joined[n] if _split_dim(n) is not None else saved.params[n]
            _eq(w, _shard(whole, n, tp, tp_rank), f"{name}: module weight {n} on rank {rank}")
    assert sorted(states) == matrices, sorted(states)
    for n in matrices:
        if ".experts." in n or (_split_dim(n) is not None and tp > 1):  # one rank of the world
            assert len(states[n]) == 1 and masters[n] == (states[n] if ".experts." in n else masters[n]), \
                (n, states[n], masters[n])
        else:  # a dense matrix: one owner per TP rank (its DP group's)
            assert sorted(res[q]["tp_rank"] for q in masters[n]) == list(range(tp)), (n, masters[n])
            assert states[n] == masters[n], (n, states[n], masters[n])
    # the offline converter's TP=1 form of the saved checkpoint: the same, by whole-model name
    from canzona_testkit.ckpt import read

    uni = read(os.path.join(_root(), name), "saved")
    assert sorted(uni.params) == sorted(saved.params) and sorted(uni.rule_state) == matrices
    for n, w in uni.params.items():
        _eq(w, saved.params[n], f"{name}: converted {n}")
    for n, moments in uni.adam.items():
        for k, v in moments.items():
            _eq(v, saved.adam[n][k], f"{name}: converted AdamW {k} of {n}")
    for n, st in uni.rule_state.items():
        for k, v in st.items():
            _eq(v, saved.rule_state[n][k], f"{name}: converted {k} of {n}")
    # (b) training on equals the TP=1 model continued from the saved state at the new DP size
    ref, ref_first = res[0]["ref"], res[0]["ref_first"]
    for r in res:  # each rank's copy (its TP shard) agrees with DP rank 0's
        for key in ("first", "params"):
            mine = _joined(res, key, tp)
            for n, w in r[key].items():
                _eq(w, _shard(mine[n], n, tp, r["tp_rank"]), f"{name}: {n} ({key}) on rank {r}")
    first, params = _joined(res, "first", tp), _joined(res, "params", tp)
    assert sorted(params) == sorted(ref), sorted(params)
    if tp == 1:
        for n, w in params.items():
            _eq(w, ref[n], f"{name}: {n} after {MORE} steps")
        return
    dev1 = max(float(np.abs(first[n] - ref_first[n]).max()) for n in first)
    dev = max(float(np.abs(params[n] - ref[n]).max()) for n in params)
    print(f"{name}: max |param - TP=1 reference| after 1 step = {dev1:.3g}, after {MORE} steps = {dev:.3g}")
    # measured: Muon and Shampoo 6e-8 after 1 step, SOAP 1.5e-5 (its normalised update in the
    # eigenbasis amplifies the ulps); after 2 steps Muon 6e-8, Shampoo 3e-6, SOAP 6e-3 (a refresh)
    # Muon: TP-split products sum in another order, which bf16 Newton-Schulz may amplify (muon_reordered_sum_tolerance)
    assert dev1 <= {"CanzonaSOAP": 1e-4, "CanzonaShampoo": 1e-6, "CanzonaMuon": muon_reordered_sum_tolerance(1)}[opt_type], dev1
    if opt_type != "CanzonaSOAP":
        assert dev <= (muon_reordered_sum_tolerance(MORE) if opt_type == "CanzonaMuon" else 1e-4), dev


@pytest.mark.parametrize("name", list(REFUSED))
def test_moe_tp_resume_refused(name):
    _, (tp, dp, _), _, _ = REFUSED[name]
    for msg in _loaded(tp, dp)[name]:
        assert msg is not None and all(text in msg for text in REFUSAL_TEXT[name]), msg

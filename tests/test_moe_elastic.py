"""DeepSpeed MoE checkpoints resumed at another size: DP growth at the same ``ep_size`` (world
2 -> 4, ep_size 2) and a change of ``ep_size`` (world 4, ep_size 2 -> 4; stage 0 also world 4
-> 2), ZeRO 0, 1 and 2, Muon, Shampoo and SOAP, through the checkpoint index (the shrinking
cases and ep_size 2 -> 1 are rows of tests/test_ckpt_resume.py);
real gloo processes.  Checkpoints without the index and the records a resize needs (as an older
canzona-ds wrote them) are refused by name.

Each scenario trains the tiny MoE model (``canzona_testkit.moe``) 2 steps at the saved size
and saves; every saving rank also hands back, by whole-model name (expert ``k*E/ep + j``), what
it held in memory: the fp32 master and rule state of the matrices it owns, its pieces of the
AdamW partitions (master, moments) and the steps.  Merged, that is the model's whole state as
saved, independent of the checkpoint reader.  A fresh engine at the new size then
``engine.load_checkpoint``s the tag and:

  (a) after loading, every matrix's fp32 master and rule state (dense and each expert, by
      whole-model name), every AdamW piece (expert biases included) and every module weight
      equal the saved ones bit for bit (rtol = atol = 0); each matrix lives on exactly one rank
      of the model, the planned owner of its new (expert-)DP group (``layout.owners()``), and
      its expert-DP group is the one of its new expert-parallel rank (ZeRO 0: every rank of
      that expert-parallel rank keeps it).  The offline converter's form (``canzona_testkit.ckpt.read``)
      equals the saved state too;
  (b) it trains 2 more steps, compared with the single-process reference
      (``reference_run(start=<the saved state>)``: the whole model, every expert, the ranks'
      forward/backward and ZeRO's averages at the NEW size, torch's AdamW and the rule per
      expert, continued from the saved weights, moments, rule state and steps):
        new world 2 (sums of two terms): every parameter bit for bit after 2 steps;
        new world 4: after the first step every expert matrix whose expert-DP group has at most
        two ranks (ep_size 2 and 4) is bit for bit and every parameter within 1e-5 (4-term sums
        are associated in gloo's order: ~1 ulp in the gradients, measured <= 2e-6 in the
        parameters); after 2 steps Muon is within the reordered-sum bound of the reference end to end (measured
        <= 3e-8).  Shampoo's and SOAP's 2-step deviations are printed, not asserted: a
        preconditioner refresh turns those ulps into ~1e-3 (SOAP world 4 ep_size 4: 2e-3), the
        size a misplaced expert or state would also have; their state is checked bit for bit in
        (a) and their continuation bit for bit at world 2.

One ``run_distributed`` per (phase, world); each scenario in its own ``try``: one failing
scenario fails one test.
"""
from __future__ import annotations

import os
import shutil
import traceback
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed, scratch_dir
from canzona_testkit.models import muon_reordered_sum_tolerance

SAVE_STEPS, MORE = 2, 2

#: name -> (saved world, saved ep_size, new world, new ep_size, ZeRO stage, type)
#: (ZeRO 1/2 shrinking to world <= 2 and ep_size 2 -> 1 are rows of tests/test_ckpt_resume.py's
#: scenario table; here the 4-rank growths, through the checkpoint index too)
SCENARIOS = {
    "w2ep2_to_w4_z1_muon": (2, 2, 4, 2, 1, "CanzonaMuon"),
    "w2ep2_to_w4_z2_shampoo": (2, 2, 4, 2, 2, "CanzonaShampoo"),
    "w4ep2_to_ep4_z2_muon": (4, 2, 4, 4, 2, "CanzonaMuon"),
    "w4ep2_to_ep4_z1_soap": (4, 2, 4, 4, 1, "CanzonaSOAP"),
    # ZeRO stage 0: DeepSpeed's expp_rank files (every rank keeps all its matrices), through the
    # checkpoint index (ep_size 2 -> 1 at world 2 is a row of tests/test_ckpt_resume.py)
    "w4ep2_to_w2_z0_muon": (4, 2, 2, 2, 0, "CanzonaMuon"),
    "w2ep2_to_w4_z0_shampoo": (2, 2, 4, 2, 0, "CanzonaShampoo"),
    "w4ep2_to_ep4_z0_muon": (4, 2, 4, 4, 0, "CanzonaMuon"),
}


def _data(world: int, steps: int, seed: int) -> list:
    from canzona_testkit.models import batches

    return batches(steps, 2 * world, seed=seed)


def _snapshot(engine) -> dict:
    """What this rank holds, by whole-model name (numpy, picklable)."""
    import torch.distributed as dist

    from canzona_ds.optimizer import MATRIX

    zopt = engine.optimizer
    opt = getattr(zopt, "optimizer", zopt)
    glob = opt.moe.global_names

    def np_(t):  # (memory order kept: SOAP's eigenbases are column-major, and BLAS rounds by layout)
        return np.array(t.detach().float().numpy(), copy=True, order="K")

    rule_state = {glob.get(n, n): {k: (np_(v) if hasattr(v, "numpy") else v) for k, v in st.items()}
                  for n, st in opt.matrix_state.items()}
    module = {glob.get(n, n): np_(p) for n, p in engine.module.named_parameters()}
    common = dict(rule_state=rule_state, module=module, ep=(opt.groups.ep_size, opt.groups.ep_rank))
    if opt is zopt:  # ZeRO stage 0: every rank keeps every matrix it has, and AdamW's state per parameter
        name_of = {id(p): n for n, p in engine.module.named_parameters()}
        master, adam = {}, []
        adam_step = matrix_step = None  # (a pipeline stage may hold no matrix: tests/test_moe_pipeline_elastic.py)
        for g in opt.param_groups:
            for p in g["params"]:
                n = glob.get(name_of[id(p)], name_of[id(p)])
                if g["canzona_role"] == MATRIX:
                    master[n] = np_(p)
                    matrix_step = g["step"]
                else:
                    st = opt.state[p]
                    adam.append((n, 0, p.numel(), np_(p).reshape(-1), np_(st["exp_avg"]).reshape(-1),
                                 np_(st["exp_avg_sq"]).reshape(-1)))
                    adam_step = float(st["step"])
        return dict(master=master, adam=adam, adam_step=adam_step, matrix_step=matrix_step, owners=None,
                    groups=None, **common)

    master, owners, groups, adam = {}, {}, {}, []
    adam_step = matrix_step = None
    for i, g in enumerate(opt.param_groups):
        flat = zopt.single_partition_of_fp32_groups[i]
        key = g.get("canzona_partition")
        edp_rank = dist.get_rank(group=zopt.real_dp_process_group[i])
        if g["canzona_role"] == MATRIX:
            matrix_step = g["step"]
            for v in opt.placement.views[id(flat)]:
                master[glob.get(v.name, v.name)] = np_(flat[v.offset:v.offset + v.numel].view(v.shape))
            layout = zopt.canzona_layouts[i]
            for n, owner in zip(opt.partition_matrices[key], layout.owners()):
                owners[glob.get(n, n)] = owner
            groups[str(key)] = (edp_rank, dist.get_world_size(group=zopt.real_dp_process_group[i]))
            continue
        state = opt.state[flat]
        adam_step = float(state["step"])
        P = zopt.partition_size[i]
        lo, hi = edp_rank * P, (edp_rank + 1) * P
        for p, off in zip(zopt.round_robin_bit16_groups[i], zopt.round_robin_bit16_offsets[i]):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                n = zopt.param_names[p]
                adam.append((glob.get(n, n), a - off, b - off, np_(flat[a - lo:b - lo]),
                             np_(state["exp_avg"][a - lo:b - lo]), np_(state["exp_avg_sq"][a - lo:b - lo])))
    return dict(master=master, adam=adam, adam_step=adam_step, matrix_step=matrix_step, owners=owners,
                groups=groups, **common)


def _save_worker(rank, world, root, names):
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    out = {}
    for name in names:
        _, ep, _, _, stage, opt_type = SCENARIOS[name]
        try:
            cfg = moe_ds_config(world, optimizer=opt_type, stage=stage)
            _, _, engine = run_moe_engine(rank, world, ep, cfg, SAVE_STEPS, data=_data(world, SAVE_STEPS, 1))
            engine.save_checkpoint(os.path.join(root, name), tag="saved")
            out[name] = _snapshot(engine)
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    return out


def _merge(snaps: list) -> SimpleNamespace:
    """The whole model's saved state (numpy, by whole-model name) from every rank's snapshot."""
    shapes = {n: v.shape for s in snaps for n, v in s["module"].items()}
    params = {n: v for s in snaps for n, v in s["master"].items()}
    flat = {}
    for s in snaps:
        for n, a, b, m, ea, eas in s["adam"]:
            size = int(np.prod(shapes[n]))
            entry = flat.setdefault(n, [np.full(size, np.nan, np.float32) for _ in range(3)])
            for dst, src in zip(entry, (m, ea, eas)):
                dst[a:b] = src
    adam = {}
    for n, (m, ea, eas) in flat.items():
        assert not np.isnan(m).any(), n  # every piece of every AdamW parameter was held by some rank
        params[n] = m.reshape(shapes[n])
        adam[n] = {"exp_avg": ea.reshape(shapes[n]), "exp_avg_sq": eas.reshape(shapes[n])}
    rule_state = {n: st for s in snaps for n, st in s["rule_state"].items()}
    return SimpleNamespace(params=params, adam=adam, rule_state=rule_state, adam_step=snaps[0]["adam_step"],
                           matrix_step=snaps[0]["matrix_step"])


def _as_torch(state: SimpleNamespace) -> SimpleNamespace:
    """``_merge``'s state as tensors (in the worker: numpy crosses the process boundary)."""
    import torch

    def t(v):
        return torch.from_numpy(np.array(v, copy=True, order="K")) if isinstance(v, np.ndarray) else v

    return SimpleNamespace(params={n: t(v) for n, v in state.params.items()},
                           adam={n: {k: t(v) for k, v in d.items()} for n, d in state.adam.items()},
                           rule_state={n: {k: t(v) for k, v in d.items()} for n, d in state.rule_state.items()},
                           adam_step=state.adam_step, matrix_step=state.matrix_step)


#: name -> (the scenario whose checkpoint is loaded, new world, new ep_size): refused by name
#: once its optimizer files are rewritten as an older canzona-ds wrote them (``_as_old``)
REFUSED = {
    # stage 0 (expp_rank files) at another ep_size without the files' parameter names
    "old_z0_ep2_to_ep1": ("w4ep2_to_w2_z0_muon", 2, 1),
    # ZeRO 1/2 at another size without the layout record's expert global names (nor an index)
    "old_z2_w4_to_w2": ("w4ep2_to_ep4_z2_muon", 2, 2),
}
REFUSAL_TEXT = {"old_z0_ep2_to_ep1": ("ep_size=1.", "do not name their parameters", "saved ep_size"),
                "old_z2_w4_to_w2": ("whole-model names", "another DP or expert-parallel size", "saved at")}


def _as_old(root: str, name: str) -> str:
    """A copy of ``REFUSED[name]``'s checkpoint without the records an older canzona-ds did not
    write (the experts' whole-model names, the parameter names of the param groups)."""
    import torch

    source = os.path.join(root, REFUSED[name][0], "saved")
    target = os.path.join(root, name, "saved")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    os.remove(os.path.join(target, "canzona_index.json"))  # (written since: a tag from before the index)
    for f in os.listdir(target):
        path = os.path.join(target, f)
        if f.startswith("expp_rank_"):
            sd = torch.load(path, weights_only=False)
            for key in ("param_names", "global_names"):
                sd["optimizer"]["canzona"].pop(key)
            torch.save(sd, path)
        elif f.startswith("zero_pp_rank_"):
            sd = torch.load(path, weights_only=False)
            for info in sd["optimizer_state_dict"]["canzona_layout"]["moe"].values():
                for key in ("global_names", "ep_rank", "ep_size"):
                    info.pop(key)
            torch.save(sd, path)
    return os.path.join(root, name)


def _refused_worker(rank, world, ckpt, name):
    from canzona_ds.checkpoint import engine_hooks_off
    from canzona_ds.ckpt import CheckpointIndexError
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    source, _, ep = REFUSED[name]
    stage, opt_type = SCENARIOS[source][4:]

    def load(engine):
        with engine_hooks_off():  # (the files were rewritten after the manifest)
            engine.load_checkpoint(ckpt, tag="saved")

    try:
        run_moe_engine(rank, world, ep, moe_ds_config(world, optimizer=opt_type, stage=stage), 1, after_init=load)
    except CheckpointIndexError as e:  # (the index built from the tag's records: ckpt_legacy.py)
        return str(e)
    except Exception:  # noqa: BLE001
        return "not a CheckpointIndexError:\n" + traceback.format_exc()
    return None


def _load_worker(rank, world, root, jobs, refused=None):
    from canzona_testkit.moe import moe_ds_config, reference_run, run_moe_engine

    out = {name: _refused_worker(rank, world, ckpt, name) for name, ckpt in (refused or {}).items()}
    # stage 0 first, smaller ep_size first: DeepSpeed picks the stage-0 optimizer file by the
    # largest expert group registered in the process (one model per process in real use)
    for name, start in sorted(jobs.items(), key=lambda job: (SCENARIOS[job[0]][4] != 0, SCENARIOS[job[0]][3])):
        _, _, _, ep, stage, opt_type = SCENARIOS[name]
        start = _as_torch(start)
        try:
            loaded, first = {}, {}

            def load(engine):
                engine.load_checkpoint(os.path.join(root, name), tag="saved")
                loaded.update(_snapshot(engine))

            def after_step(step, params):
                if step == 1:
                    first.update(params)

            data = _data(world, MORE, 7)
            cfg = moe_ds_config(world, optimizer=opt_type, stage=stage)
            params, _, _ = run_moe_engine(rank, world, ep, cfg, MORE, after_init=load, after_step=after_step,
                                          data=data)
            res = dict(loaded=loaded, first=first, params=params)
            if rank == 0:
                res["ref"] = reference_run(world, ep, MORE, opt_type, data=data, start=start)
                res["ref_first"] = reference_run(world, ep, 1, opt_type, data=data, start=start)
            out[name] = res
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _root() -> str:
    return scratch_dir("canzona_moe_elastic_")


@lru_cache(maxsize=None)
def _saved(world: int) -> dict:
    names = [n for n, s in SCENARIOS.items() if s[0] == world]
    res = run_distributed(_save_worker, world, _root(), names, timeout=900)
    return {n: [r[n] for r in res] for n in names}


@lru_cache(maxsize=None)
def _loaded(world: int) -> dict:
    jobs, failed = {}, {}
    for name, s in SCENARIOS.items():
        if s[2] != world:
            continue
        snaps = _saved(s[0])[name]
        bad = next((r for r in snaps if isinstance(r, str)), None)
        if bad is not None:
            failed[name] = "saving failed:\n" + bad
        else:
            jobs[name] = _merge(snaps)
    refused = {}
    for n, (source, w, _) in REFUSED.items():
        if w == world and not any(isinstance(r, str) for r in _saved(SCENARIOS[source][0])[source]):
            refused[n] = _as_old(_root(), n)
    res = run_distributed(_load_worker, world, _root(), jobs, refused, timeout=900) if jobs else []
    out = {n: [r[n] for r in res] for n in list(jobs) + list(refused)}
    out.update({n: [msg] for n, msg in failed.items()})
    return out


def _eq(got, want, what: str) -> None:
    got, want = (v.detach().numpy() if hasattr(v, "detach") else v for v in (got, want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_moe_resume_at_new_size(name):
    saved_world, saved_ep, world, ep, stage, opt_type = SCENARIOS[name]
    res = _loaded(world)[name]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    saved = _merge(_saved(saved_world)[name])
    experts = [n for n in saved.rule_state if ".experts." in n]
    assert len(experts) == 8, sorted(saved.rule_state)  # 4 experts x 2 matrices, each with state
    # (a) the state as saved, on the planned owner of the new (expert-)DP group
    holders: dict[str, list[int]] = {}
    for rank, r in enumerate(res):
        got = r["loaded"]
        assert got["ep"] == (ep, rank % ep), got["ep"]
        assert got["matrix_step"] == saved.matrix_step == SAVE_STEPS and got["adam_step"] == saved.adam_step
        for n, w in got["master"].items():
            holders.setdefault(n, []).append(rank)
            _eq(w, saved.params[n], f"{name}: fp32 master of {n} on rank {rank}")
            if stage == 0:  # every rank keeps its matrices: the dense ones and its experts'
                continue
            key = "ep_size_%d" % ep if ".experts." in n else "None"
            edp_rank, edp_size = got["groups"][key]
            assert got["owners"][n] == edp_rank, (n, rank, got["owners"][n], edp_rank)  # its planned owner
            if ".experts." in n:  # an expert of this rank's new expert-parallel rank
                e = int(n.split("deepspeed_experts.")[1].split(".")[0])
                assert e // (4 // ep) == rank % ep, (n, rank)
                assert edp_size == world // ep
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
    if stage:  # every matrix of the model (every expert's) owned by exactly one rank
        assert all(len(v) == 1 for v in holders.values()), holders
    else:  # a dense matrix on every rank, an expert's on every rank of its expert-parallel rank
        for n, ranks in holders.items():
            e = int(n.split("deepspeed_experts.")[1].split(".")[0]) if ".experts." in n else None
            want = list(range(world)) if e is None else [r for r in range(world) if r % ep == e // (4 // ep)]
            assert ranks == want, (n, ranks, want)
    if stage:  # the offline converter's size-independent form (read): the same, by whole-model name
        from canzona_testkit.ckpt import read

        uni = read(os.path.join(_root(), name), "saved")
        assert sorted(uni.params) == sorted(saved.params) and sorted(uni.adam) == sorted(saved.adam)
        assert sorted(uni.rule_state) == sorted(saved.rule_state)
        for n, w in uni.params.items():
            _eq(w, saved.params[n], f"{name}: converted {n}")
        for n, moments in uni.adam.items():
            for k, v in moments.items():
                _eq(v, saved.adam[n][k], f"{name}: converted AdamW {k} of {n}")
        for n, st in uni.rule_state.items():
            for k, v in st.items():
                _eq(v, saved.rule_state[n][k], f"{name}: converted {k} of {n}")
    # (b) training on equals the reference continued from the saved state at the new size
    ref, ref_first = res[0]["ref"], res[0]["ref_first"]
    if world == 2:
        for r in res:
            for n, w in r["params"].items():
                _eq(w, ref[n], f"{name}: {n} after {MORE} steps")
        return
    if (world // ep) <= 2:
        for r in res:
            for n, w in r["first"].items():
                if ".experts." in n:
                    _eq(w, ref_first[n], f"{name}: {n} after 1 step")
    first = max(float(np.abs(r["first"][n] - ref_first[n]).max()) for r in res for n in r["first"])
    dev = max(float(np.abs(r["params"][n] - ref[n]).max()) for r in res for n in r["params"])
    print(f"{name}: max |param - reference| after 1 step = {first:.3g}, after {MORE} steps = {dev:.3g}")
    # dense 4-rank sums: another association (muon_reordered_sum_tolerance); Shampoo/SOAP's refresh amplifies it further
    assert first <= (muon_reordered_sum_tolerance(1) if opt_type == "CanzonaMuon" else 1e-5), first
    if opt_type == "CanzonaMuon":
        assert dev <= muon_reordered_sum_tolerance(MORE), dev


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_moe_resume_refused(name):
    source, world, ep = REFUSED[name]
    for r in _saved(SCENARIOS[source][0])[source]:
        if isinstance(r, str):
            pytest.fail("saving failed:\n" + r)
    for msg in _loaded(world)[name]:
        assert msg is not None and all(text in msg for text in REFUSAL_TEXT[name]), msg

"""Hosted expert stacks: a 3-D expert stack whose update one DP rank computes for pieces held by
every rank (ZeRO stage 3, and the mixed ZeRO-1/2 layout when a stack crosses a chunk boundary).
The host assembles the whole stack and runs the rule per expert (``optim.rule.rule_direction``:
``stack_direction`` or one ``direction`` per expert, states ``"<stack>[e]"``); every rank applies
its piece with the per-expert scales.

Real processes (gloo, DP=2) on the tiny ``Qwen3MoeForCausalLM`` of ``canzona_testkit.hf_moe``, every rule,
against ``PerExpertReference`` (every expert slice stepped as its own 2-D parameter, computed in a
worker): bit for bit in fp32.  The mixed layout is compared on the whole model (reference_grads);
ZeRO-3's averaged gradients of this HF model differ from reference_grads in the last bits (the
embedding's, with or without experts: not this code's), so at stage 3 the reference steps the
matrices on the whole gradients ZeRO-3 handed the optimizer, gathered from every rank's piece.
One run per layout (lru_cache), each rule in its own try; plus one ZeRO-3 checkpoint round trip
with experts (state saved == state loaded, each expert's on its stack's host, and the resumed run
equal to the uninterrupted one), and the mixed layout's elastic resume DP 2 -> 1 and 1 -> 2 with
the stack hosted at DP=2 (every expert's state on its host or owner, continued bit for bit).

Cost: 7 rank runs; 20 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
from functools import lru_cache

import numpy as np
import pytest
import torch

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, TYPES, ds_config, params_of

transformers = pytest.importorskip("transformers")

from canzona_testkit.hf_moe import PerExpertReference, make_moe_model, moe_batches  # noqa: E402

STEPS, MICRO = 3, 2
GATE_UP = "model.model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.model.layers.0.mlp.experts.down_proj"
STACKS = (GATE_UP, DOWN)
#: layout name -> (ZeRO stage, optimizer params added to HP, experts per stack).  With 8 experts
#: the gate_up stack outgrows DP=2's equal chunk, so the mixed layout must cut and host it
LAYOUTS = {"zero3": (3, {}, 4), "mixed": (1, {"layout": "mixed"}, 8)}


def _engine(dp, opt_type, layout):
    import canzona_ds  # noqa: F401
    import deepspeed

    from canzona_testkit.zero3 import zero3_config

    stage, extra, experts = LAYOUTS[layout]
    model = make_moe_model(0, experts=experts)
    kw = dict(micro=MICRO, optimizer=opt_type, params={**HP[opt_type], **extra})
    cfg = zero3_config(dp, **kw) if stage == 3 else ds_config(dp, stage=stage, **kw)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _params(engine) -> dict:
    from canzona_testkit.zero3 import gathered_params

    return gathered_params(engine.module) if engine.zero_optimization_stage() == 3 else params_of(engine.module)


def _train(engine, rank, data) -> list[float]:
    losses = []
    for x, y in data:
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _hosted(opt) -> dict:
    """name -> host rank of every matrix the DP-hosted runtime runs (cut into pieces over DP)."""
    hosted = opt.placement.hosted
    if hosted is None:
        return {}
    from canzona_ds.tp.runtime import FlatSplit

    runtime = hosted.runtime
    return {m.name: runtime.plan.host[j] for j, m in enumerate(runtime.matrices) if isinstance(m, FlatSplit)}


def _reference(data, dp, opt_type, layout):
    from canzona_testkit.models import reference_grads

    model = make_moe_model(0, experts=LAYOUTS[layout][2])
    ref = PerExpertReference(model, opt_type)
    for x, y in data:
        grads = reference_grads(model, [x], [y], dp, MICRO)
        for n, p in model.named_parameters():
            p.grad = grads[n]
        ref.step()
    return params_of(model)


def _record_gradients(opt) -> list[dict]:
    """Wrap the hosted runtime's step: every step, the whole gradient of each matrix it steps,
    joined from every rank's piece (all_gather_object, nothing of the code under test).  The
    gradients ZeRO-3 hands the optimizer, for the reference."""
    import torch.distributed as dist

    runtime, record = opt.placement.hosted.runtime, []
    step = runtime.step

    def recording(params, grads, *args, **kwargs):
        gathered = [None] * dist.get_world_size(runtime.group)
        dist.all_gather_object(gathered, [g.detach().reshape(-1).clone() for g in grads], group=runtime.group)
        record.append({m.name: torch.cat([pieces[i] for pieces in gathered]).view(m.full_shape)
                       for i, m in enumerate(runtime.matrices)})
        return step(params, grads, *args, **kwargs)

    runtime.step = recording
    return record


def _reference_from(record: list[dict], opt_type: str, layout: str) -> dict:
    """The per-expert reference stepped on recorded whole gradients of the matrices (the other
    parameters get zeros; only the matrices are compared)."""
    model = make_moe_model(0, experts=LAYOUTS[layout][2])
    ref = PerExpertReference(model, opt_type)
    for grads in record:
        for n, p in model.named_parameters():
            p.grad = grads[n].clone() if n in grads else torch.zeros_like(p)
        ref.step()
    return {n: v for n, v in params_of(model).items() if n in record[0]}


def _worker(rank, dp, layout):
    torch.set_num_threads(test_threads())
    data = moe_batches(STEPS, MICRO * dp)
    out = {}
    for opt_type in TYPES:
        try:
            engine = _engine(dp, opt_type, layout)
            opt = engine.optimizer.optimizer
            record = _record_gradients(opt) if layout == "zero3" else None
            losses = _train(engine, rank, data)
            hosted = _hosted(opt)
            res = dict(params=_params(engine), losses=losses, hosted=hosted,
                       experts={m.name: m.num_experts for m in opt.placement.hosted.runtime.matrices}
                       if opt.placement.hosted is not None else {},
                       piece_keys=sorted(opt.piece_state), state_keys=sorted(opt.matrix_state),
                       kind=opt.placement.kind)
            if rank == 0:
                # ZeRO-3's averaged gradients of this HF model differ from reference_grads in the
                # last bits (the embedding's, already at step 1, with or without experts), so the
                # stage-3 reference steps on the gradients ZeRO-3 handed the optimizer
                res["reference"] = _reference(data, dp, opt_type, layout) if record is None else \
                    _reference_from(record, opt_type, layout)
            out[opt_type] = {"ok": res}
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            import traceback

            out[opt_type] = {"error": traceback.format_exc()}
    return out


@lru_cache(maxsize=None)
def _results(layout: str):
    try:
        return run_distributed(_worker, 2, layout, timeout=400), None
    except RuntimeError as e:
        return None, str(e)


def _scenario(layout: str, opt_type: str) -> list[dict]:
    res, err = _results(layout)
    if err is not None:
        pytest.fail(f"{layout}: the DP=2 processes failed:\n{err}")
    for r in range(2):
        if "error" in res[r][opt_type]:
            pytest.fail(f"{layout} {opt_type} failed on rank {r}:\n{res[r][opt_type]['error']}")
    return [res[r][opt_type]["ok"] for r in range(2)]


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("opt_type", TYPES)
def test_hosted_stacks_equal_per_expert_reference(layout, opt_type):
    r0, r1 = _scenario(layout, opt_type)
    ref = r0["reference"]
    for name in ref:
        np.testing.assert_array_equal(r0["params"][name], ref[name], err_msg=name)
        np.testing.assert_array_equal(r1["params"][name], ref[name], err_msg=name)
    assert all(np.isfinite(r0["losses"]))
    # the feature is active: at least one stack is cut over DP and hosted, as a stack of E
    stacks = [s for s in STACKS if s in r0["hosted"]]
    assert stacks, f"{layout}: no expert stack is hosted ({sorted(r0['hosted'])})"
    if layout == "zero3":
        assert r0["kind"] == "sharded" and set(stacks) == set(STACKS)
    assert r0["hosted"] == r1["hosted"]
    E = LAYOUTS[layout][2]
    for s in stacks:
        assert r0["experts"][s] == E
        host = [r0, r1][r0["hosted"][s]]
        other = [r0, r1][1 - r0["hosted"][s]]
        experts = {f"{s}[{e}]" for e in range(E)}
        # every expert's whole state on the stack's host, none elsewhere, never a state for the stack
        assert experts <= set(host["state_keys"]) and not experts & set(other["state_keys"])
        assert s not in host["state_keys"] and s not in host["piece_keys"] + other["piece_keys"]


# ------------------------------------------------------------------------- ZeRO-3 checkpoints
def _save_resume(rank, dp, ckpt, opt_type):
    """Train 2 steps, save, train 2 more (the uninterrupted run); a fresh engine loads the
    checkpoint and trains the same 2: its rule state and parameters must be the first run's."""
    torch.set_num_threads(test_threads())
    before, after = moe_batches(2, MICRO * dp, seed=1), moe_batches(2, MICRO * dp, seed=2)
    engine = _engine(dp, opt_type, "zero3")
    _train(engine, rank, before)
    engine.save_checkpoint(ckpt, tag="t")
    saved = {k: {n: v.clone() for n, v in st.items() if torch.is_tensor(v)}
             for k, st in engine.optimizer.optimizer.matrix_state.items()}
    _train(engine, rank, after)
    uninterrupted = _params(engine)
    del engine
    engine = _engine(dp, opt_type, "zero3")
    engine.load_checkpoint(ckpt, tag="t")
    opt = engine.optimizer.optimizer
    loaded = {k: dict(st) for k, st in opt.matrix_state.items()}
    same = sorted(saved) == sorted(loaded) and all(
        torch.equal(v, loaded[k][n]) for k, st in saved.items() for n, v in st.items())
    _train(engine, rank, after)
    return dict(params=_params(engine), uninterrupted=uninterrupted, hosted=_hosted(opt), state_keys=sorted(saved),
                same=same)


@pytest.mark.dist
def test_zero3_checkpoint_round_trip_keeps_expert_state_with_its_host(tmp_path):
    E = LAYOUTS["zero3"][2]
    res = run_distributed(_save_resume, 2, str(tmp_path / "ckpt"), "CanzonaShampoo", timeout=300)
    for r, out in enumerate(res):
        assert out["same"], f"rank {r}: the loaded rule state differs from the saved one"
        for s in STACKS:
            mine = {k for k in out["state_keys"] if k.startswith(s + "[")}
            assert mine == ({f"{s}[{e}]" for e in range(E)} if out["hosted"][s] == r else set()), (r, s)
            assert s not in out["state_keys"]
        for name, v in out["uninterrupted"].items():
            np.testing.assert_array_equal(out["params"][name], v, err_msg=name)


# ------------------------------------------------------------------------- mixed layout, elastic
def _mixed_save(rank, dp, ckpt, opt_type):
    torch.set_num_threads(test_threads())
    engine = _engine(dp, opt_type, "mixed")
    _train(engine, rank, moe_batches(2, MICRO * dp, seed=1))
    engine.save_checkpoint(ckpt, tag="t")
    opt = engine.optimizer.optimizer
    return dict(hosted=_hosted(opt), state_keys=sorted(opt.matrix_state), piece_keys=sorted(opt.piece_state))


def _mixed_resume(rank, dp, ckpt, opt_type, n):
    from canzona_testkit.models import reference_grads

    torch.set_num_threads(test_threads())
    engine = _engine(dp, opt_type, "mixed")
    engine.load_checkpoint(ckpt, tag="t")
    opt = engine.optimizer.optimizer
    out = dict(held=opt.handled_state_names(), state_keys=sorted(opt.matrix_state), hosted=_hosted(opt),
               piece_keys=sorted(opt.piece_state))
    after = moe_batches(2, MICRO * dp, seed=2)
    _train(engine, rank, after)
    out["params"] = params_of(engine.module)
    if rank == 0:  # n-rank batches before the checkpoint, dp-rank batches after
        model = make_moe_model(0, experts=LAYOUTS["mixed"][2])
        ref = PerExpertReference(model, opt_type)
        for size, data in ((n, moe_batches(2, MICRO * n, seed=1)), (dp, after)):
            for x, y in data:
                grads = reference_grads(model, [x], [y], size, MICRO)
                for name, p in model.named_parameters():
                    p.grad = grads[name]
                ref.step()
        out["reference"] = params_of(model)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("n,m", [(2, 1), (1, 2)], ids=["dp2to1", "dp1to2"])
def test_mixed_layout_elastic_resume_moves_hosted_stack_state(tmp_path, n, m):
    """Saved at DP=n, resumed at DP=m; at DP=2 the gate_up stack is hosted (Muon: its host keeps
    every expert's momentum, no piece state for the stack): every expert's state reaches the
    stack's owner or host, and the run continues bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_mixed_save, n, ckpt, "CanzonaMuon", timeout=300)
    res = run_distributed(_mixed_resume, m, ckpt, "CanzonaMuon", n, timeout=300)
    E = LAYOUTS["mixed"][2]
    experts = {f"{s}[{e}]" for s in STACKS for e in range(E)}
    gate_up = {f"{GATE_UP}[{e}]" for e in range(E)}
    for runs in (saved, res):
        assert experts <= set().union(*(r["state_keys"] for r in runs))
        if len(runs) == 2:  # DP=2: the stack is hosted, every expert's whole state on its host only
            assert GATE_UP in runs[0]["hosted"], runs[0]["hosted"]
            host = runs[0]["hosted"][GATE_UP]
            assert gate_up <= set(runs[host]["state_keys"]) and not gate_up & set(runs[1 - host]["state_keys"])
            assert GATE_UP not in runs[0]["piece_keys"] + runs[1]["piece_keys"]
    for r in res:
        assert {k for k in r["state_keys"] if k in experts} == {k for k in r["held"] if k in experts}
    for name, v in res[0]["reference"].items():
        for r in res:
            np.testing.assert_array_equal(r["params"][name], v, err_msg=name)

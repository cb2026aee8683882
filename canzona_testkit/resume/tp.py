"""Family ``tp``: tensor parallelism without MoE, the Megatron stand-in of tests/test_zero_tp.py
(its ``TinyGPTBlock``, ``CFG``, ``PARAMS``, batches and loss: VocabParallelEmbedding, the fused
qkv ``[q; k; v]`` per TP rank, the fused SwiGLU fc1 ``[gate; up]`` with partition_stride 2,
row-parallel proj and fc2, replicated norms and a replicated matrix) at ZeRO 1 under
``deepspeed.initialize(..., mpu=ms.mpu)``: TP 2 -> 1 (TP shard frames and a TP host's rule state
in its concatenated TP layout reaching TP=1), the mixed layout at DP 2 x TP 2 (a TP-split matrix
grid-hosted: its weight and Muon's momentum in pieces of both TP shards, Shampoo's and SOAP's
state on the grid host), owned <-> mixed at the same size, mixed at TP 2 -> mixed at TP 1.

No gradient clipping: under TP DeepSpeed reduces the norm over the model-parallel group, not
canzona's torch-exact clip (as in tests/test_zero_tp.py).

Route: every row goes through the index loop, except a row whose saved and running layouts are
the same spec: that one must take DeepSpeed's stock load (the one comparison finds the same
fingerprints), and resumes bit for bit through it (the grid host's rule state, Muon's momentum
pieces).  :func:`resume` records which route ``engine.load_checkpoint`` took; :func:`check`
asserts it.

Lossless: every (whole-model name, state) of the saved index equals the reloaded one bit for
bit: in the TP=1 frame where TP changed (``tp1_state``: shards rebuilt, a TP host's state mapped
through its rule's state_axes), else in the TP frame both were written in (:func:`frame_state`:
Shampoo's blocked factors of a fused layout have no TP=1 frame).

Continuation: the single-process ReferenceOptimizer in the frame the running engine computes in
(the TP=1 matrices at TP 1; at TP 2 the concatenated TP layout, ``ms.to_tp_layout``, as
tests/test_zero_tp.py's reference), started from the saved state in that frame and fed the
resumed run's own local gradients (tapped on a shadow copy of the module) averaged as ZeRO
averages them (``zero_average`` over the DP ranks of each TP rank): every DP replica's
parameters equal it bit for bit (DP <= 2: every sum has two terms).
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import os

import numpy as np
import torch

from . import AFTER, BEFORE, Layout, assert_same_tp1_state, assert_steps, record_routes, start_state, tp1_state


def _zt():
    import test_zero_tp as zt  # the model, data and settings (tests/ is on the workers' path)

    return zt


def config(lay: Layout, opt_type: str) -> dict:
    if lay.stage != 1 or lay.pp != 1 or lay.ep != 1 or lay.epb is not None or lay.offload or lay.before:
        raise ValueError(f"family 'tp' runs ZeRO 1 with TP and DP only (and 'mixed'); got {lay}")
    cfg = _zt().ds_config(opt_type, lay.stage)
    if lay.mixed:
        cfg["optimizer"]["params"]["layout"] = "mixed"
    return cfg


def engine_for(lay: Layout, opt_type: str):
    """This TP rank's shards of the deterministic TP=1 weights on a DeepSpeed engine (ZeRO x TP
    through the stand-in mpu)."""
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit import megatron_standin as ms

    zt = _zt()
    torch.set_num_threads(test_threads())
    ms.initialize_model_parallel(lay.tp)
    model = ms.TinyGPTBlock(**zt.CFG)
    model.load_state_dict(ms.shard_state_dict(ms.init_full_state_dict(zt.CFG), zt.CFG, lay.tp,
                                              ms.get_tensor_model_parallel_rank()))
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(lay, opt_type),
                                mpu=ms.mpu)[0]


def _tp_hosts(engine) -> dict:
    """The grid hosts' TP ranks by name (the mixed layout's record; {} owned)."""
    return {n: h["tp_host"] for n, h in engine.optimizer.canzona_layout_meta().get("hosted", {}).items()
            if h.get("tp_host") is not None}


def save(rank, world, model, lay, opt_type, ckpt):
    from canzona_testkit import megatron_standin as ms

    zt, engine = _zt(), engine_for(lay, opt_type)
    for s in range(BEFORE):
        engine.backward(zt.loss_of(engine, zt.batch(s, ms.get_data_parallel_rank())))
        engine.step()
    engine.save_checkpoint(ckpt, tag="saved")
    return {"mixed": engine.optimizer.canzona_layout.mixed, "tp_hosts": _tp_hosts(engine)}


def save_unseeded(rank, world, model, lay, opt_type, ckpt):
    """:func:`save` with the grid hosts' TP ranks chosen without the owned TP runtime's load
    (``tp_cells(seed_owned=False)``: what versions before the seed chose)."""
    import functools

    import canzona_ds.planning.mixed as pm

    seeded = pm.tp_cells
    pm.tp_cells = functools.partial(seeded, seed_owned=False)
    try:
        return save(rank, world, model, lay, opt_type, ckpt)
    finally:
        pm.tp_cells = seeded


def save_unseeded_and_resume(rank, world, model, lay, opt_type, ckpt, out):
    """:func:`save_unseeded`, then :func:`resume` in the same processes (this version restarted on
    that checkpoint); returns the resume's result with the saved grid hosts (``saved_tp_hosts``)."""
    saved = save_unseeded(rank, world, model, lay, opt_type, ckpt)
    return dict(resume(rank, world, model, lay, opt_type, ckpt, out), saved_tp_hosts=saved["tp_hosts"])


def resume(rank, world, model, lay, opt_type, ckpt, out):
    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.models import params_of

    zt, taken = _zt(), record_routes()
    engine = engine_for(lay, opt_type)
    engine.load_checkpoint(ckpt, tag="saved")
    engine.save_checkpoint(out, tag="reloaded")  # what this rank holds right after the load
    steps = engine.global_steps
    shadow, grads = ms.TinyGPTBlock(**zt.CFG), []
    for s in range(BEFORE, BEFORE + AFTER):
        ids = zt.batch(s, ms.get_data_parallel_rank())
        shadow.load_state_dict(engine.module.state_dict())  # this rank's local gradient, before ZeRO averages it
        shadow.zero_grad(set_to_none=True)
        zt.loss_of(shadow, ids).backward()
        grads.append({n: p.grad.numpy().copy() for n, p in shadow.named_parameters()})
        engine.backward(zt.loss_of(engine, ids))
        engine.step()
    return dict(params=params_of(engine.module), grads=grads,  # numpy: no shared memory across processes
                steps_at_load=steps, steps=engine.global_steps, route=taken, mixed=engine.optimizer.canzona_layout.mixed,
                tp_hosts=_tp_hosts(engine))


def try_loads(rank, world, model, lays, opt_type, ckpt):
    """Load tag ``saved`` at each layout of ``lays`` in turn (the same processes): for each, None
    or the refusal's message."""
    out = []
    for lay in lays:
        engine = engine_for(lay, opt_type)
        try:
            engine.load_checkpoint(ckpt, tag="saved")
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    return out


def frame_state(folder: str, tp: int) -> dict:
    """(whole-model name, state) -> the tensor in the frame a TP ``tp`` engine computes in: the
    TP=1 frame at TP 1 (:func:`tp1_state`); else the concatenated TP layout (a TP host's state as
    stored, written at the same TP size; every other state of a TP-split parameter is the
    parameter's shape, put in that layout by ``ms.to_tp_layout``)."""
    if tp == 1:
        return tp1_state(folder)
    from canzona_ds.ckpt import Index, Reader
    from canzona_testkit import megatron_standin as ms

    cfg = _zt().CFG
    split = ms.fused_layout(cfg)
    index = Index.read(folder)
    reader, out = Reader(folder, index), {}
    for n, k in index.by_key():
        frame = reader.frame_of(n, k)
        if frame is not None:
            assert len(frame.sizes) == tp, (n, k, frame, f"a TP host's state written at another TP size than {tp}")
            out[n, k] = reader.whole(n, k, frame).clone()
            continue
        t = reader.whole(n, k).clone()
        if n in split:
            assert t.shape == index.shape(n), (n, k, "a TP-split parameter's global state of another shape")
            t = ms.to_tp_layout(t, n, cfg, tp)
        out[n, k] = t
    return out


def _assemble(per_tp: list[dict], name: str, tp: int) -> torch.Tensor:
    """One tensor in the concatenated TP layout from its per-TP-rank values (replicated: equal)."""
    from canzona_testkit import megatron_standin as ms

    dim, _ = ms.fused_layout(_zt().CFG).get(name, (None, []))
    if dim is None:
        for t in range(1, tp):
            assert torch.equal(per_tp[t][name], per_tp[0][name]), f"replicated {name} differs on TP rank {t}"
        return per_tp[0][name]
    return torch.cat([per_tp[t][name] for t in range(tp)], dim=dim)


def reference(opt_type: str, running: Layout, folder: str, results: list) -> tuple[dict, dict]:
    """(start, end): the ReferenceOptimizer's parameters in the running frame, started from the
    state in ``folder`` and stepped on ``results``' gradients averaged over DP as ZeRO does."""
    from canzona_ds.ckpt import Index
    from canzona_ds.reference import ReferenceOptimizer, zero_average
    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.moe import _start_from
    from canzona_testkit.schedule import reference_lr

    zt, tp, dp = _zt(), running.tp, running.dp
    torch.set_num_threads(test_threads())
    index = Index.read(folder)
    start = start_state(index, frame_state(folder, tp))
    assert set(index.names) == set(ms.init_full_state_dict(zt.CFG)), index.names
    params = {n: torch.nn.Parameter(start.params[n].clone()) for n in ms.init_full_state_dict(zt.CFG)}  # model order
    opt = ReferenceOptimizer(params.items(), zt._config(opt_type))
    assert [n for n, _ in opt.matrices] == zt.MATRICES
    _start_from(opt, params, start)
    for s in range(AFTER):  # Megatron's layout: global rank = dp_rank * tp + tp_rank
        averaged = [zero_average([{n: torch.from_numpy(g) for n, g in results[d * tp + t]["grads"][s].items()}
                                  for d in range(dp)]) for t in range(tp)]
        for n, p in params.items():
            p.grad = _assemble(averaged, n, tp)
        reference_lr(opt)  # the scenarios' schedule (canzona_testkit/schedule.py)
        opt.step()
    return start.params, {n: p.detach() for n, p in params.items()}


def check_state(model, opt_type, saved, running, ckpt, out, results):
    """Lossless, the step counts, and the continuation (the module doc); the route is the
    caller's."""
    from canzona_testkit import megatron_standin as ms

    zt = _zt()
    folder = os.path.join(ckpt, "saved")
    names = set(ms.init_full_state_dict(zt.CFG))
    if saved.tp == running.tp:  # in the TP frame (Shampoo's blocked factors have no TP=1 frame)
        got, back = frame_state(folder, saved.tp), frame_state(os.path.join(out, "reloaded"), saved.tp)
        assert set(got) == set(back), sorted(set(got) ^ set(back))[:5]
        for key in got:
            assert torch.equal(got[key], back[key]), (key, float((got[key] - back[key]).abs().max()))
        compared = len(got)
    else:
        compared, got = assert_same_tp1_state(folder, os.path.join(out, "reloaded")), tp1_state(folder)
    assert {n for n, k in got if k == "param"} == names and compared >= len(names) + 2 * len(zt.MATRICES)
    assert all(any(n == m and k != "param" for n, k in got) for m in zt.MATRICES)  # every matrix's rule state
    assert_steps(results)
    assert all(r["steps_at_load"] == BEFORE for r in results)
    if running.mixed:
        assert all(r["mixed"] for r in results), "the running mixed layout hosts no matrix"
    start, ref = reference(opt_type, running, folder, results)
    for n in ref:
        assert not torch.equal(ref[n], start[n]), n  # every parameter trained on
    for d in range(running.dp):
        final = [{n: torch.from_numpy(v) for n, v in results[d * running.tp + t]["params"].items()}
                 for t in range(running.tp)]
        for n in ref:
            np.testing.assert_array_equal(_assemble(final, n, running.tp).numpy(), ref[n].numpy(),
                                          err_msg=f"dp {d} {n}")


def check(model, opt_type, saved, running, ckpt, out, results):
    want = "stock" if saved == running else "index"
    for r in results:
        assert r["route"] == [want], (r["route"], want)
    check_state(model, opt_type, saved, running, ckpt, out, results)

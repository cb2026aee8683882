"""Families ``pipe`` (pipeline parallelism without MoE: canzona_testkit.pipeline's tied tiny
decoder as a DeepSpeed ``PipelineModule``, DP 1, any PP size, ZeRO 0 or 1) and ``pptp`` (PP x TP
x DP, tests/test_pipeline.py's 3D layout: ColumnParallel fc1 and RowParallel fc2 blocks on two
stages, ZeRO 1).

``pipe``: at ZeRO 0 the module weights are in DeepSpeed's per-layer files
(``layer_XX-model_states.pt``), the optimizer in each stage's ``mp_rank_XX_model_states.pt``;
the tied embedding lives on the first and the last stage.  Lossless: every (name, state) of the
saved index reads back bit for bit from the
reloaded one.  Continuation, with gradient clipping that clips on every step: the same decoder
in one process (``ReferenceDecoder``, torch's clip_grad_norm_, the ReferenceOptimizer), bit for
bit.  The tied embedding's two uses are summed as the pipeline does at each step's PP size: one
stage lets autograd add them micro-batch by micro-batch ("shared"), two stages add the per-use
sums in the tie all-reduce ("per_use"); the reference switches with the run.

``pptp``: TP 2 -> 1 under pipeline parallelism (refused by name before the index: under PP the
per-layout readers changed the DP size only): each stage fills its own parameters from the TP
shard frames and hosts' state; every state, in the TP=1 frame, is the saved one bit for bit, and
training continues (a finite loss on every rank).  No continuation reference here (the 3D
pipeline's exactness is tests/test_pipeline.py's) and no clipping (under TP DeepSpeed reduces
the norm over the model-parallel group, not canzona's torch-exact clip).
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import os

import numpy as np
import torch

from . import AFTER, BEFORE, CLIP, MICRO, Layout, assert_same_state, assert_same_tp1_state, assert_steps
from . import index_route_only

#: micro-batches per step (gradient accumulation)
GAS = 2


def config(lay: Layout, opt_type: str) -> dict:
    from canzona_testkit.models import HP

    if lay.dp != 1 or lay.tp != 1 or lay.ep != 1 or lay.stage > 1 or lay.mixed or lay.offload or lay.before:
        raise ValueError(f"family 'pipe' runs DP 1, ZeRO 0 or 1, any PP size; got {lay}")
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "train_batch_size": MICRO * GAS, "optimizer": {"type": opt_type, "params": dict(HP[opt_type])},
            "zero_optimization": {"stage": lay.stage}, "gradient_clipping": CLIP, "steps_per_print": 10 ** 9}


def _engine(lay: Layout, opt_type: str):
    """(module, engine, this rank's micro-batches of every step: BEFORE then AFTER steps)."""
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_testkit.pipeline import build_pipe, dataset, rank_micro_batches

    torch.set_num_threads(test_threads())
    module = build_pipe(lay.pp, True, 0)
    engine = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                  config=config(lay, opt_type))[0]
    x, y = dataset((BEFORE + AFTER) * GAS * MICRO, 1)
    return module, engine, rank_micro_batches(x, y, 1, 0, MICRO)


def _pptp(rank, world, lay: Layout, opt_type: str):
    """(engine, this rank's micro-batches of every step) at PP x TP x DP (``pptp``)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    import canzona_ds  # noqa: F401
    import test_pipeline as tpl  # the TP blocks and settings (tests/ is on the workers' path)
    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.pipeline import Embedding, Head, dataset, loss_fn, rank_micro_batches

    if lay.stage != 1 or lay.ep != 1 or lay.mixed or lay.offload or lay.before:
        raise ValueError(f"family 'pptp' runs ZeRO 1 with PP, TP and DP only; got {lay}")
    torch.set_num_threads(test_threads())
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    topo = PipeModelDataParallelTopology(num_pp=lay.pp, num_mp=lay.tp, num_dp=lay.dp)
    grid = PipelineParallelGrid(topology=topo)
    ms._TP_GROUP, ms._TP_SIZE, ms._DP_GROUP = grid.get_slice_parallel_group(), lay.tp, grid.get_data_parallel_group()
    layers = [LayerSpec(Embedding, 0), LayerSpec(tpl.TPBlock, 1), LayerSpec(tpl.TPBlock, 2), LayerSpec(Head, 3)]
    module = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
    engine = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                  config=tpl.pipe_config(opt_type, lay.dp))[0]
    x, y = dataset((BEFORE + AFTER) * tpl.GAS * tpl.MICRO * lay.dp, 1)
    return engine, rank_micro_batches(x, y, lay.dp, grid.get_data_parallel_rank(), tpl.MICRO), tpl.GAS


def save(rank, world, model, lay, opt_type, ckpt):
    if model == "pptp":
        engine, batches, gas = _pptp(rank, world, lay, opt_type)
    else:
        (_, engine, batches), gas = _engine(lay, opt_type), GAS
    data = iter(batches[:BEFORE * gas])
    for _ in range(BEFORE):
        engine.train_batch(data)
    engine.save_checkpoint(ckpt, tag="saved")
    return True


def resume(rank, world, model, lay, opt_type, ckpt, out):
    from canzona_testkit.models import params_of
    from canzona_testkit.pipeline import canonical_name

    index_route_only()
    if model == "pptp":
        engine, batches, gas = _pptp(rank, world, lay, opt_type)
    else:
        (module, engine, batches), gas = _engine(lay, opt_type), GAS
    engine.load_checkpoint(ckpt, tag="saved")
    engine.save_checkpoint(out, tag="reloaded")  # what this rank holds right after the load
    steps = engine.global_steps
    data = iter(batches[BEFORE * gas:])
    losses = [float(engine.train_batch(data)) for _ in range(AFTER)]
    res = dict(steps_at_load=steps, steps=engine.global_steps, losses=losses)
    if model == "pipe":
        res["params"] = {canonical_name(n): v for n, v in params_of(module).items()}
    return res


def reference(opt_type: str, modes: list[str]) -> dict:
    """The tied tiny decoder in one process (DP 1), one step per entry of ``modes`` (how that
    step sums the tied weight's two uses), clipped by torch's clip_grad_norm_."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer
    from canzona_testkit.models import HP, params_of
    from canzona_testkit.pipeline import ReferenceDecoder, dataset, rank_micro_batches
    from canzona_testkit.schedule import reference_lr

    torch.set_num_threads(test_threads())
    model = ReferenceDecoder(True, 0, modes[0])
    named = list(model.named_parameters())
    opt = ReferenceOptimizer(named, CanzonaConfig.from_ds(opt_type, dict(HP[opt_type])))
    x, y = dataset(len(modes) * GAS * MICRO, 1)
    batches = rank_micro_batches(x, y, 1, 0, MICRO)
    for s, mode in enumerate(modes):
        model.tied_grad = mode
        model.zero_grad(set_to_none=True)
        for xb, yb in batches[s * GAS:(s + 1) * GAS]:
            (model(xb, yb) / GAS).backward()
        model.merge_tied_grad()
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)
        assert norm > 2 * CLIP, f"the clipping must clip (norm {float(norm):.3g})"
        reference_lr(opt)  # the scenarios' schedule (canzona_testkit/schedule.py)
        opt.step()
    return params_of(model)


def check(model, opt_type, saved, running, ckpt, out, results):
    assert_steps(results)
    assert all(r["steps_at_load"] == BEFORE for r in results)
    if model == "pptp":
        assert all(np.isfinite(x) for r in results for x in r["losses"]), [r["losses"] for r in results]
        assert assert_same_tp1_state(os.path.join(ckpt, "saved"), os.path.join(out, "reloaded")) >= 4 * 2 + 2
        return
    from canzona_testkit.pipeline import merge_stages

    compared = assert_same_state(os.path.join(ckpt, "saved"), os.path.join(out, "reloaded"))
    assert compared >= 30  # every parameter's master, the AdamW moments, the rule state
    modes = ["shared" if lay.pp == 1 else "per_use" for lay, n in ((saved, BEFORE), (running, AFTER)) for _ in range(n)]
    ref = reference(opt_type, modes)
    got = merge_stages(results)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)

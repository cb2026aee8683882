"""Families ``dense`` (the tiny LM, canzona_testkit.models) and ``stacks`` (a tiny transformers
Qwen3-MoE whose experts are 3-D stacks: rule state per expert, ``W[e]``): ZeRO 0-3, offload,
the mixed layout, any DP size.

Continuation: the single-process ReferenceOptimizer (torch AdamW, the rule per whole matrix,
torch's clip_grad_norm_) that saw the saved run's batches before the checkpoint and the
resumed run's after it.  Bit for bit where both sides average over at most 2 ranks in fp32 (a
sum of two is exact in either order); at DP 4 the all-reduce associates a 4-term sum otherwise,
so Muon ends within ``muon_reordered_sum_tolerance`` and Shampoo within 1e-5 (SOAP continues at
DP <= 2 only: from an ulp-different clipped gradient its eigenbasis Adam drifts ~1e-3; no useful
bound).
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import os

import numpy as np
import torch

from . import AFTER, BEFORE, CLIP, MICRO, Layout, assert_same_state, assert_steps, index_route_only

STACKS = ("model.model.layers.0.mlp.experts.gate_up_proj", "model.model.layers.0.mlp.experts.down_proj")


def config(lay: Layout, opt_type: str) -> dict:
    from canzona_testkit.models import ds_config
    from canzona_testkit.zero3 import zero3_config

    kw = dict(optimizer=opt_type, gradient_clipping=CLIP)
    if lay.offload:
        kw["zero_optimization"] = {"offload_optimizer": {"device": "cpu"}}
    cfg = zero3_config(lay.dp, **kw) if lay.stage == 3 else ds_config(lay.dp, stage=lay.stage, **kw)
    if lay.mixed:
        cfg["optimizer"]["params"]["layout"] = "mixed"
    return cfg


def data(model: str, dp: int, steps: int, seed: int) -> list:
    if model == "stacks":
        from canzona_testkit.hf_moe import moe_batches

        return moe_batches(steps, MICRO * dp, seed=seed)
    from canzona_testkit.models import batches

    return batches(steps, MICRO * dp, seed=seed)


def make(model: str):
    if model == "stacks":
        from canzona_testkit.hf_moe import make_moe_model

        return make_moe_model(0)
    from canzona_testkit.models import make_model

    return make_model(0)


def engine_for(model: str, lay: Layout, opt_type: str, cfg: dict | None = None):
    import deepspeed

    import canzona_ds  # noqa: F401

    torch.set_num_threads(test_threads())
    module = make(model)
    cfg = config(lay, opt_type) if cfg is None else cfg
    return deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)[0]


def train(engine, rank: int, batches: list) -> None:
    for x, y in batches:
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(x, y))
        engine.step()


def params(engine, stage: int) -> dict:
    if stage == 3:
        from canzona_testkit.zero3 import gathered_params

        return gathered_params(engine.module)
    from canzona_testkit.models import params_of

    return params_of(engine.module)


def save(rank, world, model, lay, opt_type, ckpt):
    engine = engine_for(model, lay, opt_type)
    train(engine, rank, data(model, lay.dp, BEFORE, 1))
    engine.save_checkpoint(ckpt, tag="saved")
    return True


def resume(rank, world, model, lay, opt_type, ckpt, out):
    index_route_only()
    engine = engine_for(model, lay, opt_type)
    engine.load_checkpoint(ckpt, tag="saved")
    engine.save_checkpoint(out, tag="reloaded")  # what this rank holds right after the load
    steps = engine.global_steps
    train(engine, rank, data(model, lay.dp, AFTER, 2))
    return dict(params=params(engine, lay.stage), steps_at_load=steps, steps=engine.global_steps)


def reference(model: str, n: int, m: int, opt_type: str) -> dict:
    """The reference that saw ``BEFORE`` steps at DP ``n`` and ``AFTER`` at DP ``m``."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer
    from canzona_testkit.models import HP, params_of, reference_grads
    from canzona_testkit.schedule import reference_lr

    torch.set_num_threads(test_threads())
    module = make(model)
    if model == "stacks":  # every expert slice its own 2-D matrix
        from canzona_testkit.hf_moe import PerExpertReference

        opt = PerExpertReference(module, opt_type)
    else:
        opt = ReferenceOptimizer(module.named_parameters(), CanzonaConfig.from_ds(opt_type, HP[opt_type]))
    for dp, batches in ((n, data(model, n, BEFORE, 1)), (m, data(model, m, AFTER, 2))):
        for x, y in batches:
            grads = reference_grads(module, [x], [y], dp, MICRO)
            for name, p in module.named_parameters():
                p.grad = grads[name]
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            assert norm > 2 * CLIP, f"the clipping must clip (norm {float(norm):.3g})"
            reference_lr(opt)  # the scenarios' schedule (canzona_testkit/schedule.py)
            opt.step()
    return params_of(module)


def stack_states(folder: str) -> set:
    """(stack, rule-state key) pairs an index holds for the expert stacks."""
    from canzona_ds.ckpt import Index

    index = Index.read(folder)
    stacks = index.meta["expert_stacks"]
    return {(n, k) for n, k in index.by_key() if n in stacks and k not in ("param", "exp_avg", "exp_avg_sq")}


def check(model, opt_type, saved, running, ckpt, out, results):
    compared = assert_same_state(os.path.join(ckpt, "saved"), os.path.join(out, "reloaded"))
    if model == "dense":
        assert compared >= 9 + 2 * 5  # every parameter's master, the AdamW moments of the 5 AdamW ones, rule state
    else:  # both stacks' rule state, every expert's chunk, compared above as the stack's (E, ...) state
        assert {n for n, _ in stack_states(os.path.join(ckpt, "saved"))} == set(STACKS)
    assert_steps(results)
    assert all(r["steps_at_load"] == BEFORE for r in results)
    ref = reference(model, saved.dp, running.dp, opt_type)
    got = results[0]["params"]
    if max(saved.dp, running.dp) <= 2:
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
        return
    from canzona_testkit.models import muon_reordered_sum_tolerance

    dev = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
    assert opt_type != "CanzonaSOAP", "SOAP continues at DP <= 2 only (module docstring)"
    bound = muon_reordered_sum_tolerance(BEFORE + AFTER) if opt_type == "CanzonaMuon" else 1e-5
    print(f"{opt_type} {saved} -> {running}: max |param - reference| = {dev:.3g} (bound {bound:.3g})")
    assert dev <= bound, (dev, bound)

"""Families ``moe`` (DeepSpeed MoE: canzona_testkit.moe's TinyMoE, 4 experts of two matrices)
and ``moe-e2`` (2 experts, ``.2.weight`` left to AdamW: at DP 4, ep_size 2 the mixed layout
hosts each rank's local expert over its expert-DP pair and the dense ``proj.weight`` over the 4
ranks): ZeRO 0-2, owned or mixed, another DP or ep_size, ``epb`` (a second MoE layer with its
own ep_size), ``before`` (``use_data_before_expert_parallelism``).

Continuation: ``testing.moe.reference_run`` at the running layout (the ranks' forward, the
all-to-alls and ZeRO's averages reproduced in one process, torch AdamW, the rule per expert,
torch's clip_grad_norm_) continued from the saved state as the saved index holds it.  Bit for
bit at DP 2 (every sum has two terms); at DP 4 the all-reduce associates 4-term sums
otherwise: Muon within ``muon_reordered_sum_tolerance``, Shampoo within ``TOL``.  (SOAP continues
at DP <= 2 only: from an ulp-different clipped gradient its eigenbasis Adam ends ~2e-3 apart at
DP 4, measured; no useful bound.)
"""
from __future__ import annotations

import os

import numpy as np

from . import AFTER, BEFORE, CLIP, MICRO, Layout, assert_same_state, assert_steps, index_route_only, start_of

#: the largest |param - reference| at DP 4 after AFTER steps for Shampoo (4-term sums in another
#: order, ~1e-7 relative, amplified by the preconditioner's inverse roots)
TOL = 1e-5


def _experts(model: str) -> int:
    return 2 if model == "moe-e2" else 4


def config(model: str, lay: Layout, opt_type: str) -> dict:
    from canzona_ds.planning.params import DEFAULT_EXCLUDE
    from canzona_testkit.models import HP
    from canzona_testkit.moe import moe_ds_config

    params = dict(HP[opt_type])
    if model == "moe-e2":
        params["matrix_exclude"] = list(DEFAULT_EXCLUDE) + [".2.weight"]
    if lay.mixed:
        params["layout"] = "mixed"
    extra = {"use_data_before_expert_parallelism": True} if lay.before else {}
    if lay.offload:
        extra["zero_optimization"] = {"offload_optimizer": {"device": "cpu"}}
    return moe_ds_config(lay.dp, optimizer=opt_type, stage=lay.stage, params=params, gradient_clipping=CLIP,
                         micro=MICRO, **extra)


def data(dp: int, steps: int, seed: int) -> list:
    from canzona_testkit.models import batches

    return batches(steps, MICRO * dp, seed=seed)


def _run(rank, model, lay, opt_type, steps, batches, after_init=None):
    from canzona_testkit.moe import run_moe_engine

    return run_moe_engine(rank, lay.dp, lay.ep, config(model, lay, opt_type), steps, micro=MICRO, data=batches,
                          after_init=after_init, num_experts=_experts(model), ep2=lay.epb)


def save(rank, world, model, lay, opt_type, ckpt):
    _, _, engine = _run(rank, model, lay, opt_type, BEFORE, data(lay.dp, BEFORE, 1))
    engine.save_checkpoint(ckpt, tag="saved")
    return True


def resume(rank, world, model, lay, opt_type, ckpt, out):
    index_route_only()
    at = {}

    def load(engine):
        engine.load_checkpoint(ckpt, tag="saved")
        engine.save_checkpoint(out, tag="reloaded")  # what this rank holds right after the load
        at["steps"] = engine.global_steps
        at["mixed"] = any(x.mixed for x in getattr(engine.optimizer, "canzona_layouts", {}).values())

    params, _, engine = _run(rank, model, lay, opt_type, AFTER, data(lay.dp, AFTER, 2), after_init=load)
    return dict(params=params, steps_at_load=at["steps"], steps=engine.global_steps, mixed=at["mixed"])


def reference(model: str, lay: Layout, opt_type: str, start) -> dict:
    from canzona_testkit.moe import reference_run

    kw = dict(params=config(model, lay, opt_type)["optimizer"]["params"]) if model == "moe-e2" else {}
    return reference_run(lay.dp, lay.ep, AFTER, opt_type, micro=MICRO, data=data(lay.dp, AFTER, 2), start=start,
                         clip=CLIP, num_experts=_experts(model), ep2=lay.epb, before=lay.before, schedule=True, **kw)


def check(model, opt_type, saved, running, ckpt, out, results):
    from canzona_testkit.moe import whole_names

    compared = assert_same_state(os.path.join(ckpt, "saved"), os.path.join(out, "reloaded"))
    # every expert (weight and bias of 2 layers, of each MoE layer) by its whole-model name
    assert compared >= len(whole_names(_experts(model), two=running.epb is not None))
    assert_steps(results)
    assert all(r["steps_at_load"] == BEFORE for r in results)
    if running.mixed and model == "moe-e2" and running.dp > running.ep:
        assert all(r["mixed"] for r in results), "the running mixed layout hosts no matrix"
    ref = reference(model, running, opt_type, start_of(os.path.join(ckpt, "saved")))
    if running.dp <= 2:
        for r in results:
            for k, v in r["params"].items():
                np.testing.assert_array_equal(v, ref[k], err_msg=k)
        return
    from canzona_testkit.models import muon_reordered_sum_tolerance

    dev = max(float(np.abs(r["params"][k] - ref[k]).max()) for r in results for k in r["params"])
    assert opt_type != "CanzonaSOAP", "SOAP continues at DP <= 2 only (module docstring)"
    bound = muon_reordered_sum_tolerance(AFTER) if opt_type == "CanzonaMuon" else TOL
    print(f"{opt_type} {saved} -> {running}: max |param - reference| = {dev:.3g} (bound {bound:.3g})")
    assert dev <= bound, (dev, bound)

"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``, 4 experts, ep_size 2) with ZeRO-Offload
(``zero_optimization.offload_optimizer.device = "cpu"``) at ZeRO 1 and 2, world 2, on real gloo
processes, against the single-process reference of ``canzona_testkit.moe``.

With offload DeepSpeed keeps every param group's fp32 partition (dense and each expert group,
``single_partition_of_fp32_groups``) and its gradient on the host, copies each averaged gradient
piece there (``cpu_offload`` paths of ``stage_1_and_2.py``) and runs the optimizer there; the
Canzona layout binds its matrix views into those host partitions and the torch-exact clip reads
the gradient partitions from ``single_partition_of_fp32_groups[i].grad``
(``integration/clip.py``, ``TorchClip.partition_pieces``).  (DeepSpeed 0.19.8 itself runs MoE with
offload: its own ``"AdamW"`` - ``DeepSpeedCPUAdam`` - on this model at ZeRO 1 and 2 with clipping
follows the run without offload within an ulp or two per step: checked below; docs/moe.md.)

  * ZeRO 1 and 2, Muon, Shampoo, SOAP: every rank's parameters equal the reference bit for bit
    (rtol = atol = 0); offload active (``cpu_offload``), every matrix group's views bound into its
    fp32 partition, each owner's updates replayed bit for bit, no collective call in the step,
    each matrix owned once (dense over DP, experts over their expert-DP group);
  * gradient clipping (ZeRO 1 Muon, ZeRO 2 SOAP): the norm is above the clip every step (it
    clips) and the parameters equal the reference with torch's ``clip_grad_norm_`` bit for bit;
  * bf16 with clipping (ZeRO 1, Muon) and gradient accumulation (ZeRO 2, Shampoo, 2 micro-steps),
    which the reference does not model: bit for bit with the same run without offload, each
    owner's updates replayed bit for bit;
  * DeepSpeed's own ``"AdamW"`` with clipping, ZeRO 1 and 2: with offload (``DeepSpeedCPUAdam``)
    within an ulp or two per step of the run without it (DeepSpeed supports MoE with offload
    itself; its two paths round the clip norm differently: ``test_offload_equals_plain``);
  * checkpoints (ZeRO 2, Shampoo): saved after 2 steps, a fresh engine loads and trains the
    third: bit for bit with the uninterrupted run, rule state equal.  (Resizes with offload, ep_size
    2 -> 1 and DP 4 -> 2, are rows of tests/test_ckpt_resume.py's scenario table.)

One ``run_distributed`` at world 2; each scenario in its own ``try``: one failing scenario fails
one test.

Cost: 1 rank run; 4 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import traceback
from functools import lru_cache

import numpy as np
import pytest
import torch

from canzona_testkit.dist import run_distributed, scratch_dir
from canzona_testkit.models import TYPES
from canzona_testkit.kernels import assert_bits, note_exact

STEPS = 3  # Shampoo/SOAP in HP refresh every 2 steps
CLIP = 0.05  # well below the gradient norm (~1.8): every step clips
EP = 2
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}

#: name -> (stage, type, clip)
SCENARIOS = {f"z{stage}_{t}": (stage, t, 0.0) for stage in (1, 2) for t in TYPES}
SCENARIOS.update({"z1_muon_clip": (1, "CanzonaMuon", CLIP), "z2_soap_clip": (2, "CanzonaSOAP", CLIP)})
#: name -> (stage, type, micro-steps, extra ds_config): offload against the same run without it
TWINS = {"z1_muon_bf16_clip_twin": (1, "CanzonaMuon", STEPS, {"bf16": {"enabled": True}, "gradient_clipping": CLIP}),
         "z2_shampoo_gas2_twin": (2, "CanzonaShampoo", 2 * STEPS, {"gas": 2})}
#: DeepSpeed's own optimizer on the same model: DeepSpeed 0.19.8 supports MoE with offload itself
DS_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
TWINS.update({f"z{stage}_deepspeed_adamw_clip_twin": (stage, DS_ADAMW, STEPS, {"gradient_clipping": CLIP})
              for stage in (1, 2)})
CKPT = "z2_shampoo_checkpoint"
CKPT_TYPE = "CanzonaShampoo"


def _cfg(world: int, stage: int, opt_type: str, clip: float = 0.0) -> dict:
    from canzona_testkit.moe import moe_ds_config

    return moe_ds_config(world, optimizer=opt_type, stage=stage, gradient_clipping=clip,
                         zero_optimization={"stage": stage, **OFFLOAD})


def _train(rank, world, stage, opt_type, clip):
    from canzona_testkit.comm import CommCounter
    from canzona_testkit.models import MatrixStepRecorder
    from canzona_testkit.moe import run_moe_engine

    calls, recorder, norms = [], [], []

    def attach(engine):
        inner = engine.optimizer.optimizer
        stock = inner.step

        def counted(*a, **k):
            with CommCounter() as c:
                out = stock(*a, **k)
            calls.append(c.count("torch") + c.count("deepspeed"))
            return out

        inner.step = counted
        recorder.append(MatrixStepRecorder(inner))
        engines.append(engine)

    engines = []

    def after_step(step, params):
        norms.append(float(engines[0].get_global_grad_norm()))

    params, _, engine = run_moe_engine(rank, world, EP, _cfg(world, stage, opt_type, clip), STEPS, after_init=attach,
                                       after_step=after_step)
    zopt, inner = engine.optimizer, engine.optimizer.optimizer
    # every matrix group's views lie in its (host) fp32 partition
    bound = []
    for i, g in enumerate(inner.param_groups):
        if g["canzona_role"] == "matrix":
            flat = zopt.single_partition_of_fp32_groups[i]
            bound.append((str(g.get("canzona_partition")), sorted(v.name for v in inner.placement.views[id(flat)]),
                          str(flat.device)))
    return dict(params=params, calls=calls, replay=recorder[0].summary(), norms=norms, bound=bound,
                cpu_offload=bool(zopt.cpu_offload), owned=sorted(inner.handled_names()),
                plans={str(k): v.world_size for k, v in inner.plans.items()}, zero_class=type(zopt).__name__,
                groups=[[g["canzona_role"], g.get("moe", False)] for g in inner.param_groups])


def _twin(rank, world, stage, opt_type, steps, extra):
    """bf16 and gradient accumulation, which the reference does not model: the offloaded run
    equals the same run without offload bit for bit, each owner's updates replayed bit for bit."""
    from canzona_testkit.models import MatrixStepRecorder
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    out, recorder, norms = {}, [], []
    for offload in (True, False):
        zero = {"stage": stage, **(OFFLOAD if offload else {})}
        cfg = moe_ds_config(world, optimizer=opt_type, stage=stage, zero_optimization=zero, **extra)
        engines = []

        def attach(engine):
            engines.append(engine)
            if offload and isinstance(opt_type, str):
                recorder.append(MatrixStepRecorder(engine.optimizer.optimizer))

        def after_step(step, p):
            if offload and extra.get("gradient_clipping"):
                norms.append(float(engines[0].get_global_grad_norm()))

        params, losses, engine = run_moe_engine(rank, world, EP, cfg, steps, after_init=attach, after_step=after_step)
        out[offload] = dict(params=params, losses=losses, cpu_offload=bool(engine.optimizer.cpu_offload),
                            inner=type(engine.optimizer.optimizer).__name__)
    return dict(offload=out[True], plain=out[False], replay=recorder[0].summary() if recorder else None, norms=norms)


def _checkpoint(rank, world, root):
    """Save after 2 steps, train 1 more; a fresh engine loads and trains the same step."""
    import torch

    from canzona_testkit.models import batches
    from canzona_testkit.moe import run_moe_engine

    data = batches(3, 2 * world)
    cfg = _cfg(world, 2, CKPT_TYPE)
    saved = {}

    def after_step(step, params):
        if step == 2:
            saved["engine"].save_checkpoint(root, tag="two")

    straight, _, engine = run_moe_engine(rank, world, EP, cfg, 3, after_init=lambda e: saved.update(engine=e),
                                         after_step=after_step, data=data)
    state = {n: {k: v.clone() for k, v in st.items()} for n, st in engine.optimizer.optimizer.matrix_state.items()}
    resumed, _, engine2 = run_moe_engine(rank, world, EP, cfg, 1, data=data[2:],
                                         after_init=lambda e: e.load_checkpoint(root, tag="two"))
    state2 = engine2.optimizer.optimizer.matrix_state
    same_state = state.keys() == state2.keys() and all(torch.equal(state[n][k], state2[n][k])
                                                        for n in state for k in state[n])
    res = dict(straight=straight, resumed=resumed, same_state=same_state,
               cpu_offload=bool(engine2.optimizer.cpu_offload), experts=sorted(n for n in state if ".experts." in n))
    return res


def _worker(rank, world, root):
    from canzona_testkit.moe import reference_run

    out, refs = {}, {}
    for name, (stage, opt_type, clip) in SCENARIOS.items():
        try:
            res = _train(rank, world, stage, opt_type, clip)
            if rank == 0:
                if (opt_type, clip) not in refs:
                    refs[(opt_type, clip)] = reference_run(world, EP, STEPS, opt_type, clip=clip)
                res["ref"] = refs[(opt_type, clip)]
            out[name] = res
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    for name, args in TWINS.items():
        try:
            out[name] = _twin(rank, world, *args)
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()
    try:
        out[CKPT] = _checkpoint(rank, world, root)
    except Exception:  # noqa: BLE001
        out[CKPT] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _run() -> list:
    return run_distributed(_worker, 2, scratch_dir("canzona_moe_offload_"), timeout=900)


def _results(name: str) -> list:
    res = [r[name] for r in _run()]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    return res


def _eq(got: dict, want: dict, what: str) -> None:
    assert got and set(got) <= set(want)
    for n in got:
        np.testing.assert_array_equal(got[n], want[n], err_msg=f"{what}: {n}")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_offload_bit_exact(name):
    stage, opt_type, clip = SCENARIOS[name]
    res = _results(name)
    for rank, r in enumerate(res):
        _eq(r["params"], res[0]["ref"], name)
        assert r["cpu_offload"] and r["zero_class"] == "CanzonaZeroOptimizer"
        assert r["calls"] and set(r["calls"]) == {0}, r["calls"]  # no collective call in the step
        assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
        assert r["replay"]["steps"] == STEPS, r["replay"]
        assert r["groups"] == [["matrix", False], ["aux", False], ["matrix", True], ["aux", True]], r["groups"]
        assert r["plans"] == {"None": 2, "ep_size_2": 1}
        # the dense matrices over DP, this rank's 2 local experts (2 matrices each) over its expert-DP
        # group of one rank: all bound into the host fp32 partitions
        bound = {part: names for part, names, _ in r["bound"]}
        assert sorted(bound) == ["None", "ep_size_2"] and len(bound["ep_size_2"]) == 4, r["bound"]
        assert all(device == "cpu" for _, _, device in r["bound"]), r["bound"]
        assert sorted(n for n in r["owned"] if ".experts." in n) == bound["ep_size_2"]
        if clip:
            assert len(r["norms"]) == STEPS and min(r["norms"]) > clip, r["norms"]  # clipping clips
    dense = sorted(n for r in res for n in r["owned"] if ".experts." not in n)
    assert dense == ["moe.deepspeed_moe.gate.wg.weight", "proj.weight"], dense  # each dense matrix once


#: DeepSpeed's own AdamW twins (offload vs plain): the fraction of Adam's largest step by which
#: their updates may differ per step (derivation in ``_within_adam_steps``)
DS_ADAM_STEP_FRACTION = 2.0 ** -12


def _within_adam_steps(got: dict, want: dict, steps: int, lr: float, what: str) -> None:
    """Two AdamW runs that differ only by roundings agree within, per step, the weight's own
    rounding (an ulp of the weight on each side) plus ``DS_ADAM_STEP_FRACTION`` of Adam's largest
    step ``lr (1 - b1) / sqrt(1 - b2)`` (Kingma & Ba, section 2.1).

    Why the update's size and not the weight's ulp: the error enters through the update.  Adam's
    step ``m/(sqrt(v) + eps)`` is homogeneous of degree 0 in the gradient, so gradients that agree
    to a relative ~2^-20 (an ulp of the clip coefficient, ulp-different weights fed forward) give
    steps that agree to a few times that, and the SIMD splits of the CPU Adam kernel add a few ulps
    of the step; 2^-12 of the largest step leaves a 2^8 margin for elements whose gradient nearly
    cancels in ``m``.  A weight near zero has a tiny ulp but takes the same lr-sized step (an AVX2
    EPYC: 2.98e-8 apart on such an ``embed.weight`` element after 3 steps, 20 ulps of the weight,
    1e-6 of lr)."""
    b1, b2 = 0.9, 0.999  # DeepSpeed's AdamW defaults, which DS_ADAMW keeps
    largest_step = lr * (1 - b1) / np.sqrt(1 - b2)
    assert got and set(got) <= set(want)
    for n in got:
        a, b = np.asarray(got[n], dtype=np.float32), np.asarray(want[n], dtype=np.float32)
        bound = steps * (2 * np.spacing(np.maximum(np.abs(a), np.abs(b))) + DS_ADAM_STEP_FRACTION * largest_step)
        far = np.abs(a - b) > bound
        assert not far.any(), f"{what}: {n}: {int(far.sum())} elements beyond the bound, max {np.abs(a - b).max():.3g}"


@pytest.mark.parametrize("name", sorted(TWINS))
def test_offload_equals_plain(name):
    """Canzona types: offload and plain are the same arithmetic (the torch-exact clip, the rule and
    torch's AdamW on the same values), so bit for bit on any CPU.

    DeepSpeed's own ``"AdamW"`` is not: with offload DeepSpeed sums the squared per-parameter norms
    as Python floats (fp64, ``complete_grad_norm_calculation_for_cpu_offload``), without it in fp32
    tensors (``get_grad_norm_direct``), so the two clip coefficients may differ by an fp32 ulp and
    every clipped gradient element with them; the two runs also cut the same CPU Adam kernel
    (``cpu_adam_impl.cpp``: ``DeepSpeedCPUAdam`` on the flat partition, ``FusedAdam`` per tensor) at
    other SIMD/scalar and OpenMP-thread boundaries, which depend on the CPU and the thread count.
    So the twins agree within a fraction of Adam's step per step (``_within_adam_steps``)."""
    stage, opt_type, steps, extra = TWINS[name]
    gas = extra.get("gas", 1)
    for r in _results(name):
        assert r["offload"]["cpu_offload"] and not r["plain"]["cpu_offload"]
        if isinstance(opt_type, str):
            _eq(r["offload"]["params"], r["plain"]["params"], name)
            assert_bits(r["offload"]["losses"], r["plain"]["losses"])
        else:
            note_exact()  # the bound's premise is the CPU Adam kernel's SIMD splits: .ci/kernels reruns it
            _within_adam_steps(r["offload"]["params"], r["plain"]["params"], steps, opt_type["params"]["lr"], name)
            # each loss is computed from weights within that bound (~1e-6 relative to the weights
            # after 3 steps) on the same batch: to first order it moves by as little; 1e-5 leaves 10x
            np.testing.assert_allclose(r["offload"]["losses"], r["plain"]["losses"], rtol=1e-5, atol=0)
        if isinstance(opt_type, str):
            assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
            assert r["replay"]["steps"] == steps // gas, r["replay"]
        else:  # DeepSpeed's offload runs its own CPU Adam
            assert r["offload"]["inner"] == "DeepSpeedCPUAdam", r["offload"]["inner"]
        if extra.get("gradient_clipping"):  # clipping clips
            assert min(r["norms"]) > extra["gradient_clipping"], r["norms"]


def test_offload_checkpoint_round_trip():
    res = _results(CKPT)
    for r in res:
        _eq(r["resumed"], r["straight"], "resumed")
        assert r["same_state"] and r["cpu_offload"] and len(r["experts"]) == 4, r["experts"]


def _adamw_run(bug: str | None) -> dict:
    """Three torch AdamW steps (DS_ADAMW's lr and weight decay, DeepSpeed's betas) on fixed
    weights and gradients; ``bug`` changes one thing a broken twin could."""
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(shape, generator=g) for n, shape in (("w", (40, 24)), ("b", (24,)))}
    grads = [{n: torch.randn(t.shape, generator=g) for n, t in w.items()} for _ in range(STEPS)]
    params = {n: t.clone().requires_grad_() for n, t in w.items()}
    lr = DS_ADAMW["params"]["lr"] * (0.9 if bug == "lr_x0.9" else 1.0)
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=DS_ADAMW["params"]["weight_decay"])
    for s, step in enumerate(grads):
        for n, p in params.items():
            # the clip coefficient one fp32 ulp off: what the twins may differ by
            p.grad = step[n] * (1.0 + 2.0 ** -23 if bug == "clip_ulp" else 1.0)
        if bug == "dropped_step" and s == 1:
            params["w"].grad = None
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in params.items()}


@pytest.mark.parametrize("bug", ["lr_x0.9", "dropped_step"])
def test_adam_step_bound_fails_injected_bugs(bug):
    """``_within_adam_steps`` holds for runs that differ only by a rounding of the clip coefficient
    and fails lr x 0.9 and a step dropped on one tensor.  Single process, ~0.1 s."""
    lr = DS_ADAMW["params"]["lr"]
    _within_adam_steps(_adamw_run("clip_ulp"), _adamw_run(None), STEPS, lr, "a rounding")
    with pytest.raises(AssertionError, match="elements beyond the bound"):
        _within_adam_steps(_adamw_run(bug), _adamw_run(None), STEPS, lr, bug)

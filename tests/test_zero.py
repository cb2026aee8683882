"""Canzona optimizers under DeepSpeed ZeRO stage 1 and 2 (real gloo processes) against the
single-process reference (``reference.ReferenceOptimizer`` fed ZeRO's averaged gradient).

Every scenario runs in its own process group, so one failure fails one test.

Tolerances (fp32):
  * DP=1 and DP=2 (with or without gradient accumulation 2): rtol=atol=0.  Division by 2 is
    exact and a two-term sum is commutative, so the averaged gradient is bit-identical (the
    reference sums in the stage's order: stage 2 averages every micro-step, stage 1 at the
    boundary); the rule's math is the same code; for Muon that code equals torch.optim.Muon
    (test_optim_muon).
  * DP=4: gloo's 4-rank reduction associates the sum in its own order (~1 ulp on gradients):
    Muon within the reordered-sum bound end to end; for every rule, each owner's updates are replayed in one
    process from the gradients it received and must match bit for bit
    (canzona_testkit.models.MatrixStepRecorder), which checks the machinery exactly where the
    gradients cannot be reproduced (also bf16).
  * gradient clipping: tests/test_clipping.py (bit-exact against torch's clip_grad_norm_).
  * bf16 weights: replayed bit for bit, and the update (final - initial) is compared with the
    fp32 reference's: relative error < 0.15 for Muon and AdamW parameters (measured values
    printed).

Cost: 31 rank runs; 17 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from canzona_testkit.dist import device_params, run_distributed
from canzona_testkit.models import (HP, MATRICES, TYPES, batches, ds_config, make_model, max_abs_diff,
                                       muon_reordered_sum_tolerance, params_of, reference_grads,
                                       reordered_sum_bound, run_engine, run_reference)
from canzona_testkit.kernels import assert_bits, bits_differ

STEPS = 4  # Shampoo/SOAP in HP refresh every 2 steps: two refreshes


# ---------------------------------------------------------------------------- workers
def _exact_worker(rank, dp, opt_type, stage, gas):
    """Train; also count the collectives of the inner optimizer's step calls."""
    from canzona_testkit.comm import CommCounter

    inner_calls = []

    def count_inner(engine):
        inner = engine.optimizer.optimizer
        stock = inner.step

        def counted(*a, **k):
            with CommCounter() as c:
                out = stock(*a, **k)
            inner_calls.append(c.count("torch") + c.count("deepspeed"))
            return out

        inner.step = counted

    params, _, engine = run_engine(rank, dp, ds_config(dp, gas=gas, optimizer=opt_type, stage=stage), STEPS, gas=gas,
                                   after_init=count_inner)
    opt = engine.optimizer.optimizer
    return dict(params=params, owned=sorted(opt.handled_names()), inner_calls=inner_calls,
                zero_class=type(engine.optimizer).__name__,
                padding=engine.optimizer.canzona_layout.padding_fraction)


def _config_worker(rank, dp, cfg, steps, tags=None):
    from canzona_testkit.models import MatrixStepRecorder

    model = make_model(0)
    for name, flag in (tags or {}).items():
        model.get_parameter(name).use_muon = flag
    from canzona_ds.optimizer import CanzonaOptimizer

    recorder = []

    def attach(engine):
        if isinstance(engine.optimizer.optimizer, CanzonaOptimizer):
            recorder.append(MatrixStepRecorder(engine.optimizer.optimizer))

    params, losses, engine = run_engine(rank, dp, cfg, steps, model=model, after_init=attach)
    return dict(params=params, losses=losses, finite=bool(all(np.isfinite(losses))),
                inner=type(engine.optimizer).__name__, replay=recorder[0].summary() if recorder else None)


def _fp16_overflow_worker(rank, dp, stage):
    """Step 2 sees an inf gradient: the step must be skipped (weights and rule state unchanged)."""
    import canzona_ds  # noqa: F401
    import deepspeed
    import torch

    from canzona_ds.integration.accelerator import allow_fp16

    cfg = ds_config(dp, stage=stage, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000,
                                           "hysteresis": 1})
    with allow_fp16():
        model = make_model(0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        inner = engine.optimizer.optimizer
        snaps = []
        for s, (x, y) in enumerate(batches(3, 2 * dp)):
            x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
            loss = engine(x, y)
            if s == 1:
                loss = loss * torch.tensor(float("inf"))
            engine.backward(loss)
            state = lambda: {n: {k: v.clone() for k, v in st.items()} for n, st in inner.matrix_state.items()}  # noqa
            before = (params_of(engine.module), state(), engine.optimizer.loss_scale)
            engine.step()
            snaps.append((before, (params_of(engine.module), state(), engine.optimizer.loss_scale),
                          engine.skipped_steps))
    (bp, bs, bscale), (ap, as_, ascale), skipped = snaps[1]
    same_state = bs.keys() == as_.keys() and all(torch.equal(bs[n][k], as_[n][k]) for n in bs for k in bs[n])
    return dict(same_params=not bits_differ(bp, ap), same_state=same_state, scale=(bscale, ascale),
                skipped=skipped, finite=bool(all(np.isfinite(v).all() for v in snaps[2][1][0].values())),
                changed_later=max_abs_diff(snaps[2][0][0], snaps[2][1][0]) > 0, step=inner.param_groups[0]["step"])


def _comm_worker(rank, dp, cfg):
    """Collectives of one training iteration: backward (gradient reduction) and the ZeRO step."""
    import canzona_ds  # noqa: F401
    import deepspeed

    from canzona_testkit.comm import CommCounter

    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x, y = batches(1, 2 * dp)[0]
    x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
    with CommCounter() as bwd:
        engine.backward(engine(x, y))
    with CommCounter() as stp:
        engine.step()
    return dict(backward=bwd.by_op(), step=stp.by_op())


def _assert_equal(got: dict, ref: dict, atol: float = 0.0, what: str = "") -> None:
    for name in ref:
        if not atol:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"{what} {name}")
        else:
            np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=atol, err_msg=f"{what} {name}")


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("device", device_params(2))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_type", TYPES)
def test_dp2_bit_exact(opt_type, stage, device):
    """cpu: gloo ranks; cuda: NCCL ranks, one GPU each, against the reference on the first GPU
    (the same kernels)."""
    res = run_distributed(_exact_worker, 2, opt_type, stage, 1, device=device)
    ref = run_reference(2, STEPS, opt_type, device=device)
    for r in res:
        _assert_equal(r["params"], ref, what=f"{opt_type} stage {stage}")
        assert r["zero_class"] == "CanzonaZeroOptimizer"
        assert r["inner_calls"] and set(r["inner_calls"]) == {0}, r["inner_calls"]  # the step makes no collective
    owned = res[0]["owned"] + res[1]["owned"]  # every matrix is owned by exactly one rank
    assert sorted(owned) == sorted(MATRICES)


@pytest.mark.parametrize("opt_type", ["CanzonaMuon", "CanzonaSOAP"])
def test_dp1_bit_exact(opt_type):
    res = run_distributed(_exact_worker, 1, opt_type, 1, 1)
    _assert_equal(res[0]["params"], run_reference(1, STEPS, opt_type))
    assert sorted(res[0]["owned"]) == sorted(MATRICES)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_type", ["CanzonaMuon", "CanzonaShampoo"])
def test_gradient_accumulation_bit_exact(opt_type, stage):
    res = run_distributed(_exact_worker, 2, opt_type, stage, 2)
    _assert_equal(res[0]["params"], run_reference(2, STEPS, opt_type, gas=2, stage=stage))


@pytest.mark.parametrize("opt_type", TYPES)
def test_dp4(opt_type):
    """Four ranks, one matrix each.  Each owner applies exactly the single-process rule to the
    gradient it received (replayed bit for bit), and at the first step that gradient is the
    reference's to within the 4-term summation-order bound (``reordered_sum_bound``), on any CPU.
    End to end, the ulps of that order flip bf16 roundings in Muon's Newton-Schulz: within
    ``muon_reordered_sum_tolerance``; Shampoo's and SOAP's preconditioners divide by small
    curvature and amplify them (printed, not asserted)."""
    res = run_distributed(_config_worker, 4, ds_config(4, optimizer=opt_type), STEPS)
    ref = run_reference(4, STEPS, opt_type)
    dev = max(max_abs_diff(r["params"], ref) for r in res)
    print(f"{opt_type} DP=4: max |param - reference| = {dev:.3g}")
    for r in res:
        assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
        assert r["replay"]["steps"] == STEPS, r["replay"]
    # the first step's averaged gradient each owner received: the reference's, to summation order
    # (same weights, same micro-batches; only the 4-term sum associates otherwise), on any CPU
    x, y = batches(1, 2 * 4)[0]
    model = make_model(0)
    per_rank = [reference_grads(model, [x[2 * k:2 * k + 2]], [y[2 * k:2 * k + 2]], 1, 2) for k in range(4)]
    want = reference_grads(model, [x], [y], 4, 2)
    bound = reordered_sum_bound(per_rank)
    for r in res:
        for n, g in r["replay"]["first_grads"].items():
            err = np.abs(g - want[n].numpy())
            assert (err <= bound[n].numpy()).all(), (n, float(err.max()), float(bound[n].max()))
    assert sorted(len(r["replay"]["matrices"]) for r in res) == [1, 1, 1, 1]  # one matrix each
    if opt_type == "CanzonaMuon":  # 4-rank sums: another association (muon_reordered_sum_tolerance)
        assert dev <= muon_reordered_sum_tolerance(STEPS), dev


def test_more_ranks_than_matrices():
    """Three matrices over four ranks: one rank owns only padding (and is not rank 0)."""
    hp = dict(HP["CanzonaMuon"], matrix_exclude=["embed", "lm_head", "fc2"])
    res = run_distributed(_config_worker, 4, ds_config(4, params=hp), STEPS)
    ref = run_reference(4, STEPS, params=hp)
    for r in res:
        assert max_abs_diff(r["params"], ref) <= muon_reordered_sum_tolerance(STEPS)  # 4-rank sums: another association
    # the bound is about one step's update (a dropped step passes it: test_a_dropped_step_...): the
    # owners' updates replayed bit for bit, every step (the padding-only rank steps too), every
    # matrix on one owner
    for r in res:
        assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"]["matrices"])
        assert r["replay"]["steps"] == STEPS, r["replay"]
    assert sorted(n for r in res for n in r["replay"]["matrices"]) == sorted(set(MATRICES) - {"fc2.weight"})


def _single_process_dp4(bug=None) -> tuple[dict, dict]:
    """CanzonaOptimizer in one process on ZeRO's averaged DP=4 gradients (what an owner receives),
    with a MatrixStepRecorder; ``bug(model, opt, step)`` runs inside the matrix step."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import CanzonaOptimizer
    from canzona_testkit.models import MatrixStepRecorder

    model = make_model(0)
    opt = CanzonaOptimizer(model.named_parameters(), CanzonaConfig.from_ds("CanzonaMuon", dict(HP["CanzonaMuon"])))
    recorder = MatrixStepRecorder(opt)
    stock = opt.placement.step

    def step(group, ctx):
        if bug is None:
            return stock(group, ctx)
        return bug(model, stock, group, ctx)

    opt.placement.step = step
    for x, y in batches(STEPS, 2 * 4):
        grads = reference_grads(model, [x], [y], 4, 2)
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.step()
    return params_of(model), recorder.summary()


def _drop_fc1_step_2(model, stock, group, ctx):
    """The owner loses fc1's second update (its result never reaches the weights)."""
    held = model.get_parameter("fc1.weight").detach().clone()
    stock(group, ctx)
    if group["step"] == 2:
        model.get_parameter("fc1.weight").data.copy_(held)


def _regroup_fc1_shard(model, stock, group, ctx):
    """fc1's gradient assembled from its two halves in the wrong order (at the first step)."""
    g = model.get_parameter("fc1.weight").grad
    if group["step"] == 1:
        half = g.shape[0] // 2
        g.copy_(torch.cat([g[half:], g[:half]]))
    stock(group, ctx)


def test_a_dropped_step_passes_the_bound_and_fails_the_replay():
    """Why test_dp4 and test_more_ranks_than_matrices replay: a step dropped on one matrix ends
    within muon_reordered_sum_tolerance of the reference (one Muon step moves these weights by
    0.010-0.018; the bound is 0.02 over 4 steps), and only the replay sees it.  Single process,
    ~1 s."""
    got, replay = _single_process_dp4(_drop_fc1_step_2)
    dev = max_abs_diff(got, run_reference(4, STEPS))
    assert 0 < dev <= muon_reordered_sum_tolerance(STEPS), dev
    assert bits_differ(replay["replay_max_diff"], 0.0)
    _, replay = _single_process_dp4()  # the same run without the bug replays exactly
    assert_bits(replay["replay_max_diff"], 0.0)


def test_a_regrouped_shard_fails_the_bound():
    """A gradient shard regrouped wrongly (fc1's halves swapped once) is what the replay cannot
    see (it replays from the gradient the owner received): the bound against the reference
    catches it (0.040 measured against 0.02), as test_dp4's first-step gradient check does.
    Single process, ~1 s."""
    got, replay = _single_process_dp4(_regroup_fc1_shard)
    assert_bits(replay["replay_max_diff"], 0.0)
    assert max_abs_diff(got, run_reference(4, STEPS)) > muon_reordered_sum_tolerance(STEPS)


def test_use_muon_tags_are_honoured():
    """DeepSpeed's use_muon tag decides: lm_head tagged True is a matrix, fc2 tagged False is AdamW."""
    tags = {"lm_head.weight": True, "fc2.weight": False}
    res = run_distributed(_config_worker, 2, ds_config(2), STEPS, tags)
    model = make_model(0)
    for name, flag in tags.items():
        model.get_parameter(name).use_muon = flag
    ref = run_reference(2, STEPS, model=model)
    _assert_equal(res[0]["params"], ref)
    assert max_abs_diff(res[0]["params"], run_reference(2, STEPS)) > 1e-4  # the tags changed the result


# ---------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_type", TYPES)
def test_bf16(opt_type, stage):
    """bf16 weights, fp32 master and gradient partitions.  Exact where it can be: every owner
    applies the single-process rule to the gradient it received (replayed bit for bit).  End
    to end against the fp32 reference (the update final - initial, per tensor): Muon within
    0.15 relative (bf16 forward/backward); Shampoo's and SOAP's preconditioners amplify the
    bf16 gradient noise in low-curvature directions (measured up to ~0.55 on this tiny model,
    printed, not asserted)."""
    import torch

    res = run_distributed(_config_worker, 2, ds_config(2, optimizer=opt_type, stage=stage, bf16={"enabled": True}),
                          STEPS)
    for r in res:
        assert_bits(r["replay"]["replay_max_diff"], 0.0, r["replay"])
        assert r["replay"]["steps"] == STEPS, r["replay"]
        assert r["finite"]
    assert_bits(max_abs_diff(res[0]["params"], res[1]["params"]), 0.0)  # replicas agree after the all-gather
    ref = run_reference(2, STEPS, opt_type)
    init = {n: p.detach() for n, p in make_model(0).named_parameters()}
    for n in ref:
        d_ref = ref[n] - init[n].numpy()
        d_bf16 = res[0]["params"][n] - init[n].to(torch.bfloat16).float().numpy()
        rel = float(np.linalg.norm(d_bf16 - d_ref) / max(np.linalg.norm(d_ref), 1e-12))
        print(f"{opt_type} stage {stage} bf16 update rel. error {n}: {rel:.3f}")
        if opt_type == "CanzonaMuon" or n not in MATRICES:
            assert rel < 0.15, (n, rel)


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_step_skipped(stage):
    """Dynamic loss scaling on any CPU: the test tells DeepSpeed's CPU accelerator that fp16 is
    allowed (integration.accelerator.allow_fp16); the logic needs no fp16 hardware."""
    for o in run_distributed(_fp16_overflow_worker, 2, stage):
        assert o["same_params"] and o["same_state"], o
        assert o["scale"][1] < o["scale"][0] and o["skipped"] == 1, o
        assert o["finite"] and o["changed_later"], o
        assert o["step"] == 2  # three iterations, one skipped: the rules saw two steps


# ---------------------------------------------------------------------------- against DeepSpeed
def test_closer_to_reference_than_deepspeed_muon():
    ours = run_distributed(_config_worker, 2, ds_config(2), STEPS)[0]["params"]
    theirs = run_distributed(_config_worker, 2, ds_config(2, optimizer={"type": "Muon", "params": dict(
        HP["CanzonaMuon"], ns_method="standard", torch_adam=True)}), STEPS)[0]["params"]
    ref = run_reference(2, STEPS)
    d_ours = max(float(abs(ours[n] - ref[n]).max()) for n in MATRICES)
    d_theirs = max(float(abs(theirs[n] - ref[n]).max()) for n in MATRICES)
    print(f"max |param - reference| on matrices after {STEPS} steps: CanzonaMuon {d_ours:.3g}, "
          f"DeepSpeed Muon (ns_method=standard) {d_theirs:.3g}")
    assert_bits(d_ours, 0.0)
    assert d_theirs > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_reduction_not_worse_than_stock_adamw(stage):
    ours = run_distributed(_comm_worker, 2, ds_config(2, stage=stage))[0]
    stock = run_distributed(_comm_worker, 2, ds_config(2, stage=stage, optimizer={
        "type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}))[0]
    print("Canzona backward+step:", ours["backward"], ours["step"])
    print("stock AdamW backward+step:", stock["backward"], stock["step"])
    ours_grad = sum(v[2] for v in ours["backward"].values())
    stock_grad = sum(v[2] for v in stock["backward"].values())
    assert 0 < ours_grad <= stock_grad, (ours_grad, stock_grad)
    assert "all_gather_into_tensor" in ours["step"]  # the stock post-step all-gather rebuilds the weights


@pytest.mark.parametrize("bug", ["rank_dropped", "shard_regrouped"])
def test_reordered_sum_bound_fails_injected_bugs(bug):
    """test_dp4's first-step gradient check (``reordered_sum_bound``) holds for the same four terms
    summed in another order and fails an average that lost one rank's micro-batches (the other
    three scaled to make up the count) or one with fc1's halves regrouped.  Single process, ~0.5 s."""
    x, y = batches(1, 2 * 4)[0]
    model = make_model(0)
    per_rank = [reference_grads(model, [x[2 * k:2 * k + 2]], [y[2 * k:2 * k + 2]], 1, 2) for k in range(4)]
    want = reference_grads(model, [x], [y], 4, 2)
    bound = reordered_sum_bound(per_rank)
    reordered = {n: (per_rank[3][n] / 4 + per_rank[1][n] / 4) + (per_rank[2][n] / 4 + per_rank[0][n] / 4)
                 for n in want}
    if bug == "rank_dropped":
        broken = {n: sum(per_rank[k][n] for k in range(3)) / 3 for n in want}
    else:
        half = want["fc1.weight"].shape[0] // 2
        broken = dict(want, **{"fc1.weight": torch.cat([want["fc1.weight"][half:], want["fc1.weight"][:half]])})

    def within(got: dict) -> bool:
        return all(bool(((got[n] - want[n]).abs() <= bound[n]).all()) for n in want)

    assert within(reordered) and not within(broken)

"""Every setting DeepSpeed's own Muon runs in, with the Canzona optimizers (real gloo processes,
single-process reference): optimizer offload to CPU at stages 1 and 2, bf16 with fp32
gradient accumulation, per_head_muon, DeepSpeed lr schedulers that keep the lr split, and
parameters that get no gradient.

Cost: 13 rank runs; 7 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import (HP, TinyLM, batches, ds_config, make_attention_model, max_abs_diff, params_of,
                                       run_engine, run_reference)

STEPS = 4


def _run(rank, dp, cfg, steps=STEPS, gas=1, model_fn=None):
    from canzona_testkit.models import MatrixStepRecorder

    rec = []
    params, losses, engine = run_engine(rank, dp, cfg, steps, gas=gas, model=model_fn() if model_fn else None,
                                        after_init=lambda e: rec.append(MatrixStepRecorder(e.optimizer.optimizer)))
    inner = engine.optimizer.optimizer
    return dict(params=params, losses=losses, zero=type(engine.optimizer).__name__, replay=rec[0].summary(),
                lrs=[g["lr"] for g in inner.param_groups], infos={n: i.num_heads for n, i in inner.infos.items()})


# ---------------------------------------------------------------------------- offload
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_type", ["CanzonaMuon", "CanzonaShampoo"])
def test_cpu_offload_bit_exact(opt_type, stage):
    """offload_optimizer.device=cpu: the fp32 master partition, its gradient and the rule run on
    the host (here the host is the device, so this checks DeepSpeed's offload code path: grads
    copied into the fp32 partition buffer, the step on it, bit16 copies back)."""
    cfg = ds_config(2, optimizer=opt_type, zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}})
    res = run_distributed(_run, 2, cfg)
    ref = run_reference(2, STEPS, opt_type)
    for r in res:
        assert r["zero"] == "CanzonaZeroOptimizer"
        for n in ref:
            np.testing.assert_array_equal(r["params"][n], ref[n], err_msg=n)


# ---------------------------------------------------------------------------- bf16 + fp32 accumulation
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_with_fp32_gradient_accumulation(stage):
    """bf16 weights, grad_accum_dtype fp32, 2 micro-steps.  DeepSpeed would send stage 1 to
    BF16_Optimizer (which re-partitions blind to matrices); canzona routes it to ZeRO-1 with
    fp32 per-parameter accumulation and fp32 reduction.  Each owner applies the rule exactly
    to what it received (replayed bit for bit); end to end it is close to the fp32 reference."""
    cfg = ds_config(2, gas=2, stage=stage, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    res = run_distributed(_run, 2, cfg, STEPS, 2)
    for r in res:
        assert r["zero"] == "CanzonaZeroOptimizer"
        assert_bits(r["replay"]["replay_max_diff"], 0.0)
        assert r["replay"]["steps"] == STEPS
    ref = run_reference(2, STEPS, gas=2, stage=stage)
    init = {n: p.detach() for n, p in TinyLM().named_parameters()}  # only for shapes
    assert set(ref) == set(init)
    dev = max_abs_diff(res[0]["params"], ref)
    print(f"stage {stage} bf16 + fp32 accumulation: max |param - fp32 reference| = {dev:.3g}")
    assert dev < 0.05  # bf16 forward/backward and weights (measured ~0.02)
    assert_bits(max_abs_diff(res[0]["params"], res[1]["params"]), 0.0)


# ---------------------------------------------------------------------------- per_head_muon
def test_per_head_muon_matches_per_head_reference():
    """``per_head_muon: true`` (DeepSpeed's key): q_proj is orthogonalised as 4 heads, k_proj and
    v_proj as 2, o_proj whole (DeepSpeed's head resolution); DP=2 equals the single-process
    reference with the same tags bit for bit, and differs from whole-matrix Muon."""
    from canzona_ds.integration.heads import tag_heads
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    params = dict(HP["CanzonaMuon"], per_head_muon=True)
    res = run_distributed(_run, 2, ds_config(2, params=params), STEPS, 1, make_attention_model)
    heads = res[0]["infos"]
    assert heads == {"q_proj.weight": 4, "k_proj.weight": 2, "v_proj.weight": 2, "o_proj.weight": None}, heads

    def reference(per_head: bool) -> dict:
        torch.set_num_threads(test_threads())
        model = make_attention_model()
        cfg = CanzonaConfig.from_ds("CanzonaMuon", dict(params, per_head_muon=per_head))
        if per_head:
            tag_heads(model, list(model.named_parameters()))
        opt = ReferenceOptimizer(model.named_parameters(), cfg)
        from canzona_testkit.models import reference_grads

        for x, y in batches(STEPS, 4):
            grads = reference_grads(model, [x], [y], 2, 2)
            for n, p in model.named_parameters():
                p.grad = grads[n]
            opt.step()
        return params_of(model)

    ref = reference(True)
    for r in res:
        for n in ref:
            np.testing.assert_array_equal(r["params"][n], ref[n], err_msg=n)
    assert max_abs_diff(res[0]["params"], reference(False)) > 1e-3


def _per_head_without_heads(rank, dp):
    try:
        run_engine(rank, dp, ds_config(dp, params=dict(HP["CanzonaMuon"], per_head_muon=True)), 0)
    except ValueError as err:
        return str(err)
    return None


def test_per_head_muon_on_a_model_without_heads_is_an_error():
    """As DeepSpeed's own per_head_muon: an explicit opt-in that tags nothing is an error."""
    msg = run_distributed(_per_head_without_heads, 1)[0]
    assert msg is not None and "per_head_muon" in msg


# ---------------------------------------------------------------------------- lr schedulers
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 10, "warmup_type": "linear"},
    "WarmupDecayLR": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 2, "total_num_steps": 8,
                      "warmup_type": "linear"},
    "WarmupCosineLR": {"warmup_min_ratio": 0.1, "warmup_num_steps": 2, "total_num_steps": 8},
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_deepspeed_scheduler_keeps_the_lr_split(name):
    """A ds_config scheduler's lr values are the matrix lr; the AdamW group follows at
    adam_lr / lr (0.5 here) at every step, instead of every group getting one lr."""
    cfg = ds_config(2, scheduler={"type": name, "params": SCHEDULERS[name]})
    res = run_distributed(_run, 2, cfg)
    matrix_lr, adam_lr = res[0]["lrs"]
    assert matrix_lr > 0
    assert adam_lr == pytest.approx(matrix_lr * HP["CanzonaMuon"]["adam_lr"] / HP["CanzonaMuon"]["lr"], rel=1e-12)


# ---------------------------------------------------------------------------- unused parameters
class SometimesMLP(TinyLM):
    """TinyLM whose MLP branch runs only for batches whose first token is even: fc1/fc2 get no
    gradient in the steps where no rank's batch starts with an even token.  (Parameters
    unused on SOME ranks only are not supported by DeepSpeed's ZeRO reduction, for any
    optimizer: the ranks' gradient buckets differ and the collectives mismatch, as with DDP
    without find_unused_parameters.)"""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "seen"):
            self.seen = []
        self.seen.append(self.fc1.weight.detach().clone().numpy())  # fc1 as this step starts
        h = self.embed(x)
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        h = h + self.proj(F.silu(q) * k + v)
        if int(x[0, 0]) % 2 == 0:
            h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten())


def _sometimes_mlp() -> SometimesMLP:
    torch.manual_seed(0)
    return SometimesMLP()


def _sometimes_data() -> list:
    """Global batches whose first tokens agree across ranks: the MLP runs in steps 0, 2, 4 only."""
    data = batches(6, 4)
    for s, (x, _) in enumerate(data):
        x[:, 0] = 2 * (s % 2)
    return data


def _run_sometimes(rank, dp, stage):
    params, _, engine = run_engine(rank, dp, ds_config(dp, stage=stage), 6, model=_sometimes_mlp(),
                                   data=_sometimes_data())
    return params, engine.module.seen


@pytest.mark.parametrize("stage", [1, 2])
def test_parameter_without_gradient_gets_a_zero_gradient(stage):
    """No gradient = a zero gradient (DeepSpeed ZeRO's semantics for every optimizer): momentum
    and weight decay still move such a parameter; equal to the reference bit for bit."""
    res = run_distributed(_run_sometimes, 2, stage)
    ref = run_reference(2, 6, model=_sometimes_mlp(), stage=stage, data=_sometimes_data())
    for params, _ in res:
        for n in ref:
            np.testing.assert_array_equal(params[n], ref[n], err_msg=n)
    # step 1 used no MLP on any rank, yet fc1 moved during it (momentum and weight decay)
    seen = res[0][1]
    assert (seen[1] != seen[2]).any()

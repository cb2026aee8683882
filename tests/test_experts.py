"""Mixture-of-experts: a 3-D expert stack (transformers 5's Qwen3-MoE ``mlp.experts.gate_up_proj``
[E, 2I, H]) is E matrices: E rule updates, E states keyed ``"<stack>[e]"``, E per-expert costs.

* recognition (``planning.params.matrix_experts``): the ``experts`` path component, ds_config
  ``expert_params``, ``num_experts`` from ds_config or the model config; a >= 3-D ``<module>.weight``
  (conv kernel) is flattened by the documented rule; any other >= 3-D parameter is refused by name;
* the flattening regression: each expert's Muon update has flat singular values (the old
  [E, out*in] update does not);
* real processes (gloo, DP=2) on a real tiny ``Qwen3MoeForCausalLM``, ZeRO stages 0, 1, 2 and every
  rule, against ``canzona_testkit.hf_moe.PerExpertReference`` (torch.optim.Muon / the rule on each expert slice
  as its own 2-D parameter, computed in a worker): bit for bit in fp32 (DP=2 averages exactly);
* checkpoints: resumes at another DP size or ZeRO stage are rows of tests/test_ckpt_resume.py's
  scenario table (each expert's state a chunk of its stack's, through the checkpoint index).

Each DP=2 scenario runs once per stage (lru_cache) with each rule in its own try: one failing
scenario fails one test.

Cost: 3 rank runs; 10 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import copy
import json
from functools import lru_cache

import numpy as np
import pytest
import torch

from canzona_ds.config import CanzonaConfig
from canzona_ds.optimizer import CanzonaOptimizer
from canzona_ds.optim.rule import MatrixInfo, rule_step
from canzona_ds.planning.cost import task_cost
from canzona_ds.planning.params import ParamSpec, expert_stack, matrix_experts
from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, TYPES, ds_config, muon_kernel_tolerance, params_of

transformers = pytest.importorskip("transformers")

from canzona_testkit.hf_moe import (PerExpertReference, make_moe_model,  # noqa: E402
                                    moe_batches)

STEPS, MICRO = 4, 2
GATE_UP = "model.model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.model.layers.0.mlp.experts.down_proj"


# ------------------------------------------------------------------------- recognition
def test_expert_stacks_are_recognised_by_module_declaration_and_rank():
    assert expert_stack("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 32))
    assert not expert_stack("model.layers.0.mlp.gate.weight", (4, 32))  # the router: one matrix
    assert not expert_stack("deepspeed_moe.experts.deepspeed_experts.0.weight", (16, 8))  # one expert, 2-D
    assert not expert_stack("moe.w1", (4, 8, 16))
    assert expert_stack("moe.w1", (4, 8, 16), declared=("moe.w",))
    assert matrix_experts("mlp.experts.down_proj", (8, 32, 16), num_experts=8) == 8
    assert matrix_experts("mlp.experts.down_proj", (8, 32, 16)) == 8
    assert matrix_experts("conv.weight", (8, 3, 3, 3)) is None  # a conv kernel: flattened, documented
    assert matrix_experts("fc.weight", (8, 3)) is None


def test_expert_bias_stacks_go_to_adamw():
    from canzona_ds.planning.params import is_matrix

    # gpt-oss: mlp.experts.gate_up_proj_bias [E, 2I] is E biases, not a matrix
    assert not is_matrix("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 64))
    assert not is_matrix("model.layers.0.mlp.experts.down_proj_bias", (4, 32))
    assert is_matrix("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 64))
    assert is_matrix("x.gate_up_proj_bias", (4, 64), include=("gate_up_proj_bias",))


def test_unknown_3d_parameter_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'moe\.w1' has shape \[4, 8, 16\].*expert_params.*matrix_exclude"):
        matrix_experts("moe.w1", (4, 8, 16))


class _GroupedMLP(torch.nn.Module):
    """Megatron-LM's GroupedMLP (moe_grouped_gemm) as it holds its weights: every expert of the
    layer in one 2-D weight1 [hidden, E*ffn] and weight2 [E*ffn, hidden]."""

    def __init__(self, hidden=8, ffn=6, experts=4):
        super().__init__()
        self.weight1 = torch.nn.Parameter(torch.randn(hidden, experts * ffn))
        self.weight2 = torch.nn.Parameter(torch.randn(experts * ffn, hidden))


def test_megatron_grouped_mlp_is_refused_by_name():
    """A 2-D parameter held directly by an ``experts`` module (GroupedMLP's weight1/weight2) is
    not one matrix: refused by name, naming what to use instead; the escape (AdamW) works."""
    match = r"'decoder\.layers\.0\.mlp\.experts\.weight1' \[8, 24\]: Megatron-LM's GroupedMLP.*SequentialMLP.*" \
            r"TEGroupedMLP.*matrix_exclude"
    with pytest.raises(ValueError, match=match):
        matrix_experts("decoder.layers.0.mlp.experts.weight1", (8, 24))
    with pytest.raises(ValueError, match=r"'x\.experts\.w' \[4, 8\]: a 2-D parameter held directly by an 'experts'"):
        matrix_experts("x.experts.w", (4, 8))
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.mlp = torch.nn.Module()
    model.decoder.mlp.experts = _GroupedMLP()
    model.decoder.mlp.router = torch.nn.Linear(8, 4, bias=False)
    for build in (lambda cfg: CanzonaOptimizer(model.named_parameters(), cfg),
                  lambda cfg: __import__("canzona_ds.reference", fromlist=["x"]).ReferenceOptimizer(
                      list(model.named_parameters()), cfg)):
        with pytest.raises(ValueError, match=r"'decoder\.mlp\.experts\.weight1' \[8, 24\]: Megatron-LM's GroupedMLP"):
            build(CanzonaConfig.from_ds("CanzonaMuon", {}))
    from canzona_ds.planning.params import specs_from_module

    with pytest.raises(ValueError, match="GroupedMLP"):
        specs_from_module(model)
    opt = CanzonaOptimizer(model.named_parameters(),
                           CanzonaConfig.from_ds("CanzonaMuon", {"matrix_exclude": ["experts.weight"]}))
    assert opt.matrix_names == ["decoder.mlp.router.weight"]


@pytest.mark.parametrize("name,shape,experts", [
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 16), 4),                  # transformers 5 stack
    ("moe.deepspeed_moe.experts.deepspeed_experts.0.0.weight", (24, 16), None),  # DeepSpeed MoE expert
    ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", (12, 8), None),  # SequentialMLP
    ("decoder.layers.0.mlp.experts.linear_fc1.weight1", (12, 8), None),          # TEGroupedMLP: expert 1
    ("model.layers.0.mlp.experts.0.gate_proj.weight", (12, 8), None),             # transformers 4 experts
])
def test_per_expert_parameters_are_unaffected(name, shape, experts):
    assert matrix_experts(name, shape) == experts


def test_stack_that_disagrees_with_num_experts_is_refused():
    with pytest.raises(ValueError, match=r"'mlp\.experts\.down_proj' \[8, 32, 16\].*dim 0 \(8\).*num_experts=4"):
        matrix_experts("mlp.experts.down_proj", (8, 32, 16), num_experts=4)
    model = make_moe_model(0)  # 4 experts
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {"num_experts": 8})
    with pytest.raises(ValueError, match=r"dim 0 \(4\) is not the model's num_experts=8"):
        CanzonaOptimizer(model.named_parameters(), cfg)
    with pytest.raises(ValueError, match=r"num_experts=8 disagrees with the model config's 4 experts"):
        CanzonaOptimizer(model.named_parameters(), cfg, num_experts=4)


@pytest.mark.parametrize("params,match", [
    ({"expert_params": "experts"}, r"Invalid expert_params='experts'\. Must be a list of non-empty strings"),
    ({"expert_params": [""]}, r"Invalid expert_params=\(''"),
    ({"num_experts": 0}, r"Invalid num_experts=0\. Must be an integer within \[1, "),
    ({"num_experts": 2.5}, r"Invalid num_experts=2\.5"),
])
def test_expert_keys_are_validated(params, match):
    with pytest.raises((TypeError, ValueError), match=match):
        CanzonaConfig.from_ds("CanzonaMuon", params)


def test_declared_stack_is_per_expert():
    w = torch.nn.Parameter(torch.randn(3, 8, 5))
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {"expert_params": ["moe.w"]})
    opt = CanzonaOptimizer([("moe.w1", w)], cfg)
    assert opt.infos["moe.w1"].num_experts == 3
    assert sorted(opt.state_infos) == ["moe.w1[0]", "moe.w1[1]", "moe.w1[2]"]
    with pytest.raises(ValueError, match=r"'moe\.w1' has shape \[3, 8, 5\]"):
        CanzonaOptimizer([("moe.w1", w)], CanzonaConfig.from_ds("CanzonaMuon", {}))


def test_hf_moe_experts_can_still_go_to_adamw():
    model = make_moe_model(0)
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {"matrix_exclude": ["embed", "lm_head", "experts"]})
    opt = CanzonaOptimizer(model.named_parameters(), cfg)
    assert not any("experts" in n for n in opt.matrix_names)
    assert "model.model.layers.0.mlp.gate.weight" in opt.matrix_names


# ------------------------------------------------------------------------- cost
@pytest.mark.parametrize("rule", ["muon", "shampoo", "soap"])
def test_stack_costs_e_experts(rule):
    from canzona_ds.optim import cost_model

    model = cost_model(rule)
    stack = ParamSpec("mlp.experts.down_proj", (8, 32, 16), num_experts=8)
    one = ParamSpec("mlp.experts.down_proj.0", (32, 16))
    flat = ParamSpec("flat", (8, 32 * 16))
    for cost in ("flops", "peak_flops"):
        assert task_cost(stack, cost, model) == 8 * task_cost(one, cost, model)
        assert task_cost(stack, cost, model) != task_cost(flat, cost, model)
    state = model.state_bytes((32, 16))
    assert task_cost(stack, "memory", model) == 8 * 32 * 16 * 8 + 8 * state
    assert stack.matrix_shape == (32, 16) and stack.matrix_count == 8
    with pytest.raises(ValueError, match="Invalid num_experts=4"):
        ParamSpec("mlp.experts.down_proj", (8, 32, 16), num_experts=4)


# ------------------------------------------------------------------------- local
def _local_steps(opt_type: str, steps: int = STEPS):
    torch.set_num_threads(test_threads())
    model = make_moe_model(0)
    ref_model = copy.deepcopy(model)
    opt = CanzonaOptimizer(model.named_parameters(), CanzonaConfig.from_ds(opt_type, HP[opt_type]), num_experts=4)
    ref = PerExpertReference(ref_model, opt_type)
    for x, y in moe_batches(steps, 4):
        for m, o in ((model, opt), (ref_model, ref)):
            m.zero_grad(set_to_none=True)
            m(x, y).backward()
            o.step()
    return model, ref_model, opt, ref


@pytest.mark.parametrize("opt_type", TYPES)
def test_single_process_equals_per_expert_reference(opt_type):
    model, ref_model, opt, ref = _local_steps(opt_type)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), n
    keys = {f"{s}[{e}]" for s in (GATE_UP, DOWN) for e in range(4)}
    assert keys <= set(opt.matrix_state) and not {GATE_UP, DOWN} & set(opt.matrix_state)
    if opt_type == "CanzonaMuon":
        for e in range(4):
            assert torch.equal(opt.matrix_state[f"{DOWN}[{e}]"]["momentum_buffer"],
                               ref.expert_state(DOWN, e)["momentum_buffer"])


def _sv_spread(update: torch.Tensor) -> list[float]:
    """max/min singular value of each expert's update (of its min(out, in) values)."""
    return [float((s := torch.linalg.svdvals(update[e].double())).max() / s.min()) for e in range(update.shape[0])]


def test_muon_update_is_flat_per_expert_regression():
    """The issue's regression: one Muon step on a stack gave every expert a spread spectrum (the
    stack was orthogonalised as ONE [E, out*in] matrix).  Now each expert's update is an
    orthogonalised matrix of its own: its singular values are flat (quintic Newton-Schulz keeps
    them within ~[0.7, 1.2])."""
    torch.set_num_threads(test_threads())
    model = make_moe_model(0)
    x, y = moe_batches(1, 8)[0]
    model(x, y).backward()
    params = dict(model.named_parameters())
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.0,
                                                "nesterov": False})
    opt = CanzonaOptimizer(model.named_parameters(), cfg, num_experts=4)
    before = params[DOWN].detach().clone()
    grad = params[DOWN].grad.clone()
    assert all(float(grad[e].abs().max()) > 0 for e in range(4))  # every expert got tokens
    opt.step()
    ours = _sv_spread(before - params[DOWN].detach())
    # the wrong update, for contrast: the rule on the flattened stack
    flat = before.clone()
    rule_step(cfg.rule, flat.view(4, -1), grad.view(4, -1), {}, MatrixInfo(DOWN, (4, 32 * 16)), 1, 0.02, 0.0)
    wrong = _sv_spread(before - flat)
    print(f"per-expert sv spread (max/min): ours {[f'{v:.3g}' for v in ours]}, "
          f"flattened {[f'{v:.3g}' for v in wrong]}")
    assert max(ours) < 2.5
    assert min(wrong) > 10.0


# ------------------------------------------------------------------------- DP=2, stages 0/1/2
def _dp_worker(rank, dp, stage):
    import canzona_ds  # noqa: F401
    import deepspeed

    from canzona_testkit.models import reference_grads

    torch.set_num_threads(test_threads())
    data = moe_batches(STEPS, MICRO * dp)
    out = {}
    for opt_type in TYPES:
        try:
            model = make_moe_model(0)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(dp, micro=MICRO, optimizer=opt_type, stage=stage))
            losses = []
            for x, y in data:
                x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            opt = engine.optimizer.optimizer if stage else engine.optimizer
            res = dict(params=params_of(engine.module), losses=losses, held=sorted(opt.handled_names()),
                       state_keys=sorted(opt.matrix_state), zero=type(engine.optimizer).__name__,
                       stacks={n: opt.infos[n].num_experts for n in (GATE_UP, DOWN)})
            if rank == 0:  # the reference, in a worker (this process's BLAS)
                ref_model = make_moe_model(0)
                ref = PerExpertReference(ref_model, opt_type)
                for x, y in data:
                    grads = reference_grads(ref_model, [x], [y], dp, MICRO, stage=max(stage, 1))
                    for n, p in ref_model.named_parameters():
                        p.grad = grads[n]
                    ref.step()
                res["reference"] = params_of(ref_model)
            out[opt_type] = {"ok": res}
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            import traceback

            out[opt_type] = {"error": traceback.format_exc()}
    return out


@lru_cache(maxsize=None)
def _dp_results(stage: int):
    try:
        return run_distributed(_dp_worker, 2, stage, timeout=400), None
    except RuntimeError as e:
        return None, str(e)


def _scenario(stage: int, opt_type: str) -> list[dict]:
    res, err = _dp_results(stage)
    if err is not None:
        pytest.fail(f"stage {stage}: the DP=2 processes failed:\n{err}")
    for r in range(2):
        if "error" in res[r][opt_type]:
            pytest.fail(f"stage {stage} {opt_type} failed on rank {r}:\n{res[r][opt_type]['error']}")
    return [res[r][opt_type]["ok"] for r in range(2)]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("opt_type", TYPES)
def test_dp2_equals_per_expert_reference(stage, opt_type):
    r0, r1 = _scenario(stage, opt_type)
    ref = r0["reference"]
    assert r0["stacks"] == {GATE_UP: 4, DOWN: 4}
    for name in ref:
        np.testing.assert_array_equal(r0["params"][name], ref[name], err_msg=name)
        np.testing.assert_array_equal(r1["params"][name], ref[name], err_msg=name)
    assert all(np.isfinite(r0["losses"]))
    experts = {f"{s}[{e}]" for s in (GATE_UP, DOWN) for e in range(4)}
    if stage == 0:  # every rank steps everything
        assert set(r0["state_keys"]) == set(r1["state_keys"]) and experts <= set(r0["state_keys"])
    else:  # each stack on one owner, its experts' states with it
        assert r0["zero"] == "CanzonaZeroOptimizer"
        for r in (r0, r1):
            for s in (GATE_UP, DOWN):
                mine = {k for k in r["state_keys"] if k.startswith(s + "[")}
                assert mine == ({f"{s}[{e}]" for e in range(4)} if s in r["held"] else set()), (s, r["held"])
        assert set(r0["state_keys"]) | set(r1["state_keys"]) >= experts
        assert not set(r0["state_keys"]) & set(r1["state_keys"])


# ------------------------------------------------------------------------- planner at MoE scale
def test_whole_stacks_against_per_expert_units_at_qwen3_30b_scale():
    """The measured reason for docs/zero.md's decision: whole stacks balance up to DP=16 and are
    bounded by the largest stack beyond; per-expert units would balance at every size."""
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.compare import compare
    from canzona_ds.planning.cost import stack_bound
    from canzona_ds.planning.models import matrix_specs, model_specs

    muon = cost_model("muon")
    mats = matrix_specs(model_specs("qwen3-30b-a3b"))
    assert sum(s.num_experts is not None for s in mats) == 96
    x = compare("qwen3-30b-a3b", 128, cost_model=muon, cost="flops").summary["expert_stacks"]
    assert x["whole"]["flops_ratio"] == pytest.approx(stack_bound(mats, 128, "flops", muon), rel=1e-9)
    assert x["whole"]["flops_ratio"] > 2.0 and x["per_expert"]["flops_ratio"] < 1.01
    assert compare("qwen3-30b-a3b", 16, cost_model=muon, cost="flops").summary["expert_stacks"]["whole"][
        "flops_ratio"] < 1.001


def test_optimizer_warns_when_a_stack_bounds_the_plan():
    from canzona_ds.optimizer import _plan

    model = make_moe_model(0)
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {})
    specs = [ParamSpec(n, tuple(p.shape), "matrix", num_experts=matrix_experts(n, tuple(p.shape)))
             for n, p in model.named_parameters() if cfg.is_matrix(n, tuple(p.shape))]
    with pytest.warns(UserWarning, match=r"An expert stack bounds the DP plan: its busiest rank carries >= "
                                         r"\d+\.\d\dx the average flops load at dp=4"):
        _plan(specs, 4, cfg, cfg.rule)


def test_canzona_plan_reports_expert_stacks(capsys):
    from canzona_ds.cli.plan import main

    assert main(["--model", "deepseek-v2-lite", "--dp", "64", "--cost", "flops"]) == 0
    out = capsys.readouterr().out
    assert "Expert stacks: 52 stacks of [64] experts" in out and "per expert (lpt)" in out
    assert main(["--model", "qwen3-30b-a3b", "--dp", "32", "--json"]) == 0
    x = json.loads(capsys.readouterr().out)["expert_stacks"]
    assert x["ep"] == 1 and x["stacks"] == 96 and x["experts_per_stack"] == [128]
    assert x["whole"]["flops_ratio"] >= x["per_expert"]["flops_ratio"]


@pytest.mark.parametrize("ns_method", ["standard", "gram"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_batched_stack_equals_per_expert_direction(ns_method, nesterov):
    """Muon's stack_direction (one batched Newton-Schulz over the experts) equals its direction()
    on each expert: the momentum bit for bit (element-wise lerp: on CPU the foreach op runs the
    per-tensor kernel), the weights within muon_kernel_tolerance (baddbmm over the experts vs one
    addmm per expert: other GEMM kernels, on the same given gradients)."""
    from canzona_ds.optim.muon import MuonRule

    torch.set_num_threads(test_threads())
    rule = MuonRule(ns_method=ns_method, nesterov=nesterov, ns_batch=True)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 40, 24, generator=g)
    W_each, stacked, each = W.clone(), {}, {}
    for t in range(1, 4):
        G = torch.randn(6, 40, 24, generator=g)
        rule_step(rule, W, G, stacked, MatrixInfo("w", (6, 40, 24), num_experts=6), t, 0.02, 0.1)
        for e in range(6):
            info = MatrixInfo(f"w[{e}]", (40, 24))
            state = each.setdefault(info.name, rule.init_state(info, like=W_each[e]))
            D = rule.direction(G[e], state, info, t)
            decay, size = rule.scales(0.02, 0.1, info, t)
            W_each[e].mul_(decay).add_(D.to(W.dtype), alpha=-size)
    info = MatrixInfo("w[0]", (40, 24))
    sizes = [rule.scales(0.02, 0.1, info, t)[1] for t in range(1, 4)]
    for e in range(6):
        bound = muon_kernel_tolerance((40, 24), sizes, float(W_each[e].norm()))
        assert float((W[e] - W_each[e]).norm()) <= bound, (e, float((W[e] - W_each[e]).norm()), bound)
    assert all(torch.equal(stacked[k]["momentum_buffer"], each[k]["momentum_buffer"]) for k in each)

"""Model shapes: parameter counts match shared/reference/model_shapes.yaml."""
from __future__ import annotations

import json

import pytest

from canzona_ds.planning.models import load_models, model_specs, padded_vocab, pipeline_stage

MODELS = load_models()


@pytest.mark.parametrize("name", list(MODELS))
def test_params_total_at_tp1(name):
    derived = MODELS[name]["derived"]
    specs = model_specs(name, tp=1, pad_vocab=False)
    assert sum(s.numel for s in specs) == derived["params_total"]
    layer0 = [s for s in specs if s.name.startswith("decoder.layers.0.")]
    assert sum(s.numel for s in layer0) == derived["params_per_layer"]
    by = {s.name.split(".", 3)[-1]: s for s in layer0}
    if "fused_qkv_out" in derived:
        assert by["self_attention.linear_qkv.weight"].shape[0] == derived["fused_qkv_out"]
    if "fc1_out" in derived:
        assert by["mlp.linear_fc1.weight"].shape[0] == derived["fc1_out"]
    if "expert_fc1" in derived:  # MoE: every MoE layer holds two stacks of E experts
        moe = {s.name.split(".", 3)[-1]: s for s in specs if s.name.startswith("decoder.layers.1.")}
        fc1, fc2 = moe["mlp.experts.linear_fc1"], moe["mlp.experts.linear_fc2"]
        assert list(fc1.shape) == derived["expert_fc1"] and list(fc2.shape) == derived["expert_fc2"]
        assert fc1.num_experts == fc2.num_experts == derived["expert_fc1"][0]
        assert moe["mlp.router.weight"].shape == (derived["expert_fc1"][0], fc1.shape[2])


def test_moe_models_are_planned_at_tp1_only():
    with pytest.raises(ValueError, match=r"Invalid tp=2 for qwen3-30b-a3b: mixture-of-experts"):
        model_specs("qwen3-30b-a3b", tp=2)


def test_moe_hf_config_json(tmp_path):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
           "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert sum(s.numel for s in model_specs(str(path), pad_vocab=False)) == MODELS["qwen3-30b-a3b"]["derived"][
        "params_total"]
    path.write_text(json.dumps(dict(cfg, mlp_only_layers=[0])))
    with pytest.raises(ValueError, match="interleaved with dense ones"):
        model_specs(str(path))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards(tp):
    derived = MODELS["qwen3-32b"]["derived"]
    assert padded_vocab(151936, tp) == derived["megatron_padded_vocab"][f"tp{tp}"]
    full = {s.name: s for s in model_specs("qwen3-32b", tp=1, pad_vocab=False)}
    for s in model_specs("qwen3-32b", tp=tp):
        if s.is_matrix:
            assert s.tp_size == tp and s.full_shape == full[s.name].shape
    emb = next(s for s in model_specs("qwen3-32b", tp=tp) if "word_embeddings" in s.name)
    assert emb.shape == (derived["megatron_padded_vocab"][f"tp{tp}"] // tp, 5120) and emb.role == "aux"


def test_tied_head_and_roles():
    names = {s.name: s for s in model_specs("qwen3-0.6b")}
    assert "output_layer.weight" not in names
    assert "output_layer.weight" in {s.name for s in model_specs("qwen3-8b")}
    assert names["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (128,)
    assert {s.role for s in names.values() if len(s.shape) == 1} == {"aux"}


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
           "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert sum(s.numel for s in model_specs(str(path))) == MODELS["qwen3-0.6b"]["derived"]["params_total"]


def test_bad_model_and_tp():
    with pytest.raises(ValueError, match="Unknown model='nope'.*qwen3-32b"):
        model_specs("nope")
    with pytest.raises(ValueError, match="tp=3"):
        model_specs("qwen3-0.6b", tp=3)
    with pytest.raises(ValueError, match="tp=0"):
        model_specs("qwen3-0.6b", tp=0)


@pytest.mark.parametrize("name", ["qwen3-32b", "qwen3-14b", "gpt2-small"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_split_specs_know_their_full_matrix(name, tp):
    full = {s.name: s for s in model_specs(name, tp=1)}
    for s in model_specs(name, tp=tp):
        if not s.is_matrix:
            continue
        assert s.is_tp_split == (tp > 1)
        assert s.full_matrix_shape == full[s.name].matrix_shape
        assert s.numel * tp == full[s.name].numel
        assert s.num_heads is None  # whole-matrix Muon unless a model tags heads


def test_model_roles_agree_with_is_matrix():
    # the one matrix-vs-AdamW rule gives Megatron's names the roles model_specs assigns
    from canzona_ds.planning.params import specs_from_named_shapes

    for name in ("qwen3-8b", "gpt2-small"):
        specs = model_specs(name, tp=2)
        derived = specs_from_named_shapes((s.name, s.shape) for s in specs)
        assert [s.role for s in derived] == [s.role for s in specs]
        assert {s.name for s in specs if s.is_matrix} == {
            s.name for s in specs if s.name.split(".")[-2] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
            and s.name.endswith(".weight")}


def test_pipeline_stage_even_split():
    specs = model_specs("qwen3-32b", tp=8)
    stages = [pipeline_stage(specs, 8, k) for k in range(8)]
    assert sum(len(s) for s in stages) == len(specs)  # a partition
    layers = [sorted({int(s.name.split(".")[2]) for s in st if s.name.startswith("decoder.layers.")}) for st in stages]
    assert layers == [list(range(8 * k, 8 * k + 8)) for k in range(8)]
    assert any(s.name.startswith("embedding.") for s in stages[0])
    assert {s.name for s in stages[-1] if not s.name.startswith("decoder.layers.")} == {
        "decoder.final_layernorm.weight", "output_layer.weight"}
    assert pipeline_stage(specs, 1, 0) == specs
    with pytest.raises(ValueError, match="pp=3"):
        pipeline_stage(specs, 3, 0)  # 64 layers do not split into 3
    with pytest.raises(ValueError, match="stage=8"):
        pipeline_stage(specs, 8, 8)
    with pytest.raises(ValueError, match="pp=2.0"):
        pipeline_stage(specs, 2.0, 0)


# ------------------------------------------------------------------------- expert parallelism
def test_expert_parallel_rank_load_is_dense_share_plus_expert_share():
    """dp=4, ep=2 by hand: two dense 8x8 matrices over the 4 DP ranks (two ranks get one each),
    a stack of 4 experts [4, 4]: each EP rank holds 2 of them, one per rank of its expert-DP group
    of 2.  DP rank r (expert-DP rank r // 2) carries its dense share + one expert."""
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.compare import local_experts, plan_expert_parallel
    from canzona_ds.planning.cost import task_cost
    from canzona_ds.planning.dp import plan_dp
    from canzona_ds.planning.params import ParamSpec
    from canzona_ds.planning.report import rank_costs

    muon = cost_model("muon")
    dense = [ParamSpec("d1", (8, 8)), ParamSpec("d2", (8, 8))]
    mats = dense + [ParamSpec("experts.w", (4, 4, 4), num_experts=4)]
    local = local_experts(mats, 2, per_expert=True)
    assert [(s.name, s.shape, s.num_experts) for s in local] == [("experts.w[0]", (4, 4), None),
                                                                 ("experts.w[1]", (4, 4), None)]
    assert [(s.shape, s.num_experts) for s in local_experts(mats, 2, per_expert=False)] == [((2, 4, 4), 2)]
    for metric in ("flops", "memory"):
        a, b = task_cost(dense[0], metric, muon), task_cost(local[0], metric, muon)
        out = plan_expert_parallel(mats, 4, 2, "lpt", "flops", muon, per_expert=True)
        loads = out[f"rank_{metric}"]
        assert sorted(loads) == pytest.approx(sorted([a + b, a + b, b, b]), rel=1e-12)
        d = rank_costs(plan_dp(dense, 4, planner="lpt", cost="flops", model=muon), metric, muon)
        e = rank_costs(plan_dp(local, 2, planner="lpt", cost="flops", model=muon), metric, muon)
        assert loads == pytest.approx([d[r] + e[r // 2] for r in range(4)], rel=1e-12)
        assert out[f"{metric}_ratio"] == pytest.approx((a + b) / ((2 * a + 4 * b) / 4), rel=1e-12)
    assert out["ep"] == 2 and out["expert_dp"] == 2
    assert out["units"] == {"dense": 2, "experts_per_ep_rank": 2}
    # each EP rank's 2 experts as one stack [2, 4, 4]: it lands on expert-DP rank 0, which is DP ranks
    # 0 and 1 (EP ranks 0 and 1 of the same expert-DP rank), where the dense matrices also are
    whole = plan_expert_parallel(mats, 4, 2, "lpt", "flops", muon, per_expert=False)
    a, b = task_cost(dense[0], "flops", muon), task_cost(local[0], "flops", muon)
    assert whole["rank_flops"] == pytest.approx([a + 2 * b, a + 2 * b, 0.0, 0.0], rel=1e-12)
    # held: dense 4 ranks x 64 elements, experts 2 EP ranks x 2 expert-DP ranks x 32 = 384 for 192 useful
    assert whole["padding_fraction"] == pytest.approx(1.0)


def test_expert_parallelism_lifts_the_whole_stack_bound_at_qwen3_30b_scale():
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.compare import compare

    x = compare("qwen3-30b-a3b", 128, cost_model=cost_model("muon"), cost="flops", ep=8).summary["expert_stacks"]
    assert x["ep"] == 8 and x["expert_dp"] == 16
    assert x["whole"]["flops_ratio"] < 1.05 and x["per_expert"]["flops_ratio"] < 1.05  # 2.1 at ep=1


def test_lpt_initial_loads_seed_the_ranks():
    from canzona_ds.planning.dp import plan_lpt
    from canzona_ds.planning.params import ParamSpec

    specs = [ParamSpec(f"m{i}", (4, 4)) for i in range(3)]
    assert plan_lpt(specs, 2, [1.0] * 3).rank_params == ((0, 2), (1,))
    seeded = plan_lpt(specs, 2, [1.0] * 3, initial=[2.5, 0.0])  # rank 0 already carries 2.5
    assert seeded.rank_params == ((), (0, 1, 2)) and seeded.rank_load == (0.0, 3.0)  # seeds not in the plan
    with pytest.raises(ValueError, match="initial has 1 loads for world_size=2"):
        plan_lpt(specs, 2, [1.0] * 3, initial=[0.0])


def test_joint_expert_parallel_plan_is_planner_only_and_absorbs_the_dense_remainder():
    """The seeded joint plan (planner only) against the runtime's separate plans: by hand at dp 4,
    ep 2 (a big dense matrix shares expert-DP rank 0 with a small one: the joint plan gives that
    expert-DP rank fewer experts), and DeepSeek-V2-Lite at DP=128, EP 8 (1.27x -> ~1.02x)."""
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.compare import compare, plan_expert_parallel
    from canzona_ds.planning.cost import task_cost
    from canzona_ds.planning.params import ParamSpec

    muon = cost_model("muon")
    mats = [ParamSpec("big", (32, 32))] + [ParamSpec(f"d{i}", (8, 8)) for i in range(3)] + \
        [ParamSpec("experts.w", (8, 8, 8), num_experts=8)]
    sep = plan_expert_parallel(mats, 4, 2, "lpt", "flops", muon, per_expert=True)
    joint = plan_expert_parallel(mats, 4, 2, "lpt", "flops", muon, per_expert=True, joint=True)
    big, small, e = (task_cost(ParamSpec("x", sh), "flops", muon) for sh in ((32, 32), (8, 8), (8, 8)))
    assert sep["rank_flops"] == pytest.approx([big + 2 * e, small + 2 * e, small + 2 * e, small + 2 * e], rel=1e-12)
    assert max(joint["rank_flops"]) < max(sep["rank_flops"])
    assert sum(joint["rank_flops"]) == pytest.approx(sum(sep["rank_flops"]), rel=1e-12)  # same work, moved
    x = compare("deepseek-v2-lite", 128, cost_model=muon, cost="flops", ep=8).summary["expert_stacks"]
    assert x["joint"]["planner_only"] is True
    assert x["per_expert"]["flops_ratio"] > 1.2 and x["joint"]["flops_ratio"] < 1.05


def test_ep_is_validated_by_name():
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.compare import compare

    muon = cost_model("muon")
    with pytest.raises(ValueError, match=r"Invalid ep=3: it must divide the number of experts 128"):
        compare("qwen3-30b-a3b", 96, cost_model=muon, ep=3)
    with pytest.raises(ValueError, match=r"Invalid ep=16: it must divide dp=8"):
        compare("qwen3-30b-a3b", 8, cost_model=muon, ep=16)
    with pytest.raises(ValueError, match=r"Invalid ep=2: the model has no expert stacks"):
        compare("qwen3-0.6b", 8, cost_model=muon, ep=2)
    with pytest.raises(ValueError, match=r"Invalid ep=0"):
        compare("qwen3-30b-a3b", 8, cost_model=muon, ep=0)


def test_canzona_plan_ep_option(capsys):
    import json as _json

    from canzona_ds.cli.plan import main

    assert main(["--model", "deepseek-v2-lite", "--dp", "16", "--ep", "8", "--cost", "flops"]) == 0
    out = capsys.readouterr().out
    assert "ep=8 (experts over expert-DP groups of 2 ranks, dense over 16" in out and "stack of E/8" in out
    assert main(["--model", "deepseek-v2-lite", "--dp", "16", "--ep", "8", "--json"]) == 0
    x = _json.loads(capsys.readouterr().out)["expert_stacks"]
    assert x["ep"] == 8 and x["expert_dp"] == 2 and x["experts_per_stack"] == [64]
    assert main(["--model", "deepseek-v2-lite", "--dp", "16", "--ep", "3"]) == 2
    assert "Invalid ep=3: it must divide dp=16" in capsys.readouterr().err
    assert main(["--model", "deepseek-v2-lite", "--dp", "32", "--ep", "128"]) == 2
    assert "Invalid ep=128: it must divide dp=32" in capsys.readouterr().err
    assert main(["--model", "deepseek-v2-lite", "--dp", "256", "--ep", "128"]) == 2
    assert "Invalid ep=128: it must divide the number of experts 64" in capsys.readouterr().err

"""3-D expert stacks (transformers 5's Qwen3-MoE ``mlp.experts.gate_up_proj`` [E, 2I, H]) are never
silently flattened into one matrix: refused by name, and trainable with the experts on AdamW."""
from __future__ import annotations

import pytest
import torch

from canzona_ds.optim.config import CanzonaConfig
from canzona_ds.optim.optimizer import CanzonaOptimizer
from canzona_ds.planning.params import DEFAULT_EXCLUDE, expert_stack

transformers = pytest.importorskip("transformers")


def _tiny_qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def test_expert_stack_is_recognised_by_module_and_rank():
    assert expert_stack("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 32))
    assert not expert_stack("model.layers.0.mlp.gate.weight", (4, 32))  # the router: one matrix
    assert not expert_stack("conv.weight", (8, 3, 3, 3))  # a conv filter: flattened by the documented rule
    assert not expert_stack("deepspeed_moe.experts.deepspeed_experts.0.weight", (16, 8))  # one expert, 2-D


@pytest.mark.parametrize("opt_type", ["CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"])
def test_hf_moe_expert_stacks_are_refused_by_name(opt_type):
    model = _tiny_qwen3_moe()
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' \[4, 32, 32\]: 4 experts "
                                         r".*matrix_exclude"):
        CanzonaOptimizer(model.named_parameters(), CanzonaConfig.from_ds(opt_type, {}))


def test_hf_moe_trains_with_the_experts_on_adamw():
    model = _tiny_qwen3_moe()
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {"matrix_exclude": [*DEFAULT_EXCLUDE, "experts"]})
    opt = CanzonaOptimizer(model.named_parameters(), cfg)
    assert not any("experts" in n for n in opt.matrix_names) and "model.layers.0.mlp.gate.weight" in opt.matrix_names
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]

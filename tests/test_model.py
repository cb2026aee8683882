"""Qwen3-style decoder: shapes, causality, GQA, tied weights, parameter roles."""
import pytest
import torch

from canzona_ds.models.qwen3 import PRESETS, Qwen3Config, Qwen3ForCausalLM, build_model, preset
from canzona_ds.planning.params import default_is_matrix

#: one process, both sides of every comparison: every core (canzona_testkit/kernels.py solo_threads)
pytestmark = pytest.mark.solo

SMALL = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=32)


def test_shapes_and_loss():
    m = build_model(SMALL, seed=0)
    x = torch.randint(0, 256, (3, 17))
    logits, loss = m(x, x)
    assert logits.shape == (3, 17, 256)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # random init predicts roughly uniformly over 256 bytes
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert m(x)[1] is None


def test_causal_mask_future_tokens_do_not_leak():
    m = build_model(SMALL, seed=1).eval()
    x = torch.randint(0, 256, (2, 12))
    y = x.clone()
    y[:, 7:] = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        a, b = m(x)[0], m(y)[0]
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build_model(SMALL, seed=2).eval()
    mha_cfg = Qwen3Config(**{**SMALL.to_dict(), "num_kv_heads": SMALL.num_heads})
    mha = Qwen3ForCausalLM(mha_cfg).eval()
    group, d = SMALL.num_heads // SMALL.num_kv_heads, SMALL.head_dim
    sd = gqa.state_dict()
    for k in list(sd):
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            w = sd[k].view(SMALL.num_kv_heads, d, -1)
            sd[k] = w.repeat_interleave(group, dim=0).reshape(SMALL.num_heads * d, -1)
    mha.load_state_dict(sd)
    assert gqa.model.layers[0].self_attn.k_proj.weight.shape == (SMALL.num_kv_heads * d, SMALL.hidden_size)
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x)[0], mha(x)[0], rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_one_parameter():
    tied = build_model(Qwen3Config(**{**SMALL.to_dict(), "tie_word_embeddings": True}), seed=0)
    untied = build_model(SMALL, seed=0)
    assert tied.lm_head is None and tied.output_weight() is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert untied.num_parameters() - tied.num_parameters() == SMALL.vocab_size * SMALL.hidden_size
    # gradient from the output head reaches the shared embedding
    x = torch.randint(0, 256, (1, 5))
    tied(x, x)[1].backward()
    assert tied.model.embed_tokens.weight.grad is not None


def test_parameter_roles_follow_default_matrix_filter():
    m = build_model(SMALL, seed=0)
    roles = {n: default_is_matrix(n, tuple(p.shape)) for n, p in m.named_parameters()}
    assert not roles["model.embed_tokens.weight"] and not roles["lm_head.weight"]
    assert roles["model.layers.0.self_attn.q_proj.weight"] and roles["model.layers.1.mlp.down_proj.weight"]
    assert not roles["model.layers.0.self_attn.q_norm.weight"] and not roles["model.norm.weight"]
    assert sum(roles.values()) == SMALL.num_layers * 7  # q k v o gate up down


def test_same_seed_same_weights_and_presets():
    a, b = build_model(SMALL, seed=5), build_model(SMALL, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(build_model(SMALL, seed=6).model.embed_tokens.weight, a.model.embed_tokens.weight)
    assert {"tiny", "small", "medium", "qwen3-0.6b"} <= set(PRESETS)
    assert 0.5e6 < build_model(preset("tiny"), 0).num_parameters() < 2e6


@pytest.mark.parametrize("kwargs, match", [
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"head_dim": 7}, "head_dim"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_bad_model_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config(**{**SMALL.to_dict(), **kwargs})


def test_bad_preset_and_override():
    with pytest.raises(ValueError, match="preset"):
        preset("huge")
    with pytest.raises(ValueError, match="num_layer"):
        preset("tiny", num_layer=3)


def test_sequence_longer_than_rope_table():
    m = build_model(SMALL, seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.long))

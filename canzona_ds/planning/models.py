"""Megatron-style parameter lists of known models, for planning without building them.

Per decoder layer (names as in Megatron-Core), TP-local shapes for TP size t:

    self_attention.linear_qkv.weight   ((q + 2 kv) / t, hidden)   column-parallel, dim 0
    self_attention.linear_proj.weight  (hidden, q / t)             row-parallel, dim 1
    mlp.linear_fc1.weight              (fc1 / t, hidden)           column (gate+up fused)
    mlp.linear_fc2.weight              (hidden, ffn / t)           row-parallel
    input_layernorm / pre_mlp_layernorm (hidden,)  q_layernorm / k_layernorm (head_dim,)
    biases (GPT-2): column-parallel biases split, row-parallel biases replicated

    embedding.word_embeddings.weight   (padded_vocab / t, hidden)  vocab-parallel, aux
    embedding.position_embeddings      (max_positions, hidden)     learned positions only
    decoder.final_layernorm            (hidden,)
    output_layer.weight                (padded_vocab / t, hidden)  aux; absent when tied

``padded_vocab`` follows Megatron's ``_vocab_size_with_padding``: the vocabulary is
rounded up to a multiple of ``make_vocab_size_divisible_by (128) * t``.

Mixture-of-experts layers (``num_experts`` > 0; Qwen3-MoE, DeepSeek-V2), at t = 1::

    mlp.router.weight                  (E, hidden)                 the router: one matrix
    mlp.experts.linear_fc1             (E, 2 moe_ffn, hidden)      a stack of E experts
    mlp.experts.linear_fc2             (E, hidden, moe_ffn)        (ParamSpec.num_experts = E)
    mlp.shared_experts.linear_fc1.weight (2 shared_ffn, hidden)    DeepSeek's shared experts
    mlp.shared_experts.linear_fc2.weight (hidden, shared_ffn)

the first ``first_k_dense`` layers keep the dense MLP.  Multi-head latent attention
(``kv_lora_rank`` > 0, DeepSeek-V2 without q compression)::

    self_attention.linear_q_proj.weight       (heads (nope + rope), hidden)
    self_attention.linear_kv_down_proj.weight (kv_lora + rope, hidden)
    self_attention.kv_layernorm.weight        (kv_lora,)
    self_attention.linear_kv_up_proj.weight   (heads (nope + v), kv_lora)
    self_attention.linear_proj.weight         (hidden, heads v)

Expert (EP) and tensor parallelism of these models are not modelled here: t must be 1.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from .params import ParamSpec

MODELS_YAML = Path(__file__).resolve().parents[2] / "configs" / "models.yaml"
VOCAB_DIVISIBLE_BY = 128
GATED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "deepseek_v2")


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the parameter list depends on."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool
    gated_mlp: bool
    #: "rmsnorm" (weight only) or "layernorm" (weight + bias)
    norm: str = "rmsnorm"
    attention_bias: bool = False
    linear_bias: bool = False
    #: learned absolute position embeddings of this many positions (0: none, e.g. RoPE)
    learned_positions: int = 0
    #: routed experts per MoE layer (0: a dense model)
    num_experts: int = 0
    #: one routed expert's FFN width
    moe_intermediate_size: int = 0
    #: FFN width of the shared experts together (DeepSeek: n_shared_experts x moe_intermediate_size)
    shared_expert_intermediate_size: int = 0
    #: the first layers that keep a dense MLP (DeepSeek's first_k_dense_replace)
    first_k_dense: int = 0
    #: multi-head latent attention (DeepSeek-V2): compressed KV rank (0: plain attention)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


def load_models(path: Path | str = MODELS_YAML) -> dict[str, dict]:
    with open(path) as f:
        return yaml.safe_load(f)


def known_models(path: Path | str = MODELS_YAML) -> list[str]:
    return list(load_models(path))


def _from_entry(name: str, cfg: dict) -> ModelShape:
    learned = cfg.get("position_embedding") == "learned_absolute"
    return ModelShape(
        name=name,
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=bool(cfg.get("qk_norm", False)),
        gated_mlp=bool(cfg.get("gated_mlp", True)),
        norm=str(cfg.get("norm", "rmsnorm")),
        attention_bias=bool(cfg.get("attention_bias", False)),
        linear_bias=bool(cfg.get("linear_bias", False)),
        learned_positions=int(cfg.get("max_position_embeddings", 0)) if learned else 0,
        num_experts=int(cfg.get("num_experts") or cfg.get("n_routed_experts") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size")
                                            or (cfg.get("n_shared_experts") or 0) * (cfg.get("moe_intermediate_size") or 0)),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
    )


def _from_hf_config(path: Path) -> ModelShape:
    """An HF ``config.json`` (Qwen2/3, Llama, Mistral, GPT-2 field names)."""
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type", "")
    if model_type == "gpt2":
        hidden = cfg["n_embd"]
        return ModelShape(
            name=str(path), hidden_size=hidden, intermediate_size=cfg.get("n_inner") or 4 * hidden,
            num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
            num_key_value_heads=cfg["n_head"], head_dim=hidden // cfg["n_head"], vocab_size=cfg["vocab_size"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", True), qk_norm=False, gated_mlp=False,
            norm="layernorm", attention_bias=True, linear_bias=True, learned_positions=cfg["n_positions"],
        )
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config.json lacks {missing} (model_type={model_type!r}); cannot build shapes")
    entry = dict(cfg)
    entry["qk_norm"] = model_type.startswith("qwen3")
    if cfg.get("q_lora_rank"):
        raise ValueError(f"{path}: q_lora_rank={cfg['q_lora_rank']} (compressed queries, DeepSeek-V2/V3 full size) is "
                         "not modelled; only q_lora_rank null (DeepSeek-V2-Lite) is.")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{path}: MoE layers interleaved with dense ones (mlp_only_layers, decoder_sparse_step or "
                         "moe_layer_freq) are not modelled; every layer from first_k_dense_replace on is MoE here.")
    entry["gated_mlp"] = model_type in GATED_MODEL_TYPES or cfg.get("hidden_act") == "silu"
    entry["attention_bias"] = cfg.get("attention_bias", model_type == "qwen2")
    entry.setdefault("tie_word_embeddings", False)
    return _from_entry(str(path), entry)


def model_shape(name_or_path: str | Path) -> ModelShape:
    """A name from ``configs/models.yaml`` or a path to an HF-style ``config.json``."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"Model config file {str(path)!r} does not exist.")
        return _from_hf_config(path)
    models = load_models()
    key = str(name_or_path).lower()
    if key not in models:
        raise ValueError(f"Unknown model={str(name_or_path)!r}. Known: {list(models)} (or pass a config.json path)")
    return _from_entry(key, models[key])


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _split(value: int, tp: int, what: str, name: str) -> int:
    if value % tp:
        raise ValueError(f"Invalid tp={tp} for {name}: {what}={value} is not divisible by it.")
    return value // tp


def model_specs(name_or_path: str | Path, tp: int = 1, pad_vocab: bool = True) -> list[ParamSpec]:
    """TP-local ParamSpecs of one TP rank, in Megatron's parameter order.

    ``pad_vocab=False`` keeps the raw vocabulary (to compare with published parameter
    counts); Megatron pads it.  Matrices are role "matrix"; embeddings, output head,
    norms and biases are "aux".
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"Invalid tp={tp!r}. Must be an int >= 1.")
    m = model_shape(name_or_path)
    if (m.num_experts or m.kv_lora_rank) and tp != 1:
        raise ValueError(f"Invalid tp={tp} for {m.name}: mixture-of-experts and latent-attention models are "
                         "planned at tp=1 (expert and tensor parallelism of their layers are not modelled).")
    h, hd = m.hidden_size, m.head_dim
    q_out = m.num_attention_heads * hd
    kv_out = m.num_key_value_heads * hd
    _split(m.num_attention_heads, tp, "num_attention_heads", m.name)
    _split(m.num_key_value_heads, tp, "num_key_value_heads", m.name)
    ffn = _split(m.intermediate_size, tp, "intermediate_size", m.name)
    qkv_local = (q_out + 2 * kv_out) // tp
    fc1_local = ffn * (2 if m.gated_mlp else 1)
    vocab = padded_vocab(m.vocab_size, tp) if pad_vocab else m.vocab_size
    vocab_local = _split(vocab, tp, "vocab_size", m.name)
    col = dict(tp_partition_dim=0, tp_size=tp)
    row = dict(tp_partition_dim=1, tp_size=tp)

    def norm(prefix: str, size: int) -> list[ParamSpec]:
        out = [ParamSpec(f"{prefix}.weight", (size,), "aux")]
        if m.norm == "layernorm":
            out.append(ParamSpec(f"{prefix}.bias", (size,), "aux"))
        return out

    specs = [ParamSpec("embedding.word_embeddings.weight", (vocab_local, h), "aux", **col)]
    if m.learned_positions:
        specs.append(ParamSpec("embedding.position_embeddings.weight", (m.learned_positions, h), "aux"))
    for i in range(m.num_hidden_layers):
        p = f"decoder.layers.{i}"
        specs += norm(f"{p}.input_layernorm", h)
        if m.kv_lora_rank:
            specs += _mla_specs(m, p)
            specs += norm(f"{p}.pre_mlp_layernorm", h)
            specs += _mlp_specs(m, p, i, ffn)
            continue
        specs.append(ParamSpec(f"{p}.self_attention.linear_qkv.weight", (qkv_local, h), "matrix", **col))
        if m.attention_bias:
            specs.append(ParamSpec(f"{p}.self_attention.linear_qkv.bias", (qkv_local,), "aux", **col))
        if m.qk_norm:
            specs.append(ParamSpec(f"{p}.self_attention.q_layernorm.weight", (hd,), "aux"))
            specs.append(ParamSpec(f"{p}.self_attention.k_layernorm.weight", (hd,), "aux"))
        specs.append(ParamSpec(f"{p}.self_attention.linear_proj.weight", (h, q_out // tp), "matrix", **row))
        if m.linear_bias:
            specs.append(ParamSpec(f"{p}.self_attention.linear_proj.bias", (h,), "aux"))
        specs += norm(f"{p}.pre_mlp_layernorm", h)
        if m.num_experts and i >= m.first_k_dense:
            specs += _mlp_specs(m, p, i, ffn)
            continue
        specs.append(ParamSpec(f"{p}.mlp.linear_fc1.weight", (fc1_local, h), "matrix", **col))
        if m.linear_bias:
            specs.append(ParamSpec(f"{p}.mlp.linear_fc1.bias", (fc1_local,), "aux", **col))
        specs.append(ParamSpec(f"{p}.mlp.linear_fc2.weight", (h, ffn), "matrix", **row))
        if m.linear_bias:
            specs.append(ParamSpec(f"{p}.mlp.linear_fc2.bias", (h,), "aux"))
    specs += norm("decoder.final_layernorm", h)
    if not m.tie_word_embeddings:
        specs.append(ParamSpec("output_layer.weight", (vocab_local, h), "aux", **col))
    return specs


def _mla_specs(m: ModelShape, p: str) -> list[ParamSpec]:
    """Multi-head latent attention without query compression (DeepSeek-V2-Lite), tp=1."""
    heads, h = m.num_attention_heads, m.hidden_size
    rope, nope, v, rank = m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    return [ParamSpec(f"{p}.self_attention.linear_q_proj.weight", (heads * (nope + rope), h), "matrix"),
            ParamSpec(f"{p}.self_attention.linear_kv_down_proj.weight", (rank + rope, h), "matrix"),
            ParamSpec(f"{p}.self_attention.kv_layernorm.weight", (rank,), "aux"),
            ParamSpec(f"{p}.self_attention.linear_kv_up_proj.weight", (heads * (nope + v), rank), "matrix"),
            ParamSpec(f"{p}.self_attention.linear_proj.weight", (h, heads * v), "matrix")]


def _mlp_specs(m: ModelShape, p: str, layer: int, ffn: int) -> list[ParamSpec]:
    """Layer ``layer``'s MLP at tp=1: dense, or the router, the expert stacks and the shared experts."""
    h, up = m.hidden_size, 2 if m.gated_mlp else 1
    if not m.num_experts or layer < m.first_k_dense:
        return [ParamSpec(f"{p}.mlp.linear_fc1.weight", (up * ffn, h), "matrix"),
                ParamSpec(f"{p}.mlp.linear_fc2.weight", (h, ffn), "matrix")]
    e, moe = m.num_experts, m.moe_intermediate_size
    out = [ParamSpec(f"{p}.mlp.router.weight", (e, h), "matrix"),
           ParamSpec(f"{p}.mlp.experts.linear_fc1", (e, up * moe, h), "matrix", num_experts=e),
           ParamSpec(f"{p}.mlp.experts.linear_fc2", (e, h, moe), "matrix", num_experts=e)]
    shared = m.shared_expert_intermediate_size
    if shared:
        out += [ParamSpec(f"{p}.mlp.shared_experts.linear_fc1.weight", (up * shared, h), "matrix"),
                ParamSpec(f"{p}.mlp.shared_experts.linear_fc2.weight", (h, shared), "matrix")]
    return out


def matrix_specs(specs: list[ParamSpec]) -> list[ParamSpec]:
    return [s for s in specs if s.is_matrix]


def pipeline_stage(specs: list[ParamSpec], pp: int, stage: int) -> list[ParamSpec]:
    """The parameters of pipeline stage ``stage`` of ``pp`` under Megatron's even split:
    decoder layers ``[stage*L/pp, (stage+1)*L/pp)`` (``decoder.layers.<i>.``), the
    embedding on the first stage, the final norm and the output layer on the last.
    ``pp`` must divide the number of layers."""
    for name, v in (("pp", pp), ("stage", stage)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"Invalid {name}={v!r}. Must be an int.")
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"Invalid pp={pp}, stage={stage}: need pp >= 1 and 0 <= stage < pp.")
    layers = sorted({int(s.name.split(".")[2]) for s in specs if s.name.startswith("decoder.layers.")})
    n = len(layers)
    if n % pp:
        raise ValueError(f"Invalid pp={pp}: the model's {n} layers do not split evenly into {pp} stages.")
    lo, hi = stage * n // pp, (stage + 1) * n // pp
    out = []
    for s in specs:
        if s.name.startswith("decoder.layers."):
            keep = lo <= int(s.name.split(".")[2]) < hi
        elif s.name.startswith("embedding."):
            keep = stage == 0
        else:  # final norm, output layer
            keep = stage == pp - 1
        if keep:
            out.append(s)
    return out

"""A Qwen3-architecture decoder in plain torch (no transformers dependency).

    tokens -> embed_tokens -> N x [ x + Attn(RMSNorm(x)),  x + SwiGLU(RMSNorm(x)) ] -> norm -> lm_head

    Attn:  q = q_norm(Wq x) per head, k = k_norm(Wk x) per head   (Qwen3's per-head RMSNorm;
           qk_norm=false: q = Wq x, k = Wk x, Llama-style -- what MuonClip's QK-clip needs)
           RoPE on q, k;  GQA: num_heads query heads share num_kv_heads k/v heads
           causal softmax attention, output o_proj
    SwiGLU: down_proj(silu(gate_proj x) * up_proj x)

Parameter names follow Hugging Face's ``Qwen3ForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...), so the default matrix
filter (``canzona_ds.planning.params.default_is_matrix`` and DeepSpeed's
``set_optimizer_flags``) sends the 2-D projections to Muon and the embedding / head / norm
weights to AdamW.  With ``tie_word_embeddings`` the head reuses ``embed_tokens.weight`` and
there is no ``lm_head.weight`` parameter.  No biases (Qwen3 has none).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Qwen3Config:
    """Model shape.  Every field is validated at construction."""

    #: token ids are in [0, vocab_size); the byte tokenizer needs >= 256
    vocab_size: int = 256
    #: width of the residual stream
    hidden_size: int = 128
    #: width of the SwiGLU hidden layer
    intermediate_size: int = 384
    num_layers: int = 4
    #: query heads
    num_heads: int = 4
    #: key/value heads (GQA); must divide num_heads
    num_kv_heads: int = 2
    #: per-head width (Qwen3 decouples it from hidden_size / num_heads)
    head_dim: int = 32
    #: longest sequence RoPE tables are built for
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    #: share embed_tokens.weight with the output head
    tie_word_embeddings: bool = False
    #: std of the normal init of every weight matrix
    init_std: float = 0.02
    #: Qwen3's per-head RMSNorm of q and k (q_norm/k_norm); false: Llama-style attention without
    #: it, whose logits the q/k projections control (optimizer.params.qk_clip needs that)
    qk_norm: bool = True

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Invalid {f}={v!r}. Must be an int >= 1.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Invalid num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads} (GQA).")
        if self.head_dim % 2:
            raise ValueError(f"Invalid head_dim={self.head_dim}. Must be even (RoPE rotates pairs).")
        for f in ("tie_word_embeddings", "qk_norm"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"Invalid {f}={getattr(self, f)!r}. Must be a bool.")
        for f in ("rope_theta", "rms_norm_eps", "init_std"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Invalid {f}={v!r}. Must be a number > 0.")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


#: named shapes; "tiny" trains visibly in minutes on 2 CPU ranks
PRESETS: dict[str, Qwen3Config] = {
    # ~0.62 M params: 3 layers x (4 q heads, 2 kv heads, head_dim 32), SwiGLU 352 (~8/3 x
    # hidden, as in real models).  Chosen so that at DP=2 DeepSpeed's equal chunks split a
    # matrix (layers.1.mlp.gate_proj, orthogonalised on both ranks: busiest rank 0.970 NS
    # GFLOP/step) while the Canzona plan keeps every matrix whole (busiest 0.849, 0.74%
    # padding): the default run shows the difference.  With power-of-two widths and an even layer count the cut would
    # land on a layer boundary and both layouts would coincide.
    "tiny": Qwen3Config(num_layers=3, intermediate_size=352),
    # ~4.9 M params
    "small": Qwen3Config(hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8,
                         num_kv_heads=4, head_dim=32),
    # ~25 M params
    "medium": Qwen3Config(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                          num_kv_heads=4, head_dim=64, max_seq_len=1024),
    # the shapes of Qwen3-0.6B (vocab kept: bytes use ids < 256); for GPU runs / planning
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              max_seq_len=4096, rope_theta=1_000_000.0, tie_word_embeddings=True),
}


def preset(name: str, **overrides) -> Qwen3Config:
    """A preset, with fields overridden (unknown fields are an error)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset={name!r}. Allowed: {sorted(PRESETS)}")
    unknown = sorted(set(overrides) - set(Qwen3Config.field_names()))
    if unknown:
        raise ValueError(f"Unknown model override key(s) {unknown}. Allowed: {list(Qwen3Config.field_names())}")
    return Qwen3Config(**{**PRESETS[name].to_dict(), **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim), HF "rotate_half" layout
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        #: the softmax scale SDPA applies by default (its logits are (q . k) * scaling)
        self.scaling = self.head_dim ** -0.5
        #: QK-clip's recorder of this layer's per-head max logit (optim/qk_clip.AttentionLayer;
        #: set by models/qk_record.attach when optimizer.params.qk_clip is on; training forwards only)
        self.qk_observer = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.qk_observer is not None and self.training:
            self.qk_observer.observe(q, k, self.scaling, causal=True)
        # GQA: each kv head serves num_heads // num_kv_heads consecutive query heads
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # buffers, not parameters: never seen by an optimizer, not saved in checkpoints
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        if T > self.rope_cos.shape[0]:
            raise ValueError(f"Sequence length {T} exceeds max_seq_len={self.rope_cos.shape[0]}")
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    """``forward(input_ids, labels=None) -> (logits, loss or None)``.

    ``labels`` are already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``),
    which is what :class:`canzona_ds.data.BatchSampler` yields.
    """

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, mean=0.0, std=std)
            else:
                nn.init.ones_(p)  # RMSNorm gains

    def output_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h = self.model(input_ids)
        logits = F.linear(h, self.output_weight())
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    """Same seed -> bit-identical initial weights on every rank and in every run."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(cfg)


def approx_flops_per_token(cfg: Qwen3Config, seq_len: int) -> float:
    """Training FLOPs per token: 6 * matmul params + attention score/value products."""
    n = cfg.num_layers * (cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
                          + 3 * cfg.hidden_size * cfg.intermediate_size) + cfg.hidden_size * cfg.vocab_size
    attn = cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * seq_len  # causal: ~half of 4*T*d
    return 6.0 * n + 3.0 * attn


__all__ = ["PRESETS", "Qwen3Config", "Qwen3ForCausalLM", "approx_flops_per_token", "build_model", "preset"]

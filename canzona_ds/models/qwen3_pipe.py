"""The Qwen3 decoder of :mod:`canzona_ds.models.qwen3` as a DeepSpeed ``PipelineModule``.

Layers (index = DeepSpeed's layer index; L = ``cfg.num_layers``)::

    0        EmbeddingPipe     embed_tokens             (TiedLayerSpec "embed" when tie_word_embeddings)
    1..L     DecoderLayerPipe  the plain DecoderLayer, with its own RoPE tables
    L+1      NormPipe          the final RMSNorm
    L+2      LMHeadPipe        lm_head                  (tied: the layer-0 module, F.linear(h, W_embed))
    loss_fn  qwen3_loss        cross entropy in fp32, as Qwen3ForCausalLM computes it

A stage's parameter names and the plain model's (``build_model``), :func:`canonical_name`::

    "0.embed_tokens.weight"                     "model.embed_tokens.weight"
    "tied_modules.embed.embed_tokens.weight"    "model.embed_tokens.weight"  (first AND last stage)
    "3.self_attn.q_proj.weight"                 "model.layers.2.self_attn.q_proj.weight"
    "{L+1}.weight"                              "model.norm.weight"
    "{L+2}.lm_head.weight"                      "lm_head.weight"

Stage names keep ``embed_tokens``/``lm_head``, so name-based matrix filters give a parameter the
same role under both names.

Initial values equal ``build_model(cfg, seed)``'s bit for bit: :func:`qwen3_initial_values`
replays build_model's random stream (every default init, then ``reset_parameters``'s normal
draws, in construction / ``named_parameters`` order) into scratch tensors and keeps only the
values a stage holds, so a stage never materialises the whole model.  :class:`Qwen3Pipe` replays
once per stage; a layer built on its own (outside Qwen3Pipe) replays for itself.

The main job trains it when the run config sets ``pp`` > 1 (``canzona_ds/train/trainer.py``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import Tensor, nn

from .qwen3 import DecoderLayer, Qwen3Config, RMSNorm, rope_tables

TIE_KEY = "embed"


def _param_shapes(cfg: Qwen3Config) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of Qwen3ForCausalLM, in ``named_parameters`` order."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out = [("model.embed_tokens.weight", (cfg.vocab_size, H))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (cfg.num_heads * hd, H)),
                (p + "self_attn.k_proj.weight", (cfg.num_kv_heads * hd, H)),
                (p + "self_attn.v_proj.weight", (cfg.num_kv_heads * hd, H)),
                (p + "self_attn.o_proj.weight", (H, cfg.num_heads * hd))]
        if cfg.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out += [(p + "post_attention_layernorm.weight", (H,)),
                (p + "mlp.gate_proj.weight", (I, H)),
                (p + "mlp.up_proj.weight", (I, H)),
                (p + "mlp.down_proj.weight", (H, I))]
    out.append(("model.norm.weight", (H,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, H)))
    return out


def qwen3_initial_values(cfg: Qwen3Config, seed: int, keep: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """``build_model(cfg, seed)``'s initial parameters (names as there) for which ``keep(name)``
    (all when None), without building the model: the same random draws in the same order.

    build_model seeds, constructs (nn.Embedding: ``normal_``; each bias-free nn.Linear:
    ``kaiming_uniform_`` = one ``uniform_``; RMSNorm: ones) and then ``reset_parameters`` draws
    ``normal_(0, init_std)`` for every >= 2-D parameter.  A draw's consumption of the generator
    depends only on the tensor's size, so drawing into a scratch tensor of the same shape
    advances it identically."""
    keep = keep or (lambda name: True)
    shapes = _param_shapes(cfg)
    out: dict[str, Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # construction: default initialisers, in module construction order
        for name, shape in shapes:
            if len(shape) < 2:
                if keep(name):
                    out[name] = torch.ones(shape)
                continue
            t = torch.empty(shape)
            if name == "model.embed_tokens.weight":
                nn.init.normal_(t)
            else:
                nn.init.kaiming_uniform_(t, a=5 ** 0.5)
        # reset_parameters: normal_(0, std) over named_parameters with ndim >= 2
        for name, shape in shapes:
            if len(shape) >= 2:
                t = torch.empty(shape)
                nn.init.normal_(t, mean=0.0, std=cfg.init_std)
                if keep(name):
                    out[name] = t
    return out


class InitialValues:
    """The initial values for the layers of one stage, drawn once (:meth:`prepare`) and handed to
    the layers as they are built (:meth:`load`)."""

    def __init__(self, cfg: Qwen3Config, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self._values: dict[str, Tensor] = {}
        self._skip = False

    def prepare(self, prefixes: Iterable[str]) -> None:
        prefixes = tuple(prefixes)
        self._values = qwen3_initial_values(self.cfg, self.seed, lambda n: n.startswith(prefixes))

    def clear(self) -> None:
        self._values = {}

    @contextlib.contextmanager
    def skipped(self):
        """Layers built meanwhile keep arbitrary values (PipelineModule builds every layer once
        just to count its parameters)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    @torch.no_grad()
    def load(self, module: nn.Module, prefix: str) -> None:
        """Copy the values named ``prefix + local name`` into ``module``'s parameters."""
        if self._skip:
            return
        names = {prefix + n for n, _ in module.named_parameters()}
        if not names <= set(self._values):
            self._values.update(qwen3_initial_values(self.cfg, self.seed, names.__contains__))
        for n, p in module.named_parameters():
            p.copy_(self._values[prefix + n])


class EmbeddingPipe(nn.Module):
    def __init__(self, cfg: Qwen3Config, init: InitialValues) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG where it was
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        init.load(self, "model.")

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)


def tied_lm_head(embedding: EmbeddingPipe, h: Tensor) -> Tensor:
    """The last stage's use of the tied embedding, as Qwen3ForCausalLM.output_weight()."""
    return F.linear(h, embedding.embed_tokens.weight)


class DecoderLayerPipe(DecoderLayer):
    """The plain DecoderLayer; RoPE tables are per layer (non-persistent buffers) because a stage
    receives only the hidden states."""

    def __init__(self, cfg: Qwen3Config, index: int, init: InitialValues) -> None:
        with torch.random.fork_rng(devices=[]):
            super().__init__(cfg)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init.load(self, f"model.layers.{index}.")

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        T = x.shape[1]
        if T > self.rope_cos.shape[0]:
            raise ValueError(f"Sequence length {T} exceeds max_seq_len={self.rope_cos.shape[0]}")
        return super().forward(x, self.rope_cos[:T], self.rope_sin[:T])


class NormPipe(RMSNorm):
    def __init__(self, cfg: Qwen3Config, init: InitialValues) -> None:
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps)
        init.load(self, "model.norm.")


class LMHeadPipe(nn.Module):
    def __init__(self, cfg: Qwen3Config, init: InitialValues) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        init.load(self, "")

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(h, self.lm_head.weight)


def qwen3_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Qwen3ForCausalLM's loss (labels already shifted)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


def qwen3_layer_specs(cfg: Qwen3Config, seed: int, init: InitialValues | None = None) -> list:
    """The LayerSpecs of the decoder (see the module docstring)."""
    init = InitialValues(cfg, seed) if init is None else init
    tie = ["embed_tokens.weight"]
    if cfg.tie_word_embeddings:
        embed = TiedLayerSpec(TIE_KEY, EmbeddingPipe, cfg, init, tied_weight_attr=tie)
        head = TiedLayerSpec(TIE_KEY, EmbeddingPipe, cfg, init, forward_fn=tied_lm_head, tied_weight_attr=tie)
    else:
        embed, head = LayerSpec(EmbeddingPipe, cfg, init), LayerSpec(LMHeadPipe, cfg, init)
    layers = [LayerSpec(DecoderLayerPipe, cfg, i, init) for i in range(cfg.num_layers)]
    return [embed, *layers, LayerSpec(NormPipe, cfg, init), head]


def canonical_name(cfg: Qwen3Config, stage_name: str) -> str:
    """A stage's parameter name -> the plain model's (``build_model``) name."""
    tied_prefix = f"tied_modules.{TIE_KEY}."
    if stage_name.startswith(tied_prefix):
        return "model." + stage_name[len(tied_prefix):]
    index, rest = stage_name.split(".", 1)
    i = int(index)
    if i == 0:
        return "model." + rest
    if i <= cfg.num_layers:
        return f"model.layers.{i - 1}.{rest}"
    if i == cfg.num_layers + 1:
        return "model.norm." + rest
    if i == cfg.num_layers + 2:
        return rest
    raise ValueError(f"Invalid stage parameter name {stage_name!r} for {cfg.num_layers} layers.")


def _layer_prefixes(cfg: Qwen3Config, index: int) -> tuple[str, ...]:
    if index == 0 or (index == cfg.num_layers + 2 and cfg.tie_word_embeddings):
        return ("model.embed_tokens.",)
    if index <= cfg.num_layers:
        return (f"model.layers.{index - 1}.",)
    return ("model.norm.",) if index == cfg.num_layers + 1 else ("lm_head.",)


class Qwen3Pipe(PipelineModule):
    """``Qwen3Pipe(cfg, seed, num_stages=..., **PipelineModule kwargs)``: the decoder as a
    PipelineModule whose stages hold exactly build_model(cfg, seed)'s values (needs deepspeed.comm
    initialised, like any PipelineModule).  ``partition_method`` defaults to balancing decoder
    layers ("type:DecoderLayerPipe": the embedding goes with the first, norm and head with the
    last)."""

    def __init__(self, cfg: Qwen3Config, seed: int, partition_method: str = "type:DecoderLayerPipe",
                 **kwargs) -> None:
        self.qwen3_config = cfg
        self._init = InitialValues(cfg, seed)
        super().__init__(layers=qwen3_layer_specs(cfg, seed, self._init), loss_fn=qwen3_loss,
                         partition_method=partition_method, **kwargs)

    def _count_layer_params(self):
        with self._init.skipped():  # counting builds every layer; its values are thrown away
            return super()._count_layer_params()

    def _build(self):
        # one replay of the random stream for every layer this stage builds
        self._init.prepare(p for i in range(self._local_start, self._local_stop)
                           for p in _layer_prefixes(self.qwen3_config, i))
        try:
            super()._build()
        finally:
            self._init.clear()

    def canonical_names(self) -> dict[str, str]:
        """This stage's parameter names -> build_model's names."""
        return {n: canonical_name(self.qwen3_config, n) for n, _ in self.named_parameters()}


__all__ = ["DecoderLayerPipe", "EmbeddingPipe", "InitialValues", "LMHeadPipe", "NormPipe", "Qwen3Pipe",
           "canonical_name", "qwen3_initial_values", "qwen3_layer_specs", "qwen3_loss", "tied_lm_head"]

"""Where QK-clip's logits come from: the attention layers of a model, found and instrumented.

:func:`attach` walks a module tree and, for every attention layer it recognises, returns an
:class:`~canzona_ds.optim.qk_clip.AttentionLayer` (its q/k parameter names and head counts) and
makes the layer's training forward call ``layer.observe(q, k, scale, mask)`` with q and k as the
model computed them (after rotary embeddings)::

    the project's model (models/qwen3.Attention)      its forward calls ``qk_observer.observe``
    transformers attention (LlamaAttention and the     ``config._attn_implementation`` switched to
    Llama-style ones: q_proj/k_proj, ``config``)       "canzona_qk_record|eager" / "...|sdpa": the model's
                                                       own function (same output, bit for bit), then
                                                       the block-wise max (optim/qk_clip.max_logits)

Models with QK-norm (Qwen3's per-head ``q_norm``/``k_norm``, ``qk_layernorm``) are refused by
name: a norm after the projection makes the logit independent of W_q/W_k's scale, so scaling
their rows would do nothing.  Evaluation forwards (``module.training`` false) record nothing.
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

from ..optim.qk_clip import AttentionLayer

#: prefix of the attention implementations this module registers with transformers
RECORD_IMPL = "canzona_qk_record"
#: the transformers attention implementations the recorder wraps (their output is returned as is)
WRAPPABLE = ("eager", "sdpa")
_QK_NORM_ATTRS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "qk_norm")


def attach(modules: Iterable[tuple[nn.Module, str]]) -> list[AttentionLayer]:
    """The attention layers of each (module, name prefix of its parameters) and their recorders.

    Raises ValueError naming the first layer with QK-norm, or an HF attention implementation
    that cannot be wrapped."""
    layers: list[AttentionLayer] = []
    for root, prefix in modules:
        for mod_name, mod in root.named_modules():
            if not (_is_projection(getattr(mod, "q_proj", None)) and _is_projection(getattr(mod, "k_proj", None))):
                continue
            where = ".".join(x for x in (prefix.rstrip("."), mod_name) if x)
            norm = next((a for a in _QK_NORM_ATTRS if isinstance(getattr(mod, a, None), nn.Module)), None)
            if norm is not None:
                raise ValueError(f"qk_clip: attention layer {where!r} has QK-norm ({norm}): its logits do not scale "
                                 "with W_q/W_k, so QK-clip cannot cap them through those rows. Remove qk_clip, or use "
                                 "a model without QK-norm (the project's model: model_overrides qk_norm: false).")
            ours = hasattr(mod, "qk_observer")  # the project's model
            if not ours and not hasattr(getattr(mod, "config", None), "_attn_implementation"):
                raise ValueError(f"qk_clip: attention layer {where!r} ({type(mod).__name__}) is neither the project's "
                                 "Attention nor a transformers attention module (config._attn_implementation): its "
                                 "logits cannot be recorded.")
            layer = _layer_of(mod, where)
            if ours:
                mod.qk_observer = layer
            else:
                _wrap_hf(mod, where)
                mod._canzona_qk_layer = layer
            layers.append(layer)
    return layers


def _is_projection(m) -> bool:
    """A linear projection: ``nn.Linear``, or a tensor-parallel one (Megatron's column-parallel
    linear, DeepSpeed AutoTP's ``LinearLayer``) holding a 2-D ``weight``."""
    w = getattr(m, "weight", None)
    return isinstance(m, nn.Module) and isinstance(w, nn.Parameter) and len(_rows_cols(w)) == 2


def _rows_cols(w) -> tuple[int, ...]:
    return tuple(getattr(w, "ds_shape", None) or w.shape)  # (ZeRO-3: the partitioned parameter's shape)


def _layer_of(mod: nn.Module, where: str) -> AttentionLayer:
    head_dim = getattr(mod, "head_dim", None)
    if not head_dim:
        raise ValueError(f"qk_clip: attention layer {where!r} has q_proj/k_proj but no head_dim the recorder can "
                         "read.")
    # the heads this rank computes, from the rows it holds (under tensor parallelism: its own heads,
    # whatever the module's or its config's head counts say)
    q_rows, k_rows = _rows_cols(mod.q_proj.weight)[0], _rows_cols(mod.k_proj.weight)[0]
    if q_rows % head_dim or k_rows % head_dim or not k_rows or (q_rows // head_dim) % (k_rows // head_dim):
        raise ValueError(f"qk_clip: attention layer {where!r}: q_proj rows {q_rows} and k_proj rows {k_rows} are not "
                         f"whole heads of head_dim {head_dim} with key heads dividing query heads.")
    heads, kv = q_rows // head_dim, k_rows // head_dim
    if getattr(mod.q_proj, "bias", None) is not None or getattr(mod.k_proj, "bias", None) is not None:
        raise ValueError(f"qk_clip: attention layer {where!r} has q/k biases: scaling W_q/W_k rows alone would not "
                         "scale its logits (biases are not clipped here).")
    return AttentionLayer(f"{where}.q_proj.weight", f"{where}.k_proj.weight", int(heads), int(kv), int(head_dim))


def _wrap_hf(mod: nn.Module, where: str) -> None:
    cfg = mod.config
    impl = getattr(cfg, "_attn_implementation", None)
    if impl is None or impl.startswith(RECORD_IMPL):
        base = impl.split("|", 1)[1] if impl else "eager"
    else:
        base = impl
    if base not in WRAPPABLE:
        raise ValueError(f"qk_clip: attention layer {where!r} uses attn_implementation={impl!r}; the logit recorder "
                         f"wraps {list(WRAPPABLE)}. Load the model with attn_implementation='sdpa' or 'eager'.")
    register()
    cfg._attn_implementation = f"{RECORD_IMPL}|{base}"


_registered = False


def register() -> None:
    """Register ``canzona_qk_record|eager`` and ``canzona_qk_record|sdpa`` with transformers'
    attention and mask interfaces (idempotent): the mask is the base implementation's, the
    output the base function's own."""
    global _registered
    if _registered:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for base in WRAPPABLE:
        name = f"{RECORD_IMPL}|{base}"
        ALL_ATTENTION_FUNCTIONS.register(name, _recording(base))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    _registered = True


def _recording(base: str):
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if base == "eager":
            from importlib import import_module

            # the model's own eager function (each modeling file defines one; same math)
            fn = getattr(import_module(type(module).__module__), "eager_attention_forward")
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        out = fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layer = getattr(module, "_canzona_qk_layer", None)
        if layer is not None and module.training:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            # SDPA's own rule for when it attends causally without a mask
            causal = attention_mask is None and query.shape[2] > 1 and kwargs.get(
                "is_causal", getattr(module, "is_causal", True)) is not False
            k = key[:, :, :query.shape[2]] if causal and key.shape[2] > query.shape[2] else key
            layer.observe(query, k, scale, attention_mask, causal=causal)
        return out

    attention.__name__ = f"canzona_qk_record_{base}"
    return attention


__all__ = ["RECORD_IMPL", "WRAPPABLE", "attach", "register"]

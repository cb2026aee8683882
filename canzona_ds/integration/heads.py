"""``per_head_muon``: which attention projections are orthogonalised head by head.

DeepSpeed's own Muon decides this in ``deepspeed.set_optimizer_flags`` (only for its
``"Muon"`` type): a projection's leaf module name says what it claims to be (``q_proj``,
``k_proj``, ...), the model's ``config`` gives the candidate head geometries, and the
parameter's shape must confirm one; fused QKV and MLA down-projections stay whole.  To
mean exactly what DeepSpeed means, :func:`tag_heads` calls the same resolver (private
functions DeepSpeed added in 0.19.8, ``per_head_muon`` in ``ds_compat.FEATURES``: refused by name
on an older release) and sets the same attributes,
``muon_num_heads`` and ``muon_head_dim``.  With tensor parallelism the geometry is
resolved on the FULL matrix shape: the TP host orthogonalises the whole matrix, head by
head.  Like DeepSpeed, an explicit ``per_head_muon: true`` that tags nothing is an error.
"""
from __future__ import annotations

import torch


def tag_heads(module, named: list, tp_size: int = 1) -> dict[str, int]:
    """Tag attention projections of ``module`` (``named``: its trainable (name, param)s);
    returns name -> heads of the full matrix."""
    import deepspeed as ds

    from ..tp.runtime import TPMatrix

    meta, text_config = ds._per_head_muon_meta(module)
    owners = ds._owner_modules(module)
    tagged, skipped, out = {}, {}, {}
    for name, p in named:
        shape = tuple(ds._layer_shape(p))
        if len(shape) < 2 or meta is None:
            continue
        full = TPMatrix.from_param(name, p, tp_size).full_shape if TPMatrix.is_split(p, tp_size) else shape
        probe = torch.empty(full, device="meta")
        heads, reason = ds._resolve_attention_head_count(name, probe, meta, text_config, owners)
        leaf = ds._leaf_module_name(name)
        if heads is None:
            skipped[leaf] = reason
            p.muon_num_heads = None
            continue
        head_dim = full[0] // heads
        p.muon_head_dim = head_dim
        p.muon_num_heads = shape[0] // head_dim  # heads of this rank's shard, as DeepSpeed records them
        tagged[leaf] = f"{heads} heads of {head_dim}"
        out[name] = heads
    ds._report_per_head_tagging(tagged, skipped)
    return out

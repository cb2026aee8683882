"""A faithful, CPU-runnable stand-in for the Megatron pieces canzona_ds touches.

Megatron-DeepSpeed needs CUDA and is not on PyPI, so tests use this module instead.  It
reproduces what matters to the optimizer, with Megatron's names and semantics:

* ``mpu`` functions (megatron/core/parallel_state.py): ``initialize_model_parallel``,
  ``get_tensor_model_parallel_group/rank/world_size``, ``get_model_parallel_*``,
  ``get_data_parallel_group/rank/world_size``.  Rank layout as Megatron's with PP=1:
  TP groups are contiguous ranks ``[k*tp, (k+1)*tp)``, DP groups stride by ``tp``.
* ``set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride)`` sets
  ``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` exactly like
  megatron/core/tensor_parallel/layers.py.
* ``ColumnParallelLinear`` (weight split on dim 0), ``RowParallelLinear`` (dim 1),
  ``VocabParallelEmbedding`` (dim 0), with the usual copy/reduce autograd functions.
* ``TinyGPTBlock``: embedding, RMSNorm (replicated 1-D), fused QKV (per rank
  ``[q_r; k_r; v_r]``, GQA), attention output (row), fused SwiGLU fc1 (per rank
  ``[gate_r; up_r]``), fc2 (row) and one replicated (non-TP) 2-D matrix.  Built from a
  TP=1 state dict in the *normal* fused layout (``[q; k; v]``, ``[gate; up]``) with
  :func:`shard_state_dict`; :func:`unshard_state_dict` maps shards back.
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------- parallel_state (mpu)
_TP_GROUP = None
_DP_GROUP = None
_TP_SIZE = 1


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    """Megatron's group layout for PP=1: TP = contiguous ranks, DP = stride tp."""
    global _TP_GROUP, _DP_GROUP, _TP_SIZE
    world = dist.get_world_size()
    tp = tensor_model_parallel_size
    if tp < 1 or world % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide world_size={world}")
    rank = dist.get_rank()
    for k in range(world // tp):
        ranks = list(range(k * tp, (k + 1) * tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP = g
    for j in range(tp):
        ranks = list(range(j, world, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            _DP_GROUP = g
    _TP_SIZE = tp


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tensor_model_parallel_group():
    if _TP_GROUP is None:
        raise RuntimeError("tensor model parallel group is not initialized")
    return _TP_GROUP


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tensor_model_parallel_group()) if dist.is_initialized() else 1


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tensor_model_parallel_group()) if dist.is_initialized() else 0


def get_data_parallel_group():
    if _DP_GROUP is None:
        raise RuntimeError("data parallel group is not initialized")
    return _DP_GROUP


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(get_data_parallel_group())


# Megatron-DeepSpeed's older names (DeepSpeed's utils/bwc.py tries both)
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank


class _MPU:
    """``mpu`` as a namespace object (what Megatron-DeepSpeed passes to deepspeed.initialize)."""

    initialize_model_parallel = staticmethod(initialize_model_parallel)
    get_tensor_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_tensor_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_model_parallel_group = staticmethod(get_model_parallel_group)
    get_model_parallel_world_size = staticmethod(get_model_parallel_world_size)
    get_model_parallel_rank = staticmethod(get_model_parallel_rank)
    get_data_parallel_group = staticmethod(get_data_parallel_group)
    get_data_parallel_world_size = staticmethod(get_data_parallel_world_size)
    get_data_parallel_rank = staticmethod(get_data_parallel_rank)


mpu = _MPU()

# ---------------------------------------------------------------- tensor_parallel/layers.py
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor: Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    # Make sure the attributes are not set.
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        assert not hasattr(tensor, attribute)
    # Set the attributes.
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def _tp_group_or_none():
    return _TP_GROUP if (dist.is_initialized() and _TP_GROUP is not None and _TP_SIZE > 1) else None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=_TP_GROUP)
        return g


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=_TP_GROUP)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def copy_to_tensor_model_parallel_region(x: Tensor) -> Tensor:
    return _CopyToTP.apply(x) if _tp_group_or_none() is not None else x


def reduce_from_tensor_model_parallel_region(x: Tensor) -> Tensor:
    return _ReduceFromTP.apply(x) if _tp_group_or_none() is not None else x


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split on its output dim (dim 0 of the weight); no bias."""

    def __init__(self, input_size: int, output_size: int, stride: int = 1) -> None:
        super().__init__()
        tp = _TP_SIZE if _tp_group_or_none() is not None else 1
        if output_size % tp:
            raise ValueError(f"output_size={output_size} not divisible by TP size {tp}")
        self.weight = nn.Parameter(torch.empty(output_size // tp, input_size))
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tensor_model_parallel_region(x), self.weight)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split on its input dim (dim 1); input already parallel."""

    def __init__(self, input_size: int, output_size: int, stride: int = 1) -> None:
        super().__init__()
        tp = _TP_SIZE if _tp_group_or_none() is not None else 1
        if input_size % tp:
            raise ValueError(f"input_size={input_size} not divisible by TP size {tp}")
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp))
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tensor_model_parallel_region(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = _TP_SIZE if _tp_group_or_none() is not None else 1
        self.per_rank = num_embeddings // tp
        self.start = (get_tensor_model_parallel_rank() if tp > 1 else 0) * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out)


# ---------------------------------------------------------------- a tiny GPT block
class TinyGPTBlock(nn.Module):
    """One pre-norm decoder block with every TP layout the optimizer must handle."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 8, ffn: int = 48) -> None:
        super().__init__()
        tp = _TP_SIZE if _tp_group_or_none() is not None else 1
        self.cfg = dict(vocab=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn)
        self.heads, self.kv_heads, self.head_dim = heads // tp, kv_heads // tp, head_dim
        self.embed = VocabParallelEmbedding(vocab, hidden)
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.qkv = ColumnParallelLinear(hidden, (heads + 2 * kv_heads) * head_dim)
        # [q; k; v] fused: each TP rank holds its chunk of each block (canzona_ds/tp/layout.py)
        self.qkv.weight.canzona_tp_blocks = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.proj = RowParallelLinear(heads * head_dim, hidden)
        self.norm2 = nn.Parameter(torch.ones(hidden))
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn, stride=2)
        self.fc2 = RowParallelLinear(ffn, hidden)
        self.mix = nn.Linear(hidden, hidden, bias=False)  # replicated 2-D matrix

    @staticmethod
    def _rms(x: Tensor, w: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        B, T, _ = x.shape
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(self._rms(x, self.norm1))
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        q = q.view(B, T, h, d).transpose(1, 2)
        k = k.view(B, T, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        v = v.view(B, T, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, h * d))
        gate, up = self.fc1(self._rms(x, self.norm2)).chunk(2, dim=-1)
        x = x + self.fc2(F.silu(gate) * up)
        return self.mix(x)


#: (param name, partition dim, sizes of the fused blocks along it in the TP=1 layout)
def fused_layout(cfg: dict) -> dict[str, tuple[int | None, list[int]]]:
    d = cfg["head_dim"]
    return {
        "embed.weight": (0, [cfg["vocab"]]),
        "qkv.weight": (0, [cfg["heads"] * d, cfg["kv_heads"] * d, cfg["kv_heads"] * d]),
        "proj.weight": (1, [cfg["heads"] * d]),
        "fc1.weight": (0, [cfg["ffn"], cfg["ffn"]]),
        "fc2.weight": (1, [cfg["ffn"]]),
    }


def shard_tensor(full: Tensor, dim: int | None, blocks: Sequence[int], tp: int, rank: int) -> Tensor:
    """TP rank ``rank``'s shard of a TP=1 tensor: chunk ``rank`` of every fused block."""
    if dim is None or tp == 1:
        return full.clone()
    parts = [b.chunk(tp, dim=dim)[rank] for b in full.split(list(blocks), dim=dim)]
    return torch.cat(parts, dim=dim).clone()


def unshard_tensor(shards: Sequence[Tensor], dim: int | None, blocks: Sequence[int]) -> Tensor:
    """Inverse of :func:`shard_tensor`: the TP=1 tensor in the normal fused layout."""
    if dim is None or len(shards) == 1:
        return shards[0].clone()
    tp = len(shards)
    per_rank = [s.split([b // tp for b in blocks], dim=dim) for s in shards]
    return torch.cat([torch.cat([per_rank[r][j] for r in range(tp)], dim=dim) for j in range(len(blocks))], dim=dim)


def shard_state_dict(full_sd: dict, cfg: dict, tp: int, rank: int) -> dict:
    layout = fused_layout(cfg)
    return {n: shard_tensor(t, *layout.get(n, (None, [])), tp, rank) for n, t in full_sd.items()}


def unshard_state_dict(shard_sds: Sequence[dict], cfg: dict) -> dict:
    layout = fused_layout(cfg)
    return {n: unshard_tensor([sd[n] for sd in shard_sds], *layout.get(n, (None, []))) for n in shard_sds[0]}


def to_tp_layout(full: Tensor, name: str, cfg: dict, tp: int) -> Tensor:
    """A TP=1 tensor in the *concatenated TP layout*: the TP ranks' shards side by side
    (what a rule sees when the shards are gathered in rank order)."""
    dim, blocks = fused_layout(cfg).get(name, (None, []))
    return full.clone() if dim is None else torch.cat([shard_tensor(full, dim, blocks, tp, r) for r in range(tp)], dim=dim)


def from_tp_layout(t: Tensor, name: str, cfg: dict, tp: int) -> Tensor:
    """Inverse of :func:`to_tp_layout`: the TP=1 tensor in the normal fused layout."""
    dim, blocks = fused_layout(cfg).get(name, (None, []))
    return t.clone() if dim is None else unshard_tensor(list(t.split(t.shape[dim] // tp, dim=dim)), dim, blocks)


def reference_run(cfg: dict, tp: int, config, layout: str, steps: int, ids_of, loss_of,
                  lrs=None) -> tuple[dict[str, Tensor], list[str]]:
    """The single-process reference for a TP run: the TP=1 :class:`TinyGPTBlock` trained on its
    own gradients for ``steps`` steps (``ids_of(step)`` the batch, ``loss_of(model, ids)`` the
    loss) with :class:`~canzona_ds.reference.ReferenceOptimizer` and ``config``.  The rule
    sees each matrix in ``layout`` "fused" (the TP=1 matrices) or "tp" (:func:`to_tp_layout`);
    ``lrs(step)`` sets the matrix lr of each step (AdamW's scaled by ``adam_lr_ratio``).
    Returns the trained parameters (TP=1 layout) and the names the matrix rule handled."""
    from canzona_ds.reference import ReferenceOptimizer

    if layout not in ("fused", "tp"):
        raise ValueError(f"layout must be 'fused' or 'tp', got {layout!r}")
    saved = torch.get_num_threads()
    torch.set_num_threads(test_threads())
    try:
        model = TinyGPTBlock(**cfg)
        model.load_state_dict(init_full_state_dict(cfg))
        named = dict(model.named_parameters())
        seen = named if layout == "fused" else {
            n: nn.Parameter(to_tp_layout(p.detach(), n, cfg, tp)) for n, p in named.items()}
        opt = ReferenceOptimizer(seen.items(), config)
        for s in range(steps):
            if lrs is not None:
                opt.set_lr(lrs(s), lrs(s) * config.adam_lr_ratio)
            model.zero_grad()
            loss_of(model, ids_of(s)).backward()
            if layout == "tp":
                for n, p in seen.items():
                    p.grad = to_tp_layout(named[n].grad, n, cfg, tp)
            opt.step()
            if layout == "tp":
                with torch.no_grad():
                    for n, p in named.items():
                        p.copy_(from_tp_layout(seen[n].detach(), n, cfg, tp))
        return {n: p.detach().clone() for n, p in named.items()}, [n for n, _ in opt.matrices]
    finally:
        torch.set_num_threads(saved)


def init_full_state_dict(cfg: dict, seed: int = 0) -> dict:
    """Deterministic TP=1 weights for :class:`TinyGPTBlock` (normal fused layout)."""
    g = torch.Generator().manual_seed(seed)
    H, d = cfg["hidden"], cfg["head_dim"]

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    return {
        "norm1": torch.ones(H) + 0.1 * torch.randn(H, generator=g),
        "norm2": torch.ones(H) + 0.1 * torch.randn(H, generator=g),
        "embed.weight": torch.randn(cfg["vocab"], H, generator=g),
        "qkv.weight": w((cfg["heads"] + 2 * cfg["kv_heads"]) * d, H),
        "proj.weight": w(H, cfg["heads"] * d),
        "fc1.weight": w(2 * cfg["ffn"], H),
        "fc2.weight": w(H, cfg["ffn"]),
        "mix.weight": w(H, H),
    }

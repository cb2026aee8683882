"""How a tensor-parallel parameter's shards make up the whole (TP=1) tensor.

Along its partition dimension a TP=1 tensor is a sequence of *blocks* (one for a plain
column- or row-parallel layer; ``[gate; up]`` for a fused SwiGLU fc1; ``[q; k; v]`` for a
fused QKV), and TP rank r holds chunk r of every block, concatenated::

    TP=1:        | gate                | up                  |      blocks (2)
    TP=2 shards:   r0: | gate_0 | up_0 |    r1: | gate_1 | up_1 |
    concatenated shards (the "TP layout" a host sees): | gate_0 | up_0 | gate_1 | up_1 |

So the concatenated shards are a permutation of the TP=1 tensor along that dimension,
which :func:`concat_permutation` returns.  Blocks come from the parameter: Megatron's
``partition_stride`` (s equal blocks) or an explicit ``canzona_tp_blocks`` attribute (block
sizes in the TP=1 layout); otherwise one block.  Used to move checkpoints between TP sizes.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def tp_blocks(param, full_size: int) -> tuple[int, ...]:
    """Block sizes of ``param``'s partition dimension in the TP=1 layout."""
    explicit = getattr(param, "canzona_tp_blocks", None)
    if explicit is not None:
        blocks = tuple(int(b) for b in explicit)
    else:
        stride = int(getattr(param, "partition_stride", 1) or 1)
        if full_size % stride:
            raise ValueError(f"partition_stride={stride} does not divide the partition dimension ({full_size}).")
        blocks = (full_size // stride,) * stride
    if sum(blocks) != full_size:
        raise ValueError(f"TP blocks {blocks} do not add up to the partition dimension ({full_size}).")
    return blocks


def concat_permutation(blocks: Sequence[int], shard_sizes: Sequence[int]) -> Tensor:
    """``perm`` with ``concat_of_shards[i] == full[perm[i]]`` along the partition dimension.

    With one block the shards may be uneven (AutoTP); with several, every block must split
    into ``len(shard_sizes)`` equal chunks that add up to the shard sizes."""
    tp = len(shard_sizes)
    starts = [sum(blocks[:b]) for b in range(len(blocks))]
    if len(blocks) == 1:
        return torch.arange(sum(shard_sizes), device="cpu")
    for b in blocks:
        if b % tp:
            raise ValueError(f"TP block of {b} does not split into {tp} equal chunks.")
    if any(s != sum(b // tp for b in blocks) for s in shard_sizes):
        raise ValueError(f"shard sizes {list(shard_sizes)} do not match blocks {list(blocks)} split {tp} ways.")
    idx = []
    for r in range(tp):
        for start, b in zip(starts, blocks):
            c = b // tp
            idx.extend(range(start + r * c, start + (r + 1) * c))
    return torch.tensor(idx, dtype=torch.long, device="cpu")


def unshard(shards: Sequence[Tensor], dim: int, blocks: Sequence[int]) -> Tensor:
    """The TP=1 tensor from its TP shards."""
    concat = torch.cat(list(shards), dim=dim)
    perm = concat_permutation(blocks, [s.shape[dim] for s in shards])
    out = torch.empty_like(concat)
    out.index_copy_(dim, perm.to(concat.device), concat)
    return out


def shard(full: Tensor, dim: int, blocks: Sequence[int], shard_sizes: Sequence[int], rank: int) -> Tensor:
    """TP rank ``rank``'s shard of a TP=1 tensor."""
    perm = concat_permutation(blocks, shard_sizes).to(full.device)
    start = sum(shard_sizes[:rank])
    return full.index_select(dim, perm[start:start + shard_sizes[rank]]).contiguous()

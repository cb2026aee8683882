"""Frames of the checkpoint index: where a chunk's elements lie in the whole-model tensor.

A chunk without a frame indexes the row-major flat of the global (TP=1) tensor.  A tensor-
parallel shard is another frame (``canzona_ds/tp/layout.py``): along ``dim`` the TP=1 tensor is
a sequence of blocks, TP rank t holds chunk t of every block, and the concatenated shards are a
permutation of the TP=1 tensor along ``dim``::

    frame = {"tp": {"dim": 0, "sizes": [3, 3], "blocks": [4, 2], "rank": 1}}
    TP=1 rows:       g0 g1 g2 g3 | u0 u1          blocks (4, 2), two TP ranks
    shard 1 rows:    g2 g3 u1                     (chunk 1 of every block)
    a chunk of shard 1, offset 2, length 5 (shape (6, 2)): shard flat [2, 7) = rows 1..3 of
    shard 1 -> TP=1 rows g3, u1 -> global flat [6, 8) and [10, 12), [11] cut at the end

:func:`to_global` is that arithmetic (the global flat positions of a frame's flat range);
:func:`assemble` fills a whole global tensor from chunks in any shard frames.  A frame without
``"rank"`` is a TP host's rule state, kept in the concatenated TP layout: mapping it to TP=1
takes the rule's ``state_axes`` (integration/ckpt/fill.IndexSource), not this module.

Plain torch (and canzona_ds/tp/layout.py, plain torch); no DeepSpeed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from ..tp.layout import concat_permutation


class FrameError(ValueError):
    """A frame the index cannot describe (the message names it)."""


@dataclass(frozen=True)
class TPFrame:
    """A tensor-parallel layout along ``dim``: shard sizes, TP=1 block sizes, and (a shard's
    frame) the TP rank, or ``rank=None`` (the concatenated shards: a TP host's rule state)."""

    dim: int
    sizes: tuple[int, ...]
    blocks: tuple[int, ...]
    rank: int | None = None

    @classmethod
    def of(cls, frame: Any, where: str = "frame") -> "TPFrame | None":
        """The frame of a chunk (its JSON form), None for the global frame; refuses by name
        anything else."""
        if frame is None:
            return None
        if not isinstance(frame, dict) or set(frame) != {"tp"} or not isinstance(frame["tp"], dict):
            raise FrameError(f"{where}: frame {frame!r} is not one this reader knows (null, or {{\"tp\": "
                             "{dim, sizes, blocks[, rank]}}).")
        tp = frame["tp"]
        need = {"dim", "sizes", "blocks"}
        if not need <= set(tp) or set(tp) - need - {"rank"}:
            raise FrameError(f"{where}: TP frame {tp!r} needs exactly dim, sizes, blocks and optionally rank.")
        ints = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not ints(tp["dim"]) or tp["dim"] < 0:
            raise FrameError(f"{where}: TP frame dim={tp['dim']!r}; expected an integer >= 0.")
        for k in ("sizes", "blocks"):
            if not isinstance(tp[k], list) or not tp[k] or not all(ints(s) and s > 0 for s in tp[k]):
                raise FrameError(f"{where}: TP frame {k}={tp[k]!r}; expected a non-empty list of positive integers.")
        if sum(tp["sizes"]) != sum(tp["blocks"]):
            raise FrameError(f"{where}: TP frame sizes {tp['sizes']} and blocks {tp['blocks']} cover different "
                             "lengths.")
        rank = tp.get("rank")
        if rank is not None and (not ints(rank) or not 0 <= rank < len(tp["sizes"])):
            raise FrameError(f"{where}: TP frame rank={rank!r}; expected 0..{len(tp['sizes']) - 1}.")
        return cls(tp["dim"], tuple(tp["sizes"]), tuple(tp["blocks"]), rank)

    @classmethod
    def from_layout(cls, layout: Sequence, rank: int | None = None) -> "TPFrame":
        """From a running TP layout ``(dim, shard sizes, blocks)``."""
        dim, sizes, blocks = layout
        return cls(int(dim), tuple(int(s) for s in sizes), tuple(int(b) for b in blocks), rank)

    def to_json(self) -> dict:
        tp: dict[str, Any] = {"dim": self.dim, "sizes": list(self.sizes), "blocks": list(self.blocks)}
        if self.rank is not None:
            tp["rank"] = self.rank
        return {"tp": tp}

    @property
    def layout(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(dim, sizes, blocks): the frame without its rank."""
        return self.dim, self.sizes, self.blocks

    def at(self, rank: int | None) -> "TPFrame":
        return TPFrame(self.dim, self.sizes, self.blocks, rank)

    def perm(self) -> Tensor:
        """concatenated shards[i] = TP=1[perm[i]] along ``dim``."""
        return concat_permutation(self.blocks, self.sizes)

    def shard_shape(self, shape: Sequence[int], rank: int | None = None) -> tuple[int, ...]:
        """The shape of shard ``rank`` (default: this frame's) of a global ``shape``."""
        rank = self.rank if rank is None else rank
        s = list(shape)
        s[self.dim] = self.sizes[rank]
        return tuple(s)

    def check(self, shape: Sequence[int], where: str = "frame") -> None:
        """A shard frame fits the global ``shape`` it cuts."""
        if self.dim >= len(shape) or sum(self.sizes) != shape[self.dim]:
            raise FrameError(f"{where}: TP frame (dim {self.dim}, sizes {list(self.sizes)}) does not cut shape "
                             f"{list(shape)}.")


def to_global(frame: TPFrame, shape: Sequence[int], start: int, stop: int) -> Tensor:
    """The global (TP=1, row-major) flat positions of elements ``[start, stop)`` of the row-major
    flat of shard ``frame.rank`` of a tensor of global ``shape``, as an int64 tensor."""
    if frame.rank is None:
        raise FrameError("to_global needs a shard's frame (with its rank).")
    frame.check(shape)
    d, t = frame.dim, frame.rank
    inner = math.prod(shape[d + 1:])
    n = frame.sizes[t]
    if not 0 <= start <= stop <= math.prod(frame.shard_shape(shape)):
        raise FrameError(f"[{start}, {stop}) lies outside shard {t} of {list(shape)} "
                         f"({math.prod(frame.shard_shape(shape))} elements).")
    flat = torch.arange(start, stop, dtype=torch.long)
    rest = flat % inner
    along = (flat // inner) % n
    outer = flat // (inner * n)
    rows = frame.perm()[sum(frame.sizes[:t]) + along]
    return (outer * shape[d] + rows) * inner + rest


def assemble(pieces: Sequence[tuple[TPFrame | None, int, Tensor]], shape: Sequence[int], dtype=None) -> Tensor:
    """The whole global tensor from ``(frame, offset, values)`` pieces: ``values`` are elements
    ``[offset, offset + len)`` of the flat of ``frame`` (None: the global frame; else a shard's).
    Where pieces overlap (replicas) the later one wins; the caller checks coverage."""
    if not pieces:
        raise FrameError("assemble: no pieces.")
    out = torch.empty(math.prod(shape), dtype=dtype or pieces[0][2].dtype)
    for frame, offset, values in pieces:
        values = values.reshape(-1)
        if frame is None:
            out[offset:offset + values.numel()].copy_(values)
        else:
            out.index_copy_(0, to_global(frame, shape, offset, offset + values.numel()), values.to(out.dtype))
    return out.view(tuple(shape))

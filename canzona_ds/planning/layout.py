"""Planned padding: an ownership plan as one flat buffer cut into equal rank ranges.

The ONE place padding is computed: the ZeRO integration realises exactly this layout in
DeepSpeed's flat buffer, and the main job, the CLI and the benchmarks report its padding.

Input: how many parameters each rank owns (in buffer order: rank 0's first), their
element counts, and two alignments: ``param_alignment`` (DeepSpeed's
``zero_optimization.parameter_alignment``: each parameter starts on a multiple of it) and
``start_alignment`` (every rank's range starts on a multiple of it; DeepSpeed ZeRO uses 2
elements, its ``nccl_start_alignment_factor``).  Output: the rank range size P (a multiple
of both), each parameter's offset, and the padding after each parameter (DeepSpeed's
per-parameter padding list).  Every rank's range is exactly P elements, so DeepSpeed's
equal-chunk code works unchanged, and no parameter crosses a range boundary.

Worked example: dp = 2, rank 0 owns A (5) and B (3), rank 1 owns C (6); param_alignment
2, start_alignment 2::

    rank 0: A at 0, 1 pad (so B starts aligned), B at 6        used 9
    rank 1: C at P                                             used 6
    P = round_up(max(9, 6), 2) = 10
    offsets (0, 6, 10), padding after each (1, 1, 4), flat buffer 2 * P = 20
    total padding = 20 - 14 = 6 elements (42.9% of 14)

    | A A A A A . B B B . | C C C C C C . . . . |
      rank 0 (P = 10)       rank 1 (P = 10)

A rank that owns nothing (possible when there are about as many ranks as matrices) has
an all-padding range; the padding of the last parameter before it covers it.  Rank 0 must
own something: DeepSpeed's padding list can only pad *after* a parameter.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

#: DeepSpeed ZeRO stage 1/2 aligns every rank range start to 2 elements
#: (``DeepSpeedZeroOptimizer.nccl_start_alignment_factor``)
DS_START_ALIGNMENT = 2


@dataclass(frozen=True)
class Layout:
    world_size: int
    #: parameters per rank, in buffer order
    rank_counts: tuple[int, ...]
    #: element count of every parameter, in buffer order
    numels: tuple[int, ...]
    #: elements in every rank's range (P)
    shard_numel: int
    #: start of every parameter in the flat buffer
    offsets: tuple[int, ...]
    #: padding elements after every parameter (DeepSpeed's per-parameter padding list)
    padding: tuple[int, ...]
    param_alignment: int = 1
    start_alignment: int = DS_START_ALIGNMENT
    #: the mixed layout (planning/mixed.py): owner rank of every parameter in buffer order, -1
    #: for a hosted one (updated over the DP group, may cross range boundaries); () = atomic
    owner_at: tuple[int, ...] = ()

    @property
    def mixed(self) -> bool:
        return bool(self.owner_at)

    def hosted_indices(self) -> list[int]:
        """Buffer indices of the hosted parameters (mixed layout only)."""
        return [k for k, o in enumerate(self.owner_at) if o < 0]

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    @property
    def buffer_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def total_padding(self) -> int:
        """Extra elements of the layout: ``dp * P - S``."""
        return self.buffer_numel - self.total_numel

    @property
    def padding_fraction(self) -> float:
        return self.total_padding / self.total_numel if self.total_numel else 0.0

    def owners(self) -> list[int]:
        """Owner rank of every parameter, in buffer order (-1: hosted, mixed layout)."""
        if self.owner_at:
            return list(self.owner_at)
        return [r for r, c in enumerate(self.rank_counts) for _ in range(c)]

    def rank_views(self, rank: int) -> list[tuple[int, int]]:
        """(buffer index, offset inside the rank's range) of the parameters ``rank`` owns."""
        lo = rank * self.shard_numel
        return [(j, self.offsets[j] - lo) for j, owner in enumerate(self.owners()) if owner == rank]

    def fingerprint(self) -> str:
        payload = [self.world_size, list(self.rank_counts), list(self.numels), self.shard_numel, list(self.padding)]
        if self.owner_at:
            payload.append(list(self.owner_at))
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan_layout(rank_counts: Sequence[int], numels: Sequence[int], param_alignment: int = 1,
                start_alignment: int = DS_START_ALIGNMENT) -> Layout:
    """The planned-padding layout (see module doc)."""
    for name, v in (("param_alignment", param_alignment), ("start_alignment", start_alignment)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Invalid {name}={v!r}. Must be an int >= 1.")
    counts = list(rank_counts)
    if not counts or any(isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0 for c in counts) \
            or sum(counts) != len(numels):
        raise ValueError(f"Invalid rank_counts={counts!r}: must be ints >= 0 (one per rank) adding up to the "
                         f"{len(numels)} parameters.")
    counts = [int(c) for c in counts]
    if not numels:
        raise ValueError("plan_layout needs at least one parameter.")
    for j, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"Invalid numels[{j}]={n!r}. Must be an int >= 0 (a parameter's element count).")
    numels = [int(n) for n in numels]
    if counts[0] == 0:
        raise ValueError("rank 0 owns no parameter: the padded layout pads after parameters, so rank 0 must own one "
                         "(reorder the ranks so that the empty ones come last).")
    dp = len(counts)
    # pass 1: inner padding (alignment) and the used size of every rank
    inner = [0] * len(numels)
    used, k = [], 0
    for c in counts:
        u = 0
        for j in range(k, k + c):
            u += numels[j]
            if j < k + c - 1:
                inner[j] = (-u) % param_alignment
                u += inner[j]
        used.append(u)
        k += c
    P = _round_up(max(max(used), 1), math.lcm(param_alignment, start_alignment))
    # pass 2: offsets; the last parameter of a rank pads to the start of the next rank that
    # owns something (or the end of the buffer)
    offsets, padding = [], list(inner)
    nonempty = [r for r, c in enumerate(counts) if c]
    last_of_rank = {}
    k = 0
    for r, c in enumerate(counts):
        if c:
            last_of_rank[k + c - 1] = r
        k += c
    off = 0
    for j, n in enumerate(numels):
        offsets.append(off)
        off += n + inner[j]
        if j in last_of_rank:
            r = last_of_rank[j]
            following = [q for q in nonempty if q > r]
            end = following[0] * P if following else dp * P
            padding[j] = end - (off - inner[j])
            off = end
    return Layout(world_size=dp, rank_counts=tuple(counts), numels=tuple(int(n) for n in numels), shard_numel=P,
                  offsets=tuple(offsets), padding=tuple(padding), param_alignment=param_alignment,
                  start_alignment=start_alignment)


def nonempty_first(rank_params: Sequence[Sequence[int]]) -> list[int]:
    """A relabelling of ranks (new rank -> old rank) that keeps the order of the ranks that
    own something and moves the empty ones last, so rank 0 owns a parameter."""
    full = [r for r, ps in enumerate(rank_params) if len(ps)]
    return full + [r for r, ps in enumerate(rank_params) if not len(ps)]

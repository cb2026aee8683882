"""Sharded placement (ZeRO stage 3): every matrix is cut into contiguous flat pieces over the
data-parallel group, one piece per rank (``FlatSplit``); a planned host rank per matrix runs the
rule on the whole matrix, and every rank applies its piece of the result.

ZeRO-3 keeps, per rank, one flat fp32 partition of the matrix group and its gradient partition;
the ZeRO integration (``integration/zero3.py``) tells :meth:`ShardedPlacement.bind` where each
matrix's piece lies in them::

    matrix W (numel n), P = ceil(n / dp):   rank r holds W.flat[r*P : min((r+1)*P, n)]
    fp32 partition of rank r:   | W_a piece | pad | W_b piece | W_c piece | pad | ...
                                  ^ offset_a        ^ offset_b  (padding tails excluded)

Per micro-group (planned from the rule's cost over the DP size, ``planning/tp.py``)::

    pieces --all_to_all_single--> host: G = cat(pieces).view(shape); D = rule.direction(G, state)
    host --all_to_all_single--> pieces of D;  every rank: apply_rule_update(piece, D_r, ...)

The rule state of a matrix lives only on its host (``CanzonaOptimizer.matrix_state``).  Every
rank of the group steps every matrix (empty pieces included), in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..config import TPConfig
from ..optim.rule import MatrixRule
from ..tp.runtime import FlatSplit
from .base import Placement
from .hosted import HostedPlacement


@dataclass(frozen=True)
class FlatPiece:
    """This rank's piece of one matrix inside the flat partition: ``length`` elements at ``offset``."""

    name: str
    offset: int
    length: int


class ShardedPlacement(Placement):
    kind = "sharded"

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = list(names)
        #: this rank's piece of every matrix, in ``names`` order (set by :meth:`bind`)
        self.pieces: tuple[FlatPiece, ...] = ()
        self.partition_numel: int | None = None

    def bind(self, partition_numel: int, pieces: Sequence[FlatPiece], splits: Sequence[FlatSplit],
             rule: MatrixRule, group, config: TPConfig, states: dict) -> None:
        """The matrix group's flat partition (``partition_numel`` elements) holds ``pieces``;
        ``splits`` say how every matrix is cut over ``group`` (the DP group)."""
        pieces = tuple(pieces)
        if [p.name for p in pieces] != self.names or [s.name for s in splits] != self.names:
            raise RuntimeError("ZeRO-3 bound pieces/splits that do not follow the optimizer's matrix order: "
                               f"{[p.name for p in pieces][:4]}... vs {self.names[:4]}...")
        for p in pieces:
            if p.offset < 0 or p.length < 0 or p.offset + p.length > partition_numel:
                raise RuntimeError(f"Matrix {p.name}'s piece [{p.offset}, {p.offset + p.length}) does not fit in a "
                                   f"partition of {partition_numel} elements.")
        self.pieces = pieces
        self.partition_numel = partition_numel
        self.hosted = HostedPlacement(list(splits), rule, group, config, states)

    def items(self, group: dict) -> list[tuple[str, Tensor, Tensor]]:
        if self.partition_numel is None:
            raise RuntimeError("ZeRO-3 sharded placement stepped before ZeRO bound its flat partition "
                               "(CanzonaOptimizer(placement='sharded') runs only inside DeepSpeed ZeRO stage 3).")
        params = group["params"]
        if len(params) != 1 or params[0].numel() != self.partition_numel:
            raise RuntimeError(f"The matrix group must hold this rank's one flat partition of {self.partition_numel} "
                               f"elements; got {[tuple(p.shape) for p in params]}.")
        flat = params[0]
        grad = flat.grad if flat.grad is not None else torch.zeros_like(flat)
        return [(p.name, flat.narrow(0, p.offset, p.length), grad.narrow(0, p.offset, p.length)) for p in self.pieces]

    def held_names(self) -> list[str]:
        return [p.name for p in self.pieces]

"""ZeRO stage 1/2 ownership: each rank updates the whole matrices the DP plan gives it, inside
its flat fp32 partition; the step makes no collective call.

The ZeRO integration replaces the matrix group's parameters by this rank's flat fp32 partition
and calls :meth:`OwnedPlacement.bind` with where each owned matrix lies in it (the layout of
``planning/layout.py``)::

    flat fp32 partition of rank r (P elements)
    | W_a (rows_a x cols_a) | W_d (...) |   pad to P   |
      ^ view(offset=0)        ^ view(offset=k)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor

from .base import Placement


@dataclass(frozen=True)
class FlatView:
    """One matrix inside a flat partition."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class OwnedPlacement(Placement):
    kind = "owned"

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = set(names)
        #: id(flat partition) -> the matrices inside it
        self.views: dict[int, tuple[FlatView, ...]] = {}

    def bind(self, flat_param: Tensor, views: Iterable[FlatView],
             make_hosted: Callable[[list[str]], object] | None = None) -> None:
        """``flat_param`` (this rank's partition of the matrix group) holds ``views``; the split
        matrices among them get a hosted strategy from ``make_hosted(names)``."""
        views = tuple(views)
        for v in views:
            if v.name not in self.names:
                raise RuntimeError(f"bind_partition: {v.name!r} is not one of this optimizer's matrices.")
            if v.offset < 0 or v.offset + v.numel > flat_param.numel():
                raise RuntimeError(f"Matrix {v.name} at offset {v.offset} does not fit in a partition of "
                                   f"{flat_param.numel()} elements.")
        self.views[id(flat_param)] = views
        if make_hosted is not None:  # one partition per matrix group (several under MoE; with TP the
            # dense one, bound first, holds the TP-split matrices and keeps the hosted strategy)
            hosted = make_hosted([v.name for v in views])
            if hosted is not None or len(self.views) == 1:
                self.hosted = hosted

    def items(self, group: dict) -> list[tuple[str, Tensor, Tensor]]:
        if not self.views:
            raise RuntimeError("ZeRO-owned placement stepped before ZeRO bound its flat partition "
                               "(CanzonaOptimizer(placement='owned') runs only inside DeepSpeed ZeRO stage 1/2).")
        items = []
        for p in group["params"]:  # views of this rank's flat partition
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            for v in self.views.get(id(p), ()):
                sl = slice(v.offset, v.offset + v.numel)
                items.append((v.name, p[sl].view(v.shape), grad[sl].view(v.shape)))
        return items

    def held_names(self) -> list[str]:
        return [v.name for views in self.views.values() for v in views]

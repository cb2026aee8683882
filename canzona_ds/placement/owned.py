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
        #: id(flat partition) -> the hosted strategy of that matrix group (one per matrix param
        #: group that has split matrices: under DeepSpeed MoE the dense group's over the DP/TP
        #: groups, each expert group's over its own expert-data-parallel group); ``hosted`` reads
        #: them all as one (HostedSet), and each group's step runs only its own
        self.hosted_of: dict[int, object] = {}

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
        if make_hosted is not None:  # one partition per matrix group (several under MoE, each with
            # its own hosted strategy over its own group: the dense one's TP-split and DP-hosted
            # matrices, an expert group's hosted experts over its expert-DP group)
            hosted = make_hosted([v.name for v in views])
            if hosted is not None:
                self.hosted_of[id(flat_param)] = hosted
            self.hosted = _as_one(list(self.hosted_of.values()))

    def hosted_for(self, group: dict):
        """The hosted strategy bound with this group's flat partition (None: it hosts nothing)."""
        found = [self.hosted_of[id(p)] for p in group["params"] if id(p) in self.hosted_of]
        return _as_one(found)

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


def _as_one(hosted: list):
    """None, the one hosted strategy, or a HostedSet of all their parts (in the order given)."""
    if not hosted:
        return None
    if len(hosted) == 1:
        return hosted[0]
    from .hosted import HostedSet

    return HostedSet([part for h in hosted for part in getattr(h, "parts", (h,))])

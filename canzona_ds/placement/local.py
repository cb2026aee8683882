"""Replicated placement (one process, ZeRO stage 0): the matrix group holds the real parameters
and this rank updates every one of them (the split ones through the hosted strategy)."""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Placement


class LocalPlacement(Placement):
    kind = "local"

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        #: matrix names in the param groups' order
        self.names = list(names)
        #: id(parameter) -> its name (:meth:`track`; the matrix groups may be several: MoE)
        self.name_of: dict[int, str] = {}

    def track(self, named: list[tuple[str, Tensor]]) -> None:
        """The (name, parameter) pairs of every matrix group."""
        self.name_of = {id(p): n for n, p in named}

    def items(self, group: dict) -> list[tuple[str, Tensor, Tensor]]:
        return [(self.name_of[id(p)], p, p.grad if p.grad is not None else torch.zeros_like(p))
                for p in group["params"]]

    def held_names(self) -> list[str]:
        return list(self.names)

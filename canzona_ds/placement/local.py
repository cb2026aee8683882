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
        #: matrix names in the param group's order
        self.names = list(names)

    def items(self, group: dict) -> list[tuple[str, Tensor, Tensor]]:
        return [(n, p, p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in zip(self.names, group["params"])]

    def held_names(self) -> list[str]:
        return list(self.names)

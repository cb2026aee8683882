"""The placement interface: which matrices this rank updates, and how their update reaches the
parameters.

Every step of the matrix param group::

    ctx = StepContext(rule, infos, states, step, lr, weight_decay)
    placement.step(group, ctx)
        for (name, param, grad) in placement.items(group):       # what this rank holds
            split across TP ranks  -> collected for placement.hosted (one runtime step)
            whole                  -> rule_steps(rule, [(param, grad, infos[name]), ...], states, ...)
                                      (same-shape matrices batched where the rule can; optim/rule.py)
                                      then MuonClip's QK-clip: param rows *= ctx.qk_scales[name]
                                      (split ones: each rank's piece, placement/hosted.py)

``param``/``grad`` are views of whatever holds the matrix (the real parameter, or a slice of
ZeRO's flat fp32 partition), so the update lands in place.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from ..optim.qk_clip import apply_row_scale
from ..optim.rule import rule_steps
from .context import StepContext

if TYPE_CHECKING:
    from .hosted import HostedPlacement, HostedSet


class Placement(ABC):
    """A holding strategy; the matrices it holds that are split across a group go to ``hosted``."""

    kind: ClassVar[str]

    def __init__(self) -> None:
        #: the hosted strategy for split matrices this rank holds a shard of (None: none); a
        #: HostedSet where several runtimes run (the mixed layout under TP)
        self.hosted: HostedPlacement | HostedSet | None = None

    @abstractmethod
    def items(self, group: dict) -> list[tuple[str, Tensor, Tensor]]:
        """(name, parameter view, gradient view) of every matrix (or shard) this rank holds;
        a missing gradient is a zero one (DeepSpeed ZeRO's semantics)."""

    @abstractmethod
    def held_names(self) -> list[str]:
        """Names of the matrices (or shards) this rank holds, in ``items`` order."""

    def handled_names(self) -> list[str]:
        """Matrices whose rule state this rank keeps: the whole ones it holds and the split ones
        it hosts."""
        split = self.hosted.split if self.hosted is not None else {}
        out = [n for n in self.held_names() if n not in split]
        return out + (self.hosted.hosted_names() if self.hosted is not None else [])

    def hosted_for(self, group: dict) -> HostedPlacement | HostedSet | None:
        """The hosted strategy of the matrix param group ``group`` (default: ``hosted``)."""
        return self.hosted

    def step(self, group: dict, ctx: StepContext) -> None:
        hosted = self.hosted_for(group)
        split: dict[str, tuple[Tensor, Tensor]] = {}
        whole: list[tuple[str, Tensor, Tensor]] = []
        for name, param, grad in self.items(group):
            if hosted is not None and name in hosted.split:
                split[name] = (param, grad)
                continue
            whole.append((name, param, grad))
        rule_steps(ctx.rule, [(p, g, ctx.infos[n]) for n, p, g in whole], ctx.states, ctx.step, ctx.lr,
                   ctx.weight_decay)
        for name, param, _ in whole:  # after the update of its own matrix (matrices are independent)
            if name in ctx.qk_scales:
                apply_row_scale(param, ctx.qk_scales[name])
        if hosted is not None and split:
            # every rank of the split group calls this (the same matrices, by construction); a
            # group without split matrices (an MoE expert group beside the TP-split dense one)
            # holds none of the hosted ones
            hosted.step(split, ctx)

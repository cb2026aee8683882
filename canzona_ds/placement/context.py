"""What one step of the matrix param group hands a placement besides the matrices
(:class:`StepContext`): the holding strategies (base.py) and the hosted one (hosted.py) both
take it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from torch import Tensor

from ..optim.rule import MatrixInfo, MatrixRule


@dataclass
class StepContext:
    """What one step of the matrix group needs besides the matrices."""

    rule: MatrixRule
    infos: Mapping[str, MatrixInfo]
    #: rule state by matrix name (created on first use by rule_step / the host)
    states: dict[str, dict[str, Tensor]]
    step: int
    lr: float
    weight_decay: float
    #: QK-clip (optim/qk_clip.py): per-row factors of the q/k matrices that clip this step,
    #: applied right after their rule update on the same tensor (the whole matrix)
    qk_scales: Mapping[str, Tensor] = field(default_factory=dict)

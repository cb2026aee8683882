"""The unit a matrix rule states its cost in, and the planners balance: one leaf both import.

A rule (``canzona_ds/optim/``, torch) says what one step of a matrix costs; the planners
(``canzona_ds/planning/``, no torch) weigh matrices by it.  Neither imports the other: the
value type they exchange lives here, importing nothing.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flops:
    """FLOPs of one matrix's optimizer step: ``amortised`` over the refresh period of any
    periodic work (a preconditioner eigendecomposition every f steps counts 1/f per step),
    and ``peak``, the step that does all of it."""

    amortised: float
    peak: float

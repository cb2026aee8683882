"""Learning-rate multiplier: linear warmup, then constant / cosine / linear decay."""
from __future__ import annotations

import math


def lr_multiplier(step: int, total_steps: int, schedule: str, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier for optimizer step ``step`` (0-based) of ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    raise ValueError(f"Unknown lr_schedule={schedule!r}. Allowed: ['constant', 'cosine', 'linear']")

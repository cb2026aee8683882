"""Global-norm gradient clipping with ``torch.nn.utils.clip_grad_norm_``'s arithmetic, bit for bit.

Why this exists: the clip factor multiplies every gradient, and a matrix rule amplifies one ulp
of it.  ``torch.optim.Muon`` (and our Muon rule, which equals it) runs Newton-Schulz in bf16, so
a factor one ulp off flips a few bf16 roundings and, five steps later on a small decoder, the
weights are 1e-3 apart.  DeepSpeed's ZeRO-1/2 clip is the same *math* as torch's but not the same
*arithmetic*: its global norm is ``stack(norms).pow(2).sum().pow(0.5)`` (torch:
``vector_norm(stack(norms))``) and it multiplies by ``1 / ((norm + 1e-6) / clip)`` (torch:
``clip / (norm + 1e-6)``).  A user's single-process run (``clip_grad_norm_`` + the optimizer)
is the reference, so the distributed clip must reproduce torch's operations exactly:

    norms[k]   = ||g_k||_2 for every parameter k, each over the WHOLE gradient, computed as
                 torch computes it (``torch._foreach_norm`` where the device has foreach
                 kernels, ``torch.linalg.vector_norm`` per tensor elsewhere)
    total      = vector_norm(stack(norms in the model's parameter order))
    coef       = clamp(max_norm / (total + 1e-6), max=1.0)
    g_k       <- g_k * coef

The distributed side (``integration/zero.py``) supplies whole-gradient norms: a ZeRO owner holds
each of its matrices whole; a parameter that ZeRO's equal chunks cut across ranks has its pieces
brought to one rank first.  Everything here is plain torch.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

#: torch.nn.utils.clip_grad_norm_'s epsilon in ``max_norm / (total_norm + 1e-6)``
CLIP_EPS = 1e-6


def _foreach_ok(tensors: Sequence[Tensor], device: torch.device) -> bool:
    """Whether torch's clip_grad_norm_ (foreach=None) would use the foreach kernel here."""
    try:
        from torch.utils._foreach_utils import _has_foreach_support
    except ImportError:  # pragma: no cover - older torch: foreach on CUDA only
        return device.type == "cuda"
    return _has_foreach_support(list(tensors), device)


def per_tensor_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The L2 norm of each tensor (0-dim, on its device), computed exactly as
    ``torch.nn.utils.get_total_norm`` computes its per-tensor norms."""
    out: list[Tensor | None] = [None] * len(tensors)
    by_key: dict[tuple, list[int]] = {}
    for k, t in enumerate(tensors):
        by_key.setdefault((t.device, t.dtype), []).append(k)
    for (device, _), idx in by_key.items():
        group = [tensors[k] for k in idx]
        norms = torch._foreach_norm(group, 2.0) if _foreach_ok(group, device) else \
            [torch.linalg.vector_norm(g, 2.0) for g in group]
        for k, n in zip(idx, norms):
            out[k] = n
    return out  # type: ignore[return-value]


def stack_order(keys: Sequence[tuple]) -> list[int]:
    """The order in which ``get_total_norm`` stacks per-tensor norms: tensors grouped by
    (device, dtype) in order of first appearance, in input order within a group."""
    first: dict[tuple, int] = {}
    for k, key in enumerate(keys):
        first.setdefault(key, k)
    return sorted(range(len(keys)), key=lambda k: (first[keys[k]], k))


def total_norm(norms: Sequence[Tensor] | Tensor) -> Tensor:
    """``torch.nn.utils.get_total_norm``'s combination: the L2 norm of the per-tensor norms,
    stacked in the order given (``stack_order`` of the model's parameters)."""
    stacked = norms if isinstance(norms, Tensor) else torch.stack(list(norms))
    return torch.linalg.vector_norm(stacked, 2.0)


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """``clamp(max_norm / (norm + 1e-6), max=1.0)``, torch's expression (a 0-dim tensor)."""
    clip_coef = max_norm / (norm + CLIP_EPS)
    return torch.clamp(clip_coef, max=1.0)

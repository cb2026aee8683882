"""Parameter descriptions the planners consume: shapes and roles, nothing from torch.

A ``ParamSpec`` is what a planner needs to know about one parameter tensor (of one TP
rank, when tensor parallelism splits it):

    name      "layers.3.mlp.linear_fc1.weight"
    shape     (rows, cols) as stored on this rank
    role      "matrix" -> handled by the matrix optimizer (Muon), atomic, never split
              "aux"    -> element-wise optimizer (AdamW), may be sliced anywhere
    tp_*      Megatron-style tensor-parallel split of the *full* matrix, if any

Default role rule (overridable with ``matrix_filter``): ndim >= 2 and the name is not
an embedding or output head.  That matches DeepSpeed's ``set_optimizer_flags`` and the
usual Muon recipe (embeddings/head use AdamW).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

Role = Literal["matrix", "aux"]

#: name fragments that mark a >=2-D parameter as an embedding / output head (-> aux)
DEFAULT_AUX_NAME_FRAGMENTS: tuple[str, ...] = ("embed", "lm_head", "wte", "wpe", "output_layer")

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor, as the planners see it."""

    name: str
    shape: tuple[int, ...]
    role: Role = "matrix"
    dtype_bytes: int = 4
    #: tensor-parallel split of the full matrix: dimension split (0 rows, 1 cols) or None
    tp_partition_dim: int | None = None
    #: number of TP ranks the full matrix is split over (1 = not split)
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ParamSpec.name must be a non-empty string")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"Invalid shape={self.shape!r} for {self.name!r}: dims must be ints >= 0")
        if self.role not in ("matrix", "aux"):
            raise ValueError(f"Invalid role={self.role!r} for {self.name!r}. Must be 'matrix' or 'aux'.")
        if self.role == "matrix" and len(self.shape) < 2:
            raise ValueError(f"{self.name!r} has shape {self.shape} but role='matrix' needs ndim >= 2")
        if self.tp_size < 1:
            raise ValueError(f"Invalid tp_size={self.tp_size} for {self.name!r}. Must be >= 1.")
        if self.tp_partition_dim not in (None, 0, 1):
            raise ValueError(f"Invalid tp_partition_dim={self.tp_partition_dim} for {self.name!r}. Must be None, 0 or 1.")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_matrix(self) -> bool:
        return self.role == "matrix"

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D shape Muon sees (trailing dims flattened, like a conv kernel)."""
        if len(self.shape) < 2:
            raise ValueError(f"{self.name!r} is not a matrix (shape {self.shape})")
        return (self.shape[0], math.prod(self.shape[1:]))

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the whole matrix before tensor-parallel splitting."""
        if self.tp_partition_dim is None or self.tp_size == 1:
            return self.shape
        s = list(self.shape)
        s[self.tp_partition_dim] *= self.tp_size
        return tuple(s)


def default_is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """ndim >= 2 and not an embedding / output head (by name)."""
    lowered = name.lower()
    return len(shape) >= 2 and not any(f in lowered for f in DEFAULT_AUX_NAME_FRAGMENTS)


def specs_from_named_shapes(
    named_shapes: Iterable[tuple[str, tuple[int, ...]]],
    matrix_filter: Callable[[str, tuple[int, ...]], bool] = default_is_matrix,
    dtype_bytes: int = 4,
) -> list[ParamSpec]:
    """Build specs from ``(name, shape)`` pairs, assigning roles with ``matrix_filter``."""
    out = []
    for name, shape in named_shapes:
        shape = tuple(int(d) for d in shape)
        role: Role = "matrix" if matrix_filter(name, shape) else "aux"
        out.append(ParamSpec(name=name, shape=shape, role=role, dtype_bytes=dtype_bytes))
    return out


def specs_from_module(module, matrix_filter: Callable[[str, tuple[int, ...]], bool] = default_is_matrix) -> list[ParamSpec]:
    """Specs of a torch module's trainable parameters (duck-typed: no torch import here).

    Megatron-style TP attributes (``tensor_model_parallel``, ``partition_dim``) are read
    from the parameter objects when present; the TP size must then be given by the caller
    via :func:`with_tp` since parameters do not carry it.
    """
    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(p.shape)
        role: Role = "matrix" if matrix_filter(name, shape) else "aux"
        pdim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
        out.append(ParamSpec(name=name, shape=shape, role=role, dtype_bytes=p.element_size(), tp_partition_dim=pdim))
    return out

"""Parameter descriptions the planners consume: shapes and roles, nothing from torch.

A ``ParamSpec`` is what a planner needs to know about one parameter tensor (of one TP
rank, when tensor parallelism splits it):

    name      "layers.3.mlp.linear_fc1.weight"
    shape     (rows, cols) as stored on this rank (TP-local)
    role      "matrix" -> the matrix optimizer (Muon, Shampoo, SOAP): atomic, never split
              "aux"    -> element-wise AdamW: may be sliced anywhere
    tp_*      Megatron-style tensor-parallel split of the full matrix, if any
    num_heads Muon per-head: the full matrix's dim 0 holds this many heads

Which parameters are matrices is decided in ONE place, :func:`is_matrix`, used by the
optimizer, its reference and the planners alike::

    1. a parameter with a ``use_muon`` attribute (DeepSpeed's tag): that decides, and
       ``use_muon=True`` on a parameter with fewer than 2 dims is an error;
    2. ndim < 2                                   -> aux
    3. name contains a ``matrix_include`` fragment -> matrix
    4. name contains a ``matrix_exclude`` fragment -> aux   (default DEFAULT_EXCLUDE:
       embeddings, lm_head, output_layer, wte/wpe)
    5. the module holding it is an output head:   -> aux   (HEAD_MODULES: a parameter
       ``<...>.output.weight``, ``<...>.head.weight``, ``<...>.classifier.weight``; the
       module name itself, so ``attention.output.dense.weight`` stays a matrix)
    6. otherwise                                  -> matrix
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

Role = Literal["matrix", "aux"]

#: name fragments (substrings, case-insensitive) that make a >=2-D parameter AdamW's
DEFAULT_EXCLUDE: tuple[str, ...] = ("embed", "lm_head", "output_layer", "wte", "wpe")
#: module names (the component before ``.weight``/``.bias``) that are output heads
HEAD_MODULES: tuple[str, ...] = ("output", "head", "classifier")


def is_matrix(name: str, shape: Sequence[int], include: Iterable[str] = (),
              exclude: Iterable[str] = DEFAULT_EXCLUDE, use_muon: bool | None = None) -> bool:
    """Matrix optimizer (True) or AdamW (False) for a trainable parameter (see module doc)."""
    if use_muon is not None:
        if use_muon and len(shape) < 2:
            raise ValueError(f"Parameter {name!r} has use_muon=True but shape {tuple(shape)}: the matrix optimizer "
                             "needs ndim >= 2. Remove the use_muon tag (it goes to AdamW).")
        return bool(use_muon)
    if len(shape) < 2:
        return False
    lowered = name.lower()
    if any(s.lower() in lowered for s in include):
        return True
    if any(s.lower() in lowered for s in exclude):
        return False
    parts = lowered.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    return module not in HEAD_MODULES


def expert_stack(name: str, shape: Sequence[int]) -> bool:
    """A >= 3-D parameter of an ``experts`` module: E expert matrices stacked along dim 0 (how
    transformers 5 stores MoE experts: ``mlp.experts.gate_up_proj`` [E, 2I, H]).  Flattening its
    trailing dims (the rule for other >= 3-D parameters, e.g. conv filters) would make it ONE
    [E, out*in] matrix, which is not E expert updates."""
    return len(shape) >= 3 and "experts" in name.split(".")


def default_is_matrix(name: str, shape: Sequence[int]) -> bool:
    """:func:`is_matrix` with the default include/exclude lists and no tag."""
    return is_matrix(name, shape)


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
    #: Muon per-head: heads along dim 0 of the FULL matrix (None = whole matrix)
    num_heads: int | None = None

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
        if self.num_heads is not None and (self.num_heads < 1 or self.full_shape[0] % self.num_heads):
            raise ValueError(f"Invalid num_heads={self.num_heads} for {self.name!r}: rows {self.full_shape[0]} "
                             "must split into that many equal heads.")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_matrix(self) -> bool:
        return self.role == "matrix"

    @property
    def is_tp_split(self) -> bool:
        return self.tp_partition_dim is not None and self.tp_size > 1

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D shape a matrix optimizer sees (trailing dims flattened, like a conv kernel)."""
        if len(self.shape) < 2:
            raise ValueError(f"{self.name!r} is not a matrix (shape {self.shape})")
        return (self.shape[0], math.prod(self.shape[1:]))

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the whole matrix before tensor-parallel splitting."""
        if not self.is_tp_split:
            return self.shape
        s = list(self.shape)
        s[self.tp_partition_dim] *= self.tp_size
        return tuple(s)

    @property
    def full_matrix_shape(self) -> tuple[int, int]:
        shape = self.full_shape
        return (shape[0], math.prod(shape[1:]))


def specs_from_named_shapes(named_shapes: Iterable[tuple[str, tuple[int, ...]]], dtype_bytes: int = 4,
                            **matrix_kw) -> list[ParamSpec]:
    """Specs from ``(name, shape)`` pairs, roles by :func:`is_matrix` (``matrix_kw``: its
    ``include``/``exclude``)."""
    out = []
    for name, shape in named_shapes:
        shape = tuple(int(d) for d in shape)
        role: Role = "matrix" if is_matrix(name, shape, **matrix_kw) else "aux"
        out.append(ParamSpec(name=name, shape=shape, role=role, dtype_bytes=dtype_bytes))
    return out


def specs_from_module(module, tp_size: int = 1, **matrix_kw) -> list[ParamSpec]:
    """Specs of a torch module's trainable parameters (duck-typed: no torch import here).

    Reads DeepSpeed's ``use_muon`` / ``muon_num_heads`` tags and ZeRO-3's ``ds_shape`` (the whole
    shape of a partitioned parameter), and Megatron's TP attributes
    (``tensor_model_parallel``, ``partition_dim``); ``tp_size`` is the TP group's size
    (parameters do not carry it).
    """
    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # ZeRO-3 partitioned: the whole shape
        role: Role = "matrix" if is_matrix(name, shape, use_muon=getattr(p, "use_muon", None), **matrix_kw) else "aux"
        split = getattr(p, "tensor_model_parallel", False) and tp_size > 1
        pdim = getattr(p, "partition_dim", None) if split else None
        heads = getattr(p, "muon_num_heads", None) if role == "matrix" else None
        out.append(ParamSpec(name=name, shape=shape, role=role, dtype_bytes=p.element_size(), tp_partition_dim=pdim,
                             tp_size=tp_size if pdim is not None else 1, num_heads=heads))
    return out

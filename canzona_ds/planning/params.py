"""Parameter descriptions the planners consume: shapes and roles, nothing from torch.

A ``ParamSpec`` is what a planner needs to know about one parameter tensor (of one TP
rank, when tensor parallelism splits it):

    name      "layers.3.mlp.linear_fc1.weight"
    shape     (rows, cols) as stored on this rank (TP-local)
    role      "matrix" -> the matrix optimizer (Muon, Shampoo, SOAP): atomic, never split
              "aux"    -> element-wise AdamW: may be sliced anywhere
    tp_*      Megatron-style tensor-parallel split of the full matrix, if any
    num_heads Muon per-head: the full matrix's dim 0 holds this many heads
    num_experts  a stack of E expert matrices along dim 0 (transformers 5 MoE): E updates of
              the trailing 2-D shape, costed E times (:func:`matrix_experts` decides)

Which parameters are matrices is decided in ONE place, :func:`is_matrix`, used by the
optimizer, its reference and the planners alike::

    1. a parameter with a ``use_muon`` attribute (DeepSpeed's tag): that decides, and
       ``use_muon=True`` on a parameter with fewer than 2 dims is an error;
    2. ndim < 2                                   -> aux
    3. name contains a ``matrix_include`` fragment -> matrix
    4. name contains a ``matrix_exclude`` fragment -> aux   (default DEFAULT_EXCLUDE:
       embeddings, lm_head, output_layer, wte/wpe)
    5. its own name ends in "bias"                -> aux   (a stack of biases, e.g. gpt-oss's
                                                           ``mlp.experts.gate_up_proj_bias`` [E, 2I])
    6. the module holding it is an output head:   -> aux   (HEAD_MODULES: a parameter
       ``<...>.output.weight``, ``<...>.head.weight``, ``<...>.classifier.weight``; the
       module name itself, so ``attention.output.dense.weight`` stays a matrix)
    7. otherwise                                  -> matrix
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
    if parts[-1].endswith("bias"):
        return False
    module = parts[-2] if len(parts) >= 2 else ""
    return module not in HEAD_MODULES


#: the path component that marks a module's >= 3-D parameters as stacks of experts (transformers
#: 5: ``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])
EXPERTS_COMPONENT = "experts"
#: HF config attributes that hold a model's number of routed experts (Qwen2/3-MoE, OLMoE:
#: num_experts; Mixtral, gpt-oss: num_local_experts; DeepSeek-V2/V3: n_routed_experts)
CONFIG_EXPERT_KEYS: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_stack(name: str, shape: Sequence[int], declared: Iterable[str] = ()) -> bool:
    """A >= 3-D parameter holding E expert matrices stacked along dim 0: a parameter of an
    ``experts`` module (a path component), or one whose name contains a ``declared`` fragment
    (ds_config ``expert_params``).  Flattening its trailing dims would make it ONE [E, out*in]
    matrix, which is not E expert updates."""
    if len(shape) < 3:
        return False
    lowered = name.lower()
    return EXPERTS_COMPONENT in lowered.split(".") or any(s.lower() in lowered for s in declared)


def matrix_experts(name: str, shape: Sequence[int], declared: Iterable[str] = (),
                   num_experts: int | None = None) -> int | None:
    """How a matrix parameter is updated, decided in ONE place (optimizer, reference, planners)::

        2-D                                   one matrix                        -> None
        >= 3-D expert stack (expert_stack)    E = shape[0] matrices of shape[1:] -> E
                                              (``num_experts``, when known, must equal shape[0])
        >= 3-D ``<module>.weight`` otherwise  one matrix [shape[0], prod(rest)]  -> None
                                              (conv kernels [out, in, *k], as Muon's reference code)
        >= 3-D anything else                  refused by name: an unnamed stack (a custom MoE's
                                              ``w1`` [E, H, I]) would be flattened into one wrong
                                              matrix

        2-D held directly by an ``experts``  refused by name (:func:`grouped_experts_error`):
        module (``...experts.weight1``)       Megatron-LM's GroupedMLP keeps all of a layer's
                                              experts in one 2-D tensor; as one matrix its update
                                              would not be E expert updates

    ``num_experts``: the model's number of experts (its config's, or ds_config's); None = not
    checked."""
    shape = tuple(shape)
    if len(shape) == 2 and grouped_experts(name):
        raise ValueError(grouped_experts_error(name, shape))
    if len(shape) < 3:
        return None
    if expert_stack(name, shape, declared):
        if num_experts is not None and shape[0] != num_experts:
            raise ValueError(f"Parameter {name!r} {list(shape)} looks like a stack of experts, but its dim 0 "
                             f"({shape[0]}) is not the model's num_experts={num_experts}. A stack must hold one "
                             "expert per index of dim 0; set optimizer params num_experts, or leave the parameter "
                             "to AdamW with matrix_exclude.")
        if shape[0] < 1:
            raise ValueError(f"Expert stack {name!r} {list(shape)} holds no expert.")
        return shape[0]
    if name.split(".")[-1] == "weight":
        return None
    raise ValueError(f"Parameter {name!r} has shape {list(shape)}: a >= 3-D parameter that is neither a module's "
                     f"'weight' (a conv kernel, flattened to [{shape[0]}, {math.prod(shape[1:])}]) nor a stack of "
                     f"experts (a path component {EXPERTS_COMPONENT!r}). If dim 0 indexes experts, list a fragment of "
                     "its name in the optimizer params' expert_params; otherwise send it to AdamW with "
                     "matrix_exclude.")


def grouped_experts(name: str) -> bool:
    """A parameter held directly by a module named ``experts`` (not by one expert inside it):
    Megatron-LM's GroupedMLP (``moe_grouped_gemm``: ``...mlp.experts.weight1`` [hidden, E*ffn],
    ``...mlp.experts.weight2`` [E*ffn, hidden]), transformers 5's 3-D stacks.  DeepSpeed MoE's
    (``experts.deepspeed_experts.<e>.<layer>.weight``), Megatron's SequentialMLP
    (``experts.local_experts.<e>.linear_fc1.weight``) and TEGroupedMLP
    (``experts.linear_fc1.weight<e>``) experts are 2-D parameters of their own, below it."""
    parts = name.lower().split(".")
    return len(parts) >= 2 and parts[-2] == EXPERTS_COMPONENT


def grouped_experts_error(name: str, shape: Sequence[int]) -> str:
    grouped = name.split(".")[-1] in ("weight1", "weight2")
    what = ("Megatron-LM's GroupedMLP (moe_grouped_gemm) keeps all of a layer's experts in one 2-D weight1 "
            "[hidden, E*ffn] / weight2 [E*ffn, hidden], viewed as E expert matrices only in its forward"
            if grouped else "a 2-D parameter held directly by an 'experts' module holds all of its experts")
    return (f"Parameter {name!r} {list(shape)}: {what}; updated as ONE matrix it would not get E expert updates "
            "(no silent flattening). Give each expert its own parameter instead: Megatron's SequentialMLP (no "
            "--moe-grouped-gemm), TEGroupedMLP (Transformer Engine: linear_fc1.weight<e> per expert), DeepSpeed MoE "
            "(deepspeed.moe.layer.MoE), or a 3-D [E, out, in] stack under an 'experts' module; or send it to AdamW "
            "with matrix_exclude.")


def model_num_experts(module) -> int | None:
    """The number of routed experts in a model's (HF-style) ``config``, or None where none is
    at hand (duck-typed: no torch/transformers import)."""
    config = getattr(module, "config", None)
    for key in CONFIG_EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


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
    #: a stack of this many expert matrices along dim 0 (None = one matrix): E independent
    #: updates of the trailing shape, costed E times (:func:`matrix_experts`)
    num_experts: int | None = None

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
        if self.num_experts is not None:
            if self.role != "matrix" or len(self.shape) < 3 or self.num_experts != self.shape[0]:
                raise ValueError(f"Invalid num_experts={self.num_experts} for {self.name!r} {self.shape}: an expert "
                                 "stack is a >= 3-D matrix with one expert per index of dim 0.")
            if self.is_tp_split or self.num_heads is not None:
                raise ValueError(f"Expert stack {self.name!r} cannot be tensor-parallel or per-head.")

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
    def matrix_count(self) -> int:
        """Independent matrices in this parameter: its experts, or 1."""
        return 1 if self.num_experts is None else self.num_experts

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The 2-D shape a matrix optimizer sees (trailing dims flattened, like a conv kernel);
        for an expert stack, ONE expert's."""
        if len(self.shape) < 2:
            raise ValueError(f"{self.name!r} is not a matrix (shape {self.shape})")
        shape = self.shape[1:] if self.num_experts is not None else self.shape
        return (shape[0], math.prod(shape[1:]))

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
        if self.num_experts is not None:
            return self.matrix_shape
        shape = self.full_shape
        return (shape[0], math.prod(shape[1:]))


def split_experts(specs: Iterable[ParamSpec]) -> list[ParamSpec]:
    """Every expert stack replaced by its E experts as 2-D matrices of their own (``"<stack>[e]"``):
    the plan a per-expert ownership unit would allow, against which keeping stacks whole (what the
    ZeRO-1/2 layout does) is measured (``planning/compare.py``, docs/zero.md)."""
    out = []
    for s in specs:
        if s.num_experts is None:
            out.append(s)
            continue
        out += [ParamSpec(f"{s.name}[{e}]", tuple(s.shape[1:]), "matrix", s.dtype_bytes) for e in range(s.num_experts)]
    return out


def specs_from_named_shapes(named_shapes: Iterable[tuple[str, tuple[int, ...]]], dtype_bytes: int = 4,
                            **matrix_kw) -> list[ParamSpec]:
    """Specs from ``(name, shape)`` pairs, roles by :func:`is_matrix` (``matrix_kw``: its
    ``include``/``exclude``)."""
    out = []
    for name, shape in named_shapes:
        shape = tuple(int(d) for d in shape)
        role: Role = "matrix" if is_matrix(name, shape, **matrix_kw) else "aux"
        experts = matrix_experts(name, shape) if role == "matrix" else None
        out.append(ParamSpec(name=name, shape=shape, role=role, dtype_bytes=dtype_bytes, num_experts=experts))
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
        experts = matrix_experts(name, shape, num_experts=model_num_experts(module)) if role == "matrix" else None
        out.append(ParamSpec(name=name, shape=shape, role=role, dtype_bytes=p.element_size(), tp_partition_dim=pdim,
                             tp_size=tp_size if pdim is not None else 1, num_heads=heads, num_experts=experts))
    return out

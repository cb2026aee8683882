"""The matrix-optimizer interface: a rule for one whole matrix, plus what it costs.

Every matrix optimizer canzona-ds runs (Muon, Shampoo, SOAP, or one you write) is a
:class:`MatrixRule`.  The distributed machinery never looks inside a rule: the DP owner
(ZeRO) or the TP host (after the micro-group all-to-all) calls the same three methods on
the FULL matrix, and every rank applies the result the same way::

    state = rule.init_state(info, like=master_weight)        # once, on the weight's device
    D     = rule.direction(G, state, info, step)             # full gradient -> full direction
    decay, step_size = rule.scales(lr, weight_decay, info, step)
    W.mul_(decay).add_(D, alpha=-step_size)                  # apply_update(), element-wise

``apply_update`` is element-wise, so a TP rank applying its shard of ``D`` gets exactly
its shard of the single-process update: that is why hosting is exact.  ``step`` is the
optimizer's step count (1 for the first step), the same on every rank, so scales need no
per-matrix state and every TP rank can compute them.

A rule never sees a stack of experts (a 3-D MoE parameter, ``MatrixInfo.num_experts``):
:func:`rule_step` runs it on each expert ``W[e]`` as a matrix of its own, with its own state.

A rule is also a cost model (pure arithmetic, no tensors): :meth:`MatrixRule.flops` and
:meth:`MatrixRule.state_bytes` of a 2-D shape are what the DP planner and the TP
scheduler balance.  Adding an optimizer = one file with a ``MatrixRule`` subclass and a
``register_rule`` call (see ``canzona_ds/optim/__init__.py``).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..flops import Flops


@dataclass(frozen=True)
class MatrixInfo:
    """What a rule knows about one matrix besides its gradient."""

    name: str
    #: shape of the whole (TP=1) matrix; trailing dims are flattened into columns
    shape: tuple[int, ...]
    #: Muon per-head orthogonalisation: dim 0 holds this many equal heads (None: whole matrix)
    num_heads: int | None = None
    #: a stack of this many expert matrices along dim 0 (None: one matrix).  A rule never sees
    #: a stack: :func:`rule_step` runs it on every expert (:meth:`expert`) as its own matrix
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if self.num_experts is not None and (len(self.shape) < 3 or self.shape[0] != self.num_experts
                                             or self.num_heads is not None):
            raise ValueError(f"Invalid num_experts={self.num_experts} for {self.name!r} {list(self.shape)}: an expert "
                             "stack is >= 3-D with one expert per index of dim 0 (and not per-head).")

    @property
    def shape2d(self) -> tuple[int, int]:
        """The 2-D shape the rule works on (one expert's, for a stack)."""
        shape = self.shape[1:] if self.num_experts is not None else self.shape
        return (shape[0], math.prod(shape[1:]))

    def expert(self, e: int) -> "MatrixInfo":
        """Expert ``e`` of a stack as its own matrix, named ``<stack>[e]`` (its state's key)."""
        return MatrixInfo(expert_name(self.name, e), tuple(self.shape[1:]))

    def state_infos(self) -> list["MatrixInfo"]:
        """The matrices whose rule state this parameter keeps: itself, or each expert."""
        if self.num_experts is None:
            return [self]
        return [self.expert(e) for e in range(self.num_experts)]


def expert_name(stack: str, e: int) -> str:
    """The name (and state key) of expert ``e`` of the stack ``stack``: ``"<stack>[e]"``."""
    return f"{stack}[{e}]"


#: FLOPs of a symmetric eigendecomposition with eigenvectors, per k^3 (Golub & Van Loan:
#: tridiagonalisation 4/3 k^3 + accumulating Q 4/3 k^3 + implicit QR sweeps ~6 k^3)
EIGH_FLOPS_PER_K3 = 9.0
#: FLOPs of a Householder QR of a k x k matrix with Q formed, per k^3 (4/3 + 4/3, rounded)
QR_FLOPS_PER_K3 = 8.0 / 3.0


def matmul_flops(m: int, k: int, n: int) -> float:
    """(m x k) @ (k x n)."""
    return 2.0 * m * k * n


class MatrixRule(ABC):
    """One matrix optimizer: its math on one whole matrix and its cost.

    Subclasses are frozen dataclasses of their hyper-parameters (validated in
    ``__post_init__``; every field documented with ``#:`` comments), so two ranks holding
    equal rules compute identical updates and :meth:`describe` can fingerprint them.
    """

    #: registry name ("muon", "shampoo", "soap")
    name: ClassVar[str]
    #: default learning rate of the matrix half when ds_config gives no ``lr``
    default_lr: ClassVar[float]
    #: default AdamW learning rate of the other parameters when ds_config gives no ``lr``
    default_adam_lr: ClassVar[float]
    #: ds_config ``params`` keys that mean something else for this rule than the field of
    #: the same name would suggest, e.g. Muon's ``betas``/``eps`` are the AdamW half's
    #: (DeepSpeed's own Muon reads them that way).  key -> canonical CanzonaConfig key.
    config_aliases: ClassVar[Mapping[str, str]] = {}

    # ---------------------------------------------------------------- the math
    @abstractmethod
    def init_state(self, info: MatrixInfo, like: Tensor) -> dict[str, Tensor]:
        """Fresh state of one matrix, on ``like``'s device (the fp32 master weight)."""

    @abstractmethod
    def direction(self, grad: Tensor, state: dict[str, Tensor], info: MatrixInfo, step: int) -> Tensor:
        """Update ``state`` in place from the full gradient and return the update direction
        (``grad``'s shape).  ``step`` counts optimizer steps from 1."""

    #: state keys updated element-wise from the gradient before anything else (each the
    #: matrix's shape): :meth:`pre_direction` does that part, :meth:`direction_from` the rest.
    #: A matrix hosted over DP (the mixed ZeRO layout) keeps these with its pieces, so its host
    #: holds only the other keys (placement/hosted.py; Muon's momentum: 4 bytes per element)
    elementwise_state: ClassVar[tuple[str, ...]] = ()

    def pre_direction(self, grad: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Update the :attr:`elementwise_state` keys of ``state`` from ``grad`` (the whole matrix
        or any piece of it, the state cut alike) and return what :meth:`direction_from` takes,
        element for element.  Default (no element-wise state): ``grad``."""
        return grad

    def direction_from(self, pre: Tensor, state: dict[str, Tensor], info: MatrixInfo, step: int) -> Tensor:
        """The direction from :meth:`pre_direction`'s result of the whole matrix and the other
        state keys.  ``direction(g, st, ...) == direction_from(pre_direction(g, st), st, ...)``."""
        return self.direction(pre, state, info, step)

    def stack_direction(self, grad: Tensor | list[Tensor], states: list[dict[str, Tensor]],
                        infos: list[MatrixInfo], step: int) -> Tensor | None:
        """Directions of k same-shape matrices at once (``grad``: an expert stack [E, ...] or a list
        of k gradients of one shape, :func:`rule_steps`; ``states[i]``/``infos[i]``: matrix i's),
        stacked [k, ...] and equal to :meth:`direction` on each matrix, or None to let the caller
        loop.  A rule overrides it to batch (Muon: one batched Newton-Schulz instead of k)."""
        return None

    def direction_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """dtype of :meth:`direction`'s result for a gradient of ``grad_dtype``; TP hosts send
        direction shards in it, so every rank must know it without being told."""
        return grad_dtype

    def scales(self, lr: float, weight_decay: float, info: MatrixInfo, step: int) -> tuple[float, float]:
        """(decay factor, step size) for ``W.mul_(decay).add_(D, alpha=-step_size)``.
        Default: decoupled weight decay ``1 - lr * weight_decay`` and ``lr``."""
        return 1.0 - lr * weight_decay, lr

    def state_axes(self, key: str, shape: tuple[int, ...], info: MatrixInfo) -> tuple[str, ...] | None:
        """What each axis of state tensor ``key`` indexes: "row" or "col" of the matrix, or
        "fixed" (an axis no permutation of the matrix's rows/columns touches, e.g. an
        eigenbasis coordinate).  Used to move the state of a tensor-parallel matrix between TP
        layouts (whose full matrices differ by a row or column permutation); None = this
        state cannot follow such a permutation (the TP size of a checkpoint cannot change).
        Default: a tensor of the matrix's own 2-D shape is indexed like the matrix."""
        return ("row", "col") if tuple(shape) == info.shape2d or tuple(shape) == tuple(info.shape) else None

    # ---------------------------------------------------------------- the cost
    @abstractmethod
    def flops(self, shape: tuple[int, int], num_heads: int | None = None) -> Flops:
        """FLOPs of one step of this rule on a matrix of 2-D ``shape``."""

    @abstractmethod
    def state_bytes(self, shape: tuple[int, int], num_heads: int | None = None) -> float:
        """Bytes of optimizer state this rule keeps for a matrix of 2-D ``shape``
        (not counting the master weight and gradient, which every optimizer has)."""

    # ---------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        """Name and every hyper-parameter, JSON-serialisable (for fingerprints and logs)."""
        out: dict[str, Any] = {"rule": self.name}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def apply_update(param: Tensor, direction: Tensor, decay: float, step_size: float) -> None:
    """``param = decay * param - step_size * direction`` in ``param``'s dtype (in place).

    The order (decay first, then the step) is torch.optim.Muon's / AdamW's, so Muon is
    bit-exact against torch.  Element-wise: applying a shard of ``direction`` to a shard
    of ``param`` gives that shard of the full update.
    """
    if decay != 1.0:
        param.mul_(decay)
    if step_size != 0.0:
        param.add_(direction.to(param.dtype), alpha=-step_size)


def rule_state(states: dict[str, dict[str, Tensor]], name: str, rule: "MatrixRule", info: MatrixInfo,
               like: Tensor) -> dict[str, Tensor]:
    """The rule state of matrix ``name`` in ``states``, created (on ``like``'s device) the
    first time it is asked for."""
    state = states.get(name)
    if state is None:
        state = states[name] = rule.init_state(info, like=like)
    return state


def apply_rule_update(param: Tensor, direction: Tensor, rule: "MatrixRule", info: MatrixInfo, step: int,
                      lr: float, weight_decay: float) -> None:
    """Apply ``direction`` (a whole matrix's, or this rank's shard of it) with the rule's scales
    for the WHOLE matrix ``info``: the one place a rule's update reaches a parameter."""
    decay, step_size = rule.scales(lr, weight_decay, info, step)
    apply_update(param, direction, decay, step_size)


def rule_direction(rule: "MatrixRule", grad: Tensor, states: dict[str, dict[str, Tensor]], info: MatrixInfo,
                   step: int) -> Tensor:
    """The direction of one whole tensor ``info`` from its whole gradient (``grad``'s shape), its
    state in ``states`` created on first use: ``rule.direction`` of a matrix, and for an expert
    stack every expert's as :func:`rule_step` computes it (state ``states["<name>[e]"]``,
    ``rule.stack_direction`` where the rule batches, else one ``direction`` per expert).

    What a host (TP, ZeRO-3, the mixed ZeRO layout) runs; every rank then applies its piece with
    :func:`apply_rule_update` and ``info`` itself: a rule's scales depend on ``shape2d``, which is
    one expert's for a stack, so the pieces get the per-expert scales."""
    if info.num_experts is None:
        return rule.direction(grad, rule_state(states, info.name, rule, info, like=grad), info, step)
    experts = info.state_infos()
    expert_states = [rule_state(states, i.name, rule, i, like=grad[e]) for e, i in enumerate(experts)]
    D = rule.stack_direction(grad, expert_states, experts, step)
    if D is None:
        D = torch.stack([rule.direction(grad[e], expert_states[e], i, step) for e, i in enumerate(experts)])
    return D


def rule_step(rule: "MatrixRule", param: Tensor, grad: Tensor, states: dict[str, dict[str, Tensor]],
              info: MatrixInfo, step: int, lr: float, weight_decay: float) -> None:
    """One rule update of one whole matrix, in place::

        state = states[name] (created on first use);  D = rule.direction(grad, state, info, step)
        param <- decay * param - step_size * D           (rule.scales)

    What every placement (local, ZeRO-owned; the TP/DP host computes ``direction`` itself and
    each rank applies its shard with :func:`apply_rule_update`), the single-process reference
    and the baselines call.

    An expert stack (``info.num_experts`` = E) is E independent matrices: expert e is updated
    on the view ``param[e]`` with its own state ``states["<name>[e]"]`` (:meth:`MatrixInfo.expert`),
    exactly as if it were a 2-D parameter of its own."""
    if info.num_experts is not None:
        experts = info.state_infos()
        expert_states = [rule_state(states, i.name, rule, i, like=param[e]) for e, i in enumerate(experts)]
        D = rule.stack_direction(grad, expert_states, experts, step)
        if D is None:
            for e, i in enumerate(experts):
                apply_rule_update(param[e], rule.direction(grad[e], expert_states[e], i, step), rule, i, step, lr,
                                  weight_decay)
        else:  # every expert has the same shape, hence the same scales: one element-wise update
            apply_rule_update(param, D, rule, experts[0], step, lr, weight_decay)
        return
    state = rule_state(states, info.name, rule, info, like=param)
    apply_rule_update(param, rule.direction(grad, state, info, step), rule, info, step, lr, weight_decay)


#: rule_steps: most gradient elements one batch stacks (2^27: 512 MiB in fp32), so batching
#: same-shape matrices never holds more than that in extra copies at once
BATCH_MAX_NUMEL = 2 ** 27


def rule_steps(rule: "MatrixRule", items: list[tuple[Tensor, Tensor, MatrixInfo]],
               states: dict[str, dict[str, Tensor]], step: int, lr: float, weight_decay: float) -> None:
    """:func:`rule_step` on every (param, grad, info) of ``items`` -- the whole matrices one rank
    updates -- with the plain 2-D matrices of one (shape, dtype, device) handed to
    ``rule.stack_direction`` together, the way an expert stack's experts are::

        items:  q0 (64,256)  k0 (32,256)  q1 (64,256)  stack E (4,64,256)  q2 (64,256)
        groups: [q0, q1, q2] -> stack_direction once  |  k0 -> rule_step  |  E -> rule_step (its own stack)

    The result per matrix is the rule's ``direction`` (``stack_direction``'s contract), so the
    updates equal :func:`rule_step` one by one; only the kernel count changes.  A group is cut
    into batches of at most ``BATCH_MAX_NUMEL`` gradient elements.  Matrices with heads or
    experts keep their own path."""
    groups: dict[tuple, list[tuple[Tensor, Tensor, MatrixInfo]]] = {}
    for param, grad, info in items:
        if info.num_experts is not None or info.num_heads or grad.ndim != 2:
            rule_step(rule, param, grad, states, info, step, lr, weight_decay)
            continue
        groups.setdefault((tuple(grad.shape), grad.dtype, grad.device), []).append((param, grad, info))
    chunks = []
    for members in groups.values():  # a batch stacks copies of its gradients: bounded in size
        per = max(1, BATCH_MAX_NUMEL // members[0][1].numel())
        chunks += [members[i:i + per] for i in range(0, len(members), per)]
    for members in chunks:
        D = None
        if len(members) > 1:
            infos = [info for _, _, info in members]
            member_states = [rule_state(states, i.name, rule, i, like=p) for p, _, i in members]
            D = rule.stack_direction([g for _, g, _ in members], member_states, infos, step)
        if D is None:
            for param, grad, info in members:
                rule_step(rule, param, grad, states, info, step, lr, weight_decay)
            continue
        for (param, _, info), d in zip(members, D.unbind(0)):
            apply_rule_update(param, d, rule, info, step, lr, weight_decay)


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a finite number within bounds."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        where = f" Must be a finite number within {lo or '(-inf'}, {hi or 'inf)'}."
        raise ValueError(f"Invalid {name}={value!r}.{where}")


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"Invalid {name}={value!r}. Must be an integer within [{low}, {high}].")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}={value!r}. Must be true or false.")


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"Invalid {name}={value!r}. Allowed: {list(allowed)}.")


def eigh_descending(matrix: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns) of a symmetric matrix, computed
    in ``dtype``; retried in float64 if the solver fails to converge in a lower precision.
    Returned in ``dtype``."""
    m = matrix.to(dtype)
    try:
        vals, vecs = torch.linalg.eigh(m)
    except torch.linalg.LinAlgError:
        if dtype == torch.float64:
            raise
        vals, vecs = torch.linalg.eigh(m.double())
        vals, vecs = vals.to(dtype), vecs.to(dtype)
    return vals.flip(0), vecs.flip(1)

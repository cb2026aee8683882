"""Cost models: the load W(p) a planner balances, for any matrix optimizer.

A *cost model* is any object with the two methods of ``canzona_ds.optim.rule.MatrixRule``
that are pure arithmetic::

    flops(shape2d, num_heads=None) -> Flops(amortised, peak)   one step's FLOPs
    state_bytes(shape2d, num_heads=None) -> float              optimizer-state bytes

so the planners here stay free of torch: the caller passes the configured rule (Muon with
its ns_steps, Shampoo with its precondition_frequency, ...), and ``canzona_ds.optim.
cost_model("shampoo", ...)`` builds one by name.  An expert stack (``ParamSpec.num_experts``
= E) is E matrices of one expert's 2-D shape: its FLOPs and state are E times one expert's.

Cost names a planner can balance (``COST_MODELS``):

``numel``       elements of the parameter (the paper's default proxy)
``flops``       FLOPs per step, amortised over the rule's refresh period
``peak_flops``  FLOPs of the step that also does the periodic work (eigendecompositions)
``memory``      bytes the owner holds: fp32 master + fp32 gradient + optimizer state

Where a TP-split matrix is charged (paper §4): its update runs on ONE host of its TP
group, on the FULL matrix.  So

* ``hosted=True`` (TP micro-group scheduling): the full matrix's cost, on its host;
* ``hosted=False`` (the DP plan, made over one TP rank's shards): the DP owner's share,
  ``full cost / tp_size`` for compute and state (the TP group's hosts share the owned
  matrices) plus the local shard's master weight and gradient.  Weighing shards by their
  own shape instead mis-weights hosted matrices by 6-47x on Qwen3-32B at TP=8.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from ..flops import Flops
from .params import ParamSpec

#: bytes per element of the fp32 master weight + fp32 gradient partition
MASTER_GRAD_BYTES = 4 + 4
#: AdamW (non-matrix parameters): master + gradient + two fp32 moments
AUX_BYTES_PER_ELEMENT = MASTER_GRAD_BYTES + 2 * 4

COST_MODELS = ("numel", "flops", "peak_flops", "memory")


class CostModel(Protocol):
    name: str

    def flops(self, shape: tuple[int, int], num_heads: int | None = None) -> Flops: ...

    def state_bytes(self, shape: tuple[int, int], num_heads: int | None = None) -> float: ...


def check_cost(cost: str) -> None:
    if cost not in COST_MODELS:
        raise ValueError(f"Invalid cost model={cost!r}. Allowed: {list(COST_MODELS)}.")


def _need_model(model: CostModel | None, cost: str) -> CostModel:
    if model is None:
        raise ValueError(f"cost model {cost!r} needs the optimizer's cost model (e.g. canzona_ds.optim."
                         "cost_model('muon')); only 'numel' works without one.")
    return model


def task_cost(spec: ParamSpec, cost: str, model: CostModel | None = None, hosted: bool = False) -> float:
    """Load of one parameter under ``cost`` (0 FLOPs for AdamW parameters).

    ``hosted``: the whole TP matrix on its host (TP scheduling); otherwise the DP owner's
    share (see the module doc)."""
    check_cost(cost)
    split = spec.is_tp_split
    share = 1.0 if (hosted or not split) else 1.0 / spec.tp_size
    if cost == "numel":
        return float(spec.numel * (spec.tp_size if hosted and split else 1))
    if not spec.is_matrix:
        return float(spec.numel) * AUX_BYTES_PER_ELEMENT if cost == "memory" else 0.0
    model = _need_model(model, cost)
    shape = spec.full_matrix_shape if split else spec.matrix_shape
    count = spec.matrix_count  # an expert stack: E matrices of one expert's shape
    if cost == "memory":
        local = spec.numel * (spec.tp_size if hosted and split else 1)
        return float(local) * MASTER_GRAD_BYTES + count * model.state_bytes(shape, spec.num_heads) * share
    f = model.flops(shape, spec.num_heads)
    return count * (f.amortised if cost == "flops" else f.peak) * share


def slice_cost(spec: ParamSpec, cost: str, load: float, part: int) -> float:
    """Load on a rank that holds ``part`` of ``spec``'s elements when DeepSpeed's stock
    equal-chunk slicing cuts it (``load`` = :func:`task_cost` of the whole spec).

    A cut matrix is updated in full on every rank it touches (DeepSpeed's Muon runs the
    whole-matrix step on each), so its FLOPs and optimizer state count in full there;
    its master weight and gradient (``memory``) and ``numel`` pro rata to the slice.  An
    AdamW (element-wise) parameter is charged pro rata in every cost."""
    check_cost(cost)
    numel = spec.numel
    if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part <= numel:
        raise ValueError(f"Invalid part={part!r} of {spec.name!r}: must be an int within [0, {numel}].")
    if spec.is_matrix and cost in ("flops", "peak_flops"):
        return float(load)
    if spec.is_matrix and cost == "memory":
        return float(part) * MASTER_GRAD_BYTES + (load - numel * MASTER_GRAD_BYTES)
    return load * part / numel if numel else 0.0


def cost_vector(specs: Sequence[ParamSpec], cost: str = "numel", model: CostModel | None = None,
                hosted: bool = False) -> list[float]:
    """:func:`task_cost` of every spec."""
    return [task_cost(s, cost, model, hosted) for s in specs]


def stack_bound(specs: Sequence[ParamSpec], world_size: int, cost: str = "flops",
                model: CostModel | None = None) -> float:
    """Busiest rank / average that keeping every expert stack whole on one owner forces at least:
    the largest stack's load over the average per-rank load (0.0 without stacks).  Above 1 no
    plan of whole stacks balances; each expert as its own unit would (docs/zero.md)."""
    loads = cost_vector(specs, cost, model)
    stacks = [c for s, c in zip(specs, loads) if s.num_experts is not None]
    total = sum(loads)
    return max(stacks) * world_size / total if stacks and total > 0 else 0.0

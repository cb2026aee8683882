"""The planners by name (``DP_PLANNERS``, what ``canzona_dp.planner`` and ``canzona-plan`` accept)
and :func:`plan_dp`, the one entry point: cost vector from the cost model, then the named planner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..params import ParamSpec
from .multi_lpt import plan_multi_lpt
from .paper import (DEFAULT_BUCKET_NUMEL, plan_alpha_balanced, plan_equal_chunk, plan_layerwise, plan_lpt,
                    plan_naive_atomic, plan_paper_naive)
from .plan import OwnershipPlan, _validate


@dataclass(frozen=True)
class DPRequest:
    """Everything a DP planner may use; each registry entry picks what it needs."""

    specs: Sequence[ParamSpec]
    world_size: int
    #: per spec, the cost-model load
    loads: Sequence[float]
    cost_model: str
    alpha: float
    #: the optimizer's cost model (planning.cost.CostModel), or None (numel only)
    model: object
    #: bucket size of ``alpha_balanced`` and ``paper_naive`` (elements); None = one bucket
    bucket_numel: int | None


#: planner name -> fn(DPRequest) -> OwnershipPlan
DP_PLANNERS: dict[str, Callable[[DPRequest], OwnershipPlan]] = {
    "equal_chunk": lambda q: plan_equal_chunk(q.specs, q.world_size, q.loads, q.cost_model),
    "naive_atomic": lambda q: plan_naive_atomic(q.specs, q.world_size, q.loads, q.cost_model),
    "alpha_balanced": lambda q: plan_alpha_balanced(
        q.specs, q.world_size, q.loads, q.cost_model, alpha=q.alpha, bucket_numel=q.bucket_numel
    ),
    "lpt": lambda q: plan_lpt(q.specs, q.world_size, q.loads, q.cost_model),
    "multi_lpt": lambda q: plan_multi_lpt(q.specs, q.world_size, q.loads, q.cost_model, q.model),
    "paper_naive": lambda q: plan_paper_naive(q.specs, q.world_size, q.loads, q.cost_model,
                                              bucket_numel=q.bucket_numel),
    "layerwise": lambda q: plan_layerwise(q.specs, q.world_size, q.loads, q.cost_model),
}
#: planners that keep every matrix whole on one rank
ATOMIC_DP_PLANNERS = ("naive_atomic", "alpha_balanced", "lpt", "multi_lpt", "paper_naive", "layerwise")
#: planners whose plan depends on the bucket size (``bucket_numel``)
BUCKETED_DP_PLANNERS = ("alpha_balanced", "paper_naive")
DEFAULT_DP_PLANNER = "multi_lpt"


def plan_dp(
    specs: Sequence[ParamSpec],
    world_size: int,
    planner: str = DEFAULT_DP_PLANNER,
    alpha: float = 1.0,
    cost: str = "numel",
    model=None,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
) -> OwnershipPlan:
    """Plan ownership of ``specs`` (all atomic) over ``world_size`` DP ranks.

    Args:
        planner: planner name (see ``DP_PLANNERS``).
        alpha: balance factor of ``alpha_balanced`` (ignored by the others), in [0, 1].
        cost: cost name the planner balances (``planning.cost.COST_MODELS``).
        model: the optimizer's cost model (e.g. ``canzona_ds.optim.cost_model("muon")``);
            needed for every cost but ``numel``; ``multi_lpt`` also balances its FLOPs and
            memory.  TP-split specs are charged the DP owner's share of the full matrix.
        bucket_numel: bucket size of ``alpha_balanced`` and ``paper_naive`` in elements
            (None: one bucket); default DeepSpeed's ``reduce_bucket_size``.
    """
    from ..cost import check_cost, cost_vector  # local import keeps the module graph one-way

    _validate(specs, world_size, alpha)
    check_cost(cost)
    if planner not in DP_PLANNERS:
        raise ValueError(f"Unknown DP planner={planner!r}. Allowed: {sorted(DP_PLANNERS)}")
    loads = cost_vector(specs, cost=cost, model=model)
    request = DPRequest(specs, world_size, loads, cost, alpha, model, bucket_numel)
    return DP_PLANNERS[planner](request)

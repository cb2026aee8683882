"""Owned or mixed: the ZeRO-1/2 layout of one matrix group.  :func:`choose_layout` is the
documented ``layout`` rule ("owned", "mixed", "auto"); :func:`plan_mixed_dp` the mixed layout's
plan (planning/mixed.py); :func:`owned_step_bytes` what an atomic plan's step moves."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from ..params import ParamSpec
from .paper import DEFAULT_BUCKET_NUMEL
from .plan import MIXED, OwnershipPlan, _finish, _validate
from .registry import DEFAULT_DP_PLANNER, plan_dp


#: ``layout`` settings: "owned" (atomic ownership, planned padding), "mixed" (owned + hosted
#: over DP, no padding), "auto" (owned unless its padding exceeds ``max_padding``)
LAYOUTS = ("auto", "owned", "mixed")
#: the default ``max_padding`` of ``layout="auto"`` (padding / useful elements of the owned layout)
DEFAULT_MAX_PADDING = 0.02


def plan_mixed_dp(specs: Sequence[ParamSpec], world_size: int, loads: Sequence[float], cost_model: str = "numel",
                  model=None, param_alignment: int = 1) -> OwnershipPlan:
    """The mixed layout's plan (planning/mixed.py): owned matrices whole in equal chunks, the
    rest hosted over the DP group.  ``rank_params``: owned matrices per rank (buffer order);
    ``owner``: -1 for hosted ones; ``host``: who computes each update; ``rank_load``: the
    cost-model load of everything a rank computes (owned + hosted); ``rank_numel``: elements
    of its range.  ``extra["step_bytes"]``: per-step communication (mixed.step_bytes)."""
    from ..cost import cost_vector
    from ..mixed import plan_mixed, step_bytes

    t0 = time.perf_counter()
    _validate(specs, world_size, None)
    if model is not None:
        flops = cost_vector(specs, "flops", model)
        memory = cost_vector(specs, "memory", model)
        state = [m - s.numel * 8 for m, s in zip(memory, specs)]  # planning.cost.MASTER_GRAD_BYTES
    else:
        flops, state = [float(s.numel) for s in specs], [0.0] * len(specs)
    direction_bytes = 4  # fp32 gradients travel to the host; directions come back in the rule's dtype
    if model is not None and hasattr(model, "direction_dtype"):
        import torch  # only with a rule object, which is torch code itself

        direction_bytes = model.direction_dtype(torch.float32).itemsize
    # the rule's element-wise state (Muon's momentum, fp32) stays with a hosted matrix's pieces
    elementwise_bytes = 4.0 * len(getattr(model, "elementwise_state", ()))
    got = plan_mixed(specs, world_size, flops, state, param_alignment=param_alignment,
                     direction_bytes=direction_bytes, elementwise_bytes=elementwise_bytes)
    order, owner, host, layout = got["order"], got["owner"], got["host"], got["layout"]
    rank_params: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        if owner[i] >= 0:
            rank_params[owner[i]].append(i)
    rank_load = [0.0] * world_size
    for i, h in enumerate(host):
        rank_load[h] += loads[i]
    P = layout.shard_numel
    rank_numel = [0] * world_size
    for off, n in zip(layout.offsets, layout.numels):
        for r in range(off // P, min(world_size - 1, (off + max(n, 1) - 1) // P) + 1):
            rank_numel[r] += max(0, min(off + n, (r + 1) * P) - max(off, r * P))
    host_at = [host[i] if owner[i] < 0 else -1 for i in order]
    rank_hosted = [0] * world_size  # hosted elements in each rank's range (their element-wise state)
    for off, n, o in zip(layout.offsets, layout.numels, layout.owner_at):
        if o < 0:
            for r in range(off // P, min(world_size - 1, (off + max(n, 1) - 1) // P) + 1):
                rank_hosted[r] += max(0, min(off + n, (r + 1) * P) - max(off, r * P))
    extra = {"elementwise_bytes": elementwise_bytes, "rank_hosted_numel": rank_hosted, "step_bytes": step_bytes(layout, host_at, direction_bytes=direction_bytes), "hosted_numel": sum(specs[i].numel for i in order
                                                                               if owner[i] < 0)}
    plan = _finish(MIXED, specs, world_size, rank_params, loads, t0, cost_model, owner=list(owner),
                   rank_numel=rank_numel, rank_load=rank_load, extra=extra)
    return replace(plan, order=tuple(order), host=tuple(host))


def owned_step_bytes(plan: OwnershipPlan) -> dict:
    """Per-step communication of an atomic plan's planned-padding layout (no hosted step):
    :func:`canzona_ds.planning.mixed.step_bytes`."""
    from ..mixed import step_bytes

    return step_bytes(plan.nonempty_first().layout())


def choose_layout(specs: Sequence[ParamSpec], world_size: int, layout: str = "auto",
                  max_padding: float = DEFAULT_MAX_PADDING, planner: str = DEFAULT_DP_PLANNER, alpha: float = 1.0,
                  cost: str = "numel", model=None, bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
                  allow_mixed: bool = True, blocked: str = "tensor-parallel ones without a DP x TP grid group"
                  ) -> tuple[OwnershipPlan, OwnershipPlan | None, str]:
    """The documented rule: ``layout="owned"`` is the atomic plan of ``planner``; ``"mixed"``
    the mixed layout; ``"auto"`` the atomic plan unless BOTH its planned padding (DeepSpeed's
    default alignment) exceeds ``max_padding`` AND the mixed layout's step is cheaper for the
    busiest rank (``step_bytes(...)["rank_cost"]``: its share of ZeRO's gradient reduction and
    all-gather of the buffer, padded or not, plus the hosted all-to-alls' bytes and latency,
    planning/mixed.py); then the mixed one.  ``allow_mixed=False``
    (tensor-parallel matrices without a DP x TP grid group, which cannot be hosted) keeps the
    atomic plan under "auto".  Under DeepSpeed MoE each matrix group (dense, each expert group)
    is chosen by this rule on its own.  Returns (chosen plan, the atomic plan or None, why)."""
    if layout not in LAYOUTS:
        raise ValueError(f"Invalid layout={layout!r}. Allowed: {list(LAYOUTS)}.")
    if isinstance(max_padding, bool) or not isinstance(max_padding, (int, float)) or not max_padding >= 0:
        raise ValueError(f"Invalid max_padding={max_padding!r}. Must be a number >= 0 (a fraction: 0.02 = 2%).")
    from ..cost import cost_vector

    if layout == "mixed":
        return plan_mixed_dp(specs, world_size, cost_vector(specs, cost, model), cost, model), None, "layout=mixed"
    atomic = plan_dp(specs, world_size, planner=planner, alpha=alpha, cost=cost, model=model,
                     bucket_numel=bucket_numel)
    if layout == "owned" or atomic.split_params:
        return atomic, atomic, "layout=owned"
    pad = atomic.padding_fraction
    if pad <= max_padding:
        return atomic, atomic, f"owned padding {pad:.2%} <= max_padding {max_padding:.2%}"
    mixed = plan_mixed_dp(specs, world_size, cost_vector(specs, cost, model), cost, model)
    owned_cost, mixed_cost = owned_step_bytes(atomic)["rank_cost"], mixed.extra["step_bytes"]["rank_cost"]
    if mixed_cost >= owned_cost:
        return atomic, atomic, f"owned padding {pad:.2%} > max_padding {max_padding:.2%}, but the mixed step costs " \
                               f"more ({mixed_cost:,} >= {owned_cost:,} byte-equivalents per rank): owned kept"
    why = f"owned padding {pad:.2%} > max_padding {max_padding:.2%} and the mixed step costs less " \
          f"({mixed_cost:,} < {owned_cost:,} byte-equivalents per rank)"
    if not allow_mixed:
        return atomic, atomic, f"{why}, but the mixed layout cannot host these matrices ({blocked}): owned kept"
    return mixed, atomic, f"{why}: mixed"

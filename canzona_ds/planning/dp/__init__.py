"""DP ownership planners: which rank owns (updates, stores state for) each matrix.

The runtime realises a plan in DeepSpeed's flat buffer like this ("planned padding"):

    flat buffer of the matrix param group, dp = 3, every rank's range padded to P

      rank 0 range (P)              rank 1 range (P)              rank 2 range (P)
    |  W_a  |   W_d   |  pad |   W_b     | W_e | pad...  |  W_c  |  W_f  | W_g |pad|
      ^ rank_params[0] in order   ^ rank_params[1]             ^ rank_params[2]

Every matrix lies wholly inside one rank's range, so DeepSpeed's stock equal-chunk
code (reduce to owner, partitioned step, all-gather) keeps working unchanged and the
optimizer step needs no communication.  The cost is ``padding = dp*P - S`` elements in
the replicated buffer and the post-step all-gather (computed in ONE place,
``planning/layout.py``); the planners keep it small by balancing ``numel`` together with
the compute cost.

Planners are pure functions of (specs, world size, settings): every rank computes the
same plan; :meth:`OwnershipPlan.fingerprint` lets the runtime verify that.

The package, one idea per module (this ``__init__`` is its public API)::

    plan.py           OwnershipPlan, the plan type every planner returns
    multi_lpt.py      the production planner (the default)
    paper.py          the paper's Algorithm 1 and the baselines it is measured against
    registry.py       planners by name (DP_PLANNERS) and plan_dp, the entry point
    layout_choice.py  owned or mixed: choose_layout, plan_mixed_dp, owned_step_bytes
"""
from __future__ import annotations

from .layout_choice import DEFAULT_MAX_PADDING, LAYOUTS, choose_layout, owned_step_bytes, plan_mixed_dp
from .multi_lpt import plan_multi_lpt
from .paper import (DEFAULT_BUCKET_NUMEL, layer_groups, layer_key, make_buckets, megatron_bucket_numel,
                    plan_alpha_balanced, plan_equal_chunk, plan_layerwise, plan_lpt, plan_naive_atomic,
                    plan_paper_naive)
from .plan import MIXED, OwnershipPlan
from .registry import (ATOMIC_DP_PLANNERS, BUCKETED_DP_PLANNERS, DEFAULT_DP_PLANNER, DP_PLANNERS, DPRequest,
                       plan_dp)

__all__ = ["ATOMIC_DP_PLANNERS", "BUCKETED_DP_PLANNERS", "DEFAULT_BUCKET_NUMEL", "DEFAULT_DP_PLANNER",
           "DEFAULT_MAX_PADDING", "DP_PLANNERS", "DPRequest", "LAYOUTS", "MIXED", "OwnershipPlan", "choose_layout",
           "layer_groups", "layer_key", "make_buckets", "megatron_bucket_numel", "owned_step_bytes",
           "plan_alpha_balanced", "plan_dp", "plan_equal_chunk", "plan_layerwise", "plan_lpt", "plan_mixed_dp",
           "plan_multi_lpt", "plan_naive_atomic", "plan_paper_naive"]

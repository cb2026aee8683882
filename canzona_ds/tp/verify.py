"""Cross-rank consistency checks for plans (one collective, at setup only).

Every rank of a TP group must run the same micro-group plan, and under DP x TP the DP
ownership plan must give every shard of a TP-split matrix the same DP index on every TP
rank (otherwise a host would wait for a shard that another DP index owns).  Both reduce
to "this fingerprint is equal on every rank of the group"::

    verify_same_across_group(dp_plan.fingerprint(), tp_group, what="DP ownership plan")
"""
from __future__ import annotations

import torch.distributed as dist


def gather_fingerprints(fingerprint: str, group=None) -> list[str]:
    """Every rank's fingerprint, in group-rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [fingerprint]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, fingerprint, group=group)
    return out


def verify_same_across_group(fingerprint: str, group=None, what: str = "plan") -> None:
    """Raise ValueError naming the disagreeing ranks if ``fingerprint`` differs in ``group``."""
    fps = gather_fingerprints(fingerprint, group)
    if len(set(fps)) > 1:
        by_rank = ", ".join(f"rank {r}: {fp}" for r, fp in enumerate(fps))
        raise ValueError(f"{what} differs across the group ({by_rank}); every rank must build it "
                         f"from the same parameter list and config")

"""Every rank must run the same optimizer settings: checked once, at setup, without a collective.

A rank started with other settings (another ``lr``, another ZeRO stage, another model) must
be an error on every rank, not a silent mix and not a hang.  A collective cannot check it:
a rank at ZeRO stage 0 never reaches the collective a stage-1 rank waits in (it is inside a
gradient all-reduce by then).  So each rank writes what it runs into the process group's
key-value store and waits for every rank's entry with a timeout; the first point every
Canzona configuration reaches is building the optimizer (``registry.build_optimizer``), so
ranks that differ in anything there meet and compare, and a rank that never gets there (it
runs another optimizer type) makes the others fail after ``timeout`` seconds naming it.

The timeout is ``CANZONA_AGREEMENT_TIMEOUT`` seconds (default 300): ranks reach the optimizer
setup right after DeepSpeed's own model broadcast, so they arrive within seconds of each other.
"""
from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 300.0
_round = 0


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _scoped(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"scope", "value", "what"}


def _differences(values: list[dict]) -> list[str]:
    """Keys whose values differ between ranks.  A scoped value ``{"scope": s, "value": v,
    "what": text}`` is compared only among the ranks with the same scope (e.g. the model's
    parameters among the ranks of one pipeline stage)."""
    keys = sorted({k for v in values for k in v})
    out = []
    for k in keys:
        seen = [v.get(k) for v in values]
        if all(_scoped(s) for s in seen):
            for scope in sorted({s["scope"] for s in seen}, key=str):
                ranks = [r for r, s in enumerate(seen) if s["scope"] == scope]
                if len({json.dumps(seen[r]["value"]) for r in ranks}) > 1:
                    per_rank = ", ".join(f"rank {r}: {json.dumps(seen[r]['value'])}" for r in ranks)
                    out.append(f"{seen[ranks[0]]['what']} ({per_rank})")
            continue
        if any(s != seen[0] for s in seen):
            per_rank = ", ".join(f"rank {r}: {json.dumps(s)}" for r, s in enumerate(seen))
            out.append(f"{k} ({per_rank})")
    return out


def check_agreement(settings: dict[str, Any], what: str = "the optimizer settings",
                    timeout_s: float | None = None) -> None:
    """Raise on every rank unless every rank of the default group passes equal ``settings``
    (JSON-serialisable, flat keys -> values)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    values = gather(settings, timeout_s)
    diff = _differences(values)
    if diff:
        raise ValueError(f"Ranks disagree on {what}: " + "; ".join(diff) + ". Every rank must run the same "
                         "ds_config and model.")


def gather(settings: dict[str, Any], timeout_s: float | None = None) -> list[dict]:
    """Every rank's ``settings`` (rank order), through the store as :func:`check_agreement`
    exchanges them (no collective; every rank must call it, in the same order)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [json.loads(json.dumps(settings, sort_keys=True, default=str))]
    global _round
    _round += 1
    timeout_s = float(os.environ.get("CANZONA_AGREEMENT_TIMEOUT", DEFAULT_TIMEOUT_S)) if timeout_s is None else timeout_s
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    keys = [f"canzona/agreement/{_round}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(settings, sort_keys=True, default=str))
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - the store raises a backend-specific timeout error
        missing = [r for r in range(world) if not store.check([keys[r]])]
        raise RuntimeError(
            f"Ranks {missing} did not reach the Canzona optimizer setup within {timeout_s:.0f} s: they run another "
            "optimizer type or failed before it. Every rank must start with the same ds_config (and model). "
            "(CANZONA_AGREEMENT_TIMEOUT sets the wait.)") from None
    return [json.loads(store.get(k)) for k in keys]

"""The param groups' hyper-parameters across a save and a resume.

A schedule lives in two places: the scheduler's own state (its step count, its base lrs) and
the values it last wrote into the optimizer's param groups (``lr``, and whatever else it or the
rule writes: ``initial_lr``, OneCycle's ``betas``/``momentum``, Megatron's ``weight_decay``).
The first step after a resume runs on the second, and no scheduler rewrites it when it loads
(torch's ``LRScheduler``, DeepSpeed's ``WarmupLR``/``WarmupDecayLR``/``WarmupCosineLR``/
``OneCycle`` load their counters only).  So every save records each group's hyper-parameters in
the checkpoint index (:func:`describe`, ``meta["param_groups"]``), and every load that restores
the optimizer state -- DeepSpeed's stock load and the index loop alike -- puts them back into the
live groups afterwards (:func:`restore`, called once from registry.py's ``load_checkpoint``).

Groups are matched by role, partition (``canzona_role``, ``canzona_partition``: a DeepSpeed
MoE expert group) and multiplier class (``wd_mult``/``param_lr_mult``: Megatron's no-weight-decay
and lr-scaled groups, optimizer.py), which do not depend on the layout: DP, TP, PP, ZeRO stage and
ep_size change which parameters a group holds on a rank, not which groups exist or what they are
set to.
"""
from __future__ import annotations

import math
from typing import Any

from torch import Tensor

#: group keys that are structure (or the matrix step count, restored with the optimizer
#: state), not hyper-parameters
STRUCTURE = ("params", "step", "canzona_role", "canzona_partition", "moe", "name")


def group_key(group: dict) -> str:
    key = f"{group.get('canzona_role')}:{group.get('canzona_partition') or ''}"
    if "wd_mult" in group or "param_lr_mult" in group:  # a multiplier class (Megatron's groups)
        key += f":wd_mult={group.get('wd_mult', 1.0)!r}:param_lr_mult={group.get('param_lr_mult', 1.0)!r}"
    return key


def _plain(value: Any):
    """``value`` as JSON keeps it exactly (floats round-trip through ``repr``), or None where it
    is no number, string, bool or flat sequence of those."""
    if isinstance(value, Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def describe(param_groups) -> list[dict]:
    """[{"key": role:partition, "hparams": {key: value}}] of each group, in order."""
    out = []
    for g in param_groups:
        hp = {}
        for k, v in g.items():
            if k in STRUCTURE:
                continue
            p = _plain(v)
            if p is not None or v is None:
                hp[k] = p
        out.append({"key": group_key(g), "hparams": hp})
    return out


def merge(parts) -> list[dict]:
    """Every rank's groups (a pipeline stage has its own), the first of each key kept."""
    seen: dict[str, dict] = {}
    for part in parts:
        for g in part or ():
            seen.setdefault(g["key"], g)
    return list(seen.values())


def restore(param_groups, saved: list[dict]) -> int:
    """Write the saved hyper-parameters into the live groups (matched by :func:`group_key`; a
    group whose key was not saved takes the first saved group of its role).  Returns the number
    of groups written."""
    by_key = {g["key"]: g["hparams"] for g in saved}
    by_role: dict[str, dict] = {}
    for g in saved:
        by_role.setdefault(g["key"].split(":", 1)[0], g["hparams"])
    written = 0
    for g in param_groups:
        hp = by_key.get(group_key(g), by_role.get(str(g.get("canzona_role"))))
        if hp is None:
            continue
        for k, v in hp.items():
            cur = g.get(k)
            if isinstance(cur, Tensor) and v is not None and not isinstance(v, list):
                cur.fill_(v)  # (a tensor lr stays the tensor a compiled step captured)
            elif isinstance(cur, tuple) and isinstance(v, list):
                g[k] = tuple(v)
            else:
                g[k] = v
        written += 1
    return written

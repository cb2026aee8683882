"""Resume a Canzona ZeRO checkpoint at another DP (and TP) size: every matrix's state follows it.

A Canzona checkpoint is DeepSpeed's own (one ``zero_pp_rank_{dp}_mp_rank_{tp}_optim_states.pt``
per rank, one ``mp_rank_{tp}_model_states.pt`` per TP rank) plus, in every optimizer file,
the layout it was written with (``canzona_layout``: the plan, offsets, TP layout of every
split parameter) and every matrix's rule state by name.  That is enough to rebuild, for
every parameter, its whole (TP=1) fp32 master weight and optimizer state, whatever the
DP and TP size it was saved at::

    read(dir, tag)  -> Universal            every parameter whole, in the TP=1 layout:
                                            fp32 master, AdamW moments, the rule's state,
                                            step counts, loss scale, lr scheduler, client state
    write(engine, universal)                 fill a live engine laid out for the CURRENT
                                            DP x TP (its plan, its layout, its TP hosts)
    load(engine, dir, tag) = write(engine, read(dir, tag))

Nothing is approximated: matrices are moved whole (a DP change only changes which rank
owns a matrix and where its range starts), AdamW's element-wise state is re-sliced, and a
TP change re-orders rows (or columns) by the permutation between the TP layouts of the two
sizes (``canzona_ds/tp/layout.py``), which each rule maps onto its state through
``MatrixRule.state_axes`` (e.g. SOAP's L is row x row, its eigenbasis row x eigen).  A
state that cannot follow such a permutation (Shampoo blocks cut along the split dimension
of a fused layout) is refused by name.

``engine.load_checkpoint`` of a Canzona engine takes this path by itself when the
checkpoint's DP or TP size differs from the engine's (integration/registry.py), and
``canzona_ds.checkpoint.load`` verifies the files first.  The offline converter writes the
universal form to one file, like DeepSpeed's ``ds_to_universal``::

    python -m canzona_ds.integration.elastic convert CKPT_DIR TAG OUT.pt

Memory: every rank reads every optimizer file and holds the whole fp32 model and optimizer
state while converting (shared filesystem required); fine up to a few billion parameters
per host, use the offline converter beyond.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from .zero import LAYOUT_KEY

OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = "mp_rank_{:02d}_model_states.pt"
#: model-states keys DeepSpeed writes itself (the rest is the user's client_state)
DS_MODEL_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version")


class ElasticError(ValueError):
    """A checkpoint cannot be resumed at this size (the message says why)."""


@dataclass
class Universal:
    """A checkpoint independent of DP and TP size: every parameter whole (TP=1 layout)."""

    rule: str
    #: name -> fp32 master weight
    params: dict[str, Tensor]
    #: name -> AdamW state ("exp_avg", "exp_avg_sq") of the non-matrix parameters
    adam: dict[str, dict[str, Tensor]]
    adam_step: float
    #: name -> the rule's state of that matrix
    rule_state: dict[str, dict[str, Any]]
    matrix_step: int
    #: DeepSpeed's loss scaler object and flags (fp16)
    zero_scalars: dict[str, Any]
    #: engine scalars (global_steps, ...), the lr scheduler's state, the client state
    engine_state: dict[str, Any]
    client_state: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ reading
def checkpoint_size(ckpt_dir: str, tag: str) -> tuple[int, int]:
    """(DP size, TP size) a checkpoint was written at, from its file names."""
    ranks = [OPTIM_FILE.search(f) for f in os.listdir(os.path.join(ckpt_dir, tag))]
    found = [(int(m.group(1)), int(m.group(2))) for m in ranks if m]
    if not found:
        raise ElasticError(f"{os.path.join(ckpt_dir, tag)} has no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt).")
    return max(d for d, _ in found) + 1, max(t for _, t in found) + 1


def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def read(ckpt_dir: str, tag: str) -> Universal:
    """Every parameter and its state, whole (see the module doc)."""
    from ..optim import rule_from_description
    from ..tp.layout import concat_permutation, unshard

    folder = os.path.join(ckpt_dir, tag)
    dp, tp = checkpoint_size(ckpt_dir, tag)
    files = {(int(m.group(1)), int(m.group(2))): os.path.join(folder, f)
             for f in os.listdir(folder) if (m := OPTIM_FILE.search(f))}
    missing = [f"zero_pp_rank_{r}_mp_rank_{t:02d}" for r in range(dp) for t in range(tp) if (r, t) not in files]
    if missing:
        raise ElasticError(f"{folder} lacks optimizer files {missing}.")
    local_params: list[dict[str, Tensor]] = []  # per TP rank: name -> local fp32 master
    local_adam: list[dict[str, dict[str, Tensor]]] = []
    rule_state: dict[str, dict] = {}
    hosted_in_tp_layout: set[str] = set()
    meta0 = None
    rule_description = None
    adam_step, matrix_step, zero_scalars = 0.0, 0, {}
    for t in range(tp):
        model = _load(os.path.join(folder, MODEL_FILE.format(t)))
        shards = [_load(files[(r, t)])["optimizer_state_dict"] for r in range(dp)]
        metas = [s.get(LAYOUT_KEY) for s in shards]
        if any(m is None or m.get("matrix_names") is None for m in metas):
            raise ElasticError(f"{folder} was not written by a Canzona optimizer with a planned layout (no "
                               f"'{LAYOUT_KEY}'); only Canzona checkpoints can change size here.")
        meta = metas[0]
        meta0 = meta0 or meta
        roles = meta["roles"]
        group_shapes = model["param_shapes"]
        params: dict[str, Tensor] = {}
        adam: dict[str, dict[str, Tensor]] = {}
        for g, role in enumerate(roles):
            shapes = dict(group_shapes[g])
            if role == "matrix":
                P = meta["shard_numel"]
                owners = [r for r, c in enumerate(meta["rank_counts"]) for _ in range(c)]
                for name, off, owner in zip(meta["matrix_names"], meta["offsets"], owners):
                    shape = tuple(shapes[name])
                    n = int(torch.Size(shape).numel())
                    part = shards[owner]["single_partition_of_fp32_groups"][g]
                    params[name] = part[off - owner * P: off - owner * P + n].view(shape).clone()
                for s in shards:
                    base = s["base_optimizer_state"]
                    rule_description = base["canzona"]["config"]["rule"]
                    for name, st in base["canzona"]["matrix_state"].items():
                        rule_state.setdefault(name, st)  # TP replicas of a non-split matrix are identical
                    matrix_step = int(base["param_groups"][g]["step"])
            else:
                flat = torch.cat([s["single_partition_of_fp32_groups"][g] for s in shards])
                lengths = [s["single_partition_of_fp32_groups"][g].numel() for s in shards]
                moments = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    moments[key] = torch.cat([s["base_optimizer_state"]["state"][g][key][:n]
                                              for s, n in zip(shards, lengths)])
                adam_step = float(shards[0]["base_optimizer_state"]["state"][g]["step"])
                off = 0
                for (name, shape), pad in zip(shapes.items(), shards[0]["param_alignment_paddings"][g]):
                    n = int(torch.Size(shape).numel())
                    params[name] = flat[off:off + n].view(tuple(shape)).clone()
                    adam[name] = {k: v[off:off + n].view(tuple(shape)).clone() for k, v in moments.items()}
                    off += n + pad
        hosted_in_tp_layout |= set(meta["tp_params"]) & set(meta["matrix_names"])
        local_params.append(params)
        local_adam.append(adam)
        if t == 0:
            zero_scalars = {k: shards[0][k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow") if k in shards[0]}
            engine_state = {k: model.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")}
            client_state = {k: v for k, v in model.items() if k not in DS_MODEL_KEYS}
    # TP=1 layout
    tp_params = meta0["tp_params"]
    params, adam = {}, {}
    for name in local_params[0]:
        if name in tp_params:
            dim, _, blocks = tp_params[name]
            params[name] = unshard([lp[name] for lp in local_params], dim, blocks)
            if name in local_adam[0]:
                adam[name] = {k: unshard([la[name][k] for la in local_adam], dim, blocks) for k in local_adam[0][name]}
        else:
            params[name] = local_params[0][name]
            if name in local_adam[0]:
                adam[name] = local_adam[0][name]
    rule = rule_from_description(rule_description)  # with its hyper-parameters (Shampoo's blocks)
    for name in hosted_in_tp_layout:
        if name not in rule_state:
            continue
        dim, sizes, blocks = tp_params[name]
        perm = concat_permutation(blocks, sizes)
        rule_state[name] = _permute_state(rule, name, rule_state[name], params[name].shape, dim, perm, inverse=True)
    return Universal(rule=meta0["rule"], params=params, adam=adam, adam_step=adam_step, rule_state=rule_state,
                     matrix_step=matrix_step, zero_scalars=zero_scalars, engine_state=engine_state,
                     client_state=client_state, source={"dp": dp, "tp": tp, "dir": folder})


def _permute_state(rule, name: str, state: dict, full_shape, dim: int, perm: Tensor, inverse: bool) -> dict:
    """Move a TP-split matrix's state between its TP layout and the TP=1 layout.

    ``perm``: TP layout[i] = TP=1[perm[i]] along the split dimension (``dim``)."""
    from ..optim.rule import MatrixInfo

    if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
        return state
    info = MatrixInfo(name, tuple(full_shape))
    side = "row" if dim == 0 else "col"
    out = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            out[key] = value
            continue
        axes = rule.state_axes(key, tuple(value.shape), info)
        if axes is None:
            raise ElasticError(f"The {rule.name} state {key!r} of {name!r} cannot follow a change of tensor-parallel "
                               "size (its fused TP layout permutes the matrix, and that state is not defined along "
                               "whole rows/columns); resume at the saved TP size.")
        t = value
        for axis, kind in enumerate(axes):
            if kind != side:
                continue
            if inverse:  # TP layout -> TP=1
                full = torch.empty_like(t)
                full.index_copy_(axis, perm.to(t.device), t)
                t = full
            else:  # TP=1 -> TP layout
                t = t.index_select(axis, perm.to(t.device))
        out[key] = t.contiguous()
    return out


# ------------------------------------------------------------------------------ writing
def _check_state(rule, info, state: dict) -> None:
    """The loaded state has every tensor this rule keeps for the matrix, with its shape (e.g.
    Shampoo's blocks depend on max_preconditioner_dim: a changed value is refused here)."""
    fresh = rule.init_state(info, like=torch.empty(0, device="meta"))
    for key, t in fresh.items():
        got = state.get(key)
        if got is None or tuple(got.shape) != tuple(t.shape):
            raise ElasticError(f"The checkpoint's {rule.name} state of {info.name!r} does not fit this run's settings: "
                               f"{key!r} is {None if got is None else tuple(got.shape)}, the rule keeps "
                               f"{tuple(t.shape)} (a hyper-parameter that shapes the state changed?).")



def write(engine, uni: Universal) -> dict:
    """Fill ``engine`` (a Canzona optimizer under ZeRO 1/2, any DP x TP) from ``uni``; returns
    the client state."""
    from deepspeed import comm as dist

    from ..optim.optimizer import MATRIX
    from ..tp.layout import concat_permutation, shard, tp_blocks
    from ..tp.runtime import TPMatrix
    from .runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    zopt = engine.optimizer
    if opt is None or getattr(zopt, "canzona_layout", None) is None:
        raise ElasticError("elastic loading needs an engine running a Canzona optimizer under ZeRO stage 1 or 2.")
    if opt.rule.name != uni.rule:
        raise ElasticError(f"The checkpoint holds {uni.rule!r} state; this engine runs {opt.rule.name!r}.")
    names = dict(engine.module.named_parameters())
    missing = sorted(set(names) - set(uni.params))
    extra = sorted(set(uni.params) - set(names))
    if missing or extra:
        raise ElasticError(f"The checkpoint's parameters differ from the model's: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}.")
    tp_size = opt.tp_size
    tp_rank = dist.get_rank(group=opt.tp_group) if tp_size > 1 else 0
    layouts = {}
    local: dict[str, Tensor] = {}
    for name, p in names.items():
        full = uni.params[name]
        if TPMatrix.is_split(p, tp_size):
            m = TPMatrix.from_param(name, p, tp_size)
            if tuple(full.shape) != tuple(m.full_shape):
                raise ElasticError(f"{name!r} is {tuple(full.shape)} in the checkpoint, {m.full_shape} here.")
            layouts[name] = (m.partition_dim, m.shard_sizes, tp_blocks(p, m.full_shape[m.partition_dim]))
            dim, sizes, blocks = layouts[name]
            local[name] = shard(full, dim, blocks, sizes, tp_rank)
        else:
            if tuple(full.shape) != tuple(p.shape):
                raise ElasticError(f"{name!r} is {tuple(full.shape)} in the checkpoint, {tuple(p.shape)} here.")
            local[name] = full
    with torch.no_grad():
        for name, p in names.items():
            p.data.copy_(local[name].to(p.dtype))
        roles = [g["canzona_role"] for g in opt.param_groups]
        for i, role in enumerate(roles):
            flat = zopt.single_partition_of_fp32_groups[i]
            if role == MATRIX:
                for v in opt.placement.views[id(flat)]:
                    flat[v.offset:v.offset + v.numel].copy_(local[v.name].reshape(-1).to(flat.dtype))
                opt.param_groups[i]["step"] = uni.matrix_step
                continue
            P = zopt.partition_size[i]
            rank = dist.get_rank(group=zopt.real_dp_process_group[i])
            lo, hi = rank * P, (rank + 1) * P
            state = {"step": torch.tensor(uni.adam_step, dtype=torch.float32, device="cpu"),
                     "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
            for p, off in zip(zopt.round_robin_bit16_groups[i], zopt.round_robin_bit16_offsets[i]):
                name = zopt.param_names[p]
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a >= b:
                    continue
                src = slice(a - off, b - off)
                dst = slice(a - lo, b - lo)
                flat[dst].copy_(local[name].reshape(-1)[src].to(flat.dtype))
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = uni.adam[name][key]
                    if name in layouts:
                        dim, sizes, blocks = layouts[name]
                        moment = shard(moment, dim, blocks, sizes, tp_rank)
                    state[key][dst].copy_(moment.reshape(-1)[src].to(flat.dtype))
            opt.state[flat] = state
        # every matrix this rank keeps state for: owned ones, and the TP-split ones it hosts
        wanted = {}
        for name in opt.handled_names():
            if name not in uni.rule_state:
                continue  # never stepped before the checkpoint (e.g. SOAP's basis not built yet)
            st = uni.rule_state[name]
            if name in opt.tp_matrices:
                dim, sizes, blocks = layouts[name]
                st = _permute_state(opt.rule, name, st, uni.params[name].shape, dim,
                                    concat_permutation(blocks, sizes), inverse=False)
            _check_state(opt.rule, opt.infos[name], st)
            wanted[name] = st
        opt.matrix_state.clear()
        opt.load_matrix_state(wanted)
    for key, value in uni.zero_scalars.items():
        setattr(zopt, key, value)
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if uni.engine_state.get(key) is not None:
            setattr(engine, key, uni.engine_state[key])
    if engine.lr_scheduler is not None and uni.engine_state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(uni.engine_state["lr_scheduler"])
    return dict(uni.client_state)


def load(engine, ckpt_dir: str, tag: str | None = None) -> tuple[str, dict]:
    """Resume ``engine`` from a Canzona checkpoint written at any DP x TP size."""
    if tag is None:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
    uni = read(ckpt_dir, tag)
    return os.path.join(ckpt_dir, tag), write(engine, uni)


#: format marker of a file written by ``convert``
UNIVERSAL_FORMAT = "canzona-universal-1"


def save_universal_file(uni: Universal, path: str) -> None:
    torch.save({"format": UNIVERSAL_FORMAT, **{f.name: getattr(uni, f.name) for f in fields(Universal)}}, path)


def load_universal_file(engine, path: str) -> dict:
    """Resume ``engine`` from a file written by ``convert``."""
    data = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(data, dict) or data.pop("format", None) != UNIVERSAL_FORMAT:
        raise ElasticError(f"{path} is not a canzona universal checkpoint (written by `python -m "
                           "canzona_ds.integration.elastic convert`).")
    return write(engine, Universal(**data))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m canzona_ds.integration.elastic",
                                 description="Write a DP/TP-size-independent copy of a Canzona checkpoint.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="CKPT_DIR TAG OUT.pt")
    c.add_argument("ckpt_dir")
    c.add_argument("tag")
    c.add_argument("out")
    args = ap.parse_args(argv)
    try:
        uni = read(args.ckpt_dir, args.tag)
    except (ElasticError, OSError) as err:
        print(f"elastic: error: {err}", file=sys.stderr)
        return 2
    save_universal_file(uni, args.out)
    print(f"wrote {args.out}: {len(uni.params)} parameters, {len(uni.rule_state)} matrices with {uni.rule} state, "
          f"saved at DP={uni.source['dp']} TP={uni.source['tp']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

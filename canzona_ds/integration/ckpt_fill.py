"""The fills of the checkpoint index's load loop that need DeepSpeed's ZeRO 1/2 internals, and
the rule-state permutations a change of tensor-parallel layout takes.

    fill_zero12(engine, src)      every rank copies, out of the memory-mapped files through the
                                  index (``src``: ckpt_index.IndexSource), only what it holds in
                                  the running layout: its matrices' fp32 masters (its pieces of
                                  hosted ones), its range of each AdamW group and that range's
                                  moments, the rule state of the matrices it owns or hosts (a
                                  TP host's in this run's TP layout); then the bit16 weights
                                  are broadcast from the owners' fp32 partitions, as after a step

A TP change re-orders rows (or columns) by the permutation between the TP layouts of the two
sizes (``canzona_ds/tp/layout.py``), which each rule maps onto its state through
``MatrixRule.state_axes`` (SOAP's L is row x row, its eigenbasis row x eigen); a state that
cannot follow (Shampoo's blocks cut along the split dimension of a fused layout) is refused by
name before any rank writes (:func:`_check_permutable`).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from ..ckpt.index import MASTER, CheckpointIndexError

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
#: model-states keys DeepSpeed writes itself (the rest is the user's client_state)
DS_MODEL_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version")


def _rule_of(description: dict):
    from ..optim import rule_from_description

    return rule_from_description(description)  # with its hyper-parameters (Shampoo's blocks)


def _layout_perm(tp_layout) -> Tensor:
    """TP layout[i] = TP=1[perm[i]] along the split dimension of ``tp_layout`` (dim, shard sizes, blocks)."""
    from ..tp.layout import concat_permutation

    _, sizes, blocks = tp_layout
    return concat_permutation(blocks, sizes)


def _layout_key(tp_layout) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    dim, sizes, blocks = tp_layout
    return int(dim), tuple(int(s) for s in sizes), tuple(int(b) for b in blocks)


def _check_permutable(rule, name: str, shapes: dict[str, tuple[int, ...]], full_shape, perm: Tensor) -> None:
    """Refuse (by name) a state that cannot follow the TP-layout permutation ``perm``."""
    from ..optim.rule import MatrixInfo

    if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
        return
    info = MatrixInfo(name, tuple(full_shape))
    for key, shape in shapes.items():
        if rule.state_axes(key, tuple(shape), info) is None:
            raise CheckpointIndexError(f"The {rule.name} state {key!r} of {name!r} cannot follow a change of tensor-parallel "
                               "size (its fused TP layout permutes the matrix, and that state is not defined along "
                               "whole rows/columns); resume at the saved TP size.")


def _permute_state(rule, name: str, state: dict, full_shape, dim: int, perm: Tensor, inverse: bool) -> dict:
    """Move a TP-split matrix's state between its TP layout and the TP=1 layout.

    ``perm``: TP layout[i] = TP=1[perm[i]] along the split dimension (``dim``)."""
    from ..optim.rule import MatrixInfo

    if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
        return state
    _check_permutable(rule, name, {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)},
                      full_shape, perm)
    info = MatrixInfo(name, tuple(full_shape))
    side = "row" if dim == 0 else "col"
    out = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            out[key] = value
            continue
        axes = rule.state_axes(key, tuple(value.shape), info)
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


def _check_state(rule, info, shapes: dict[str, tuple[int, ...]]) -> None:
    """The loaded state has every tensor this rule keeps for the matrix, with its shape (e.g.
    Shampoo's blocks depend on max_preconditioner_dim: a changed value is refused here)."""
    fresh = rule.init_state(info, like=torch.empty(0, device="meta"))
    for key, t in fresh.items():
        got = shapes.get(key)
        if got is None or tuple(got) != tuple(t.shape):
            raise CheckpointIndexError(f"The checkpoint's {rule.name} state of {info.name!r} does not fit this run's settings: "
                               f"{key!r} is {got}, the rule keeps "
                               f"{tuple(t.shape)} (a hyper-parameter that shapes the state changed?).")


@contextlib.contextmanager
def agreed():
    """Every rank leaves the block together: a refusal on any rank is raised on every rank, so no
    rank goes on into a collective the others never reach.  The block itself holds no collective."""
    import torch.distributed as tdist

    err = None
    try:
        yield
    except (CheckpointIndexError, ValueError, KeyError) as e:
        err = e
    errors = [None if err is None else f"{type(err).__name__}: {err}"]
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        errors = [None] * tdist.get_world_size()
        tdist.all_gather_object(errors, None if err is None else f"{type(err).__name__}: {err}")
    if err is not None:
        raise err
    first = next(((r, e) for r, e in enumerate(errors) if e), None)
    if first is not None:
        raise CheckpointIndexError(f"rank {first[0]} refused the load: {first[1]}")


def fill_zero12(engine, src) -> dict:
    """Fill ``engine`` (a Canzona optimizer under ZeRO 1/2, any DP x TP) from ``src`` (an
    :class:`~.ckpt_index.IndexSource`), copying only what this rank holds; returns the client
    state.  The bit16 weights every rank keeps whole are gathered from the ranks' fp32
    partitions (a collective), not read from the files.
    Everything that can refuse (names, shapes, rule, state that cannot follow a TP layout) is
    checked first, from shapes alone and alike on every rank, so no rank is left waiting in the
    closing all-gather."""
    from deepspeed import comm as dist

    from ..optimizer import MATRIX
    from ..tp.layout import tp_blocks
    from ..tp.runtime import FlatSplit, GridSplit, TPMatrix, tp_split
    from .runtime_info import canzona_optimizer

    with agreed():  # (every check below is local: a refusal is raised on every rank)
        opt = canzona_optimizer(engine)
        zopt = engine.optimizer
        if opt is None or getattr(zopt, "canzona_layout", None) is None:
            raise CheckpointIndexError("fill_zero12 needs an engine running a Canzona optimizer under ZeRO stage 1 or 2.")
        if opt.rule.name != src.rule:
            raise CheckpointIndexError(f"The checkpoint holds {src.rule!r} state; this engine runs {opt.rule.name!r}.")
        names = dict(engine.module.named_parameters())
        # DeepSpeed MoE: the checkpoint names every expert by its whole-model (global) number; this
        # rank's local experts are the global ones of its expert-parallel rank (integration/moe.py)
        moe = opt.moe if opt.moe is not None and opt.moe.active else None
        glob = opt.global_name  # (a MoE expert by its global number, a pipeline stage's parameter by the plain model's name)
        saved_names = set(src.names)
        here = {glob(n) for n in names}
        whole_model = here | set(moe.global_order) if moe is not None else here  # every expert of the model
        missing = sorted(here - saved_names)
        extra = sorted(saved_names - whole_model)
        if moe is not None and not missing and not extra:
            missing = sorted(whole_model - saved_names)  # (another number of experts)
        if missing or extra:
            raise CheckpointIndexError(f"The checkpoint's parameters differ from the model's: missing {missing[:5]}, "
                                       f"unexpected {extra[:5]}.")
        tp_size = opt.tp_size
        tp_rank = dist.get_rank(group=opt.tp_group) if tp_size > 1 else 0
        layouts = {}  # name -> (dim, shard sizes, blocks) of this run's TP-split parameters
        for name, p in names.items():
            full = src.full_shape(glob(name))
            if TPMatrix.is_split(p, tp_size):  # a matrix or a 1-D bias
                dim, sizes, whole = tp_split(name, p, tp_size)
                if tuple(full) != whole:
                    raise CheckpointIndexError(f"{name!r} is {tuple(full)} in the checkpoint, {whole} here.")
                layouts[name] = (dim, sizes, tuple(tp_blocks(p, whole[dim])))
            elif tuple(full) != tuple(p.shape):
                raise CheckpointIndexError(f"{name!r} is {tuple(full)} in the checkpoint, {tuple(p.shape)} here.")
        # rule state is keyed per matrix, and per expert for a stack ("<stack>[e]"); here by this
        # rank's (local) names, in the checkpoint by the whole model's
        local_of = {glob(n): n for n in opt.state_infos}
        with_state = [local_of[n] for n in src.state_names() if n in local_of]
        for name in with_state:
            shapes = src.state_shapes(glob(name))
            src.check_state_layout(opt.rule, glob(name), layouts.get(name))  # saved TP-split, or split here
            _check_state(opt.rule, opt.state_infos[name], shapes)

    def mine(name: str, key: str, start: int, stop: int) -> Tensor:
        return src.flat_range(glob(name), key, start, stop, layouts.get(name), tp_rank)

    with torch.no_grad():
        roles = [g["canzona_role"] for g in opt.param_groups]
        for i, role in enumerate(roles):
            flat = zopt.single_partition_of_fp32_groups[i]
            if role == MATRIX:
                split = opt.placement.hosted.split if opt.placement.hosted is not None else {}
                rank = dist.get_rank(group=zopt.real_dp_process_group[i])
                for v in opt.placement.views[id(flat)]:
                    m = split.get(v.name)
                    lo = m.starts[rank] if m is not None and hasattr(m, "starts") else 0  # a mixed layout's piece
                    flat[v.offset:v.offset + v.numel].copy_(mine(v.name, MASTER, lo, lo + v.numel).view(-1))
                opt.param_groups[i]["step"] = src.matrix_step
                continue
            P = zopt.partition_size[i]
            rank = dist.get_rank(group=zopt.real_dp_process_group[i])
            lo, hi = rank * P, (rank + 1) * P
            state = {"step": torch.tensor(src.adam_step, dtype=torch.float32, device="cpu"),
                     "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
            for p, off in zip(zopt.round_robin_bit16_groups[i], zopt.round_robin_bit16_offsets[i]):
                name = zopt.param_names[p]
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a >= b:
                    continue
                dst = slice(a - lo, b - lo)
                flat[dst].copy_(mine(name, MASTER, a - off, b - off))
                for key in ADAM_KEYS:
                    state[key][dst].copy_(mine(name, key, a - off, b - off))
            opt.state[flat] = state
        # every matrix this rank keeps state for: owned ones, and the TP-split ones it hosts
        wanted = {}
        handled = set(opt.handled_state_names())
        for name in with_state:
            if name not in handled:
                continue
            st = src.state_in(opt.rule, glob(name), layouts.get(name))  # (a TP-split one in this run's TP layout)
            wanted[name] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in st.items()}
        # the mixed layout: every rank keeps its piece of a hosted matrix's element-wise state, the
        # host the other keys (MatrixRule.elementwise_state; tp/runtime.py)
        pieces = {}
        elementwise = opt.rule.elementwise_state
        split = opt.placement.hosted.split if opt.placement.hosted is not None else {}
        flat = [n for n in with_state if isinstance(split.get(n), (FlatSplit, GridSplit))] if elementwise else []
        if flat:
            # this rank's index in the DP group each matrix's pieces are cut over: its matrix group's
            # (the dense group's DP group; an expert group's expert-DP group under DeepSpeed MoE)
            group_of = {}
            for i, role in enumerate(roles):
                h = opt.placement.hosted_of.get(id(zopt.single_partition_of_fp32_groups[i]))
                if role == MATRIX and h is not None:
                    group_of.update({n: i for n in h.split})
            for name in flat:
                m, st = split[name], src.state_in(opt.rule, glob(name), layouts.get(name))
                dp_rank = dist.get_rank(group=zopt.real_dp_process_group[group_of[name]])
                lo, n = m.starts[dp_rank], m.lengths[dp_rank]
                if isinstance(m, GridSplit):  # this TP rank's shard of the TP layout, then its DP piece
                    dim, sizes, blocks = layouts[name]
                    off = sum(sizes[:tp_rank])
                    st = {k: st[k].narrow(dim, off, sizes[tp_rank]) for k in elementwise}
                pieces[name] = {k: st[k].reshape(-1)[lo:lo + n].clone() for k in elementwise}
                if name in wanted:
                    wanted[name] = {k: v for k, v in wanted[name].items() if k not in elementwise}
        opt.matrix_state.clear()
        opt.load_matrix_state(wanted)
        opt.load_piece_state(pieces)
        # the bit16 weights: every rank's fp32 partition, gathered as after a step (a parameter
        # outside the optimizer's groups, e.g. frozen here, is copied whole)
        grouped = {id(p) for group in zopt.bit16_groups for p in group}
        for name, p in names.items():
            if id(p) not in grouped:
                p.data.copy_(mine(name, MASTER, 0, p.numel()).view(p.shape))
        _gather_bit16(zopt)
    # (the engine's counters, ZeRO's scalars and the lr scheduler follow once, for every stage, in
    # ckpt_index._apply_engine_state; the param groups' hyper-parameters in restore_param_groups)
    return dict(src.client_state)


def _gather_bit16(zopt) -> None:
    """DeepSpeed's post-step all-gather (``update_lp_params``), as one broadcast per DP rank
    straight into the flat bit16 buffer: no staging copy of the buffer (gloo's
    all_gather_into_tensor stages a whole one, which would cost every rank the model's size)."""
    import torch.distributed as tdist

    for i, (parts, fp32) in enumerate(zip(zopt.parallel_partitioned_bit16_groups,
                                          zopt.single_partition_of_fp32_groups)):
        group = zopt.real_dp_process_group[i]
        parts[tdist.get_rank(group=group)].data.copy_(fp32.data)
        for r in range(tdist.get_world_size(group=group)):
            src = r if group is None else tdist.get_global_rank(group, r)
            tdist.broadcast(parts[r].data, src=src, group=group)



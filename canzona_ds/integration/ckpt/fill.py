"""The index loop's fills: what each rank copies out of a tag, through the index, into the running
layout.  :class:`IndexSource` answers regions by whole-model name (a TP-split parameter in this
run's TP frame), rule state whole, the engine's scalars; the fills write them:

    fill_stage0(engine, opt, src)   every parameter whole, its moments; every matrix's rule state
    fill_zero3(engine, opt, src)    each parameter's piece [r*P, r*P + n) of every state; the rule
                                    state of the matrices this rank hosts

    fill_zero12(engine, src)      every rank copies, out of the memory-mapped files through the
                                  index (``src``: :class:`IndexSource`), only what it holds in
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
import logging
import math
from typing import Any

import torch
from torch import Tensor

from ...ckpt.frames import TPFrame
from ...ckpt.index import MASTER, CheckpointIndexError, Index, Reader
from ...optim.rule import expert_name

logger = logging.getLogger(__name__)
from .emit import ADAM, MATRIX, _dp_rank, _roles_here, _tp_frames

class IndexSource:
    """What :func:`fill_zero12` (and the stage-0 and ZeRO-3 fills here) read through, answered
    from the index: regions by whole-model name, rule state whole, scalars."""

    def __init__(self, folder: str, index: Index, engine_file: str | None = None) -> None:
        #: ``engine_file``: the model-states file whose engine state (counters, lr scheduler,
        #: client state) this rank takes (default: the index's, DP rank 0's of the first stage)
        self.folder, self.index, self._engine_file = folder, index, engine_file
        from .safe import read

        self.reader = Reader(folder, index, read)  # (only data unpickled: ckpt/safe_load.py)
        self.rule = index.meta["rule"]
        self.matrix_step = index.meta.get("matrix_step", 0)
        adam = index.meta.get("adam_step")
        self.adam_step = 0.0 if adam is None else adam
        self.roles = index.meta.get("roles", {})
        #: parameters whose role changed, opted in to re-initialise (``reinit_changed_roles``)
        self.changed: set[str] = set()
        #: under pipeline parallelism: this stage's parameters (what ``write`` may ask for)
        self.only: set[str] | None = None
        #: the saving rule (with its hyper-parameters: Shampoo's blocks decide which factors follow
        #: a permutation), whose ``state_axes`` move a TP host's state from its TP layout to TP=1
        described = index.meta.get("rule_description")
        try:
            self.saved_rule = None if described is None else _rule_from(described)
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointIndexError(f"{folder}: the index's rule_description is not a rule ({e})") from None
        #: the running rule (:func:`load` sets it): moves TP=1 state into this run's TP layout
        self.running_rule = None
        try:  # (the files are untrusted: one that lacks what the index says is one line naming the tag)
            self.engine_state, self.client_state = self._engine_state()
            self.zero_scalars = self._zero_scalars()
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise CheckpointIndexError(f"{folder}: the files disagree with the index's engine_file / scalars "
                                       f"({type(e).__name__}: {e})") from None

    def _engine_state(self) -> tuple[dict, dict]:

        name = self._engine_file or self.index.meta.get("engine_file")
        if not name:
            return {}, {}
        sd = self.reader._file(name)
        engine = {k: sd.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")}
        client = {k: v for k, v in sd.items() if k not in DS_MODEL_KEYS}
        return engine, client

    def _zero_scalars(self) -> dict:
        rec = self.index.meta.get("scalars")
        if not rec:
            return {}
        sd = self.reader._file(rec["file"])
        for k in rec["key"]:
            sd = sd[k]
        return {k: sd[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow") if k in sd}

    # the source protocol of fill_zero12
    @property
    def names(self) -> list[str]:
        return [n for n in self.index.names if self.only is None or n in self.only]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self.index.shape(name)

    def flat_range(self, name: str, key: str, start: int, stop: int, tp_layout=None, tp_rank: int = 0) -> Tensor:
        """Elements ``[start, stop)`` of ``name``'s ``key`` flattened as TP rank ``tp_rank`` of this
        run's ``tp_layout`` ((dim, shard sizes, blocks); None: not split) holds it: straight from
        the chunks where they were saved in that frame, else from the whole parameter
        (:meth:`Reader.region`)."""
        if name in self.changed and key != MASTER:  # a matrix that became AdamW: its moments start at zero
            return torch.zeros(stop - start, dtype=torch.float32)
        frame = None if tp_layout is None else TPFrame.from_layout(tp_layout, tp_rank)
        return self.reader.region(name, key, start, stop, frame=frame)

    def state_names(self) -> list[str]:
        """The rule-state keys the checkpoint holds: a matrix's name, an expert stack's ``W[e]``."""
        stacks = self.index.meta.get("expert_stacks") or {}
        names = sorted({n for (n, s) in self.index.by_key() if s != MASTER and self.roles.get(n) != ADAM
                        and n not in self.changed and (self.only is None or n in self.only)})
        return [k for n in names for k in ([expert_name(n, e) for e in range(stacks[n])] if n in stacks else [n])]

    def _expert(self, name: str) -> tuple[str, int | None]:
        """(the stored name, the expert) of a rule-state key (``W[e]`` -> ("W", e))."""
        stack, _, e = name[:-1].rpartition("[") if name.endswith("]") else ("", "", "")
        if stack and e.isdigit() and stack in (self.index.meta.get("expert_stacks") or {}):
            return stack, int(e)
        return name, None

    def state_shapes(self, name: str) -> dict[str, tuple[int, ...]]:
        stored, e = self._expert(name)
        shapes = {k: v for k, v in self.index.states_of(stored).items() if k != MASTER}
        return shapes if e is None else {k: v[1:] for k, v in shapes.items()}

    def state_of(self, name: str) -> dict[str, Any]:
        """The rule state of ``name`` in the TP=1 layout (views of the files where nothing moved:
        copy what you keep).  A TP host's state, saved in its concatenated TP layout, is
        permuted through ``state_axes`` of :attr:`running_rule` (set by :func:`load`)."""
        stored, e = self._expert(name)
        if e is None:
            return self.state_in(self.running_rule or self.saved_rule, name, None)
        out = {}
        for k, shape in self.state_shapes(name).items():  # expert e's chunk of the stack's state only
            n = math.prod(shape)
            out[k] = self.reader.region(stored, k, e * n, (e + 1) * n).view(shape)
        return out

    def _saved_layouts(self, name: str) -> dict[str, TPFrame | None]:
        """state key -> the TP layout (a frame without a rank) it was saved in: a host's state in
        the concatenated layout, or a grid piece's shards; None: the TP=1 frame."""
        out = {}
        stored, _ = self._expert(name)  # (an expert stack's W[e]: the stack's chunks)
        for k in self.state_shapes(name):
            fs = {c.tp.at(None) for c in self.index.by_key()[(stored, k)] if c.tp is not None}
            out[k] = next(iter(fs)) if len(fs) == 1 else None
        return out

    def check_state_layout(self, rule, name: str, tp_layout) -> None:
        """Refuse (by name, from shapes alone) a rule state that cannot move from the TP layout it
        was saved in into ``tp_layout`` ((dim, shard sizes, blocks) of this run; None: TP=1).  Where
        that is the saved layout nothing moves, so every rule's state fits (Shampoo's blocked
        factors too, at another DP size or plan)."""

        if self._expert(name)[1] is not None:  # an expert of a stack: never TP-split (refused at initialize)
            return
        want = None if tp_layout is None else TPFrame.from_layout(tp_layout)
        saved = self._saved_layouts(name)
        if all(f == want for f in saved.values()):
            return
        shapes, full = self.state_shapes(name), self.full_shape(name)
        hosts = {f for k, f in saved.items() if f is not None and self.reader.frame_of(name, k) is not None}
        for f in hosts:  # a host's state to the TP=1 layout
            _check_permutable(self.saved_rule or rule, name, shapes, full, f.perm())
        if tp_layout is not None:  # and into this run's
            _check_permutable(rule, name, shapes, full, _layout_perm(tp_layout))

    def state_in(self, rule, name: str, tp_layout) -> dict[str, Any]:
        """The rule state of ``name`` in ``tp_layout`` (the concatenated TP layout a host of this run
        sees; None: TP=1): read as saved where that is the saved layout (a grid piece's shards
        side by side along the split dimension), else through the TP=1 layout (a host's state
        permuted through ``rule.state_axes``; shards rebuilt into the whole matrix)."""

        if self._expert(name)[1] is not None:  # an expert of a stack (never TP-split): its chunk of the stack's
            return self.state_of(name)
        want = None if tp_layout is None else TPFrame.from_layout(tp_layout)
        full = self.full_shape(name)
        out = {}
        for k, saved in self._saved_layouts(name).items():
            if saved is not None and saved == want:  # as saved: nothing moves
                if any(c.tp.rank is None for c in self.index.by_key()[(name, k)]):
                    out[k] = self.reader.whole(name, k, saved)
                else:
                    out[k] = torch.cat([self.reader.whole(name, k, saved.at(t)) for t in range(len(saved.sizes))],
                                       dim=saved.dim)
                continue
            if saved is not None and self.reader.frame_of(name, k) is not None:  # a host's: to TP=1 by its axes
                back = self.saved_rule or rule
                if back is None:
                    raise CheckpointIndexError(f"{name!r} {k}: a TP host's rule state needs its rule to reach TP=1.")
                v = _permute_state(back, name, {k: self.reader.whole(name, k, saved)}, full, saved.dim,
                                   saved.perm(), inverse=True)[k]
            else:
                v = self.reader.whole(name, k)  # (the TP=1 frame, or rebuilt from the shards)
            if want is not None:
                v = _permute_state(rule, name, {k: v}, full, want.dim, _layout_perm(tp_layout), inverse=False)[k]
            out[k] = v
        return out


def _rule_from(description: dict):
    from ...optim import rule_from_description

    return rule_from_description(description)


def _check_roles(engine, opt, index: Index, folder: str, reinit: bool) -> list[str]:
    """Parameters whose role (matrix rule <-> AdamW) differs between the checkpoint and this run:
    refused by name, or (``reinit``) returned to be re-initialised."""
    import torch.distributed as tdist

    here = _roles_here(opt)
    if opt.groups.pp_size > 1 and tdist.is_initialized():  # every stage's, so every rank names them all
        parts: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, here)
        here = {n: r for part in parts for n, r in part.items()}
    saved = index.meta.get("roles", {})
    changed = sorted(n for n, r in here.items() if n in saved and saved[n] != r)
    if changed and not reinit:
        what = ", ".join(f"{n!r} ({saved[n]} -> {here[n]})" for n in changed[:6])
        raise CheckpointIndexError(
            f"{folder}: the optimizer role of {len(changed)} parameter(s) changed since the save: {what}. Their "
            "saved optimizer state cannot serve the new role, and nothing restarts silently. Restore the matrix "
            "selection (matrix_include / matrix_exclude) the checkpoint was written with, or set "
            "\"canzona_checkpoint\": {\"reinit_changed_roles\": true} to re-initialise exactly those states.")
    return changed


def _tp_layouts(engine, opt) -> tuple[dict[str, tuple], int]:
    """This run's TP-split parameters (local name) -> (dim, shard sizes, blocks), and the TP rank."""
    frames = _tp_frames(engine, opt)
    rank = next((f.rank for f, _ in frames.values()), 0)
    return {n: (f.dim, f.sizes, f.blocks) for n, (f, _) in frames.items()}, rank


def fill_stage0(engine, opt, src: IndexSource, changed: set) -> None:
    names = dict(engine.module.named_parameters())
    glob = opt.global_name  # (a DeepSpeed MoE expert: its whole-model name in the checkpoint)
    layouts, tp_rank = _tp_layouts(engine, opt)

    def mine(local: str, key: str, p) -> Tensor:  # (a TP-split parameter: this TP rank's shard)
        return src.flat_range(glob(local), key, 0, p.numel(), layouts.get(local), tp_rank).view(p.shape)

    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                opt.state.pop(p, None)
        for g, gnames in zip(opt.param_groups, opt.group_names):
            for local, p in zip(gnames, g["params"]):
                name = glob(local)
                p.data.copy_(mine(local, MASTER, p))
                if g["canzona_role"] == MATRIX or name in changed:
                    continue
                if src.reader.has(name, "exp_avg"):
                    opt.state[p] = {"step": torch.tensor(float(src.adam_step), dtype=torch.float32),
                                    **{k: mine(local, k, p).to(p.device, copy=True) for k in ("exp_avg", "exp_avg_sq")}}
        frozen = [n for n, p in names.items() if not p.requires_grad]
        for n in frozen:
            names[n].data.copy_(mine(n, MASTER, names[n]))
    _fill_rule_state(opt, src, changed, layouts)


def fill_zero3(engine, opt, src: IndexSource, changed: set) -> None:
    zopt = engine.optimizer
    rank = _dp_rank(zopt)
    names_of = {id(p): n for n, p in zopt.module.named_parameters()}
    here = _roles_here(opt)
    with torch.no_grad():
        for i, group in enumerate(zopt.fp16_groups):
            flat = zopt.fp32_partitioned_groups_flat[i]
            names = [names_of[id(p)] for p in group]
            zopt.optimizer.state.pop(flat, None)
            sources = {MASTER: flat}
            if any(here.get(n) == ADAM for n in names):  # an AdamW sub-group in this run
                state = {"step": torch.tensor(float(src.adam_step), dtype=torch.float32),
                         "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
                zopt.optimizer.state[flat] = state
                sources.update(exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"])
            off = 0
            for name, p in zip(names, group):
                P = p.partition_numel()
                n = max(0, min(P, p.ds_numel - rank * P))
                for key, dst in sources.items():
                    dst.narrow(0, off, P).zero_()
                    if n and (key == MASTER or name not in changed):
                        src.reader.region(name, key, rank * P, rank * P + n, out=dst.narrow(0, off, n))
                off += P
            zopt.fp16_partitioned_groups_flat[i].data.copy_(flat.data)
            zopt._unflatten_partitioned_parameters(i)
    _fill_rule_state(opt, src, changed)


def _fill_rule_state(opt, src: IndexSource, changed: set, layouts: dict | None = None) -> None:
    """Every matrix this rank keeps state for, by name (``layouts``: this run's TP-split matrices,
    whose host keeps the state in its concatenated TP layout)."""
    layouts = layouts or {}
    local_of = {opt.global_name(n): n for n in opt.handled_state_names()}  # (DeepSpeed MoE: local names here)
    states = {local_of[n]: {k: v.clone() for k, v in  # owned, not views of the files
                            (src.state_in(opt.rule, n, layouts[local_of[n]]) if local_of[n] in layouts
                             else src.state_of(n)).items()}
              for n in src.state_names() if n in local_of and n not in changed}
    opt.matrix_state.clear()
    opt.load_matrix_state(states)
    opt.load_piece_state({})
    for g in opt.param_groups:
        if g["canzona_role"] == MATRIX:
            g["step"] = src.matrix_step


def _apply_engine_state(engine, src: IndexSource, load_lr_scheduler_states: bool) -> dict:
    """The engine's counters, the lr scheduler (once: Megatron's adds its saved step count to its
    own), ZeRO's loss-scale scalars; returns the client state.  The param groups' hyper-parameters
    follow in :func:`restore_param_groups`, after either route."""
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if src.engine_state.get(key) is not None:
            setattr(engine, key, src.engine_state[key])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and src.engine_state.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(src.engine_state["lr_scheduler"])
    zopt = engine.optimizer
    for key, value in src.zero_scalars.items():
        if hasattr(zopt, key):
            setattr(zopt, key, value)
    return dict(src.client_state)


ADAM_KEYS = ("exp_avg", "exp_avg_sq")
#: model-states keys DeepSpeed writes itself (the rest is the user's client_state)
DS_MODEL_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version")


def _rule_of(description: dict):
    from ...optim import rule_from_description

    return rule_from_description(description)  # with its hyper-parameters (Shampoo's blocks)


def _layout_perm(tp_layout) -> Tensor:
    """TP layout[i] = TP=1[perm[i]] along the split dimension of ``tp_layout`` (dim, shard sizes, blocks)."""
    from ...tp.layout import concat_permutation

    _, sizes, blocks = tp_layout
    return concat_permutation(blocks, sizes)


def _layout_key(tp_layout) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    dim, sizes, blocks = tp_layout
    return int(dim), tuple(int(s) for s in sizes), tuple(int(b) for b in blocks)


def _check_permutable(rule, name: str, shapes: dict[str, tuple[int, ...]], full_shape, perm: Tensor) -> None:
    """Refuse (by name) a state that cannot follow the TP-layout permutation ``perm``."""
    from ...optim.rule import MatrixInfo

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
    from ...optim.rule import MatrixInfo

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
    :class:`IndexSource`), copying only what this rank holds; returns the client
    state.  The bit16 weights every rank keeps whole are gathered from the ranks' fp32
    partitions (a collective), not read from the files.
    Everything that can refuse (names, shapes, rule, state that cannot follow a TP layout) is
    checked first, from shapes alone and alike on every rank, so no rank is left waiting in the
    closing all-gather."""
    from deepspeed import comm as dist

    from ...optimizer import MATRIX
    from ...tp.layout import tp_blocks
    from ...tp.runtime import FlatSplit, GridSplit, TPMatrix, tp_split
    from ..runtime_info import canzona_optimizer

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
    # route._apply_engine_state; the param groups' hyper-parameters in restore_param_groups)
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



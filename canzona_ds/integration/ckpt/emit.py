"""The writer's side of the checkpoint index of a Canzona engine: at every save each placement
describes the chunks it holds in the files DeepSpeed just wrote (canzona_ds/ckpt/index.py has
the model; fill.py and route.py read it back).  Also the layout fingerprints the load compares
and the ``canzona_checkpoint`` ds_config section.

Save (every rank, after DeepSpeed wrote its files; :func:`emit`)::

    stage 0    the rank that writes mp_rank_00_model_states.pt: every parameter whole
               (module/<name>), AdamW moments (optimizer/state/<i>/exp_avg), rule state
               (optimizer/canzona/matrix_state/<name>/<key>)
    stage 1/2  every DP rank, its zero_pp_rank_<r>_..._optim_states.pt: each owned matrix's
               view of the flat fp32 partition (a mixed layout's piece at its offset), each
               AdamW parameter's overlap with the partition (master and both moments), the
               rule state it keeps (whole matrices; a mixed layout's element-wise pieces)
    stage 3    every DP rank (optimizer offloaded or not): each parameter's ZeRO-3 piece
               [r*P, r*P + n) of its fp32 flat group (and moments), the rule state of the
               matrices it hosts

    gathered on rank 0 -> Index(tag, meta, files, chunks) -> canzona_index.json

Names are the whole model's: a DeepSpeed MoE expert (ZeRO 1/2) by its global number
(``opt.global_name``: local expert j of expert-parallel rank k is k*E/ep + j), so a load at
another DP size or ep_size finds it; a transformers expert stack W (E experts) keeps its rule
state per expert, W[e], stored as chunk [e*n, (e+1)*n) of the stack's state (E, *shape) under
the name W (``meta["expert_stacks"]``; :class:`IndexSource` hands W[e] back to the optimizer).

Tensor parallelism (ZeRO 0, 1, 2): a TP-split parameter's master, moments and grid pieces (the
mixed layout) are chunks in the frame of the shard this TP rank holds (``{"tp": {dim, sizes,
blocks, rank}}``, the global shape; canzona_ds/ckpt/frames.py), a TP host's rule state one chunk
in the concatenated TP layout (the frame without ``rank``, the state's shape);
:class:`IndexSource` reads them into this run's TP layout (straight where it is the saved one,
else through the whole parameter and, for a host's state, ``MatrixRule.state_axes``).

A ``PipelineModule`` at ZeRO stage 0 has its module weights in DeepSpeed's per-layer files
(``layer_<idx>-model_states.pt``, by the layer's own parameter names; :func:`_pipe_layer_files`)
and each stage's optimizer in its ``mp_rank_<stage>_model_states.pt``: each stage describes its
own parameters there, by the pipeline's names (the same at every PP size).
A tag whose weights DeepSpeed saved in no file (its stage-0 MoE writer rule under TP) writes
the index with ``chunks: null`` and the reason.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ...ckpt.frames import TPFrame
from ...ckpt.index import INDEX, MASTER, CheckpointIndexError, Chunk, Index
from ..ds_compat import expert_ckpt_file

logger = logging.getLogger(__name__)
from .param_groups import describe as describe_groups
from .param_groups import merge as merge_groups

ADAM = "adamw"
MATRIX = "matrix"

#: top-level ds_config section read by :func:`checkpoint_config`
DS_CONFIG_CHECKPOINT_KEY = "canzona_checkpoint"


def checkpoint_config(engine):
    """The engine's ``canzona_checkpoint`` section (config.CheckpointConfig)."""
    from ...config import CheckpointConfig

    return CheckpointConfig.from_section(engine._config._param_dict.get(DS_CONFIG_CHECKPOINT_KEY))


# ---------------------------------------------------------------------------------------- emit
def _experts_of(opt) -> dict[str, tuple[str, int, int]]:
    """An expert stack's rule-state keys (``W[e]``) -> (the stack ``W``, ``e``, E)."""
    return {i.name: (info.name, e, info.num_experts) for info in opt.infos.values() if info.num_experts is not None
            for e, i in enumerate(info.state_infos())}


def _tp_frames(engine, opt) -> dict[str, tuple[TPFrame, tuple[int, ...]]]:
    """This run's TP-split parameters (local name) -> (their shard's frame, the global shape)."""
    from ...tp.layout import tp_blocks
    from ...tp.runtime import TPMatrix, tp_split

    if opt.tp_size <= 1:
        return {}
    from deepspeed import comm as dist

    t = dist.get_rank(group=opt.tp_group)
    out = {}
    for name, p in engine.module.named_parameters():
        if TPMatrix.is_split(p, opt.tp_size):  # a matrix or a 1-D bias: a shard frame either way
            dim, sizes, full = tp_split(name, p, opt.tp_size)
            out[name] = (TPFrame(dim, sizes, tuple(tp_blocks(p, full[dim])), t), full)
    return out


def _rule_state_chunks(opt, file: str, prefix: tuple, rank: int, piece_at: dict[str, int],
                       tp: dict | None = None) -> list[Chunk]:
    """The rule state this rank keeps: whole matrices (``matrix_state``), and under the mixed
    layout its piece ``[piece_at[name], + n)`` of a hosted matrix's element-wise state.  An
    expert stack ``W`` of E experts keeps one state per expert (``W[e]``): expert e's is chunk
    ``[e*n, (e+1)*n)`` of the stack's state ``(E, *shape)`` under the stack's name.  A TP-split
    matrix (``tp``: :func:`_tp_frames`): its host's state is in the concatenated TP layout (the
    frame without a rank, the state's own shape); a grid piece of its element-wise state is in
    this rank's shard frame at its offset in the shard."""
    tp = tp or {}
    out = []
    experts = _experts_of(opt)
    glob = opt.global_name  # (DeepSpeed MoE: local expert j of expert-parallel rank k is global k*E/ep + j)
    for name, st in opt.matrix_state.items():
        for k, v in st.items():
            if not torch.is_tensor(v):
                raise CheckpointIndexError(f"rule state {name!r} {k!r} is a {type(v).__name__}, not a tensor; the "
                                           "index describes tensors only.")
            key = prefix + ("matrix_state", name, k)
            if name in experts:
                stack, e, E = experts[name]
                out.append(Chunk(glob(stack), k, (E,) + tuple(v.shape), e * v.numel(), v.numel(), file, key, 0,
                                 None, rank))
            else:
                frame = tp[name][0].at(None).to_json() if name in tp else None
                out.append(Chunk(glob(name), k, tuple(v.shape), 0, v.numel(), file, key, 0, frame, rank))
    for name, st in opt.piece_state.items():  # the mixed layout: this rank's piece of element-wise state
        for k, v in st.items():
            shape, frame = tuple(opt.infos[name].shape), None
            if name in tp:  # a grid piece: of this TP rank's shard
                shape, frame = tp[name][1], tp[name][0].to_json()
            out.append(Chunk(glob(name), k, shape, piece_at[name], v.numel(), file,
                             prefix + ("piece_state", name, k), 0, frame, rank))
    return out


def _emit_zero12(engine, opt, rank: int) -> list[Chunk]:
    from deepspeed import comm as dist

    zopt = engine.optimizer
    file = os.path.basename(engine._get_zero_ckpt_name("", ""))
    top = ("optimizer_state_dict",)
    base = top + ("base_optimizer_state",)
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    out: list[Chunk] = []
    split = opt.placement.hosted.split if opt.placement.hosted is not None else {}
    piece_at: dict[str, int] = {}
    tp = _tp_frames(engine, opt)  # a TP-split parameter: its global shape, offsets in its shard's frame
    shape_of = {n: tp[n][1] if n in tp else tuple(p.shape) for n, p in engine.module.named_parameters()}
    frame_of = {n: f.to_json() for n, (f, _) in tp.items()}
    for i, g in enumerate(opt.param_groups):
        flat = zopt.single_partition_of_fp32_groups[i]
        fkey = top + ("single_partition_of_fp32_groups", i)
        r = dist.get_rank(group=zopt.real_dp_process_group[i])
        if g["canzona_role"] == MATRIX:
            for v in opt.placement.views.get(id(flat), ()):
                m = split.get(v.name)
                lo = m.starts[r] if m is not None and hasattr(m, "starts") else 0
                if m is not None and hasattr(m, "starts"):
                    piece_at[v.name] = lo
                out.append(Chunk(opt.global_name(v.name), MASTER, shape_of[v.name], lo, v.numel, file, fkey,
                                 v.offset, frame_of.get(v.name), rank))
            continue
        P = zopt.partition_size[i]
        lo, hi = r * P, (r + 1) * P
        st = opt.state.get(flat) or {}
        idx = order.index(id(flat))
        for p, off in zip(zopt.round_robin_bit16_groups[i], zopt.round_robin_bit16_offsets[i]):
            local = zopt.param_names[p]
            name, shape, frame = opt.global_name(local), shape_of[local], frame_of.get(local)
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a >= b:
                continue
            out.append(Chunk(name, MASTER, shape, a - off, b - a, file, fkey, a - lo, frame, rank))
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out.append(Chunk(name, k, shape, a - off, b - a, file, base + ("state", idx, k), a - lo,
                                     frame, rank))
    return out + _rule_state_chunks(opt, file, base + ("canzona",), rank, piece_at, tp)


def _emit_zero3(engine, opt, rank: int) -> list[Chunk]:
    zopt = engine.optimizer
    file = os.path.basename(engine._get_zero_ckpt_name("", ""))
    top = ("optimizer_state_dict",)
    inner = top + ("optimizer_state_dict",)
    r = _dp_rank(zopt)
    names_of = {id(p): n for n, p in zopt.module.named_parameters()}
    # the torch state index of each sub-group's flat: DeepSpeed's state_dict puts every sub-group
    # back into its param group (sub-group order within each group) before torch numbers them
    idx_of, k = {}, 0
    for g in range(len(zopt.optimizer.param_groups)):
        for s in range(len(zopt.fp16_groups)):
            if int(zopt.sub_group_to_group_id[s]) == g:
                idx_of[s], k = k, k + 1
    out: list[Chunk] = []
    for s, group in enumerate(zopt.fp16_groups):
        flat = zopt.fp32_partitioned_groups_flat[s]
        st = zopt.optimizer.state.get(flat) or {}
        off = 0
        for p in group:
            P = p.partition_numel()
            n = max(0, min(P, p.ds_numel - r * P))
            name = names_of[id(p)]
            if n:
                out.append(Chunk(name, MASTER, tuple(p.ds_shape), r * P, n, file, top + ("fp32_flat_groups", s), off,
                                 None, rank))
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in st:
                        out.append(Chunk(name, key, tuple(p.ds_shape), r * P, n, file,
                                         inner + ("state", idx_of[s], key), off, None, rank))
            off += P
    return out + _rule_state_chunks(opt, file, inner + ("canzona",), rank, {})


def _pipe_layer_files(engine) -> dict[int, tuple[str, tuple]] | None:
    """A ``PipelineModule`` (at any PP size, 1 included): where DeepSpeed's ``save_state_dict``
    put each parameter of this stage, ``id(p) -> (layer_<idx>[-<model rank>]-model_states.pt,
    (its name in that layer's state_dict,))``; None for any other module.  A tied module is saved
    by the stage whose layer *is* the module (a layer that only calls it through a ``forward_fn``
    writes nothing), so a stage may hold a tied weight that none of its own layer files holds:
    that stage describes the weight's optimizer state only, the other stage its master."""
    from torch import nn

    module = engine.module
    if not hasattr(module, "forward_funcs") or not hasattr(module, "ckpt_layer_path"):
        return None
    where: dict[int, tuple[str, tuple]] = {}
    for i, layer in enumerate(module.forward_funcs):
        if isinstance(layer, nn.Module):
            file = os.path.basename(module.ckpt_layer_path("", i))
            for n, p in layer.named_parameters():
                where.setdefault(id(p), (file, (n,)))
    return where


def _module_keys(engine) -> dict[int, tuple]:
    """Where DeepSpeed's save put each parameter in the model file: ``id(p)`` -> its key path in
    that file (``("module", ...)``), read from what ``engine.module_state_dict()`` returns, the
    dict DeepSpeed writes under ``module``.  A client may shape that dict its own way:
    Megatron-DeepSpeed saves ``state_dict_for_save_checkpoint()``, nested
    (``{"language_model": {"encoder": {"layers.0...weight": ...}}}``).  Each stored tensor is
    matched to its parameter by storage (the dict holds the parameters' tensors, detached), so
    the index describes what was written, whatever the nesting."""
    at = {(p.data_ptr(), tuple(p.shape), p.dtype): id(p) for p in engine.module.parameters() if p.numel()}
    out: dict[int, tuple] = {}

    def walk(obj, path: tuple) -> None:
        if torch.is_tensor(obj):
            found = at.get((obj.data_ptr(), tuple(obj.shape), obj.dtype)) if obj.numel() else None
            if found is not None:
                out.setdefault(found, path)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + (k,))

    walk(engine.module_state_dict(), ("module",))
    return out


def _emit_stage0(engine, opt, rank: int) -> list[Chunk]:
    if not engine.save_non_zero_checkpoint:
        return []  # another rank writes the (replicated) file
    file = os.path.basename(engine._get_ckpt_name("", ""))
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    layers = _pipe_layer_files(engine)  # (a PipelineModule, at any PP size: the module is in per-layer files)
    tp = _tp_frames(engine, opt)  # (a TP-split parameter: this TP rank's shard, in its frame)
    keys = _module_keys(engine) if layers is None else {}
    out: list[Chunk] = []
    for g in opt.param_groups:
        for p in g["params"]:
            name = names[id(p)]
            shape, frame = (tp[name][1], tp[name][0].to_json()) if name in tp else (tuple(p.shape), None)
            if layers is None:
                out.append(Chunk(name, MASTER, shape, 0, p.numel(), file, keys.get(id(p), ("module", name)), 0,
                                 frame, rank))
            elif id(p) in layers:
                out.append(Chunk(name, MASTER, shape, 0, p.numel(), *layers[id(p)], 0, frame, rank))
            st = opt.state.get(p) or {}
            for k in ("exp_avg", "exp_avg_sq"):
                if g["canzona_role"] != MATRIX and k in st:
                    out.append(Chunk(name, k, shape, 0, p.numel(), file,
                                     ("optimizer", "state", order.index(id(p)), k), 0, frame, rank))
    return out + _rule_state_chunks(opt, file, ("optimizer", "canzona"), rank, {}, tp)


def _emit_stage0_moe(engine, opt, rank: int) -> list[Chunk]:
    """Stage 0 under DeepSpeed MoE: DeepSpeed's ``_save_moe_checkpoint`` writes the dense weights
    to ``mp_rank_<m>_model_states.pt`` (module/<name>), each expert's to
    ``layer_<l>_expert_<global e>_mp_rank_<m>_model_states.pt`` (its whole-model name) and each
    expert-parallel rank k's whole optimizer state to ``expp_rank_<k>_mp_rank_<m>_optim_states.pt``
    (optimizer/state/<i>/..., optimizer/canzona/matrix_state/<local name>/...).  One rank of each
    replica set writes (moe.checkpoint_writers); every rank describes what it holds under the
    file DeepSpeed names for it, and :func:`gather_index` keeps the chunks of the files that
    were written (the replicas hold the same values)."""
    import re

    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups as ds_groups

    glob = opt.global_name
    model_file = os.path.basename(engine._get_ckpt_name("", ""))
    k = ds_groups._get_expert_parallel_rank(ds_groups._get_max_expert_size_name())
    optim_file = os.path.basename(engine._get_optimizer_ckpt_name("", "", k))
    prefix = ".deepspeed_moe.experts.deepspeed_experts."
    where: dict[str, tuple[str, tuple]] = {}  # local name -> (file, key) of its weight
    layer = 0
    for n_module, module in engine.module.named_modules():
        if not isinstance(module, MoE):
            continue
        ep_rank = ds_groups._get_expert_parallel_rank(module.expert_group_name)
        for n, _ in module.named_parameters():
            local = f"{n_module}.{n}"
            found = re.match(f".*{re.escape(prefix)}([0-9]+).*", local)
            if "expert" not in n or "moe.gate.wg.weight" in local or not found:
                continue
            e = ep_rank * module.num_local_experts + int(found.group(1))
            key = local.replace(f"{prefix}{found.group(1)}", f"{prefix}{e}")
            where[local] = (expert_ckpt_file(engine, layer, e), (key,))
        layer += 1
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    tp = _tp_frames(engine, opt)  # (MoE x TP: a TP-split dense parameter's shard, in its frame)

    def shape_frame(n, p):
        return (tp[n][1], tp[n][0].to_json()) if n in tp else (tuple(p.shape), None)

    out: list[Chunk] = []
    # (a PipelineModule too: DeepSpeed's MoE save writes the module with DeepSpeedEngine's
    # module_state_dict, not the pipeline's per-layer files)
    keys = _module_keys(engine)
    for n, p in engine.module.named_parameters():
        file, key = where.get(n, (model_file, keys.get(id(p), ("module", n))))
        shape, frame = shape_frame(n, p)
        out.append(Chunk(glob(n), MASTER, shape, 0, p.numel(), file, key, 0, frame, rank))
    for g in opt.param_groups:
        if g["canzona_role"] == MATRIX:
            continue
        for p in g["params"]:
            st = opt.state.get(p) or {}
            shape, frame = shape_frame(names[id(p)], p)
            for s in ("exp_avg", "exp_avg_sq"):
                if s in st:
                    out.append(Chunk(glob(names[id(p)]), s, shape, 0, p.numel(), optim_file,
                                     ("optimizer", "state", order.index(id(p)), s), 0, frame, rank))
    return out + _rule_state_chunks(opt, optim_file, ("optimizer", "canzona"), rank, {}, tp)


def _dp_rank(zopt) -> int:
    from deepspeed import comm as dist

    return dist.get_rank(group=zopt.dp_process_group)


def _adam_step(opt) -> float | None:
    """The AdamW step count (matrices keep no torch state; at ZeRO-3 the param groups are empty
    between steps, so the state is read directly)."""
    for st in opt.state.values():
        if isinstance(st, dict) and "step" in st:
            return float(st["step"])
    return None


def emit(engine) -> tuple[list[Chunk] | None, dict]:
    """(this rank's chunks, or None with the reason in the meta; the run's meta)."""
    from ..runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    stage = engine.zero_optimization_stage()
    matrix_step = next((int(g["step"]) for g in opt.param_groups if g["canzona_role"] == MATRIX), 0)
    roles = {}
    for g, names in zip(opt.param_groups, opt.group_names):
        for n in names:
            roles[opt.global_name(n)] = MATRIX if g["canzona_role"] == MATRIX else ADAM
    meta: dict[str, Any] = {
        "stage": stage, "dp": opt.groups.dp_size, "tp": opt.tp_size, "pp": opt.groups.pp_size, "ep": _ep(opt),
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "rule": opt.rule.name, "rule_description": opt.rule.describe(), "roles": roles, "matrix_step": matrix_step, "adam_step": _adam_step(opt),
        "engine_file": None, "scalars": None,
        # expert stacks: their rule state is per expert, W[e] = chunk e of the stack's (E, ...) state
        "expert_stacks": {info.name: info.num_experts for info in opt.infos.values() if info.num_experts is not None},
        # each group's hyper-parameters as the schedule last wrote them (integration/ckpt/param_groups.py)
        "param_groups": describe_groups(opt.param_groups),
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if stage == 0 and opt.moe is not None and getattr(opt.moe, "active", False):
        chunks = _emit_stage0_moe(engine, opt, rank)
        meta["replicas"] = True  # (gather_index keeps the chunks of the files that were written)
    elif stage == 0:
        chunks = _emit_stage0(engine, opt, rank)
    elif stage == 3:
        chunks = _emit_zero3(engine, opt, rank)
    else:
        chunks = _emit_zero12(engine, opt, rank)
    # (a mixed layout's piece can be empty on a rank: nothing to describe)
    return [c for c in chunks if c.length > 0], meta


def _ep(opt) -> int:
    """The DeepSpeed MoE expert-parallel size (1 without MoE)."""
    moe = opt.moe
    return int(opt.groups.ep_size) if moe is not None and getattr(moe, "active", False) else 1


def _roles_here(opt) -> dict[str, str]:
    here = {}
    for g, names in zip(opt.param_groups, opt.group_names):
        for n in names:
            here[opt.global_name(n)] = MATRIX if g["canzona_role"] == MATRIX else ADAM
    return here


def layout_fingerprint(engine) -> str | None:
    """This rank's ZeRO layout fingerprint (the plan and padded layout at ZeRO 1/2, the hosting
    plan at ZeRO 3; None at stage 0, where every rank holds everything): :func:`record_fingerprint`
    of its layout record."""
    meta = getattr(engine.optimizer, "canzona_layout_meta", None)
    return record_fingerprint(meta()) if callable(meta) else None


def record_fingerprint(record: dict) -> str | None:
    """A layout record's fingerprint, with what the plan's own fingerprint does not cover: the
    TP rank of each grid host (the mixed layout under TP: chosen after the plan, so another
    choice keeps a rule state on another rank) and, under DeepSpeed MoE, this rank's place in
    each expert group (``ep_size``, ``ep_rank``, ``edp_rank``: another
    ``use_data_before_expert_parallelism`` puts other experts in this rank's files at the same
    sizes)."""
    fp = record.get("fingerprint")
    if fp is None:
        return None
    hosted = record.get("hosted") if isinstance(record.get("hosted"), dict) else {}  # (ZeRO 3: a list, no TP)
    extra: list = sorted([n, h["tp_host"]] for n, h in hosted.items()
                         if isinstance(h, dict) and h.get("tp_host") is not None)
    extra += [[key] + [info.get(k) for k in ("ep_size", "ep_rank", "edp_rank")]
              for key, info in sorted((record.get("moe") or {}).items()) if isinstance(info, dict)]
    if extra:
        import hashlib
        import json

        fp = f"{fp}:{hashlib.sha256(json.dumps(extra).encode()).hexdigest()[:8]}"
    return fp


def _engine_files(engine) -> tuple[str, dict | None]:
    """The model-states file with the engine counters (DP rank 0's), and the loss-scaler record."""
    name = os.path.basename(engine._get_ckpt_name("", ""))
    if engine.zero_optimization_stage() == 3:
        name = name.replace(f"zero_pp_rank_{_dp_rank(engine.optimizer)}_", "zero_pp_rank_0_")
    scalars = None
    if engine.zero_optimization_stage() > 0:
        zfile = os.path.basename(engine._get_zero_ckpt_name("", ""))
        zfile = zfile.replace(f"zero_pp_rank_{_dp_rank(engine.optimizer)}_", "zero_pp_rank_0_")
        scalars = {"file": zfile, "key": ["optimizer_state_dict"]}
    return name, scalars


def gather_index(engine, tag: str, directory: str) -> Index | None:
    """Every rank's chunks gathered (a collective); the index on rank 0, None elsewhere."""
    import torch.distributed as tdist

    chunks, meta = emit(engine)
    meta["engine_file"], meta["scalars"] = _engine_files(engine)
    payload = (None if chunks is None else [c.to_json() for c in chunks], meta["roles"], layout_fingerprint(engine),
               meta["expert_stacks"], meta["ep"], meta["param_groups"])
    if tdist.is_initialized():
        parts: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, payload)
    else:
        parts = [payload]
    if tdist.is_initialized() and tdist.get_rank() != 0:
        return None
    # every rank's roles and expert stacks (a pipeline stage knows its own parameters only) and
    # layout fingerprint
    meta["roles"] = {n: r for _, roles, *_ in parts for n, r in roles.items()}
    meta["expert_stacks"] = {n: e for _, _, _, stacks, *_ in parts for n, e in stacks.items()}
    meta["fingerprints"] = [fp for _, _, fp, *_ in parts]
    meta["ep"] = max(p[4] for p in parts)  # (a pipeline stage without MoE layers has ep 1)
    meta["param_groups"] = merge_groups(p[5] for p in parts)  # (a pipeline stage has its own groups)
    parts = [c for c, *_ in parts]
    files = sorted(f for f in _list(directory))
    if any(p is None for p in parts):
        all_chunks = None
    else:
        all_chunks = [Chunk.from_json(c) for part in parts for c in part]
        if meta.pop("replicas", False):  # each replica set's one writer: its file, every replica's chunk
            listed = set(files)
            all_chunks = [c for c in all_chunks if c.file in listed]
        # (a pipeline's tied weight that no stage's layer file holds: DeepSpeed saved no master for it)
        unsaved = sorted({c.name for c in all_chunks} - {c.name for c in all_chunks if c.state == MASTER})
        if unsaved:
            all_chunks, meta["no_chunks"] = None, f"parameters whose weights DeepSpeed saved in no file: {unsaved[:5]}"
    return Index(tag, meta, files, all_chunks)


def _list(directory: str) -> list[str]:
    from ...ckpt.tag import SAVING, _list_files

    return [f for f in _list_files(directory) if f not in (INDEX, SAVING)]

"""The checkpoint index of a Canzona engine: each placement emits the chunks it holds at save,
and one loop fills any running layout from the chunks at load (canzona_ds/ckpt/index.py has
the model; this file is the DeepSpeed side).

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
A Canzona tag without an index (written by a development version before the index existed;
no release wrote one) resumes only at the layout it was saved at, through DeepSpeed's stock load;
any other layout is refused by name (:func:`unindexed`).

Load (:func:`load`; :func:`index_route` is the one comparison: the same stage, DP, TP, PP,
ep_size, world size, every rank's layout fingerprint and every role -> DeepSpeed's stock load;
anything else, where the index has chunks and this run's layout an emitter (or where the stage
or a role changed) -> this loop)::

    src = IndexSource(Reader(folder, index))      regions by whole-model name, memory-mapped
    stage 1/2  ckpt_fill.fill_zero12(engine, src)         each rank's views and AdamW overlap
    stage 3    each parameter's piece [r*P, r*P + n) of every state, rule state of its hosts
    stage 0    every parameter whole, its moments; every matrix's rule state
    then the engine's counters, lr scheduler and client state from the saved engine file

Every refusal (another rule, other parameters, other shapes, a role change) is decided from
the index alone, alike on every rank, before any buffer is written.
"""
from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

import torch
from torch import Tensor

from ..ckpt.frames import TPFrame
from ..ckpt.index import INDEX, MASTER, CheckpointIndexError, Chunk, Index, Reader
from ..optim.rule import expert_name
from .param_groups import describe as describe_groups
from .param_groups import merge as merge_groups

logger = logging.getLogger(__name__)

ADAM = "adamw"
MATRIX = "matrix"

#: top-level ds_config section read by :func:`checkpoint_config`
DS_CONFIG_CHECKPOINT_KEY = "canzona_checkpoint"


def checkpoint_config(engine):
    """The engine's ``canzona_checkpoint`` section (config.CheckpointConfig)."""
    from ..config import CheckpointConfig

    return CheckpointConfig.from_section(engine._config._param_dict.get(DS_CONFIG_CHECKPOINT_KEY))


# ---------------------------------------------------------------------------------------- emit
def _experts_of(opt) -> dict[str, tuple[str, int, int]]:
    """An expert stack's rule-state keys (``W[e]``) -> (the stack ``W``, ``e``, E)."""
    return {i.name: (info.name, e, info.num_experts) for info in opt.infos.values() if info.num_experts is not None
            for e, i in enumerate(info.state_infos())}


def _tp_frames(engine, opt) -> dict[str, tuple[TPFrame, tuple[int, ...]]]:
    """This run's TP-split parameters (local name) -> (their shard's frame, the global shape)."""
    from ..tp.layout import tp_blocks
    from ..tp.runtime import TPMatrix, tp_split

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

    m = int(engine.checkpoint_mp_rank)
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
            where[local] = (os.path.basename(engine._get_expert_ckpt_name("", layer, e, "", checkpoint_mp_rank=m)),
                            (key,))
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
    from .runtime_info import canzona_optimizer

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
        # each group's hyper-parameters as the schedule last wrote them (integration/param_groups.py)
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
    from ..checkpoint import SAVING, _list_files

    return [f for f in _list_files(directory) if f not in (INDEX, SAVING)]


# ---------------------------------------------------------------------------------------- load
def latest_tag(ckpt_dir: str) -> str | None:
    """The tag DeepSpeed's ``latest`` file in ``ckpt_dir`` names (None: no such file)."""
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def read_index(folder: str) -> Index | None:
    """The tag's index, or None where the tag has none (written before the index existed)."""
    if not os.path.isfile(os.path.join(folder, INDEX)):
        return None
    return Index.read(folder)


#: a DeepSpeed optimizer-states file of a ZeRO stage (1-3), or of DeepSpeed MoE at stage 0
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def _holds_canzona_state(sd: Any) -> bool:
    """Whether a DeepSpeed file's optimizer state is a Canzona optimizer's (its ``canzona`` entry:
    stage 0 ``optimizer``, ZeRO 1/2 ``base_optimizer_state``, ZeRO 3 the inner state dict)."""
    from ..optimizer import STATE_KEY

    if not isinstance(sd, dict):
        return False
    top = [sd.get("optimizer"), sd.get("optimizer_state_dict")]
    inner = [t.get(k) for t in top if isinstance(t, dict) for k in ("base_optimizer_state", "optimizer_state_dict")]
    return any(isinstance(d, dict) and STATE_KEY in d for d in top + inner)


def unindexed(engine, opt, folder: str) -> None:
    """A tag without an index.  Not a Canzona optimizer's (DeepSpeed's own AdamW wrote it): None,
    DeepSpeed's stock load, whose Canzona side refuses its optimizer state by name
    (integration/zero.py).  A Canzona tag: canzona-ds wrote such a tag only before the index
    existed (development versions, no release); it takes DeepSpeed's stock load where every rank
    runs the layout it was saved at (the ZeRO stage, DP and model-parallel sizes DeepSpeed
    recorded; at ZeRO 1-3 this rank's layout fingerprint against the ``canzona_layout`` record
    those versions wrote into its file; at stage 0 the expert-parallel size of its files), and
    raises :class:`CheckpointIndexError` on every rank for any other.  Reads the structure of at
    most three files per rank (memory-mapped), no tensor data."""
    import torch.distributed as tdist

    from .ckpt_safe import read

    listing = sorted(os.listdir(folder))
    optim = [f for f in listing if _OPTIM_FILE.match(f)] or [f for f in listing if _EXPP_FILE.match(f)]
    probe = optim[0] if optim else next((f for f in ("mp_rank_00_model_states.pt",) if f in listing), None)
    if probe is None or not _holds_canzona_state(read(os.path.join(folder, probe), mmap=True)):
        return None
    stage = engine.zero_optimization_stage()
    here = (stage, int(engine.seq_dp_world_size), int(engine.mp_world_size))
    saved, same = None, False
    model = os.path.join(folder, _engine_files(engine)[0])
    for f in (model, *(os.path.join(folder, n) for n in ("mp_rank_00_model_states.pt",
                                                         "zero_pp_rank_0_mp_rank_00_model_states.pt"))):
        if os.path.isfile(f):  # (the saved sizes DeepSpeed recorded; this stage's own file first)
            sd = read(f, mmap=True)
            zero = ((sd.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
            saved = (int(zero), sd.get("dp_world_size"), sd.get("mp_world_size"))
            same = f == model and saved == here
            break
    if same and stage > 0:
        zfile = os.path.join(folder, os.path.basename(engine._get_zero_ckpt_name("", "")))
        record = (read(zfile, mmap=True).get("optimizer_state_dict") or {}).get("canzona_layout") \
            if os.path.isfile(zfile) else None
        same = isinstance(record, dict) and record_fingerprint(record) == layout_fingerprint(engine)
    elif same:
        ep = len({m.group(1) for f in listing if (m := _EXPP_FILE.match(f))}) or 1
        same = ep == _ep(opt)
    verdict = (same, saved)
    if tdist.is_initialized():
        verdicts: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(verdicts, verdict)
    else:
        verdicts = [verdict]
    if all(v[0] for v in verdicts):
        return None  # the layout it was saved at: DeepSpeed's stock load
    saved = verdicts[0][1]
    was = "at an unknown layout" if saved is None else \
        f"at ZeRO stage {saved[0]}, DP={saved[1]}, model-parallel size {saved[2]}"
    raise CheckpointIndexError(
        f"{folder} has no {INDEX}: a Canzona tag written before the checkpoint index (by a development version of "
        f"canzona-ds; no release writes one), saved {was}. Without the index only the layout it was saved at loads "
        f"it (DeepSpeed's stock load), and this run's is another: ZeRO stage {stage}, DP={opt.groups.dp_size}, "
        f"TP={opt.tp_size}, PP={opt.groups.pp_size}, ep_size={_ep(opt)}"
        f"{' (the layout records differ)' if saved == here else ''}. To continue from it, resume it at the layout "
        "it was saved at (the version that wrote it, or this one) and save once with this version: that save writes "
        "the index, and the new tag resumes at any layout.")


class IndexSource:
    """What ``ckpt_fill.fill_zero12`` (and the stage-0 and ZeRO-3 fills here) read through, answered
    from the index: regions by whole-model name, rule state whole, scalars."""

    def __init__(self, folder: str, index: Index, engine_file: str | None = None) -> None:
        #: ``engine_file``: the model-states file whose engine state (counters, lr scheduler,
        #: client state) this rank takes (default: the index's, DP rank 0's of the first stage)
        self.folder, self.index, self._engine_file = folder, index, engine_file
        from .ckpt_safe import read

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
        self.saved_rule = None if described is None else _rule_from(described)
        #: the running rule (:func:`load` sets it): moves TP=1 state into this run's TP layout
        self.running_rule = None
        self.engine_state, self.client_state = self._engine_state()
        self.zero_scalars = self._zero_scalars()

    def _engine_state(self) -> tuple[dict, dict]:
        from .ckpt_fill import DS_MODEL_KEYS

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

    # the source protocol of ckpt_fill.fill_zero12
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
        from .ckpt_fill import _check_permutable, _layout_perm

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
        from .ckpt_fill import _layout_perm, _permute_state

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
    from ..optim import rule_from_description

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


def restore_param_groups(engine, load_dir: str, tag: str | None) -> None:
    """After a load of the optimizer state (DeepSpeed's stock load or :func:`load`): the live param
    groups get the hyper-parameters the save recorded (integration/param_groups.py), so the first
    resumed step runs at the lr (betas, weight decay, ...) the uninterrupted run's would.  A tag
    written before the index recorded them: read from the optimizer state DeepSpeed saved (the
    torch ``param_groups`` of DP rank 0's file)."""
    from .param_groups import restore
    from .runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    tag = latest_tag(load_dir) if tag is None else tag
    if opt is None or tag is None:
        return
    folder = os.path.join(load_dir, str(tag))
    index = read_index(folder)
    saved = None if index is None else index.meta.get("param_groups")
    if saved is None:
        try:
            saved = _saved_groups_from_files(folder, index)
        except CheckpointIndexError:  # (records it cannot read: only DeepSpeed's stock load took such a tag,
            saved = None              # and that load restored the groups with the optimizer state)
    if saved:
        restore(opt.param_groups, saved)
        _fit_scheduler(engine.lr_scheduler, opt.param_groups)


def _fit_scheduler(sched, groups) -> None:
    """A torch ``LRScheduler`` loaded from a file whose stage had other param groups (a pipeline
    resumed at another PP size) keeps per-group lists of the wrong length: rebuilt from the live
    groups, which hold the saved ``initial_lr`` / ``lr`` of their own role (just restored)."""
    base = getattr(sched, "base_lrs", None)
    if not isinstance(base, list) or len(base) == len(groups) or any("initial_lr" not in g for g in groups):
        return
    sched.base_lrs = [g["initial_lr"] for g in groups]
    sched._last_lr = [g["lr"] for g in groups]
    lambdas = getattr(sched, "lr_lambdas", None)
    if isinstance(lambdas, list) and lambdas and len(lambdas) != len(groups):
        sched.lr_lambdas = [lambdas[0]] * len(groups)  # (one callable given: the same for every group)


def _saved_groups_from_files(folder: str, index: Index | None) -> list[dict] | None:
    """The param groups of the torch optimizer state DeepSpeed wrote (stage 0: the model-states
    file's ``optimizer``; ZeRO 1/2: ``base_optimizer_state``; ZeRO 3: ``optimizer_state_dict``)."""
    from .param_groups import describe

    if index is None or index.chunks is None:  # (no chunks: only the stock load took it, groups and all)
        return None
    reader, m = Reader(folder, index), index.meta
    found = []
    rec = m.get("scalars")
    if rec and rec.get("file"):
        sd = reader._file(rec["file"])
        for k in rec.get("key", ()):
            sd = sd.get(k, {}) if isinstance(sd, dict) else {}
        if isinstance(sd, dict):
            found += [sd.get("base_optimizer_state"), sd.get("optimizer_state_dict")]
    if m.get("engine_file") and os.path.isfile(os.path.join(folder, m["engine_file"])):
        found.append(reader._file(m["engine_file"]).get("optimizer"))
    for sd in found:
        if isinstance(sd, dict) and isinstance(sd.get("param_groups"), list):
            return describe(sd["param_groups"])
    return None


def index_route(engine, load_dir: str, tag: str | None) -> Index | None:
    """The one comparison.  The checkpoint's index against this run: the same ZeRO stage, DP,
    TP, PP and expert-parallel size, world size, every rank's layout fingerprint and every
    parameter's role -> None (DeepSpeed's stock load); anything else -> the index, for the index loop, where the
    index describes its chunks and the loop fills this run's layout, or where a role or the
    ZeRO stage changed (the loop then refuses by name what it cannot do).  A tag without an index
    (written before the index existed): :func:`unindexed` (the stock load at its saved layout, else refused by name).
    A tag whose chunks are not described (weights DeepSpeed wrote in no file) resumes at another DP size through
    DeepSpeed's stock load (stage 0 replicates everything; None), and is refused by name in
    :func:`load` for any other change.  The verdicts are all-gathered, so every rank takes the
    same branch."""
    import torch.distributed as tdist

    from .runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    if opt is None:
        return None
    tag = latest_tag(load_dir) if tag is None else tag
    if tag is None:
        return None
    folder = os.path.join(load_dir, str(tag))
    index = read_index(folder)
    if index is None:  # no index: DeepSpeed's stock load at the saved layout, else refused by name
        return unindexed(engine, opt, folder)
    missing = sorted(f for f in index.files if not os.path.isfile(os.path.join(folder, f)))
    if missing:  # (every rank reads the same directory: every rank refuses)
        raise CheckpointIndexError(f"{folder} lacks {missing[:6]}{' ...' if len(missing) > 6 else ''}, which its "
                                   "index lists: the tag is incomplete (files removed, or a copy that missed them), so "
                                   "it cannot be resumed. Restore the files, or resume from another tag.")
    m = index.meta
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    here = (engine.zero_optimization_stage(), opt.groups.dp_size, opt.tp_size, opt.groups.pp_size, _ep(opt), world)
    saved_fps = m.get("fingerprints") or []
    mine = layout_fingerprint(engine)
    same = (here[:4] + here[5:] == (m.get("stage"), m.get("dp"), m.get("tp"), m.get("pp"), m.get("world_size"))
            and rank < len(saved_fps) and saved_fps[rank] == mine)
    roles_here = _roles_here(opt)
    changed = any(n in m.get("roles", {}) and m["roles"][n] != r for n, r in roles_here.items())
    verdict = (same, changed, _ep(opt))
    if tdist.is_initialized():
        verdicts: list = [None] * world
        tdist.all_gather_object(verdicts, verdict)
    else:
        verdicts = [verdict]
    ep = max(v[2] for v in verdicts)  # (a pipeline stage without MoE layers has ep 1)
    if all(v[0] for v in verdicts) and not any(v[1] for v in verdicts) and ep == m.get("ep", 1):
        return None  # the same fingerprint: DeepSpeed's stock load
    if any(v[1] for v in verdicts) or m.get("stage") != engine.zero_optimization_stage():
        return index  # the loop fills it, or refuses by name (DeepSpeed's load would crash)
    if index.chunks is None and here[0] == m.get("stage") == 0 and (here[2], here[3], ep) == (
            m.get("tp"), m.get("pp"), m.get("ep", 1)):
        return None  # stage 0 at another DP size: every rank loads the replicated state (DeepSpeed's own load)
    return index  # the loop fills it, or load() refuses by name what its chunks cannot give


def _roles_here(opt) -> dict[str, str]:
    here = {}
    for g, names in zip(opt.param_groups, opt.group_names):
        for n in names:
            here[opt.global_name(n)] = MATRIX if g["canzona_role"] == MATRIX else ADAM
    return here


def load(engine, load_dir: str, tag: str | None, index: Index, load_module_strict: bool = True,
         load_lr_scheduler_states: bool = True) -> tuple[str, dict]:
    """Fill ``engine`` from any saved layout the index describes (module docstring)."""
    from .ckpt_fill import fill_zero12
    from .runtime_info import canzona_optimizer

    tag = latest_tag(load_dir) if tag is None else tag
    folder = os.path.join(load_dir, str(tag))
    opt = canzona_optimizer(engine)
    stage = engine.zero_optimization_stage()
    reinit = bool(checkpoint_config(engine).reinit_changed_roles)
    changed = set(_check_roles(engine, opt, index, folder, reinit))
    todo = "; ".join(t for t in (
        f"ZeRO stage {index.meta.get('stage')} -> {stage}" if index.meta.get("stage") != stage else "",
        f"PP {index.meta.get('pp')} -> {opt.groups.pp_size}" if index.meta.get("pp") != opt.groups.pp_size else "",
        f"re-initialising {sorted(changed)[:4]}" if changed else "") if t) or "another layout"
    if index.chunks is None:
        m = index.meta
        raise CheckpointIndexError(
            f"{folder} was saved at ZeRO stage {m.get('stage')}, DP={m.get('dp')}, TP={m.get('tp')}, PP={m.get('pp')}, "
            f"ep_size={m.get('ep', 1)} with {m.get('no_chunks')}, so its index describes no chunks and only its own "
            f"layout loads (at stage 0 also another DP size); this run has ZeRO stage {stage}, DP={opt.groups.dp_size}, "
            f"TP={opt.tp_size}, PP={opt.groups.pp_size}, ep_size={_ep(opt)} ({todo}).")
    # under pipeline parallelism each stage's model-states file holds its own lr scheduler (one entry
    # per param group of that stage): a stage that has its saved file takes it
    own = _engine_files(engine)[0]
    src = IndexSource(folder, index, engine_file=own if own in index.files else None)
    if src.rule != opt.rule.name:
        raise CheckpointIndexError(f"{folder} holds {src.rule!r} state; this engine runs {opt.rule.name!r}.")
    import torch.distributed as tdist

    local = {opt.global_name(n) for names in opt.group_names for n in names}
    here = set(local)
    if opt.moe is not None and getattr(opt.moe, "active", False):  # every expert of the model, not only this rank's
        here |= set(opt.moe.global_order)
    if opt.groups.pp_size > 1:  # each stage holds its own parameters: the model is every stage's
        parts: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, sorted(local))
        here = {n for part in parts for n in part}
        src.only = local
    from .ckpt_fill import _check_state, agreed

    with agreed():  # (local checks: a refusal on any rank is raised on every rank)
        saved_names = set(index.names)
        missing, extra = sorted(here - saved_names), sorted(saved_names - here)
        if missing or extra:
            raise CheckpointIndexError(f"{folder}: the checkpoint's parameters differ from the model's: missing "
                                       f"{missing[:5]}, unexpected {extra[:5]}.")
        tp_full = {n: full for n, (_, full) in _tp_frames(engine, opt).items()}  # (a TP shard: its global shape)
        for n, p in engine.module.named_parameters():
            shape, g = tp_full.get(n, tuple(getattr(p, "ds_shape", p.shape))), opt.global_name(n)
            if tuple(src.full_shape(g)) != shape:
                raise CheckpointIndexError(
                    f"{folder}: {g!r} is {tuple(src.full_shape(g))} in the checkpoint, {shape} here; a resume needs "
                    "the model's shapes as saved (Megatron-DeepSpeed pads the vocabulary to a multiple of "
                    "--make-vocab-size-divisible-by x TP: at another TP size choose it so that both pad to one size).")
        src.changed, src.running_rule = changed, opt.rule
        tp_layouts = _tp_layouts(engine, opt)[0]
        local_of = {opt.global_name(n): n for n in opt.state_infos}  # (a DeepSpeed MoE expert's local name)
        for name in src.state_names():  # every rule state fits this run's settings (shapes only)
            if name in local_of:
                _check_state(opt.rule, opt.state_infos[local_of[name]], src.state_shapes(name))
                if stage in (0, 3):  # (at ZeRO 1/2 write checks it against this run's TP layout)
                    src.check_state_layout(opt.rule, name, tp_layouts.get(local_of[name]))
    for n in sorted(changed):
        logger.warning("canzona_ds: %s: %r changed role (%s -> %s); its optimizer state is re-initialised "
                       "(reinit_changed_roles)", folder, n, src.roles[n],
                       MATRIX if src.roles[n] == ADAM else ADAM)
    if stage == 0:
        fill_stage0(engine, opt, src, changed)
    elif stage == 3:
        fill_zero3(engine, opt, src, changed)
    else:
        fill_zero12(engine, src)
    return folder, _apply_engine_state(engine, src, load_lr_scheduler_states)

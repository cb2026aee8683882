"""The reader's route of a Canzona engine's load: the one comparison and the index loop.

Load (:func:`load`; :func:`index_route` is the one comparison: the same stage, DP, TP, PP,
ep_size, world size, every rank's layout fingerprint and every role -> DeepSpeed's stock load;
anything else, where the index has chunks and this run's layout an emitter (or where the stage
or a role changed) -> this loop)::

    src = IndexSource(Reader(folder, index))      regions by whole-model name, memory-mapped
    stage 1/2  fill.fill_zero12(engine, src)         each rank's views and AdamW overlap
    stage 3    each parameter's piece [r*P, r*P + n) of every state, rule state of its hosts
    stage 0    every parameter whole, its moments; every matrix's rule state
    then the engine's counters, lr scheduler and client state from the saved engine file

Every refusal (another rule, other parameters, other shapes, a role change) is decided from
the index alone, alike on every rank, before any buffer is written.

A Canzona tag without an index (written by a development version before the index existed;
no release wrote one) resumes only at the layout it was saved at, through DeepSpeed's stock load;
any other layout is refused by name (:func:`unindexed`).

:func:`restore_param_groups` then writes the param groups' saved hyper-parameters into the live
groups after either route (param_groups.py).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any

from ...ckpt.index import INDEX, CheckpointIndexError, Index, Reader

logger = logging.getLogger(__name__)
from .emit import (ADAM, MATRIX, _engine_files, _ep, _roles_here, _tp_frames, checkpoint_config, layout_fingerprint,
                   record_fingerprint)
from .fill import IndexSource, _apply_engine_state, _check_roles, _tp_layouts, fill_stage0, fill_zero3

def latest_tag(ckpt_dir: str) -> str | None:
    """The tag DeepSpeed's ``latest`` file in ``ckpt_dir`` names (None: no such file); a ``latest``
    that names anything but a tag directory of ``ckpt_dir`` is refused by name
    (``ckpt/tag.read_latest``)."""
    from ...ckpt.tag import read_latest

    return read_latest(str(ckpt_dir))


def read_index(folder: str) -> Index | None:
    """The tag's index, or None where the tag has none (written before the index existed)."""
    if not os.path.lexists(os.path.join(folder, INDEX)):
        return None
    return Index.read(folder)


#: a DeepSpeed optimizer-states file of a ZeRO stage (1-3), or of DeepSpeed MoE at stage 0
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def _holds_canzona_state(sd: Any) -> bool:
    """Whether a DeepSpeed file's optimizer state is a Canzona optimizer's (its ``canzona`` entry:
    stage 0 ``optimizer``, ZeRO 1/2 ``base_optimizer_state``, ZeRO 3 the inner state dict)."""
    from ...optimizer import STATE_KEY

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

    from .safe import read

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


def restore_param_groups(engine, load_dir: str, tag: str | None) -> None:
    """After a load of the optimizer state (DeepSpeed's stock load or :func:`load`): the live param
    groups get the hyper-parameters the save recorded (integration/ckpt/param_groups.py), so the first
    resumed step runs at the lr (betas, weight decay, ...) the uninterrupted run's would.  A tag
    written before the index recorded them: read from the optimizer state DeepSpeed saved (the
    torch ``param_groups`` of DP rank 0's file)."""
    from .param_groups import restore
    from ..runtime_info import canzona_optimizer

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

    from ..runtime_info import canzona_optimizer

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



def load(engine, load_dir: str, tag: str | None, index: Index, load_module_strict: bool = True,
         load_lr_scheduler_states: bool = True) -> tuple[str, dict]:
    """Fill ``engine`` from any saved layout the index describes (module docstring)."""
    from .fill import fill_zero12
    from ..runtime_info import canzona_optimizer

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
    from .fill import _check_state, agreed

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

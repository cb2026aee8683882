"""The checkpoint index of a tag written before the index existed, built from the records
canzona-ds wrote into its files (:func:`legacy_index`); the tag then takes the same comparison
and the same loop as any other (integration/ckpt_index.py).  Nothing here reads tensor data:
every file is opened memory-mapped and only its pickled structure is looked at; each piece
becomes a :class:`Chunk` where DeepSpeed put it::

    ZeRO 1/2   canzona_layout (each zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt) + param_shapes
               (mp_rank_<m>_model_states.pt):
                 a matrix group   P = shard_numel per rank; a matrix at buffer offset ``off``:
                                  owned  -> whole in partition ``owner`` at ``off - owner*P``
                                  hosted (mixed, owner -1) -> its pieces in the consecutive
                                  partitions it crosses; its element-wise rule state (piece_state)
                                  cut the same way, in rank order
                 an AdamW group   the parameters in param_shapes order, each followed by its
                                  alignment padding, over the partitions in rank order
                 a DeepSpeed MoE expert group (param group ``canzona_partition`` = its key): one
                                  buffer per expert-parallel rank over its expert-DP files
                                  (``moe[key]``: ep_rank, edp_rank), experts by whole-model name
                                  (``moe[key].global_names``)
               under pipeline parallelism each stage's files (mp rank = the stage), TP 1
    ZeRO 3     canzona_layout kind "zero3": every sub-group's parameters, their element counts
    ZeRO 0     mp_rank_<m>_model_states.pt (module/<name>, optimizer/state/<i>, canzona/...);
               under DeepSpeed MoE the optimizer in expp_rank_<k>_mp_rank_<m>_optim_states.pt
               (param groups by local and whole-model name: canzona/param_names, global_names),
               each expert in layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt

What cannot be described is an index without chunks whose ``meta["refusal"]`` says why (a
resize is then refused by name; the same layout still takes DeepSpeed's stock load): tensor
parallelism (TP layout frames), expert groups whose records lack the experts' whole-model
names, stage-0 MoE files without parameter names, a pipeline at ZeRO 0 (its weights are in
per-layer files the old records do not map).
"""
from __future__ import annotations

import os
import re

import torch

from ..ckpt.index import INDEX, MASTER, CheckpointIndexError, Chunk, Index
from ..optim.rule import expert_name
from .ckpt_index import record_fingerprint

ADAM, MATRIX = "adamw", "matrix"
EXPP_FILE = re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_FILE = "mp_rank_{:02d}_model_states.pt"
OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")

#: an expert group whose records do not name its experts globally (an older canzona-ds)
MOE_REFUSAL = ("{where}: this checkpoint has DeepSpeed MoE expert groups but its layout record lacks the experts' "
               "whole-model names and expert-parallel ranks (written by an older canzona-ds), so it cannot be "
               "resumed at another DP or expert-parallel size, nor at another ZeRO stage. Resume it at the size it "
               "was saved at (engine.load_checkpoint does), or load the module weights only "
               "(load_optimizer_states=False, load_module_only=True).")


#: the files one :func:`legacy_index` call has opened (memory-mapped: structure only), by path
_opened: dict[str, dict] | None = None


def _load(path: str) -> dict:
    """A checkpoint file memory-mapped (its structure; tensor data stays in the file until sliced)."""
    from .ckpt_safe import read

    if _opened is not None and path in _opened:
        return _opened[path]
    try:
        obj = read(path, mmap=True)
    except RuntimeError:  # written with the legacy (non-zip) format: cannot be mapped
        obj = read(path)
    if _opened is not None:
        _opened[path] = obj
    return obj


def _listing(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))


def _index(folder: str, meta: dict, chunks: list[Chunk] | None, what: str) -> Index:
    chunks = [c for c in chunks if c.length > 0]  # (a mixed layout's piece can be empty on a rank)
    index = Index(os.path.basename(folder.rstrip("/")), meta, _listing(folder), chunks)
    if chunks is not None:
        index.validate(f"{folder} (index built from its {what} records)")
    return index


def _refused(folder: str, meta: dict, why: str) -> Index:
    """An index without chunks: the same layout resumes (DeepSpeed's stock load), any other is
    refused by name with ``why``."""
    meta = dict(meta, no_chunks=why, refusal=why, adapted_from="records without what a resize needs")
    return Index(os.path.basename(folder.rstrip("/")), meta, _listing(folder), None)


def legacy_index(folder: str) -> Index | None:
    """The index of a tag written before the index existed, built from its records (module doc);
    None where ``folder`` is no such tag (no Canzona records: DeepSpeed's own load decides).
    Each file is opened once per call (a stage-0 model file holds every weight)."""
    global _opened

    _opened = {}
    try:
        return _legacy_index(folder)
    except (KeyError, IndexError, TypeError, AttributeError) as e:  # records of a shape no release wrote
        raise CheckpointIndexError(f"{folder} has no {INDEX} (written before the checkpoint index) and its "
                                   f"canzona-ds records cannot be read ({type(e).__name__}: {e}); it cannot be "
                                   "resumed with its optimizer state. Load the module weights only "
                                   "(load_module_only=True).") from e
    finally:
        _opened = None


def _legacy_index(folder: str) -> Index | None:
    if not os.path.isdir(folder):
        return None
    listing = os.listdir(folder)
    optim = sorted((int(m.group(1)), int(m.group(2)), f) for f in listing if (m := OPTIM_FILE.search(f)))
    if optim:
        first = _load(os.path.join(folder, optim[0][2]))["optimizer_state_dict"]
        kind = (first.get("canzona_layout") or {}).get("kind")
        if kind == "zero3":
            return legacy_zero3_index(folder)
        if first.get("canzona_layout") is None:
            return None
        return legacy_zero12_index(folder, optim)
    if any(EXPP_FILE.search(f) for f in listing):
        return legacy_stage0_index(folder, moe=True)
    if MODEL_FILE.format(0) in listing:
        return legacy_stage0_index(folder, moe=False)
    return None


# ------------------------------------------------------------------------------------ ZeRO 1/2
def legacy_zero12_index(folder: str, optim: list[tuple[int, int, str]]) -> Index | None:
    """ZeRO 1/2: the layout record of every optimizer file (module doc)."""
    dp = max(r for r, _, _ in optim) + 1
    mps = sorted({m for _, m, _ in optim})
    by = {(r, m): f for r, m, f in optim}
    missing = [f"zero_pp_rank_{r}_mp_rank_{m:02d}" for r in range(dp) for m in mps if (r, m) not in by]
    if missing or mps != list(range(len(mps))):
        return None  # (the manifest names missing files; DeepSpeed's load says so)
    sds = {k: _load(os.path.join(folder, f))["optimizer_state_dict"] for k, f in by.items()}
    metas = {k: sd.get("canzona_layout") or {} for k, sd in sds.items()}
    meta0 = metas[(0, 0)]
    if any(m.get("matrix_names") is None for m in metas.values()):
        return None  # not a planned Canzona layout
    tp, pp = int(meta0.get("tp_size", 1)), int(meta0.get("pp_size", 1))
    eps = [int(i["ep_size"]) for m in metas.values() for i in (m.get("moe") or {}).values() if "ep_size" in i]
    fps = [None] * (dp * len(mps))
    for (r, m), mt in metas.items():  # by global rank: a pipeline grid's ranks are stage-major
        fps[(int(mt.get("pp_rank", m)) if pp > 1 else m) * dp + r] = record_fingerprint(mt)
    meta = {"stage": None, "dp": dp, "tp": tp, "pp": pp, "ep": max(eps, default=1), "world_size": dp * len(mps),
            "rule": meta0["rule"], "roles": {}, "matrix_step": 0, "adam_step": None,
            "engine_file": MODEL_FILE.format(0), "scalars": {"file": by[(0, 0)], "key": ["optimizer_state_dict"]},
            "fingerprints": fps, "expert_stacks": {}, "adapted_from": "canzona_layout (ZeRO 1/2)"}
    stage = None
    ds_model = _load(os.path.join(folder, MODEL_FILE.format(0)))
    cfg = (ds_model.get("ds_config") or {}).get("zero_optimization") or {}
    stage = int(cfg.get("stage", 1)) if isinstance(cfg, dict) else 1
    meta["stage"] = stage
    if tp > 1:
        return _refused(folder, meta, f"tensor parallelism (TP={tp}), written before the checkpoint index: its TP "
                                      "layouts are not described here, so it resumes at its saved TP, DP and PP "
                                      "size only (DeepSpeed's stock load); resume it there and save once (that save "
                                      "writes the index), then resume the new tag at the new size")
    for mt in metas.values():
        for info in (mt.get("moe") or {}).values():
            if not {"global_names", "ep_rank", "ep_size", "edp_rank"} <= set(info):
                return _refused(folder, meta, MOE_REFUSAL.format(where=folder))
    chunks: list[Chunk] = []
    for m in mps:
        files = [by[(r, m)] for r in range(dp)]
        _stage_chunks(folder, m, files, [sds[(r, m)] for r in range(dp)], [metas[(r, m)] for r in range(dp)],
                      meta, chunks)
    return _index(folder, meta, chunks, "ZeRO 1/2 layout")


def _stage_chunks(folder: str, m: int, files: list[str], sds: list[dict], metas: list[dict], meta: dict,
                  chunks: list[Chunk]) -> None:
    """The chunks of one model-parallel rank's files (a pipeline stage; TP 1): ``files[r]`` is
    DP rank r's optimizer file, ``sds[r]`` its ``optimizer_state_dict``."""
    model = _load(os.path.join(folder, MODEL_FILE.format(m)))
    base0 = sds[0]["base_optimizer_state"]
    partition_of = [g.get("canzona_partition") for g in base0["param_groups"]]
    mt0 = metas[0]
    for g, role in enumerate(mt0["roles"]):
        shapes = {n: tuple(s) for n, s in model["param_shapes"][g].items()}
        key = partition_of[g]
        if key is not None:  # a DeepSpeed MoE expert group
            _expert_chunks(g, role, key, shapes, files, sds, metas, meta, chunks)
            continue
        if role == MATRIX:
            owners = mt0.get("owner_at") or [r for r, c in enumerate(mt0["rank_counts"]) for _ in range(c)]
            experts = {n for mt in metas for i in (mt.get("moe") or {}).values() for n in i["matrix_names"]}
            _matrix_chunks(g, mt0["matrix_names"], mt0["offsets"], owners, int(mt0["shard_numel"]), shapes,
                           list(range(len(files))), files, sds, lambda n: n, experts, meta, chunks)
        else:
            _adam_chunks(g, shapes, list(range(len(files))), files, sds, lambda n: n, meta, chunks)


def _matrix_chunks(g, names, offsets, owners, P, shapes, order, files, sds, glob, skip, meta, chunks):
    """A matrix group's buffer over the files ``order`` (its DP, or expert-DP, ranks in order):
    every matrix's master (whole in its owner's partition, or a hosted one's pieces), the rule
    state each file keeps, a hosted matrix's element-wise pieces in rank order."""
    fkey = ("optimizer_state_dict", "single_partition_of_fp32_groups", g)
    for name, off, owner in zip(names, offsets, owners):
        shape = shapes[name]
        n = int(torch.Size(shape).numel())
        meta["roles"][glob(name)] = MATRIX
        if owner >= 0:
            chunks.append(Chunk(glob(name), MASTER, shape, 0, n, files[order[owner]], fkey, off - owner * P))
            continue
        for e, r in enumerate(order):  # hosted: its pieces in the consecutive partitions it crosses
            a, b = max(off, e * P), min(off + n, (e + 1) * P)
            if a < b:
                chunks.append(Chunk(glob(name), MASTER, shape, a - off, b - a, files[r], fkey, a - e * P))
    mine = set(names)
    pieces: dict[str, int] = {}
    for r in order:
        base = sds[r]["base_optimizer_state"]
        meta["matrix_step"] = int(base["param_groups"][g]["step"])
        canzona = base["canzona"]
        prefix = ("optimizer_state_dict", "base_optimizer_state", "canzona")
        for name, st in canzona["matrix_state"].items():
            stack, e = _stack_of(name, shapes)
            if (stack or name) not in mine or name in skip:
                continue
            for k, v in st.items():
                if stack is None:
                    chunks.append(Chunk(glob(name), k, tuple(v.shape), 0, v.numel(), files[r],
                                        prefix + ("matrix_state", name, k)))
                else:  # an expert stack's expert e: chunk e of the stack's (E, ...) state
                    E = shapes[stack][0]
                    meta["expert_stacks"][glob(stack)] = E
                    chunks.append(Chunk(glob(stack), k, (E,) + tuple(v.shape), e * v.numel(), v.numel(), files[r],
                                        prefix + ("matrix_state", name, k)))
        for name, st in (canzona.get("piece_state") or {}).items():  # the mixed layout, in rank order
            if name not in mine or name in skip:
                continue
            at = pieces.get(name, 0)
            for k, v in st.items():
                chunks.append(Chunk(glob(name), k, shapes[name], at, v.numel(), files[r],
                                    prefix + ("piece_state", name, k)))
            pieces[name] = at + next(iter(st.values())).numel() if st else at


def _stack_of(name: str, shapes: dict) -> tuple[str | None, int]:
    """``W[e]`` of an expert stack ``W`` (3-D, E experts) -> (``W``, e); else (None, 0)."""
    stack, _, e = name[:-1].rpartition("[") if name.endswith("]") else ("", "", "")
    if stack in shapes and e.isdigit() and len(shapes[stack]) == 3:
        return stack, int(e)
    return None, 0


def _adam_chunks(g, shapes, order, files, sds, glob, meta, chunks):
    """An AdamW group's buffer over the files ``order``: each parameter followed by its padding."""
    lengths = [sds[r]["single_partition_of_fp32_groups"][g].numel() for r in order]
    starts = [sum(lengths[:e]) for e in range(len(order))]
    base = sds[order[0]]["base_optimizer_state"]
    st0 = base["state"].get(g) or {}
    if "step" in st0:
        meta["adam_step"] = float(st0["step"])
    off = 0
    for (name, shape), pad in zip(shapes.items(), sds[order[0]]["param_alignment_paddings"][g]):
        n = int(torch.Size(shape).numel())
        meta["roles"][glob(name)] = ADAM
        for e, r in enumerate(order):
            a, b = max(off, starts[e]), min(off + n, starts[e] + lengths[e])
            if a >= b:
                continue
            chunks.append(Chunk(glob(name), MASTER, shape, a - off, b - a, files[r],
                                ("optimizer_state_dict", "single_partition_of_fp32_groups", g), a - starts[e]))
            st = sds[r]["base_optimizer_state"]["state"].get(g) or {}
            for k in ADAM_KEYS:
                if k in st:
                    chunks.append(Chunk(glob(name), k, shape, a - off, b - a, files[r],
                                        ("optimizer_state_dict", "base_optimizer_state", "state", g, k),
                                        a - starts[e]))
        off += n + int(pad)


def _expert_chunks(g, role, key, shapes, files, sds, metas, meta, chunks):
    """Expert group ``key`` (param group ``g``): each expert-parallel rank k's buffer over its
    expert-DP files (``moe[key]``: ep_rank, edp_rank), experts by whole-model name."""
    by: dict[int, dict[int, int]] = {}
    for r, mt in enumerate(metas):
        info = mt["moe"][key]
        by.setdefault(int(info["ep_rank"]), {})[int(info["edp_rank"])] = r
    for k, edp in sorted(by.items()):
        order = [edp[e] for e in range(len(edp))]
        info = metas[order[0]]["moe"][key]
        names = info["global_names"]
        glob = (lambda n, names=names: names.get(n, n))
        if role == MATRIX:
            owners = info.get("owner_at") or [e for e, c in enumerate(info["rank_counts"]) for _ in range(c)]
            _matrix_chunks(g, info["matrix_names"], info["offsets"], owners, int(info["shard_numel"]), shapes,
                           order, files, sds, glob, set(), meta, chunks)
        else:
            _adam_chunks(g, shapes, order, files, sds, glob, meta, chunks)


# --------------------------------------------------------------------------------------- ZeRO 0
def legacy_stage0_index(folder: str, moe: bool) -> Index | None:
    """ZeRO 0: each model-parallel rank m's (a pipeline stage's; TP 1) model-states file (the
    module whole, or None for a ``PipelineModule``, whose layers DeepSpeed writes to
    ``layer_<idx>-model_states.pt`` by their own parameter names) and its optimizer (in that
    file, or under DeepSpeed MoE in the expp_rank files, each expert's weight in its
    ``layer_<l>_expert_<e>_mp_rank_<m>`` file by whole-model name); the param groups name their
    parameters (``canzona/param_names``, ``global_names``)."""
    listing = os.listdir(folder)
    model = _load(os.path.join(folder, MODEL_FILE.format(0))) if MODEL_FILE.format(0) in listing else None
    if not isinstance(model, dict):
        return None
    mp = int(model.get("mp_world_size") or 1)
    dp = int(model.get("dp_world_size") or 1)
    pp = int((model.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) or 1)
    tp = mp // pp
    expp = sorted((int(m.group(2)), int(m.group(1)), f) for f in listing if (m := EXPP_FILE.search(f)))
    ep = len({k for _, k, _ in expp}) if moe else 1
    # (under MoE x PP a stage without MoE layers keeps its optimizer in its model-states file)
    optims = {m: [f for mm, _, f in expp if mm == m] or [MODEL_FILE.format(m)] for m in range(mp)}
    first = _load(os.path.join(folder, optims[0][0])) if optims[0] else {}
    canzona = (first.get("optimizer") or {}).get("canzona") if isinstance(first, dict) else None
    if not isinstance(canzona, dict):
        return None  # not a Canzona optimizer's state
    meta = {"stage": 0, "dp": dp, "tp": tp, "pp": pp, "ep": ep, "world_size": dp * mp, "rule": canzona.get("rule"),
            "roles": {}, "matrix_step": 0, "adam_step": None, "engine_file": MODEL_FILE.format(0), "scalars": None,
            "fingerprints": [None] * (dp * mp), "expert_stacks": {}, "adapted_from": "stage-0 optimizer records"}
    if tp > 1:
        return _refused(folder, meta, f"{folder}: ZeRO stage 0 with tensor parallelism (TP={tp}), written before "
                                      "the checkpoint index: its TP layouts are not described here, so it resumes "
                                      "at its saved sizes only (DeepSpeed's stock load); resume it there and save "
                                      "once (that save writes the index), then resume the new tag at the new size")
    if moe and "global_names" not in canzona:
        return _refused(folder, meta, f"{folder}: its ZeRO stage 0 optimizer files (expert-parallel size {ep}) do "
                                      "not name their parameters (written by an older canzona-ds), so it resumes "
                                      "only with the saved ep_size (any DP size), at ZeRO stage 0; or load the "
                                      "module weights only (load_optimizer_states=False)")
    if "param_names" not in canzona:
        return _refused(folder, meta, f"{folder}: its ZeRO stage 0 optimizer file does not name its parameters "
                                      "(written by an older canzona-ds), so it resumes at ZeRO stage 0 only")
    where: dict[str, tuple[str, tuple]] = {}  # whole-model name -> (file, key) of an expert's weight
    for f in listing:
        if EXPERT_FILE.search(f):
            for n in _load(os.path.join(folder, f)):
                where.setdefault(n, (f, (n,)))
    chunks: list[Chunk] = []
    seen: set[str] = set()
    shapes: dict[str, tuple] = {}
    layers = _layer_weights(folder, optims) if model.get("module") is None else None
    for m in range(mp):
        for file in optims[m]:
            sd = _load(os.path.join(folder, file))["optimizer"]
            path = ("optimizer",)
            cz = sd["canzona"]
            glob_names = cz.get("global_names") or cz["param_names"]
            for g, (group, locals_, globals_) in enumerate(zip(sd["param_groups"], cz["param_names"], glob_names)):
                matrix = group.get("canzona_role") == MATRIX
                if matrix:
                    meta["matrix_step"] = int(group["step"])
                for i, (local, name) in enumerate(zip(locals_, globals_)):
                    if name in seen:
                        continue  # (every expp_rank file, every stage of a tied weight holds it; the first)
                    seen.add(name)
                    meta["roles"][name] = MATRIX if matrix else ADAM
                    if name in where:
                        wfile, wkey = where[name]
                    elif layers is not None:
                        if name not in layers:
                            return _refused(folder, meta, f"{folder}: the weight of {name!r} is in none of the "
                                                          "pipeline's layer files, so it cannot be read by name")
                        wfile, wkey = layers[name]
                    else:
                        wfile, wkey = MODEL_FILE.format(m), ("module", local)
                    weight = _load(os.path.join(folder, wfile))
                    for k in wkey:
                        weight = weight[k]
                    shape = shapes[name] = tuple(weight.shape)
                    chunks.append(Chunk(name, MASTER, shape, 0, weight.numel(), wfile, wkey))
                    if matrix:
                        for k, v in (cz.get("matrix_state") or {}).get(local, {}).items():
                            chunks.append(Chunk(name, k, tuple(v.shape), 0, v.numel(), file,
                                                path + ("canzona", "matrix_state", local, k)))
                        continue
                    st = sd["state"].get(group["params"][i]) or {}
                    if "step" in st:
                        meta["adam_step"] = float(st["step"])
                    for k in ADAM_KEYS:
                        if k in st:
                            chunks.append(Chunk(name, k, shape, 0, st[k].numel(), file,
                                                path + ("state", group["params"][i], k)))
            for local, st in (cz.get("matrix_state") or {}).items():  # an expert stack's experts: W[e]
                stack, e = _stack_of(local, shapes)
                if stack is not None:
                    E = shapes[stack][0]
                    meta["expert_stacks"][stack] = E
                    for k, v in st.items():
                        chunks.append(Chunk(stack, k, (E,) + tuple(v.shape), e * v.numel(), v.numel(), file,
                                            path + ("canzona", "matrix_state", local, k)))
    return _index(folder, meta, chunks, "stage-0 optimizer")


def _layer_weights(folder: str, optims: dict) -> dict[str, tuple[str, tuple]]:
    """A ``PipelineModule`` at ZeRO 0 (TP 1): parameter ``"<idx>.<rest>"`` is ``<rest>`` of
    ``layer_<idx:02d>-model_states.pt``; a tied module's ``"tied_modules.<key>.<rest>"`` is in
    the one layer file that holds ``<rest>`` and whose layer has no parameters of its own name
    (the layer that *is* the tied module; a layer calling it through a ``forward_fn`` writes no
    file)."""
    names = set()
    for files in optims.values():
        for f in files:
            cz = _load(os.path.join(folder, f))["optimizer"]["canzona"]
            names |= {n for group in cz["param_names"] for n in group}
    files = {int(m.group(1)): f for f in os.listdir(folder) if (m := re.fullmatch(r"layer_(\d+)-model_states\.pt", f))}
    own = {int(n.split(".", 1)[0]) for n in names if n.split(".", 1)[0].isdigit()}
    out = {}
    for n in names:
        head, _, rest = n.partition(".")
        if head.isdigit() and int(head) in files:
            out[n] = (files[int(head)], (rest,))
        elif head == "tied_modules":
            rest = rest.partition(".")[2]
            found = [f for i, f in sorted(files.items()) if i not in own and rest in _load(os.path.join(folder, f))]
            if len(found) == 1:
                out[n] = (found[0], (rest,))
    return out


# --------------------------------------------------------------------------------------- ZeRO 3
def legacy_zero3_index(folder: str) -> Index | None:
    """The index of a ZeRO-3 tag written before the index existed, built from the layout record
    each optimizer file carries (``canzona_layout``, ``kind: "zero3"``: every sub-group's
    parameters in flat order, their element counts, the DP size) and the shapes DeepSpeed's
    model-states file records; None where the tag is not such a checkpoint.  Each parameter of
    ``n`` elements was saved as ``dp`` pieces of ``P = ceil(n / dp)`` (the last one short), piece
    ``r`` at its offset of rank ``r``'s flat sub-group::

        rank r file: fp32_flat_groups[s] = | a[rP:rP+n_r] pad | b[rP:rP+n_r] pad | ...
    """
    if not os.path.isdir(folder):
        return None
    files = sorted((int(m.group(1)), f) for f in os.listdir(folder) if (m := OPTIM_FILE.search(f))
                   and int(m.group(2)) == 0)
    if not files:
        return None
    first = _load(os.path.join(folder, files[0][1]))["optimizer_state_dict"]
    if (first.get("canzona_layout") or {}).get("kind") != "zero3":
        return None
    tops = [first] + [_load(os.path.join(folder, f))["optimizer_state_dict"] for _, f in files[1:]]
    metas = [t.get("canzona_layout") or {} for t in tops]
    if any(m.get("kind") != "zero3" or "sub_groups" not in m for m in metas):
        return None
    meta0 = metas[0]
    dp = int(meta0["world_size"])
    if [r for r, _ in files] != list(range(dp)):
        return None  # the files of another DP size, or some missing: the manifest names them
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shapes = {}
    for group in _load(os.path.join(folder, model_file)).get("param_shapes") or []:
        shapes.update({n: tuple(s) for n, s in group.items()})
    numels = meta0["numels"]
    inner = [t["optimizer_state_dict"] for t in tops]
    idx_of, k = {}, 0  # sub-group -> torch state index (param group order, sub-groups within)
    for g in range(len(inner[0]["param_groups"])):
        for sg, pg in enumerate(meta0["sub_group_param_group"]):
            if pg == g:
                idx_of[sg], k = k, k + 1
    chunks = []
    for r, (_, file) in enumerate(files):
        state = inner[r]["state"]
        for sg, names in enumerate(meta0["sub_groups"]):
            off = 0
            st = state.get(idx_of[sg]) or {}
            for name in names:
                n_all = int(numels[name])
                P = -(-n_all // dp)
                n = max(0, min(P, n_all - r * P))
                if n:
                    key = ("optimizer_state_dict", "fp32_flat_groups", sg)
                    chunks.append(Chunk(name, MASTER, shapes[name], r * P, n, file, key, off, None, r))
                    for sk in ADAM_KEYS:
                        if sk in st:
                            chunks.append(Chunk(name, sk, shapes[name], r * P, n, file, ("optimizer_state_dict",
                                          "optimizer_state_dict", "state", idx_of[sg], sk), off, None, r))
                off += P
        for name, st in ((inner[r].get("canzona") or {}).get("matrix_state") or {}).items():
            for sk, v in st.items():
                chunks.append(Chunk(name, sk, tuple(v.shape), 0, v.numel(), file, ("optimizer_state_dict",
                              "optimizer_state_dict", "canzona", "matrix_state", name, sk), 0, None, r))
    matrices = set(meta0["matrix_names"])
    groups = inner[0]["param_groups"]
    adam_step = next((float(st["step"]) for st in inner[0]["state"].values() if "step" in st), None)
    meta = {"stage": 3, "dp": dp, "tp": 1, "pp": 1, "ep": 1, "world_size": dp, "rule": meta0["rule"],
            "roles": {n: (MATRIX if n in matrices else ADAM) for n in numels},
            "matrix_step": next((int(g["step"]) for g in groups if g.get("canzona_role") == MATRIX), 0),
            "adam_step": adam_step, "engine_file": model_file,
            "scalars": {"file": files[0][1], "key": ["optimizer_state_dict"]},
            "fingerprints": [record_fingerprint(m) for m in metas], "adapted_from": "canzona_layout (zero3)"}
    return _index(folder, meta, chunks, "ZeRO-3 layout")

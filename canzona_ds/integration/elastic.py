"""Resume a Canzona ZeRO checkpoint at another DP (and TP) size: every matrix's state follows it.

A Canzona checkpoint is DeepSpeed's own (one ``zero_pp_rank_{dp}_mp_rank_{tp}_optim_states.pt``
per rank, one ``mp_rank_{tp}_model_states.pt`` per TP rank) plus, in every optimizer file,
the layout it was written with (``canzona_layout``: the plan, offsets, TP layout of every
split parameter) and every matrix's rule state by name.  That is enough to rebuild, for
every parameter, its whole (TP=1) fp32 master weight and optimizer state, whatever the
DP and TP size it was saved at::

    SavedCheckpoint(dir, tag)               the files memory-mapped and indexed: any slice of a
                                            parameter's fp32 master, AdamW moments or rule state
                                            on request (TP=1 layout or a TP rank's), step counts,
                                            loss scale, lr scheduler, client state
    read(dir, tag)  -> Universal            the same, every parameter whole in memory (converter)
    write(engine, source)                   fill a live engine laid out for the CURRENT
                                            DP x TP (its plan, its layout, its TP hosts) with
                                            what this rank holds, from either
    load(engine, dir, tag) = write(engine, SavedCheckpoint(dir, tag))

Nothing is approximated: matrices are moved whole (a DP change only changes which rank
owns a matrix and where its range starts), AdamW's element-wise state is re-sliced, and a
TP change re-orders rows (or columns) by the permutation between the TP layouts of the two
sizes (``canzona_ds/tp/layout.py``), which each rule maps onto its state through
``MatrixRule.state_axes`` (e.g. SOAP's L is row x row, its eigenbasis row x eigen).  A
state that cannot follow such a permutation (Shampoo blocks cut along the split dimension
of a fused layout) is refused by name; where a matrix keeps its saved TP layout (another DP
size or plan, a grid host at another TP rank) its state is taken as saved, nothing permuted
(``SavedCheckpoint.state_in``).

Under DeepSpeed MoE (ZeRO 1/2) every expert parameter is indexed by its whole-model name (local
expert j on expert-parallel rank k is global expert k*E/ep + j, recorded per file in
``canzona_layout.moe[group].global_names``): each expert-parallel rank's expert group is one
flat buffer partitioned over its expert-DP group, and at the new size a rank takes the
experts of its new expert-parallel rank and the matrices of its new expert-DP plan, so a
resume may change the DP size and ``ep_size`` (docs/moe.md).  Under Megatron tensor parallelism
(whole experts) DeepSpeed's expert groups span the TP ranks, so one expert group's files lie at
different TP ranks: each expert group is indexed over the files of every TP rank (by the
expert-parallel and expert-DP rank each file records), the dense groups as without MoE, and a
resume may change TP too.  At ZeRO stage 0 DeepSpeed's own
load resumes at another DP size; another ``ep_size`` goes through ``load_stage0_moe`` (each
parameter's state from the expp_rank file that held it, by whole-model name).  Under pipeline
parallelism (MoE x PP, TP 1) DeepSpeed numbers a stage's files by its model-parallel rank, the
stage, and each stage's ranks read their own stage's files only (``_stage_file_ranks``,
``SavedCheckpoint(mp_ranks=...)``; at ZeRO 0 the stage's expp_rank files): another DP size or
``ep_size`` at the same PP size; the converter and the mixed layout are refused there.

``engine.load_checkpoint`` of a Canzona engine takes this path by itself for the layouts the
checkpoint index does not describe yet and for ZeRO 1/2 tags written before the index (DeepSpeed
MoE and tensor parallelism at ZeRO 1/2 go through the index), when the checkpoint's DP or TP size differs from the engine's
(integration/registry.py); every other layout change goes through the index
(integration/ckpt_index.py).  ``canzona-ckpt convert`` reads through ``read`` where the index
describes no chunks.

Memory: ``load`` never builds the ``Universal``.  It opens every file memory-mapped
(``SavedCheckpoint``: ``torch.load(mmap=True)`` reads the pickled structure, no tensor data)
and each rank copies out only the slices it will hold in the new layout, straight into its
own buffers::

    saved at DP=2      rank 0 file | W0  W3  pad | adam[0:P)   |   rank 1 file | W1  W2  W4 | adam[P:2P) |
    resumed at DP=4    rank 2 owns W2 and adam[2Q:3Q): it touches W2's bytes in rank 1's file and
                       the pages of adam[2Q:3Q) (and their moments) in whichever files hold them

so a rank reads (and its resident memory grows by) its own share of the fp32 state, not the
model's.  The bit16 weights every rank keeps whole come from the owners' fp32 partitions,
broadcast into the flat bit16 buffer (what DeepSpeed's post-step all-gather does), not from
the files.  Only a TP-split parameter whose TP size changes is rebuilt whole, one at a time,
on the ranks holding part of it.  ``read`` (the converter) still builds every parameter whole.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
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


#: DeepSpeed MoE checkpoints written before the layout record named every expert globally
MOE_REFUSAL = ("{where}: this checkpoint has DeepSpeed MoE expert groups but its layout record lacks the experts' "
               "whole-model names and expert-parallel ranks (written by an older canzona-ds), so it cannot be "
               "resumed at another DP or expert-parallel size. Resume it at the size it was saved at "
               "(engine.load_checkpoint does), or load the module weights only (load_optimizer_states=False, "
               "load_module_only=True); checkpoints written now resume at any DP and ep_size, either layout (docs/moe.md).")


def _check_moe_meta(folder: str, metas: list[dict], tp: int = 1, stage: bool = False) -> None:
    """A DeepSpeed MoE checkpoint resumes at another size when every file records its experts'
    whole-model names (``canzona_layout.moe[group].global_names``), with either layout (a mixed
    group also records ``owner_at`` and ``hosted``), at any TP size ``tp`` (whole experts: each file holds its expert-parallel rank's partition,
    wherever its TP rank lies; ``SavedCheckpoint._index_experts``).  Under pipeline parallelism
    only when ``stage``: the files read are one pipeline stage's (``SavedCheckpoint(mp_ranks=...)``,
    as ``load`` opens them), without TP and in the owned layout (what is tested)."""
    for m in metas:
        pp = m.get("pp_size", 1)
        if pp > 1 and (not stage or tp > 1 or m.get("layout") == "mixed"
                       or any(i.get("layout") == "mixed" for i in m["moe"].values())):
            raise ElasticError(MOE_PP_REFUSAL.format(where=folder, pp=pp))
        if tp > 1 and (m.get("layout") == "mixed" or any(i.get("layout") == "mixed" for i in m["moe"].values())):
            raise ElasticError(MOE_TP_MIXED_REFUSAL.format(where=folder, tp=tp))
        for info in m["moe"].values():
            if not {"global_names", "ep_rank", "ep_size"} <= set(info):
                raise ElasticError(MOE_REFUSAL.format(where=folder))
            if info.get("layout") == "mixed" and not {"owner_at", "hosted"} <= set(info):
                raise ElasticError(f"{folder}: this DeepSpeed MoE checkpoint's expert groups have the mixed ZeRO "
                                   "layout but their layout record lacks 'owner_at' and 'hosted' (which matrices "
                                   "are cut over the expert-DP ranks), so it cannot be resumed at another size or "
                                   "layout. Resume it at the size and layout it was saved at (engine.load_checkpoint "
                                   "does), or load the module weights only (load_module_only=True).")


#: DeepSpeed MoE x tensor parallelism x the mixed layout: not resumable at another size (untested)
MOE_TP_MIXED_REFUSAL = ("{where}: a DeepSpeed MoE checkpoint with tensor parallelism (TP={tp}) and the mixed ZeRO layout "
                        "cannot be resumed at another size or layout (not implemented for MoE x TP x the mixed "
                        "layout); resume it at the size and layout it was saved at (engine.load_checkpoint does), or "
                        "load the module weights only (load_module_only=True). Set layout 'owned' for MoE x TP runs "
                        "that must resize.")


#: DeepSpeed MoE x pipeline parallelism: resumable at another DP size and ep_size through ``load``
#: (ZeRO 1, the owned layout; ZeRO 0: ``load_stage0_moe``), each stage from its own files; not
#: through the converter (which reads every model-parallel file as a TP rank), nor in the mixed
#: layout (untested)
MOE_PP_REFUSAL = ("{where}: a DeepSpeed MoE checkpoint saved under pipeline parallelism (PP={pp}) is resumed at another "
                  "size only by engine.load_checkpoint (ZeRO 0, or ZeRO 1 in the owned layout), each pipeline stage "
                  "from its own files (another DP size or ep_size, the same PP size); it cannot be read whole here "
                  "(the offline converter), nor resized in the mixed layout (not implemented for MoE x pipeline "
                  "parallelism). Resume it at the size it was saved at, or load the module weights only "
                  "(load_module_only=True).")


#: the owner recorded for a hosted matrix of the mixed layout (ZeRO's partitions hold its pieces)
HOSTED = -1
#: the key of a parameter's fp32 master weight in ``flat_range``; the others are AdamW's moments
MASTER = "param"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


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

    # what ``write`` reads through (``SavedCheckpoint`` answers the same)
    @property
    def names(self) -> list[str]:
        return list(self.params)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.params[name].shape)

    def flat_range(self, name: str, key: str, start: int, stop: int, tp_layout, tp_rank: int) -> Tensor:
        whole = self.params[name] if key == MASTER else self.adam.get(name, {}).get(key)
        if whole is None:
            raise ElasticError(f"{name!r} has no AdamW state in the checkpoint (a matrix there?).")
        if tp_layout is not None:
            from ..tp.layout import shard

            dim, sizes, blocks = tp_layout
            whole = shard(whole, dim, blocks, sizes, tp_rank)
        return whole.reshape(-1)[start:stop]

    def state_names(self) -> list[str]:
        return list(self.rule_state)

    def state_shapes(self, name: str) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.rule_state[name].items() if isinstance(v, Tensor)}

    def state_of(self, name: str) -> dict[str, Any]:
        return self.rule_state[name]

    def check_state_layout(self, rule, name: str, tp_layout) -> None:
        """Refuse (ElasticError, by name) a state that cannot be laid out as ``tp_layout``
        ((dim, shard sizes, blocks) of this run; None: not split)."""
        if tp_layout is not None:
            _check_permutable(rule, name, self.state_shapes(name), self.full_shape(name), _layout_perm(tp_layout))

    def state_in(self, rule, name: str, tp_layout) -> dict[str, Any]:
        """The rule state of ``name`` in ``tp_layout`` (the TP layout a host of this run sees)."""
        state = self.rule_state[name]
        if tp_layout is None:
            return state
        return _permute_state(rule, name, state, self.full_shape(name), tp_layout[0], _layout_perm(tp_layout),
                              inverse=False)


# ------------------------------------------------------------------------------ reading
def latest_tag(ckpt_dir: str) -> str | None:
    """The tag DeepSpeed's ``latest`` file in ``ckpt_dir`` names (None: no such file)."""
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def resolve_tag(ckpt_dir: str, tag: str | None) -> str:
    """``tag``, or the one ``latest`` names (FileNotFoundError naming the file if there is none)."""
    if tag is not None:
        return tag
    found = latest_tag(ckpt_dir)
    if found is None:
        raise FileNotFoundError(f"No tag given and no 'latest' file in {ckpt_dir}.")
    return found


def checkpoint_size(ckpt_dir: str, tag: str) -> tuple[int, int]:
    """(DP size, TP size) a checkpoint was written at, from its file names."""
    ranks = [OPTIM_FILE.search(f) for f in os.listdir(os.path.join(ckpt_dir, tag))]
    found = [(int(m.group(1)), int(m.group(2))) for m in ranks if m]
    if not found:
        raise ElasticError(f"{os.path.join(ckpt_dir, tag)} has no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt).")
    return max(d for d, _ in found) + 1, max(t for _, t in found) + 1


def _load(path: str, mmap: bool = False) -> dict:
    """A checkpoint file; with ``mmap`` its tensors stay in the file until sliced and copied."""
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # written with the legacy (non-zip) format: cannot be mapped
            pass
    return torch.load(path, map_location="cpu", weights_only=False)


def _owned(obj: Any) -> Any:
    """``obj`` with every tensor copied out of a memory-mapped file (small things handed to the user)."""
    if isinstance(obj, Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps an OrderedDict or defaultdict what it is
        for k, v in obj.items():
            out[k] = _owned(v)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_owned(v) for v in obj)
    return obj


class SavedCheckpoint:
    """A Canzona checkpoint opened for slicing: every file memory-mapped, no tensor data read
    until ``flat_range`` or ``state_of`` asks for it (see the module doc).

    ``elements_read`` counts the elements handed out so far: what this rank copied from the
    checkpoint (a whole parameter counts once per TP shard it was rebuilt from)."""

    def __init__(self, ckpt_dir: str, tag: str, mmap: bool = True, mp_ranks: list[int] | None = None) -> None:
        """``mp_ranks``: the model-parallel file ranks to read, by TP rank (pipeline parallelism:
        DeepSpeed numbers files by pipe x slice rank, and a stage reads its own); default: every
        file rank is a TP rank."""
        folder = os.path.join(ckpt_dir, tag)
        dp, tp = checkpoint_size(ckpt_dir, tag)
        file_rank = list(range(tp)) if mp_ranks is None else list(mp_ranks)
        tp = len(file_rank)
        found = {(int(m.group(1)), int(m.group(2))): os.path.join(folder, f)
                 for f in os.listdir(folder) if (m := OPTIM_FILE.search(f))}
        files = {(r, t): found[(r, mp)] for r in range(dp) for t, mp in enumerate(file_rank) if (r, mp) in found}
        missing = [f"zero_pp_rank_{r}_mp_rank_{mp:02d}" for r in range(dp) for t, mp in enumerate(file_rank)
                   if (r, t) not in files]
        if missing:
            raise ElasticError(f"{folder} lacks optimizer files {missing}.")
        self.dp, self.tp, self.folder, self._mmap = dp, tp, folder, mmap
        self.elements_read = 0
        #: [tp rank][dp rank] -> that file's optimizer_state_dict (tensors memory-mapped)
        self._shards = [[_load(files[(r, t)], mmap)["optimizer_state_dict"] for r in range(dp)] for t in range(tp)]
        #: [tp rank] name -> (group, the file (DP rank) holding it whole or None for the AdamW group
        #: or HOSTED, offset in that file's partition (in the group's buffer when not owned),
        #: TP-local shape, the key of its buffer's partitions in ``_parts``)
        self._where: list[dict[str, tuple[int, int | None, int, tuple[int, ...], Any]]] = []
        #: [tp rank] buffer key -> (file, start, numel) of every partition of that flat buffer, in
        #: order: the key is the group for a dense group (one buffer over DP), (group, expert-parallel
        #: rank) for an expert group (one buffer per expert-parallel rank, over its expert-DP group)
        self._parts: list[dict[Any, list[tuple[int, int, int]]]] = []
        self._state_at: dict[str, tuple[int, int]] = {}  # matrix -> the (tp, dp) file holding its rule state
        self._state_key: dict[str, str] = {}  # matrix -> its name in that file (an expert's local name)
        self._pieces: dict[str, list[int]] = {}  # hosted matrix -> the DP files holding pieces of its state
        #: a hosted expert (mixed layout under MoE) -> the (tp, dp) files holding pieces of its
        #: element-wise state, in its expert-DP order, and its (local) name there
        self._expert_pieces: dict[str, list[tuple[int, int]]] = {}
        self._piece_key: dict[str, str] = {}
        hosted: set[str] = set()
        meta0, rule_description = None, None
        self.adam_step, self.matrix_step = 0.0, 0
        #: DeepSpeed MoE: expert group -> (ep_size, number of experts per layer prefix), as saved
        self.moe: dict[str, dict[str, Any]] = {}
        for t in range(tp):
            shards = self._shards[t]
            model = _load(os.path.join(folder, MODEL_FILE.format(file_rank[t])), mmap)
            metas = [s.get(LAYOUT_KEY) for s in shards]
            if any(m is None or m.get("matrix_names") is None for m in metas):
                raise ElasticError(f"{folder} was not written by a Canzona optimizer with a planned layout (no "
                                   f"'{LAYOUT_KEY}'); only Canzona checkpoints can change size here.")
            if any(m.get("moe") for m in metas):
                _check_moe_meta(folder, metas, tp, stage=mp_ranks is not None)
            meta = metas[0]
            meta0 = meta0 or meta
            where: dict[str, tuple] = {}
            parts: dict[Any, list[tuple[int, int, int]]] = {}
            partition_of = [g.get("canzona_partition") for g in shards[0]["base_optimizer_state"]["param_groups"]]
            for g, role in enumerate(meta["roles"]):
                shapes = dict(model["param_shapes"][g])
                key = partition_of[g]
                if key is not None:  # a DeepSpeed MoE expert group: one buffer per expert-parallel rank
                    if t == 0:  # (its files lie across the TP ranks: indexed once, from all of them)
                        self._index_experts(g, role, key, shapes, where, parts)
                    continue
                if role == "matrix":
                    P = meta["shard_numel"]
                    owners = meta.get("owner_at") or [r for r, c in enumerate(meta["rank_counts"]) for _ in range(c)]
                    for name, off, owner in zip(meta["matrix_names"], meta["offsets"], owners):
                        if owner < 0:  # hosted (mixed layout): its pieces lie in consecutive partitions
                            where[name] = (g, HOSTED, off, tuple(shapes[name]), g)
                            parts[g] = [(r, r * P, P) for r in range(len(shards))]
                        else:
                            where[name] = (g, owner, off - owner * P, tuple(shapes[name]), g)
                    for r, s in enumerate(shards):
                        base = s["base_optimizer_state"]
                        rule_description = base["canzona"]["config"]["rule"]
                        # (a DeepSpeed MoE expert's state is under its local name: _index_experts)
                        experts = {n for info in (metas[r].get("moe") or {}).values() for n in info["matrix_names"]}
                        for name in base["canzona"]["matrix_state"]:
                            if name not in experts:
                                self._state_at.setdefault(name, (t, r))  # TP replicas of a non-split matrix agree
                                self._state_key.setdefault(name, name)
                        if t == 0:  # a hosted matrix's element-wise state, cut like its pieces (mixed layout)
                            for name in base["canzona"].get("piece_state", {}):
                                if name not in experts:
                                    self._pieces.setdefault(name, []).append(r)
                        self.matrix_step = int(base["param_groups"][g]["step"])
                else:
                    lengths = [s["single_partition_of_fp32_groups"][g].numel() for s in shards]
                    parts[g] = [(r, sum(lengths[:r]), n) for r, n in enumerate(lengths)]
                    self.adam_step = float(shards[0]["base_optimizer_state"]["state"][g]["step"])
                    off = 0
                    for (name, shape), pad in zip(shapes.items(), shards[0]["param_alignment_paddings"][g]):
                        where[name] = (g, None, off, tuple(shape), g)
                        off += int(torch.Size(shape).numel()) + pad
            hosted |= set(meta["tp_params"]) & set(meta["matrix_names"])
            self._where.append(where)
            self._parts.append(parts)
            if t == 0:
                self.zero_scalars = _owned({k: shards[0][k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow")
                                            if k in shards[0]})
                self.engine_state = _owned({k: model.get(k) for k in ("global_steps", "global_samples",
                                                                      "skipped_steps", "lr_scheduler")})
                self.client_state = _owned({k: v for k, v in model.items() if k not in DS_MODEL_KEYS})
            self._model = model  # (its bit16 weights are never read; held as the reader before held it)
        self.rule = meta0["rule"]
        #: name -> (dim, shard sizes, blocks) of every TP-split parameter, as saved
        self.tp_params = {n: (int(d), tuple(s), tuple(b)) for n, (d, s, b) in meta0["tp_params"].items()}
        self._hosted = hosted
        self._rule = None if rule_description is None else _rule_of(rule_description)
        # (a state that cannot leave its saved TP layout is refused where it would have to: state_of,
        # and write's checks, from shapes alone, on every rank)

    @property
    def names(self) -> list[str]:
        return list(self._where[0])

    def _index_experts(self, g: int, role: str, key: str, shapes: dict, where: dict, parts: dict) -> None:
        """Index group ``g``, the ``role`` group of DeepSpeed MoE expert group ``key``, by the
        experts' whole-model names (into TP rank 0's tables, which every unsplit parameter is
        read through).

        Each expert-parallel rank k holds its own experts in its own flat buffer, partitioned over
        its expert-DP group: file (t, r) holds partition ``edp_rank`` of rank ``ep_rank``'s buffer
        (``canzona_layout.moe[key]``).  The experts are whole (not split over TP), and under
        tensor parallelism DeepSpeed's expert groups span the TP ranks (at TP 2 x DP 2, ep_size 2
        the expert-parallel groups are the TP groups), so the files of one buffer may lie at
        different TP ranks: every file of every TP rank is a (t, r) here.  A matrix lies whole in
        its owner's partition; an expert's AdamW range may cross the partitions of its buffer."""
        files: dict[int, dict[int, tuple[int, int]]] = {}  # ep rank -> edp rank -> file (tp, dp)
        metas = {}
        for t, shards in enumerate(self._shards):
            for r, s in enumerate(shards):
                info = s[LAYOUT_KEY]["moe"][key]
                k, e = int(info["ep_rank"]), int(info["edp_rank"])
                if e in files.setdefault(k, {}):
                    raise ElasticError(f"{self.folder}: expert group {key!r} has two files for expert-parallel rank "
                                       f"{k}, expert-DP rank {e}: {files[k][e]} and {(t, r)} (experts split over "
                                       "TP are not supported).")
                files[k][e] = (t, r)
                metas[(t, r)] = info
        info0 = metas[(0, 0)]
        ep_size, edp_size = int(info0["ep_size"]), int(info0["world_size"])
        if sorted(files) != list(range(ep_size)) or any(sorted(f) != list(range(edp_size)) for f in files.values()):
            raise ElasticError(f"{self.folder}: the files of expert group {key!r} do not cover its {ep_size} "
                               f"expert-parallel x {edp_size} expert-DP ranks: {files}.")
        self.moe[key] = {"ep_size": ep_size, "edp_size": edp_size}
        for k, by_edp in sorted(files.items()):
            order = [by_edp[e] for e in range(edp_size)]
            info = metas[order[0]]
            glob = info["global_names"]
            if role == "matrix":
                P = int(info["shard_numel"])
                owners = info.get("owner_at") or [e for e, c in enumerate(info["rank_counts"]) for _ in range(c)]
                for name, off, owner in zip(info["matrix_names"], info["offsets"], owners):
                    if owner < 0:  # hosted (mixed layout): its pieces lie in consecutive partitions of the buffer
                        where[glob[name]] = (g, HOSTED, off, tuple(shapes[name]), (g, k))
                        parts[(g, k)] = [(tr, e * P, P) for e, tr in enumerate(order)]
                    else:
                        where[glob[name]] = (g, order[owner], off - owner * P, tuple(shapes[name]), (g, k))
                for t, r in order:
                    base = self._shards[t][r]["base_optimizer_state"]
                    self.matrix_step = int(base["param_groups"][g]["step"])
                    for name in base["canzona"]["matrix_state"]:
                        if name in glob and name in info["matrix_names"]:
                            self._state_at.setdefault(glob[name], (t, r))
                            self._state_key.setdefault(glob[name], name)
                    # a hosted expert's element-wise state: a piece per expert-DP rank (mixed layout)
                    for name in base["canzona"].get("piece_state", {}):
                        if name in glob and name in info["matrix_names"]:
                            self._expert_pieces.setdefault(glob[name], []).append((t, r))
                            self._piece_key[glob[name]] = name
                continue
            lengths = [self._shards[t][r]["single_partition_of_fp32_groups"][g].numel() for t, r in order]
            parts[(g, k)] = [(tr, sum(lengths[:e]), n) for e, (tr, n) in enumerate(zip(order, lengths))]
            t0, r0 = order[0]
            self.adam_step = float(self._shards[t0][r0]["base_optimizer_state"]["state"][g]["step"])
            off = 0
            for (name, shape), pad in zip(shapes.items(), self._shards[t0][r0]["param_alignment_paddings"][g]):
                where[glob[name]] = (g, None, off, tuple(shape), (g, k))
                off += int(torch.Size(shape).numel()) + pad

    def _perm(self, name: str) -> Tensor:
        from ..tp.layout import concat_permutation

        _, sizes, blocks = self.tp_params[name]
        return concat_permutation(blocks, sizes)

    def full_shape(self, name: str) -> tuple[int, ...]:
        shape = list(self._where[0][name][3])
        if name in self.tp_params:
            dim, sizes, _ = self.tp_params[name]
            shape[dim] = sum(sizes)
        return tuple(shape)

    def _partition(self, t: int, r: int | tuple[int, int], g: int, key: str) -> Tensor:
        """File ``r`` of TP rank ``t`` (or the file ``r`` = (tp, dp) itself: an expert group's)."""
        if isinstance(r, tuple):
            t, r = r
        shard = self._shards[t][r]
        if key == MASTER:
            return shard["single_partition_of_fp32_groups"][g]
        return shard["base_optimizer_state"]["state"][g][key]

    def local_range(self, t: int, name: str, key: str, start: int, stop: int) -> Tensor:
        """Elements [start, stop) of ``name`` flattened as saved TP rank ``t`` held it: a view into
        the one file holding them, or the few pieces of an AdamW range that crosses partitions."""
        g, owner, off, _, buffer = self._where[t][name]
        if owner is not None and key != MASTER:
            raise ElasticError(f"{name!r} is a matrix in the checkpoint and has no AdamW state.")
        if owner is not None and owner != HOSTED:
            pieces = [self._partition(t, owner, g, MASTER)[off + start:off + stop]]
        else:  # AdamW, or a hosted matrix of the mixed layout: across the partitions of its buffer
            a, b = off + start, off + stop
            pieces = [self._partition(t, r, g, key)[max(a, lo) - lo:min(b, lo + n) - lo]
                      for r, lo, n in self._parts[t][buffer] if max(a, lo) < min(b, lo + n)]
        self.elements_read += sum(p.numel() for p in pieces)
        if not pieces:
            return torch.empty(0)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def whole(self, name: str, key: str = MASTER) -> Tensor:
        """``name``'s TP=1 tensor (a copy), from every saved TP shard of a split parameter."""
        from ..tp.layout import unshard

        def local(t: int) -> Tensor:
            shape = self._where[t][name][3]
            return self.local_range(t, name, key, 0, int(torch.Size(shape).numel())).view(shape)

        if name in self.tp_params:
            dim, _, blocks = self.tp_params[name]
            return unshard([local(t) for t in range(self.tp)], dim, blocks)
        return local(0).clone()

    def flat_range(self, name: str, key: str, start: int, stop: int, tp_layout, tp_rank: int) -> Tensor:
        """Elements [start, stop) of ``name`` flattened as TP rank ``tp_rank`` of ``tp_layout``
        ((dim, shard sizes, blocks); None: not split) holds it.  Sliced from the file holding
        them when the TP layout is the saved one; else from the whole parameter."""
        saved = self.tp_params.get(name)
        if saved is None and tp_layout is None:
            return self.local_range(0, name, key, start, stop)
        if saved is not None and tp_layout is not None and saved == _layout_key(tp_layout):
            return self.local_range(tp_rank, name, key, start, stop)
        whole = self.whole(name, key)
        if tp_layout is not None:
            from ..tp.layout import shard

            dim, sizes, blocks = tp_layout
            whole = shard(whole, dim, blocks, sizes, tp_rank)
        return whole.reshape(-1)[start:stop]

    def state_names(self) -> list[str]:
        return list(self._state_at)

    def _saved_state(self, name: str) -> dict[str, Any]:
        t, r = self._state_at[name]
        state = self._shards[t][r]["base_optimizer_state"]["canzona"]["matrix_state"][self._state_key[name]]
        if name in self._expert_pieces:  # a hosted expert: its pieces across its expert-DP files, in order
            files = [self._shards[ft][fr]["base_optimizer_state"]["canzona"]["piece_state"][self._piece_key[name]]
                     for ft, fr in self._expert_pieces[name]]
            shape = self._where[0][name][3]
            return {**state, **{key: torch.cat([f[key].reshape(-1) for f in files]).view(shape) for key in files[0]}}
        if name not in self._pieces:
            return state
        # the mixed layout: the host holds the other keys, every rank its piece of the element-wise
        # ones (MatrixRule.elementwise_state), joined here in rank order (pieces follow the buffer)
        state = dict(state)
        # a TP-split one (the DP x TP grid, tp/runtime.GridSplit): each TP rank's files hold the
        # pieces of its shard; the shards side by side along the split dim are the TP layout
        shards = []
        for t in range(self.tp if name in self.tp_params else 1):
            files = [self._shards[t][r]["base_optimizer_state"]["canzona"]["piece_state"][name]
                     for r in sorted(self._pieces[name])]
            shape = self._where[t][name][3]
            shards.append({key: torch.cat([f[key].reshape(-1) for f in files]).view(shape) for key in files[0]})
        dim = self.tp_params[name][0] if name in self.tp_params else 0
        for key in shards[0]:
            state[key] = torch.cat([sh[key] for sh in shards], dim=dim) if len(shards) > 1 else shards[0][key]
        return state

    def state_shapes(self, name: str) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._saved_state(name).items() if isinstance(v, Tensor)}

    def state_of(self, name: str) -> dict[str, Any]:
        """The rule state of ``name`` in the TP=1 layout (views into the file where no permutation
        was needed: copy what you keep)."""
        state = self._saved_state(name)
        self.elements_read += sum(v.numel() for v in state.values() if isinstance(v, Tensor))
        if name in self._hosted:
            dim = self.tp_params[name][0]
            state = _permute_state(self._rule, name, state, self.full_shape(name), dim, self._perm(name), inverse=True)
        return state

    def _same_tp_layout(self, name: str, tp_layout) -> bool:
        saved = self.tp_params.get(name)
        return saved is not None and tp_layout is not None and saved == _layout_key(tp_layout)

    def check_state_layout(self, rule, name: str, tp_layout) -> None:
        """Refuse (ElasticError, by name) a state that cannot be laid out as ``tp_layout``
        ((dim, shard sizes, blocks) of this run; None: not split).  Where that is the saved TP
        layout nothing moves, so every rule's state fits, Shampoo's blocked factors too (another
        DP size or plan, a grid host at another TP rank)."""
        if self._same_tp_layout(name, tp_layout):
            return
        if name in self._hosted:  # to the TP=1 layout
            _check_permutable(self._rule, name, self.state_shapes(name), self.full_shape(name), self._perm(name))
        if tp_layout is not None:  # and into this run's
            _check_permutable(rule, name, self.state_shapes(name), self.full_shape(name), _layout_perm(tp_layout))

    def state_in(self, rule, name: str, tp_layout) -> dict[str, Any]:
        """The rule state of ``name`` in ``tp_layout`` (the TP layout a host of this run sees):
        as saved where that is the saved TP layout (views into the file: copy what you keep),
        else through the TP=1 layout (:meth:`state_of`)."""
        if not self._same_tp_layout(name, tp_layout):
            state = self.state_of(name)
            if tp_layout is None:
                return state
            return _permute_state(rule, name, state, self.full_shape(name), tp_layout[0], _layout_perm(tp_layout),
                                  inverse=False)
        state = self._saved_state(name)
        self.elements_read += sum(v.numel() for v in state.values() if isinstance(v, Tensor))
        return state

    def universal(self) -> Universal:
        """Every parameter and its state whole, in memory (the converter's form)."""
        params = {name: self.whole(name) for name in self.names}
        adam = {name: {k: self.whole(name, k) for k in ADAM_KEYS}
                for name in self.names if self._where[0][name][1] is None}
        # copied out of the mapped files: a Universal must outlive them (a save may rewrite a file in place)
        rule_state = {name: (_owned if self._mmap else dict)(self.state_of(name)) for name in self._state_at}
        return Universal(rule=self.rule, params=params, adam=adam, adam_step=self.adam_step, rule_state=rule_state,
                         matrix_step=self.matrix_step, zero_scalars=self.zero_scalars, engine_state=self.engine_state,
                         client_state=self.client_state, source={"dp": self.dp, "tp": self.tp, "dir": self.folder})


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


def read(ckpt_dir: str, tag: str, mmap: bool = True) -> Universal:
    """Every parameter and its state, whole (see the module doc); ``mmap=False`` reads every
    file into memory first (the elastic load before it read by slices)."""
    return SavedCheckpoint(ckpt_dir, tag, mmap=mmap).universal()


def _check_permutable(rule, name: str, shapes: dict[str, tuple[int, ...]], full_shape, perm: Tensor) -> None:
    """Refuse (by name) a state that cannot follow the TP-layout permutation ``perm``."""
    from ..optim.rule import MatrixInfo

    if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
        return
    info = MatrixInfo(name, tuple(full_shape))
    for key, shape in shapes.items():
        if rule.state_axes(key, tuple(shape), info) is None:
            raise ElasticError(f"The {rule.name} state {key!r} of {name!r} cannot follow a change of tensor-parallel "
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


# ------------------------------------------------------------------------------ writing
def _check_state(rule, info, shapes: dict[str, tuple[int, ...]]) -> None:
    """The loaded state has every tensor this rule keeps for the matrix, with its shape (e.g.
    Shampoo's blocks depend on max_preconditioner_dim: a changed value is refused here)."""
    fresh = rule.init_state(info, like=torch.empty(0, device="meta"))
    for key, t in fresh.items():
        got = shapes.get(key)
        if got is None or tuple(got) != tuple(t.shape):
            raise ElasticError(f"The checkpoint's {rule.name} state of {info.name!r} does not fit this run's settings: "
                               f"{key!r} is {got}, the rule keeps "
                               f"{tuple(t.shape)} (a hyper-parameter that shapes the state changed?).")


def write(engine, src: Universal | SavedCheckpoint, gather: bool = True) -> dict:
    """Fill ``engine`` (a Canzona optimizer under ZeRO 1/2, any DP x TP) from ``src``, copying
    only what this rank holds; returns the client state.

    The bit16 weights every rank keeps whole are gathered from the ranks' fp32 partitions
    (``gather``, a collective), or with ``gather=False`` copied from ``src`` parameter by
    parameter (every parameter read on every rank: the way before, no collective).
    Everything that can refuse (names, shapes, rule, state that cannot follow a TP layout) is
    checked first, from shapes alone and alike on every rank, so no rank is left waiting in the
    closing all-gather."""
    from deepspeed import comm as dist

    from ..optimizer import MATRIX
    from ..tp.layout import tp_blocks
    from ..tp.runtime import FlatSplit, GridSplit, TPMatrix
    from .runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    zopt = engine.optimizer
    if opt is None or getattr(zopt, "canzona_layout", None) is None:
        raise ElasticError("elastic loading needs an engine running a Canzona optimizer under ZeRO stage 1 or 2.")
    if opt.rule.name != src.rule:
        raise ElasticError(f"The checkpoint holds {src.rule!r} state; this engine runs {opt.rule.name!r}.")
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
        raise ElasticError(f"The checkpoint's parameters differ from the model's: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}.")
    tp_size = opt.tp_size
    if moe is not None and tp_size > 1 and any(lay.mixed for lay in zopt.canzona_layouts.values()):
        raise ElasticError(MOE_TP_MIXED_REFUSAL.format(where="this run", tp=tp_size).replace(
            "a DeepSpeed MoE checkpoint", "a DeepSpeed MoE run").replace("cannot be resumed", "cannot load a checkpoint"))
    tp_rank = dist.get_rank(group=opt.tp_group) if tp_size > 1 else 0
    layouts = {}  # name -> (dim, shard sizes, blocks) of this run's TP-split parameters
    for name, p in names.items():
        full = src.full_shape(glob(name))
        if TPMatrix.is_split(p, tp_size):
            m = TPMatrix.from_param(name, p, tp_size)
            if tuple(full) != tuple(m.full_shape):
                raise ElasticError(f"{name!r} is {tuple(full)} in the checkpoint, {m.full_shape} here.")
            layouts[name] = (m.partition_dim, tuple(m.shard_sizes), tuple(tp_blocks(p, m.full_shape[m.partition_dim])))
        elif tuple(full) != tuple(p.shape):
            raise ElasticError(f"{name!r} is {tuple(full)} in the checkpoint, {tuple(p.shape)} here.")
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
        grouped = {id(p) for group in zopt.bit16_groups for p in group} if gather else set()
        for name, p in names.items():
            if id(p) not in grouped:
                p.data.copy_(mine(name, MASTER, 0, p.numel()).view(p.shape))
        if gather:
            _gather_bit16(zopt)
    for key, value in src.zero_scalars.items():
        setattr(zopt, key, value)
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if src.engine_state.get(key) is not None:
            setattr(engine, key, src.engine_state[key])
    if engine.lr_scheduler is not None and src.engine_state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(src.engine_state["lr_scheduler"])
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


def load(engine, ckpt_dir: str, tag: str | None = None, whole: bool = False) -> tuple[str, dict]:
    """Resume ``engine`` from a Canzona checkpoint written at any DP x TP size.

    Each rank reads only its share (``SavedCheckpoint``).  ``whole=True`` is the previous way,
    kept to measure against (benchmarks/bench_elastic_rss.py): every file read into memory,
    every parameter rebuilt whole on every rank (``read(mmap=False)``) and the module's weights
    set from them (no collective)."""
    tag = resolve_tag(ckpt_dir, tag)
    mp_ranks = _stage_file_ranks(engine, ckpt_dir, tag)
    if whole:
        if mp_ranks is not None:
            raise ElasticError("load(whole=True) does not read pipeline-parallel checkpoints; use the default path.")
        return os.path.join(ckpt_dir, tag), write(engine, read(ckpt_dir, tag, mmap=False), gather=False)
    return os.path.join(ckpt_dir, tag), write(engine, SavedCheckpoint(ckpt_dir, tag, mp_ranks=mp_ranks))


def _stage_file_ranks(engine, ckpt_dir: str, tag: str) -> list[int] | None:
    """Under pipeline parallelism: the model-parallel file ranks of this rank's stage, by TP rank
    (each stage resumes from its own files; the DP size may change, the PP x TP layout may not).
    None without pipeline parallelism."""
    import torch.distributed as tdist

    from .runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    groups = opt.groups
    folder = os.path.join(ckpt_dir, tag)
    first = sorted(f for f in os.listdir(folder) if OPTIM_FILE.search(f))[0]
    saved_pp = int((_load(os.path.join(folder, first), mmap=True)["optimizer_state_dict"].get(LAYOUT_KEY) or {})
                   .get("pp_size", 1))
    if saved_pp != groups.pp_size:
        raise ElasticError(f"{folder} was saved with PP={saved_pp}; this run has PP={groups.pp_size} x "
                           f"TP={groups.tp_size}. Under pipeline parallelism a resume may change the DP size only.")
    if groups.pp_size == 1:
        return None
    _, saved_mp = checkpoint_size(ckpt_dir, tag)
    if saved_mp != groups.pp_size * groups.tp_size:
        raise ElasticError(
            f"{os.path.join(ckpt_dir, tag)} was saved with {saved_mp} model-parallel ranks (pipeline x tensor); this "
            f"run has PP={groups.pp_size} x TP={groups.tp_size}. Under pipeline parallelism a resume may change the "
            "DP size only.")
    from .groups import model_parallel_file_rank

    mine = model_parallel_file_rank(engine)
    if groups.tp_size == 1:
        return [mine]
    ranks: list = [None] * groups.tp_size
    tdist.all_gather_object(ranks, mine, group=groups.tp_group)
    return [int(r) for r in ranks]


#: DeepSpeed's stage-0 MoE optimizer files: one per expert-parallel rank of the largest expert group
EXPP_FILE = re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def stage0_moe_resize_needed(engine, ckpt_dir: str, tag: str | None) -> bool:
    """ZeRO stage 0 under DeepSpeed MoE: DeepSpeed saves each expert-parallel rank's whole
    optimizer state (``expp_rank_<k>_mp_rank_<m>_optim_states.pt``: every rank keeps the state of
    all its matrices, placement "local"; one file per expert-parallel rank ``k`` and
    model-parallel rank ``m`` that holds it, moe.checkpoint_writers) and each rank loads the file
    of its own ``k`` and ``m``.  That resumes at any DP size with the same ``ep_size`` (the same
    experts per file; False here); another ``ep_size`` needs :func:`load_stage0_moe` (True here),
    which the files of an older canzona-ds (no parameter names) cannot give: refused by name, as
    is a checkpoint that lacks this rank's files (one written by DeepSpeed's own writer rule under
    tensor parallelism, which skipped every TP rank but expert-DP rank 0's)."""
    from .runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    if opt is None or opt.moe is None or not opt.moe.active or engine.zero_optimization_stage() != 0:
        return False
    tag = latest_tag(ckpt_dir) if tag is None else tag
    folder = os.path.join(ckpt_dir, str(tag)) if tag is not None else None
    if folder is None or not os.path.isdir(folder):
        return False  # DeepSpeed's own message
    listing = os.listdir(folder)
    pairs = {(int(m.group(1)), int(m.group(2))) for f in listing if (m := EXPP_FILE.search(f))}
    if not pairs:
        return False
    # every model-parallel rank writes its model-states file (its DP rank 0, moe.checkpoint_writers)
    mp = sorted(f for f in listing if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f))
    if len(mp) != opt.groups.tp_size * opt.groups.pp_size:
        saved_mp = _load(os.path.join(folder, mp[0]), mmap=True).get("mp_world_size") if mp else None
        if saved_mp == opt.groups.tp_size * opt.groups.pp_size:
            raise ElasticError(_incomplete_stage0_moe(folder, [f"mp_rank_{m:02d}_model_states.pt" for m in
                                                              range(saved_mp) if MODEL_FILE.format(m) not in mp]))
        raise ElasticError(f"{folder} was saved at ZeRO stage 0 under DeepSpeed MoE with {len(mp)} model-parallel "
                           f"rank(s) (TP x PP); this run has TP={opt.groups.tp_size} x PP={opt.groups.pp_size}. "
                           "A stage-0 MoE checkpoint resumes at its saved TP and PP size only (another DP size; "
                           "another ep_size without TP). To change TP, train at ZeRO 1/2 (its MoE x TP checkpoints "
                           "resume at another TP size, docs/moe.md), or load the module weights only "
                           "(load_module_only=True) at the saved TP size.")
    saved_ep = sorted({k for k, _ in pairs})  # the largest expert group's ranks, as DeepSpeed names files
    if saved_ep != list(range(len(saved_ep))):
        raise ElasticError(f"{folder}: expp_rank optimizer files of expert-parallel ranks {saved_ep} are not "
                           f"0..{len(saved_ep) - 1}.")
    if len(saved_ep) == opt.groups.ep_size:  # DeepSpeed's own load: this rank's (k, m) file
        from deepspeed.utils import groups as ds_groups

        k = ds_groups._get_expert_parallel_rank(ds_groups._get_max_expert_size_name())
        if (k, int(engine.checkpoint_mp_rank)) not in pairs:
            raise ElasticError(_incomplete_stage0_moe(
                folder, [os.path.basename(engine._get_optimizer_ckpt_name(ckpt_dir, tag, k))]))
        return False
    if opt.groups.tp_size > 1 or (opt.groups.pp_size == 1 and any(m for _, m in pairs)):
        raise ElasticError(f"{folder} was saved at ZeRO stage 0 with expert-parallel size {len(saved_ep)}; this run "
                           f"has ep_size={opt.groups.ep_size}. A change of ep_size under tensor parallelism is not "
                           "implemented; resume MoE x TP with the saved ep_size.")
    first = _load(_expp_files(folder, int(engine.checkpoint_mp_rank))[0], mmap=True)["optimizer"]
    if "global_names" not in first.get("canzona", {}):
        raise ElasticError(
            f"{folder} was saved at ZeRO stage 0 with expert-parallel size {len(saved_ep)}; this run has "
            f"ep_size={opt.groups.ep_size}, and its optimizer files do not name their parameters (written by an "
            "older canzona-ds). Resume it with the saved ep_size (any DP size), or load the module weights only "
            "(load_optimizer_states=False).")
    return True


def _incomplete_stage0_moe(folder: str, missing: list) -> str:
    return (f"{folder} lacks {missing}: it was saved at ZeRO stage 0 under DeepSpeed MoE with tensor parallelism "
            "by DeepSpeed's own writer rule (canzona-ds before its per-model-parallel-rank writers, or "
            "DeepSpeed's own optimizer), where only expert-DP rank 0 writes and, when the expert-DP group spans "
            "TP ranks (an ep_size that is not a multiple of the TP size), the other TP ranks' module shards, "
            "experts and optimizer state were never written, so it cannot be resumed with its state. "
            "Checkpoints saved by this canzona-ds write every model-parallel rank's files (docs/moe.md, "
            "Checkpoints).")


def _expp_files(folder: str, mp_rank: int = 0) -> list[str]:
    """DeepSpeed's stage-0 MoE optimizer files of ``folder`` at model-parallel rank ``mp_rank``, by
    expert-parallel rank (TP=1, stage0_moe_resize_needed: ``mp_rank`` is the pipeline stage)."""
    found = {int(m.group(1)): os.path.join(folder, f) for f in os.listdir(folder)
             if (m := EXPP_FILE.search(f)) and int(m.group(2)) == mp_rank}
    if sorted(found) != list(range(len(found))):
        raise ElasticError(f"{folder}: expp_rank optimizer files {sorted(found)} are not 0..{len(found) - 1}.")
    return [found[k] for k in range(len(found))]


def load_stage0_moe(engine, stock_load, ckpt_dir: str, tag: str | None, load_module_strict: bool = True,
                    load_lr_scheduler_states: bool = True) -> tuple[str, dict]:
    """Resume a ZeRO stage-0 DeepSpeed MoE checkpoint at another ``ep_size`` (and any DP size).

    DeepSpeed's own load, without the optimizer, restores the module (the dense weights, every
    local expert from its file by global id), the scheduler and the step counts; then every
    parameter this rank holds takes its optimizer state from the ``expp_rank`` file of the
    expert-parallel rank that held it, found by whole-model name (each file records its param
    groups' parameters by local and by global name): AdamW's moments and step for the rest, the
    rule state and step count for a matrix.  Nothing is recomputed: the state is copied."""
    from ..optimizer import MATRIX
    from .runtime_info import canzona_optimizer

    tag = resolve_tag(ckpt_dir, tag)
    folder = os.path.join(ckpt_dir, tag)
    opt = canzona_optimizer(engine)
    # where every saved parameter's state lies: whole-model name -> (file, group, position)
    # (under pipeline parallelism this stage's files: DeepSpeed numbers them by the stage's mp rank)
    files = [_load(path, mmap=True)["optimizer"] for path in _expp_files(folder, int(engine.checkpoint_mp_rank))]
    where: dict[str, tuple[int, int, int]] = {}
    for k, sd in enumerate(files):
        for g, names in enumerate(sd["canzona"]["global_names"]):
            for i, name in enumerate(names):
                where.setdefault(name, (k, g, i))
    mine = {(g, i): opt.global_name(n) for g, names in enumerate(opt.group_names) for i, n in enumerate(names)}
    missing = sorted({n for n in mine.values() if n not in where})
    if missing:
        raise ElasticError(f"{folder}: the checkpoint has no optimizer state for {missing[:5]} (another model?).")
    for (g, i), name in mine.items():  # every check first, alike on every rank, before anything is loaded
        k, sg, si = where[name]
        role = files[k]["param_groups"][sg]["canzona_role"]
        if role != opt.param_groups[g]["canzona_role"]:
            raise ElasticError(f"{name!r} is in a {role} group in the checkpoint, a "
                               f"{opt.param_groups[g]['canzona_role']} group here (another optimizer setting?).")
        if role == MATRIX:
            local = files[k]["canzona"]["param_names"][sg][si]
            st = files[k]["canzona"]["matrix_state"].get(local)
            if st is not None:
                _check_state(opt.rule, opt.state_infos[opt.group_names[g][i]],
                             {key: tuple(v.shape) for key, v in st.items() if isinstance(v, Tensor)})
    if files[0]["canzona"].get("rule") != opt.rule.name:
        raise ElasticError(f"{folder} holds {files[0]['canzona'].get('rule')!r} state; this engine runs "
                           f"{opt.rule.name!r}.")
    path, client_state = stock_load(engine, ckpt_dir, tag, load_module_strict=load_module_strict,
                                    load_optimizer_states=False, load_lr_scheduler_states=load_lr_scheduler_states)
    matrix_state = {}
    with torch.no_grad():
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                k, sg, si = where[mine[(g, i)]]
                saved, saved_group = files[k], files[k]["param_groups"][sg]
                if group["canzona_role"] == MATRIX:
                    group["step"] = saved_group["step"]
                    st = saved["canzona"]["matrix_state"].get(saved["canzona"]["param_names"][sg][si])
                    if st is not None:
                        matrix_state[opt.group_names[g][i]] = _owned(st)
                    continue
                st = saved["state"].get(saved_group["params"][si])
                opt.state[p] = {} if st is None else {
                    key: (v.clone() if key == "step" else v.to(device=p.device, dtype=p.dtype).clone())
                    for key, v in st.items()}
    opt.matrix_state.clear()
    opt.load_matrix_state(matrix_state)
    return path, client_state


#: format marker of a file written by ``convert``

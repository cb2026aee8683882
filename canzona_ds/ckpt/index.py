"""The checkpoint index: every piece of optimizer state a save wrote, described by its writer.

A tag written by canzona-ds holds DeepSpeed's files unchanged plus ``canzona_index.json``,
written by rank 0 after every rank's files are on disk (and before the sha256 manifest, which
covers it).  The index is the commit mark: a tag without it was never finished.  It says, for
every whole-model parameter and every state key (``param`` = the fp32 master weight, AdamW's
``exp_avg`` / ``exp_avg_sq``, every rule-state entry such as Muon's ``momentum_buffer`` or
SOAP's ``L``), which stored tensors hold which elements::

    whole-model view of one state (row-major, global shape)     fc1.weight / exp_avg, 640 elements
        [0 ...................... 320 ..................... 640)
         \\_________ chunk A _______/ \\________ chunk B _________/
              file zero_pp_rank_0_mp_rank_00_optim_states.pt      key optimizer_state_dict/.../state/1/exp_avg
              offset 0, length 320, at 216                        (element 216 of that stored flat tensor)
                                       file zero_pp_rank_1_..., offset 320, length 320, at 0

    Chunk(name, state, shape, offset, length, file, key, at, frame)

A load asks for a *region* (``name``, ``state``, ``[start, stop)`` of the global flat) and
:func:`overlaps` intersects it with the chunks that exist (torch.distributed.checkpoint's
model: the writer describes, the reader intersects); :class:`Reader` copies the overlapping
pieces out of the memory-mapped files, so a rank touches only the bytes it needs.

``frame`` is ``None`` for a chunk in the global row-major frame; a chunk cut in another frame
records it (:mod:`canzona_ds.ckpt.frames`): a TP shard's frame (``{"tp": {dim, sizes, blocks,
rank}}``; ``offset``/``length`` index the shard's flat, ``shape`` is the global shape), or a TP
host's rule state in the concatenated TP layout (no ``rank``; ``shape`` is the state's).
:meth:`Reader.region` reads a region of the global frame or of any shard frame: straight from
the chunks where they are in that frame, else through the whole tensor rebuilt from its shards
(one parameter at a time).  A host's concatenated-layout state is read in its own frame only
(mapping it to TP=1 needs the rule's ``state_axes``: integration/ckpt/fill.IndexSource).

This module imports no DeepSpeed (torch for :class:`Reader`'s memory-mapped reads and the frame
arithmetic).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable

from .frames import FrameError, TPFrame, assemble, to_global

INDEX = "canzona_index.json"
FORMAT = "canzona_ds.ckpt.index/1"
#: the state key of a parameter's fp32 master weight; AdamW's moments are "exp_avg", "exp_avg_sq"
MASTER = "param"


class CheckpointIndexError(ValueError):
    """An index that is damaged, inconsistent, or does not match the files (the message says which)."""


@dataclass(frozen=True)
class Chunk:
    """Elements ``[offset, offset + length)`` of the row-major flat of state ``state`` of the
    whole-model parameter ``name`` (global shape ``shape``), stored in ``file`` under ``key``
    (a path of dict keys / list positions into ``torch.load(file)``), starting at element
    ``at`` of that stored tensor's flat view."""

    name: str
    state: str
    shape: tuple[int, ...]
    offset: int
    length: int
    file: str
    key: tuple
    at: int = 0
    frame: Any = None
    rank: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def tp(self) -> TPFrame | None:
        """The chunk's frame parsed (None: the global frame)."""
        try:
            return TPFrame.of(self.frame, f"{self.name!r} {self.state}")
        except FrameError as e:
            raise CheckpointIndexError(str(e)) from None

    @property
    def flat_numel(self) -> int:
        """Elements of the flat its offsets index: the tensor's, or a shard's (a shard frame)."""
        tp = self.tp
        return self.numel if tp is None or tp.rank is None else math.prod(tp.shard_shape(self.shape))

    @property
    def stop(self) -> int:
        return self.offset + self.length

    def to_json(self) -> dict:
        d = {"name": self.name, "state": self.state, "shape": list(self.shape), "offset": self.offset,
             "length": self.length, "file": self.file, "key": list(self.key), "at": self.at}
        if self.frame is not None:
            d["frame"] = self.frame
        if self.rank >= 0:
            d["rank"] = self.rank
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "chunk") -> "Chunk":
        if not isinstance(d, dict):
            raise CheckpointIndexError(f"{where}: expected an object, got {type(d).__name__}.")
        need = {"name": str, "state": str, "shape": list, "offset": int, "length": int, "file": str, "key": list}
        for k, t in need.items():
            if k not in d:
                raise CheckpointIndexError(f"{where}: missing field {k!r} (a chunk has {sorted(need)}, optional at, frame).")
            if not isinstance(d[k], t) or isinstance(d[k], bool):
                raise CheckpointIndexError(f"{where}: field {k!r} is {d[k]!r}; expected {t.__name__}.")
        if not all(isinstance(s, int) and s >= 0 for s in d["shape"]):
            raise CheckpointIndexError(f"{where}: shape {d['shape']!r} is not a list of non-negative integers.")
        if not all(isinstance(k, (str, int)) for k in d["key"]):
            raise CheckpointIndexError(f"{where}: key {d['key']!r} is not a list of strings and integers.")
        at, rank = d.get("at", 0), d.get("rank", -1)
        if type(at) is not int or at < 0:
            raise CheckpointIndexError(f"{where}: at={at!r}; expected an integer >= 0.")
        if type(rank) is not int or rank < -1:
            raise CheckpointIndexError(f"{where}: rank={rank!r:.80}; expected an integer >= 0.")
        if d.get("frame") is not None and not isinstance(d["frame"], dict):
            raise CheckpointIndexError(f"{where}: frame={d['frame']!r:.80}; expected an object or null.")
        _name(d["file"], f"{where} field 'file'")
        return cls(d["name"], d["state"], tuple(d["shape"]), d["offset"], d["length"], d["file"], tuple(d["key"]),
                   at, d.get("frame"), rank)


@dataclass
class Index:
    """What one save wrote.

    ``meta``: the saving run (``stage``, ``dp``, ``tp``, ``pp``, ``world_size``, ``rule``,
    ``fingerprint``, ``roles`` (name -> ``"matrix"`` or ``"adamw"``), ``matrix_step``,
    ``adam_step``, ``engine_file`` (the model-states file with the engine counters, lr scheduler
    and client state), ``scalars`` (file and key of the ZeRO loss-scaler record, or None));
    ``files``: every file of the tag the save wrote (the index itself and the manifest aside);
    ``chunks``: every chunk, or None where this layout does not describe its chunks yet
    (``meta["no_chunks"]`` says why; such a tag resumes at its own layout only, or at another DP
    size at ZeRO stage 0)."""

    tag: str
    meta: dict
    files: list[str]
    chunks: list[Chunk] | None = None
    _by_key: dict = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ queries
    def by_key(self) -> dict[tuple[str, str], list[Chunk]]:
        """(name, state) -> its chunks sorted by offset."""
        if self._by_key is None:
            out: dict[tuple[str, str], list[Chunk]] = {}
            for c in self.chunks or ():
                out.setdefault((c.name, c.state), []).append(c)
            for v in out.values():
                v.sort(key=lambda c: (c.offset, -c.length))
            self._by_key = out
        return self._by_key

    @property
    def names(self) -> list[str]:
        """Every parameter with an fp32 master weight, in first-seen order."""
        seen: dict[str, None] = {}
        for c in self.chunks or ():
            if c.state == MASTER:
                seen.setdefault(c.name, None)
        return list(seen)

    def states_of(self, name: str) -> dict[str, tuple[int, ...]]:
        """state key -> global shape, for one parameter (``param`` included)."""
        return {s: cs[0].shape for (n, s), cs in self.by_key().items() if n == name}

    def shape(self, name: str, state: str = MASTER) -> tuple[int, ...]:
        cs = self.by_key().get((name, state))
        if not cs:
            raise CheckpointIndexError(f"the checkpoint index has no {state!r} for {name!r}.")
        return cs[0].shape

    # ------------------------------------------------------------------ (de)serialisation
    def to_json(self) -> dict:
        return {"format": FORMAT, "tag": self.tag, "meta": self.meta, "files": sorted(self.files),
                "chunks": None if self.chunks is None else [c.to_json() for c in self.chunks]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, d: Any, where: str = INDEX) -> "Index":
        if not isinstance(d, dict):
            raise CheckpointIndexError(f"{where}: not a JSON object.")
        if d.get("format") != FORMAT:
            raise CheckpointIndexError(f"{where}: format {d.get('format')!r}; this canzona-ds reads {FORMAT!r}.")
        for k, t in (("tag", str), ("meta", dict), ("files", list)):
            if not isinstance(d.get(k), t):
                raise CheckpointIndexError(f"{where}: field {k!r} is {d.get(k)!r:.80}; expected {t.__name__}.")
        for i, f in enumerate(d["files"]):
            _name(f, f"{where} files[{i}]")
        _check_meta(d["meta"], where)
        chunks = d.get("chunks")
        if chunks is not None and not isinstance(chunks, list):
            raise CheckpointIndexError(f"{where}: 'chunks' is {type(chunks).__name__}; expected a list or null.")
        parsed = None if chunks is None else [Chunk.from_json(c, f"{where} chunk {i}") for i, c in enumerate(chunks)]
        return cls(d["tag"], d["meta"], list(d["files"]), parsed)

    @classmethod
    def loads(cls, text: str, where: str = INDEX) -> "Index":
        try:
            d = json.loads(text)
        except RecursionError:
            raise CheckpointIndexError(f"{where}: nested too deep to parse; the index is damaged.") from None
        except ValueError as e:
            raise CheckpointIndexError(f"{where}: not valid JSON ({e}); the index is damaged.") from None
        return cls.from_json(d, where)

    @classmethod
    def read(cls, folder: str) -> "Index":
        from .tag import CheckpointFileError, member, read_text

        path = os.path.join(folder, INDEX)
        if not os.path.lexists(path):
            raise CheckpointIndexError(f"{folder}: no {INDEX} (the save did not finish, or the tag predates the index).")
        try:  # (inside the tag, a regular file, bounded: anything else refused by name)
            text = read_text(member(folder, INDEX, "the tag"))
        except CheckpointFileError as e:
            raise CheckpointIndexError(str(e)) from None
        index = cls.loads(text, path)
        index.validate(path)
        return index

    # ------------------------------------------------------------------ validation
    def validate(self, where: str = INDEX) -> None:
        """Every chunk inside its global shape; the chunks of one (name, state) agree on the shape
        and together cover every element; every file a chunk names is in ``files``."""
        files = set(self.files)
        for c in self.chunks or ():
            if c.tp is not None and c.tp.rank is not None:
                try:
                    c.tp.check(c.shape, f"{where}: {c.name!r} {c.state}")
                except FrameError as e:
                    raise CheckpointIndexError(str(e)) from None
            if c.offset < 0 or c.length <= 0 or c.stop > c.flat_numel:
                frame = "" if c.tp is None else f" of frame {c.frame}"
                raise CheckpointIndexError(f"{where}: {c.name!r} {c.state} chunk [{c.offset}, {c.stop}) lies outside its "
                                  f"{c.flat_numel} elements{frame} (shape {list(c.shape)}).")
            if c.file not in files:
                raise CheckpointIndexError(f"{where}: {c.name!r} {c.state} is in {c.file!r}, which the index's file list "
                                  f"does not name.")
        for (name, state), cs in self.by_key().items():
            shapes = {c.shape for c in cs}
            if len(shapes) > 1:
                raise CheckpointIndexError(f"{where}: the chunks of {name!r} {state} disagree on its shape: {sorted(shapes)}.")
            for frame, fcs in frames(cs).items():  # each frame the state is stored in covers it whole
                ranks = [None] if frame is None or frame.rank is None else range(len(frame.sizes))
                for t in ranks:
                    tcs = [c for c in fcs if c.tp is None or c.tp.rank == t]
                    n = math.prod(frame.shard_shape(cs[0].shape, t)) if t is not None else cs[0].numel
                    gaps = missing(tcs, 0, n)
                    if gaps:
                        what = "" if t is None else f" (TP shard {t} of frame {frame.at(None).to_json()})"
                        raise CheckpointIndexError(f"{where}: {name!r} {state}{what} is not covered: elements "
                                                   f"{gaps[:3]} of {n} are in no chunk.")
        if self.chunks is not None:
            no_master = sorted({n for n, _ in self.by_key()} - set(self.names))
            if no_master:
                raise CheckpointIndexError(f"{where}: {no_master[:5]} have optimizer state but no fp32 master weight.")


def _name(name: Any, where: str) -> str:
    """A file name the index gives, refused by name unless it stays inside the tag
    (:func:`canzona_ds.ckpt.tag.check_name`)."""
    from .tag import CheckpointFileError, check_name

    try:
        return check_name(name, where)
    except CheckpointFileError as e:
        raise CheckpointIndexError(str(e)) from None


#: the types of the meta fields the readers use (None allowed for each): a field of another
#: type is refused by name when the index is read, never met as a TypeError later
_META = {"stage": int, "dp": int, "tp": int, "pp": int, "ep": int, "world_size": int, "rule": str,
         "rule_description": dict, "roles": dict, "matrix_step": int, "adam_step": (int, float), "engine_file": str,
         "scalars": dict, "expert_stacks": dict, "param_groups": list, "fingerprints": list, "no_chunks": str,
         "replicas": bool}


def _check_meta(meta: dict, where: str) -> None:
    for k, t in _META.items():
        v = meta.get(k)
        if v is not None and (not isinstance(v, t) or (isinstance(v, bool) and t is not bool)):
            names = " or ".join(x.__name__ for x in (t if isinstance(t, tuple) else (t,)))
            raise CheckpointIndexError(f"{where}: meta field {k!r} is {v!r:.80}; expected {names} or null.")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (meta.get("roles") or {}).items()):
        raise CheckpointIndexError(f"{where}: meta field 'roles' is not an object of names to roles.")
    if not all(isinstance(k, str) and type(v) is int for k, v in (meta.get("expert_stacks") or {}).items()):
        raise CheckpointIndexError(f"{where}: meta field 'expert_stacks' is not an object of names to integers.")
    if meta.get("engine_file") is not None:
        _name(meta["engine_file"], f"{where} meta field 'engine_file'")
    rec = meta.get("scalars")
    if rec is not None:
        if not isinstance(rec.get("file"), str) or not isinstance(rec.get("key", []), list):
            raise CheckpointIndexError(f"{where}: meta field 'scalars' is {rec!r:.80}; expected "
                                       "{'file': a file name, 'key': a list}.")
        _name(rec["file"], f"{where} meta field 'scalars'")


def frames(chunks: Iterable[Chunk]) -> dict[TPFrame | None, list[Chunk]]:
    """The chunks of one (name, state) by the frame family they are in: None (the global frame),
    a TP layout with ``rank=0`` standing for all its shards, or a TP layout without a rank (a
    host's concatenated-layout state)."""
    out: dict[TPFrame | None, list[Chunk]] = {}
    for c in chunks:
        key = None if c.tp is None else c.tp.at(None if c.tp.rank is None else 0)
        out.setdefault(key, []).append(c)
    return out


def missing(chunks: Iterable[Chunk], start: int, stop: int) -> list[tuple[int, int]]:
    """The sub-ranges of ``[start, stop)`` that no chunk covers."""
    gaps, pos = [], start
    for c in sorted(chunks, key=lambda c: c.offset):
        if c.offset > pos:
            gaps.append((pos, min(c.offset, stop)))
        pos = max(pos, c.stop)
        if pos >= stop:
            break
    if pos < stop:
        gaps.append((pos, stop))
    return [g for g in gaps if g[0] < g[1]]


def overlaps(chunks: Iterable[Chunk], start: int, stop: int) -> list[tuple[Chunk, int, int, int]]:
    """How to fill region ``[start, stop)`` from ``chunks`` (one (name, state)): a list of
    ``(chunk, src, dst, n)``, element ``src`` of the chunk's stored flat tensor onwards to
    element ``dst`` of the region onwards, ``n`` elements; every region element exactly once
    (where chunks overlap, e.g. replicas, the first by offset wins).  Raises if a part of the
    region is in no chunk."""
    out, pos = [], start
    for c in sorted(chunks, key=lambda c: (c.offset, -c.length)):
        if c.stop <= pos or c.offset >= stop:
            continue
        if c.offset > pos:
            break
        b = min(stop, c.stop)
        out.append((c, c.at + pos - c.offset, pos - start, b - pos))
        pos = b
        if pos >= stop:
            break
    if pos < stop:
        some = next(iter(chunks), None)
        what = f"{some.name!r} {some.state}" if some is not None else "the region"
        raise CheckpointIndexError(f"{what}: elements [{pos}, {stop}) are in no chunk of the checkpoint index.")
    return out


class Reader:
    """Regions of a checkpoint read through its index, every file opened memory-mapped once.

    ``elements_read`` counts the stored elements handed out so far (a region's, a whole
    tensor's, each TP shard a rebuild reads once): what this rank copied from the checkpoint.

    ``read(path, mmap=True)`` opens a file: :func:`canzona_ds.ckpt.safe_load.load` by default,
    which unpickles only data (tensors and the few types DeepSpeed's files hold); canzona-ds
    passes integration/ckpt/safe.read, the same plus the ds_config opt-in."""

    def __init__(self, folder: str, index: Index, read: Callable[..., Any] | None = None) -> None:
        if index.chunks is None:
            raise CheckpointIndexError(f"{folder}: this checkpoint's index describes no chunks "
                              f"({index.meta.get('no_chunks', 'layout without an emitter')}).")
        self.folder, self.index = folder, index
        if read is None:
            from .safe_load import load as read
        self._read = read
        self._files: dict[str, Any] = {}
        self._cache: tuple | None = None  # ((name, state), its flat global tensor): one at a time
        self.elements_read = 0

    def _file(self, name: str) -> Any:
        if name not in self._files:
            from .tag import CheckpointFileError, member

            try:
                path = member(self.folder, name, INDEX)  # (inside the tag; the loader refuses a FIFO or device)
            except CheckpointFileError as e:
                raise CheckpointIndexError(str(e)) from None
            if not os.path.isfile(path):
                raise CheckpointIndexError(f"{self.folder}: the index names {name!r}, which is not in the checkpoint.")
            self._files[name] = self._read(path, mmap=True)
        return self._files[name]

    def stored(self, c: Chunk):
        """The stored tensor a chunk lies in, flattened."""
        flat = self._obj(c).reshape(-1)
        if c.at + c.length > flat.numel():
            raise CheckpointIndexError(f"{self.folder}: {c.file!r} {'/'.join(map(str, c.key))!r} has {flat.numel()} elements; "
                              f"the index places {c.name!r} {c.state} at [{c.at}, {c.at + c.length}). The files "
                              "disagree with the index.")
        return flat

    def _obj(self, c: Chunk):
        """The stored tensor a chunk lies in, as stored."""
        import torch

        obj = self._file(c.file)
        for k in c.key:
            try:
                obj = obj[k]
            except (KeyError, IndexError, TypeError):
                raise CheckpointIndexError(f"{self.folder}: {c.file!r} has no {'/'.join(map(str, c.key))!r} (chunk of "
                                  f"{c.name!r} {c.state}); the files disagree with the index.") from None
        if not torch.is_tensor(obj):
            raise CheckpointIndexError(f"{self.folder}: {c.file!r} {'/'.join(map(str, c.key))!r} is not a tensor; the files "
                              "disagree with the index.")
        return obj

    def has(self, name: str, state: str) -> bool:
        return (name, state) in self.index.by_key()

    def frame_of(self, name: str, state: str) -> TPFrame | None:
        """The frame :meth:`whole` reads ``state`` of ``name`` in by default: None (the global frame,
        stored so or rebuilt from TP shards), or the concatenated TP layout (a frame without a rank)
        of a host's rule state stored only so."""
        fams = frames(self._chunks(name, state))
        if None in fams or any(f.rank is not None for f in fams):
            return None
        return next(iter(fams))

    def _chunks(self, name: str, state: str) -> list[Chunk]:
        cs = self.index.by_key().get((name, state))
        if not cs:
            raise CheckpointIndexError(f"{self.folder}: the checkpoint index has no {state!r} for {name!r}.")
        return cs

    def _global(self, name: str, state: str):
        """The flat global (TP=1) tensor of ``state`` of ``name`` rebuilt from its TP shards (or read
        from its global chunks); the last one kept, so a run of regions of one parameter rebuilds
        it once (memory: one parameter's state at a time)."""
        if self._cache is not None and self._cache[0] == (name, state):
            return self._cache[1]
        self._cache = None
        cs = self._chunks(name, state)
        fams = frames(cs)
        if None in fams:
            flat = self.region(name, state, 0, cs[0].numel)
        else:
            ranked = [f for f in fams if f.rank is not None]
            if not ranked:
                raise CheckpointIndexError(
                    f"{self.folder}: {name!r} {state} is stored in the concatenated TP layout "
                    f"{next(iter(fams)).to_json()} only; it reads in that frame (mapping it to TP=1 takes the rule's "
                    "state_axes: integration/ckpt/fill.IndexSource).")
            pieces = [(c.tp, c.offset, self.stored(c)[c.at:c.at + c.length]) for c in fams[ranked[0]]]
            self.elements_read += sum(c.length for c in fams[ranked[0]])
            flat = assemble(pieces, cs[0].shape).reshape(-1)
        self._cache = ((name, state), flat)
        return flat

    def region(self, name: str, state: str, start: int, stop: int, out=None, frame: TPFrame | None = None):
        """Elements ``[start, stop)`` of the flat of ``state`` of ``name`` in ``frame`` (None: the
        global frame; a :class:`~canzona_ds.ckpt.frames.TPFrame` with a rank: that TP shard's flat;
        without a rank: the concatenated TP layout a host's state is stored in): copied into ``out``
        if given; else a region inside one chunk is a view of the memory-mapped file (read-only in
        spirit: copy what you keep), one across chunks a new tensor.  Chunks stored in ``frame``
        are read directly; otherwise the whole tensor is rebuilt (:meth:`_global`) and the region
        taken from it."""
        import torch

        cs = self._chunks(name, state)
        if stop <= start:  # an empty region (e.g. a rank's empty piece of a mixed-layout matrix)
            return out if out is not None else torch.empty(0, dtype=self.stored(cs[0]).dtype)
        same = [c for c in cs if c.tp == frame]
        if not same:  # another frame: through the whole tensor
            if frame is not None and frame.rank is None:
                raise CheckpointIndexError(f"{self.folder}: {name!r} {state} is not stored in the concatenated TP "
                                           f"layout {frame.to_json()}.")
            flat = self._global(name, state)
            got = flat[start:stop] if frame is None else flat[to_global(frame, cs[0].shape, start, stop)]
            if out is None:
                return got
            return out.copy_(got)
        plan = overlaps(same, start, stop)
        self.elements_read += sum(n for *_, n in plan)
        if out is None and len(plan) == 1:  # one chunk: a view of the mapped file, no copy (callers copy
            c, src, _, n = plan[0]             # what they keep, as from any memory-mapped checkpoint)
            return self.stored(c)[src:src + n]
        if out is None:
            out = torch.empty(stop - start, dtype=self.stored(plan[0][0]).dtype)
        for c, src, dst, n in plan:
            out[dst:dst + n].copy_(self.stored(c)[src:src + n])
        return out

    def whole(self, name: str, state: str = MASTER, frame: TPFrame | None = None):
        """The whole tensor in ``frame`` (None: the global frame; a shard frame: that shard; a frame
        without a rank: the concatenated TP layout a host's state is stored in); where one chunk
        is the whole stored tensor, that tensor itself (a view of the mapped file with its
        strides: a column-major eigenbasis stays column-major, and a matmul on it rounds as
        before the save)."""
        cs = self._chunks(name, state)
        shape = cs[0].shape if frame is None or frame.rank is None else frame.shard_shape(cs[0].shape)
        same = [c for c in cs if c.tp == frame]
        if len(same) == 1 and same[0].at == 0 and same[0].length == math.prod(shape):
            obj = self._obj(same[0])
            if tuple(obj.shape) == tuple(shape):
                self.elements_read += obj.numel()
                return obj
        return self.region(name, state, 0, math.prod(shape), frame=frame).view(shape)

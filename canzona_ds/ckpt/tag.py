"""Atomic, verified DeepSpeed checkpoints with a content manifest, and a loader that refuses a
corrupt checkpoint (naming the file) or falls back to the newest intact one.

Uses only DeepSpeed's public engine API (``save_checkpoint`` / ``load_checkpoint``) plus
plain ``os`` / ``json`` / ``hashlib``; every function here is a collective: all ranks call it.

Layout of ``save_dir`` (DeepSpeed's own files, unchanged, plus one manifest per tag)::

    save_dir/
      latest                      the published tag (written atomically, last)
      step8/                      a published checkpoint
        mp_rank_00_model_states.pt, zero_pp_rank_*_mp_rank_00_optim_states.pt  (DeepSpeed)
        canzona_manifest.json     format, tag, world size, versions, per file: path, bytes, sha256
      step10.partial/             a save in progress, or one a crash interrupted: never loaded
      zero_to_fp32.py, ...        DeepSpeed's recovery scripts (outside the tag dirs)

:func:`save`
    1. rank 0 removes a stale ``<tag>.partial`` left by an interrupted save; barrier;
    2. every rank: ``engine.save_checkpoint(save_dir, tag="<tag>.partial", save_latest=False)``;
    3. the files of ``<tag>.partial`` are split over the ranks; each hashes (sha256) and
       ``fsync``\\ s its share; ``all_gather_object`` collects the entries;
    4. rank 0 writes ``canzona_manifest.json`` (temp file + fsync + ``os.replace``), fsyncs the
       directory, renames ``<tag>.partial`` -> ``<tag>`` (an existing ``<tag>`` is first moved
       aside to ``<tag>.replaced`` and removed once the new one is in place: a save replaces a
       checkpoint of the same tag, as DeepSpeed's does, but never half-overwrites it), fsyncs
       ``save_dir``, then writes ``latest`` the same atomic way.  The outcome (or rank 0's
       error) is broadcast, so every rank returns or raises together.
    A crash at any point before the rename leaves only ``<tag>.partial`` (ignored by
    :func:`load`, removed by the next save of that tag); ``latest`` only ever names a
    directory whose manifest was written and synced first.

:func:`verify` (one process) checks one checkpoint against its manifest; :func:`load` does
the same collectively: rank 0 checks the structure (directory, manifest, file list, sizes)
and broadcasts the verdict; in ``"sha256"`` mode each rank then hashes every world-size-th
file and ``all_gather_object`` gives every rank the same list of problems.  So all ranks
reach the same decision from the same evidence and take the same branch (no rank can load
while another refuses, no collective is left waiting), and the hashing is shared.  This
assumes a filesystem every rank sees, which DeepSpeed's own ZeRO loading already does
(each rank reads every rank's optimizer file).

Errors are :class:`CheckpointError` (a ``ValueError``) naming the checkpoint and the file:
missing tag directory, missing/unreadable/altered manifest, a file missing, an unexpected
extra file, a size mismatch, a sha256 mismatch.

Fallback order (``load(..., fallback=True)``): the requested tag (``latest`` when none is
given) first, then every other published tag directory of ``load_dir`` (not ``*.partial``,
not ``*.replaced``) from the newest to the oldest by the manifest's ``created_unix_ns``
(written by rank 0 at save time; ties and unreadable manifests ordered by tag name,
descending).  The first that verifies is loaded; the skipped ones are reported with the
reason.  "Newest" is deliberately the write time, not the step: a directory holding an
older run's longer checkpoints prefers the current run's.

Verification cost: sha256 runs at ~0.5-1 GB/s per core (docs/main_job.md has the figure
measured on this machine); ``verify="size"`` checks presence and byte sizes only (about
free, but blind to overwritten bytes).

The engine methods: after ``import canzona_ds``, ``engine.save_checkpoint`` of an engine
running a Canzona type writes the same manifest (:func:`hash_files` + :func:`write_manifest`,
then ``latest``) and its ``engine.load_checkpoint`` verifies through :func:`load` with
``unverified="load"`` (integration/ckpt/hooks.py).  :func:`save` and :func:`load` turn
those hooks off around their own engine calls (:func:`engine_hooks_off`): nothing is hashed
or verified twice, and a ``.partial`` directory gets no manifest of its own.

Elastic loading hook: everything that happens after a checkpoint verified is one call,
``loader(engine, load_dir, tag, manifest, **load_kwargs) -> (path, client_state)``
(default :func:`deepspeed_load`, i.e. ``engine.load_checkpoint``).  The manifest carries
the saving run's ``world_size`` and ``dp_world_size``, so an elastic loader can dispatch on
them.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import posixpath
import shutil
import time
from dataclasses import dataclass, field

MANIFEST = "canzona_manifest.json"
#: written by rank 0 into a tag before an engine save starts, removed once its index and manifest
#: are on disk: a tag that still has it is an incomplete save (it names the files expected and,
#: when the save failed, why)
SAVING = "canzona_saving.json"
#: the checkpoint index (canzona_ds/ckpt/index.py), written by every Canzona engine save
INDEX = "canzona_index.json"
FORMAT = "canzona_ds.checkpoint/1"
PARTIAL = ".partial"
REPLACED = ".replaced"
LATEST = "latest"
VERIFY_MODES = ("sha256", "size")
_CHUNK = 1 << 20

logger = logging.getLogger(__name__)

#: False while this module drives ``engine.save_checkpoint`` / ``load_checkpoint`` itself: the
#: engine-level hooks of a Canzona engine (integration/ckpt/hooks.py) then neither write
#: a manifest (``save`` writes its own, for the published tag) nor verify (``load`` just did)
_ENGINE_HOOKS = contextvars.ContextVar("canzona_ds_engine_checkpoint_hooks", default=True)


@contextlib.contextmanager
def engine_hooks_off():
    """Within: a Canzona engine's ``save_checkpoint`` / ``load_checkpoint`` are DeepSpeed's own
    (plus the checkpoint-index path), no manifest written, nothing verified."""
    token = _ENGINE_HOOKS.set(False)
    try:
        yield
    finally:
        _ENGINE_HOOKS.reset(token)


def engine_hooks_on() -> bool:
    """False inside :func:`engine_hooks_off`."""
    return _ENGINE_HOOKS.get()


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt.

    ``path``: the checkpoint directory; ``problems``: ``[(file, what), ...]`` (file relative
    to ``path``; ``"."`` for the directory itself)."""

    def __init__(self, message: str, path: str | None = None, problems: list | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.problems = [tuple(p) for p in (problems or [])]

    def __reduce__(self):  # picklable with its attributes (broadcast between ranks)
        return (CheckpointError, (str(self), self.path, self.problems))

    @property
    def reason(self) -> str:
        """Short form for a console line: ``"file: what"`` of the first problem."""
        if not self.problems:
            return str(self)
        f, what = self.problems[0]
        more = len(self.problems) - 1
        return (f"{f}: {what}" if f != "." else what) + (f" (+{more} more problem{'s' * (more > 1)})" if more else "")


class CheckpointFileError(CheckpointError):
    """One file of a tag (or a path a tag's JSON names) that is not read: outside the tag, not a
    regular file, or not what a checkpoint file holds.  ``path``: the file; the message is one
    line, ``"<file>: <what>"``."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}", str(path), [(str(path), what)])

    def __reduce__(self):  # picklable with its subclass (broadcast between ranks)
        return (_file_error, (type(self), self.path, self.problems[0][1]))


def _file_error(cls, path: str, what: str) -> CheckpointFileError:
    return cls(path, what)


#: the largest JSON file (``latest``, the manifest, the index, the saving record) read whole
MAX_JSON_BYTES = 1 << 30


def check_name(name, what: str) -> str:
    """``name`` if it is a relative, normalised ``/``-separated path that stays inside the folder
    it is relative to (no ``..``, no absolute path, no empty or ``.`` part); else
    :class:`CheckpointFileError` naming it and ``what`` named it."""
    ok = (isinstance(name, str) and name not in ("", ".") and not name.startswith("/") and "\\" not in name
          and "\x00" not in name and posixpath.normpath(name) == name and name.split("/")[0] != "..")
    if not ok:
        raise CheckpointFileError(repr(name) if not isinstance(name, str) else name,
                                  f"named by {what}: not a relative, normalised path inside the tag")
    return name


def member(root: str, name, what: str) -> str:
    """``root/name`` for a ``name`` that :func:`check_name` accepts and that, symlinks resolved,
    stays inside ``root``; else :class:`CheckpointFileError` naming it (nothing is read)."""
    full = os.path.join(str(root), check_name(name, what))
    real_root, real = os.path.realpath(str(root)), os.path.realpath(full)
    if os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointFileError(full, f"named by {what}: leaves {root} (a symlink to {real})")
    return full


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str):
    """``path`` opened for reading (binary), refused by name unless it is a regular file: opened
    non-blocking, so a FIFO never blocks the open, and checked on the open descriptor, so what
    is checked is what is read (a device or FIFO swapped in after a ``stat`` is still refused)."""
    import stat

    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(str(path), flags)
    except OSError as e:
        raise CheckpointFileError(str(path), f"unreadable ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointFileError(str(path), f"{_kind(mode)}, not a regular file: refused")
    return os.fdopen(fd, "rb")


def read_text(path: str, limit: int = MAX_JSON_BYTES) -> str:
    """A small file (JSON, ``latest``) read whole through :func:`open_regular`, refused by name
    past ``limit`` bytes or when it is not UTF-8."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointFileError(str(path), f"larger than {limit} bytes: refused")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFileError(str(path), f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json(path: str):
    """A JSON file read through :func:`read_text`; one line naming the file for text that is not
    JSON or is nested too deep to parse."""
    text = read_text(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise CheckpointFileError(str(path), "nested too deep to parse: refused") from None
    except ValueError as e:
        raise CheckpointFileError(str(path), f"not valid JSON ({e})") from None


def read_latest(load_dir: str) -> str | None:
    """The tag ``load_dir/latest`` names (None when there is no such file); refused by name unless
    it is a plain directory name inside ``load_dir`` (one path part, no ``..``, not a symlink
    leaving ``load_dir``)."""
    path = os.path.join(str(load_dir), LATEST)
    if not os.path.lexists(path):
        return None
    tag = read_text(member(str(load_dir), LATEST, "the load dir"), 4096).strip()
    if not tag:
        return ""
    if "/" in tag or "\\" in tag or tag in (".", "..") or "\x00" in tag:
        raise CheckpointFileError(path, f"names {tag!r}, which is not a tag directory of {load_dir}")
    member(str(load_dir), tag, LATEST)
    return tag


@dataclass
class LoadResult:
    """What :func:`load` did.  Unpacks like DeepSpeed's ``(load_path, client_state)``."""

    #: DeepSpeed's load path (None: nothing loaded)
    path: str | None
    client_state: dict | None
    #: the tag that was loaded
    tag: str | None = None
    #: ``[(tag, reason), ...]`` checkpoints tried first and refused
    skipped: list = field(default_factory=list)
    #: why nothing was loaded, or a remark (e.g. no ``latest`` file)
    note: str | None = None
    #: None when a checkpoint without a manifest was loaded unverified (``unverified="load"``)
    manifest: dict | None = None

    def __iter__(self):
        yield self.path
        yield self.client_state


# ----------------------------------------------------------------------------- collectives
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def _on_rank0(fn, what: str = ""):
    """Run ``fn`` on rank 0 only; every rank returns its result or raises the same
    :class:`CheckpointError` (another exception on rank 0 becomes one, ``what`` failed: ...,
    chained to the original there)."""
    d = _dist()
    box, cause = [None], None
    if d is None or d.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except CheckpointError as e:
            box[0] = ("err", e)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            box[0], cause = ("err", CheckpointError(f"{what or 'checkpoint operation'} failed on rank 0: "
                                                    f"{type(e).__name__}: {e}")), e
    if d is not None:
        d.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "err":
        raise value from cause
    return value


def _all_gather(obj) -> list:
    d = _dist()
    if d is None:
        return [obj]
    out = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- file helpers
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``path`` so that a reader sees the old content or the new one, never a mix:
    temp file in the same directory, fsync, ``os.replace``, fsync the directory."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk must not leave the temp file behind
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _rmtree(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _list_files(root: str) -> list[str]:
    """Every file under ``root`` (relative, '/'-separated, sorted), the manifest excluded."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel not in (MANIFEST, SAVING):
                out.append(rel)
    return sorted(out)


def sha256_file(path: str, fsync: bool = False) -> tuple[int, str]:
    """(bytes, sha256 hex) of a regular file (:func:`open_regular`: a FIFO or a device is refused,
    never read); ``fsync`` also flushes it to stable storage."""
    h = hashlib.sha256()
    n = 0
    with open_regular(path) as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return n, h.hexdigest()


def _files_digest(files: list[dict]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _check_tag(tag) -> str:
    tag = str(tag)
    bad = (not tag or tag in (".", "..", LATEST) or "/" in tag or os.sep in tag
           or tag.endswith((PARTIAL, REPLACED)) or tag.startswith(LATEST + ".tmp"))
    if bad:
        raise ValueError(f"Invalid checkpoint tag {tag!r}: must be a plain directory name, not {LATEST!r}, "
                         f"and not end with {PARTIAL!r} or {REPLACED!r}.")
    return tag


# ----------------------------------------------------------------------------- manifest
def hash_files(directory: str) -> list[dict]:
    """``[{"path", "bytes", "sha256"}, ...]`` of every file under ``directory`` (a checkpoint
    DeepSpeed has just written; the manifest excluded), each file fsynced (collective: rank 0
    lists, the files are split over the ranks, the entries all-gathered)."""
    _barrier()  # every rank's files are written

    def listing():
        names = _list_files(directory)
        if not names:
            raise CheckpointError(f"DeepSpeed wrote no files into {directory}: nothing to publish", directory)
        return names

    names = _on_rank0(listing, f"listing {directory}")
    rank, world = _rank_world()
    mine = {names[i]: sha256_file(os.path.join(directory, names[i]), fsync=True)
            for i in range(rank, len(names), world)}
    digests = {}
    for part in _all_gather(mine):
        digests.update(part)
    return [{"path": n, "bytes": digests[n][0], "sha256": digests[n][1]} for n in names]


def _installed(package: str) -> str | None:
    """The installed release of ``package`` (its metadata: importing DeepSpeed is not needed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_manifest(engine, directory: str, tag: str, files: list[dict]) -> dict:
    """Write ``directory/canzona_manifest.json`` for ``files`` (:func:`hash_files`) atomically,
    after fsyncing the directory tree (one process: rank 0).  Returns the manifest."""
    from importlib.metadata import PackageNotFoundError, version
    import torch

    from ..version import __version__

    manifest = {
        "format": FORMAT, "tag": str(tag), "created_unix_ns": time.time_ns(),
        "global_steps": getattr(engine, "global_steps", None),
        "world_size": _rank_world()[1], "dp_world_size": getattr(engine, "dp_world_size", None),
        "canzona_ds_version": __version__, "deepspeed_version": _installed("deepspeed"),
        "torch_version": torch.__version__, "files": files, "files_sha256": _files_digest(files),
    }
    for dirpath, _, _ in os.walk(directory):
        _fsync_dir(dirpath)
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


# ----------------------------------------------------------------------------- save
def save(engine, save_dir: str, tag: str, client_state: dict | None = None, latest: bool = True) -> str:
    """Save ``engine`` to ``save_dir/<tag>`` atomically with a manifest (collective).

    Returns the published directory.  Raises :class:`CheckpointError` on every rank when
    rank 0 cannot publish (the ``.partial`` directory is left for inspection)."""
    tag = _check_tag(tag)
    save_dir = str(save_dir)
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is not None and getattr(ckpt_engine, "is_decoupled", lambda: False)():
        raise ValueError("canzona_ds.checkpoint.save needs a synchronous DeepSpeed checkpoint engine: a decoupled "
                         "(asynchronous) one may still be writing when save_checkpoint returns, so the manifest "
                         "could describe half-written files.")
    partial = os.path.join(save_dir, tag + PARTIAL)
    final = os.path.join(save_dir, tag)

    def prepare():
        os.makedirs(save_dir, exist_ok=True)
        _rmtree(partial)  # a stale save of this tag interrupted by a crash

    _on_rank0(prepare, f"preparing {partial}")
    with engine_hooks_off():  # DeepSpeed's own save: the manifest is written below, for `tag`
        engine.save_checkpoint(save_dir, tag=tag + PARTIAL, client_state=dict(client_state or {}), save_latest=False)
    files = hash_files(partial)

    def publish():
        write_manifest(engine, partial, tag, files)
        aside = None
        if os.path.lexists(final):
            aside = final + REPLACED
            _rmtree(aside)
            os.rename(final, aside)
        os.rename(partial, final)
        _fsync_dir(save_dir)
        if aside:
            _rmtree(aside)
        if latest:
            write_atomic(os.path.join(save_dir, LATEST), tag)
        return final

    return _on_rank0(publish, f"publishing checkpoint {final}")


# ----------------------------------------------------------------------------- verify
def _corrupt(path: str, problems: list, what: str = "is corrupt") -> CheckpointError:
    shown = "; ".join(f"{f}: {w}" for f, w in problems[:8])
    more = f"; ... {len(problems) - 8} more" if len(problems) > 8 else ""
    return CheckpointError(f"checkpoint {path} {what}: {shown}{more}", path, problems)


def read_manifest(save_dir: str, tag: str) -> dict:
    """The manifest of ``save_dir/<tag>``; :class:`CheckpointError` if it is not usable."""
    path = os.path.join(str(save_dir), str(tag))
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}", path, [(".", f"checkpoint directory {what}")])
    incomplete_save(path)
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise _corrupt(path, [(MANIFEST, "missing (the save was interrupted, or the checkpoint was not written by "
                                         "canzona_ds.checkpoint.save)")], "is not verifiable")
    try:
        manifest = read_json(mpath)
    except CheckpointFileError as e:
        raise _corrupt(path, [(MANIFEST, f"unreadable ({e.problems[0][1]})")]) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(files, list)
          and all(isinstance(e, dict) and isinstance(e.get("path"), str) and type(e.get("bytes")) is int
                  and e["bytes"] >= 0 and isinstance(e.get("sha256"), str) for e in files))
    if not ok:
        raise _corrupt(path, [(MANIFEST, f"not a {FORMAT} manifest")])
    bad = []
    for e in files:
        try:
            check_name(e["path"], MANIFEST)
        except CheckpointFileError as err:
            bad.append((e["path"], err.problems[0][1]))
    if bad:
        raise _corrupt(path, bad)
    if manifest.get("files_sha256") != _files_digest(files):
        raise _corrupt(path, [(MANIFEST, "altered (its own digest of the file list does not match)")])
    if manifest.get("tag") != str(tag):
        raise _corrupt(path, [(MANIFEST, f"belongs to tag {manifest.get('tag')!r}, not {str(tag)!r}")])
    return manifest


def incomplete_save(path: str) -> None:
    """Raise :class:`CheckpointError` if ``path`` is a tag whose engine save never finished (its
    :data:`SAVING` record is still there), naming the files that are missing and, where the
    save failed with an error, the error."""
    record_path = os.path.join(path, SAVING)
    if not os.path.lexists(record_path):
        return
    try:
        record = read_json(record_path)
    except CheckpointFileError as e:
        record = {"error": f"(its {SAVING} is unreadable: {e.problems[0][1]})"}
    if not isinstance(record, dict):
        record = {"error": f"(its {SAVING} is a JSON {type(record).__name__}, not an object)"}
    named = record.get("expected", [])
    if not isinstance(named, list) or not all(isinstance(f, str) for f in named):
        named, record["error"] = [], f"(its {SAVING}'s expected is {named!r:.80}, not a list of file names)"
    present = set(_list_files(path))
    expected = named + [INDEX, MANIFEST]
    missing = [f for f in expected if f not in present]
    problems = [(f, "missing") for f in missing] or [(SAVING, "present")]
    cause = f"; the save failed: {str(record['error'])[:500]}" if record.get("error") else ""
    raise CheckpointError(f"checkpoint {path} is an incomplete save (started by canzona-ds, never finished: "
                          f"{SAVING} is still there; missing {missing}{cause}). Load an earlier tag; a tag is "
                          f"complete once its {INDEX} and {MANIFEST} are written.", path, problems)


def _structure_problems(path: str, manifest: dict) -> list:
    """Missing / extra files, files that leave the tag or are not regular files, and size
    mismatches (cheap: stat only, nothing read)."""
    import stat

    problems = []
    expected = {e["path"]: e for e in manifest["files"]}
    present = set(_list_files(path))
    for name, e in expected.items():
        if name not in present:
            problems.append((name, "missing"))
            continue
        try:
            st = os.stat(member(path, name, MANIFEST))
        except CheckpointFileError as err:
            problems.append((name, err.problems[0][1]))
            continue
        except OSError as err:
            problems.append((name, f"unreadable ({err.strerror or err})"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append((name, f"{_kind(st.st_mode)}, not a regular file"))
            continue
        size = st.st_size
        if size != e["bytes"]:
            problems.append((name, f"size mismatch ({size} bytes, manifest says {e['bytes']}: truncated or "
                                   "overwritten)" if size < e["bytes"] else
                                   f"size mismatch ({size} bytes, manifest says {e['bytes']})"))
    for name in sorted(present - set(expected)):
        problems.append((name, "unexpected extra file (not in the manifest)"))
    return problems


def _digest_problem(path: str, entry: dict) -> str | None:
    try:
        _, digest = sha256_file(member(path, entry["path"], MANIFEST))
    except CheckpointFileError as e:
        return e.problems[0][1]
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if digest != entry["sha256"]:
        return f"sha256 mismatch (expected {entry['sha256'][:12]}..., got {digest[:12]}...)"
    return None


def _check_mode(mode: str) -> None:
    if mode not in VERIFY_MODES:
        raise ValueError(f"Invalid verify={mode!r}. Allowed: {list(VERIFY_MODES)}")


def verify(save_dir: str, tag: str, mode: str = "sha256") -> dict:
    """Check ``save_dir/<tag>`` against its manifest in this process (no collectives).

    Returns the manifest; raises :class:`CheckpointError` naming the checkpoint and every
    bad file.  ``mode="size"`` skips the digests (presence and sizes only)."""
    _check_mode(mode)
    path = os.path.join(str(save_dir), str(tag))
    manifest = read_manifest(save_dir, tag)
    problems = _structure_problems(path, manifest)
    if problems:
        raise _corrupt(path, problems)
    if mode == "sha256":
        problems = [(e["path"], p) for e in manifest["files"] if (p := _digest_problem(path, e))]
        if problems:
            raise _corrupt(path, problems)
    return manifest


def verify_collective(load_dir: str, tag: str, mode: str = "sha256", missing_manifest_ok: bool = False) -> dict | None:
    """:func:`verify` shared by the ranks, same verdict on every rank (see module doc).

    ``missing_manifest_ok``: a tag directory without a manifest returns None (nothing to
    verify against) instead of raising."""
    _check_mode(mode)
    path = os.path.join(load_dir, tag)

    def structure():
        if os.path.isdir(path):
            incomplete_save(path)
        if missing_manifest_ok and os.path.isdir(path) and not os.path.lexists(os.path.join(path, MANIFEST)):
            return None
        manifest = read_manifest(load_dir, tag)
        problems = _structure_problems(path, manifest)
        if problems:
            raise _corrupt(path, problems)
        return manifest

    manifest = _on_rank0(structure, f"verifying {path}")
    if manifest is not None and mode == "sha256":
        rank, world = _rank_world()
        entries = manifest["files"]
        mine = {i: p for i in range(rank, len(entries), world) if (p := _digest_problem(path, entries[i]))}
        found = {}
        for part in _all_gather(mine):
            found.update(part)
        if found:
            raise _corrupt(path, [(entries[i]["path"], found[i]) for i in sorted(found)])
    return manifest


# ----------------------------------------------------------------------------- load
def deepspeed_load(engine, load_dir: str, tag: str, manifest: dict, **load_kwargs):
    """The default loader: DeepSpeed's own ``engine.load_checkpoint`` of a verified tag."""
    return engine.load_checkpoint(load_dir, tag=tag, **load_kwargs)


def _created(load_dir: str, tag: str) -> int:
    try:
        return int(read_json(os.path.join(load_dir, tag, MANIFEST))["created_unix_ns"])
    except Exception:  # noqa: BLE001 - unreadable: ordered last
        return -1


def published_tags(load_dir: str) -> list[str]:
    """Published tag directories of ``load_dir``, newest first (see module doc for the order)."""
    if not os.path.isdir(load_dir):
        return []
    real = os.path.realpath(load_dir)
    tags = [n for n in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, n))
            and not n.endswith((PARTIAL, REPLACED))
            and os.path.dirname(os.path.realpath(os.path.join(load_dir, n))) == real]  # (no symlink leaving)
    tags.sort(reverse=True)  # tie-break: name, descending (stable sort keeps it)
    tags.sort(key=lambda t: _created(load_dir, t), reverse=True)
    return tags


def load_order(load_dir: str, tag: str | None, fallback: bool) -> dict:
    """Rank 0: which tags to try, in order, why (a note), and the tag asked for (given or named
    by ``latest``; None when there is none) -- broadcast to every rank."""
    if not os.path.isdir(load_dir):
        return {"order": [], "note": f"no checkpoint directory {load_dir!r}"}
    tags = published_tags(load_dir)
    partials = sorted(n for n in os.listdir(load_dir) if n.endswith(PARTIAL))
    unfinished = f"; unfinished saves ignored: {partials}" if partials else ""
    note = None
    if tag is None:
        try:
            tag = read_latest(load_dir)
        except CheckpointError as e:
            if not fallback or not tags:
                raise
            note = f"{e}: trying the newest published tags{unfinished}"
        if tag == "":
            tag = f"<empty {LATEST} file>"
        elif tag is None and note is None:
            if not tags or not fallback:
                found = f"; tags present: {tags} (pass one explicitly)" if tags else ""
                return {"order": [], "note": f"no {LATEST!r} file in {load_dir!r}{found}{unfinished}"}
            note = f"no {LATEST!r} file in {load_dir!r}: trying the newest published tags{unfinished}"
    order = ([tag] if tag is not None else []) + ([t for t in tags if t != tag] if fallback else [])
    return {"order": order, "note": note, "requested": tag}


UNVERIFIED_MODES = ("refuse", "load")


def _warn0(msg: str, *args) -> None:
    """A warning logged once, by rank 0 (every rank reaches the same verdict)."""
    if _rank_world()[0] == 0:
        logger.warning(msg, *args)


def load(engine, load_dir: str, tag: str | None = None, fallback: bool = False, verify: str = "sha256",
         loader=None, unverified: str = "refuse", **load_kwargs) -> LoadResult:
    """Verify, then load a checkpoint into ``engine`` (collective: every rank calls it).

    ``tag=None`` loads the tag named by ``load_dir/latest``.  A checkpoint that fails
    verification raises :class:`CheckpointError` naming the file (``fallback=False``), or
    (``fallback=True``) is skipped for the newest intact one; ``LoadResult.skipped`` lists
    what was skipped and why.  No checkpoint at all returns ``(None, None)`` with a
    ``note``, as ``engine.load_checkpoint`` does; checkpoints present but none intact raise.
    ``loader`` replaces the DeepSpeed load of the verified tag (see the module doc).
    ``load_kwargs`` go to ``engine.load_checkpoint``.  A checkpoint that verifies but that
    DeepSpeed cannot load (e.g. another DP size) raises DeepSpeed's error: not corruption,
    so no fallback.  ``unverified``: what the tag asked for (``tag``, or the one ``latest``
    names) is when its directory has no manifest (written by DeepSpeed alone, or before
    manifests existed): ``"refuse"`` (not verifiable: an error, or a fallback) or ``"load"``
    (loaded as it is, rank 0 logging once that it was not verified; ``LoadResult.manifest``
    is then None).  A fallback candidate needs a manifest either way."""
    _check_mode(verify)
    if unverified not in UNVERIFIED_MODES:
        raise ValueError(f"Invalid unverified={unverified!r}. Allowed: {list(UNVERIFIED_MODES)}")
    load_dir = str(load_dir)
    plan = _on_rank0(lambda: load_order(load_dir, tag, fallback), f"listing {load_dir}")
    if not plan["order"]:
        _warn0("canzona_ds.checkpoint: nothing to load: %s", plan["note"])
        return LoadResult(None, None, note=plan["note"])
    skipped = []
    for cand in plan["order"]:
        try:
            # only the tag asked for may load unverified: a fallback must be known to be intact
            manifest = verify_collective(load_dir, cand, verify,
                                         missing_manifest_ok=unverified == "load" and cand == plan["requested"])
        except CheckpointError as e:
            if not fallback:
                raise
            skipped.append((cand, e.reason))
            _warn0("canzona_ds.checkpoint: skipping %s", e)
            continue
        if manifest is None:
            _warn0("canzona_ds.checkpoint: %s has no %s (saved by DeepSpeed without canzona_ds, or before "
                   "canzona_ds wrote manifests): loading it NOT verified", os.path.join(load_dir, cand), MANIFEST)
        elif skipped:
            _warn0("canzona_ds.checkpoint: loading %s, the newest intact checkpoint (skipped %s)",
                   os.path.join(load_dir, cand), [t for t, _ in skipped])
        with engine_hooks_off():  # verified here: the engine's load_checkpoint must not verify again
            path, client_state = (loader or deepspeed_load)(engine, load_dir, cand, manifest, **load_kwargs)
        if path is None:
            raise CheckpointError(f"checkpoint {os.path.join(load_dir, cand)} "
                                  f"{'verified but ' if manifest is not None else ''}DeepSpeed loaded nothing from it",
                                  os.path.join(load_dir, cand))
        return LoadResult(path, client_state, tag=cand, skipped=skipped, note=plan["note"], manifest=manifest)
    listing = "; ".join(f"{t}: {r}" for t, r in skipped)
    partials = sorted(n for n in os.listdir(load_dir) if n.endswith(PARTIAL)) if os.path.isdir(load_dir) else []
    extra = f"; unfinished saves (never loaded): {partials}" if partials else ""
    raise CheckpointError(f"no intact checkpoint in {load_dir}: {listing}{extra}", load_dir,
                          [(t, r) for t, r in skipped])

"""A checkpoint is untrusted input: a seeded mutator over a real tag (issue 47).

One real tag (the tiny model, CanzonaMuon, ZeRO 1, one rank, one step: its model states, ZeRO
optimizer states, index and manifest) is mutated a few hundred times, each mutant with its
manifest recomputed (anyone can: it has no key), and read by ``canzona-ckpt verify``,
``convert`` and ``inspect`` in this process.  The mutations: the index's and the manifest's
fields (other types, nesting 100k deep, paths that leave the tag, ranks), ``latest`` (a path
out of the load dir), the pickles (an opcode inserted, the stream truncated, two slices
swapped, a planted object, a BUILD on an allowlisted class or function), and the files' kinds
(a FIFO, a symlink to ``/dev/zero`` or out of the tag, empty, junk, a zip header then junk, a
pickle with a zip appended, a decompression bomb, the legacy format).  For every mutant:

* no code ran: a planted object would create a marker file, which never exists;
* nothing changed: the allowlisted classes and functions (and torch's rebuild functions) have
  the same attributes after every mutant as before;
* no traceback, no hang: exit status 0 or 2 (3 is "no check named it"), at most one line on
  stderr, naming the load dir; each command under an alarm;
* nothing outside was read: an audit hook records every file the process opens under the
  test's folder, and none lies outside the load dir.

Cost: one subprocess (a real one-rank ZeRO-1 tag), then 300 mutants in this process; about 50 s on a
loaded 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import zipfile

import pytest
import torch

from canzona_testkit.ckpt import Planted
from canzona_testkit.dist import run_distributed

SEED = 47
MUTANTS = 300
ALARM_S = 20
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
INDEX = "canzona_index.json"
MANIFEST = "canzona_manifest.json"


def _save(rank, world, root):
    """The tiny model, CanzonaMuon at ZeRO 1 on one rank, one step, saved as tag "good"."""
    from canzona_testkit.models import ds_config, run_engine

    *_, engine = run_engine(rank, world, ds_config(world, stage=1), steps=1)
    engine.save_checkpoint(root, tag="good")
    return sorted(os.listdir(os.path.join(root, "good")))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    src = str(base / "src")
    files = run_distributed(_save, 1, src, timeout=300)[0]
    assert {MODEL, OPTIM, INDEX, MANIFEST} <= set(files), files
    return os.path.join(src, "good")


# ------------------------------------------------------------------------------ the watchers
_WATCH: dict = {"base": None, "inside": None, "outside": []}


def _audit(event, args):
    if event != "open" or _WATCH["base"] is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if path.startswith("/proc/self/fd/"):
        return
    real = os.path.realpath(path)
    if real.startswith(_WATCH["base"] + os.sep) and not real.startswith(_WATCH["inside"] + os.sep):
        _WATCH["outside"].append(real)


def _allowlisted() -> dict:
    """name -> object: every allowlisted type and function the process has, torch's own allowlist
    (its rebuild functions, storages, ``OrderedDict``) included."""
    from torch._weights_only_unpickler import _get_allowed_globals

    from canzona_ds.ckpt import safe_load

    objs = dict(_get_allowed_globals())
    objs.update({n: o for o, n in safe_load._allowlist(safe_load.CHECKPOINT_GLOBALS)})
    return objs


def _snapshot(objs: dict) -> dict:
    """Each object's attributes (identities), ``__slotnames__`` aside (copyreg's cache, set when a
    test's own ``torch.save`` pickles a type)."""
    return {n: {k: id(v) for k, v in vars(o).items() if k != "__slotnames__"} if hasattr(o, "__dict__") else None
            for n, o in objs.items()}


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: int):
    def fire(*_):
        raise _Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------ the mutator
def _recompute(tag: str) -> None:
    """The manifest's sizes, hashes and digest recomputed for whatever the tag now holds (what an
    attacker does); an entry that is not a regular file inside the tag keeps its old figures."""
    import hashlib

    from canzona_ds.ckpt import tag as ck

    mpath = os.path.join(tag, MANIFEST)
    try:
        manifest = json.loads(open(mpath).read())
        entries = manifest["files"]
        for e in entries:
            p = os.path.join(tag, e["path"])
            if os.path.isfile(p) and not os.path.islink(p):
                data = open(p, "rb").read()
                e["bytes"], e["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        manifest["tag"] = os.path.basename(tag)
        manifest["files_sha256"] = ck._files_digest(entries)
    except Exception:  # noqa: BLE001 - a manifest the mutant broke stays broken
        return
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _rewrite_pickle(path: str, fn) -> None:
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in items:
            z.writestr(name, fn(data) if name.endswith("/data.pkl") else data)


def _build_on(target: str, attr: str = "update_scale") -> bytes:
    """A pickle that BUILDs attribute ``attr`` = ``builtins.complex`` onto the object ``target``
    names (a class or a function): what would change it for the rest of the process."""
    module, name = target.rsplit(".", 1)
    return (b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n}X" + len(attr).to_bytes(4, "little")
            + attr.encode() + b"cbuiltins\ncomplex\nsb.")


BUILD_TARGETS = ("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "argparse.Namespace",
                 "deepspeed.runtime.zero.config.ZeroStageEnum", "torch._utils._rebuild_parameter",
                 "collections.OrderedDict")


def _bad_values(rng, outside: str) -> list:
    return [None, [], {}, "x", -1, 2 ** 70, 1.5, True, [1], {"a": [1]}, "../../outside/z.pt", outside,
            "../" + MODEL, "./" + MODEL, "", "a/../../" + MODEL, [{}], "\x00", rng.choice([0, 1, 7])]


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:4]):
            yield from _json_paths(v, prefix + (i,))


def _mutate_json(rng, path: str, outside: str, what: str) -> str:
    d = json.loads(open(path).read())
    paths = [p for p in _json_paths(d) if p]
    if what == "manifest":
        paths = [p for p in paths if p[0] == "files"] + [("files",)]
    target = rng.choice(paths)
    parent = d
    for k in target[:-1]:
        parent = parent[k]
    deep = rng.random() < 0.1
    if deep:
        parent[target[-1]] = "__DEEP__"
    elif rng.random() < 0.15 and isinstance(parent, dict):
        del parent[target[-1]]
    else:
        parent[target[-1]] = rng.choice(_bad_values(rng, outside))
    text = json.dumps(d)
    if deep:
        text = text.replace('"__DEEP__"', "[" * 100_000 + "]" * 100_000)
    if what == "manifest" and not deep:  # (the digest over the files recomputed too: anyone can)
        from canzona_ds.ckpt import tag as ck

        with contextlib.suppress(Exception):
            d["files_sha256"] = ck._files_digest(d["files"])
            text = json.dumps(d)
    with open(path, "w") as f:
        f.write(text)
    return f"{what} {'/'.join(map(str, target))}{' deep' if deep else ''}"


def _mutate_pickle(rng, path: str, marker: str) -> str:
    kind = rng.choice(["insert", "truncate", "swap", "plant", "build"])
    if kind == "plant":
        obj = torch.load(path, map_location="cpu", weights_only=False)  # (the suite's own file)
        obj["planted"] = Planted(marker)
        torch.save(obj, path)
        return "pickle plant"
    if kind == "build":
        target = rng.choice(BUILD_TARGETS)
        _rewrite_pickle(path, lambda _: _build_on(target))
        return f"pickle build {target}"

    def mutate(data: bytes) -> bytes:
        n = len(data)
        i, j = sorted(rng.randrange(n) for _ in range(2))
        if kind == "insert":
            return data[:i] + bytes([rng.choice(b"cRbs}]q(tuN.\x80\x93\x94\x95iho")]) + data[i:]
        if kind == "truncate":
            return data[:i]
        k = rng.randrange(i, max(i + 1, j))
        return data[:i] + data[k:j] + data[i:k] + data[j:]
    _rewrite_pickle(path, mutate)
    return f"pickle {kind}"


def _mutate_kind(rng, path: str, outside: str, marker: str) -> str:
    kind = rng.choice(["fifo", "devzero", "symlink_out", "empty", "junk", "zip_junk", "pickle_zip", "bomb",
                       "legacy_plant", "truncated", "dir"])
    data = open(path, "rb").read()
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "symlink_out":
        os.symlink(outside, path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "legacy_plant":
        torch.save({"x": Planted(marker)}, path, _use_new_zipfile_serialization=False)
    elif kind == "pickle_zip":
        import pickle

        with open(path, "wb") as f:
            f.write(pickle.dumps({"w": 1}, protocol=2) + data)
    elif kind == "bomb":
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("archive/data.pkl", b"\x80\x02}q\x00." + b"\x00" * (48 << 20))
            z.writestr("archive/byteorder", b"little")
    else:
        with open(path, "wb") as f:
            f.write({"empty": b"", "junk": b"hello, this is text\n" * 10, "zip_junk": b"PK\x03\x04" + os.urandom(200),
                     "truncated": data[:len(data) // 2]}[kind])
    return f"kind {kind}"


def _mutant(rng, good: str, root: str, outside: str, marker: str) -> tuple[str, list[list[str]]]:
    """One mutant of ``good`` as ``root/m``; returns (what was done, the commands to run)."""
    tag = os.path.join(root, "m")
    shutil.rmtree(tag, ignore_errors=True)
    shutil.copytree(good, tag)
    _recompute(tag)  # (the manifest names its tag: "m")
    latest = os.path.join(root, "latest")
    if os.path.lexists(latest):
        os.remove(latest)
    with open(latest, "w") as f:
        f.write("m")
    out = os.path.join(root, "out")
    family = rng.choice(["index", "manifest", "pickle", "pickle", "kind", "kind", "latest"])
    pt = os.path.join(tag, rng.choice([MODEL, OPTIM]))
    if family == "index":
        what = _mutate_json(rng, os.path.join(tag, INDEX), outside, "index")
    elif family == "manifest":
        what = _mutate_json(rng, os.path.join(tag, MANIFEST), outside, "manifest")
    elif family == "pickle":
        what = _mutate_pickle(rng, pt, marker)
    elif family == "kind":
        what = _mutate_kind(rng, rng.choice([pt, pt, os.path.join(tag, INDEX)]), outside, marker)
    else:
        os.remove(latest)
        choice = rng.choice(["up", "abs", "dotdot", "fifo", "symlink"])
        if choice == "fifo":
            os.mkfifo(latest)
        elif choice == "symlink":
            os.symlink(os.path.join(os.path.dirname(outside), "elsewhere_latest"), latest)
        else:
            with open(latest, "w") as f:
                f.write({"up": "../elsewhere/good", "abs": os.path.join(os.path.dirname(outside), "elsewhere", "good"),
                         "dotdot": "m/../../elsewhere/good"}[choice])
        what = f"latest {choice}"
        return what, [["verify", root], ["inspect", root], ["convert", root, out]]
    if family != "manifest":
        _recompute(tag)
    cmds = [["verify", root, "--tag", "m"], ["convert", root, out, "--tag", "m"]]
    if family in ("index", "kind"):
        cmds.append(["inspect", root, "--tag", "m"])
    return what, cmds


@pytest.mark.dist
def test_mutated_tags_never_run_change_hang_or_reach_outside(good, tmp_path, capsys):
    from canzona_ds.cli.ckpt import main
    from canzona_ds.integration.ckpt.safe import import_deepspeed_types

    import_deepspeed_types()  # (what the CLI imports anyway: the snapshot covers DeepSpeed's types)
    base = str(tmp_path.resolve())
    root, marker = os.path.join(base, "ckpt"), os.path.join(base, "ran")
    os.makedirs(root)
    outside_dir = os.path.join(base, "outside")
    shutil.copytree(good, os.path.join(base, "elsewhere", "good"))
    os.makedirs(outside_dir)
    outside = os.path.join(outside_dir, "z.pt")
    shutil.copy(os.path.join(good, MODEL), outside)
    with open(os.path.join(base, "elsewhere_latest"), "w") as f:
        f.write("good")
    # the intact tag passes, and a copy of it outside is what a followed path would reach
    assert main(["verify", os.path.join(base, "elsewhere"), "--tag", "good"]) == 0
    capsys.readouterr()
    objs = _allowlisted()
    before = _snapshot(objs)
    dtype = str(torch.float32), repr(__import__("numpy").dtype("float32"))
    sys.addaudithook(_audit)  # (on only while a command runs: the mutator itself writes outside)
    _WATCH.update(inside=os.path.realpath(root), outside=[])
    rng = random.Random(SEED)
    seen: set[str] = set()
    for i in range(MUTANTS):
        what, cmds = _mutant(rng, good, root, outside, marker)
        seen.add(what.split()[0])
        for cmd in cmds:
            shutil.rmtree(os.path.join(root, "out"), ignore_errors=True)
            _WATCH["base"] = base
            with _alarm(ALARM_S):
                try:
                    rc = main(cmd)
                except _Hang as e:
                    pytest.fail(f"mutant {i} ({what}): {cmd[0]} hung: {e}")
                finally:
                    _WATCH["base"] = None
            got = capsys.readouterr()
            where = f"mutant {i} ({what}), {cmd[0]}: rc {rc}, stderr {got.err!r}"
            assert rc in (0, 2), where
            assert len(got.err.strip().splitlines()) == (rc != 0), where
            assert rc == 0 or root in got.err, where
            assert not os.path.exists(marker), where
            assert not _WATCH["outside"], f"{where}: read {_WATCH['outside']}"
            assert _snapshot(objs) == before, where
    assert (str(torch.float32), repr(__import__("numpy").dtype("float32"))) == dtype
    # every family was drawn (the seed is fixed: this guards the mutator itself)
    assert seen == {"index", "manifest", "pickle", "kind", "latest"}, seen


def test_build_on_an_allowlisted_class_or_function_is_refused_and_changes_nothing(tmp_path):
    """Issue 47's first finding: a BUILD of ``{"update_scale": complex}`` on DeepSpeed's
    ``DynamicLossScaler`` class (or on ``argparse.Namespace``, ``ZeroStageEnum``, torch's
    ``_rebuild_parameter``) loaded and changed the class for the rest of the process.  Refused
    by name, nothing changed."""
    from canzona_ds.ckpt import safe_load
    from canzona_ds.integration.ckpt.safe import import_deepspeed_types

    import_deepspeed_types()
    objs = _allowlisted()
    before = _snapshot(objs)
    path = str(tmp_path / "f.pt")
    for target in BUILD_TARGETS:
        torch.save({"w": torch.ones(2)}, path)
        _rewrite_pickle(path, lambda _: _build_on(target))
        with pytest.raises(safe_load.UnsafeCheckpointError, match=r"f\.pt: holds (a BUILD on a \S+ object|"
                                                                 + target.replace(".", r"\.") + ")"):
            safe_load.load(path)
    assert _snapshot(objs) == before
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    assert "update_scale" in vars(DynamicLossScaler) and vars(DynamicLossScaler)["update_scale"] is not complex


def test_the_file_read_is_the_file_checked(tmp_path, monkeypatch):
    """Issue 47's second finding: the file was scanned, then opened again, so a file swapped in
    between (a zip when scanned, a legacy pickle when reopened) ran.  The loader opens a file
    once: whatever the name points to after the zip check, the bytes unpickled are the ones
    opened.  Deterministically: the swap is made inside the check, both for the file replaced
    under its name and for a symlink retargeted."""
    from canzona_ds.ckpt import safe_load

    marker = tmp_path / "ran"
    evil = str(tmp_path / "evil.pt")
    torch.save({"x": Planted(str(marker))}, evil, _use_new_zipfile_serialization=False)
    real_check = safe_load._check_zip
    for form in ("replaced", "symlink"):
        name = str(tmp_path / f"{form}.pt")
        good_file = str(tmp_path / f"{form}_target.pt")
        torch.save({"w": torch.arange(3.0)}, good_file)
        if form == "symlink":
            os.symlink(good_file, name)
        else:
            shutil.copy(good_file, name)

        def swap(path, f, size, name=name, form=form):
            zipped = real_check(path, f, size)
            if form == "symlink":
                os.remove(name)
                os.symlink(evil, name)
            else:
                shutil.copy(evil, name + ".tmp")
                os.replace(name + ".tmp", name)
            return zipped

        monkeypatch.setattr(safe_load, "_check_zip", swap)
        for mmap in (False, True):
            if mmap:  # (the name points at the evil file now: back to the good one, swapped again in the check)
                os.remove(name)
                (os.symlink(good_file, name) if form == "symlink" else shutil.copy(good_file, name))
            got = safe_load.load(name, mmap=mmap)
            assert torch.equal(got["w"], torch.arange(3.0)), (form, mmap)
        assert not marker.exists()
        # and the swapped-in file itself, read on its own, is refused by name
        monkeypatch.setattr(safe_load, "_check_zip", real_check)
        with pytest.raises(safe_load.UnsafeCheckpointError, match="holds io.open"):
            safe_load.load(name)
        assert not marker.exists()


def test_reading_imports_nothing(tmp_path, monkeypatch):
    """Issue 47's third finding: resolving the allowlist imported modules (``megatron.core.enums``
    for any legacy file), so a ``megatron/`` package where Python looks ran.  Names resolve only
    in modules already imported: with a planted ``megatron`` package first on the path, a file
    naming ``megatron.core.enums.ModelType`` is refused by name and the package never runs."""
    from canzona_ds.ckpt import safe_load

    pkg = tmp_path / "megatron" / "core"
    pkg.mkdir(parents=True)
    marker = tmp_path / "ran"
    for d in (tmp_path / "megatron", pkg):
        (d / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "enums.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass ModelType: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, m)
    path = str(tmp_path / "f.pt")
    for legacy in (False, True):
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)
        assert torch.equal(safe_load.load(path)["w"], torch.ones(2))
        if not legacy:
            _rewrite_pickle(path, lambda _: b"\x80\x02cmegatron.core.enums\nModelType\nq\x00.")
            with pytest.raises(safe_load.UnsafeCheckpointError, match="holds megatron.core.enums.ModelType"):
                safe_load.load(path)
    assert not marker.exists() and "megatron" not in sys.modules


@pytest.mark.parametrize("kind", ["fifo", "devzero", "bomb", "empty", "junk", "zip_junk", "pickle_zip", "deep"])
def test_a_bad_file_is_one_line_naming_it(tmp_path, kind):
    """Every bad file is one ``CheckpointError`` line naming it, none blocks: a FIFO and
    ``/dev/zero`` are refused before a byte is read, a decompression bomb before a member is
    inflated (its members' sizes against the file's)."""
    import pickle

    from canzona_ds.ckpt import safe_load
    from canzona_ds.ckpt.tag import CheckpointError

    path = str(tmp_path / "f.pt")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "bomb":
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("archive/data.pkl", b"\x80\x02}q\x00." + b"\x00" * (48 << 20))
    else:
        buf = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buf)
        data = {"empty": b"", "junk": b"text\n", "zip_junk": b"PK\x03\x04" + b"\x01" * 100,
                "pickle_zip": pickle.dumps({"a": 1}, protocol=2) + buf.getvalue(),
                "deep": b"\x80\x02" + b"]" * 200_000 + b"."}[kind]
        with open(path, "wb") as f:
            f.write(data)
    with _alarm(ALARM_S):
        for mmap in (False, True):
            with pytest.raises(CheckpointError) as e:
                safe_load.load(path, mmap=mmap)
            assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value), str(e.value)
    if kind == "bomb":
        assert "decompression bomb" in str(e.value)
    if kind in ("fifo", "devzero"):
        assert "not a regular file" in str(e.value)


def test_the_resume_paths_tag_is_a_closed_world(good, tmp_path):
    """The resume's own steps (``checkpoint.load``'s order and ``verify_collective``, one process
    here) refuse by name a ``latest`` out of the load dir (or, with fallback, skip it for the
    newest published tag), a manifest entry out of the tag, a symlink leaving it and a FIFO,
    each before a byte of it is read."""
    from canzona_ds.ckpt import tag as ck

    root = str(tmp_path / "ckpt")
    shutil.copytree(good, os.path.join(root, "good"))
    shutil.copy(os.path.join(good, OPTIM), tmp_path / "z.pt")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("../elsewhere/good")
    with pytest.raises(ck.CheckpointFileError, match=r"latest: names '\.\./elsewhere/good', which is not a tag"):
        ck.load_order(root, None, fallback=False)
    plan = ck.load_order(root, None, fallback=True)
    assert plan["order"] == ["good"] and "trying the newest published tags" in plan["note"]
    for name, make, what in (("out", lambda p: os.symlink(str(tmp_path / "z.pt"), p), "leaves"),
                             ("fifo", os.mkfifo, "a FIFO, not a regular file")):
        tag = os.path.join(root, name)
        shutil.copytree(good, tag)
        os.remove(os.path.join(tag, OPTIM))
        make(os.path.join(tag, OPTIM))
        _recompute(tag)
        with _alarm(ALARM_S), pytest.raises(ck.CheckpointError, match=f"{OPTIM}: .*{what}"):
            ck.verify_collective(root, name)
    tag = os.path.join(root, "up")
    shutil.copytree(good, tag)
    manifest = json.loads(open(os.path.join(tag, MANIFEST)).read())
    manifest["files"][0]["path"] = "../good/" + manifest["files"][0]["path"]
    manifest["files_sha256"] = ck._files_digest(manifest["files"])
    with open(os.path.join(tag, MANIFEST), "w") as f:
        json.dump(manifest, f)
    _recompute(tag)
    with pytest.raises(ck.CheckpointError, match=r"\.\./good/\S+: named by canzona_manifest.json: not a relative"):
        ck.verify_collective(root, "up")

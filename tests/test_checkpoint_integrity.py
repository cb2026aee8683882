"""Checkpoint integrity (``canzona_ds.checkpoint``): atomic save with a manifest, verified load
that refuses a corrupt checkpoint naming the file, fallback to the newest intact one.

Real DeepSpeed ZeRO-1 checkpoints written by 2 gloo ranks, real damage to the files:
64 bytes overwritten in the middle of a file, a file truncated, a file deleted, the tag
directory deleted, the manifest deleted, an extra file, a save that crashed before publishing.

* ``scenarios`` (2 ranks, one engine): each fault against ``load(fallback=False)`` (refused,
  naming the file, identically on both ranks) and ``load(fallback=True)`` (the intact
  checkpoint is loaded: the weights are exactly the ones saved at that step);
* single-process ``verify`` on copies of the same checkpoint (every fault, both modes);
* the main job through DeepSpeed's launcher: ``--resume`` with the newest checkpoint
  damaged says so, resumes from the previous one and reproduces the uninterrupted losses bit
  for bit; with every checkpoint damaged it exits 4 naming the files.

Cost: 2 launching tests; 36 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from canzona_ds.ckpt import tag as ck
from canzona_testkit.dist import free_port, run_distributed
from canzona_testkit.models import batches, ds_config, make_model, params_of

pytestmark = pytest.mark.dist

MICRO = 2
MODEL = "mp_rank_00_model_states.pt"
OPT0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
OPT1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


# ------------------------------------------------------------------ real damage to real files
def overwrite_middle(path, n: int = 64) -> None:
    """Overwrite ``n`` bytes in the middle of a file with their bitwise complement."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        old = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in old))


def truncate_half(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


FAULTS = {
    # name: (damage applied to a copy of the checkpoint directory, expected file, expected words)
    "overwrite_model_states": (lambda d: overwrite_middle(d / "step2" / MODEL), MODEL, "sha256 mismatch"),
    "overwrite_optim_rank0": (lambda d: overwrite_middle(d / "step2" / OPT0), OPT0, "sha256 mismatch"),
    "truncate_optim_rank1": (lambda d: truncate_half(d / "step2" / OPT1), OPT1, "size mismatch"),
    "truncate_model_states": (lambda d: truncate_half(d / "step2" / MODEL), MODEL, "size mismatch"),
    "missing_file": (lambda d: (d / "step2" / OPT1).unlink(), OPT1, "missing"),
    "missing_tag": (lambda d: shutil.rmtree(d / "step2"), ".", "does not exist"),
    "missing_manifest": (lambda d: (d / "step2" / ck.MANIFEST).unlink(), ck.MANIFEST, "missing"),
    "extra_file": (lambda d: (d / "step2" / "notes.txt").write_text("x"), "notes.txt", "unexpected extra file"),
}


def _engine(world):
    import canzona_ds  # noqa: F401 - registers CanzonaMuon
    import deepspeed

    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(world, micro=MICRO))
    return engine


def _step(engine, rank, x, y):
    engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
    engine.step()


def _scenarios(rank, world, root):
    import torch.distributed as dist

    root = Path(root)
    base = root / "base"
    engine = _engine(world)
    data = batches(2, MICRO * world)
    out = {}
    _step(engine, rank, *data[0])
    ck.save(engine, base, "step1", client_state={"step": 1})
    out["p1"] = params_of(engine.module)
    _step(engine, rank, *data[1])
    ck.save(engine, base, "step2", client_state={"step": 2})
    out["p2"] = params_of(engine.module)
    out["after_save"] = sorted(os.listdir(base))

    # a save that dies before it is published (rank 0 fails writing the manifest): every
    # rank gets the error, `latest` still names step2, step3 exists only as step3.partial
    real = ck.write_atomic

    def crash(path, data):
        raise OSError(28, "No space left on device (injected)")

    ck.write_atomic = crash
    try:
        ck.save(engine, base, "step3", client_state={"step": 3})
        out["crash"] = None
    except ck.CheckpointError as e:
        out["crash"] = str(e)
    finally:
        ck.write_atomic = real
    out["after_crash"] = sorted(os.listdir(base))
    out["latest_after_crash"] = (base / "latest").read_text()

    # the next save of that tag clears the stale .partial; a save of an existing tag replaces it
    atomic = root / "atomic"
    if rank == 0:
        shutil.copytree(base, atomic)
    dist.barrier()
    ck.save(engine, atomic, "step3", client_state={"step": 3})
    out["after_resave"] = sorted(os.listdir(atomic))
    ck.save(engine, atomic, "step3", client_state={"step": 33})
    out["after_replace"] = sorted(os.listdir(atomic))
    out["replaced_client"] = ck.load(engine, atomic, tag="step3").client_state["step"]

    cases = {}
    for name, (damage, _, _) in FAULTS.items():
        d = root / name
        if rank == 0:
            shutil.copytree(base, d)
            damage(d)
        dist.barrier()
        case = {}
        try:
            res = ck.load(engine, d, fallback=False)
            case["strict"] = ("loaded", res.tag)
        except ck.CheckpointError as e:
            case["strict"] = ("refused", str(e), e.problems)
        res = ck.load(engine, d, fallback=True)
        case["fallback"] = (res.tag, res.skipped, res.client_state["step"], params_of(engine.module))
        cases[name] = case
    out["cases"] = cases

    # the unpublished step3.partial is never a candidate: latest (step2) loads, nothing skipped
    res = ck.load(engine, base, fallback=True)
    out["partial"] = (res.tag, res.skipped, params_of(engine.module))

    # every checkpoint damaged: refused on every rank with the list of what was found
    d = root / "all_bad"
    if rank == 0:
        shutil.copytree(base, d)
        overwrite_middle(d / "step2" / MODEL)
        truncate_half(d / "step1" / OPT0)
    dist.barrier()
    try:
        ck.load(engine, d, fallback=True)
        out["all_bad"] = None
    except ck.CheckpointError as e:
        out["all_bad"] = str(e)

    # nothing to load: (None, None) as DeepSpeed does
    res = ck.load(engine, root / "does_not_exist", fallback=True)
    out["nothing"] = (res.path, res.client_state, res.note)
    return out


@pytest.fixture(scope="module")
def scen(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_integrity")
    return root, run_distributed(_scenarios, 2, str(root), timeout=400)


def test_save_publishes_atomically_with_manifest(scen):
    root, res = scen
    r0 = res[0]
    assert r0["after_save"] == ["latest", "step1", "step2", "zero_to_fp32.py", "zero_to_torch.py"]
    assert (root / "base" / "latest").read_text() == "step2"
    man = json.loads((root / "base" / "step2" / ck.MANIFEST).read_text())
    assert man["format"] == ck.FORMAT and man["tag"] == "step2" and man["world_size"] == 2
    assert man["dp_world_size"] == 2 and man["global_steps"] == 2
    assert [f["path"] for f in man["files"]] == [ck.INDEX, MODEL, OPT0, OPT1]
    for f in man["files"]:
        assert ck.sha256_file(root / "base" / "step2" / f["path"]) == (f["bytes"], f["sha256"])
    assert man["created_unix_ns"] > json.loads((root / "base" / "step1" / ck.MANIFEST).read_text())["created_unix_ns"]


def test_crash_before_publish_never_becomes_latest(scen):
    _, res = scen
    for r in res:  # both ranks got the error (no hang, no rank carrying on alone)
        assert r["crash"] is not None and "No space left on device (injected)" in r["crash"], r["crash"]
        assert r["after_crash"] == ["latest", "step1", "step2", "step3.partial", "zero_to_fp32.py",
                                    "zero_to_torch.py"]
        assert r["latest_after_crash"] == "step2"


def test_stale_partial_cleared_and_same_tag_replaced(scen):
    root, res = scen
    for r in res:
        assert r["after_resave"] == ["latest", "step1", "step2", "step3", "zero_to_fp32.py", "zero_to_torch.py"]
        assert r["after_replace"] == r["after_resave"]  # no .partial / .replaced left behind
        assert r["replaced_client"] == 33
    assert (root / "atomic" / "latest").read_text() == "step3"
    ck.verify(root / "atomic", "step3")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_corrupt_checkpoint_refused_naming_the_file(scen, fault):
    _, res = scen
    _, fname, words = FAULTS[fault]
    strict = [r["cases"][fault]["strict"] for r in res]
    assert strict[0] == strict[1]  # the same verdict on both ranks
    kind, msg, problems = strict[0]
    assert kind == "refused"
    assert "step2" in msg and words in msg, msg
    assert fname in [p[0] for p in problems], problems
    if fname != ".":
        assert fname in msg


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fallback_loads_the_previous_intact_checkpoint_exactly(scen, fault):
    _, res = scen
    _, fname, words = FAULTS[fault]
    for r in res:
        tag, skipped, step, params = r["cases"][fault]["fallback"]
        assert tag == "step1" and step == 1
        assert [t for t, _ in skipped] == ["step2"] and words in skipped[0][1], skipped
        for n, v in r["p1"].items():
            np.testing.assert_array_equal(params[n], v, err_msg=n)
        assert any((r["p1"][n] != r["p2"][n]).any() for n in r["p1"])  # step 1 != step 2


def test_unpublished_partial_is_ignored(scen):
    _, res = scen
    for r in res:
        tag, skipped, params = r["partial"]
        assert tag == "step2" and skipped == []
        for n, v in r["p2"].items():
            np.testing.assert_array_equal(params[n], v, err_msg=n)


def test_no_intact_checkpoint_lists_what_was_found(scen):
    _, res = scen
    for r in res:
        msg = r["all_bad"]
        assert msg is not None and msg.startswith("no intact checkpoint in "), msg
        assert f"step2: {MODEL}: sha256 mismatch" in msg and f"step1: {OPT0}: size mismatch" in msg, msg
        assert "step3.partial" in msg  # the unfinished save is named, not loaded


def test_no_checkpoint_returns_none(scen):
    _, res = scen
    for r in res:
        path, client, note = r["nothing"]
        assert path is None and client is None and "no checkpoint directory" in note


# ------------------------------------------------------------------ single process verify
@pytest.mark.parametrize("fault", list(FAULTS))
def test_verify_names_the_file(scen, fault, tmp_path):
    root, _ = scen
    damage, fname, words = FAULTS[fault]
    d = tmp_path / "c"
    shutil.copytree(root / "base", d)
    ck.verify(d, "step2")  # intact copy verifies
    damage(d)
    with pytest.raises(ck.CheckpointError) as ei:
        ck.verify(d, "step2")
    assert str(d / "step2") in str(ei.value) and words in str(ei.value)
    assert ei.value.problems[0][0] == fname
    ck.verify(d, "step1")  # the neighbour is untouched


def test_size_mode_catches_truncation_not_overwrites(scen, tmp_path):
    root, _ = scen
    d = tmp_path / "c"
    shutil.copytree(root / "base", d)
    overwrite_middle(d / "step2" / MODEL)
    ck.verify(d, "step2", mode="size")  # blind to overwritten bytes (documented)
    with pytest.raises(ck.CheckpointError, match="sha256 mismatch"):
        ck.verify(d, "step2")
    truncate_half(d / "step1" / OPT1)
    with pytest.raises(ck.CheckpointError, match=f"{OPT1}: size mismatch"):
        ck.verify(d, "step1", mode="size")
    with pytest.raises(ValueError, match="Invalid verify="):
        ck.verify(d, "step1", mode="md5")


def test_altered_manifest_detected(scen, tmp_path):
    root, _ = scen
    d = tmp_path / "c"
    shutil.copytree(root / "base", d)
    mpath = d / "step2" / ck.MANIFEST
    man = json.loads(mpath.read_text())
    man["files"][0]["sha256"] = "0" * 64  # someone "fixes" a digest by hand
    mpath.write_text(json.dumps(man))
    with pytest.raises(ck.CheckpointError, match="altered"):
        ck.verify(d, "step2")
    mpath.write_text(mpath.read_text()[:50])  # torn manifest
    with pytest.raises(ck.CheckpointError, match=f"{ck.MANIFEST}: unreadable"):
        ck.verify(d, "step2")
    shutil.copytree(d / "step1", d / "step1_copy")  # a renamed directory is not the tag it claims
    with pytest.raises(ck.CheckpointError, match="belongs to tag 'step1'"):
        ck.verify(d, "step1_copy")


def test_fallback_order_newest_first(scen, tmp_path):
    root, _ = scen
    d = tmp_path / "c"
    shutil.copytree(root / "base", d)
    assert ck.published_tags(d) == ["step2", "step1"]  # step3.partial is not published
    assert ck.published_tags(tmp_path / "nothing") == []


@pytest.mark.parametrize("tag", ["", "latest", "a/b", "step1.partial", "x.replaced", ".."])
def test_bad_tags_rejected(tag):
    with pytest.raises(ValueError, match="Invalid checkpoint tag"):
        ck.save(object(), "/nonexistent", tag)


# ------------------------------------------------------------------ the main job
REPO = Path(__file__).resolve().parents[1]
#: the job tests' settings (tests/test_train_job.py): tiny preset, seq_len 64, 4 windows per rank
COMMON = ["--set", "seq_len=64", "--set", "micro_batch=4", "--set", "eval_batches=2", "--set", "warmup_steps=2",
          "--no-progress"]
JOB = ["--set", "steps=8", "--set", "checkpoint_every=4", "--set", "eval_every=4",
       "--ds-config", "configs/ds_cpu_canzona.json"]


def launch(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    """The main job on 2 gloo ranks through this interpreter's DeepSpeed launcher."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "canzona_ds.cli.train", "--config", "configs/run_tiny.yaml", *COMMON, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, launch.py and the ranks: no orphans
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def job_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("job")
    r = launch([*JOB, "--set", f"log_dir={out}", "--set", f"checkpoint_dir={out}/ckpt"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_job_resume_falls_back_from_corrupt_newest_checkpoint(job_run, tmp_path):
    full = job_run
    assert (full / "ckpt" / "latest").read_text() == "step8"
    res = tmp_path / "resumed"
    shutil.copytree(full / "ckpt", res / "ckpt")
    # the fault: 64 bytes overwritten in the middle of the newest model-states file
    overwrite_middle(res / "ckpt" / "step8" / MODEL)
    r = launch([*JOB, "--set", f"log_dir={res}", "--set", f"checkpoint_dir={res}/ckpt", "--resume"])
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"[CanzonaMuon] checkpoint step8 is corrupt or incomplete ({MODEL}: sha256 mismatch" in log, log[-3000:]
    assert "[CanzonaMuon] resumed from step4 (newest intact checkpoint; skipped ['step8'])" in log
    assert "at step 4" in log and "OVERFLOW" not in log
    a, b = rows(full / "metrics.jsonl"), rows(res / "metrics.jsonl")
    assert [x["step"] for x in b] == [5, 6, 7, 8]
    assert [x["loss"] for x in b] == [x["loss"] for x in a[4:]]  # bit for bit
    # the resumed run re-saved step8 (replacing the corrupt one): intact and identical content
    ck.verify(res / "ckpt", "step8")
    assert (res / "ckpt" / "latest").read_text() == "step8"


def test_job_resume_with_no_intact_checkpoint_exits_4(job_run, tmp_path):
    res = tmp_path / "bad"
    shutil.copytree(job_run / "ckpt", res / "ckpt")
    truncate_half(res / "ckpt" / "step8" / OPT1)
    (res / "ckpt" / "step4" / MODEL).unlink()
    r = launch([*JOB, "--set", f"log_dir={res}", "--set", f"checkpoint_dir={res}/ckpt", "--resume"])
    log = r.stdout + r.stderr
    assert r.returncode == 4, log[-3000:]
    assert "checkpoint error: no intact checkpoint in" in log
    assert f"step8: {OPT1}: size mismatch" in log and f"step4: {MODEL}: missing" in log, log[-3000:]
    assert "Traceback" not in log
    assert (res / "ckpt" / "latest").read_text() == "step8"  # nothing overwritten

"""DeepSpeed's ~69 MB /dev/shm all-reduce buffers are not left behind when the main job is
stopped: SIGTERM to ``launch/train.sh`` midway through a real 2-rank run, a rank SIGKILLed
midway, and ``train.sh``'s own sweep of its port's buffers after the launcher returns.

Buffer name (DeepSpeed 0.19.8 ``shm.cpp``):
``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``.

Cost: 5 launching tests; 25 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canzona_testkit.dist import free_port

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
pytestmark = [pytest.mark.dist, pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")]

#: a run long enough to be stopped midway: tiny preset, seq_len 64, no eval, no checkpoints
LONG = ["--set", "steps=500", "--set", "seq_len=64", "--set", "micro_batch=4", "--set", "eval_every=0",
        "--set", "eval_batches=1", "--set", "checkpoint_every=0", "--no-progress"]


def buffers(port: int) -> list[Path]:
    return sorted(SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def job_processes(port: int) -> dict[int, dict]:
    """pid -> {RANK, cmd} of live processes whose environment has MASTER_PORT=port."""
    found = {}
    needle = f"MASTER_PORT={port}".encode()
    for env_path in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = env_path.read_bytes().split(b"\0")
            cmd = (env_path.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (env_path.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)
            found[int(env_path.parent.name)] = {"RANK": rank, "cmd": cmd}
    return found


def start_train_sh(port: int, args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["MASTER_PORT"] = str(port)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this interpreter's deepspeed
    # its own session: the test's signals go to train.sh alone, as a user's `kill` would
    return subprocess.Popen(["bash", "launch/train.sh", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int = 1, timeout: float = 180) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"train.sh exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("no training step within the timeout")


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return out


def test_sigterm_midway_leaves_no_buffer(tmp_path):
    port = free_port()
    proc = start_train_sh(port, [*LONG, "--set", f"log_dir={tmp_path}"])
    try:
        wait_for_steps(proc, tmp_path / "metrics.jsonl")
        ranks = {p["RANK"] for p in job_processes(port).values() if "-m canzona_ds.cli.train" in p["cmd"]}
        assert ranks == {"0", "1"}
        # each rank unlinked its buffer right after start-up: nothing in /dev/shm while it runs
        assert buffers(port) == []
        proc.send_signal(signal.SIGTERM)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out[-3000:]
    assert "received SIGTERM; exiting" in out, out[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(steps) < 500  # stopped midway
    assert buffers(port) == []
    assert job_processes(port) == {}  # launcher, launch.py and both ranks are gone


def test_sigkilled_rank_leaves_no_buffer(tmp_path):
    port = free_port()
    proc = start_train_sh(port, [*LONG, "--set", f"log_dir={tmp_path}"])
    try:
        wait_for_steps(proc, tmp_path / "metrics.jsonl")
        rank1 = [pid for pid, p in job_processes(port).items()
                 if p["RANK"] == "1" and "-m canzona_ds.cli.train" in p["cmd"]]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-3000:]
    # DeepSpeed's launcher polls its ranks once a second and reports the first dead one it finds:
    # the killed rank (-9), or rank 0 when it has already failed on the lost peer in the same
    # interval (seen in CI, with gloo's "Connection closed by peer" and "... reset by peer").
    # Either way the report is a failure, and the rank we killed is the cause.
    killed = "exits with return code = -9" in out
    peer_lost = "exits with return code = 1" in out and "by peer" in out
    assert killed or peer_lost, out[-3000:]
    assert buffers(port) == []
    assert job_processes(port) == {}


def test_train_sh_sweeps_its_port_buffers_when_it_exits(tmp_path):
    # buffers a rank SIGKILLed during start-up would leave (before it unlinks its own):
    # stand-ins with the real names, for this run's port and for another port
    port, other = free_port(), free_port()
    uid = os.getuid()
    mine = [SHM / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{r}" for r in (0, 1)]
    theirs = SHM / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{other}_0"
    maps = []
    for p in (*mine, theirs):
        p.write_bytes(b"\0" * 4096)
        with p.open("r+b") as f:  # mapped, like a live rank's: other test sessions' sweeps leave it
            maps.append(mmap.mmap(f.fileno(), 4096))
    try:
        # train.sh returns quickly: its pre-launch check rejects the config (exit 2, no rank
        # started); it sweeps its port's buffers on every exit path
        proc = start_train_sh(port, ["--set", "stepz=1", "--set", f"log_dir={tmp_path}"])
        out = finish(proc)
        assert proc.returncode == 2, out[-3000:]
        assert "Unknown run config key(s) ['stepz']" in out
        assert buffers(port) == []
        assert theirs.exists()  # another job's buffers are not touched
    finally:
        for m in maps:
            m.close()
        for p in (*mine, theirs):
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------ the test session's own sweep
# (tests/conftest.py): helpers on a private folder, then whole pytest sessions on /dev/shm

import conftest  # noqa: E402 - tests/conftest.py, importable as pytest puts tests/ on sys.path


def _mapped_in_child(path: Path) -> subprocess.Popen:
    """A live process (a child of this one) that maps ``path`` until its stdin closes."""
    code = ("import mmap, sys\nf = open(sys.argv[1], 'r+b')\nm = mmap.mmap(f.fileno(), 4096)\n"
            "print('mapped', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "mapped"
    return proc


def test_sweep_removes_only_abandoned_files(tmp_path):
    old = tmp_path / "deepspeed_allreduce_buffer_x_1"   # a finished job's: unmapped
    young = tmp_path / "deepspeed_allreduce_buffer_x_2"  # unmapped too
    used = tmp_path / "deepspeed_allreduce_buffer_x_3"   # mapped by a live process
    for p in (old, young, used):
        p.write_bytes(b"\0" * 4096)
    # (ctime cannot be set back: every file is young; the settle time decides)
    holder = _mapped_in_child(used)
    try:
        baseline = set()
        assert conftest.sweep(conftest.created_since(baseline, tmp_path), tmp_path, wait=False, settle_s=60) == []
        assert old.exists() and young.exists() and used.exists()  # ctime is fresh for all: nothing settled
        removed = conftest.sweep(conftest.created_since(baseline, tmp_path), tmp_path, wait=True, settle_s=1.0)
        assert sorted(removed) == [old.name, young.name]  # waited for them to settle
        assert used.exists()
        # the one that was mapped is a leak only while its process lives
        assert [line.split(" ")[0] for line in conftest.session_leaks(baseline, tmp_path)] == [str(used)]
        assert "still mapped by process(es) the suite started" in conftest.session_leaks(baseline, tmp_path)[0]
    finally:
        holder.stdin.close()
        holder.wait()
    assert conftest.sweep(conftest.created_since(set(), tmp_path), tmp_path, settle_s=0.5) == [used.name]
    assert conftest.session_leaks(set(), tmp_path) == []


def test_sweep_leaves_files_present_at_the_start(tmp_path):
    before = tmp_path / "someone_elses"
    before.write_bytes(b"x")
    baseline = conftest.snapshot(tmp_path)
    new = tmp_path / "new"
    new.write_bytes(b"y")
    assert set(conftest.created_since(baseline, tmp_path)) == {"new"}
    assert conftest.sweep(conftest.created_since(baseline, tmp_path), tmp_path, settle_s=0.2) == ["new"]
    assert before.exists()


INNER_TESTS = '''
import mmap, os, subprocess, sys
from pathlib import Path

NAME = os.environ["SELFTEST_NAME"]


def test_leaves_unmapped_file():
    Path("/dev/shm", NAME + "_unmapped").write_bytes(b"\\0" * 4096)


def test_leaves_a_live_process_mapping_a_file():
    if os.environ.get("SELFTEST_LEAK_PROCESS") != "1":
        return
    p = Path("/dev/shm", NAME + "_mapped")
    p.write_bytes(b"\\0" * 4096)
    code = ("import mmap, sys, time\\nf = open(sys.argv[1], 'r+b')\\nm = mmap.mmap(f.fileno(), 4096)\\n"
            "print('mapped', flush=True)\\ntime.sleep(float(sys.argv[2]))\\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(p), "60"], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert child.stdout.readline().strip() == "mapped"
    Path(os.environ["SELFTEST_PID_FILE"]).write_text(str(child.pid))
'''


@pytest.mark.parametrize("leak_process", [False, True], ids=["unmapped-removed", "live-process-fails-run"])
def test_session_end_check(tmp_path, leak_process):
    """A whole pytest session with this conftest: a file a test leaves unmapped is removed at
    the end (exit 0); a process the suite started that still maps a file fails the run."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "ds_range_tier.txt").write_text((REPO / "tests" / "ds_range_tier.txt").read_text())  # (it reads)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    name = f"canzona_selftest_{os.getpid()}_{time.time_ns()}"
    pid_file = tmp_path / "pid"
    env = {**os.environ, "SELFTEST_NAME": name, "SELFTEST_LEAK_PROCESS": "1" if leak_process else "0",
           "SELFTEST_PID_FILE": str(pid_file), "CANZONA_SHM_SETTLE_S": "1",
           # the copied conftest imports the test kit, which sits beside canzona_ds at the repository root
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    env.pop(conftest.SESSION_ENV, None)  # the inner session is a session of its own
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        out = r.stdout + r.stderr
        assert not (SHM / f"{name}_unmapped").exists(), out
        if leak_process:
            assert r.returncode == 1, out
            assert "/dev/shm files left by this run" in out and f"{name}_mapped" in out, out
            assert "still mapped by process(es) the suite started" in out, out
        else:
            assert r.returncode == 0, out
            assert "/dev/shm files left" not in out, out
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for suffix in ("_unmapped", "_mapped"):
            (SHM / f"{name}{suffix}").unlink(missing_ok=True)


def test_a_file_mapped_under_another_name_is_live(tmp_path):
    """glibc's sem_open (multiprocessing's ``sem.mp-*``) maps a temporary file and then links it
    to its name, so its mapping reads ``<tmp> (deleted)``: the sweep must see it as mapped (by
    inode), or a session ending beside another removes that one's semaphores under its children."""
    final = tmp_path / "sem.mp-canzona-test"
    code = ("import mmap, os, sys\ntmp, final = sys.argv[1], sys.argv[2]\n"
            "f = open(tmp, 'w+b'); f.write(b'\\0' * 4096); f.flush()\n"
            "m = mmap.mmap(f.fileno(), 4096)\nos.link(tmp, final); os.unlink(tmp)\n"
            "print('mapped', flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "sem.XXXXXX"), str(final)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert conftest.sweep(conftest.created_since(set(), tmp_path), tmp_path, settle_s=0.2) == []
        assert final.exists()
        assert "still mapped" in conftest.session_leaks(set(), tmp_path, settle_s=0.2)[0]
    finally:
        holder.stdin.close()
        holder.wait()
    assert conftest.sweep(conftest.created_since(set(), tmp_path), tmp_path, settle_s=0.2) == [final.name]

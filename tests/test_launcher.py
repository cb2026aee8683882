"""The main job's front door, ``launch/train.sh`` (canzona_ds/cli/launch.py), as a user meets it.

* Pre-launch check: ``--help``, a misspelt optimizer type, a bad run-config key, a checkpoint
  folder in the way, ``--resume`` naming a folder without a checkpoint: each answered in one
  process before any rank starts (DeepSpeed's launch.py never prints), in one line, exit 2 / 4.
* A ``launch/train.sh &`` from a non-interactive shell (SIGINT ignored by the shell for its
  background jobs) still stops on SIGINT: exit 130, no traceback, both ranks say so.
* DeepSpeed's op cache is this environment's, whoever imports canzona_ds (install.sh, the
  launcher, the ranks, the suite).
* A script that imports canzona_ds and uses DeepSpeed's CPU comm leaves no /dev/shm buffer
  after a normal exit, without calling anything.
* DeepSpeed's launch.py, forked from the launcher, starts every rank as the runner's command
  would and returns a failing rank's status.

Cost: 9 launching tests; 28 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import json
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


def train_sh(args: list[str], timeout: float = 120, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this interpreter
    env["PYTHON"] = sys.executable
    env.update(env_extra)
    return subprocess.run(["bash", "launch/train.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def no_rank_started(out: str) -> bool:
    """DeepSpeed's launch.py logs ("launch.py ... WORLD INFO DICT", "process ... spawned") before
    and as it starts the ranks: none of it appears when the check answered first."""
    return "] [launch.py:" not in out and "] [runner.py:" not in out and "canzona_ds.cli.train: rank" not in out


def lines(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]


def test_help_is_printed_once_without_starting_ranks():
    r = train_sh(["--help"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count("usage: canzona_ds.cli.train") == 1 and no_rank_started(out), out[-3000:]
    assert "(default: off)" in out and "NUM_RANKS" in out  # every option says its default; the environment


def ds_with(tmp_path: Path, **optimizer) -> Path:
    ds = json.loads((REPO / "configs/ds_cpu_canzona.json").read_text())
    ds["optimizer"].update(optimizer)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return path


@pytest.mark.parametrize("typo", ["CanzonaMoun", "canzonamuon"])
def test_misspelt_optimizer_type_is_one_line_with_a_suggestion(tmp_path, typo):
    r = train_sh(["--ds-config", str(ds_with(tmp_path, type=typo)), "--set", f"log_dir={tmp_path / 'run'}"])
    out = lines(r)
    assert r.returncode == 2 and len(out) == 1, "\n".join(out)[-3000:]
    assert f"optimizer type {typo!r}" in out[0] and "Did you mean 'CanzonaMuon'?" in out[0]
    assert "CanzonaShampoo, CanzonaSOAP" in out[0] and "adamw" in out[0]  # the valid types are listed
    assert no_rank_started(r.stdout + r.stderr) and not (tmp_path / "run").exists()


def test_bad_keys_are_found_before_ranks_start(tmp_path):
    """A run-config key and a ds_config key DeepSpeed rejects (its own parse, here once)."""
    r = train_sh(["--set", "stepz=2", "--set", f"log_dir={tmp_path / 'run'}"])
    out = lines(r)
    assert r.returncode == 2 and len(out) == 1 and "stepz" in out[0], "\n".join(out)[-3000:]
    ds = json.loads((REPO / "configs/ds_cpu_canzona.json").read_text())
    ds["zero_optimization"]["stagee"] = 1
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(ds))
    r = train_sh(["--ds-config", str(bad), "--set", f"log_dir={tmp_path / 'run'}"])
    out = lines(r)
    assert r.returncode == 2 and len(out) == 1 and "stagee" in out[0] and str(bad) in out[0], "\n".join(out)[-3000:]
    assert no_rank_started(r.stdout + r.stderr)


def test_checkpoint_problems_are_exit_4_before_ranks_start(tmp_path):
    """A checkpoint_dir the job cannot create (a file in the way: binds root too) was found at
    the first save, after training; --resume with a mistyped checkpoint_dir started at step 0."""
    (tmp_path / "file").write_text("")
    r = train_sh(["--set", f"log_dir={tmp_path / 'run'}", "--set", f"checkpoint_dir={tmp_path / 'file' / 'ck'}"])
    out = lines(r)
    assert r.returncode == 4 and len(out) == 1, "\n".join(out)[-3000:]
    assert out[0].startswith("canzona_ds.cli.train: checkpoint error: checkpoint_dir=") and "not a directory" in out[0]
    r = train_sh(["--resume", "--set", f"checkpoint_dir={tmp_path / 'chekpoints'}"])
    out = lines(r)
    assert r.returncode == 4 and len(out) == 1 and "chekpoints" in out[0] and "does not exist" in out[0], out
    assert no_rank_started(r.stdout + r.stderr)


@pytest.mark.dist
def test_sigint_reaches_a_background_job_of_a_script(tmp_path):
    """``launch/train.sh &`` from a non-interactive shell: bash starts it with SIGINT ignored
    (and bash cannot un-ignore it); a SIGINT to it must still stop the ranks, exit 130, with no
    KeyboardInterrupt traceback."""
    log = tmp_path / "run"
    args = ["--set", "steps=500", "--set", "seq_len=64", "--set", "micro_batch=4", "--set", "eval_every=0",
            "--set", "checkpoint_every=0", "--set", f"log_dir={log}", "--no-progress"]
    pidfile = tmp_path / "pid"
    script = f'launch/train.sh {" ".join(args)} & echo $! > {pidfile}; wait $!; echo "train.sh exit $?"'
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), PYTHON=sys.executable,
               MASTER_PORT=str(free_port()))
    shell = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        t0 = time.time()
        while not ((log / "metrics.jsonl").exists() and (log / "metrics.jsonl").read_text().strip()):
            assert shell.poll() is None and time.time() - t0 < 240, "no training step"
            time.sleep(0.5)
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGINT)
        out, _ = shell.communicate(timeout=120)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert "train.sh exit 130" in out, out[-3000:]
    assert out.count("received SIGINT; exiting") == 2 and "Traceback" not in out, out[-3000:]
    steps = (log / "metrics.jsonl").read_text().splitlines()
    assert 1 <= len(steps) < 500


def canzona_ds_cache(cache: str) -> str:
    """``cache`` if it is a per-environment folder under ~/.cache/canzona_ds (XDG_CACHE_HOME wins)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    prefix = os.path.join(root, "canzona_ds", "torch_extensions") + os.sep
    return cache if cache.startswith(prefix) and len(os.path.basename(cache)) == 16 else f"not under {prefix}"


def test_op_cache_is_the_environments():
    """Without TORCH_EXTENSIONS_DIR, importing canzona_ds points torch's JIT builds (DeepSpeed's
    shm op) at this environment's folder, not the ~/.cache/torch_extensions/py3XX_cpu that every
    environment on the machine shares; launch/install.sh builds the op after importing
    canzona_ds, and the launcher (hence every rank) imports it before starting DeepSpeed."""
    code = ("import canzona_ds, os, sys\nfrom torch.utils.cpp_extension import _get_build_directory\n"
            "print(canzona_ds.op_cache_dir())\nprint(_get_build_directory('deepspeed_shm_comm', False))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    cache, build = r.stdout.split()[-2:]
    assert build == os.path.join(cache, "deepspeed_shm_comm")
    if sys.prefix != sys.base_prefix:  # a virtual environment: its own folder (when writable)
        assert cache in (os.path.join(sys.prefix, "var", "cache", "torch_extensions"), canzona_ds_cache(cache))
    else:
        assert cache == canzona_ds_cache(cache), cache
    # a value the user set wins
    env["TORCH_EXTENSIONS_DIR"] = "/tmp/elsewhere"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split()[-1] == "/tmp/elsewhere/deepspeed_shm_comm"
    install = (REPO / "launch/install.sh").read_text()
    assert install.index("import canzona_ds") < install.index("build_shm_op()")


SHM_SCRIPT = """
import os, sys
import canzona_ds  # nothing else from canzona_ds: a user's own script
rank, port = sys.argv[1], sys.argv[2]
os.environ.update(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank, LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=port)
import deepspeed, torch, torch.distributed as dist
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
t = torch.ones(4)
deepspeed.comm.all_reduce(t)
dist.barrier()
print("mapped", sorted(f for f in os.listdir("/dev/shm") if f"_{port}_" in f), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.dist
@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_a_script_that_imported_canzona_ds_leaves_no_shm_buffer(tmp_path):
    port = str(free_port())
    script = tmp_path / "job.py"
    script.write_text(SHM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
        # DeepSpeed's op was in use (it created the buffers) ...
        assert any(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_1" in o for o in outs), outs
        # ... and both are gone after a normal exit
        assert sorted(SHM.glob(f"deepspeed_allreduce_buffer_*_{port}_*")) == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            f.unlink()


def test_launch_command_is_the_runners_local_command():
    """canzona_ds.integration.launcher builds what `deepspeed --num_gpus N --master_port P
    --module M ARGS` runs on one node (DeepSpeed 0.19.8's runner logs it as "cmd = ..."),
    without the runner's own start-up."""
    import base64

    from canzona_ds.integration.launcher import local_launch_command

    cmd = local_launch_command(2, 29710, "canzona_ds.cli.train", ["--config", "x.yaml"])
    assert cmd[:5] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch", "--world_info=eyJsb2NhbGhvc3QiOiBbMCwgMV19"]
    assert json.loads(base64.urlsafe_b64decode(cmd[4].split("=", 1)[1])) == {"localhost": [0, 1]}
    assert cmd[5:] == ["--master_addr=127.0.0.1", "--master_port=29710", "--module", "canzona_ds.cli.train",
                       "--config", "x.yaml"]
    with pytest.raises(ValueError, match="num_ranks=0"):
        local_launch_command(0, 1, "m", [])


PROBE = """import os, sys
with open(os.path.join(os.environ["PROBE_DIR"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(" ".join([os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"], *sys.argv[1:]]))
sys.exit(3 if "fail" in sys.argv and os.environ["RANK"] == "1" else 0)
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_forked_launcher_starts_every_rank_and_returns_their_status(tmp_path, outcome):
    """canzona_ds.integration.launcher.fork_local_launch: DeepSpeed's launch.py, run in a forked
    child (the launcher imported deepspeed already), starts every rank with DeepSpeed's
    environment and the arguments given, and its exit status is the job's (a failing rank's)."""
    (tmp_path / "rank_probe.py").write_text(PROBE)
    port = free_port()
    script = ("import os\nfrom canzona_ds.integration.launcher import fork_local_launch\n"
              f"pid = fork_local_launch(2, {port}, 'rank_probe', ['--x', '{outcome}'])\n"
              "print('status', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK")}
    env.update(PROBE_DIR=str(tmp_path), RANK="7", PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert f"status {3 if outcome == 'fail' else 0}" in r.stdout, r.stdout + r.stderr
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == f"2 {rank} {port} --local_rank={rank} --x {outcome}"

"""The main job in real processes: 2 gloo ranks through DeepSpeed's launcher.

One short CanzonaMuon run (loss falls, metrics and plan summary written, the plan comes from
the optimizer, checkpoints every 6 steps), a resume from its step-6 checkpoint that must
reproduce the uninterrupted steps 7-12 exactly, and a bad config rejected by every rank
before any process group exists.

Cost: 10 launching tests; 2.4 min on a 2-core AMD EPYC (docs/ci.md).
"""
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from canzona_testkit.kernels import assert_bits, test_threads

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.dist

#: small but real: the tiny preset at seq_len 64, 4 windows per rank per micro step
COMMON = ["--set", "seq_len=64", "--set", "micro_batch=4", "--set", "eval_batches=2", "--set", "warmup_steps=2",
          "--no-progress",
          # the ranks' intra-op threads: those of the single-process references in this pytest process
          # (tests/conftest.py), so a reference comparison runs the same kernels on both sides
          "--set", f"threads_per_rank={test_threads()}"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], ranks: int = 2, timeout: int = 240, port: int | None = None) -> subprocess.CompletedProcess:
    # the launcher module of *this* interpreter (the `deepspeed` script on PATH may be another's)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd += ["--num_gpus", str(ranks), "--master_port", str(port or _port()), "--module", "canzona_ds.cli.train",
            "--config", "configs/run_tiny.yaml", *COMMON, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def canzona_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("canzona")
    port = _port()
    r = launch(["--set", "steps=12", "--set", f"log_dir={out}", "--set", f"checkpoint_dir={out}/ckpt",
                "--set", "checkpoint_every=6", "--set", "eval_every=6", "--ds-config", "configs/ds_cpu_canzona.json"], port=port)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    leftover = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) if Path("/dev/shm").is_dir() else []
    return out, r.stdout + r.stderr, leftover


def test_loss_decreases_and_artifacts_written(canzona_run):
    out, log, _ = canzona_run
    m = rows(out / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(1, 13))
    assert m[-1]["loss"] < m[0]["loss"] - 1.0  # bytes: ~5.5 nats at init
    assert m[-1]["val_loss"] is not None and m[-1]["val_loss"] < 5.0
    assert all(r["tokens_per_s"] > 0 for r in m)
    assert all(r[k] is not None for r in m for k in ("fwd_bwd_ms", "grad_reduce_ms", "optimizer_ms", "allgather_ms"))
    assert (out / "metrics.csv").read_text().count("\n") == 13
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer"] == "CanzonaMuon" and summary["steps"] == 12
    for needle in ("partition plan over dp=2", "artifacts:", "metrics_jsonl", "fwd+bwd"):
        assert needle in log


def test_plan_summary_comes_from_the_optimizer(canzona_run):
    out, _, _ = canzona_run
    plan = json.loads((out / "plan_summary.json").read_text())
    assert plan["world_size"] == 2
    assert plan["plan_source"].startswith("plan of the run's optimizer") and plan["rule"] == "muon"
    canzona = plan["layouts"][1]
    assert len(canzona["rank_flops"]) == 2 and all(f > 0 for f in canzona["rank_flops"])
    assert canzona["padding_fraction"] >= 0


def test_resume_continues_the_same_trajectory(canzona_run, tmp_path):
    full, _, _ = canzona_run
    resumed = tmp_path / "resumed"
    # a run interrupted after step 6: only that checkpoint exists
    shutil.copytree(full / "ckpt" / "step6", resumed / "ckpt" / "step6")
    (resumed / "ckpt" / "latest").write_text("step6")
    r = launch(["--set", "steps=12", "--set", f"log_dir={resumed}", "--set", f"checkpoint_dir={resumed}/ckpt",
                "--set", "checkpoint_every=6", "--set", "eval_every=6", "--ds-config", "configs/ds_cpu_canzona.json",
                "--resume"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "at step 6" in r.stdout + r.stderr
    a, b = rows(full / "metrics.jsonl"), rows(resumed / "metrics.jsonl")
    assert [x["step"] for x in b] == [7, 8, 9, 10, 11, 12]
    # fp32 CanzonaMuon restores master weights and momentum exactly: the same losses, bit for bit
    assert [x["loss"] for x in b] == [x["loss"] for x in a[6:]]
    assert_bits(b[-1]["val_loss"], a[-1]["val_loss"])
    # and a different trajectory would be caught: consecutive losses differ by far more
    assert abs(a[6]["loss"] - a[7]["loss"]) > 1e-3


def test_dp_not_dividing_global_batch_fails_on_every_rank():
    r = launch(["--set", "global_batch=12", "--set", "grad_accum=null"], timeout=120)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "global_batch=12 is not divisible by micro_batch * dp = 4 * 2 = 8" in err


def test_compare_mode_runs_all_optimizers_and_tracks_reference(tmp_path):
    r = launch(["--set", "steps=3", "--set", f"log_dir={tmp_path}", "--set", "checkpoint_every=0",
                "--set", "eval_every=0", "--set", "reference_steps=3", "--compare"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "compare" / "compare.json").read_text())
    assert set(report["runs"]) == {"CanzonaMuon", "Muon", "AdamW"} and not report["skipped"]
    for name, run in report["runs"].items():
        assert run["steps"] == 3 and run["mean_step_ms"] > 0, name
    # same seed and data: identical first-step loss for every optimizer (same init, same batch)
    first = {n: rows(tmp_path / "compare" / n / "metrics.jsonl")[0]["loss"] for n in report["runs"]}
    assert len(set(first.values())) == 1
    # CanzonaMuon under ZeRO follows the single-process reference (= torch.optim.Muon + AdamW)
    assert report["reference"]["steps"] == 3
    assert report["reference"]["max_abs_loss_diff"]["CanzonaMuon"] < 1e-4
    out = r.stdout + r.stderr
    assert "single-process reference" in out
    # each run prints what belongs to it: the table says where each optimizer's work is timed
    # (DeepSpeed's Muon: Newton-Schulz inside gradient reduction), AdamW prints no Muon plan,
    # and the artifacts are a list as after a single run
    assert "  Muon: Newton-Schulz runs inside gradient reduction" in out and "  CanzonaMuon: the matrix rule" in out
    assert not any(ln.startswith("[AdamW]") and "FLOPs max/mean" in ln for ln in out.splitlines()), out[-3000:]
    assert "[AdamW] AdamW: element-wise, no matrix partition plan" in out
    assert "\n  compare_json " in out and '"compare_json":' not in out


def test_job_releases_deepspeed_shm_buffers(canzona_run):
    # DeepSpeed's CPU comm op leaves ~69 MB per rank in /dev/shm; the job unlinks its own
    _, _, leftover = canzona_run
    assert leftover == []


def test_resume_with_another_number_of_ranks(canzona_run, tmp_path):
    """A 2-rank run's step-6 checkpoint resumed by 1 rank (same global batch): the plan is
    recomputed for DP=1, every matrix and its state follow, and training continues; with the
    same global batch the single rank sees exactly the two ranks' data, so the losses match
    the uninterrupted 2-rank run to summation order (one rank sums what two ranks averaged)."""
    full, _, _ = canzona_run
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "ckpt" / "step6", resumed / "ckpt" / "step6")
    (resumed / "ckpt" / "latest").write_text("step6")
    r = launch(["--set", "steps=12", "--set", f"log_dir={resumed}", "--set", f"checkpoint_dir={resumed}/ckpt",
                "--set", "checkpoint_every=6", "--set", "eval_every=6", "--set", "global_batch=8",
                "--set", "grad_accum=null", "--ds-config", "configs/ds_cpu_canzona.json", "--resume"], ranks=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "at step 6" in r.stdout + r.stderr
    a, b = rows(full / "metrics.jsonl"), rows(resumed / "metrics.jsonl")
    assert [x["step"] for x in b] == [7, 8, 9, 10, 11, 12]
    for x, y in zip(a[6:], b):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x["step"], x["loss"], y["loss"])


@pytest.mark.parametrize("config,name", [("configs/ds_cpu_shampoo.json", "CanzonaShampoo"),
                                         ("configs/ds_cpu_soap.json", "CanzonaSOAP")])
def test_shipped_shampoo_and_soap_configs_train(config, name, tmp_path):
    """The shipped ds_configs of the other two rules run the main job: loss falls, the plan
    summary names the rule, and each rank's matrices keep their rule's state."""
    r = launch(["--set", "steps=12", "--set", f"log_dir={tmp_path}", "--set", "checkpoint_every=0",
                "--set", "eval_every=0", "--ds-config", config])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = rows(tmp_path / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(1, 13))
    assert not any(math.isnan(x["loss"]) for x in m)
    assert m[-1]["loss"] < m[0]["loss"] - 0.5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["optimizer"] == name


def test_bad_ds_config_key_is_one_line_and_exit_2(tmp_path):
    """A ds_config key DeepSpeed rejects (inside deepspeed.initialize, on every rank): one line
    from rank 0, exit 2 through the launcher, no traceback."""
    ds = json.loads((REPO / "configs/ds_cpu_canzona.json").read_text())
    ds["zero_optimization"]["stagee"] = 1
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(ds))
    r = launch(["--set", "steps=2", "--set", f"log_dir={tmp_path / 'run'}", "--ds-config", str(bad)], timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    lines = [ln for ln in out.splitlines() if "canzona_ds.cli.train:" in ln]
    assert len(lines) == 1 and "config error" in lines[0] and "stagee" in lines[0] and str(bad) in lines[0], out[-3000:]
    assert "Traceback" not in out


def test_runs_get_their_own_folders_and_resume_finds_its_own(tmp_path):
    """Per-run folders under runs_dir with runs/latest; a Shampoo run does not touch the Muon
    run's files; --resume (no log_dir) continues the Muon run although latest is the Shampoo
    one, and with nothing left to train says so and rewrites nothing; resuming that checkpoint
    with another optimizer type is exit 4 and one line."""
    runs = tmp_path / "runs"
    base = ["--set", f"runs_dir={runs}", "--set", "steps=2", "--set", "eval_every=0"]
    r = launch([*base, "--set", "checkpoint_every=2", "--ds-config", "configs/ds_cpu_muon.json"], ranks=1)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (muon,) = sorted(runs.glob("run_tiny-muon-*"))
    assert (muon / "checkpoints" / "step2").is_dir() and (runs / "latest").resolve() == muon.resolve()
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in muon.iterdir() if p.is_file()}
    assert {"metrics.jsonl", "summary.json", "loss.png"} <= set(before)

    r = launch([*base, "--set", "checkpoint_every=0", "--ds-config", "configs/ds_cpu_shampoo.json"], ranks=1)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (shampoo,) = sorted(runs.glob("run_tiny-canzonashampoo-*"))
    assert (runs / "latest").resolve() == shampoo.resolve()

    r = launch([*base, "--ds-config", "configs/ds_cpu_muon.json", "--resume"], ranks=1)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"continuing the newest run_tiny-muon run this run can resume (ZeRO 1, pp=1, 1 rank), {muon}" in out
    assert "nothing to do: the checkpoint step2" in out and "steps=2" in out, out[-3000:]
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in muon.iterdir() if p.is_file()}
    assert after == before  # no artifact rewritten (no empty loss.png)

    r = launch([*base, "--set", f"log_dir={muon}", "--ds-config", "configs/ds_cpu_canzona.json", "--resume"], ranks=1)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-3000:]
    lines = [ln for ln in out.splitlines() if "canzona_ds.cli.train:" in ln]
    assert len(lines) == 1 and "was written by a Muon run; this run uses CanzonaMuon" in lines[0], out[-3000:]
    assert "Traceback" not in out


def test_shipped_zero3_config_trains_and_resumes_exactly(tmp_path):
    """configs/ds_cpu_canzona_zero3.json (ZeRO stage 3, every parameter partitioned, clipping on):
    the main job trains, the plan summary reports the ZeRO-3 hosts, and a resume from the step-4
    checkpoint reproduces steps 5-8 bit for bit (fp32 master pieces and the hosts' rule state)."""
    cfg = "configs/ds_cpu_canzona_zero3.json"
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ["--set", "steps=8", "--set", "checkpoint_every=4", "--set", "eval_every=4", "--ds-config", cfg]
    r = launch([*common, "--set", f"log_dir={full}", "--set", f"checkpoint_dir={full}/ckpt"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a = rows(full / "metrics.jsonl")
    assert [x["step"] for x in a] == list(range(1, 9)) and a[-1]["loss"] < a[0]["loss"] - 0.5
    plan = json.loads((full / "plan_summary.json").read_text())
    hosts = plan["layouts"][-1]
    assert hosts["name"].startswith("canzona zero3") and all(f > 0 for f in hosts["rank_flops"])
    shutil.copytree(full / "ckpt" / "step4", resumed / "ckpt" / "step4")
    (resumed / "ckpt" / "latest").write_text("step4")
    r = launch([*common, "--set", f"log_dir={resumed}", "--set", f"checkpoint_dir={resumed}/ckpt", "--resume"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    b = rows(resumed / "metrics.jsonl")
    assert [x["step"] for x in b] == [5, 6, 7, 8]
    assert [x["loss"] for x in b] == [x["loss"] for x in a[4:]]
    assert abs(a[4]["loss"] - a[5]["loss"]) > 1e-3

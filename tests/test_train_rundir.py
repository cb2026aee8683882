"""Where a run writes (canzona_ds/train/rundir.py): a folder per run unless log_dir is set,
runs/latest pointing at the newest, --resume finding the newest run of the same config and
optimizer that it can resume (its layout), checkpoints under the run's log_dir, a named
folder without a checkpoint refused, unwritable folders found without creating anything."""
import json
import os
from pathlib import Path

import pytest
import torch

from canzona_ds.ckpt.tag import CheckpointError
from canzona_ds.train.config import RunConfig
from canzona_ds.train.rundir import (Layout, check_named_checkpoint, check_writable, point_latest, resolve,
                                     run_prefix, runs_of, saved_layout)

T0 = 1_800_000_000.0  # a fixed clock


def test_each_config_and_optimizer_gets_its_own_folder(tmp_path):
    cfg = RunConfig(runs_dir=str(tmp_path / "runs"))
    muon, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0)
    shampoo, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaShampoo", resume=False, now=T0 + 60)
    assert muon.log_dir != shampoo.log_dir
    assert os.path.basename(muon.log_dir).startswith("run_tiny-canzonamuon-")
    assert os.path.basename(shampoo.log_dir).startswith("run_tiny-canzonashampoo-")
    # checkpoints follow the run's folder: the Shampoo run cannot overwrite the Muon run's
    assert muon.checkpoint_dir == os.path.join(muon.log_dir, "checkpoints")
    assert shampoo.checkpoint_dir == os.path.join(shampoo.log_dir, "checkpoints")
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and latest.resolve() == (tmp_path / shampoo.log_dir).resolve()
    # the same config in the same second: still a folder of its own
    again, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0)
    assert again.log_dir != muon.log_dir and again.log_dir.endswith("-2")
    assert resolve(cfg, None, "AdamW", resume=False, now=T0)[0].log_dir.split(os.sep)[-1].startswith("defaults-adamw-")


def fake_checkpoint(ckpt_dir: str | Path, stage: int = 1, pp: int = 1, world: int = 2,
                    opt_type: str = "CanzonaMuon", tag: str = "step2") -> Path:
    """The files saved_layout reads, as DeepSpeed and canzona_ds.checkpoint write them: the
    manifest's world_size, the ds_config stored in mp_rank_XX_model_states.pt, and under a
    pipeline layer_XX-model_states.pt plus one mp_rank file per stage."""
    path = Path(ckpt_dir) / tag
    path.mkdir(parents=True)
    (path / "canzona_manifest.json").write_text(json.dumps({"world_size": world}))
    ds = {"optimizer": {"type": opt_type}, "zero_optimization": {"stage": stage}}
    for s in range(pp):
        torch.save({"ds_config": ds}, path / f"mp_rank_{s:02d}_model_states.pt")
    if pp > 1:
        (path / "layer_01-model_states.pt").write_bytes(b"")
    (Path(ckpt_dir) / "latest").write_text(tag)
    return path


def test_resume_continues_the_newest_run_of_the_same_config_and_optimizer(tmp_path):
    cfg = RunConfig(runs_dir=str(tmp_path / "runs"))
    old, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0)
    new, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0 + 3600)
    for run in (old, new):
        fake_checkpoint(run.checkpoint_dir)
    other, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaSOAP", resume=False, now=T0 + 7200)  # latest -> SOAP
    resumed, note = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=True, now=T0 + 9000)
    assert resumed.log_dir == new.log_dir and "continuing the newest run_tiny-canzonamuon run" in note, note
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / new.log_dir).resolve()
    assert [p.name for p in runs_of(tmp_path / "runs", run_prefix("configs/run_tiny.yaml", "CanzonaMuon"))] == [
        os.path.basename(old.log_dir), os.path.basename(new.log_dir)]
    # nothing to resume: a new run, and it says so
    fresh, note = resolve(cfg, "configs/run_small.yaml", "CanzonaMuon", resume=True, now=T0)
    assert os.path.basename(fresh.log_dir).startswith("run_small-canzonamuon-") and "no earlier" in note
    assert other.log_dir not in (resumed.log_dir, fresh.log_dir)


def test_explicit_log_dir_wins_and_checkpoints_follow_it(tmp_path):
    cfg = RunConfig(runs_dir=str(tmp_path / "runs"), log_dir=str(tmp_path / "mine"))
    out, note = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=True)
    assert out.log_dir == str(tmp_path / "mine") and out.checkpoint_dir == str(tmp_path / "mine" / "checkpoints")
    assert note is None and not (tmp_path / "runs").exists()
    both = RunConfig(log_dir=str(tmp_path / "a"), checkpoint_dir=str(tmp_path / "ck"))
    assert resolve(both, None, "Muon", resume=False)[0].checkpoint_dir == str(tmp_path / "ck")


def test_latest_is_replaced(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    point_latest(tmp_path, tmp_path / "a")
    point_latest(tmp_path, tmp_path / "b")
    assert os.readlink(tmp_path / "latest") == "b"


def test_resume_passes_over_runs_it_cannot_resume_and_says_why(tmp_path):
    """Newest first: a run without a checkpoint, a ZeRO-3 run, a pp=2 run and (for DeepSpeed's
    Muon) a run on another rank count are passed over, each named with its reason; the newest
    run with a matching layout is continued.  Before, --resume took the newest run whatever
    its layout and walked into a load that refuses (or crashes on) it."""
    runs = tmp_path / "runs"
    cfg = RunConfig(runs_dir=str(runs))

    def run_at(t, **layout):
        made, _ = resolve(cfg, "configs/run_tiny.yaml", "Muon", resume=False, now=T0 + t)
        if layout:
            fake_checkpoint(made.checkpoint_dir, opt_type="Muon", **layout)
        return Path(made.log_dir)

    good = run_at(0, stage=1, pp=1, world=2)
    other_world = run_at(10, stage=1, pp=1, world=4)
    pipe = run_at(20, stage=1, pp=2, world=2)
    zero3 = run_at(30, stage=3, pp=1, world=2)
    empty = run_at(40)
    now = Layout(zero_stage=1, pp=1, world_size=2, canzona=False)
    resumed, note = resolve(cfg, "configs/run_tiny.yaml", "Muon", resume=True, now=T0 + 50, layout=now)
    assert Path(resumed.log_dir) == good, note
    assert "(ZeRO 1, pp=1, 2 ranks)" in note
    assert f"{empty.name} (no checkpoint)" in note
    assert f"{zero3.name} (step2: written at ZeRO stage 3, this run is stage 1)" in note
    assert f"{pipe.name} (step2: written with pp=2, this run has pp=1)" in note
    assert f"{other_world.name} (step2: written on 4 ranks, this run has 2" in note
    # a Canzona type resumes at another rank count (the checkpoint index): the 4-rank run is newest
    for run in (good, other_world):
        for f in (run / "checkpoints" / "step2").glob("mp_rank_*"):
            torch.save({"ds_config": {"optimizer": {"type": "CanzonaMuon"}, "zero_optimization": {"stage": 1}}}, f)
    canzona = Layout(zero_stage=1, pp=1, world_size=2, canzona=True)
    resumed, note = resolve(cfg, "configs/run_tiny.yaml", "Muon", resume=True, now=T0 + 60, layout=canzona)
    assert Path(resumed.log_dir) == other_world, note
    # ... and at another ZeRO stage or pp (the checkpoint index): the newest Canzona run is taken
    for run, stage in ((pipe, 1), (zero3, 3)):
        for f in (run / "checkpoints" / "step2").glob("*model_states.pt"):
            torch.save({"ds_config": {"optimizer": {"type": "CanzonaMuon"}, "zero_optimization": {"stage": stage}}}, f)
    resumed, note = resolve(cfg, "configs/run_tiny.yaml", "Muon", resume=True, now=T0 + 65, layout=canzona)
    assert Path(resumed.log_dir) == zero3, note
    # nothing this run can resume: a new run, and the note lists what was passed over
    stage0 = Layout(zero_stage=0, pp=1, world_size=2)
    fresh, note = resolve(cfg, "configs/run_tiny.yaml", "Muon", resume=True, now=T0 + 70, layout=stage0)
    assert Path(fresh.log_dir) not in (good, other_world, pipe, zero3, empty)
    assert "starting a new run" in note and "this run is stage 0" in note, note


def test_saved_layout_reads_the_checkpoint_resume_would_load(tmp_path):
    assert saved_layout(tmp_path / "none") is None
    fake_checkpoint(tmp_path / "c", stage=3, pp=1, world=4)
    assert saved_layout(tmp_path / "c") == ("step2", Layout(3, 1, 4, True))
    fake_checkpoint(tmp_path / "p", stage=0, pp=2, world=2, opt_type="AdamW")
    assert saved_layout(tmp_path / "p") == ("step2", Layout(0, 2, 2, False))


def test_named_folder_without_a_checkpoint_is_an_error(tmp_path):
    """--resume with a mistyped checkpoint_dir (or log_dir) used to start at step 0, exit 0."""
    typo = RunConfig(checkpoint_dir=str(tmp_path / "chekpoints"), resume=True)
    with pytest.raises(CheckpointError, match=r"chekpoints.*\(from checkpoint_dir\) does not exist"):
        check_named_checkpoint(typo)
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match=r"\(from log_dir\) does not exist"):
        check_named_checkpoint(RunConfig(log_dir=str(tmp_path / "run"), resume=True))
    (tmp_path / "run" / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        check_named_checkpoint(RunConfig(log_dir=str(tmp_path / "run"), resume=True))
    fake_checkpoint(tmp_path / "run" / "checkpoints")
    check_named_checkpoint(RunConfig(log_dir=str(tmp_path / "run"), resume=True))
    check_named_checkpoint(RunConfig(checkpoint_dir=str(tmp_path / "nothing"), resume=False))  # no resume: fine
    check_named_checkpoint(RunConfig(resume=True))  # nothing named: the runs_dir search decides


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: the permission bits do not bind it")
def test_unwritable_folders_are_found_without_creating_anything(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        cfg = RunConfig(log_dir=str(tmp_path / "ok"), checkpoint_dir=str(ro / "a" / "b"))
        ((key, problem),) = check_writable(cfg)
        assert key == "checkpoint_dir" and "is not writable" in problem and str(ro) in problem
        assert not (ro / "a").exists()
    finally:
        ro.chmod(0o755)


def test_a_file_in_the_way_is_found(tmp_path):
    (tmp_path / "f").write_text("")
    cfg = RunConfig(runs_dir=str(tmp_path / "f" / "runs"), checkpoint_dir=str(tmp_path / "ck"))
    ((key, problem),) = check_writable(cfg)
    assert key == "runs_dir" and "is not a directory" in problem
    assert check_writable(RunConfig(runs_dir=str(tmp_path / "new" / "runs"))) == []
    assert check_writable(RunConfig(log_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "f" / "x"),
                                    checkpoint_every=0)) == []  # no checkpoints written: not checked


def test_the_checkpoint_folder_the_run_will_use_is_checked_before_launch(tmp_path, capsys):
    """The pre-launch check (canzona_ds.cli.train.precheck: the launcher's, before any rank
    starts) checks the folder the checkpoints will go to even where the run config does not name
    it: ``<log_dir>/checkpoints`` with a file in the way (binds root too) is one line, exit 4,
    naming the folder and why; before, the first save found it, after the first training steps."""
    from canzona_ds.cli.train import precheck

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    argv = ["--config", "configs/run_tiny.yaml", "--set", f"log_dir={tmp_path / 'run'}"]
    assert precheck(argv, 2) == 4
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert line.startswith("canzona_ds.cli.train: checkpoint error: checkpoint_dir=") and \
        f"{str(tmp_path / 'run' / 'checkpoints')!r} is not a directory (a file)" in line, line
    (tmp_path / "run" / "checkpoints").unlink()
    assert precheck(argv, 2) == 0 and not (tmp_path / "run" / "checkpoints").exists()  # (nothing created)


def test_the_resumed_runs_checkpoint_folder_is_checked_before_launch(tmp_path, capsys):
    """``--resume`` without a log_dir continues an earlier run (resolve, on the ranks): the
    pre-launch check finds the run the ranks will continue and checks its checkpoints/ folder
    (an unwritable one: not under root, whom the permission bits do not bind)."""
    from canzona_ds.cli.train import _resumed_run, check_config, parse_args, precheck

    runs = tmp_path / "runs"
    run, _ = resolve(RunConfig(runs_dir=str(runs)), "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0)
    fake_checkpoint(run.checkpoint_dir)
    args = parse_args(["--config", "configs/run_tiny.yaml", "--resume", "--set", f"runs_dir={runs}"])
    cfg = check_config(args, 2)
    ranks, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=True, now=T0 + 60,
                       layout=Layout(1, 1, 2, True))
    assert _resumed_run(cfg, args, 2) == Path(ranks.log_dir) == Path(run.log_dir)
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the permission bits do not bind it (the run it finds is checked above)")
    os.chmod(run.checkpoint_dir, 0o555)
    try:
        assert precheck(["--config", "configs/run_tiny.yaml", "--resume", "--set", f"runs_dir={runs}"], 2) == 4
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert f"checkpoint_dir={run.checkpoint_dir!r} is not writable" in line, line
    finally:
        os.chmod(run.checkpoint_dir, 0o755)

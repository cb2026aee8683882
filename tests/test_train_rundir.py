"""Where a run writes (canzona_ds/train/rundir.py): a folder per run unless log_dir is set,
runs/latest pointing at the newest, --resume finding the newest run of the same config and
optimizer, checkpoints under the run's log_dir."""
import os

from canzona_ds.train.config import RunConfig
from canzona_ds.train.rundir import point_latest, resolve, run_prefix, runs_of

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


def test_resume_continues_the_newest_run_of_the_same_config_and_optimizer(tmp_path):
    cfg = RunConfig(runs_dir=str(tmp_path / "runs"))
    old, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0)
    new, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=False, now=T0 + 3600)
    other, _ = resolve(cfg, "configs/run_tiny.yaml", "CanzonaSOAP", resume=False, now=T0 + 7200)  # latest -> SOAP
    resumed, note = resolve(cfg, "configs/run_tiny.yaml", "CanzonaMuon", resume=True, now=T0 + 9000)
    assert resumed.log_dir == new.log_dir and "continuing the newest run_tiny-canzonamuon run" in note
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

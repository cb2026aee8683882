"""Run-config validation: unknown keys, wrong types, a batch the DP size cannot split.

Cost: 6 launching tests; 9 s on a 2-core AMD EPYC (docs/ci.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canzona_ds.train.config import RunConfig, load_run_config, parse_override
from canzona_ds.train.schedule import lr_multiplier
from canzona_ds.train.trainer import build_ds_config
from canzona_testkit.kernels import assert_bits

REPO = Path(__file__).resolve().parents[1]


def test_shipped_run_configs_load():
    cfg = load_run_config(REPO / "configs/run_tiny.yaml")
    assert cfg.model == "tiny" and cfg.ds_config == "configs/ds_cpu_canzona.json"
    assert cfg.batch_layout(2) == (1, 16)
    assert cfg == RunConfig()  # the dataclass defaults are the tiny run
    for path in sorted((REPO / "configs").glob("run_*.yaml")):
        c = load_run_config(path)
        assert (REPO / c.ds_config).is_file() and all((REPO / p).is_file() for p in c.compare_ds_configs)


@pytest.mark.parametrize("override, exc, words", [
    ({"stepz": 10}, ValueError, ["stepz", "Allowed", "steps"]),
    ({"steps": "10"}, TypeError, ["steps", "'10'", "int"]),
    ({"resume": 1}, TypeError, ["resume", "bool"]),
    ({"micro_batch": 2.5}, TypeError, ["micro_batch", "int"]),
    ({"model": "gigantic"}, ValueError, ["gigantic", "tiny"]),
    ({"model_overrides": {"layers": 2}}, ValueError, ["layers", "num_layers"]),
    ({"lr_schedule": "step"}, ValueError, ["lr_schedule", "cosine"]),
    ({"seq_len": 100000}, ValueError, ["seq_len", "max_seq_len"]),
    ({"steps": 0}, ValueError, ["steps", ">= 1"]),
])
def test_bad_values_name_the_key(override, exc, words):
    with pytest.raises(exc) as e:
        load_run_config(None, override)
    for w in words:
        assert w in str(e.value)


def test_global_batch_must_split_over_dp():
    cfg = load_run_config(None, {"micro_batch": 4, "grad_accum": None, "global_batch": 24})
    assert cfg.batch_layout(2) == (3, 24)
    with pytest.raises(ValueError, match=r"global_batch=24 is not divisible by micro_batch \* dp = 4 \* 4 = 16"):
        cfg.batch_layout(4)
    cfg = load_run_config(None, {"micro_batch": 4, "grad_accum": 2, "global_batch": 24})
    with pytest.raises(ValueError, match="grad_accum=2 contradicts"):
        cfg.batch_layout(2)


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(TypeError, match="mapping"):
        load_run_config(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml")
    assert parse_override("steps=20") == ("steps", 20)
    with pytest.raises(ValueError, match="key=value"):
        parse_override("steps")


def test_ds_config_batch_keys_belong_to_run_config(tmp_path):
    cfg = RunConfig()
    ds = build_ds_config(cfg, REPO / "configs/ds_cpu_muon.json", dp=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (8, 1, 16)
    clash = tmp_path / "ds.json"
    clash.write_text('{"optimizer": {"type": "Muon"}, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4"):
        build_ds_config(cfg, clash, dp=2)
    (tmp_path / "noopt.json").write_text("{}")
    with pytest.raises(ValueError, match="optimizer"):
        build_ds_config(cfg, tmp_path / "noopt.json", dp=2)


def test_lr_schedule():
    assert lr_multiplier(0, 100, "cosine", 10, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(10, 100, "cosine", 10, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(99, 100, "cosine", 10, 0.1) == pytest.approx(0.1, abs=1e-3)
    assert lr_multiplier(55, 100, "linear", 10, 0.0) == pytest.approx(0.5)
    assert_bits(lr_multiplier(50, 100, "constant", 0, 0.0), 1.0)


def _cli(args, world_size=1, timeout=120):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": str(world_size)}
    return subprocess.run([sys.executable, "-m", "canzona_ds.cli.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, world, words", [
    (["--set", "stepz=3"], 1, ["Unknown run config key", "stepz"]),
    (["--set", "steps=ten"], 1, ["steps='ten'", "int"]),
    (["--set", "global_batch=24", "--set", "grad_accum=null"], 2, ["global_batch=24", "not divisible", "8 * 2 = 16"]),
    (["--ds-config", "configs/nope.json"], 1, ["nope.json", "does not exist"]),
])
def test_cli_rejects_bad_config_with_exit_2(args, world, words):
    r = _cli(["--config", "configs/run_tiny.yaml", *args], world_size=world)
    assert r.returncode == 2, r.stderr
    assert "config error" in r.stderr
    for w in words:
        assert w in r.stderr


def test_unknown_key_names_where_it_came_from(tmp_path):
    with pytest.raises(ValueError) as e:
        load_run_config(REPO / "configs/run_tiny.yaml", {"stepz": 10}, overrides_from="the --set override(s)")
    assert "['stepz'] in the --set override(s)" in str(e.value) and "run_tiny.yaml" not in str(e.value)
    bad = tmp_path / "run.yaml"
    bad.write_text("stepz: 10\n")
    with pytest.raises(ValueError, match=r"\['stepz'\] in .*run.yaml"):
        load_run_config(bad, {"steps": 3}, overrides_from="the --set override(s)")


def test_cli_names_the_set_override_as_the_source():
    r = _cli(["--config", "configs/run_tiny.yaml", "--set", "stepz=10"])
    assert r.returncode == 2, r.stderr
    assert "Unknown run config key(s) ['stepz'] in the --set override(s)" in r.stderr
    assert "in configs/run_tiny.yaml" not in r.stderr


def test_bad_optimizer_key_is_one_line_from_rank_0_before_any_process_group(tmp_path):
    ds = json.loads((REPO / "configs/ds_cpu_canzona.json").read_text())
    ds["optimizer"]["params"]["lrr"] = 0.1
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(ds))
    r = _cli(["--config", "configs/run_tiny.yaml", "--ds-config", str(bad)], world_size=2)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "canzona_ds.cli.train" in ln or "Traceback" in ln]
    assert len(lines) == 1 and "config error" in lines[0] and "lrr" in lines[0], r.stderr
    # another rank: the same status, quietly
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    r1 = subprocess.run([sys.executable, "-m", "canzona_ds.cli.train", "--config", "configs/run_tiny.yaml",
                         "--ds-config", str(bad)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r1.returncode == 2 and "canzona_ds.cli.train" not in r1.stderr + r1.stdout, r1.stderr

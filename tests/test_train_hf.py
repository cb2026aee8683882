"""HF Trainer example on 2 gloo ranks (runs only where transformers + accelerate are
installed: ``pip install transformers accelerate``, ~25 s; see docs/main_job.md)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ds_config,zero_class", [("configs/ds_cpu_canzona.json", "CanzonaZeroOptimizer"),
                                                   ("configs/ds_cpu_canzona_zero3.json", "CanzonaZero3Optimizer")])
def test_hf_trainer_with_canzona_muon(tmp_path, ds_config, zero_class):
    """ZeRO-1, and ZeRO-3 (HF Trainer with a stage-3 ds_config: parameters partitioned, clipping on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                        str(port), "--module", "canzona_ds.train.hf_trainer", "--steps", "6", "--seq-len", "64",
                        "--micro-batch", "4", "--out", str(tmp_path), "--ds-config", ds_config],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"DeepSpeed optimizer: {zero_class};" in r.stdout + r.stderr
    losses = [h["loss"] for h in json.loads((tmp_path / "log_history.json").read_text()) if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0

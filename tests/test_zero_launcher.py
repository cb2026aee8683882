"""The `deepspeed` launcher path: a script that only adds `import canzona_ds` trains with
"type": "CanzonaMuon" (and "CanzonaSOAP") on 2 CPU ranks and matches the single-process
reference bit for bit.

Cost: 2 launching tests; 21 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import json
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from canzona_testkit.dist import free_port
from canzona_testkit.models import run_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
import torch
from canzona_testkit.kernels import test_threads
torch.set_num_threads(test_threads())
import canzona_ds  # the one line a user adds
import deepspeed
from canzona_testkit.models import ds_config, make_model, batches, params_of
deepspeed.init_distributed(dist_backend="gloo")
rank, dp = torch.distributed.get_rank(), torch.distributed.get_world_size()
model = make_model(0)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(dp, optimizer={opt_type!r}))
for x, y in batches(3, 2 * dp):
    loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    engine.backward(loss)
    engine.step()
if rank == 0:
    json.dump({{k: v.tolist() for k, v in params_of(engine.module).items()}}, open({out!r}, "w"))
# gloo's worker threads can abort the interpreter's exit ("terminate called without an active
# exception", exit 250) unless the process group is destroyed first, whatever the optimizer
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="deepspeed launcher not on PATH")
@pytest.mark.parametrize("opt_type", ["CanzonaMuon", "CanzonaSOAP"])
def test_deepspeed_launcher_two_ranks(tmp_path, opt_type):
    out = tmp_path / "params.json"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(out=str(out), opt_type=opt_type))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(script)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {k: np.asarray(v, dtype=np.float32) for k, v in json.loads(out.read_text()).items()}
    ref = run_reference(2, 3, opt_type)
    for n in ref:
        np.testing.assert_array_equal(got[n], ref[n], err_msg=n)

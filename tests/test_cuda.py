"""The single-GPU tier: runs where one CUDA GPU is present, skipped (with the reason) elsewhere.

* every rule's optimizer step on GPU tensors equals the single-process reference on the same
  GPU bit for bit, and every state tensor lives on the GPU;
* the TP micro-group runtime's math on CUDA tensors (2 ranks sharing the GPU through gloo,
  which stages CUDA tensors for its collectives; NCCL needs one GPU per rank, which the
  multi-GPU variants of the multi-rank tests use: ``device_params``);
* DeepSpeed ZeRO-1 with CanzonaMuon in bf16 through the ``deepspeed`` launcher at DP=1
  (``configs/ds_gpu_bf16.json``, the main job): trains, loss falls, finite.

Multi-rank NCCL runs need several GPUs: with one GPU they are skipped (the README says
which of these ran where).

Cost: nothing without a GPU (every test skips before a process starts); on a GPU, NCCL rank runs
(docs/ci.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from canzona_ds.config import CanzonaConfig
from canzona_ds.optimizer import CanzonaOptimizer
from canzona_ds.reference import ReferenceOptimizer
from canzona_testkit.dist import cuda_count, run_distributed
from canzona_testkit.models import HP, TYPES, batches, make_model

GPUS = cuda_count()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU; this machine has {GPUS}")]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("opt_type", TYPES)
def test_optimizer_matches_reference_on_the_gpu(opt_type):
    cfg = CanzonaConfig.from_ds(opt_type, HP[opt_type])
    models = [make_model(0).cuda(), make_model(0).cuda()]
    opts = [CanzonaOptimizer(models[0].named_parameters(), cfg), ReferenceOptimizer(models[1].named_parameters(), cfg)]
    for x, y in batches(4, 4):
        for m, o in zip(models, opts):
            m.zero_grad(set_to_none=True)
            m(x.cuda(), y.cuda()).backward()
            o.step()
    for (n, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    for st in opts[0].matrix_state.values():
        assert all(t.is_cuda for t in st.values() if isinstance(t, torch.Tensor))


SHAPES = {"col": ((64, 32), 0), "row": ((32, 48), 1)}


def _tp_on_gpu(rank, tp, opt_type):
    from canzona_ds.config import TPConfig
    from canzona_ds.tp.runtime import MicroGroupRuntime, TPMatrix

    rule = CanzonaConfig.from_ds(opt_type, HP[opt_type]).rule
    mats = [TPMatrix(n, shape, dim, (shape[dim] // tp,) * tp) for n, (shape, dim) in SHAPES.items()]
    runtime = MicroGroupRuntime(mats, rule, None, TPConfig())
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(shape, generator=g) for n, (shape, _) in SHAPES.items()}
    params = [full[m.name].chunk(tp, dim=m.partition_dim)[rank].clone().cuda() for m in mats]
    grads_all = []
    for step in range(1, 4):
        grads = {n: torch.randn(shape, generator=g) for n, (shape, _) in SHAPES.items()}
        grads_all.append(grads)
        runtime.step(params, [grads[m.name].chunk(tp, dim=m.partition_dim)[rank].cuda() for m in mats], lr=0.05,
                     weight_decay=0.1, step=step)
    assert all(t.is_cuda for st in runtime.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    return {m.name: p.cpu().numpy() for m, p in zip(mats, params)}


@pytest.mark.parametrize("opt_type", TYPES)
def test_tp_runtime_math_on_cuda_tensors(opt_type):
    from canzona_ds.optim.rule import MatrixInfo, apply_update

    res = run_distributed(_tp_on_gpu, 2, opt_type)
    rule = CanzonaConfig.from_ds(opt_type, HP[opt_type]).rule
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(shape, generator=g).cuda() for n, (shape, _) in SHAPES.items()}
    states = {n: rule.init_state(MatrixInfo(n, shape), like=params[n]) for n, (shape, _) in SHAPES.items()}
    for step in range(1, 4):
        grads = {n: torch.randn(shape, generator=g).cuda() for n, (shape, _) in SHAPES.items()}
        for n, (shape, _) in SHAPES.items():
            info = MatrixInfo(n, shape)
            apply_update(params[n], rule.direction(grads[n], states[n], info, step), *rule.scales(0.05, 0.1, info, step))
    for n, (_, dim) in SHAPES.items():
        np.testing.assert_array_equal(np.concatenate([res[r][n] for r in range(2)], axis=dim),
                                      params[n].cpu().numpy(), err_msg=n)


def test_zero1_bf16_main_job_through_the_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--module", "canzona_ds.cli.train",
           "--config", "configs/run_tiny.yaml", "--ds-config", "configs/ds_gpu_bf16.json", "--set", "steps=30",
           "--set", f"log_dir={tmp_path}", "--set", "checkpoint_every=0", "--no-progress"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 30 and all(np.isfinite(row["loss"]) for row in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0

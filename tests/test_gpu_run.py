"""benchmarks/gpu/run.py, the prepared one-GPU run, in its --dry-run (CPU, tiny sizes, gloo,
the same code path: every section, the DeepSpeed launcher included), so the device run does not
die on a typo, a missing file or a wrong flag; and the measured-time cost model
(planning/time_model.py) it fits.

Cost: 2 launching tests; 25 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from canzona_ds.optim.muon import MuonRule
from canzona_ds.planning.time_model import TimeCostModel, fit_results, fit_time, load_time_model

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("cuda_tier", "matmul_peak", "newton_schulz", "plan_time", "main_job")


@lru_cache(maxsize=None)
def _dry_run(tmp: str = "") -> dict:
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="canzona_gpu_dry_")) / "gpu_results.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu/run.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    out.unlink()
    out.parent.rmdir()
    return res


def test_dry_run_every_section_ok():
    res = _dry_run()
    assert res["ok"] and res["environment"]["dry_run"] and res["install"]["deepspeed"] == "0.19.8"
    for name in SECTIONS:
        assert res[name]["ok"], res[name].get("error")
    tier = res["cuda_tier"]
    assert tier["rc"] == 0 and tier["counts"].get("skipped", 0) >= 7 and not tier["failures"]  # no GPU here


def test_dry_run_newton_schulz_covers_every_shape_and_mode():
    from canzona_ds.planning.models import matrix_specs, model_specs

    rows = _dry_run()["newton_schulz"]["rows"]
    for model in ("qwen3-8b", "qwen3-32b"):
        for tp in (1, 8):
            shapes = {tuple(s.matrix_shape) for s in matrix_specs(model_specs(model, tp=tp))}
            for method in ("standard", "gram"):
                got = {tuple(r["shape"]) for r in rows if (r["model"], r["tp"], r["method"]) == (model, tp, method)}
                assert got == shapes, (model, tp, method)
    for r in rows:
        assert r["one_ms"] > 0 and r["batched_ms"] > 0 and 0 < r["one_of_peak"] and r["flops"] == \
            MuonRule(ns_method=r["method"]).flops(tuple(r["run_shape"])).amortised


def test_dry_run_plan_time_and_main_job():
    res = _dry_run()
    plan = res["plan_time"]
    assert (plan["model"], plan["dp"]) == ("qwen3-32b", 32) and plan["fit"]["rows"] > 0
    for label in ("default (flops)", "fitted time"):
        assert plan[label]["busiest_over_mean"] >= 1.0 - 1e-9
    job = res["main_job"]
    assert (job["backend"], job["zero_stage"], job["dp"], job["dtype"]) == ("gloo", 1, 1, "bf16")
    assert set(job["kinds"]) == {"canzona", "ds_muon", "adamw"}
    for k in job["kinds"].values():
        assert k["tokens_per_s"] > 0 and 0 < k["optimizer_step_ms"] < k["iteration_ms"]
    # the fitting code runs on the results file the device run writes
    fit = fit_results(res)
    assert fit.rows == len({(r["model"], r["tp"], tuple(r["shape"])) for r in res["newton_schulz"]["rows"]})


def test_device_run_refuses_a_machine_without_cuda():
    """The real run checks its needs first and names what is missing (here: no CUDA GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "benchmarks/gpu/run.py", "--out", "/dev/null"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "sees no CUDA GPU" in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------- the time model
def test_fit_recovers_a_known_time_law():
    """Rows made from t = c0 + c1 F + c2 E come back with those coefficients and ~0 error."""
    rule = MuonRule()
    shapes = [(128, 128), (256, 1024), (1024, 4096), (4096, 4096), (5120, 25600), (512, 512)]
    c0, c1, c2 = 2e-5, 1.5e-15, 3e-11
    rows = [{"flops": (f := rule.flops(s).amortised), "elements": s[0] * s[1], "seconds": c0 + c1 * f + c2 * s[0] * s[1]}
            for s in shapes]
    fit = fit_time(rows)
    assert fit.max_rel_error < 1e-9
    assert fit.c0 == pytest.approx(c0, rel=1e-6) and fit.c1_per_flop == pytest.approx(c1, rel=1e-6)
    assert fit.c2_per_element == pytest.approx(c2, rel=1e-6)
    with pytest.raises(ValueError, match="seconds"):
        fit_time([{"flops": 1.0, "elements": 1.0, "seconds": 0.0}])


def test_time_cost_model_balances_time_where_flops_do_not():
    """Many small matrices carry a fixed per-matrix time FLOPs do not see: with 3 large matrices
    on 4 ranks the FLOPs plan puts all 60 small ones on the fourth rank (their FLOPs are far
    below one large matrix's); the time model's plan spreads them (busiest/mean in TIME)."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import _plan
    from canzona_ds.planning.params import specs_from_named_shapes

    rule = MuonRule()
    named = [(f"big{i}.weight", (512, 2048)) for i in range(3)] + [(f"small{i}.weight", (16, 64)) for i in range(60)]
    specs = specs_from_named_shapes(named)
    fit = fit_time([{"flops": rule.flops(s).amortised, "elements": s[0] * s[1],
                     "seconds": 1e-3 + 1e-13 * rule.flops(s).amortised} for s in ((512, 2048), (16, 64), (64, 256))])
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {})
    seconds = [fit.seconds(rule.flops(s.matrix_shape).amortised, s.numel) for s in specs]

    def ratio(model) -> float:
        loads = [sum(seconds[i] for i in idx) for idx in _plan(specs, 4, cfg, model).rank_params]
        return max(loads) / (sum(loads) / len(loads))

    flops_ratio, time_ratio = ratio(rule), ratio(TimeCostModel(rule, fit))
    # measured 3.60 (flops) and 1.26 (time: the default multi_lpt plan also keeps ZeRO's padding
    # small, so it does not reach the 1.0 a free LPT would)
    assert flops_ratio > 3.0 and time_ratio < 1.3, (flops_ratio, time_ratio)


def test_no_gpu_time_model_is_shipped_yet():
    with pytest.raises(FileNotFoundError, match="none yet"):
        load_time_model("NVIDIA H100 80GB HBM3", MuonRule())

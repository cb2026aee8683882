"""The one GPU run: everything canzona-ds measures on a one-GPU machine, into one results file.

    # on the device (torch 2.11+ with CUDA, Triton, numpy; no DeepSpeed): from the repo root
    python benchmarks/gpu/run.py --out "$OUT/gpu_results.json"
    # here, on CPU, the same code path at tiny sizes over gloo (tests/test_gpu_run.py runs it)
    python benchmarks/gpu/run.py --dry-run --out /tmp/gpu_dry.json

Before anything it checks what it needs (and stops, naming the problem, if it is missing):
Python >= 3.10; torch >= 2.11 built with CUDA and a visible GPU (dry run: any torch); Triton
and numpy; DeepSpeed 0.19.8 -- if absent it is installed from the carried wheels
(``benchmarks/gpu/wheels``, built here by ``benchmarks/gpu/build_wheels.sh``) with
``pip install --no-index --find-links``; pyyaml, tqdm and pytest likewise.  Then, each section timed
and recorded on its own (a failing section records its traceback; the others still run), the
results file rewritten after every section so a timeout keeps what finished:

  environment     card name, memory, capability, torch / CUDA / DeepSpeed / Python versions
  cuda_tier       ``pytest -m cuda tests/test_cuda.py``: passed / failed / skipped, and the
                  failures' names
  matmul_peak     bf16 n x n x n matrix product (n = 8192; dry run 256), median TFLOP/s: the
                  peak every Newton-Schulz fraction below is measured against, in the same run
  newton_schulz   MuonRule's Newton-Schulz (bf16, 5 steps) on every distinct matrix shape of
                  Qwen3-8B and Qwen3-32B (planning/models.py, the shapes of
                  ../shared/reference/model_shapes.yaml), whole and as TP=8 shards, ns_method
                  standard and gram, one matrix at a time and batched by shape (k = min(count,
                  8; dry run 2) matrices): ms per matrix, TFLOP/s (the rule's FLOP count / time), fraction
                  of matmul_peak, and whether the batch is bit-identical per matrix on this
                  device (MuonRule.batch_is_exact).  Dry run: every dimension / 128 (at least
                  8), ns_dtype "auto" (fp32 where this CPU's bf16 products are slow)
  plan_time       Qwen3-32B at DP=32 (TP=1), ZeRO-1 ownership: each rank's MEASURED-time load
                  (sum of its matrices' one-at-a-time standard times from newton_schulz), busiest
                  / mean, under the default plan (cost "flops") and under a plan made with a cost
                  model fitted to those times (planning/time_model.py), with the fit's error
  main_job        ``deepspeed --num_gpus 1 benchmarks/gpu/main_job.py``: NCCL (dry run gloo),
                  ZeRO-1, DP=1, bf16, a Qwen3-shaped model; CanzonaMuon, DeepSpeed's "Muon" and
                  "AdamW" interleaved in one process: tokens/s, median iteration ms, median
                  optimizer-step (engine.step) ms, peak GPU memory
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WHEELS = HERE / "wheels"
NEEDS = {"python": (3, 10), "torch": (2, 11), "deepspeed": "0.19.8"}
#: the pure-Python packages installed from the carried wheels when missing (module -> requirement)
CARRIED = {"deepspeed": "deepspeed==0.19.8", "yaml": "pyyaml", "tqdm": "tqdm", "pytest": "pytest"}
MODELS = ("qwen3-8b", "qwen3-32b")
TP = 8
BATCH_CAP = 8
DRY_SCALE = 128
PLAN_MODEL, PLAN_DP = "qwen3-32b", 32


class Problem(RuntimeError):
    """Something the run needs is missing or wrong: the message says what and how to fix it."""


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:2])


# ------------------------------------------------------------------------------ checks and install
def check_environment(dry: bool) -> dict:
    """What the run needs, checked before anything is measured; returns the versions."""
    if sys.version_info[:2] < NEEDS["python"]:
        raise Problem(f"Python {platform.python_version()} is too old: needs >= 3.10.")
    import numpy  # noqa: F401 - raises if absent
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "numpy": numpy.__version__, "dry_run": dry}
    if not dry:
        if _version_tuple(torch.__version__) < NEEDS["torch"]:
            raise Problem(f"torch {torch.__version__} is too old: needs >= 2.11.")
        if torch.version.cuda is None or not torch.cuda.is_available():
            raise Problem(f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda={torch.version.cuda}).")
        import triton

        env["triton"] = triton.__version__
        env["device_name"] = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        env["device_memory_gib"] = round(props.total_memory / 2 ** 30, 1)
        env["capability"] = list(torch.cuda.get_device_capability(0))
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()}, dry run)"
    for f in ("tests/test_cuda.py", "benchmarks/gpu/main_job.py", "canzona_ds/planning/time_model.py"):
        if not (ROOT / f).is_file():
            raise Problem(f"{f} is missing: run from a full checkout of the repository.")
    return env


def install_carried(dry: bool) -> dict:
    """Install every CARRIED package that does not import, from the carried wheels only."""
    missing = []
    for module, req in CARRIED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(req)
    done = {"missing_before": missing}
    if missing:
        if dry:
            raise Problem(f"dry run: {missing} not installed here (the dry run installs nothing)")
        if not WHEELS.is_dir() or not any(WHEELS.glob("*.whl")):
            raise Problem(f"{missing} are not installed and {WHEELS} holds no wheels: build them with "
                          "benchmarks/gpu/build_wheels.sh and carry benchmarks/gpu/wheels.")
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS), *missing]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        done["pip"] = {"cmd": " ".join(cmd), "rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-2000:]}
        if proc.returncode:
            raise Problem(f"pip install from the carried wheels failed:\n{done['pip']['tail']}")
        importlib.invalidate_caches()
    import deepspeed

    if deepspeed.__version__ != NEEDS["deepspeed"]:
        raise Problem(f"DeepSpeed {deepspeed.__version__} is installed; canzona-ds pins {NEEDS['deepspeed']}.")
    done["deepspeed"] = deepspeed.__version__
    return done


# ------------------------------------------------------------------------------ sections
def section_cuda_tier(dry: bool) -> dict:
    t = time.perf_counter()
    # (not an enclosing pytest-xdist worker's variables: pytest-benchmark reads them and warns)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"PYTHONPATH": str(ROOT)}
    # one process: not setup.cfg's pytest-xdist workers (the device machine carries no xdist, and
    # the tier's NCCL runs want every GPU to themselves)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:xdist", "-m", "cuda", "-q",
                           "-rfEs", "-p", "no:cacheprovider", "tests/test_cuda.py"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    summary = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in ", ln)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", summary[-1] if summary else "")}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return {"rc": proc.returncode, "counts": counts, "failures": failures, "summary": summary[-1:],
            "seconds": time.perf_counter() - t, "tail": out[-3000:] if proc.returncode else ""}


def _device(dry: bool):
    import torch

    return torch.device("cpu") if dry else torch.device("cuda", 0)


def _timed(fn, device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def section_matmul_peak(dry: bool) -> dict:
    import torch

    device = _device(dry)
    n = 256 if dry else 8192
    A = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    B = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    s = _timed(lambda: A @ B, device, 3 if dry else 20)
    return {"n": n, "dtype": "bf16", "seconds": s, "tflops": 2 * n ** 3 / s / 1e12}


def ns_shapes(dry: bool) -> list[dict]:
    """Every distinct matrix shape of MODELS, whole and as TP shards, with its count in the model."""
    from canzona_ds.planning.models import matrix_specs, model_specs

    out = []
    for model in MODELS:
        for tp in (1, TP):
            counts: dict[tuple[int, int], int] = {}
            for s in matrix_specs(model_specs(model, tp=tp)):
                shape = tuple(s.matrix_shape)
                counts[shape] = counts.get(shape, 0) + s.matrix_count
            for shape, count in sorted(counts.items()):
                run_shape = tuple(max(8, d // DRY_SCALE) for d in shape) if dry else shape
                out.append({"model": model, "tp": tp, "shape": list(shape), "run_shape": list(run_shape),
                            "count": count})
    return out


def section_newton_schulz(dry: bool, peak_tflops: float | None) -> dict:
    import torch

    from canzona_ds.optim.muon import MuonRule

    device = _device(dry)
    reps = 1 if dry else 5
    # the dry run checks the code path, not bf16 speed: on CPUs without bf16 kernels "auto" runs fp32
    ns_dtype = "auto" if dry else "bf16"
    rows = []
    for entry in ns_shapes(dry):
        m, n = entry["run_shape"]
        k = min(entry["count"], 2 if dry else BATCH_CAP)
        G = torch.randn(k, m, n, device=device, dtype=torch.float32)
        for method in ("standard", "gram"):
            rule = MuonRule(ns_method=method, ns_dtype=ns_dtype)
            flops = rule.flops((m, n)).amortised
            one = _timed(lambda: rule.orthogonalise(G[0]), device, reps)
            batched = _timed(lambda: rule.orthogonalise(G), device, reps) / k
            row = dict(entry, method=method, batch=k, flops=flops, elements=m * n, one_ms=1e3 * one,
                       batched_ms=1e3 * batched, one_tflops=flops / one / 1e12, batched_tflops=flops / batched / 1e12,
                       batch_bit_identical=bool(rule.batch_is_exact(k, (m, n), G.dtype, device)) if k > 1 else None)
            if peak_tflops:
                row["one_of_peak"] = row["one_tflops"] / peak_tflops
                row["batched_of_peak"] = row["batched_tflops"] / peak_tflops
            rows.append(row)
        del G
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "peak_tflops": peak_tflops, "ns_dtype": ns_dtype, "ns_steps": 5, "batch_cap": BATCH_CAP}


def section_plan_time(dry: bool, ns: dict, source: str) -> dict:
    """Busiest / mean MEASURED-time load at Qwen3-32B DP=32 under the default plan and under a
    plan balancing a cost model fitted to the measured times."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import _plan
    from canzona_ds.planning.models import matrix_specs, model_specs
    from canzona_ds.planning.time_model import TimeCostModel, fit_results

    fit = fit_results({"newton_schulz": dict(ns, ok=True), "environment": {"device_name": source}}, "standard", "one")
    measured = {(r["model"], r["tp"], tuple(r["shape"])): r["one_ms"] for r in ns["rows"] if r["method"] == "standard"}
    specs = matrix_specs(model_specs(PLAN_MODEL, tp=1))
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {})
    # what a matrix costs in this run: its shape's measured time (dry run: the scaled shape's)
    t_of = [measured[(PLAN_MODEL, 1, tuple(s.matrix_shape))] * s.matrix_count for s in specs]
    out = {"model": PLAN_MODEL, "dp": PLAN_DP, "tp": 1, "fit": fit.__dict__}
    models = {"default (flops)": cfg.rule, "fitted time": TimeCostModel(cfg.rule, fit)}
    if dry:  # the measured shapes are scaled: the fitted model predicts the run's (scaled) times
        scaled = {tuple(r["shape"]): tuple(r["run_shape"]) for r in ns["rows"]}

        class Scaled:  # the rule's FLOPs of the shape this run measured for each real shape
            name = cfg.rule.name

            def __init__(self, base):
                self.base = base

            def flops(self, shape, num_heads=None):
                return self.base.flops(scaled.get(tuple(shape), tuple(shape)), num_heads)

            def state_bytes(self, shape, num_heads=None):
                return self.base.state_bytes(shape, num_heads)

        models = {k: Scaled(v) for k, v in models.items()}
    for label, model in models.items():
        plan = _plan(specs, PLAN_DP, cfg, model)
        loads = [sum(t_of[i] for i in idx) for idx in plan.rank_params]
        mean = sum(loads) / len(loads)
        out[label] = {"busiest_ms": max(loads), "mean_ms": mean, "busiest_over_mean": max(loads) / mean,
                      "layout": plan.extra.get("layout_choice", ""), "planner": plan.planner}
    return out


def section_main_job(dry: bool, out_path: Path) -> dict:
    from canzona_testkit.dist import free_port

    launcher = shutil.which("deepspeed")
    if launcher is None:
        raise Problem("the deepspeed launcher is not on PATH (the DeepSpeed install failed?)")
    job_out = out_path.with_name(out_path.stem + "_main_job.json")
    cmd = [launcher, "--num_gpus", "1", "--master_port", str(free_port()), str(HERE / "main_job.py"),
           "--out", str(job_out)] + (["--dry-run"] if dry else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if dry:
        env["OMP_NUM_THREADS"] = "1"
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode or not job_out.is_file():
        raise Problem(f"main job failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    res = json.loads(job_out.read_text())
    job_out.unlink()
    res["command"] = " ".join(cmd[:1] + ["--num_gpus", "1", "benchmarks/gpu/main_job.py"] + (["--dry-run"] if dry else []))
    res["seconds"] = time.perf_counter() - t
    return res


# ------------------------------------------------------------------------------ driver
def run(dry: bool, out_path: Path, skip: tuple[str, ...] = ()) -> dict:
    results: dict = {"command": "python benchmarks/gpu/run.py" + (" --dry-run" if dry else ""),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1) + "\n")

    results["environment"] = check_environment(dry)
    results["install"] = install_carried(dry)
    import deepspeed  # noqa: F401 - installed and checked above
    save()

    def section(name: str, fn, *args) -> dict | None:
        if name in skip:
            results[name] = {"ok": False, "skipped": True}
            return None
        t = time.perf_counter()
        try:
            value = fn(*args)
            results[name] = {"ok": True, **value, "section_seconds": time.perf_counter() - t}
        except Exception:  # noqa: BLE001 - recorded; the other sections still run
            results[name] = {"ok": False, "error": traceback.format_exc()[-4000:],
                             "section_seconds": time.perf_counter() - t}
        print(f"[gpu-run] {name}: {'ok' if results[name]['ok'] else 'FAILED'} "
              f"({results[name]['section_seconds']:.1f} s)", flush=True)
        save()
        return results[name] if results[name]["ok"] else None

    section("cuda_tier", section_cuda_tier, dry)
    peak = section("matmul_peak", section_matmul_peak, dry)
    ns = section("newton_schulz", section_newton_schulz, dry, peak["tflops"] if peak else None)
    if ns:
        section("plan_time", section_plan_time, dry, ns, results["environment"]["device_name"])
    section("main_job", section_main_job, dry, out_path)
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results["ok"] = all(results.get(k, {}).get("ok") for k in
                        ("cuda_tier", "matmul_peak", "newton_schulz", "plan_time", "main_job") if k not in skip)
    save()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, gloo: the same code path")
    default = Path(os.environ["OUT"]) / "gpu_results.json" if os.environ.get("OUT") else \
        ROOT / "benchmarks" / "results" / "gpu.json"
    ap.add_argument("--out", type=Path, default=default, help=f"results file (default {default})")
    ap.add_argument("--skip", nargs="*", default=[], choices=["cuda_tier", "matmul_peak", "newton_schulz",
                                                              "plan_time", "main_job"])
    args = ap.parse_args(argv)
    try:
        res = run(args.dry_run, args.out, tuple(args.skip))
    except Problem as e:
        print(f"[gpu-run] cannot run: {e}", file=sys.stderr)
        return 2
    print(f"[gpu-run] wrote {args.out} ({'all sections ok' if res['ok'] else 'some sections FAILED'})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

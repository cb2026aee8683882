"""The main job's figures in docs/main_job.md, measured: the default run and a 20-step compare.

    python benchmarks/main_job.py      # -> benchmarks/results/main_job.json (+ .md), ~5 min on 2 cores

1. ``launch/train.sh`` as the README runs it (configs/run_tiny.yaml: tiny preset, 2 CPU ranks,
   200 steps, CanzonaMuon), into a temporary folder: wall time, losses, median tokens/s and
   step time, and the partition plan summary it prints (both layouts);
2. ``launch/train.sh --compare --set steps=20``: CanzonaMuon vs DeepSpeed's Muon vs AdamW and
   the single-process reference (first ``reference_steps`` losses), median step times.

docs/main_job.md embeds the tables (``benchmarks/tables.py``: main_job_run, main_job_plan,
main_job_reference, main_job_compare); tests/test_results_in_sync.py keeps them equal to
this file.  Times are of a shared 2-core machine: noisy.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "main_job.json"
COMPARE_STEPS = 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_sh(args: list[str]) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_PORT=str(_port()), PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    t0 = time.time()
    r = subprocess.run(["bash", "launch/train.sh", *args, "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"launch/train.sh {' '.join(args)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return time.time() - t0, r.stdout + r.stderr


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, cmp_dir = Path(tmp) / "run", Path(tmp) / "compare"
        wall, _ = train_sh(["--set", f"log_dir={run_dir}", "--set", "checkpoint_every=0"])
        summary = json.loads((run_dir / "summary.json").read_text())
        run_cfg = json.loads((run_dir / "run_config.json").read_text())
        plan = json.loads((run_dir / "plan_summary.json").read_text())
        cmp_wall, _ = train_sh(["--compare", "--set", f"steps={COMPARE_STEPS}", "--set", f"log_dir={cmp_dir}"])
        report = json.loads((cmp_dir / "compare" / "compare.json").read_text())
        reference = rows(cmp_dir / "compare" / "reference.jsonl")
        curves = {n: [r["loss"] for r in rows(cmp_dir / "compare" / n / "metrics.jsonl")] for n in report["runs"]}
    data = {
        "command": "python benchmarks/main_job.py",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "run": {"command": "launch/train.sh", "wall_s": round(wall, 1), "steps": summary["steps"],
                "ranks": run_cfg["dp"], "model": run_cfg["model"], "optimizer": summary["optimizer"],
                "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
                "final_val_loss": summary["final_val_loss"], "median_tokens_per_s": summary["median_tokens_per_s"],
                "median_step_ms": summary["median_step_ms"]},
        "plan": plan,
        "compare": {"command": f"launch/train.sh --compare --set steps={COMPARE_STEPS}", "wall_s": round(cmp_wall, 1),
                    "runs": report["runs"], "reference": reference,
                    "losses": {n: c[:len(reference)] for n, c in curves.items()}},
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tables

    OUT.with_suffix(".md").write_text("\n\n".join(tables.render(n) for n in
                                                  ("main_job_run", "main_job_plan", "main_job_reference",
                                                   "main_job_compare")) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

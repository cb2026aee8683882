"""What an AVX2-only CPU's kernels cost the suite: heavy tests natively and under the AVX2 kernels.

    python benchmarks/bench_cpu_kernels.py        # writes benchmarks/results/cpu_kernels.json

Each test below (the slowest kinds of the suite: ZeRO-3, MoE x TP resize, the HF Trainer, the
main job, expert stacks, the mixed layout, the GPU dry run) runs as its own pytest process twice,
once as this machine is ("native") and once with ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` ("avx2": the kernels an AVX2-only AMD
EPYC gets, oneDNN without a bf16 matrix kernel, MKL's AVX2 sgemm), the two back to back and
the order alternating from test to test, so a shared machine's noise falls on both.  Per run:
wall seconds and CPU seconds (user + system of every process of the run: pytest, its fork
server's workers, launchers and ranks, found by a token in their environment and sampled from
``/proc`` every 20 ms, so a process that lives less than that may be missed), and the ratio
avx2 / native of each.  CPU seconds separate the work from
waiting on an oversubscribed machine.

This emulates an AVX2 CPU's kernel choice on the machine at hand; it does not emulate that
CPU's clock, caches or its bf16 fallback speed exactly (measured: ``bench_ns_dtype.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "cpu_kernels.json"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
TESTS = [
    "tests/test_zero3.py::test_dp2_bit_exact[CanzonaMuon]",
    "tests/test_ckpt_resume.py::test_resume_across_layouts[moetp-Muon-z2tp2dp2ep1-to-z2tp2dp1ep2]",
    "tests/test_train_hf.py::test_hf_trainer_qwen3_moe_exact_against_per_expert_reference[CanzonaMuon]",
    "tests/test_experts.py::test_dp2_equals_per_expert_reference[CanzonaMuon-1]",
    "tests/test_train_job.py::test_resume_continues_the_same_trajectory",
    "tests/test_layout_mixed.py::test_mixed_dp2_is_bit_exact[CanzonaMuon-stage1]",
    "tests/test_ckpt_resume.py::test_resume_across_layouts[moe-Shampoo-z0dp2ep2-to-z0dp4ep2]",
    "tests/test_gpu_run.py::test_dry_run_every_section_ok",
]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of_tagged(token: bytes, seen: dict[int, float]) -> None:
    """Record into ``seen`` (pid -> CPU seconds) every live process whose environment holds ``token``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        pid = int(stat.parent.name)
        try:
            if pid not in seen and token not in (stat.parent / "environ").read_bytes().split(b"\0"):
                continue
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seen[pid] = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime of the process itself


def run_one(test: str, kind: str) -> dict:
    token = f"CANZONA_BENCH_RUN={os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(AVX2 if kind == "avx2" else {})}
    env["CANZONA_BENCH_RUN"] = token.split("=", 1)[1]
    if kind == "native":
        for k in AVX2:
            env.pop(k, None)
    seen: dict[int, float] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:  # (a file, not a pipe: a full pipe would stall the run)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            _cpu_of_tagged(token.encode(), seen)
            time.sleep(0.02)
        log.seek(0)
        out = log.read()
    wall = time.perf_counter() - t0
    cpu = sum(seen.values())
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    if r.returncode != 0:
        raise SystemExit(f"{test} failed under {kind} kernels (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT, help=f"results file (default: {OUT.relative_to(ROOT)})")
    ap.add_argument("--tests", nargs="*", default=TESTS, help="pytest node ids (default: the eight above)")
    args = ap.parse_args()
    rows = []
    for i, test in enumerate(args.tests):
        order = ("native", "avx2") if i % 2 == 0 else ("avx2", "native")
        got = {kind: run_one(test, kind) for kind in order}
        row = {"test": test, **{f"{k}_{m}": got[k][m] for k in ("native", "avx2") for m in ("wall_s", "cpu_s")}}
        row["wall_ratio"] = round(row["avx2_wall_s"] / row["native_wall_s"], 3)
        row["cpu_ratio"] = round(row["avx2_cpu_s"] / row["native_cpu_s"], 3)
        rows.append(row)
        print(f"{row['wall_ratio']:6.3f} wall  {row['cpu_ratio']:6.3f} cpu  {test}", flush=True)
    total = {m: round(sum(r[m] for r in rows), 2) for m in ("native_wall_s", "avx2_wall_s", "native_cpu_s",
                                                            "avx2_cpu_s")}
    total["wall_ratio"] = round(total["avx2_wall_s"] / total["native_wall_s"], 3)
    total["cpu_ratio"] = round(total["avx2_cpu_s"] / total["native_cpu_s"], 3)
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "avx2_env": AVX2, "rows": rows, "total": total,
              "command": "python benchmarks/bench_cpu_kernels.py"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"total: wall x{total['wall_ratio']}, cpu x{total['cpu_ratio']} -> {args.out}")


if __name__ == "__main__":
    main()

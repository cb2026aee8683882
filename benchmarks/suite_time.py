"""The suite's size and time, as CI runs it: ``benchmarks/results/suite_time.json``.

    python benchmarks/suite_time.py                         # runs the suite, then .ci/kernels, records both
    python benchmarks/suite_time.py --avx2-suite            # also the whole suite under the AVX2 kernels
    python benchmarks/suite_time.py --from-log LOG --label L [--kernels native|avx2]
                                                            # records the pytest summaries of a saved run

A run is one pytest session; its record is pytest's own summary line (passed / skipped / failed,
seconds) with the CPU model, the core count and the kernels it ran with ("native", or "avx2":
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``, docs/zero.md).
``--from-log`` reads a saved ``CI=true bash .ci/run`` log (its closing stage table, minutes per
stage, goes to ``ci_runs``; its first summary is the suite's, its
second ``.ci/kernels``': the bit-for-bit tests under the AVX2 kernels and more threads than cores;
the integration tier's on other DeepSpeed releases follow, recorded by benchmarks/ds_range.py) or
a single pytest session's log.  Results of the same label are replaced.
Time on a machine that runs other work is not the suite's: record idle runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench_cpu_kernels import AVX2, cpu_model  # (benchmarks/, the script's folder)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_time.json"
SUITE = "the suite (python3 -m pytest -q tests)"
KERNELS = "its bit-for-bit tests (.ci/kernels)"
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s\b", re.M)
#: .ci/run's closing table: "ci-stages: <cores> cores, <cpu>", then "ci-stage: <name> <minutes> min  exit <rc>"
STAGES_HEAD = re.compile(r"^ci-stages: (?P<cores>\d+) cores, (?P<cpu>.*)$", re.M)
STAGE = re.compile(r"^ci-stage: (?P<name>.+?)\s+(?P<minutes>[\d.]+) min(?:\s+exit (?P<rc>\d+))?$", re.M)


def stages(text: str) -> dict | None:
    """.ci/run's stage table in ``text`` (the last one), or None."""
    heads = list(STAGES_HEAD.finditer(text))
    if not heads:
        return None
    head = heads[-1]
    rows = [dict(stage=m["name"], minutes=float(m["minutes"]), exit=None if m["rc"] is None else int(m["rc"]))
            for m in STAGE.finditer(text, head.end())]
    total = next((r["minutes"] for r in rows if r["stage"] == "total"), None)
    return dict(cpu=head["cpu"].strip(), cores=int(head["cores"]), total_minutes=total,
                stages=[r for r in rows if r["stage"] != "total"])


def summaries(text: str) -> list[dict]:
    """pytest's summary lines in ``text``, in order: counts by outcome and seconds."""
    out = []
    for m in SUMMARY.finditer(text):
        counts = {word: int(n) for n, word in (c.split(" ", 1) for c in m["counts"].split(", "))}
        out.append({"counts": counts, "seconds": float(m["seconds"])})
    return out


def record(label: str, what: str, kernels: str, summary: dict) -> dict:
    return {"label": label, "what": what, "kernels": kernels, "cpu": cpu_model(), "cores": os.cpu_count(),
            "passed": summary["counts"].get("passed", 0), "skipped": summary["counts"].get("skipped", 0),
            "failed": summary["counts"].get("failed", 0) + summary["counts"].get("error", 0)
            + summary["counts"].get("errors", 0),
            "minutes": round(summary["seconds"] / 60, 1)}


def run(cmd: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    found = summaries(r.stdout)
    if not found:
        raise SystemExit(f"{' '.join(cmd)}: no pytest summary (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    print(f"{' '.join(cmd)}: {found[-1]} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    return found[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--avx2-suite", action="store_true", help="also run the whole suite under the AVX2 kernels")
    ap.add_argument("--from-log", type=Path, help="record the pytest summaries of a saved log instead of running")
    ap.add_argument("--label", help="with --from-log: the label of the record(s)")
    ap.add_argument("--kernels", choices=["native", "avx2"], default="native",
                    help="with --from-log of a single session: the kernels it ran with (default native)")
    args = ap.parse_args()
    new: list[dict] = []
    ci_runs: list[dict] = []
    if args.from_log:
        if not args.label:
            ap.error("--from-log needs --label")
        text = args.from_log.read_text()
        found = summaries(text)
        table = stages(text)
        if table is not None:  # .ci/run's stage table: install, suite, kernels, each release
            ci_runs.append(dict(label=args.label, **table))
        if len(found) >= 2:  # a .ci/run log: the suite, .ci/kernels, then .ci/ds_range's tiers (ds_range.py)
            new += [record(args.label, SUITE, "native", found[0]),
                    record(f"{args.label}: .ci/kernels", KERNELS, "avx2, cores + 1 threads", found[1])]
        elif found:
            new.append(record(args.label, SUITE, args.kernels, found[0]))
        elif table is None:
            raise SystemExit(f"{args.from_log}: no pytest summary line")
    else:
        exact = ROOT / ".exact-tests.txt"
        exact.unlink(missing_ok=True)
        native = {k: v for k, v in os.environ.items() if k not in AVX2}
        new.append(record("CI: the suite", SUITE, "native",
                          run([sys.executable, "-m", "pytest", "-q", "tests"], {**native, "CANZONA_EXACT_LOG": str(exact)})))
        new.append(record("CI: .ci/kernels", KERNELS, "avx2, cores + 1 threads",
                          run(["bash", ".ci/kernels", str(exact)], native)))
        if args.avx2_suite:
            new.append(record("the suite, AVX2 kernels", SUITE, "avx2",
                              run([sys.executable, "-m", "pytest", "-q", "tests"], {**native, **AVX2})))
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    labels = {r["label"] for r in new + ci_runs}
    runs = [r for r in data.get("runs", []) if r["label"] not in labels] + new
    stage_runs = [r for r in data.get("ci_runs", []) if r["label"] not in labels] + ci_runs
    args.out.write_text(json.dumps({"runs": runs, "ci_runs": stage_runs, "command": "python benchmarks/suite_time.py"},
                                   indent=1) + "\n")
    for r in new + ci_runs:
        print(r)


if __name__ == "__main__":
    main()

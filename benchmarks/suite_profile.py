"""Where the suite's minutes go, from the profile a run with ``CANZONA_PHASES`` leaves
(canzona_testkit/phases.py; ``.ci/run`` leaves it in ``.ci-profile/suite`` and ``.ci-profile/kernels``).

    CANZONA_PHASES=/tmp/prof python3 -m pytest -q tests     # any pytest run: the whole suite, one file
    python benchmarks/suite_profile.py /tmp/prof             # per file, the slowest tests, per phase
    python benchmarks/suite_profile.py .ci-profile/suite --record "LABEL"
                                                             # into benchmarks/results/suite_profile.json
                                                             # (docs/ci.md's tables)

Per file: its tests' wall minutes (pytest's setup, call and teardown), the share of the run, how
much of it was spent waiting on ranks ``run_distributed`` started, and the CPU minutes of the
pytest process and its waited-for children (a ``deepspeed`` launcher run's whole process tree).
Per phase: the ranks' wall seconds in each phase (rank 0 of every run; ranks run side by side)
and all ranks' CPU seconds.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from canzona_testkit.phases import PHASES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_profile.json"


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def profile(folder: Path, top: int = 15) -> dict:
    tests, ranks = _lines(folder / "tests.jsonl"), _lines(folder / "ranks.jsonl")
    if not tests:
        raise SystemExit(f"{folder}: no tests.jsonl (run pytest with CANZONA_PHASES={folder})")
    wall = sum(t["wall"] for t in tests)
    files: dict[str, dict] = collections.defaultdict(lambda: dict(tests=0, wall=0.0, in_ranks=0.0, cpu=0.0))
    for t in tests:
        f = files[t["test"].split("::", 1)[0]]
        f["tests"] += 1
        f["wall"] += t["wall"]
        f["in_ranks"] += t["in_ranks"]
        f["cpu"] += t["cpu"] + t["children_cpu"]
    rank_cpu = collections.Counter()
    for r in ranks:
        rank_cpu[r["test"].split("::", 1)[0] if r["test"] else "?"] += r["cpu"]
    rows = [dict(file=name, tests=f["tests"], minutes=f["wall"] / 60, share=f["wall"] / wall,
                 in_ranks=f["in_ranks"] / f["wall"] if f["wall"] else 0.0,
                 cpu_minutes=(f["cpu"] + rank_cpu[name]) / 60)
            for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall"])]
    slowest = [dict(test=t["test"], seconds=t["wall"], in_ranks=t["in_ranks"])
               for t in sorted(tests, key=lambda t: -t["wall"])[:top]]
    lead = [r for r in ranks if r["rank"] == 0]
    phases = [dict(phase=p, rank0_minutes=sum(r[p] for r in lead) / 60,
                   per_run_s=sum(r[p] for r in lead) / max(len(lead), 1)) for p in PHASES]
    launched = [t for t in tests if t["children_cpu"] > 1.0]
    return dict(tests=len(tests), minutes=wall / 60, rank_runs=len(lead), ranks=len(ranks),
                rank_cpu_minutes=sum(r["cpu"] for r in ranks) / 60,
                in_ranks_minutes=sum(t["in_ranks"] for t in tests) / 60,
                launcher_tests=len(launched), launcher_minutes=sum(t["wall"] for t in launched) / 60,
                launcher_cpu_minutes=sum(t["children_cpu"] for t in launched) / 60,
                files=rows, slowest=slowest, phases=phases)


def show(p: dict, top: int) -> None:
    print(f"suite profile: {p['tests']} tests, {p['minutes']:.1f} min of test wall time; "
          f"{p['in_ranks_minutes']:.1f} min waiting on {p['rank_runs']} run_distributed runs "
          f"({p['ranks']} ranks, {p['rank_cpu_minutes']:.1f} CPU min); {p['launcher_tests']} tests launched "
          f"processes ({p['launcher_minutes']:.1f} min, {p['launcher_cpu_minutes']:.1f} CPU min)")
    print(f"{'minutes':>8} {'share':>6} {'in ranks':>8} {'CPU min':>8} {'tests':>6}  file")
    for r in p["files"][:top]:
        print(f"{r['minutes']:8.2f} {100 * r['share']:5.1f}% {100 * r['in_ranks']:7.0f}% {r['cpu_minutes']:8.2f} "
              f"{r['tests']:6d}  {r['file']}")
    print("rank phases (rank 0 of every run_distributed run):")
    for ph in p["phases"]:
        print(f"  {ph['phase']:<11} {ph['rank0_minutes']:6.2f} min  {ph['per_run_s']:6.2f} s per run")
    print("slowest tests:")
    for t in p["slowest"][:top]:
        print(f"  {t['seconds']:7.1f} s  {t['test']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="the CANZONA_PHASES folder of a pytest run")
    ap.add_argument("--top", type=int, default=15, help="files and tests shown (default 15)")
    ap.add_argument("--record", metavar="LABEL", help="store it in benchmarks/results/suite_profile.json")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    p = profile(args.folder, args.top)
    show(p, args.top)
    if args.record:
        from bench_cpu_kernels import cpu_model  # (benchmarks/, the script's folder)

        p["files"] = p["files"][:args.top]
        old = json.loads(args.out.read_text())["runs"] if args.out.is_file() else []
        run = dict(label=args.record, cpu=cpu_model(), cores=os.cpu_count(), **p)
        runs = [r for r in old if r["label"] != args.record] + [run]
        args.out.write_text(json.dumps({"runs": runs, "command": "python benchmarks/suite_profile.py FOLDER --record LABEL"},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()

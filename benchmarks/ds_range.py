"""The integration tier on each DeepSpeed release CI tests: ``benchmarks/results/ds_range.json``.

    python benchmarks/ds_range.py                      # the tier here (the main environment's DeepSpeed,
                                                       # the newest) and .ci/ds_range's releases; records all
    python benchmarks/ds_range.py --only-venvs         # only .ci/ds_range's releases
    python benchmarks/ds_range.py --only-here          # only the tier in this environment
    python benchmarks/ds_range.py --from-log LOG --label L   # records a saved .ci/ds_range log
                                                             # (.ds_range/dsV.log)
    python benchmarks/ds_range.py --from-log LOG --label L --where W   # a log made elsewhere (W says
                                                             # where: an environment .ci/ds_range did not make)

The tier is the tests ``tests/ds_range_tier.txt`` lists (marker ``ds_range``); a record is pytest's
own summary line (passed / skipped / failed, minutes) with the DeepSpeed and torch versions, the
CPU model and the core count.  Results of the same label are replaced.  Time on a machine that runs
other work is not the tier's: the label says whether the machine was idle.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench_cpu_kernels import cpu_model  # (benchmarks/, the script's folder)
from suite_time import summaries

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "ds_range.json"
#: pytest -rs's line for tests that stopped at a refusal by name (tests/conftest.py)
REFUSED = re.compile(r"^SKIPPED \[(\d+)\] .*: refused by name as it should be", re.M)
#: the first line .ci/ds_range prints for a release
HEADER = re.compile(r"^\.ci/ds_range: deepspeed (?P<deepspeed>\S+), torch (?P<torch>[^;\s]+);", re.M)


def record(label: str, where: str, deepspeed: str, torch: str, log: str) -> dict:
    found = summaries(log)
    if not found:
        raise SystemExit(f"{label}: no pytest summary line in the log:\n{log[-2000:]}")
    c = found[-1]["counts"]
    # of the skips, the tests that stopped at the refusal of a setting the release cannot run
    # (tests/conftest.py; listed by pytest -rs)
    refused = sum(int(m.group(1)) for m in REFUSED.finditer(log))
    return {"label": label, "deepspeed": deepspeed, "torch": torch, "where": where, "cpu": cpu_model(),
            "cores": os.cpu_count(), "passed": c.get("passed", 0), "skipped": c.get("skipped", 0),
            "refused": refused,
            "failed": c.get("failed", 0) + c.get("error", 0) + c.get("errors", 0),
            "minutes": round(found[-1]["seconds"] / 60, 1)}


def from_venv_log(label: str, log: str, where: str | None = None) -> dict:
    m = HEADER.search(log)
    if m is None:
        raise SystemExit(f"{label}: not a .ci/ds_range log (no '.ci/ds_range: deepspeed V, torch T;' line)")
    return record(label, where or f"venv .ds_range/ds{m['deepspeed']}", m["deepspeed"], m["torch"], log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--from-log", type=Path, help="record a saved .ci/ds_range log instead of running")
    ap.add_argument("--label", default="the tier", help="the record's label (say whether the machine was idle)")
    ap.add_argument("--where", help="with --from-log: where the log's run was made (default: .ci/ds_range's venv)")
    ap.add_argument("--only-venvs", action="store_true", help="skip the run in this environment")
    ap.add_argument("--only-here", action="store_true", help="skip .ci/ds_range's releases")
    args = ap.parse_args()
    new: list[dict] = []
    if args.from_log:
        new.append(from_venv_log(args.label, args.from_log.read_text(), args.where))
    else:
        if not args.only_venvs:
            import deepspeed
            import torch

            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "ds_range", "tests", "-p",
                                "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
            new.append(record(f"{args.label}, newest", "main environment", deepspeed.__version__,
                              torch.__version__, r.stdout))
        if not args.only_here:
            r = subprocess.run(["bash", ".ci/ds_range"], cwd=ROOT, capture_output=True, text=True)
            for log in r.stdout.split(".ci/ds_range: ")[1:]:
                new.append(from_venv_log(args.label, ".ci/ds_range: " + log))
    old = json.loads(args.out.read_text())["runs"] if args.out.is_file() else []
    keys = {(r["label"], r["deepspeed"]) for r in new}
    runs = [r for r in old if (r["label"], r["deepspeed"]) not in keys] + new
    args.out.write_text(json.dumps({"runs": runs, "command": "python benchmarks/ds_range.py",
                                    "tier": "tests/ds_range_tier.txt"}, indent=1) + "\n")
    for r in new:
        print(r)


if __name__ == "__main__":
    main()

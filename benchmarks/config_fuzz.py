"""Bad input, counted: every generated invalid optimizer setting, and ranks started with different
settings (real 2-rank DeepSpeed runs), with what happened to each.

    python benchmarks/config_fuzz.py      # -> benchmarks/results/config_fuzz.{md,json}
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from canzona_testkit.dist import run_distributed  # noqa: E402
from canzona_testkit.fuzz import check, invalid_settings  # noqa: E402
from canzona_testkit.models import HP, ds_config, run_engine  # noqa: E402

MUON = HP["CanzonaMuon"]
#: two ranks, each with its own ds_config (rank 0's, rank 1's)
MISMATCHES = {
    "lr 0.02 vs 0.05": (ds_config(2, params=dict(MUON, lr=0.02)), ds_config(2, params=dict(MUON, lr=0.05))),
    "momentum 0.9 vs 0.5": (ds_config(2), ds_config(2, params=dict(MUON, momentum=0.5))),
    "ns_steps 5 vs 6": (ds_config(2), ds_config(2, params=dict(MUON, ns_steps=6))),
    "weight_decay 0.1 vs 0": (ds_config(2), ds_config(2, params=dict(MUON, weight_decay=0.0))),
    "ZeRO stage 1 vs 0": (ds_config(2, stage=1), ds_config(2, stage=0)),
    "CanzonaMuon vs CanzonaSOAP": (ds_config(2), ds_config(2, optimizer="CanzonaSOAP")),
}


def _per_rank(rank, world, cfgs):
    try:
        run_engine(rank, world, cfgs[rank], 1)
    except Exception as err:  # noqa: BLE001 - what happened is the result
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    cases = list(invalid_settings())
    results = [(c, *check(c)) for c in cases]
    def kind(what: str) -> str:
        if what.startswith("non-finite"):
            return "non-finite number(s)"
        if what.startswith(("out of range", "out-of-range")):
            return "out of the documented range"
        return what

    by_kind = Counter(kind(c.what) for c, _, _ in results)
    refused = sum(1 for _, ok, _ in results if ok)
    mismatches = {}
    for name, cfgs in MISMATCHES.items():
        t0 = time.perf_counter()
        msgs = run_distributed(_per_rank, 2, list(cfgs), timeout=300)
        mismatches[name] = {"seconds": round(time.perf_counter() - t0, 1),
                            "refused_on_every_rank": all(m is not None and "Ranks disagree" in m for m in msgs),
                            "message": msgs[0]}
        print(f"{name}: {mismatches[name]['seconds']} s, refused on every rank: "
              f"{mismatches[name]['refused_on_every_rank']}", flush=True)
    out = {"command": "python benchmarks/config_fuzz.py", "invalid_settings": len(cases),
           "refused_naming_the_key": refused, "by_kind": dict(sorted(by_kind.items())),
           "examples": [{"type": c.optimizer_type, "params": repr(c.params), "canzona_tp": repr(c.tp_section),
                         "message": msg} for c, _, msg in results[::max(1, len(results) // 8)]],
           "rank_mismatches": mismatches}
    res = ROOT / "benchmarks" / "results"
    (res / "config_fuzz.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["# Bad input (measured)", "", f"Command: `{out['command']}`", "",
             f"{len(cases)} invalid optimizer settings generated from the config dataclasses "
             "(`canzona_testkit/fuzz.py`: every key of CanzonaMuon, CanzonaShampoo and CanzonaSOAP and of the "
             f"`canzona_tp` section): **{refused} refused with an error naming the key**, "
             f"{len(cases) - refused} accepted or unnamed.", "", "| kind of bad value | cases |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(by_kind.items())]
    lines += ["", "Ranks started with different settings (2 ranks, real DeepSpeed engines):", "",
              "| rank 0 vs rank 1 | refused on every rank | seconds (incl. process start) |", "|---|---|---|"]
    lines += [f"| {k} | {'yes' if v['refused_on_every_rank'] else 'NO'} | {v['seconds']} |" for k, v in mismatches.items()]
    (res / "config_fuzz.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("CANZONA_AGREEMENT_TIMEOUT", "60")
    main()

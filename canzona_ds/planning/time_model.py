"""A measured-time cost model: what a matrix's optimizer step costs in SECONDS on one device,
fitted from measured per-shape times, for the planners to balance instead of FLOPs.

FLOPs are the right load only where every matrix runs at the same FLOP rate; on a GPU a small
matrix's Newton-Schulz runs far below the rate of a large one (launch and memory bound), so a
plan balanced in FLOPs need not be balanced in time.  The model::

    t(shape) = c0 + c1 * F(shape) + c2 * m * n        seconds per matrix per step
               F = the rule's own FLOP count (rule.flops(...).amortised), m x n the matrix

with c0, c1, c2 >= 0 fitted by least squares on RELATIVE error (each row weighted by 1 / its
measured time, so a 0.1 ms matrix counts as much as a 40 ms one) over every subset of the three
terms whose solution is non-negative; the subset with the smallest RMS relative error is kept.  :class:`TimeCostModel` has the planners' ``CostModel``
interface: its ``flops`` returns predicted seconds (amortised = peak), so any planner balancing
cost ``"flops"`` with it as ``model`` balances time.

Data: ``benchmarks/gpu/run.py`` measures the rows on a GPU and writes them in its results file
(``newton_schulz.rows``); :func:`fit_results` fits them.  Fitted models are shipped as JSON in
``canzona_ds/planning/time_models/<card>.json`` (:func:`load_time_model`).  None exists yet: no
GPU run of this project has been made (docs/gpu.md).
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from ..flops import Flops
from .cost import CostModel

TIME_MODELS = Path(__file__).resolve().parent / "time_models"
TERMS = ("c0", "c1_per_flop", "c2_per_element")


@dataclass(frozen=True)
class TimeFit:
    """A fit of seconds per matrix: ``c0 + c1 * flops + c2 * elements`` and its error on the rows."""

    c0: float
    c1_per_flop: float
    c2_per_element: float
    #: rows fitted, largest and mean |predicted - measured| / measured over them
    rows: int
    max_rel_error: float
    mean_rel_error: float
    #: the device the rows were measured on (e.g. "NVIDIA H100 80GB HBM3") and where they came from
    card: str = ""
    source: str = ""

    def seconds(self, flops: float, elements: float) -> float:
        return self.c0 + self.c1_per_flop * flops + self.c2_per_element * elements


def fit_time(rows: Iterable[Mapping[str, float]], card: str = "", source: str = "") -> TimeFit:
    """Fit ``rows`` (each ``{"flops": F, "elements": m*n, "seconds": t}``, t > 0) as above."""
    rows = list(rows)
    if len(rows) < 1:
        raise ValueError("fit_time needs at least one measured row")
    for r in rows:
        if not (r["seconds"] > 0 and r["flops"] >= 0 and r["elements"] > 0):
            raise ValueError(f"Invalid measured row {dict(r)!r}: needs seconds > 0, flops >= 0, elements > 0.")
    X = np.array([[1.0, r["flops"], r["elements"]] for r in rows], dtype=np.float64)
    t = np.array([r["seconds"] for r in rows], dtype=np.float64)
    W = X / t[:, None]  # relative error: (X c - t) / t
    best = None
    for k in range(1, 4):
        for subset in itertools.combinations(range(3), k):
            cols = list(subset)
            scale = np.abs(W[:, cols]).max(axis=0)  # columns of very different magnitude: condition first
            sol, *_ = np.linalg.lstsq(W[:, cols] / scale, np.ones(len(rows)), rcond=None)
            sol = sol / scale
            if np.any(sol < 0):
                continue
            c = np.zeros(3)
            c[cols] = sol
            err = np.abs(X @ c - t) / t
            if best is None or np.sqrt(np.mean(err ** 2)) < np.sqrt(np.mean(best[1] ** 2)):
                best = (c, err)
    if best is None:  # cannot happen: the single positive column always fits with c > 0
        raise RuntimeError("no non-negative fit")
    c, err = best
    return TimeFit(float(c[0]), float(c[1]), float(c[2]), len(rows), float(err.max()), float(err.mean()), card, source)


@dataclass(frozen=True)
class TimeCostModel:
    """The planners' ``CostModel`` with predicted seconds for FLOPs (see the module doc)."""

    rule: CostModel
    fit: TimeFit

    @property
    def name(self) -> str:
        return f"{self.rule.name}@time"

    def flops(self, shape: tuple[int, int], num_heads: int | None = None) -> Flops:
        f = self.rule.flops(shape, num_heads)
        s = self.fit.seconds(f.amortised, float(shape[0]) * float(shape[1]))
        peak = self.fit.seconds(f.peak, float(shape[0]) * float(shape[1]))
        return Flops(s, peak)

    def state_bytes(self, shape: tuple[int, int], num_heads: int | None = None) -> float:
        return self.rule.state_bytes(shape, num_heads)


def rows_from_results(results: Mapping[str, Any], method: str = "standard", mode: str = "one") -> list[dict]:
    """The measured rows of a ``benchmarks/gpu/run.py`` results file: one per (model, TP, shape)
    Newton-Schulz measurement of ``method``, one matrix at a time (``mode="one"``) or per matrix
    of a batch (``"batched"``)."""
    ns = results.get("newton_schulz")
    if not ns or not ns.get("ok"):
        raise ValueError("the results file has no successful newton_schulz section to fit")
    out = []
    for r in ns["rows"]:
        if r["method"] != method:
            continue
        out.append({"flops": r["flops"], "elements": r["elements"], "seconds": r[f"{mode}_ms"] / 1e3,
                    "shape": r["shape"]})
    if not out:
        raise ValueError(f"no newton_schulz rows with method={method!r} in the results file")
    return out


def fit_results(results: Mapping[str, Any], method: str = "standard", mode: str = "one", source: str = "") -> TimeFit:
    """:func:`fit_time` of :func:`rows_from_results`, naming the results' card."""
    card = results.get("environment", {}).get("device_name", "")
    return fit_time(rows_from_results(results, method, mode), card=card, source=source)


def card_slug(card: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")


def save_time_model(fit: TimeFit, directory: Path = TIME_MODELS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{card_slug(fit.card) or 'unnamed'}.json"
    path.write_text(json.dumps(asdict(fit), indent=1) + "\n")
    return path


def available_time_models(directory: Path = TIME_MODELS) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


def load_time_model(card: str, rule: CostModel, directory: Path = TIME_MODELS) -> TimeCostModel:
    """The shipped fit for ``card`` (a device name or its slug) around ``rule``."""
    path = directory / f"{card_slug(card)}.json"
    if not path.is_file():
        have = available_time_models(directory)
        raise FileNotFoundError(f"No measured-time cost model for card {card!r} ({path.name}). Shipped: "
                                f"{have or 'none yet (no GPU run has been made; docs/gpu.md)'}.")
    return TimeCostModel(rule, TimeFit(**json.loads(path.read_text())))


def main(argv: list[str] | None = None) -> int:
    """``python -m canzona_ds.planning.time_model RESULTS.json [--save]``: fit the device run's
    Newton-Schulz times, print the fit and its error; ``--save`` ships it as
    ``time_models/<card>.json``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results", type=Path)
    ap.add_argument("--method", default="standard", choices=["standard", "gram"])
    ap.add_argument("--mode", default="one", choices=["one", "batched"])
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    fit = fit_results(json.loads(args.results.read_text()), args.method, args.mode, source=str(args.results))
    print(json.dumps(asdict(fit), indent=1))
    if args.save:
        print(f"wrote {save_time_model(fit)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run artifacts: per-step metrics (JSONL + CSV), plots (matplotlib, optional), summary table."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from canzona_ds.step_metrics import StepMetrics

#: metrics.csv's columns: the job's own, then the optimizer's step metrics as canzona_<name>
#: (optimizer.metrics(): docs/optimizers.md, "Step metrics"; trainer.optimizer_metrics)
STEP_FIELDS = ("step", "loss", "val_loss", "lr_mult", "tokens", "step_ms", "tokens_per_s",
               "fwd_bwd_ms", "grad_reduce_ms", "optimizer_ms", "allgather_ms", "qk_max_logit", "qk_clipped_heads",
               *(f"canzona_{f}" for f in StepMetrics.__dataclass_fields__ if f != "step"))


class MetricsWriter:
    """Appends one JSON object per optimizer step to ``metrics.jsonl`` (rank 0 only).

    On resume the file is first cut back to steps <= ``start_step`` (the checkpoint) so the file
    describes one trajectory."""

    def __init__(self, log_dir: Path, start_step: int = 0) -> None:
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] <= start_step] if self.path.exists() else []
        with self.path.open("w") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def write_csv(self) -> Path:
        rows = read_metrics(self.path)
        out = self.path.with_suffix(".csv")
        with out.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(STEP_FIELDS), extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        return out


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _median(values) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def summarize_steps(rows: list[dict], skip_first: int = 1) -> dict:
    """Mean and median timings over the steps (the first ``skip_first`` are warm-up and excluded).

    The console table and plots show medians: on a shared machine a few stalled steps
    dominate a mean."""
    timed = rows[skip_first:] if len(rows) > skip_first else rows
    out = {"steps": len(rows), "first_loss": rows[0]["loss"] if rows else None,
           "final_loss": rows[-1]["loss"] if rows else None,
           "final_val_loss": next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None)}
    for key in ("step_ms", "tokens_per_s", "fwd_bwd_ms", "grad_reduce_ms", "optimizer_ms", "allgather_ms"):
        out[f"mean_{key}"] = _mean(r.get(key) for r in timed)
        out[f"median_{key}"] = _median(r.get(key) for r in timed)
    return out


def _fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def summary_table(results: dict[str, dict]) -> str:
    """``results``: run name -> ``summarize_steps`` dict.  A fixed-width text table."""
    cols = [("final_loss", "loss"), ("final_val_loss", "val"), ("median_step_ms", "step ms"),
            ("median_tokens_per_s", "tok/s"), ("median_fwd_bwd_ms", "fwd+bwd"), ("median_grad_reduce_ms", "reduce"),
            ("median_optimizer_ms", "opt"), ("median_allgather_ms", "allgather")]
    width = max([len("run")] + [len(n) for n in results]) + 2
    head = "run".ljust(width) + "".join(h.rjust(11) for _, h in cols)
    lines = [head, "-" * len(head)]
    for name, s in results.items():
        lines.append(name.ljust(width) + "".join(_fmt(s.get(k)).rjust(11) for k, _ in cols))
    lines.append("(times in ms per optimizer step, median over steps after the first; n/a = not timed "
                 "separately by this runtime)")
    from canzona_ds.integration.runtime_info import work_timed_in

    for name, s in results.items():  # where each run's optimizer work is timed
        lines.append(f"  {name}: {work_timed_in(s.get('optimizer', name))}")
    return "\n".join(lines)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


MATPLOTLIB_MISSING = "matplotlib is not installed: no PNG plots (pip install 'canzona-ds[plot]' or pip install matplotlib)"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(curves: dict[str, list[dict]], out: Path, title: str = "training loss",
              dashed: tuple[str, ...] = (), markers_only: tuple[str, ...] = ()) -> Path:
    return _save(loss_figure(curves, title, dashed, markers_only), out)


def _save(fig, out: Path) -> Path:
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out


def loss_figure(curves: dict[str, list[dict]], title: str = "training loss", dashed: tuple[str, ...] = (),
                markers_only: tuple[str, ...] = ()):
    """``curves``: run name -> metric rows.  Train loss (solid) and val loss (markers).

    Curves that coincide must stay visible: the first run is drawn wide, the runs in ``dashed``
    narrower and dashed on top of it (e.g. DeepSpeed's Muon over CanzonaMuon, equal to ~1e-4),
    the runs in ``markers_only`` as black crosses (e.g. the single-process reference's first
    steps).  The legend sits outside the axes, so it covers no curve."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for i, (name, rows) in enumerate(curves.items()):
        xs, ys = [r["step"] for r in rows], [r["loss"] for r in rows]
        if name in markers_only:
            ax.plot(xs, ys, "x", color="black", ms=7, mew=1.5, label=name, zorder=5)
            continue
        style = dict(ls=(0, (4, 3)), lw=1.6, zorder=4) if name in dashed else dict(lw=3.2 if i == 0 else 1.6,
                                                                                 alpha=0.8 if i == 0 else 1.0)
        line, = ax.plot(xs, ys, label=f"{name} train", **style)
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o", color=line.get_color(), ms=7 if i == 0 else 4, mfc="none" if i == 0 else None,
                    label=f"{name} val", zorder=5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot_qk_logits(curves: dict[str, list[dict]], out: Path, threshold: float | None = None,
                   title: str = "largest attention logit per step") -> Path:
    """QK-clip's ``qk_max_logit`` per step, one line per run (rows without it are skipped), the
    threshold dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for name, rows in curves.items():
        pts = [(r["step"], r["qk_max_logit"]) for r in rows if r.get("qk_max_logit") is not None]
        if pts:
            ax.plot(*zip(*pts), lw=1.6, label=name)
    if threshold is not None:
        ax.axhline(threshold, color="black", ls="--", lw=1, label=f"threshold {threshold:g}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max pre-softmax logit (all layers, heads)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return _save(fig, out)


def plot_rank_load(plan_summary: dict, out: Path) -> Path:
    """Per-rank Newton-Schulz FLOPs and optimizer memory, one bar group per layout."""
    plt = _pyplot()
    dp = plan_summary["world_size"]
    if "stages" in plan_summary:  # pipeline: one bar group per (stage, DP rank), layouts by position
        stages = plan_summary["stages"]
        layouts = [{"name": lay["name"],
                    **{k: [v for st in stages for v in st["layouts"][i][k]]
                       for k in ("rank_flops", "rank_memory_bytes")}}
                   for i, lay in enumerate(stages[0]["layouts"][:min(len(st["layouts"]) for st in stages)])]
        labels = [f"stage {st['stage']}\nrank {r}" for st in stages for r in range(dp)]
    else:
        layouts = plan_summary["layouts"]
        labels = [f"rank {r}" for r in range(dp)]
    n = len(labels)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(layouts), 1)
    for k, lay in enumerate(layouts):
        xs = [r + k * width for r in range(n)]
        axes[0].bar(xs, [f / 1e9 for f in lay["rank_flops"]], width, label=lay["name"])
        axes[1].bar(xs, [m / 2**20 for m in lay["rank_memory_bytes"]], width, label=lay["name"])
    for ax, ylabel in zip(axes, ("Newton-Schulz GFLOP per step", "optimizer memory (MiB)")):
        ax.set_xticks([r + width * (len(layouts) - 1) / 2 for r in range(n)], labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(layouts), fontsize=8)
    pp = plan_summary.get("pipeline_stages", 1)
    fig.suptitle(f"per-rank optimizer load, dp={dp}" + (f" per stage, {pp} pipeline stages" if pp > 1 else ""))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_step_times(results: dict[str, dict], out: Path, title: str = "median time per optimizer step") -> Path:
    return _save(step_times_figure(results, title), out)


def step_times_figure(results: dict[str, dict], title: str = "median time per optimizer step"):
    """Stacked median step-time breakdown per run, the wall-clock step as a black bar; legend
    outside the axes."""
    plt = _pyplot()
    parts = [("median_fwd_bwd_ms", "fwd+bwd"), ("median_grad_reduce_ms", "grad reduce"),
             ("median_optimizer_ms", "optimizer"), ("median_allgather_ms", "param all-gather")]
    names = list(results)
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    bottom = [0.0] * len(names)
    for key, label in parts:
        vals = [results[n].get(key) or 0.0 for n in names]
        ax.bar(names, vals, bottom=bottom, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(names, [results[n].get("median_step_ms") or 0.0 for n in names], "k_", ms=40, mew=2,
            label="total step (wall)")
    ax.set_ylabel("ms per optimizer step")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, markerscale=0.4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig

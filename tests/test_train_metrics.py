from canzona_ds.train.metrics import summarize_steps, summary_table
from canzona_testkit.kernels import assert_bits


def test_summary_uses_median_so_a_stalled_step_does_not_dominate():
    rows = [{"loss": 3.0, "step_ms": 1000.0}] + [{"loss": 2.0, "step_ms": 100.0 + i} for i in range(5)]
    rows.append({"loss": 1.0, "step_ms": 60_000.0})  # one step stalled by a busy machine
    s = summarize_steps(rows, skip_first=1)
    assert_bits(s["median_step_ms"], 102.5)  # (102 + 103) / 2
    assert s["mean_step_ms"] > 10_000
    assert "102.5" in summary_table({"run": s}) and "median" in summary_table({"run": s})


def _curve(offset: float) -> list[dict]:
    return [{"step": s, "loss": 5.0 - 0.1 * s + offset, "val_loss": 4.0 + offset if s == 10 else None}
            for s in range(1, 11)]


def _outside_axes(fig, ax) -> bool:
    fig.canvas.draw()
    return ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def test_compare_loss_plot_keeps_coinciding_curves_visible():
    """CanzonaMuon and DeepSpeed's Muon coincide to ~1e-4: the second is dashed on a wider
    first, the reference is markers, and the legend sits outside the axes."""
    import pytest

    pytest.importorskip("matplotlib")
    from canzona_ds.train.metrics import _pyplot, loss_figure

    fig = loss_figure({"CanzonaMuon": _curve(0.0), "Muon": _curve(1e-4), "AdamW": _curve(0.3),
                       "reference": [{"step": 1, "loss": 4.9}]}, "t", dashed=("Muon",), markers_only=("reference",))
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["Muon train"].get_linestyle() == "--"
    assert lines["CanzonaMuon train"].get_linestyle() == "-"
    assert lines["CanzonaMuon train"].get_linewidth() > lines["Muon train"].get_linewidth()
    assert lines["reference"].get_linestyle() == "None" and lines["reference"].get_marker() == "x"
    assert _outside_axes(fig, ax)
    _pyplot().close(fig)


def test_step_time_plot_has_a_title_and_its_legend_covers_no_bar():
    import pytest

    pytest.importorskip("matplotlib")
    from canzona_ds.train.metrics import _pyplot, step_times_figure

    s = {"median_fwd_bwd_ms": 275.0, "median_grad_reduce_ms": 28.0, "median_optimizer_ms": 46.0,
         "median_allgather_ms": 8.0, "median_step_ms": 363.0}
    fig = step_times_figure({"CanzonaMuon": s, "Muon": {**s, "median_grad_reduce_ms": 394.0}, "AdamW": s}, "tiny: steps")
    ax = fig.axes[0]
    assert ax.get_title() == "tiny: steps"
    assert _outside_axes(fig, ax)
    _pyplot().close(fig)

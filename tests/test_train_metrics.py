from canzona_ds.train.metrics import summarize_steps, summary_table


def test_summary_uses_median_so_a_stalled_step_does_not_dominate():
    rows = [{"loss": 3.0, "step_ms": 1000.0}] + [{"loss": 2.0, "step_ms": 100.0 + i} for i in range(5)]
    rows.append({"loss": 1.0, "step_ms": 60_000.0})  # one step stalled by a busy machine
    s = summarize_steps(rows, skip_first=1)
    assert s["median_step_ms"] == 102.5  # (102 + 103) / 2
    assert s["mean_step_ms"] > 10_000
    assert "102.5" in summary_table({"run": s}) and "median" in summary_table({"run": s})

"""ZeRO stage 0 in fp32: a step whose gradient is non-finite on any rank is skipped and counted,
as DeepSpeed's ZeRO 1-3 do (canzona_ds/integration/stage0.py), for the Canzona types and for
DeepSpeed's own AdamW alike.  Before, the NaN went into the weights and the optimizer state.

Two gloo ranks; rank 0 alone sees a NaN loss at the second of four steps.  The run must end
bit for bit where a run over the other three batches ends (weights; and so the optimizer
state and step counts, which shape every later update), with ``skipped_steps == 1``.  Finite
steps are untouched: the same code path, compared exactly.

The CanzonaMuon run with the NaN also carries the step metrics (canzona_ds/step_metrics.py,
integration/metrics.py): the skipped step flagged, and what ``optimizer.metrics()`` recorded
on rank 0 read back from DeepSpeed's real ``csv_monitor`` and ``tensorboard`` monitors at the
engine's global steps, the DP reduction (interval 2) equal to the ranks' own step times.

Cost: 4 rank runs; 4 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import pytest
import torch

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import batches, ds_config, make_model, params_of

pytestmark = pytest.mark.dist
DP, MICRO = 2, 2


def _train(rank: int, world: int, optimizer: str, data: list, nan_at: int | None, monitor_dir: str | None = None):
    import canzona_ds  # noqa: F401 - registers the Canzona types (and the stage-0 check)
    import deepspeed

    from canzona_ds.integration.runtime_info import canzona_optimizer

    torch.set_num_threads(test_threads())
    model = make_model(0)
    section = {"type": "AdamW", "params": {"lr": 0.01}} if optimizer == "AdamW" else optimizer
    monitors = {} if monitor_dir is None else {
        "canzona_metrics": {"interval": 2},
        "csv_monitor": {"enabled": True, "output_path": monitor_dir, "job_name": "csv"},
        "tensorboard": {"enabled": True, "output_path": monitor_dir, "job_name": "tb"}}
    cfg = ds_config(DP, MICRO, optimizer=section, stage=0, **monitors)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    recorded = []
    for i, (x, y) in enumerate(data):
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(x, y)
        if i == nan_at and rank == 0:
            loss = loss * float("nan")  # this rank's gradient only; stage 0 all-reduces it to every rank
        engine.backward(loss)
        engine.step()
        if canzona_optimizer(engine) is not None:
            recorded.append(canzona_optimizer(engine).metrics())
    if monitor_dir is not None:
        if rank == 0:  # (DeepSpeed's monitors live on rank 0)
            engine.monitor.tb_monitor.summary_writer.flush()
        return params_of(engine.module), engine.skipped_steps, engine.global_steps, recorded
    return params_of(engine.module), engine.skipped_steps, engine.global_steps


@pytest.mark.parametrize("optimizer", ["CanzonaMuon", "AdamW"])
def test_nonfinite_step_is_skipped_at_stage_0(optimizer, tmp_path):
    data = batches(4, MICRO * DP)
    monitor = str(tmp_path) if optimizer != "AdamW" else None
    skipped = run_distributed(_train, DP, optimizer, data, 1, monitor)
    without = run_distributed(_train, DP, optimizer, [data[0], *data[2:]], None)
    if monitor is not None:
        _check_metrics([r[3] for r in skipped], tmp_path)
    for rank in range(DP):
        params, n_skipped, steps = skipped[rank][:3]
        ref, ref_skipped, _ = without[rank]
        assert (n_skipped, steps, ref_skipped) == (1, 4, 0)
        for name in ref:
            assert_bits(params[name], ref[name], (optimizer, rank, name))


def _check_metrics(recorded: list, tmp_path) -> None:
    """Per rank, the four steps' StepMetrics; rank 0's are in the monitors' files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank, steps in enumerate(recorded):
        assert [m.step for m in steps] == [1, 2, 3, 4]
        assert [m.skipped for m in steps] == [False, True, False, False]
        skipped = steps[1]
        assert (skipped.step_ms, skipped.matrix_ms) == (0.0, 0.0)  # the optimizer did not run
        for m in steps[::2] + steps[3:]:
            assert 0 < m.matrix_ms <= m.step_ms and m.hosted_collectives == 0 and m.qk_max_logit is None
        # the DP reduction on every second step only, over both ranks' own step times
        assert [m.dp_max_step_ms is None for m in steps] == [True, False, True, False]
        for i in (1, 3):
            times = [recorded[r][i].step_ms for r in range(DP)]
            assert steps[i].dp_max_step_ms == max(times)
            assert steps[i].dp_mean_step_ms == pytest.approx(sum(times) / DP, rel=1e-12)
    rank0 = recorded[0]
    csv_dir = tmp_path / "csv"
    tb = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent))
    tb.Reload()
    for name in ("step_ms", "matrix_ms", "skipped", "hosted_bytes", "dp_max_step_ms", "dp_mean_step_ms"):
        want = [(m.step, getattr(m, name)) for m in rank0 if getattr(m, name) is not None]
        rows = (csv_dir / f"Train_Canzona_{name}.csv").read_text().split()
        assert rows[0] == f"step,{name}"
        assert [(int(s), float(v)) for s, v in (r.split(",") for r in rows[1:])] == [(s, float(v)) for s, v in want]
        events = tb.Scalars(f"Train/Canzona/{name}")  # float32 in the event file
        assert [(e.step, e.value) for e in events] == [(s, pytest.approx(float(v), rel=1e-6)) for s, v in want]

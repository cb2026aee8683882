"""``optimizer.metrics()`` in plain torch (canzona_ds/step_metrics.py), one process, and the
``canzona_metrics`` section's errors.  The DeepSpeed side (engine step boundary, skipped steps,
the DP reduction over two ranks, csv_monitor and TensorBoard files) is checked in the runs of
tests/test_stage0_nonfinite.py and tests/test_zero3.py; the main job's use in test_qk_clip.py;
the HF Trainer callback here with the real Trainer in one process, and under DeepSpeed in
test_train_hf.py; Megatron-DeepSpeed's in test_tp_megatron.py and test_megatron_real.py."""
from __future__ import annotations

import pytest
import torch

from canzona_ds.config import CanzonaConfig, MetricsConfig
from canzona_ds.integration.metrics import events, metrics_config
from canzona_ds.optimizer import CanzonaOptimizer


def _optimizer(metrics: MetricsConfig | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, CanzonaOptimizer(model.named_parameters(), CanzonaConfig.from_ds("CanzonaMuon", {}),
                                   metrics=metrics)


def _step(model, opt) -> None:
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_each_step_is_recorded_and_reduced_every_interval():
    model, opt = _optimizer(MetricsConfig(interval=2))
    assert opt.metrics() is None
    seen = []
    for _ in range(4):
        _step(model, opt)
        seen.append(opt.metrics())
    assert [m.step for m in seen] == [1, 2, 3, 4]
    for m in seen:
        assert 0 < m.matrix_ms <= m.step_ms
        assert (m.hosted_collectives, m.hosted_bytes, m.skipped, m.qk_max_logit) == (0, 0, False, None)
    # one process: the busiest and the mean rank are this one, every second step only
    assert [(m.dp_max_step_ms, m.dp_mean_step_ms) for m in seen[::2]] == [(None, None)] * 2
    assert all(m.dp_max_step_ms == m.dp_mean_step_ms == m.step_ms for m in seen[1::2])
    assert set(seen[1].scalars()) == {"step_ms", "matrix_ms", "hosted_collectives", "hosted_bytes", "skipped",
                                      "dp_max_step_ms", "dp_mean_step_ms"}
    assert events(seen[0], 7) == [(f"Train/Canzona/{k}", v, 7) for k, v in seen[0].scalars().items()]


def test_metrics_off_records_nothing():
    model, opt = _optimizer(MetricsConfig(enabled=False))
    _step(model, opt)
    assert opt.metrics_recorder is None and opt.metrics() is None


@pytest.mark.parametrize("section,error", [
    ({"interval": -1}, "Invalid canzona_metrics.interval=-1. Must be an integer within [0, 1000000000]."),
    ({"interval": 2.5}, "Invalid canzona_metrics.interval=2.5."),
    ({"interval": True}, "Invalid canzona_metrics.interval=True."),
    ({"interval": None}, "Invalid canzona_metrics.interval=None."),
    ({"enabled": "yes"}, "Invalid canzona_metrics.enabled='yes'. Must be true or false."),
    ({"every": 5}, "Unknown canzona_metrics key(s) ['every']. Allowed: ['enabled', 'interval']."),
    ([5], "Invalid canzona_metrics=[5]. Must be a JSON object"),
])
def test_bad_section_is_named(section, error):
    with pytest.raises((ValueError, TypeError)) as err:
        metrics_config({"canzona_metrics": section})
    assert str(err.value).startswith(error), str(err.value)


def test_default_section():
    assert metrics_config({}) == MetricsConfig(enabled=True, interval=10)


def test_hf_callback_reaches_log_history_and_report_to(tmp_path):
    """``add_metrics_callback`` with the real ``transformers.Trainer`` (one process, the Canzona
    optimizer passed in): every training log in ``state.log_history`` carries that step's
    ``canzona_<name>`` figures, and so does what ``report_to=["tensorboard"]`` wrote (read back
    from the event file).  The DeepSpeed run: tests/test_train_hf.py (ZeRO-3)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    transformers = pytest.importorskip("transformers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from canzona_ds.integration.hf import add_metrics_callback

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

        def forward(self, x, labels):
            return {"loss": (self.net(x) - labels).square().mean()}

    torch.manual_seed(0)
    model = Regression()
    opt = CanzonaOptimizer(model.named_parameters(), CanzonaConfig.from_ds("CanzonaMuon", {}),
                           metrics=MetricsConfig(interval=2))
    data = [{"x": torch.randn(8), "labels": torch.randn(4)} for _ in range(8)]
    seen = []

    class Seen(transformers.TrainerCallback):  # what optimizer.metrics() held at each step's end
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(opt.metrics())

    targs = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, logging_steps=1,
                                           per_device_train_batch_size=2, report_to=["tensorboard"],
                                           use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, optimizers=(opt, None),
                                   callbacks=[Seen()])
    add_metrics_callback(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4] and [m.step for m in seen] == [1, 2, 3, 4]
    for h, m in zip(logs, seen):
        assert {k: v for k, v in h.items() if k.startswith("canzona_")} == {
            f"canzona_{k}": v for k, v in m.scalars().items()}
    assert ["canzona_dp_max_step_ms" in h for h in logs] == [False, True, False, True]
    tb = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    tb.Reload()
    for name in ("step_ms", "matrix_ms", "dp_mean_step_ms"):
        events = tb.Scalars(f"train/canzona_{name}")
        want = [(m.step, getattr(m, name)) for m in seen if getattr(m, name) is not None]
        assert [(e.step, e.value) for e in events] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want]

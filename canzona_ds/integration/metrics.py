"""The optimizer's step metrics on a DeepSpeed engine: the step boundary, and DeepSpeed's monitors.

``registry.install`` wraps ``DeepSpeedEngine._take_model_step`` (every rank, once per
optimizer step, also the steps DeepSpeed skips) with :func:`around_step`::

    skipped_steps before      the step (DeepSpeed's, or ZeRO's, or stage0.py's skip)     after
          |------------------------- stock _take_model_step ---------------------------|
                                                                    close(global_steps, skipped)
                                                                    monitor.write_events(
                                                                      Train/Canzona/<name>, value,
                                                                      global_steps)  (rank 0)

The optimizer records what it measured (canzona_ds/step_metrics.py); here the engine says
where a step ends, whether it was skipped, and, when the ds_config enables a monitor
(``"tensorboard"``, ``"wandb"``, ``"csv_monitor"``, ``"comet"``), sends the record through
``engine.monitor.write_events`` at the engine's global step.
"""
from __future__ import annotations

import contextlib

from ..config import MetricsConfig

#: ds_config section of the step metrics (canzona_ds.config.MetricsConfig)
DS_CONFIG_METRICS_KEY = "canzona_metrics"
#: the monitors' event-name prefix
EVENT_PREFIX = "Train/Canzona/"


def metrics_config(ds: dict) -> MetricsConfig:
    """The ds_config's ``canzona_metrics`` section, validated."""
    return MetricsConfig.from_section(ds.get(DS_CONFIG_METRICS_KEY))


def events(metrics, step: int) -> list[tuple[str, float, int]]:
    """A :class:`~canzona_ds.step_metrics.StepMetrics` as DeepSpeed monitor events at ``step``."""
    return [(EVENT_PREFIX + name, value, step) for name, value in metrics.scalars().items()]


@contextlib.contextmanager
def around_step(engine, optimizer):
    """Close ``optimizer``'s step record when the engine's step ends (body: the stock step) and
    send it to the engine's monitors; nothing when the optimizer records no metrics."""
    rec = getattr(optimizer, "metrics_recorder", None)
    if rec is None:
        yield
        return
    rec.engine_closes = True  # the engine says where a step ends (ZeRO-3 calls step() per sub-group)
    skipped_before = int(engine.skipped_steps)
    yield
    rec.close(step=int(engine.global_steps), skipped=int(engine.skipped_steps) > skipped_before)
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and getattr(monitor, "enabled", False):
        monitor.write_events(events(rec.last(), int(engine.global_steps)))

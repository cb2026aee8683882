"""The optimizer's step metrics in a Hugging Face ``transformers.Trainer`` run: one line.

    from canzona_ds.integration.hf import add_metrics_callback
    add_metrics_callback(trainer)          # before trainer.train()

Every training log the Trainer writes (each ``logging_steps``; the ones with ``"loss"``) gains
``canzona_<name>`` for each figure of ``optimizer.metrics()`` that has a value at that step
(docs/optimizers.md, "Step metrics"): in ``trainer.state.log_history`` and in whatever
``report_to`` names (TensorBoard, wandb, ...).  The Trainer appends a copy of the logs to
``log_history`` before it calls the callbacks, and calls them in order, the reporting ones
first; so the callback goes first and writes both.  The optimizer is found through the
Trainer's own (accelerate's wrapper of DeepSpeed's ZeRO optimizer, or the Canzona optimizer
itself); each rank logs its own figures, rank 0's are the ones reported.
"""
from __future__ import annotations

from transformers import TrainerCallback

from .runtime_info import canzona_optimizer


class CanzonaMetricsCallback(TrainerCallback):
    """Adds the last step's ``canzona_<name>`` figures to each training log."""

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if not logs or "loss" not in logs:  # evaluation and the end-of-training summary: not a step
            return
        opt = canzona_optimizer(optimizer) or canzona_optimizer(getattr(optimizer, "optimizer", None))
        metrics = opt.metrics() if opt is not None else None
        if metrics is None:
            return
        extra = {f"canzona_{name}": value for name, value in metrics.scalars().items()}
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


def add_metrics_callback(trainer) -> CanzonaMetricsCallback:
    """Put a :class:`CanzonaMetricsCallback` first in ``trainer``'s callbacks (before the
    reporting ones, which then send its figures too); returns it."""
    callback = CanzonaMetricsCallback()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback

"""ZeRO stage 0 in fp32: a step with a non-finite gradient is skipped and reported, as at stages 1-3.

DeepSpeed 0.19.8 checks gradients for inf/NaN inside its ZeRO optimizers (stage 1-3, also in
fp32: the static ``LossScaler`` logs "OVERFLOW! Skipping step" and the engine counts
``skipped_steps``) and in its fp16/bf16 wrappers.  At stage 0 in fp32 the engine calls the
basic optimizer directly (``DeepSpeedEngine._take_model_step``) and nothing checks: one
non-finite gradient poisons the weights and the optimizer state, for any optimizer type
(DeepSpeed's own AdamW included).  :func:`install` wraps ``_take_model_step`` so that, at
stage 0 in fp32 only:

    every rank: finite = all(isfinite(p.grad)) over its parameters       (its DP / TP / PP share)
    all ranks:  all_reduce(finite, MIN) over the world                    (one verdict: no rank
                                                                            steps while another skips)
    finite      -> DeepSpeed's own step, unchanged (bit for bit: nothing else runs)
    non-finite  -> DeepSpeed's own overflow path: optimizer.step() not run, gradients zeroed,
                   engine.skipped_steps += 1, no lr-scheduler step, global_steps += 1, and
                   rank 0 logs DeepSpeed's stage 1-3 line

Every rank reaches ``_take_model_step`` once per optimizer step (also a pipeline stage, after
its gradient reduction), so the world all-reduce is matched on every rank.
"""
from __future__ import annotations

import functools
import logging

import torch

#: DeepSpeed's stage 1-3 wording (runtime/fp16/loss_scaler.py, LossScaler.update_scale)
SKIP_MESSAGE = "[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated."


def checks_here(engine) -> bool:
    """True where DeepSpeed itself does not check: stage 0, fp32, no autocast grad scaler."""
    return (engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and getattr(engine, "torch_autocast_z0_gradscaler", None) is None)


def gradients_finite(engine) -> bool:
    """Every rank's verdict on all ranks' gradients (a collective over the world group)."""
    import torch.distributed as dist

    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    flag = torch.ones((), dtype=torch.float32, device=device)
    for g in grads:
        flag = torch.minimum(flag, torch.isfinite(g).all().to(flag.dtype))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def install(engine_cls) -> None:
    """Wrap ``engine_cls._take_model_step`` (idempotent)."""
    stock = engine_cls._take_model_step
    if getattr(stock, "_canzona_stage0", False):
        return

    @functools.wraps(stock)
    def _take_model_step(self, lr_kwargs=None):
        if not checks_here(self) or gradients_finite(self):
            return stock(self, lr_kwargs)
        from deepspeed.utils import log_dist

        opt = self.optimizer
        saved = {k: opt.__dict__[k] for k in ("step", "overflow") if k in opt.__dict__}
        opt.step = lambda *args, **kwargs: None  # this instance, this call: the update is not applied
        opt.overflow = True  # the engine's own overflow path: skipped_steps, no lr step, zero_grad
        try:
            stock(self, lr_kwargs)
        finally:
            for k in ("step", "overflow"):
                opt.__dict__.pop(k, None)
            opt.__dict__.update(saved)
        log_dist(f"{SKIP_MESSAGE} (ZeRO stage 0, step {self.global_steps}: canzona_ds)", ranks=[0],
                 level=logging.WARNING)

    _take_model_step._canzona_stage0 = True
    engine_cls._take_model_step = _take_model_step

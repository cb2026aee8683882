"""The main job's single-process reference (``--compare``): ``reference.ReferenceOptimizer``
with the run's optimizer settings, same init, same global batches, same lr schedule.

It walks each step's global batch micro-batch by micro-batch in the order the DP ranks
would, scaling every micro loss by 1 / (grad_accum * dp), so its gradient is the average
DeepSpeed forms.  The settings come from the ds_config's optimizer section: a Canzona type
as is; DeepSpeed's own ``"Muon"`` as ``"CanzonaMuon"`` with the same keys (DeepSpeed-only
keys such as ``torch_adam`` are dropped), so the reference says what exact Muon would do.
"""
from __future__ import annotations

from canzona_ds.data import BatchSampler, DataConfig
from canzona_ds.models.qwen3 import build_model
from canzona_ds.train.config import RunConfig
from canzona_ds.train.schedule import lr_multiplier

#: DeepSpeed "Muon" params with no meaning for the reference (DeepSpeed implementation switches)
DEEPSPEED_ONLY_KEYS = ("torch_adam", "adam_w_mode", "fused")


def reference_config(optimizer_section: dict):
    """The CanzonaConfig the reference runs, from a ds_config ``optimizer`` section."""
    from canzona_ds.optim import OPTIMIZER_TYPES
    from canzona_ds.config import CanzonaConfig

    opt_type = str(optimizer_section.get("type"))
    params = dict(optimizer_section.get("params") or {})
    if opt_type.lower() == "muon":
        opt_type = "CanzonaMuon"
        params = {k: v for k, v in params.items() if k not in DEEPSPEED_ONLY_KEYS}
    if opt_type not in OPTIMIZER_TYPES:
        raise ValueError(f"The reference runs matrix optimizers: {sorted(OPTIMIZER_TYPES)} or 'Muon'; got {opt_type!r}.")
    return CanzonaConfig.from_ds(opt_type, params)


def run_reference(cfg: RunConfig, dp: int, optimizer_section: dict, steps: int) -> list[dict]:
    """Losses of the first ``steps`` optimizer steps: ``[{"step": n, "loss": ...}, ...]``."""
    from canzona_ds.reference import ReferenceOptimizer

    accum, _ = cfg.batch_layout(dp)
    config = reference_config(optimizer_section)
    model = build_model(cfg.model_config(), cfg.seed)
    opt = ReferenceOptimizer(model.named_parameters(), config)
    sampler = BatchSampler(DataConfig(corpus=cfg.corpus, seq_len=cfg.seq_len, seed=cfg.seed))
    rows = []
    for step in range(min(steps, cfg.steps)):
        mult = lr_multiplier(step, cfg.steps, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr_ratio)
        opt.set_lr(config.lr * mult, config.adam_lr * mult)
        total = 0.0
        for micro in range(accum):
            for rank in range(dp):
                x, y = sampler.micro_batch(step, micro, rank, dp, cfg.micro_batch, accum)
                loss = model(x, y)[1]
                (loss / (accum * dp)).backward()
                total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        rows.append({"step": step + 1, "loss": total / (accum * dp)})
    return rows


"""Single-process exact Muon reference: torch.optim.Muon (matrices) + torch.optim.AdamW (the
rest), same init, same global batches, same learning-rate schedule as the distributed run.

It walks each step's global batch micro-batch by micro-batch in the order the DP ranks
would, scaling every micro loss by 1 / (grad_accum * dp), so its gradient is the average
DeepSpeed forms.  Hyper-parameters come from the params block of a Muon-style ds_config
(keys as DeepSpeed's built-in Muon reads them: lr, muon_lr, adam_lr, momentum, betas, eps,
weight_decay).
"""
from __future__ import annotations

import torch

from canzona_ds.data import BatchSampler, DataConfig
from canzona_ds.models.qwen3 import build_model
from canzona_ds.planning.params import default_is_matrix
from canzona_ds.train.config import RunConfig
from canzona_ds.train.schedule import lr_multiplier

#: keys the reference needs spelled out in the ds_config (no guessing of defaults)
REQUIRED_KEYS = ("momentum", "weight_decay", "betas", "eps")


def reference_hparams(params: dict) -> dict:
    p = dict(params)
    missing = [k for k in REQUIRED_KEYS if k not in p]
    if "lr" not in p and not ("muon_lr" in p and "adam_lr" in p):
        missing.append("lr (or muon_lr and adam_lr)")
    if missing:
        raise ValueError(f"The Muon reference needs these optimizer params in the ds_config: {missing}. "
                         f"Got: {sorted(p)}")
    return {"muon_lr": float(p["muon_lr"] if "muon_lr" in p else p["lr"]),
            "adam_lr": float(p["adam_lr"] if "adam_lr" in p else p["lr"]),
            "momentum": float(p["momentum"]), "weight_decay": float(p["weight_decay"]),
            "betas": tuple(float(b) for b in p["betas"]), "eps": float(p["eps"])}


def run_reference(cfg: RunConfig, dp: int, optimizer_params: dict, steps: int) -> list[dict]:
    """Losses of the first ``steps`` optimizer steps: ``[{"step": n, "loss": ...}, ...]``."""
    accum, _ = cfg.batch_layout(dp)
    hp = reference_hparams(optimizer_params)
    model = build_model(cfg.model_config(), cfg.seed)
    matrices = [p for n, p in model.named_parameters() if default_is_matrix(n, tuple(p.shape))]
    others = [p for n, p in model.named_parameters() if not default_is_matrix(n, tuple(p.shape))]
    muon = torch.optim.Muon(matrices, lr=hp["muon_lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"],
                            nesterov=True, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(others, lr=hp["adam_lr"], betas=hp["betas"], eps=hp["eps"],
                              weight_decay=hp["weight_decay"])
    opts = (muon, adamw)
    base = [[g["lr"] for g in o.param_groups] for o in opts]
    sampler = BatchSampler(DataConfig(corpus=cfg.corpus, seq_len=cfg.seq_len, seed=cfg.seed))
    rows = []
    for step in range(min(steps, cfg.steps)):
        mult = lr_multiplier(step, cfg.steps, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr_ratio)
        for o, lrs in zip(opts, base):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * mult
        total = 0.0
        for micro in range(accum):
            for rank in range(dp):
                x, y = sampler.micro_batch(step, micro, rank, dp, cfg.micro_batch, accum)
                loss = model(x, y)[1]
                (loss / (accum * dp)).backward()
                total += float(loss.detach())
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        rows.append({"step": step + 1, "loss": total / (accum * dp)})
    return rows

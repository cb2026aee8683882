"""AdamW for the parameters no matrix rule updates: torch's functional AdamW, bit-exact against
``torch.optim.AdamW`` (the orchestrator, ``canzona_ds/optimizer.py``, runs it on its "aux" groups)."""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw as _adamw_functional


def adamw_group_step(group: dict, state_of) -> None:
    """One torch.optim.AdamW step (bit-exact) of a param group; ``state_of[p]`` is p's state dict.

    A parameter without a gradient steps with a zero one (DeepSpeed ZeRO's semantics)."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        state = state_of[p]
        if len(state) == 0:
            # torch.optim.AdamW's state layout: the step count is a host scalar, as torch keeps it
            # (capturable=False), so reading it never syncs with the device
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    beta1, beta2 = group["betas"]
    _adamw_functional(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
        differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=False,
    )

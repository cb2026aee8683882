"""ZeRO stage 3 test kit: a stage-3 ds_config for the tiny model, the whole parameters of a
partitioned engine, a training loop over given batches, and a recorder that replays every
hosted matrix update in one process.

``zero3_config`` sets ``stage3_param_persistence_threshold: 0`` so that every parameter of the
tiny model is really partitioned (DeepSpeed keeps parameters below the threshold whole on
every rank, which would hide partitioning bugs).

``sum_gradients_as_zero3`` makes a single-process reference model's autograd sum gradients in
ZeRO-3's association (see there).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .models import ds_config


def zero3_config(dp: int, **kwargs) -> dict:
    """``models.ds_config`` at ZeRO stage 3, every parameter partitioned; ``zero_optimization``
    entries in kwargs are merged in."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **kwargs.pop("zero_optimization", {})}
    return ds_config(dp, zero_optimization=zero, **kwargs)


class _ModuleInput(torch.autograd.Function):
    """The identity, as an autograd node of its own (forward: a detached alias; backward: the
    gradient unchanged)."""

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return t.detach()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: D102
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad


def _through(value):
    if isinstance(value, (tuple, list)):
        return type(value)(_through(v) for v in value)
    return _ModuleInput.apply(value) if isinstance(value, torch.Tensor) else value


def sum_gradients_as_zero3(model: nn.Module) -> list:
    """Make ``model``'s backward sum gradient contributions in ZeRO-3's association; returns the
    hook handles.

    ZeRO-3 registers on every module a forward pre-hook that passes the module's tensor inputs
    through an identity autograd Function (DeepSpeed 0.19.8
    ``runtime/zero/parameter_offload.py``: ``_post_backward_module_hook`` applies
    ``PostBackwardFunctionModule``, whose ``forward`` returns ``output.detach()``, to ``inputs``).
    A tensor that a module uses several times inside (an RMSNorm's ``x`` in ``x.pow(2)`` and
    ``x * rsqrt(...)``) and that is also used outside it (the residual stream) then gets its
    gradient as ``outside + (use_1 + use_2)``: the uses inside the module are summed at that
    node first.  Without the node autograd accumulates all three into one buffer as they arrive,
    ``(outside + use_a) + use_b``: the same sum in another association, so the gradients differ
    by ulps (an fp32 sum of three terms is not associative).  This registers the same identity,
    written here, at every module's positional tensor inputs (DeepSpeed's hook sees no keyword
    arguments either): the math is unchanged, the association is ZeRO-3's.  A model whose
    tensors have at most two uses (``TinyLM``) needs none of it."""
    return [m.register_forward_pre_hook(lambda module, args: _through(args)) for m in model.modules()]


def gathered_params(module: nn.Module) -> dict:
    """The whole parameters of a ZeRO-3 module as float32 numpy arrays (every rank calls).  One
    parameter at a time: DeepSpeed before 0.19.8 gathers several at once with a wait on the last
    all-gather only, which on gloo can return unwritten memory (ds_compat.KNOWN_BUGS); one is
    gathered by a path that waits (``Init._all_gather``, ``len(all_gather_list) == 1``)."""
    import deepspeed

    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().float().cpu().numpy().copy()  # as params_of
    return out


def train(engine, rank: int, data: list, micro: int = 2, gas: int = 1) -> list[float]:
    """Forward/backward/step over global batches ``data`` (one entry per micro-step; rank r
    takes rows [r*micro, (r+1)*micro)); returns the losses."""
    losses = []
    for x, y in data:
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


class ShardedStepRecorder:
    """Records, on every rank, the piece of every matrix a ZeRO-3 Canzona step saw (its gradient
    piece and its fp32 piece before and after); :meth:`replay` (every rank calls it: it gathers
    the pieces) reassembles the whole matrices and reruns the rule on them in one process from
    the same gradients, returning the largest difference from what the sharded step produced
    (rank 0; None elsewhere).  It checks the machinery bit for bit where the gradients cannot be
    reproduced in one process (4-rank summation order, bf16)."""

    def __init__(self, optimizer) -> None:
        self.opt = optimizer
        self.steps: list[dict] = []
        group = next(g for g in optimizer.param_groups if g["canzona_role"] == "matrix")
        self.start_step = group["step"]
        placement = optimizer.placement
        stock_items, stock_step = placement.items, optimizer._matrix_step
        pending: dict = {}

        def items(group):
            out = stock_items(group)
            pending.clear()
            pending.update({n: (g.detach().clone(), p.detach().clone(), p) for n, p, g in out})
            return out

        def step(group):
            stock_step(group)
            self.steps.append({"lr": group["lr"], "weight_decay": group["weight_decay"], "step": group["step"],
                               "pieces": {n: (g, before, after.detach().clone())
                                          for n, (g, before, after) in pending.items()}})

        placement.items, optimizer._matrix_step = items, step

    def replay(self) -> float | None:
        import torch.distributed as dist

        from canzona_ds.optim.rule import rule_step

        opt = self.opt
        group = opt.placement.hosted.runtime.group
        world = dist.get_world_size(group)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, self.steps, group=group)
        if dist.get_rank(group) != 0:
            return None
        splits = opt.placement.hosted.split
        state: dict = {}
        worst = 0.0
        for t, rec in enumerate(self.steps):
            for name, split in splits.items():
                grad, before, after = (split.assemble([gathered[r][t]["pieces"][name][k] for r in range(world)])
                                       for k in range(3))
                W = before.clone()
                rule_step(opt.rule, W, grad.clone(), state, opt.infos[name], rec["step"], rec["lr"],
                          rec["weight_decay"])
                worst = max(worst, float((W - after).abs().max()))
        return worst


def count_rule_calls(optimizer) -> list[int]:
    """A one-element list counting ``rule.direction`` calls of the hosted runtime (the host's
    whole-matrix update); the count goes up by the matrices this rank hosts per step."""
    runtime = optimizer.placement.hosted.runtime
    rule, calls = runtime.rule, [0]
    stock = rule.direction

    def direction(*args, **kwargs):
        calls[0] += 1
        return stock(*args, **kwargs)

    object.__setattr__(rule, "direction", direction)
    return calls


def as_tensors(params: dict) -> dict:
    return {n: torch.from_numpy(v) for n, v in params.items()}

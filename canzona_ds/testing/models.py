"""Small test models, data, and the two runners every ZeRO test compares.

``TinyLM``: an embedding, a LayerNorm, heterogeneous matrices (fused qkv 48x16, proj 16x16
+ bias, fc1 40x16, fc2 16x40), and an lm_head.  Shapes are chosen so DeepSpeed's stock
equal-chunk split cuts matrices at DP=2 and DP=4.

``run_engine``     a real DeepSpeed engine (call inside ``run_distributed``); rank r gets
                   rows [r*B, (r+1)*B) of each global batch.
``run_reference``  one process: each DP rank's gradient computed separately, averaged as
                   ZeRO averages them (each divided by dp, then summed), optionally
                   clipped as DeepSpeed clips, then ``optim.reference.ReferenceOptimizer``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, T = 32, 16, 6

#: hyper-parameters the distributed tests use, per optimizer type (small refresh periods so a
#: few steps include preconditioner refreshes)
HP = {
    "CanzonaMuon": dict(lr=0.02, adam_lr=0.01, momentum=0.9, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8),
    "CanzonaShampoo": dict(lr=0.01, adam_lr=0.01, weight_decay=0.1, betas=[0.9, 0.99], precondition_frequency=2,
                           start_preconditioning_step=2, epsilon=1e-8),
    "CanzonaSOAP": dict(lr=0.01, adam_lr=0.01, weight_decay=0.1, betas=[0.9, 0.95], precondition_frequency=2),
}
TYPES = tuple(HP)


class TinyLM(nn.Module):
    def __init__(self, with_matrices: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.with_matrices = with_matrices
        if with_matrices:
            self.qkv = nn.Linear(D, 3 * D, bias=False)
            self.proj = nn.Linear(D, D)
            self.fc1 = nn.Linear(D, 40, bias=False)
            self.fc2 = nn.Linear(40, D, bias=False)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.with_matrices:
            q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
            h = h + self.proj(F.silu(q) * k + v)
            h = h + self.fc2(F.gelu(self.fc1(h)))
        else:
            h = self.norm(h)
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten())


MATRICES = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")


def make_model(seed: int = 0, with_matrices: bool = True) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(with_matrices)


def batches(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (global_batch, T), generator=g),
             torch.randint(0, VOCAB, (global_batch, T), generator=g)) for _ in range(steps)]


def ds_config(dp: int, micro: int = 2, gas: int = 1, optimizer: str = "CanzonaMuon", params: dict | None = None,
              stage: int = 1, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "optimizer": {"type": optimizer, "params": dict(HP.get(optimizer, {}) if params is None else params)},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def params_of(module: nn.Module) -> dict:
    """Parameters as float32 numpy arrays (picklable across processes without shared memory)."""
    return {n: p.detach().float().numpy().copy() for n, p in module.named_parameters()}


def run_engine(rank: int, dp: int, cfg: dict, steps: int, micro: int = 2, gas: int = 1, seed: int = 0,
               model: nn.Module | None = None, after_init=None):
    """Train ``steps`` optimizer steps on a DeepSpeed engine; return (parameters, losses, engine)."""
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed

    model = make_model(seed) if model is None else model
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if after_init is not None:
        after_init(engine)
    losses = []
    for x, y in batches(steps * gas, micro * dp):
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return params_of(engine.module), losses, engine


def reference_grads(model: nn.Module, x: list, y: list, dp: int, micro: int, gas: int = 1) -> dict:
    """ZeRO's averaged gradient, in its order: per rank, accumulate grad(loss / gas) over the
    micro-steps; then divide by dp and sum over ranks (exact for power-of-two dp and gas)."""
    from canzona_ds.optim.reference import zero_average

    per_rank = []
    for r in range(dp):
        model.zero_grad(set_to_none=True)
        rows = slice(r * micro, (r + 1) * micro)
        for m in range(gas):
            (model(x[m][rows], y[m][rows]) / gas).backward()
        per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return zero_average(per_rank)


def run_reference(dp: int, steps: int, optimizer: str = "CanzonaMuon", params: dict | None = None, micro: int = 2,
                  gas: int = 1, seed: int = 0, clip: float = 0.0, model: nn.Module | None = None) -> dict:
    """The single-process reference on ZeRO's averaged (and DeepSpeed-clipped) gradients."""
    from canzona_ds.optim.config import CanzonaConfig
    from canzona_ds.optim.reference import ReferenceOptimizer, deepspeed_clip

    torch.set_num_threads(1)  # same reduction order as the 1-thread ranks
    cfg = CanzonaConfig.from_ds(optimizer, dict(HP[optimizer] if params is None else params))
    model = make_model(seed) if model is None else model
    opt = ReferenceOptimizer(model.named_parameters(), cfg)
    data = batches(steps * gas, micro * dp)
    for s in range(steps):
        chunk = data[s * gas:(s + 1) * gas]
        grads = deepspeed_clip(reference_grads(model, [c[0] for c in chunk], [c[1] for c in chunk], dp, micro, gas),
                               clip)
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.step()
    return params_of(model)


def max_abs_diff(a: dict, b: dict) -> float:
    return max(float(abs(a[k] - b[k]).max()) for k in a)


def clone(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)

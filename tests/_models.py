"""Small test models, data, and the two runners every ZeRO-1 test compares.

``TinyLM``: an embedding, a LayerNorm, heterogeneous matrices (fused qkv 48x16, proj 16x16
+ bias, fc1 40x16, fc2 16x40, a 3-D "conv" 8x4x4), and an lm_head.  Shapes are chosen so
the stock equal-chunk split cuts matrices at DP=2 and DP=4.

``run_engine``   a real DeepSpeed engine (call inside ``run_distributed``), rank r gets rows
                 [r*B, (r+1)*B) of each global batch.
``run_reference``  one process: per-rank gradients computed separately, averaged exactly as
                 ZeRO-1 does (each divided by dp, then summed), then torch.optim.Muon on the
                 matrices and torch.optim.AdamW on the rest.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, T = 32, 16, 6


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


def make_model(seed: int = 0, with_matrices: bool = True) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(with_matrices)


def batches(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (global_batch, T), generator=g),
             torch.randint(0, VOCAB, (global_batch, T), generator=g)) for _ in range(steps)]


HP = dict(lr=0.02, adam_lr=0.01, momentum=0.9, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)


def ds_config(dp: int, micro: int = 2, gas: int = 1, params: dict | None = None, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "optimizer": {"type": "CanzonaMuon", "params": dict(HP if params is None else params)},
        "zero_optimization": {"stage": 1},
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
    """Train ``steps`` optimizer steps on a DeepSpeed engine; return the final parameters."""
    import canzona_ds  # noqa: F401 - registers CanzonaMuon
    import deepspeed

    model = make_model(seed) if model is None else model
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if after_init is not None:
        after_init(engine)
    data = batches(steps * gas, micro * dp)
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for x, y in data:
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    del dtype
    return params_of(engine.module), losses, engine


def reference_grads(model: nn.Module, x: list, y: list, dp: int, micro: int, gas: int = 1):
    """ZeRO-1's averaged gradient, in its order: per rank, accumulate grad(loss / gas) over the
    micro-steps; then divide by dp and sum over ranks (exact for power-of-two dp and gas)."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r in range(dp):
        model.zero_grad(set_to_none=True)
        rows = slice(r * micro, (r + 1) * micro)
        for m in range(gas):
            (model(x[m][rows], y[m][rows]) / gas).backward()
        for n, p in model.named_parameters():
            total[n] += p.grad / dp
    return total


def run_reference(dp: int, steps: int, micro: int = 2, gas: int = 1, seed: int = 0, hp: dict | None = None,
                  clip: float = 0.0):
    """torch.optim.Muon (matrices) + torch.optim.AdamW (rest) on ZeRO-1's averaged gradients.

    ``clip > 0``: DeepSpeed's gradient clipping first: every gradient times
    ``1 / max(1, (global_l2_norm + 1e-6) / clip)`` (stage_1_and_2.unscale_and_clip_grads)."""
    from canzona_ds.integration.config import CanzonaMuonConfig

    torch.set_num_threads(1)  # same reduction order as the 1-thread ranks
    hp = dict(HP if hp is None else hp)
    cfg = CanzonaMuonConfig.from_params(hp)
    model = make_model(seed)
    mats = [p for n, p in model.named_parameters() if cfg.is_matrix(n, tuple(p.shape))]
    rest = [p for n, p in model.named_parameters() if not cfg.is_matrix(n, tuple(p.shape))]
    muon = torch.optim.Muon(mats, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                            nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, eps=cfg.ns_eps)
    adamw = torch.optim.AdamW(rest, lr=cfg.adam_lr, betas=tuple(cfg.betas), eps=cfg.eps,
                              weight_decay=cfg.weight_decay)
    data = batches(steps * gas, micro * dp)
    for s in range(steps):
        chunk = data[s * gas:(s + 1) * gas]
        grads = reference_grads(model, [c[0] for c in chunk], [c[1] for c in chunk], dp, micro, gas)
        if clip > 0:
            norm = sum(g.double().pow(2).sum() for g in grads.values()).sqrt()
            factor = torch.clamp((norm + 1e-6) / clip, min=1.0)
            grads = {n: g.mul(1.0 / factor) for n, g in grads.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n]
        muon.step()
        adamw.step()
    return params_of(model)


def max_abs_diff(a: dict, b: dict) -> float:
    return max(float(abs(a[k] - b[k]).max()) for k in a)


def clone(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)

"""Pipeline-parallel test kit: a tiny decoder as a DeepSpeed ``PipelineModule``, a runner for a
real ``PipelineEngine``, and an independent single-process reference.

The model (layer index = DeepSpeed's layer index = what a stage names its parameters by)::

    0  Embedding   weight [VOCAB, D]                      (TiedLayerSpec "embed" when tied)
    1  Block       norm, qkv [3D, D], proj [D, D] + bias, fc1 [F0, D], fc2 [D, F0]
    2  Block       ... F1
    3  Block       ... F2
    4  Block       ... F3
    5  FinalNorm   LayerNorm(D)
    6  Head        weight [VOCAB, D]   (tied: the layer-0 Embedding, used as F.linear(h, weight))
    loss_fn        cross entropy

Every layer builds its weights from its own seed (``seed + layer index``) inside a forked RNG,
so a stage builds exactly the values the plain :class:`ReferenceDecoder` holds, whatever
PipelineModule's ``seed_layers`` does and whichever stage builds the layer.

Canonical names (the reference module's) and a stage's names::

    stage name                        canonical
    "0.embed.weight"                  "embed.weight"
    "tied_modules.embed.embed.weight" "embed.weight"          (held by the first AND last stage)
    "3.fc1.weight"                    "blocks.2.fc1.weight"
    "5.norm.weight"                   "norm.weight"
    "6.head.weight"                   "head.weight"           (untied only)

A stage name keeps the fragments name-based matrix filters use (``embed``, ``head``), so a
parameter gets the same matrix/aux role under its stage name as under its canonical one.

Data: the samples of a run are one tensor of rows; DP rank ``d`` reads rows ``d, d+dp, d+2dp,
...`` (``torch.utils.data.DistributedSampler(shuffle=False)``, what
``PipelineEngine._build_data_iter`` uses), ``micro`` rows per micro-batch, ``gas`` micro-batches
per ``train_batch``.

Gradient order of DeepSpeed's pipeline (``TrainSchedule``: forward/backward of every micro-batch,
then ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``)::

    per stage, per micro-batch m:  p.grad += d(loss_m / gas)/dp     (DeepSpeedEngine.backward scales by gas)
    tied weight:                   all_reduce over the tie group (first + last stage of one DP replica):
                                   (sum_m embedding-use grads) + (sum_m head-use grads)
    DP:                            ZeRO-0: (sum over DP ranks) * (1/dp);  ZeRO-1: sum of grad/dp
    step:                          every stage steps its own parameters (ZeRO-1: its DP shard)

:func:`run_pipe_reference` reproduces that order in one process without DeepSpeed.
"""
from __future__ import annotations

from canzona_testkit.kernels import bits_differ, test_threads
import contextlib
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .models import VOCAB, D, T, params_of

#: widths of the four blocks' MLPs (different per block: the matrices have different shapes)
FFN: tuple[int, ...] = (40, 24, 40, 24)
NUM_LAYERS = len(FFN) + 3
#: canonical module name of each layer index
CANONICAL: tuple[str, ...] = ("embed", *(f"blocks.{i}" for i in range(len(FFN))), "norm", "head")
TIE_KEY = "embed"


@contextlib.contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class Embedding(nn.Module):
    """Layer 0.  The attribute is named ``embed`` so a stage's name (``0.embed.weight``) keeps
    the fragment the name-based matrix filters look for, like the canonical ``embed.weight``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with _seeded(seed):
            self.embed = nn.Embedding(VOCAB, D)

    def forward(self, x: Tensor) -> Tensor:
        return self.embed(x)


def tied_head(embedding: Embedding, h: Tensor) -> Tensor:
    """The last stage's use of the tied embedding: logits = h @ W_embed^T (GPT-2's tie)."""
    return F.linear(h, embedding.embed.weight)


class Block(nn.Module):
    """TinyLM's residual block: attention-ish fused qkv + proj, then an MLP of width ``ffn``."""

    def __init__(self, seed: int, ffn: int) -> None:
        super().__init__()
        with _seeded(seed):
            self.norm = nn.LayerNorm(D)
            self.qkv = nn.Linear(D, 3 * D, bias=False)
            self.proj = nn.Linear(D, D)
            self.fc1 = nn.Linear(D, ffn, bias=False)
            self.fc2 = nn.Linear(ffn, D, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        h = h + self.proj(F.silu(q) * k + v)
        return h + self.fc2(F.gelu(self.fc1(h)))


class FinalNorm(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        with _seeded(seed), torch.no_grad():  # not the trivial ones/zeros, so a wrong copy shows
            self.norm.weight.add_(0.1 * torch.randn(D))
            self.norm.bias.add_(0.1 * torch.randn(D))

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(h)


class Head(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        with _seeded(seed):
            self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.head(h)


def loss_fn(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def layer_specs(tied: bool = False, seed: int = 0) -> list:
    """The LayerSpecs of the tiny decoder (layer i seeded with ``seed + i``)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    embed = (TiedLayerSpec(TIE_KEY, Embedding, seed, tied_weight_attr=["embed.weight"]) if tied
             else LayerSpec(Embedding, seed))
    head = (TiedLayerSpec(TIE_KEY, Embedding, seed, forward_fn=tied_head, tied_weight_attr=["embed.weight"]) if tied
            else LayerSpec(Head, seed + NUM_LAYERS - 1))
    blocks = [LayerSpec(Block, seed + 1 + i, f) for i, f in enumerate(FFN)]
    return [embed, *blocks, LayerSpec(FinalNorm, seed + NUM_LAYERS - 2), head]


def build_pipe(num_stages: int, tied: bool = False, seed: int = 0, partition_method: str = "uniform"):
    """The tiny decoder as a ``PipelineModule`` (needs torch.distributed initialised)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    # PipelineModule asks deepspeed.comm for ranks; this wraps the existing torch process group
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    return PipelineModule(layers=layer_specs(tied, seed), num_stages=num_stages, loss_fn=loss_fn,
                          partition_method=partition_method)


def canonical_name(stage_name: str) -> str:
    """A stage's parameter name -> the reference module's name (see the module docstring)."""
    tied_prefix = f"tied_modules.{TIE_KEY}."
    if stage_name.startswith(tied_prefix):
        return stage_name[len(tied_prefix):]
    index, rest = stage_name.split(".", 1)
    module = CANONICAL[int(index)]
    # embed/norm/head layers hold their module under its canonical name; blocks are the layer
    return rest if module in ("embed", "norm", "head") else f"{module}.{rest}"


class _HeadUse(torch.autograd.Function):
    """Identity on the tied weight whose backward sends the head's gradient to ``sink`` instead of
    the shared parameter, so the two uses accumulate separately over micro-batches, as the first
    and last stage do before the tie all-reduce."""

    @staticmethod
    def forward(ctx, weight: Tensor, sink: dict) -> Tensor:  # noqa: D102
        ctx.sink = sink
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        sink = ctx.sink
        sink["grad"] = grad.clone() if sink.get("grad") is None else sink["grad"] + grad
        return None, None


class ReferenceDecoder(nn.Module):
    """The same layers in one plain module (canonical names).  ``tied_grad``: "per_use" keeps the
    head's gradient apart until :meth:`merge_tied_grad` (the pipeline's summation order);
    "shared" lets autograd add both uses into one parameter every micro-batch."""

    def __init__(self, tied: bool = False, seed: int = 0, tied_grad: str = "per_use") -> None:
        super().__init__()
        if tied_grad not in ("per_use", "shared"):
            raise ValueError(f"Invalid tied_grad={tied_grad!r}. Allowed: ['per_use', 'shared'].")
        self.tied, self.tied_grad = tied, tied_grad
        # the pipeline layers' modules themselves, so the values are the stages' by construction
        self.embed = Embedding(seed).embed
        self.blocks = nn.ModuleList(Block(seed + 1 + i, f) for i, f in enumerate(FFN))
        self.norm = FinalNorm(seed + NUM_LAYERS - 2).norm
        self.head = None if tied else Head(seed + NUM_LAYERS - 1).head
        self._head_use: dict = {}

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        if self.head is not None:
            logits = self.head(h)
        elif self.tied_grad == "per_use":
            logits = F.linear(h, _HeadUse.apply(self.embed.weight, self._head_use))
        else:
            logits = F.linear(h, self.embed.weight)
        return loss_fn(logits, y)

    def merge_tied_grad(self) -> None:
        """Add the head's accumulated gradient to the embedding's (the tie all-reduce)."""
        g = self._head_use.pop("grad", None)
        if g is not None:
            w = self.embed.weight
            w.grad = g if w.grad is None else w.grad + g


def dataset(num_samples: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """``num_samples`` rows of (input ids, labels), each [num_samples, T]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (num_samples, T), generator=g),
            torch.randint(0, VOCAB, (num_samples, T), generator=g))


def rank_micro_batches(x: Tensor, y: Tensor, dp: int, dp_rank: int, micro: int) -> list[tuple[Tensor, Tensor]]:
    """DP rank ``dp_rank``'s micro-batches, as DeepSpeed's pipeline loader deals them
    (``DistributedSampler(num_replicas=dp, rank=dp_rank, shuffle=False)``, batches of ``micro``)."""
    from torch.utils.data import DistributedSampler

    rows = list(DistributedSampler(range(len(x)), num_replicas=dp, rank=dp_rank, shuffle=False))
    return [(x[rows[i:i + micro]], y[rows[i:i + micro]]) for i in range(0, len(rows) - micro + 1, micro)]


def run_pipe_engine(rank: int, world: int, cfg: dict, pp: int, steps: int, tied: bool = False, seed: int = 0,
                    data_seed: int = 1, partition_method: str = "uniform", after_init=None) -> dict:
    """Train ``steps`` ``train_batch`` calls of the tiny decoder on a real ``PipelineEngine``
    (call inside ``run_distributed``; DP = world / pp).  Returns this rank's
    ``params`` (canonical name -> float32 numpy), ``losses`` (``train_batch``'s DP- and
    gas-averaged loss per step), ``stage``, ``dp_rank``, ``names`` (stage name -> canonical),
    ``replicated`` (stage names marked ``ds_pipe_replicated``)."""
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed

    if world % pp:
        raise ValueError(f"Invalid pp={pp}: must divide world={world}.")
    dp = world // pp
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    module = build_pipe(pp, tied, seed, partition_method)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()
                                                                          if p.requires_grad], config=cfg)
    if after_init is not None:
        after_init(engine)
    grid = module.mpu()
    dp_rank = grid.get_data_parallel_rank()
    x, y = dataset(steps * gas * micro * dp, data_seed)
    data = iter(rank_micro_batches(x, y, dp, dp_rank, micro))
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    named = list(module.named_parameters())
    return {"params": {canonical_name(n): v for n, v in params_of(module).items()},
            "losses": losses, "stage": grid.get_stage_id(), "dp_rank": dp_rank,
            "names": {n: canonical_name(n) for n, _ in named},
            "replicated": [n for n, p in named if getattr(p, "ds_pipe_replicated", False)]}


def dp_average(per_rank: list[dict], stage: int) -> dict:
    """The DP average in DeepSpeed's order: ZeRO-0's all-reduce sums then scales by 1/dp
    (``allreduce_bucket``, postscale); ZeRO-1 sums grad/dp (``zero_average``)."""
    from canzona_ds.reference import zero_average

    if stage >= 1:
        return zero_average(per_rank)
    total = {n: torch.zeros_like(g) for n, g in per_rank[0].items()}
    for grads in per_rank:
        for n, g in grads.items():
            total[n] += g
    return {n: g.mul_(1.0 / len(per_rank)) for n, g in total.items()}


def run_pipe_reference(steps: int, dp: int, gas: int, optimizer_fn: Callable[[list], object], micro: int = 2,
                       tied: bool = False, seed: int = 0, data_seed: int = 1, stage: int = 1,
                       tied_grad: str = "per_use", clip: float = 0.0,
                       clip_fn: Callable[[list], None] | None = None) -> dict:
    """The pipeline run in one process, independent of DeepSpeed: every DP rank's micro-batches
    through :class:`ReferenceDecoder`, gradients accumulated and averaged in the pipeline's order
    (module docstring), optionally clipped by ``torch.nn.utils.clip_grad_norm_(params, clip)``
    (``clip`` > 0) or by ``clip_fn(named_params)`` (to model another rule), then
    ``optimizer_fn(named_params).step()``.  ``optimizer_fn`` gets ``[(canonical name, param)]``
    (e.g. ``lambda named: torch.optim.AdamW([p for _, p in named], ...)`` or
    ``lambda named: ReferenceOptimizer(named, canzona_config)``).
    Returns ``params`` (canonical name -> float32 numpy) and ``losses`` (per step, averaged as
    ``train_batch`` reports it)."""
    torch.set_num_threads(test_threads())  # the ranks' reduction order
    model = ReferenceDecoder(tied, seed, tied_grad)
    named = list(model.named_parameters())
    opt = optimizer_fn(named)
    x, y = dataset(steps * gas * micro * dp, data_seed)
    per_rank_batches = [rank_micro_batches(x, y, dp, r, micro) for r in range(dp)]
    losses = []
    for s in range(steps):
        per_rank_grads, rank_losses = [], []
        for r in range(dp):
            model.zero_grad(set_to_none=True)
            total = None
            for xb, yb in per_rank_batches[r][s * gas:(s + 1) * gas]:
                loss = model(xb, yb)
                total = loss.detach().clone() if total is None else total + loss.detach()
                (loss / gas).backward()
            model.merge_tied_grad()
            rank_losses.append(total / gas)
            per_rank_grads.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                                   for n, p in named})
        agg = rank_losses[0].clone()
        for l in rank_losses[1:]:
            agg += l
        losses.append(float(agg / dp) if dp > 1 else float(agg))
        grads = dp_average(per_rank_grads, stage)
        for n, p in named:
            p.grad = grads[n]
        if clip_fn is not None:
            clip_fn(named)
        elif clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
        opt.step()
        model.zero_grad(set_to_none=True)
    return {"params": params_of(model), "losses": losses}


def merge_stages(results: Iterable[dict]) -> dict:
    """One dict of canonical parameters from every rank's :func:`run_pipe_engine` result; a
    parameter held by several ranks (DP replicas, a tied weight on two stages) must agree
    bit for bit, else ValueError."""
    import numpy as np

    merged: dict = {}
    for r in results:
        for n, v in r["params"].items():
            if n in merged and bits_differ(merged[n], v):
                raise ValueError(f"ranks disagree on {n}: max diff {float(np.abs(merged[n] - v).max())}")
            merged.setdefault(n, v)
    return merged

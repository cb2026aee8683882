"""Small test models, data, and the two runners every ZeRO test compares.

``TinyLM``: an embedding, a LayerNorm, heterogeneous matrices (fused qkv 48x16, proj 16x16
+ bias, fc1 40x16, fc2 16x40), and an lm_head.  Shapes are chosen so DeepSpeed's stock
equal-chunk split cuts matrices at DP=2 and DP=4.

``run_engine``     a real DeepSpeed engine (call inside ``run_distributed``); rank r gets
                   rows [r*B, (r+1)*B) of each global batch.
``run_reference``  one process: each DP rank's gradient computed separately, averaged as
                   ZeRO averages them (each divided by dp, then summed), optionally
                   clipped by ``torch.nn.utils.clip_grad_norm_``, then
                   ``reference.ReferenceOptimizer``.
"""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import copy
import math

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
    # eps 1e-6, not SOAP's 1e-8: a tall matrix's left factor is rank-deficient (rank <= cols), so
    # its null-space eigenvectors carry rounding noise (~1e-9 on these O(0.1) gradients) that
    # SOAP divides by sqrt(V) + eps; with eps far above the noise, runs that differ only by
    # rounding (4-rank summation order, bf16) stay close, as they do at LLM gradient scales
    "CanzonaSOAP": dict(lr=0.01, adam_lr=0.01, weight_decay=0.1, betas=[0.9, 0.95], precondition_frequency=2,
                        eps=1e-6),
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


def ds_config(dp: int, micro: int = 2, gas: int = 1, optimizer: str | dict = "CanzonaMuon", params: dict | None = None,
              stage: int = 1, **extra) -> dict:
    """A ds_config for the tiny model; ``optimizer`` is a type name (params default to ``HP``)
    or a whole ds_config optimizer section."""
    section = optimizer if isinstance(optimizer, dict) else {
        "type": optimizer, "params": dict(HP.get(optimizer, {}) if params is None else params)}
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "optimizer": section,
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
    return {n: p.detach().float().cpu().numpy().copy() for n, p in module.named_parameters()}


def run_engine(rank: int, dp: int, cfg: dict, steps: int, micro: int = 2, gas: int = 1, seed: int = 0,
               model: nn.Module | None = None, after_init=None, data: list | None = None):
    """Train ``steps`` optimizer steps on a DeepSpeed engine; return (parameters, losses, engine).
    ``data``: the global batches (default ``batches(steps * gas, micro * dp)``)."""
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed

    model = make_model(seed) if model is None else model
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if after_init is not None:
        after_init(engine)
    losses = []
    for x, y in (data if data is not None else batches(steps * gas, micro * dp)):
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return params_of(engine.module), losses, engine


def reference_grads(model: nn.Module, x: list, y: list, dp: int, micro: int, gas: int = 1, stage: int = 1) -> dict:
    """ZeRO's averaged gradient, in its order (exact for power-of-two dp and gas):

    * stage 1: per rank, accumulate grad(loss / gas) over the micro-steps; at the boundary
      divide by dp and sum over ranks;
    * stage 2: every micro-step's gradient is averaged over the ranks right away (divided by
      dp, summed) and the averages are accumulated."""
    from canzona_ds.reference import zero_average

    def grads_of(r: int, steps: range) -> dict:
        model.zero_grad(set_to_none=True)
        rows = slice(r * micro, (r + 1) * micro)
        for m in steps:
            (model(x[m][rows], y[m][rows]) / gas).backward()
        # a parameter this rank's batch did not use contributes zeros (DeepSpeed's reduction)
        return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}

    if stage == 2 and gas > 1:
        total = None
        for m in range(gas):
            avg = zero_average([grads_of(r, range(m, m + 1)) for r in range(dp)])
            total = avg if total is None else {n: total[n] + avg[n] for n in total}
        return total
    return zero_average([grads_of(r, range(gas)) for r in range(dp)])


def run_reference(dp: int, steps: int, optimizer: str = "CanzonaMuon", params: dict | None = None, micro: int = 2,
                  gas: int = 1, seed: int = 0, clip: float = 0.0, model: nn.Module | None = None,
                  stage: int = 1, data: list | None = None, device: str = "cpu") -> dict:
    """The single-process reference on ZeRO's averaged gradients, clipped (``clip`` > 0) by torch's
    ``clip_grad_norm_(model.parameters(), clip)``, on ``device`` ("cuda": the first GPU, to
    compare with a CUDA run kernel for kernel)."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    torch.set_num_threads(test_threads())  # same reduction order as the 1-thread ranks
    cfg = CanzonaConfig.from_ds(optimizer, dict(HP[optimizer] if params is None else params))
    model = (make_model(seed) if model is None else model).to(device)
    opt = ReferenceOptimizer(model.named_parameters(), cfg)
    data = [(x.to(device), y.to(device)) for x, y in (data if data is not None else batches(steps * gas, micro * dp))]
    for s in range(steps):
        chunk = data[s * gas:(s + 1) * gas]
        grads = reference_grads(model, [c[0] for c in chunk], [c[1] for c in chunk], dp, micro, gas, stage)
        for n, p in model.named_parameters():
            p.grad = grads[n]
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return params_of(model)


def reordered_sum_bound(per_rank: list[dict]) -> dict:
    """Per element, how far an average of ``per_rank`` gradients (each divided by dp, a power of
    two: exact) may be from the same average summed in another order: for n fp32 terms in any
    order |sum - sum'| <= 2 (n - 1) u sum|t_i| (u = 2^-24; the classic bound on each of the two
    sums is (n - 1) u sum|t_i| to first order)."""
    dp = len(per_rank)
    u = 2.0 ** -24
    return {n: 2 * (dp - 1) * u * sum(g[n].abs() for g in per_rank) / dp for n in per_rank[0]}


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest |a - b| over the arrays of ``a``; 0.0 (both equal bit for bit) enrolls the running
    test in .ci/kernels' rerun, as a zero-tolerance assertion does (canzona_testkit/kernels.py)."""
    d = max(float(abs(a[k] - b[k]).max()) for k in a)
    if not d:
        from canzona_testkit.kernels import note_exact

        note_exact()
    return d


#: largest rows/cols (or cols/rows) of a matrix in the test models; torch.optim.Muon's
#: ``adjust_lr_fn`` scales the step by sqrt(max(1, rows/cols)) <= sqrt(4) = 2
TEST_MATRIX_ASPECT = 4.0
#: largest change of one element of bf16 Newton-Schulz's output (spectral norm ~1) when up to 32
#: elements of its input round to the neighbouring bf16 value: measured 0.050 over the test
#: shapes (tests/test_portability.py re-measures it on the running CPU and asserts this bound)
NS_FLIP_BOUND = 2.0 ** -3


#: bf16 Newton-Schulz's relative Frobenius distance from the exact iteration: bf16 keeps 8
#: significant bits (relative step 2^-8 per product) over the iteration's 15 products, 15 x 2^-8
#: (tests/test_optim_muon.py test_fp32_newton_schulz_distance_from_bf16 asserts it against the
#: fp32 iteration on the running CPU: 0.012-0.021 measured)
NS_BF16_REL = 15 * 2.0 ** -8
#: largest singular value of Newton-Schulz's output (its quintic overshoots 1; measured ~1.2,
#: asserted < 1.3 by tests/test_optim_muon.py test_gram_is_as_stable_as_standard_in_bf16)
NS_SPECTRAL_MAX = 1.3


def ns_fp32_rel(shape: tuple[int, int]) -> float:
    """fp32 Newton-Schulz's relative Frobenius distance from the exact iteration, rounded to the
    bf16 direction the rule returns: each of the iteration's 15 products has inner dimension at
    most k = max(m, n), so it is off by at most k u (u = 2^-24) relative (the classical gamma_k
    bound of a dot product, iterates of spectral norm <= NS_SPECTRAL_MAX), 15 k u over the
    iteration; the final rounding to bf16 (8 significant bits) moves each element by at most half
    an ulp, 2^-8 of it.  Measured: two fp32 paths 0.0 apart (issue 46); the bound is 1/15 of
    NS_BF16_REL, so a step 10% off (lr x 0.9) exceeds it (tests/test_optim_muon.py)."""
    return 15 * max(shape) * 2.0 ** -24 + 2.0 ** -8


def muon_kernel_tolerance(shape: tuple[int, int], sizes: list[float], weight_norm: float,
                          ns_dtype: torch.dtype = torch.bfloat16) -> float:
    """Frobenius distance allowed between two Muon runs of one matrix (``shape``) whose Newton-Schulz
    runs through other GEMM kernels (batched over matrices or heads vs one at a time) on the same
    gradients, ``sizes`` the per-step step sizes (lr x shape scale), ``ns_dtype`` the dtype the
    iteration's products run in.

    Each side's direction O_t is within rel ||O_t||_F of the exact iteration's (rel: NS_BF16_REL
    in bf16, ``ns_fp32_rel`` in fp32), so the two are within 2 rel ||O_t||_F <= 2 rel
    NS_SPECTRAL_MAX sqrt(min(m, n)); the weights' difference obeys D_t = decay D_{t-1} + size_t
    dO_t (decay <= 1), plus each side's fp32 roundings of the decay and the add (two of at most
    u ||W||_F per side per step): summed over steps."""
    if ns_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"Invalid ns_dtype={ns_dtype}. Allowed: [torch.bfloat16, torch.float32].")
    u = 2.0 ** -24
    rel = NS_BF16_REL if ns_dtype == torch.bfloat16 else ns_fp32_rel(shape)
    per_direction = 2 * rel * NS_SPECTRAL_MAX * math.sqrt(min(shape))
    return sum(sizes) * per_direction + len(sizes) * 2 * 2 * u * weight_norm


def muon_reordered_sum_tolerance(steps: int, lr: float | None = None) -> float:
    """How far Muon may end from a reference that sums the same gradients in another order.

    Where it applies: a 4-rank all-reduce (or a DP=2 run resumed at DP=4, or TP-split products)
    adds the same fp32 terms as the single-process reference, associated differently, so each
    averaged gradient element is a few ulps (u = 2^-24) off the reference's; with clipping the
    global norm is too, so the clip coefficient moves *every* element by ~1 ulp.  Which bits come
    out depends on the CPU's kernels (AVX-512 or AVX2 sgemm in the forward and backward passes),
    so neither bit-exactness nor "an ulp stays an ulp" is a promise here:

    * Muon rounds its Newton-Schulz input to bfloat16 (8 significant bits).  An element within an
      fp32 ulp of a bf16 rounding boundary rounds to the neighbouring bf16 value instead;
    * every product of the iteration is rounded to bf16 again, so such a flip cascades: one output
      element (of a matrix with spectral norm ~1) moves by up to ``NS_FLIP_BOUND``;
    * the update is ``lr * sqrt(max(1, rows/cols)) * O``, so one step moves a weight by at most
      lr * sqrt(TEST_MATRIX_ASPECT) * NS_FLIP_BOUND, and over ``steps`` steps the moves add up
      (the weights' divergence feeds the next gradients at the same order, which the normalised
      update does not amplify further).

    So |param - reference| <= steps * lr * sqrt(TEST_MATRIX_ASPECT) * NS_FLIP_BOUND.  That is the
    size of one step's update: bf16 Newton-Schulz makes an end-to-end comparison under reordered
    sums a check against blow-ups only (measured: 2e-4 and below).  The exact part of such runs is
    checked exactly elsewhere, on any CPU: every owner's update replayed bit for bit from the
    gradient it received (``MatrixStepRecorder``), and the same scenarios at world 2, whose
    two-term sums are commutative, bit for bit against the reference."""
    lr = HP["CanzonaMuon"]["lr"] if lr is None else lr
    return steps * lr * math.sqrt(TEST_MATRIX_ASPECT) * NS_FLIP_BOUND


def clone(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


class MatrixStepRecorder:
    """Records what a :class:`~canzona_ds.optimizer.CanzonaOptimizer` does to every matrix it
    updates locally: per step, the gradient and master weight each saw, and the weight after.

    :meth:`replay` reruns the rule from those gradients in a single process and returns the
    largest difference from what the optimizer produced, so the machinery (flat-partition
    views, state, step counts, scales) is checked bit for bit even where the gradients
    themselves are not reproducible in one process (bf16/fp16 forward passes, DP=4 summation
    order)."""

    def __init__(self, optimizer) -> None:
        self.opt = optimizer
        self.steps: list[dict] = []
        #: per step, the lr and weight decay its matrix group ran with
        self.hparams: list[tuple] = []
        # replay starts from the state the optimizer has now (a resumed run's loaded state)
        group = next((g for g in optimizer.param_groups if g["canzona_role"] == "matrix"), {"step": 0})
        self.start_step = group["step"]
        self.start_state = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                            for n, st in optimizer.matrix_state.items()}
        placement = optimizer.placement
        stock_items, stock_step = placement.items, optimizer._matrix_step
        pending: dict = {}

        def items(group):
            out = stock_items(group)
            pending.clear()
            pending.update({n: (g.detach().clone(), p.detach().clone(), p) for n, p, g in out
                            if n not in optimizer.tp_matrices})
            return out

        def step(group):
            stock_step(group)
            record = {n: (g, before, after.detach().clone()) for n, (g, before, after) in pending.items()}
            if group["step"] > self.start_step + len(self.steps):  # the step's first matrix group
                self.steps.append(record)
                self.hparams.append((group["lr"], group["weight_decay"]))  # (a schedule moves them)
            else:  # MoE: one matrix group per expert group, each stepped in turn
                self.steps[-1].update(record)

        placement.items, optimizer._matrix_step = items, step

    def replay(self) -> float:
        from canzona_ds.optim.rule import rule_step

        rule, worst = self.opt.rule, 0.0
        state = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                 for n, st in self.start_state.items()}
        for t, (record, (lr, wd)) in enumerate(zip(self.steps, self.hparams), start=self.start_step + 1):
            for name, (grad, before, after) in record.items():
                W = before.clone()
                rule_step(rule, W, grad.clone(), state, self.opt.infos[name], t, lr, wd)
                worst = max(worst, float((W - after).abs().max()))
        return worst

    def summary(self) -> dict:
        """Steps, matrices, the replay's largest difference, and each matrix's first-step gradient
        as the optimizer received it (``first_grads``, numpy)."""
        first = {n: g.float().numpy() for n, (g, _, _) in self.steps[0].items()} if self.steps else {}
        return {"steps": len(self.steps), "matrices": sorted({n for s in self.steps for n in s}),
                "replay_max_diff": self.replay(), "first_grads": first}


class TinyAttention(nn.Module):
    """An attention block named like HF models (q_proj/k_proj/v_proj/o_proj) with an HF-style
    ``config``, so DeepSpeed's per-head resolution recognises it: q_proj holds 4 heads of
    head_dim 8, k_proj/v_proj 2 KV heads (GQA), hidden 6 (so a head, 8 x 6, is taller than
    wide and the per-head learning-rate scale sqrt(8/6) differs from the whole matrix's)."""

    HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 6

    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        h, hd = self.HIDDEN, self.HEAD_DIM
        self.config = SimpleNamespace(num_attention_heads=self.HEADS, num_key_value_heads=self.KV_HEADS,
                                      hidden_size=h, head_dim=hd, model_type="llama")
        self.embed = nn.Embedding(VOCAB, h)
        self.q_proj = nn.Linear(h, self.HEADS * hd, bias=False)
        self.k_proj = nn.Linear(h, self.KV_HEADS * hd, bias=False)
        self.v_proj = nn.Linear(h, self.KV_HEADS * hd, bias=False)
        self.o_proj = nn.Linear(self.HEADS * hd, h, bias=False)
        self.lm_head = nn.Linear(h, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        B, T, _ = h.shape
        rep = self.HEADS // self.KV_HEADS
        q = self.q_proj(h).view(B, T, self.HEADS, self.HEAD_DIM).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.KV_HEADS, self.HEAD_DIM).transpose(1, 2).repeat_interleave(rep, 1)
        v = self.v_proj(h).view(B, T, self.KV_HEADS, self.HEAD_DIM).transpose(1, 2).repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        h = h + self.o_proj(a)
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten())


def make_attention_model(seed: int = 0) -> TinyAttention:
    torch.manual_seed(seed)
    return TinyAttention()

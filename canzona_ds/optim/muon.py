"""Muon (Jordan et al.): momentum, then Newton-Schulz orthogonalisation of the whole matrix.

:class:`MuonRule` with the default settings is bit-for-bit ``torch.optim.Muon`` (torch
2.13): momentum as ``buf.lerp_(grad, 1 - momentum)``, Nesterov as
``grad.lerp(buf, momentum)``, Newton-Schulz in bfloat16 on the wide orientation of the
matrix, torch's ``adjust_lr_fn`` scaling, then decoupled weight decay (tests check it).

``ns_method``:
    "standard"  torch.optim.Muon's quintic iteration X <- aX + (bA + cA^2)X, A = X X^T.
    "gram"      the same polynomial iterated on the small Gram matrix R = X X^T (m x m
                for a wide m x n X): X_k = Q_k X_0, so only the last product touches n.
                Squaring the matrix squares its condition number, so in half precision R
                loses the small singular values; as the Gram Newton-Schulz method
                prescribes, the iteration restarts (X = Q X, R recomputed from X) after
                ``GRAM_RESTART`` iterations.  Without the restart a bf16 Gram iteration
                reached singular values of 1e3-5e5 on power-law and near-rank-1 spectra;
                with it they stay at ~1.2 like "standard" (tests/test_optim_muon.py).  It
                runs in bfloat16 like "standard", so its directions have the same dtype.
                Equal to "standard" in exact arithmetic; differs by rounding: opt-in.

``ns_dtype`` (the dtype the iteration's matrix products run in):
    "bf16"  torch.optim.Muon's choice and the default: bit-exact with it.
    "fp32"  every product in float32.  The direction is still returned in bfloat16 (the dtype
            torch.optim.Muon adds to the parameter, and what TP/ZeRO-3 hosts send back), so
            only the iteration's rounding changes: measured distance from the bf16 result and
            cost in docs/optimizers.md (benchmarks/bench_ns_dtype.py).  For CPUs without bf16
            matrix kernels (AVX2-only x86: oneDNN falls back to a ~40x slower path).
    "auto"  per device, once per process: time one bf16 and one fp32 product of
            ``PROBE_SIZE``^3 on that device and run fp32 only when bf16 is more than
            ``AUTO_SLOWDOWN`` times slower (a wide factor, not "slower at all", so that timing
            noise cannot make two processes on one kind of machine choose differently).

Batching (``ns_batch``): k matrices of one shape on one rank -- the experts of a stack
(``stack_direction`` via :func:`~canzona_ds.optim.rule.rule_step`) and the same-shape whole
matrices a rank owns (:func:`~canzona_ds.optim.rule.rule_steps`, e.g. the q_proj of every layer)
-- run as ONE Newton-Schulz of shape (k, m, n) instead of k of (m, n)::

    updates u_1 .. u_k, each (m, n)  --stack-->  X (k, m, n)  --newton_schulz-->  O (k, m, n)
                                                 (bmm/baddbmm: one kernel per product)

but only where that is bit-identical per matrix to the one-at-a-time path on this device:
a batched product need not round like the single one (MKL's fp32 bmm on an AVX512 Xeon differs
for 7x33 and 96x384 slices; its bf16 path matched on every shape tried).  So
:meth:`MuonRule.batch_is_exact` runs both on random matrices of the exact (k, m, n, input dtype,
iteration dtype, settings, device, thread count) once per process, and a batch whose probe
differs runs one matrix at a time.

Per-head (``num_heads``, DeepSpeed's ``per_head_muon``): an attention projection of shape
(heads * head_dim, in) is orthogonalised head by head, (heads, head_dim, in) batched, and
the learning rate is scaled by the head's shape (DeepSpeed's semantics).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .rule import Flops, MatrixInfo, MatrixRule, check_bool, check_choice, check_int, check_number, matmul_flops

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("standard", "gram")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "none")
#: largest accepted ns_steps: torch.optim.Muon, the reference, refuses ns_steps >= 100 (and a
#: count of 1e9 would hang the step; 99 is ~20x the default)
MAX_NS_STEPS = 99
#: largest accepted |coefficient| (known coefficient sets stay below 10); bigger values
#: overflow bf16 after a few iterations and turn every matrix non-finite
MAX_NS_COEFFICIENT = 100.0
#: gram: iterations between restarts (DeepSpeed's gram Muon restarts after 2)
GRAM_RESTART = 2
#: ns_dtype key -> the dtype of the iteration's products ("auto" resolves to one of these per device)
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NS_DTYPE_CHOICES = (*NS_DTYPES, "auto")
#: "auto": side of the square products the probe times on each device
PROBE_SIZE = 256
#: "auto": fp32 is chosen when a bf16 product is more than this many times slower than fp32.
#: Measured (bf16 / fp32 time of the probe): AVX2-only x86 (oneDNN without bf16 kernels) ~90x;
#: an AVX512-bf16 Xeon ~1.9x; GPUs < 1.  A wide margin: where the two are close the default
#: (bf16, bit-exact with torch.optim.Muon) stays, and timing noise cannot flip the choice
AUTO_SLOWDOWN = 4.0
#: direction dtype whatever the iteration ran in (torch.optim.Muon's Newton-Schulz output)
DIRECTION_DTYPE = torch.bfloat16

_probed: dict[tuple[str, int | None], dict[str, float]] = {}
#: batch_is_exact's verdicts, per process (key: everything that selects a kernel or changes the math)
_batch_exact: dict[tuple, bool] = {}


def probe_matmul_seconds(device: torch.device | str) -> dict[str, float]:
    """Seconds of one ``PROBE_SIZE``^3 product per dtype on ``device`` (best of 3 after a warm-up),
    measured once per process and device: ``{"bf16": s, "fp32": s}``."""
    device = torch.device(device)
    key = (device.type, device.index)
    if key not in _probed:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        g = torch.Generator(device="cpu").manual_seed(0)
        base = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=g).to(device)
        out: dict[str, float] = {}
        for name, dtype in NS_DTYPES.items():
            A = base.to(dtype)
            A @ A  # warm-up: kernel selection, lazy initialisation
            best = float("inf")
            for _ in range(3):
                sync(device)
                t0 = time.perf_counter()
                A @ A
                sync(device)
                best = min(best, time.perf_counter() - t0)
            out[name] = best
        _probed[key] = out
    return _probed[key]


def resolve_ns_dtype(ns_dtype: str, device: torch.device | str) -> torch.dtype:
    """The dtype the iteration runs in on ``device`` for the ``ns_dtype`` key."""
    if ns_dtype == "auto":
        t = probe_matmul_seconds(device)
        return torch.float32 if t["bf16"] > AUTO_SLOWDOWN * t["fp32"] else torch.bfloat16
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"Invalid ns_dtype={ns_dtype!r}. Allowed: {list(NS_DTYPE_CHOICES)}.")
    return NS_DTYPES[ns_dtype]


def newton_schulz(G: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, method: str = "standard", dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate the orthogonal factor U V^T of ``G`` (..., m, n), batched over leading dims,
    with every product in ``dtype`` (bfloat16: torch.optim.Muon's iteration, op for op).

    Returns ``dtype``."""
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(G.shape)}")
    if dtype not in NS_DTYPES.values():
        raise ValueError(f"Invalid newton_schulz dtype={dtype}. Allowed: {list(NS_DTYPES.values())}.")
    tall = G.size(-2) > G.size(-1)
    if method == "standard":
        X = G.to(dtype)
        if tall:
            X = X.mT
        # Ensure spectral norm is at most 1
        X = X.div(X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        X = _standard_iterations(X, steps, coefficients)
    elif method == "gram":
        X = G.float()
        if tall:
            X = X.mT
        X = X.div(X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)).to(dtype)
        X = _gram_iterations(X, steps, coefficients)
    else:
        raise ValueError(f"Invalid ns_method={method!r}. Allowed: {list(NS_METHODS)}.")
    return X.mT if tall else X


def _standard_iterations(X: Tensor, steps: int, coefficients: tuple[float, float, float]) -> Tensor:
    a, b, c = coefficients
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c) if A.ndim == 3 else torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a) if X.ndim == 3 else torch.addmm(X, B, X, beta=a)
    return X


def _gram_iterations(X: Tensor, steps: int, coefficients: tuple[float, float, float]) -> Tensor:
    """X_{k+1} = p(R_k) X_k with p(R) = aI + bR + cR^2 and R_k = X_k X_k^T, carried as
    X_k = Q X_j (j = last restart) and R_{k+1} = p(R_k) R_k p(R_k) (p(R) commutes with R)."""
    a, b, c = coefficients
    m, n = X.size(-2), X.size(-1)
    if m == n:  # square: no smaller Gram matrix to iterate on
        return _standard_iterations(X, steps, coefficients)
    eye = torch.eye(m, dtype=X.dtype, device=X.device)
    R = X @ X.mT
    Q = None
    for k in range(steps):
        if k and k % GRAM_RESTART == 0:  # restart: materialise X, recompute R from it
            X = Q @ X
            R = X @ X.mT
            Q = None
        P = a * eye + b * R + c * (R @ R)
        Q = P if Q is None else P @ Q
        if k < steps - 1 and (k + 1) % GRAM_RESTART:
            R = P @ R @ P
    return Q @ X


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's learning-rate scaling by the (2-D) matrix shape."""
    A, B = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    if adjust_lr_fn == "none":
        return lr
    raise ValueError(f"Invalid adjust_lr_fn={adjust_lr_fn!r}. Allowed: {list(ADJUST_LR_FNS)}.")


@dataclass(frozen=True)
class MuonRule(MatrixRule):
    name: ClassVar[str] = "muon"
    default_lr: ClassVar[float] = 0.02  # DeepSpeed's MuonWithAuxAdam defaults
    default_adam_lr: ClassVar[float] = 3e-4
    # DeepSpeed's "Muon" reads betas/eps as the AdamW half's; ns_eps is torch.optim.Muon's eps
    config_aliases: ClassVar[dict] = {"betas": "adam_betas", "eps": "adam_eps", "muon_lr": "lr_matrix"}

    #: momentum coefficient, in [0, 1)
    momentum: float = 0.95
    #: Nesterov momentum (torch.optim.Muon ``nesterov``)
    nesterov: bool = True
    #: Newton-Schulz iterations, integer in [1, 99] (torch.optim.Muon refuses >= 100)
    ns_steps: int = 5
    #: quintic Newton-Schulz coefficients (a, b, c), each |x| <= 100
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    #: epsilon of the Frobenius normalisation before Newton-Schulz (torch's Muon ``eps``), in (0, 1e-2]
    ns_eps: float = 1e-7
    #: Newton-Schulz evaluation: "standard" (torch.optim.Muon, bit-exact) or "gram" (see module doc)
    ns_method: str = "standard"
    #: learning-rate scaling by shape: null/"original" (torch's default), "match_rms_adamw", "none"
    adjust_lr_fn: str | None = None
    #: dtype of the Newton-Schulz products: "bf16" (torch.optim.Muon, bit-exact), "fp32", or "auto" (per
    #: device, by a timed probe: fp32 where a bf16 product is over 4x slower, e.g. AVX2-only CPUs); the
    #: direction stays bf16. Cost and distance from bf16 in docs/optimizers.md
    ns_dtype: str = "bf16"
    #: run the Newton-Schulz of same-shape matrices on one rank (an expert stack's experts, the whole matrices
    #: a rank owns) as one batched iteration where a per-process probe finds it bit-identical per matrix on
    #: that device (else one at a time); false (the default): always one at a time. Off by default: the probe's
    #: random matrices do not establish bit-identity for every value (tests/test_moe_tp.py's Muon runs differed)
    ns_batch: bool = False

    def __post_init__(self) -> None:
        check_number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_bool("nesterov", self.nesterov)
        check_int("ns_steps", self.ns_steps, 1, MAX_NS_STEPS)
        if not isinstance(self.ns_coefficients, (tuple, list)) or len(self.ns_coefficients) != 3:
            raise ValueError(f"Invalid ns_coefficients={self.ns_coefficients!r}. Must be three numbers (a, b, c).")
        for i, c in enumerate(self.ns_coefficients):
            check_number(f"ns_coefficients[{i}]", c, -MAX_NS_COEFFICIENT, MAX_NS_COEFFICIENT)
        object.__setattr__(self, "ns_coefficients", tuple(float(c) for c in self.ns_coefficients))
        check_number("ns_eps", self.ns_eps, 0.0, 1e-2, low_open=True)
        check_choice("ns_method", self.ns_method, NS_METHODS)
        check_choice("adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_FNS)
        check_choice("ns_dtype", self.ns_dtype, NS_DTYPE_CHOICES)
        check_bool("ns_batch", self.ns_batch)

    # ---------------------------------------------------------------- the math
    def init_state(self, info: MatrixInfo, like: Tensor) -> dict[str, Tensor]:
        return {"momentum_buffer": torch.zeros(info.shape, dtype=like.dtype, device=like.device)}

    #: the momentum is element-wise: a matrix hosted over DP keeps it with its pieces
    elementwise_state: ClassVar[tuple[str, ...]] = ("momentum_buffer",)

    def direction(self, grad: Tensor, state: dict[str, Tensor], info: MatrixInfo, step: int) -> Tensor:
        return self.direction_from(self.pre_direction(grad, state), state, info, step)

    def pre_direction(self, grad: Tensor, state: dict[str, Tensor]) -> Tensor:
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - self.momentum)
        return grad.lerp(buf, self.momentum) if self.nesterov else buf

    def orthogonalise(self, G: Tensor) -> Tensor:
        """This rule's Newton-Schulz of ``G`` (..., m, n) in its ``ns_dtype`` on G's device;
        returns ``DIRECTION_DTYPE``."""
        return newton_schulz(G, self.ns_steps, self.ns_coefficients, self.ns_eps, self.ns_method,
                             resolve_ns_dtype(self.ns_dtype, G.device)).to(DIRECTION_DTYPE)

    def batch_is_exact(self, count: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> bool:
        """Is :meth:`orthogonalise` of a (count, m, n) batch of ``dtype`` on ``device`` bit-identical,
        matrix by matrix, to orthogonalising each (m, n) alone?  Probed on random matrices once per
        process and key (kernels are chosen by shape, dtype, device and thread count, not by values)."""
        ns_dtype = resolve_ns_dtype(self.ns_dtype, device)
        key = (device.type, device.index, torch.get_num_threads(), count, tuple(shape), dtype, ns_dtype,
               self.ns_method, self.ns_steps, self.ns_coefficients, self.ns_eps)
        if key not in _batch_exact:
            # compared in the iteration's dtype, before the bf16 rounding of the direction: that
            # rounding hides most fp32 differences on one input but not on every input
            X = torch.randn(count, *shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
            ns = lambda G: newton_schulz(G, self.ns_steps, self.ns_coefficients, self.ns_eps,  # noqa: E731
                                         self.ns_method, ns_dtype)
            batched = ns(X)
            _batch_exact[key] = all(torch.equal(batched[i], ns(X[i])) for i in range(count))
        return _batch_exact[key]

    def orthogonalise_stack(self, X: Tensor) -> Tensor:
        """:meth:`orthogonalise` of each matrix of ``X`` (k, m, n): one batched Newton-Schulz where
        ``ns_batch`` is on and :meth:`batch_is_exact` holds, else one matrix at a time."""
        if self.ns_batch and X.size(0) > 1 and self.batch_is_exact(X.size(0), tuple(X.shape[1:]), X.dtype, X.device):
            return self.orthogonalise(X)
        return torch.stack([self.orthogonalise(x) for x in X.unbind(0)])

    def direction_from(self, update: Tensor, state: dict[str, Tensor], info: MatrixInfo, step: int) -> Tensor:
        rows, cols = info.shape2d
        if info.num_heads:
            heads = info.num_heads
            O = self.orthogonalise(update.reshape(heads, rows // heads, cols))
        else:
            O = self.orthogonalise(update.reshape(rows, cols))
        return O.reshape(update.shape)

    def stack_direction(self, grad: Tensor | list[Tensor], states: list[dict[str, Tensor]],
                        infos: list[MatrixInfo], step: int) -> Tensor | None:
        """Every matrix's momentum (its own buffer, one foreach kernel), then one
        :meth:`orthogonalise_stack` over all of them: bit-identical to :meth:`direction` per matrix
        (the momentum is element-wise; the batch runs only where the probe found it exact; tests in
        tests/test_experts.py and tests/test_optim_muon.py).  ``grad``: an expert stack [E, ...] or
        a list of same-shape gradients; per-head matrices are not batched here (None)."""
        if infos[0].num_heads:
            return None
        grads = list(grad.unbind(0)) if isinstance(grad, Tensor) else list(grad)
        bufs = [st["momentum_buffer"] for st in states]
        torch._foreach_lerp_(bufs, grads, 1 - self.momentum)
        updates = torch._foreach_lerp(grads, bufs, self.momentum) if self.nesterov else bufs
        rows, cols = infos[0].shape2d
        O = self.orthogonalise_stack(torch.stack(updates).reshape(len(updates), rows, cols))
        return O.reshape(len(updates), *grads[0].shape)

    def direction_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return DIRECTION_DTYPE  # Newton-Schulz's output: TP update shards travel at half the bytes, losslessly

    def scales(self, lr: float, weight_decay: float, info: MatrixInfo, step: int) -> tuple[float, float]:
        rows, cols = info.shape2d
        if info.num_heads:  # DeepSpeed's per-head Muon scales by the head's shape
            rows //= info.num_heads
        return 1.0 - lr * weight_decay, adjusted_lr(lr, self.adjust_lr_fn, (rows, cols))

    # ---------------------------------------------------------------- the cost
    def flops(self, shape: tuple[int, int], num_heads: int | None = None) -> Flops:
        heads = num_heads or 1
        rows, cols = shape[0] // heads, shape[1]
        m, n = sorted((rows, cols))
        if self.ns_method == "gram" and m != n:
            # per restart: R = X X^T and one product touching n (Q X); per iteration
            # P = aI + bR + cR^2 (one m^3), Q = P Q (all but the first of a restart), and
            # R = P R P (two m^3) except before a restart and after the last iteration
            s = self.ns_steps
            restarts = math.ceil(s / GRAM_RESTART)
            cubes = s + (s - restarts) + 2 * ((s - 1) - (s - 1) // GRAM_RESTART)
            per = restarts * (matmul_flops(m, n, m) + matmul_flops(m, m, n)) + cubes * matmul_flops(m, m, m)
        else:
            per = self.ns_steps * (2 * matmul_flops(m, n, m) + matmul_flops(m, m, m))
        f = heads * per
        return Flops(f, f)

    def state_bytes(self, shape: tuple[int, int], num_heads: int | None = None) -> float:
        return 4.0 * shape[0] * shape[1]  # fp32 momentum

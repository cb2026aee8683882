"""The Muon rule: bit-exact vs torch.optim.Muon, gram Newton-Schulz stable in bf16, per-head
semantics equal to DeepSpeed's own per_head_muon."""
from __future__ import annotations

import pytest
import torch

from canzona_ds.config import CanzonaConfig
from canzona_ds.optim.muon import MuonRule, newton_schulz, resolve_ns_dtype
from canzona_ds.optimizer import CanzonaOptimizer
from canzona_ds.reference import ReferenceOptimizer
from canzona_ds.optim.rule import MatrixInfo
from canzona_testkit.models import NS_BF16_REL, muon_kernel_tolerance

#: one process, both sides of every comparison: every core (canzona_testkit/kernels.py solo_threads)
pytestmark = pytest.mark.solo

SHAPES = [(16, 16), (48, 16), (16, 40), (7, 33)]


def _steps(opt_params, opt, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(opt_params, grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("impl", ["optimizer", "reference"])
def test_bit_exact_vs_torch_muon(nesterov, adjust_lr_fn, impl):
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(4)]
    ref = [p.clone().requires_grad_() for p in init]
    _steps(ref, torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                                 adjust_lr_fn=adjust_lr_fn), grads)
    ours = [(f"m{i}.weight", p.clone().requires_grad_()) for i, p in enumerate(init)]
    cfg = CanzonaConfig.from_ds("CanzonaMuon", dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                                                     adjust_lr_fn=adjust_lr_fn))
    opt = (CanzonaOptimizer if impl == "optimizer" else ReferenceOptimizer)(ours, cfg)
    _steps([p for _, p in ours], opt, grads)
    for (name, p), r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0, msg=name)


def _spectrum(m: int, n: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    k = min(m, n)
    s = {"power_law": [1.0 / (i + 1) ** 2 for i in range(k)],
         "near_rank_1": [1.0] + [1e-4] * (k - 1),
         "uniform": torch.rand(k, generator=g).tolist()}[kind]
    return U[:, :k] @ torch.diag(torch.tensor(s)) @ V[:k, :]


@pytest.mark.parametrize("kind", ["power_law", "near_rank_1", "uniform"])
@pytest.mark.parametrize("shape", [(256, 256), (256, 1024), (1024, 256), (64, 512)])
def test_gram_is_as_stable_as_standard_in_bf16(shape, kind):
    """The issue's cases: without a restart the bf16 Gram iteration reached singular values of
    170-500,000 on these spectra; standard Newton-Schulz stays ~1.2 (its quintic overshoots 1)."""
    G = _spectrum(*shape, kind)
    std = torch.linalg.svdvals(newton_schulz(G, method="standard").float()).max().item()
    gram = torch.linalg.svdvals(newton_schulz(G, method="gram").float()).max().item()
    assert std < 1.3
    assert gram < 1.3, f"gram Newton-Schulz is unstable on a {kind} spectrum: largest singular value {gram:.3g}"


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_close_to_standard_on_random_matrices(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    std = newton_schulz(G, method="standard").float()
    gram = newton_schulz(G, method="gram").float()
    # equal in exact arithmetic; bf16 rounding differs (measured <= 0.05 relative)
    assert ((std - gram).norm() / std.norm()).item() < 0.1
    s = torch.linalg.svdvals(gram)
    assert s.min().item() > 0.3 and s.max().item() < 1.5


def test_gram_update_spectral_norm_matches_standard_in_a_training_step():
    """One Muon step per method on a badly conditioned gradient: the update's spectral norm / lr
    (the issue measured 1.5-1.8 for the old gram against 1.20)."""
    G = _spectrum(96, 384, "power_law", seed=3)
    norms = {}
    for method in ("standard", "gram"):
        rule = MuonRule(ns_method=method)
        info = MatrixInfo("w", (96, 384))
        D = rule.direction(G.clone(), rule.init_state(info, like=G), info, 1)
        norms[method] = torch.linalg.svdvals(D.float()).max().item()
    assert abs(norms["gram"] - norms["standard"]) < 0.1, norms


def test_per_head_matches_deepspeed_per_head_orthogonalisation():
    """DeepSpeed 0.19.8's _per_head_orthogonalize: view (heads, head_dim, in), Newton-Schulz per
    head, times sqrt(head_dim/in) when head_dim > in.  Ours: exactly our Newton-Schulz per head
    block, with the same scale as the step size; equal to DeepSpeed's up to the bf16 rounding of
    two Newton-Schulz implementations (DeepSpeed adds eps to the norm and does not fuse addmm),
    while the whole-matrix update is far away."""
    from deepspeed.runtime.zero.muon import original_muon

    heads, head_dim, cols = 4, 24, 16  # head_dim > cols: the aspect-ratio scale matters
    G = torch.randn(heads * head_dim, cols, generator=torch.Generator().manual_seed(5))
    rule = MuonRule(nesterov=False, momentum=0.0)
    info = MatrixInfo("q_proj.weight", tuple(G.shape), num_heads=heads)
    D = rule.direction(G.clone(), rule.init_state(info, like=G), info, 1)
    # the heads as one (heads, head_dim, in) batch: the same call on the same tensor, bit for bit
    torch.testing.assert_close(D, newton_schulz(G.reshape(heads, head_dim, cols)).reshape(G.shape), rtol=0, atol=0)
    # head by head as 2-D matrices: other GEMM kernels (addmm vs baddbmm), so each side within
    # NS_BF16_REL of the exact iteration, per head, and the two within twice that
    blocks = [newton_schulz(b).float() for b in G.split(head_dim)]
    for h, (got, one) in enumerate(zip(D.float().split(head_dim), blocks)):
        assert ((got - one).norm() / one.norm()).item() <= 2 * NS_BF16_REL, h
    _, step_size = rule.scales(1.0, 0.0, info, 1)
    assert step_size == pytest.approx(original_muon._aspect_ratio_scale(head_dim, cols))
    # eager, as the main job and the test kit's ranks run DeepSpeed's Muon: its inductor-compiled CPU kernel
    # corrupts the heap or returns NaN on some x86 CPUs (canzona_testkit/dist.py)
    from torch import _dynamo

    with _dynamo.config.patch(disable=True):
        expected = original_muon._per_head_orthogonalize(G.clone(), heads, 5, "standard").float()
    rel = lambda x: ((x - expected).norm() / expected.norm()).item()  # noqa: E731
    assert rel(D.float() * step_size) < 0.05  # measured 0.029
    whole = MatrixInfo("q_proj.weight", tuple(G.shape))
    D_whole = rule.direction(G.clone(), rule.init_state(whole, like=G), whole, 1).float()
    assert rel(D_whole * rule.scales(1.0, 0.0, whole, 1)[1]) > 0.3  # measured 0.42


def test_per_head_cost_is_per_head():
    rule = MuonRule()
    whole, per_head = rule.flops((512, 128)), rule.flops((512, 128), num_heads=8)
    # 8 heads of (64, 128): m = 64 each; whole matrix: m = 128
    assert per_head.amortised == pytest.approx(8 * 5 * (2 * 2 * 64 * 64 * 128 + 2 * 64 ** 3))
    assert whole.amortised == pytest.approx(5 * (2 * 2 * 128 * 128 * 512 + 2 * 128 ** 3))


@pytest.mark.parametrize("key,value", [("ns_steps", 1_000_000_000), ("ns_steps", 0), ("ns_coefficients", [1e30, -1e30, 1e30]),
                                       ("momentum", 1.0), ("ns_method", "svd"), ("adjust_lr_fn", "x"), ("ns_eps", 0.0),
                                       ("ns_dtype", "fp16")])
def test_bad_values_name_the_key(key, value):
    with pytest.raises((ValueError, TypeError), match=key):
        MuonRule(**{key: value})


# ---------------------------------------------------------------- ns_dtype
def _fp32_newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's _zeropower_via_newtonschulz written out with float32 for bfloat16:
    the independent oracle of ns_dtype="fp32" (same coefficients, same op order)."""
    a, b, c = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's DEFAULT_NS_COEFFICIENTS
    X = G.float()
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if tall else X


@pytest.mark.parametrize("shape", SHAPES + [(96, 384)])
def test_fp32_newton_schulz_equals_an_independent_fp32_iteration(shape):
    """Same fp32 kernels on both sides (addmm/matmul of the same shapes): bit for bit, also on
    CPUs without bf16 kernels.  The rule returns the direction in bf16 whatever the iteration ran
    in, so its direction is the oracle's rounded to bf16."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    expected = _fp32_newton_schulz(G)
    torch.testing.assert_close(newton_schulz(G, dtype=torch.float32), expected, rtol=0, atol=0)
    rule = MuonRule(ns_dtype="fp32", momentum=0.0, nesterov=False)
    info = MatrixInfo("w", shape)
    D = rule.direction(G.clone(), rule.init_state(info, like=G), info, 1)
    assert D.dtype == torch.bfloat16 == rule.direction_dtype(torch.float32)
    torch.testing.assert_close(D, expected.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES + [(256, 1024)])
def test_fp32_newton_schulz_distance_from_bf16(shape):
    """fp32 and bf16 iterations agree up to bf16 rounding: bf16 keeps 8 mantissa bits (relative
    step 2^-8 = 0.0039 per product, accumulating over 15 products); measured relative Frobenius
    distance 0.012-0.021 on these shapes (benchmarks/bench_ns_dtype.py records it per shape)."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    fp32, bf16 = newton_schulz(G, dtype=torch.float32), newton_schulz(G).float()
    assert ((bf16 - fp32).norm() / fp32.norm()).item() < 15 * 2 ** -8


def test_bf16_key_is_torch_muon_bit_exact():
    """ns_dtype="bf16" written out is the default: bit-exact with torch.optim.Muon."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(3)]
    ref = [p.clone().requires_grad_() for p in init]
    _steps(ref, torch.optim.Muon(ref, lr=0.02, momentum=0.9, weight_decay=0.0), grads)
    ours = [(f"m{i}.weight", p.clone().requires_grad_()) for i, p in enumerate(init)]
    opt = CanzonaOptimizer(ours, CanzonaConfig.from_ds("CanzonaMuon", dict(lr=0.02, momentum=0.9, ns_dtype="bf16")))
    _steps([p for _, p in ours], opt, grads)
    for (name, p), r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0, msg=name)


def test_auto_chooses_by_the_probe(monkeypatch):
    """"auto" runs fp32 exactly where the probe measured bf16 over AUTO_SLOWDOWN x slower; the
    real probe returns positive times and is measured once per device."""
    from canzona_ds.optim import muon

    real = muon.probe_matmul_seconds("cpu")
    assert real["bf16"] > 0 and real["fp32"] > 0 and muon.probe_matmul_seconds("cpu") is real
    expected = torch.float32 if real["bf16"] > muon.AUTO_SLOWDOWN * real["fp32"] else torch.bfloat16
    assert muon.resolve_ns_dtype("auto", "cpu") == expected
    monkeypatch.setitem(muon._probed, ("cpu", None), {"bf16": 40.0, "fp32": 1.0})  # AVX2-only CPU
    assert muon.resolve_ns_dtype("auto", "cpu") == torch.float32
    monkeypatch.setitem(muon._probed, ("cpu", None), {"bf16": 1.9, "fp32": 1.0})  # AVX512-bf16 Xeon
    assert muon.resolve_ns_dtype("auto", "cpu") == torch.bfloat16
    G = torch.randn(16, 40)
    monkeypatch.setitem(muon._probed, ("cpu", None), {"bf16": 40.0, "fp32": 1.0})
    torch.testing.assert_close(MuonRule(ns_dtype="auto").orthogonalise(G),
                               MuonRule(ns_dtype="fp32").orthogonalise(G), rtol=0, atol=0)


# ---------------------------------------------------------------- batched Newton-Schulz on the owner
def _assert_within_kernel_tolerance(ours, ref, rule, lr, steps):
    """A batched Newton-Schulz (baddbmm over k matrices) against one matrix at a time (addmm):
    other GEMM kernels, so not bit for bit on every CPU (the probe's random matrices do not
    establish it for every value: ns_batch's doc); the gradients are the same given tensors, so
    only the directions differ: muon_kernel_tolerance for the dtype the iteration runs in (fp32's
    bound is 1/15 of bf16's).  A batch that swapped two matrices' updates would be 8-9x the bound
    away (measured on these shapes over 3 steps); the bugs test_kernel_bound_fails_injected_bugs
    injects fail it."""
    ns_dtype = resolve_ns_dtype(rule.ns_dtype, "cpu")
    for (name, p), (_, r) in zip(ours, ref):
        info = MatrixInfo(name, tuple(r.shape))
        sizes = [rule.scales(lr, 0.0, info, t)[1] for t in range(1, steps + 1)]
        bound = muon_kernel_tolerance(info.shape2d, sizes, float(r.detach().norm()), ns_dtype)
        assert float((p.detach() - r.detach()).norm()) <= bound, (name, float((p - r).norm()), bound)


BATCH_SHAPES = [(24, 40), (24, 40), (40, 24), (24, 40), (40, 24), (7, 33), (7, 33)]


def _batched_and_reference(ns_dtype: str, ns_method: str, bug=None):
    """Three steps of CanzonaOptimizer (the owner's path, batched) and of the single-process
    reference on the same gradients; ``bug(opt, grads)`` breaks the owner's side first."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in BATCH_SHAPES]
    grads = [[torch.randn(s) for s in BATCH_SHAPES] for _ in range(3)]
    params = dict(lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, ns_method=ns_method, ns_batch=True)
    ours = [(f"m{i}.weight", p.clone().requires_grad_()) for i, p in enumerate(init)]
    ref = [(f"m{i}.weight", p.clone().requires_grad_()) for i, p in enumerate(init)]
    opt = CanzonaOptimizer(ours, CanzonaConfig.from_ds("CanzonaMuon", params))
    ref_opt = ReferenceOptimizer(ref, CanzonaConfig.from_ds("CanzonaMuon", params))
    rule = opt.rule
    if bug is not None:
        grads = bug(opt, grads)
    _steps([p for _, p in ours], opt, grads)
    _steps([p for _, p in ref], ref_opt, [[g.clone() for g in step] for step in grads])
    return ours, ref, rule, len(grads)


def _lr_times_0_9(opt, grads):
    real = opt.rule.scales
    object.__setattr__(opt.rule, "scales", lambda lr, *a: real(0.9 * lr, *a))  # (a frozen rule: this one only)
    return grads


def _momentum_off(opt, grads):
    """The owner forgets the momentum: its buffers are zero before every update."""
    one, stack = opt.rule.direction, opt.rule.stack_direction
    object.__setattr__(opt.rule, "direction", lambda grad, state, *a: (
        state["momentum_buffer"].zero_(), one(grad, state, *a))[1])
    object.__setattr__(opt.rule, "stack_direction", lambda grad, states, *a, **k: (
        [st["momentum_buffer"].zero_() for st in states], stack(grad, states, *a, **k))[1])
    return grads


def _dropped_step_on_one_matrix(opt, grads):
    """The owner skips matrix 3's second step (its gradient never reaches the rule)."""
    real = opt.step
    calls = []

    def step(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            p = [p for g in opt.param_groups for p in g["params"]][3]
            p.grad = None
        return real(*a, **k)

    opt.step = step
    return grads


@pytest.mark.parametrize("bug", [_lr_times_0_9, _momentum_off, _dropped_step_on_one_matrix],
                         ids=["lr_x0.9", "momentum_off", "dropped_step"])
def test_kernel_bound_fails_injected_bugs(bug):
    """The fp32 bound catches what a batched-path bug would do (issue 46: the bf16 bound, 15% of
    ||O|| per step on these shapes, let a 10% step-size error through): lr x 0.9, momentum
    dropped, one matrix's step dropped.  Single process, ~1 s."""
    ours, ref, rule, steps = _batched_and_reference("fp32", "standard", bug)
    with pytest.raises(AssertionError):
        _assert_within_kernel_tolerance(ours, ref, rule, 0.02, steps)


@pytest.mark.parametrize("ns_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("ns_method", ["standard", "gram"])
def test_owner_batches_same_shape_matrices(ns_dtype, ns_method, monkeypatch):
    """CanzonaOptimizer (the owner's path: placement -> rule_steps) runs the same-shape matrices
    as one batched Newton-Schulz where the probe found it exact, and its parameters stay within
    the kernel bound of the single-process reference's (one matrix at a time): 7x33 in fp32 is a
    shape where MKL's batched fp32 product rounds differently from the single one on some CPUs
    (gram also under AVX2), so there the probe must send them one at a time.  The batch must
    really run (counted)."""
    from canzona_ds.optim import muon

    batched = []
    real_ns = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda G, *a, **k: (batched.append(G.ndim == 3), real_ns(G, *a, **k))[1])
    ours, ref, rule, steps = _batched_and_reference(ns_dtype, ns_method)
    _assert_within_kernel_tolerance(ours, ref, rule, 0.02, steps)
    exact = {s: rule.batch_is_exact(BATCH_SHAPES.count(s), s if s[0] <= s[1] else s[::-1], torch.float32,
                                    torch.device("cpu")) for s in set(BATCH_SHAPES)}
    assert any(exact.values()), exact  # 24x40 batches on every CPU tried: the feature is active
    assert any(batched), "no batched Newton-Schulz ran"


def test_ns_batch_false_runs_one_at_a_time(monkeypatch):
    from canzona_ds.optim import muon

    shapes = []
    real_ns = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda G, *a, **k: (shapes.append(tuple(G.shape)), real_ns(G, *a, **k))[1])
    ours = [(f"m{i}.weight", torch.randn(24, 40, requires_grad=True)) for i in range(3)]
    opt = CanzonaOptimizer(ours, CanzonaConfig.from_ds("CanzonaMuon", {"ns_batch": False}))
    _steps([p for _, p in ours], opt, [[torch.randn(24, 40) for _ in range(3)]])
    assert shapes == [(24, 40)] * 3


def test_batch_probe_falls_back_where_batched_rounding_differs(monkeypatch):
    """A batch whose probe says "not exact" runs one matrix at a time (the probe's verdict is
    forced here, the way it comes out for MKL's fp32 bmm on 96x384 slices on an AVX512 Xeon)."""
    from canzona_ds.optim import muon

    rule = MuonRule(ns_dtype="fp32", ns_batch=True)
    X = torch.randn(3, 24, 40)
    monkeypatch.setattr(MuonRule, "batch_is_exact", lambda *a: False)
    calls = []
    real_ns = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda G, *a, **k: (calls.append(G.ndim), real_ns(G, *a, **k))[1])
    O = rule.orthogonalise_stack(X)
    assert calls == [2, 2, 2]
    torch.testing.assert_close(O, torch.stack([rule.orthogonalise(x) for x in X]), rtol=0, atol=0)


def test_owner_batches_are_bounded_in_size(monkeypatch):
    """rule_steps cuts a same-shape group into batches of at most BATCH_MAX_NUMEL elements (the
    stacked copies a batch holds), still within the kernel bound of the one-at-a-time reference."""
    from canzona_ds.optim import muon, rule

    monkeypatch.setattr(rule, "BATCH_MAX_NUMEL", 2 * 24 * 40)
    sizes = []
    real_ns = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda G, *a, **k: (sizes.append(tuple(G.shape)), real_ns(G, *a, **k))[1])
    torch.manual_seed(0)
    init = [torch.randn(24, 40) for _ in range(5)]
    grads = [[torch.randn(24, 40) for _ in range(5)]]
    ours = [(f"m{i}.weight", p.clone().requires_grad_()) for i, p in enumerate(init)]
    ref = [(f"m{i}.weight", p.clone().requires_grad_()) for i, p in enumerate(init)]
    _steps([p for _, p in ours], CanzonaOptimizer(ours, CanzonaConfig.from_ds("CanzonaMuon", {"ns_batch": True})), grads)
    _steps([p for _, p in ref], ReferenceOptimizer(ref, CanzonaConfig.from_ds("CanzonaMuon", {})), grads)
    _assert_within_kernel_tolerance(ours, ref, MuonRule(), MuonRule.default_lr, len(grads))
    assert max(s[0] for s in sizes if len(s) == 3) == 2, sizes  # 5 matrices: batches of 2, 2 and 1

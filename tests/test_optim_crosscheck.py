"""The single-process reference's SOAP and Shampoo, cross-checked against independent code.

SOAP against heavyball 3.2.1 (``heavyball.SOAP``: a public implementation, installed for tests
only by the ``test`` extra).  Shampoo: heavyball 3.2.1 has no plain Shampoo, so against an
independent from-the-paper implementation written here in another way (second part).

Small cases, fp32, one thread, fixed seeds and fixed gradient sequences (the gradients do not
depend on the weights, so both sides see the same ones and differences do not feed back).

SOAP vs heavyball.SOAP
======================
heavyball's extras are off: no precond schedule (``use_precond_schedule=False``), no warmup,
no MARS/caution/PaLM/cautious weight decay, no gradient or update clipping, fp32 storage, no
ECC, ``merge_dims=False``, ``precondition_1d=False``, ``precond_grad_accum=False``,
``promote=False``, ``compile_step=False`` and ``heavyball.utils.compile_mode = None`` (heavyball
otherwise torch.compiles its kernels: same math, slow), ``max_precond_dim`` above every side.
Same lr, betas, eps, shampoo_beta, precondition_frequency and weight decay.  Matrices 8x8 +
10x10 ("square") and 8x12 + 12x8 ("rectangular"); 8 steps, frequency 2, so refreshes after
updates 2, 4, 6; well-conditioned gradients (singular values spread over [1, 2]: full-rank
factors with distinct eigenvalues).

Differences found (ours vs heavyball 3.2.1), and how the test handles each:

1. Refresh phase: changes the trajectory; EMULATED.  Ours refreshes after update k = t-1 when
   k % f == 0, like the reference code (nikhilvyas/SOAP, whose ``state['step']`` is 0 on the
   basis-only first step).  heavyball counts that first call too: ``psgd_should_update`` fires
   on calls s with s % f == 0, i.e. after updates k = f-1, 2f-1, ...: one update earlier.
   The test gives heavyball the reference phase through its own schedule hook
   (``opt.precond_schedule``: 1.0 on calls s > 1 with (s-1) % f == 0, else 0.0).
   ``test_heavyball_native_schedule_refreshes_one_update_earlier``: with heavyball's own
   phase the runs agree until its first refresh shows (step 3), and differ by >1e-2 after.
2. Null-space lift in the refresh: changes the trajectory by a few 1e-6; EMULATED in the tight
   test, only bounded without.  heavyball's ``get_orthogonal_matrix_QR`` runs the power
   iteration on F Q + c Q = (F + c I) Q with c = max(1e-8, 64 * dim * eps_fp32) *
   max|diag(Q^T F Q)| (~1e-4 relative in fp32), so that a rank-deficient factor has a
   well-defined QR; ours and the reference code use F Q.  ``_LiftedSOAP`` hands OUR
   ``_refresh_basis`` the factor F + c I (the shift keeps the eigenvalue order), nothing else
   changed.  Unemulated, the runs stay within ``SOAP_TOL_NO_LIFT``.
3. Null space of the step-1 factor, rectangular matrices only: EMULATED by sharing the basis.
   For an m x n gradient with m != n one factor has rank min(m, n) at step 1; its null-space
   eigenvectors are eigh's rounding noise (heavyball factors G G^T + 1e-30 I, ours
   (1 - shampoo_beta) G G^T), any orthonormal basis of the null space is a valid SOAP basis,
   and Adam's per-coordinate normalisation depends on which.  After step 1 the test checks
   that both bases agree on the factor's range (eigenvectors of the nonzero eigenvalues, up to
   sign, within ``BASIS_TOL``), then heavyball continues from ours.  Square matrices share
   nothing: both sides run from scratch.
4. First moment kept in the eigenbasis: no effect but rounding.  heavyball accumulates
   M' = sum Q^T G Q and rotates it at each refresh (Q_new^T Q_old M' Q_old^T Q_new); ours keeps
   M in the original space and projects it each step (the paper's Algorithm 3).  Equal in exact
   arithmetic (Q orthogonal).  In fp32 it is the main source of the residual: Adam divides each
   eigenbasis coordinate by its own RMS, so a coordinate of Q^T G Q of ~1e-4 carries the matmul's
   absolute rounding (~1e-7 of |G|) as a ~1e-3 relative error, and ours computes Q^T M Q and
   Q^T G Q separately where heavyball's M' and G' share it (measured: ours agrees with an fp64
   evaluation on its own basis to ~4e-7, heavyball to ~1e-8 at step 2).
5. Eigenvalue order: no effect.  heavyball sorts the columns by diag(Q^T F Q) for the QR only
   and scatters the result back to the old column positions, so its second moment is never
   permuted; ours (and the reference code) keep the sorted order and permute V.  The same basis
   up to a column permutation applied to Q and V alike.  heavyball also makes diag(R) of the QR
   positive; ours keeps torch's signs: SOAP does not depend on the sign of a basis vector (V sees
   squares, M is projected and projected back).
6. Bias correction: no effect beyond eps.  heavyball debiases the EMA coefficients
   (``beta_debias``: its M, V are the bias-corrected averages) and divides by max(sqrt(V^), eps);
   ours keeps plain EMAs, scales the step by sqrt(1 - b2^k) / (1 - b1^k) and divides by
   sqrt(V) + eps.  Identical but for where eps enters: a relative effect of at most
   eps / (sqrt(1 - b2^k) sqrt(V^)) per eigenbasis coordinate, < 2e-4 on the smallest ones here
   (|Q^T G Q| >= ~3e-4), i.e. ~1e-8 on the weights.
7. shampoo_beta debiasing: no effect.  heavyball's factors are ours / (1 - shampoo_beta^t): the
   eigenbasis, the power iteration + QR, the order and heavyball's (relative) lift are all
   invariant to a positive scale of F.  (Defaults differ: ours shampoo_beta = b2, heavyball
   0.95; the test sets it.)
8. Weight decay: none.  Both: W <- (1 - lr * wd) W - lr * (step) with the decay on the old W,
   neither decays on the basis-only first step.  Tested with wd = 0 and 0.1.

Tolerances (max |W_ours - W_heavyball| over every weight of every step, weights ~0.1 moving by
~0.1 with lr = 0.01 over 8 steps, seeds 0-2):
* ``SOAP_TOL`` = 1.5e-6 with 1-3 emulated (1.5e-4 of one step; fp32 rounding as in 4.; measured
  <= 7.6e-7 square, <= 9e-8 rectangular over seeds 0-5);
* ``SOAP_TOL_NO_LIFT`` = 1e-5 with only 1 and 3 emulated (measured <= 4.5e-6 over seeds 0-5);
* ``BASIS_TOL`` = 2e-5 on |Q_ours^T Q_heavyball| - I over the range at step 1 (measured <= 3e-6).
Negative controls, wrong variants of ours against the same heavyball (lift emulated): swapped
betas (measured 5e-3), no bias correction (2.5e-2), V not permuted at a refresh (2.9e-2), plus
heavyball's native phase (1.): each must exceed ``SOAP_TOL_NO_LIFT``.

Shampoo vs an independent implementation
========================================
heavyball 3.2.1 has no plain Shampoo.  ``KLShampoo`` is KL-Shampoo (Lin et al. 2025): factors
accumulated with the other factor's inverse eigenvalues, seeded with 0.1 I and rebalanced,
inverse SQUARE roots of eigenvalues estimated in a QR-refreshed eigenbasis, no grafting;
``PSGDKron`` and relatives learn their preconditioner.  None of them is Shampoo, so ours is
checked against ``_paper_shampoo``: independent code written here (NOT a public
implementation; it shares only torch.linalg.eigh with ours) from Gupta et al. 2018 / Anil et
al. 2020, in another way than ``ShampooRule``:

* float64, every statistic a closed-form weighted sum over the whole gradient history (no
  recursive state): M^ = sum_s (1-b1) b1^(t-s) G_s / (1 - b1^t); L_r = sum_s w_s G_s G_s^T with
  w_s = (1-b2) b2^(r-s), or 1 for b2 = 1; likewise R_r and the grafting second moments;
* the preconditioner is the explicit Kronecker product: with row-major vec,
  vec(L^-1/4 M R^-1/4) = (L^-1/4 (x) R^-1/4) vec(M) = ((L + eps I) (x) (R + eps I))^(-1/4) vec(M),
  the -1/4 power of the (bm bn) x (bm bn) Kronecker matrix taken from its own eigh;
* the refresh schedule as a list: at step t, the roots of the statistics (including G_r) at the
  last refresh step r <= t with r >= start and (r - start) % f == 0; before the first one, the
  grafted optimizer's direction;
* grafting: each block of S rescaled to the Frobenius norm of the same block of the grafted
  direction (Adam: M^ / (sqrt(V^) + eps_g); AdaGrad: M^ / (sqrt(sum G^2) + eps_g); none: S).

Cases (8x12 and 12x8, 8 steps): plain sums (b2 = 1) with Adam grafting, refreshes at 3, 5, 7;
EMA factors with AdaGrad grafting and blocks (max_preconditioner_dim = 5: 5/3 x 5/5/2),
refreshes at 3, 6; b1 = 0 without grafting, refreshes at 2, 5, 8.  Every factor is full rank at
the first refresh (enough gradients accumulated), so no inverse root depends on rounding noise
in a null space.  Tolerances: ``SHAMPOO_TOL`` = 2e-5 on the relative Frobenius error of every
step's direction (fp32 eigh vs fp64; measured <= 9e-7, <= 6.3e-6 over seeds 1-3);
``SHAMPOO_WEIGHT_TOL`` = 5e-7 on ReferenceOptimizer's weights with weight decay 0.1 (measured
<= 1.2e-7).  Negative controls, each > 10x ``SHAMPOO_TOL``: inverse square roots instead of 4th
roots (measured 0.27), the first refresh one step late (0.46), grafting off (0.88).
"""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import dataclasses
import importlib.metadata

import pytest
import torch

import canzona_ds.optim.shampoo as shampoo_module
from canzona_ds.config import CanzonaConfig
from canzona_ds.reference import ReferenceOptimizer
from canzona_ds.optim.rule import MatrixInfo
from canzona_ds.optim.shampoo import ShampooRule
from canzona_ds.optim.soap import SOAPRule

STEPS = 8
LR = 0.01
FREQ = 2  # SOAP refreshes after updates 2, 4, 6 (steps 3, 5, 7)
SOAP_PARAMS = {"betas": [0.9, 0.95], "shampoo_beta": 0.9, "eps": 1e-8, "precondition_frequency": FREQ,
               "max_precond_dim": 10000}
SHAPES = {"square": [(8, 8), (10, 10)], "rectangular": [(8, 12), (12, 8)]}
SEEDS = (0, 1, 2)
SOAP_TOL = 1.5e-6
SOAP_TOL_NO_LIFT = 1e-5
BASIS_TOL = 2e-5
SHAMPOO_TOL = 2e-5
SHAMPOO_WEIGHT_TOL = 5e-7


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(test_threads())
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def heavyball(monkeypatch):
    """heavyball 3.2.1, its kernels eager (SOAP tests only: the Shampoo ones need no heavyball)."""
    hb = pytest.importorskip("heavyball", reason="the SOAP cross-check needs heavyball (pip install -e '.[test]')")
    if importlib.metadata.version("heavyball") != "3.2.1":
        pytest.skip("the differences documented here are heavyball 3.2.1's (the test extra pins it)")
    import heavyball.utils
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)  # not torch.compile'd
    return hb


# ---------------------------------------------------------------------------------------- SOAP
def _heavyball_lift(F: torch.Tensor, Q: torch.Tensor) -> float:
    """heavyball 3.2.1 get_orthogonal_matrix_QR: c of its power iteration on F Q + c Q."""
    magnitude = (Q * (F @ Q)).sum(0).abs().amax().clamp_min(torch.finfo(F.dtype).tiny)
    lift = max(1e-8, min(64 * F.shape[-1] * torch.finfo(F.dtype).eps, 0.125))
    return float(lift * magnitude)


@dataclasses.dataclass(frozen=True)
class _LiftedSOAP(SOAPRule):
    """Our SOAP, its refresh run on F + c I (heavyball's null-space lift, difference 2)."""

    def _refresh_basis(self, state):
        saved = {}
        for side, key in (("L", "Q_L"), ("R", "Q_R")):
            if key in state:
                F = saved[side] = state[side]
                state[side] = F + _heavyball_lift(F, state[key]) * torch.eye(F.shape[0], dtype=F.dtype)
        try:
            super()._refresh_basis(state)
        finally:
            state.update(saved)


@dataclasses.dataclass(frozen=True)
class _UnpermutedV(_LiftedSOAP):
    """WRONG on purpose: the second moment keeps its order when the basis is re-sorted."""

    def _refresh_basis(self, state):
        V = state["exp_avg_sq"]
        super()._refresh_basis(state)
        state["exp_avg_sq"] = V


def _reference_phase(call: int) -> float:
    """heavyball precond_schedule giving the reference refresh phase (difference 1)."""
    return 1.0 if call > 1 and (call - 1) % FREQ == 0 else 0.0


def _heavyball_soap(heavyball, params, weight_decay: float, native_schedule: bool = False):
    b1, b2 = SOAP_PARAMS["betas"]
    opt = heavyball.SOAP(
        params, lr=LR, betas=(b1, b2), shampoo_beta=SOAP_PARAMS["shampoo_beta"], eps=SOAP_PARAMS["eps"],
        weight_decay=weight_decay, cautious_weight_decay=False, precondition_frequency=FREQ,
        max_precond_dim=SOAP_PARAMS["max_precond_dim"], merge_dims=False, precondition_1d=False, warmup_steps=0,
        split=False, multi_tensor=True, mars=False, caution=False, palm=False, use_precond_schedule=False,
        gradient_clipping=None, update_clipping=None, storage_dtype="float32", precond_grad_accum=False,
        compile_step=False, promote=False, ecc=None, param_ecc=None)
    assert opt.precond_schedule == 1 / FREQ and not opt.compile_step
    if not native_schedule:
        opt.precond_schedule = _reference_phase
    return opt


def _soap_config(weight_decay: float, rule_cls=_LiftedSOAP, **rule_changes) -> CanzonaConfig:
    cfg = CanzonaConfig.from_ds("CanzonaSOAP", {"lr": LR, "weight_decay": weight_decay, **SOAP_PARAMS})
    assert cfg.lr == LR and cfg.weight_decay == weight_decay
    fields = {f.name: getattr(cfg.rule, f.name) for f in dataclasses.fields(cfg.rule)}
    return dataclasses.replace(cfg, rule=rule_cls(**{**fields, **rule_changes}))


def _well_conditioned(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """U diag(s) V^T: random singular vectors, singular values evenly spread over [1, 2]."""
    m, n = shape
    U = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    r = min(m, n)
    return ((U[:, :r] * torch.linspace(2.0, 1.0, r, dtype=torch.float64)) @ V[:, :r].T).float()


def _soap_vs_heavyball(heavyball, case: str, weight_decay: float, cfg: CanzonaConfig, native_schedule: bool = False,
                       seed: int = 0) -> list[float]:
    """Max |W_ours - W_heavyball| after each step: ReferenceOptimizer(cfg) vs heavyball.SOAP on
    the same gradients.  Both step-1 bases are checked against each other on the range of the
    factor; for rectangular matrices heavyball then continues from ours (difference 3)."""
    shapes = SHAPES[case]
    gen = torch.Generator().manual_seed(seed)
    w0 = [0.1 * torch.randn(s, generator=gen) for s in shapes]
    grads = [[_well_conditioned(s, gen) for s in shapes] for _ in range(STEPS)]
    names = [f"layers.{i}.weight" for i in range(len(shapes))]
    ours = [torch.nn.Parameter(w.clone()) for w in w0]
    theirs = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = ReferenceOptimizer(zip(names, ours), cfg)
    assert [n for n, _ in ref.matrices] == names and ref.adamw is None
    hb = _heavyball_soap(heavyball, theirs, weight_decay, native_schedule)
    errors = []
    for t, gs in enumerate(grads, 1):
        for p, q, g in zip(ours, theirs, gs):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        hb.step()
        if t == 1:
            for name, q, shape in zip(names, theirs, shapes):
                hb_q = hb.state[q][0][hb._find_val_name("Q")]  # [Q_L, Q_R], each (1, k, k)
                for mine, their in zip((ref.state[name]["Q_L"], ref.state[name]["Q_R"]), hb_q):
                    r = min(shape)  # the factor's range: eigenvalues descending on both sides
                    overlap = (mine[:, :r].mT @ their[0][:, :r]).abs()  # I up to signs
                    torch.testing.assert_close(overlap, torch.eye(r), atol=BASIS_TOL, rtol=0)
                    if case == "rectangular":
                        their[0].copy_(mine)
        errors.append(max((p - q).abs().max().item() for p, q in zip(ours, theirs)))
    assert_bits(errors[0], 0.0)  # step 1 only builds the basis, on both sides
    return errors


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_soap_matches_heavyball(heavyball, case, weight_decay):
    for seed in SEEDS:
        errors = _soap_vs_heavyball(heavyball, case, weight_decay, _soap_config(weight_decay), seed=seed)
        assert max(errors) <= SOAP_TOL, (seed, errors)


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_soap_matches_heavyball_without_emulating_the_lift(heavyball, case):
    cfg = CanzonaConfig.from_ds("CanzonaSOAP", {"lr": LR, "weight_decay": 0.1, **SOAP_PARAMS})
    assert type(cfg.rule) is SOAPRule
    for seed in SEEDS:
        errors = _soap_vs_heavyball(heavyball, case, 0.1, cfg, seed=seed)
        assert max(errors) <= SOAP_TOL_NO_LIFT, (seed, errors)


@pytest.mark.parametrize("variant", ["betas_swapped", "no_bias_correction", "second_moment_not_permuted"])
def test_soap_crosscheck_catches_a_wrong_soap(heavyball, variant):
    changes = {"betas_swapped": dict(betas=(0.95, 0.9)), "no_bias_correction": dict(correct_bias=False),
               "second_moment_not_permuted": dict(rule_cls=_UnpermutedV)}[variant]
    errors = _soap_vs_heavyball(heavyball, "square", 0.1, _soap_config(0.1, **changes))
    assert max(errors) > SOAP_TOL_NO_LIFT, errors


def test_heavyball_native_schedule_refreshes_one_update_earlier(heavyball):
    errors = _soap_vs_heavyball(heavyball, "square", 0.0, _soap_config(0.0), native_schedule=True)
    # heavyball's first refresh (after update 1, at call 2) first shows in step 3's update
    assert max(errors[:2]) <= SOAP_TOL, errors
    assert min(errors[2:]) > SOAP_TOL_NO_LIFT, errors


# ------------------------------------------------------------------------------------- Shampoo
def _weighted_sum(xs: list[torch.Tensor], beta: float, t: int) -> torch.Tensor:
    """sum_{s<=t} (1 - beta) beta^(t-s) x_s, or the plain sum for beta = 1."""
    return sum(((1 - beta) * beta ** (t - s) if beta < 1 else 1.0) * xs[s - 1] for s in range(1, t + 1))


def _paper_shampoo(grads: list[torch.Tensor], hp: dict) -> list[torch.Tensor]:
    """Directions of Shampoo with grafting at steps 1..T, float64, from the gradient history
    (module docstring); ``hp`` holds ShampooRule's keys."""
    G = [g.double() for g in grads]
    b1, b2 = hp["betas"]
    eps, block = hp["epsilon"], hp["max_preconditioner_dim"]
    m, n = G[0].shape
    starts = lambda size: [(a, min(a + block, size)) for a in range(0, size, block)]  # noqa: E731
    out = []
    for t in range(1, len(G) + 1):
        M_hat = _weighted_sum(G, b1, t) / (1 - b1**t)
        if hp["grafting"] == "adam":
            g2 = hp["grafting_beta2"]
            graft = M_hat / ((_weighted_sum([g * g for g in G], g2, t) / (1 - g2**t)).sqrt() + hp["grafting_epsilon"])
        elif hp["grafting"] == "adagrad":
            graft = M_hat / (sum(g * g for g in G[:t]).sqrt() + hp["grafting_epsilon"])
        else:
            graft = M_hat
        refreshes = [r for r in range(hp["start_preconditioning_step"], t + 1)
                     if (r - hp["start_preconditioning_step"]) % hp["precondition_frequency"] == 0]
        if not refreshes:
            out.append(graft)
            continue
        r = refreshes[-1]
        D = torch.empty_like(M_hat)
        for r0, r1 in starts(m):
            for c0, c1 in starts(n):
                Gb = [g[r0:r1, c0:c1] for g in G[:r]]
                L = _weighted_sum([g @ g.T for g in Gb], b2, r) + eps * torch.eye(r1 - r0, dtype=torch.float64)
                R = _weighted_sum([g.T @ g for g in Gb], b2, r) + eps * torch.eye(c1 - c0, dtype=torch.float64)
                lam, U = torch.linalg.eigh(torch.kron(L, R))
                S = ((U * lam.pow(-0.25)) @ U.T @ M_hat[r0:r1, c0:c1].reshape(-1)).reshape(r1 - r0, c1 - c0)
                if hp["grafting"] != "none":
                    S = S * (graft[r0:r1, c0:c1].norm() / S.norm())
                D[r0:r1, c0:c1] = S
        out.append(D)
    return out


SHAMPOO_CASES = {
    # Gupta et al.: plain sums, Adam grafting, one block, refreshes at steps 3, 5, 7
    "sums_adam_graft": dict(betas=(0.9, 1.0), epsilon=1e-12, precondition_frequency=2, start_preconditioning_step=3,
                            max_preconditioner_dim=1024, grafting="adam", grafting_beta2=0.999,
                            grafting_epsilon=1e-8),
    # EMA factors, AdaGrad grafting, blocked (8 x 12 -> 5/3 x 5/5/2), refreshes at steps 3, 6
    "ema_adagrad_blocked": dict(betas=(0.9, 0.95), epsilon=1e-6, precondition_frequency=3,
                                start_preconditioning_step=3, max_preconditioner_dim=5, grafting="adagrad",
                                grafting_beta2=0.999, grafting_epsilon=1e-8),
    # no momentum, no grafting: D = L^-1/4 G R^-1/4; refreshes at steps 2, 5, 8
    "no_graft": dict(betas=(0.0, 0.99), epsilon=1e-4, precondition_frequency=3, start_preconditioning_step=2,
                     max_preconditioner_dim=1024, grafting="none", grafting_beta2=0.999, grafting_epsilon=1e-8),
}


def _as_json(hp: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()}


def _shampoo_errors(hp: dict, rule: ShampooRule, shape=(8, 12), seed=1) -> list[float]:
    """Relative Frobenius error of ours vs _paper_shampoo, per step."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=gen) for _ in range(STEPS)]
    info = MatrixInfo("layers.0.weight", shape)
    state = rule.init_state(info, like=torch.zeros(shape))
    expected = _paper_shampoo(grads, hp)
    errors = []
    for t, (g, want) in enumerate(zip(grads, expected), 1):
        got = rule.direction(g.clone(), state, info, t).double()
        errors.append(((got - want).norm() / want.norm()).item())
    return errors


@pytest.mark.parametrize("shape", [(8, 12), (12, 8)])
@pytest.mark.parametrize("case", sorted(SHAMPOO_CASES))
def test_shampoo_matches_the_kronecker_form(case, shape):
    hp = SHAMPOO_CASES[case]
    cfg = CanzonaConfig.from_ds("CanzonaShampoo", {"lr": LR, **_as_json(hp)})
    assert cfg.rule == ShampooRule(**hp)
    errors = _shampoo_errors(hp, cfg.rule, shape)
    assert max(errors) <= SHAMPOO_TOL, errors


@pytest.mark.parametrize("case", sorted(SHAMPOO_CASES))
def test_shampoo_reference_optimizer_weights_match_the_kronecker_form(case):
    """ReferenceOptimizer (ds_config path, decoupled weight decay) against the same directions."""
    hp, wd = SHAMPOO_CASES[case], 0.1
    cfg = CanzonaConfig.from_ds("CanzonaShampoo", {"lr": LR, "weight_decay": wd, **_as_json(hp)})
    gen = torch.Generator().manual_seed(2)
    w0 = 0.1 * torch.randn(8, 12, generator=gen)
    grads = [torch.randn(8, 12, generator=gen) for _ in range(STEPS)]
    p = torch.nn.Parameter(w0.clone())
    ref = ReferenceOptimizer([("layers.0.weight", p)], cfg)
    W = w0.double()
    for g, D in zip(grads, _paper_shampoo(grads, hp)):
        p.grad = g.clone()
        ref.step()
        W = (1 - LR * wd) * W - LR * D
        torch.testing.assert_close(p.detach().double(), W, atol=SHAMPOO_WEIGHT_TOL, rtol=0)


@pytest.mark.parametrize("variant", ["inverse_square_root", "refresh_one_step_late", "no_grafting"])
def test_shampoo_crosscheck_catches_a_wrong_shampoo(variant, monkeypatch):
    hp = SHAMPOO_CASES["sums_adam_graft"]
    changes = {}
    if variant == "inverse_square_root":
        root = shampoo_module.inverse_root
        monkeypatch.setattr(shampoo_module, "inverse_root", lambda mat, _, eps, dtype: root(mat, 2, eps, dtype))
    elif variant == "refresh_one_step_late":
        changes = dict(start_preconditioning_step=hp["start_preconditioning_step"] + 1)
    else:
        changes = dict(grafting="none")
    errors = _shampoo_errors(hp, ShampooRule(**{**hp, **changes}))
    assert max(errors) > 10 * SHAMPOO_TOL, errors

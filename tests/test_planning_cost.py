"""Cost models of the three rules (Muon, Shampoo, SOAP) and the planners' TP charging rule.

Three kinds of check:

* hand-computed values for small shapes (the arithmetic written out in comments);
* counting: each rule's ``direction`` runs under a dispatch mode that adds up the FLOPs of
  every matrix product it executes (2*m*k*n for mm/addmm/bmm/baddbmm, in place or not) and
  records the size of every eigendecomposition and QR; the cost model must equal that
  count, with eigh charged ``EIGH_FLOPS_PER_K3 * k^3`` and QR ``QR_FLOPS_PER_K3 * k^3``
  (element-wise work is ignored by the models and by the count);
* the TP rule: a TP-split spec costs its DP owner ``full / tp`` and its TP host the full
  matrix, and weighing the TP-local shard instead gets Qwen3-32B at TP=8 badly wrong.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from canzona_ds.flops import Flops
from canzona_ds.optim import cost_model
from canzona_ds.optim.muon import GRAM_RESTART
from canzona_ds.optim.rule import EIGH_FLOPS_PER_K3, QR_FLOPS_PER_K3, MatrixInfo, MatrixRule
from canzona_ds.planning.cost import (AUX_BYTES_PER_ELEMENT, COST_MODELS, MASTER_GRAD_BYTES, cost_vector,
                                      slice_cost, task_cost)
from canzona_ds.planning.models import matrix_specs, model_specs
from canzona_ds.planning.params import ParamSpec
from canzona_testkit.kernels import assert_bits

MUON = cost_model("muon")


class OpCounter(TorchDispatchMode):
    """FLOPs of the matrix products executed, and the sizes of eigh/QR calls."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul = 0.0
        self.eigh: list[int] = []
        self.qr: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm"):
            a, b = args[0], args[1]
        elif name in ("addmm", "addmm_", "baddbmm", "baddbmm_"):
            a, b = args[1], args[2]
        else:
            a = b = None
        if a is not None:
            batch = math.prod(a.shape[:-2])
            self.matmul += 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        elif name == "_linalg_eigh":
            self.eigh += [args[0].shape[-1]] * math.prod(args[0].shape[:-2])
        elif name == "linalg_qr":
            self.qr += [args[0].shape[-1]] * math.prod(args[0].shape[:-2])
        return out

    @property
    def modelled(self) -> float:
        """The count in the cost models' units: products + eigh + QR."""
        return (self.matmul + EIGH_FLOPS_PER_K3 * sum(k**3 for k in self.eigh)
                + QR_FLOPS_PER_K3 * sum(k**3 for k in self.qr))


def run_steps(rule: MatrixRule, shape: tuple[int, int], steps: int, num_heads: int | None = None,
              seed: int = 0) -> tuple[list[OpCounter], dict[str, torch.Tensor]]:
    """Counters of steps 1..steps of ``rule`` on random gradients, and the final state."""
    gen = torch.Generator().manual_seed(seed)
    info = MatrixInfo("w", shape, num_heads)
    state = rule.init_state(info, like=torch.zeros(shape))
    counters = []
    for step in range(1, steps + 1):
        grad = torch.randn(shape, generator=gen)
        with OpCounter() as c:
            rule.direction(grad, state, info, step)
        counters.append(c)
    return counters, state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------------- Muon


def test_muon_hand_computed():
    # m <= n: per iteration A = X X^T (2*m*n*m), B = bA + cA@A (2*m^3), X = aX + B@X (2*m*m*n)
    # (4, 6), 5 steps: 5 * (2*(2*4*4*6) + 2*4^3) = 5 * (384 + 128) = 2560
    assert MUON.flops((4, 6)) == Flops(2560.0, 2560.0)
    assert MUON.flops((6, 4)) == Flops(2560.0, 2560.0)  # tall: Newton-Schulz runs on X^T
    assert cost_model("muon", ns_steps=3).flops((4, 6)).amortised == 3 * 512
    # square 8 x 8: 5 * (2*2*8^3 + 2*8^3) = 5 * 3072
    assert MUON.flops((8, 8)).amortised == 15360
    # per head: (8, 6) as 2 heads of (4, 6)
    assert MUON.flops((8, 6), num_heads=2).amortised == 2 * 2560
    m, n = 5, 9
    assert MUON.flops((m, n)).amortised == 5 * (2 * (2 * m * m * n) + 2 * m**3)
    assert MUON.state_bytes((4, 6)) == 4 * 24  # fp32 momentum


@pytest.mark.parametrize("shape, heads", [((6, 10), None), ((10, 6), None), ((8, 8), None), ((12, 10), 3),
                                          ((4, 32), None)])
@pytest.mark.parametrize("ns_steps", [1, 5])
def test_muon_standard_flops_equal_the_count(shape, heads, ns_steps):
    rule = cost_model("muon", ns_steps=ns_steps)
    counters, state = run_steps(rule, shape, 2, heads)
    f = rule.flops(shape, heads)
    assert f.amortised == f.peak
    for c in counters:
        assert not c.eigh and not c.qr
        assert c.matmul == f.amortised
    assert state_nbytes(state) == rule.state_bytes(shape, heads) == 4 * shape[0] * shape[1]


def gram_exact(m: int, n: int, steps: int, restart: int = GRAM_RESTART) -> float:
    """Products of muon._gram_iterations (m < n): R = X X^T at the start and at every
    restart; Q X at every restart and at the end; per iteration R@R, P@Q unless Q was just
    reset, and R = P R P (two products) unless the next iteration restarts or is past
    the end."""
    restarts = math.ceil(steps / restart)
    cubes = steps + (steps - restarts) + 2 * ((steps - 1) - (steps - 1) // restart)
    return restarts * (2.0 * m * n * m + 2.0 * m * m * n) + cubes * 2.0 * m**3


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 17)])
@pytest.mark.parametrize("ns_steps", [1, 2, 5, 6])
def test_muon_gram_count(shape, ns_steps):
    rule = cost_model("muon", ns_method="gram", ns_steps=ns_steps)
    counters, _ = run_steps(rule, shape, 1)
    m, n = sorted(shape)
    assert counters[0].matmul == gram_exact(m, n, ns_steps)
    assert rule.flops(shape).amortised == counters[0].matmul


def test_muon_gram_flops_equal_the_count():
    rule = cost_model("muon", ns_method="gram")
    counters, _ = run_steps(rule, (6, 10), 1)
    assert rule.flops((6, 10)).amortised == counters[0].matmul


def test_muon_gram_square_is_standard():
    assert cost_model("muon", ns_method="gram").flops((8, 8)) == MUON.flops((8, 8))


# ---------------------------------------------------------------------- Shampoo


def test_shampoo_hand_computed_unblocked():
    rule = cost_model("shampoo", precondition_frequency=10)
    # (3, 5): L += G G^T 2*3*5*3 = 90, R += G^T G 2*5*3*5 = 150,
    #         L^-1/4 M: 2*3*3*5 = 90, (.) R^-1/4: 2*3*5*5 = 150          -> 480 per step
    #         roots: (eigh 9 + Q diag Q^T 2) * (3^3 + 5^3) = 11 * 152 = 1672 every 10 steps
    f = rule.flops((3, 5))
    assert f.peak == 480 + 1672
    assert f.amortised == pytest.approx(480 + 167.2)
    # state: exp_avg + Adam graft (2*15) + L, R, L^-1/4, R^-1/4 (2*(9 + 25)), fp32
    assert rule.state_bytes((3, 5)) == 4 * (2 * 15 + 2 * (9 + 25))
    assert cost_model("shampoo", grafting="none").state_bytes((3, 5)) == 4 * (15 + 2 * (9 + 25))


def test_shampoo_hand_computed_blocked():
    rule = cost_model("shampoo", precondition_frequency=10, max_preconditioner_dim=2)
    # (3, 5) in blocks: rows [2, 1] x cols [2, 2, 1]; per block 4*bm*bn*(bm + bn) per step
    #   (2,2) x2: 64 each, (2,1): 24, (1,2) x2: 24 each, (1,1): 8      -> 208
    #   roots 11*(bm^3 + bn^3): (2,2) x2: 176 each, (2,1): 99, (1,2) x2: 99 each, (1,1): 22 -> 671
    f = rule.flops((3, 5))
    assert f.peak == 208 + 671
    assert f.amortised == pytest.approx(208 + 67.1)
    # factors per block 2*(bm^2 + bn^2): (2,2) x2: 16 each, (2,1) 10, (1,2) x2: 10 each, (1,1) 4 -> 66
    assert rule.state_bytes((3, 5)) == 4 * (2 * 15 + 66)


def test_shampoo_blocking_makes_cost_proportional_to_numel():
    rule = cost_model("shampoo", max_preconditioner_dim=64)
    one = rule.flops((64, 64))
    for k, l in ((2, 1), (3, 5), (8, 2)):
        f = rule.flops((64 * k, 64 * l))
        assert f.amortised == pytest.approx(k * l * one.amortised)
        assert f.peak == pytest.approx(k * l * one.peak)
        assert rule.state_bytes((64 * k, 64 * l)) == k * l * rule.state_bytes((64, 64))
    full = cost_model("shampoo", max_preconditioner_dim=65536)
    assert full.flops((128, 128)).amortised == pytest.approx(8 * full.flops((64, 64)).amortised)  # cubic


@pytest.mark.parametrize("shape, block", [((6, 10), 4), ((6, 10), 1024), ((9, 4), 3), ((16, 16), 16)])
@pytest.mark.parametrize("grafting", ["adam", "none"])
def test_shampoo_flops_and_state_equal_the_count(shape, block, grafting):
    f_ = 3
    rule = cost_model("shampoo", precondition_frequency=f_, start_preconditioning_step=2,
                      max_preconditioner_dim=block, grafting=grafting)
    counters, state = run_steps(rule, shape, 2 + 2 * f_)
    f = rule.flops(shape)
    rows, cols = rule.blocks(shape)
    refresh = [c for c in counters[1:] if c.eigh]
    steady = [c for c in counters[1:] if not c.eigh]
    assert len(refresh) == 3 and len(steady) == 2 * f_ - 2
    # one eigendecomposition per factor per block
    assert sorted(refresh[0].eigh) == sorted([bm for bm in rows for _ in cols] + [bn for _ in rows for bn in cols])
    for c in refresh:
        assert c.modelled == pytest.approx(f.peak, rel=1e-12)
    for c in steady:
        assert c.modelled == pytest.approx(f.peak - (EIGH_FLOPS_PER_K3 + 2) * sum(
            bm**3 + bn**3 for bm in rows for bn in cols), rel=1e-12)
    # one full period from the first refresh (steps 2..4): mean cost = amortised
    period = counters[1:1 + f_]
    assert sum(c.modelled for c in period) / f_ == pytest.approx(f.amortised, rel=1e-12)
    assert state_nbytes(state) == rule.state_bytes(shape)


# ------------------------------------------------------------------------- SOAP


def test_soap_hand_computed():
    rule = cost_model("soap", precondition_frequency=10)
    # (3, 5): rotations G', M', N back: 3 * (Q_L side 2*3*3*5 + Q_R side 2*3*5*5) = 3 * 240 = 720
    #         L, R statistics 90 + 150 = 240                                       -> 960 per step
    #         refresh per side F Q (2 k^3) + QR (8/3 k^3): (2 + 8/3) * (27 + 125) = 709 1/3, every 10
    #         first step: eigh of both factors 9 * 152 = 1368 (< 960 + 709 1/3)
    f = rule.flops((3, 5))
    assert f.amortised == pytest.approx(960 + 709 / 10 + 1 / 30)
    assert f.peak == pytest.approx(960 + 709 + 1 / 3)
    # state: exp_avg, exp_avg_sq (2*15) + L, Q_L (2*9) + R, Q_R (2*25), fp32
    assert rule.state_bytes((3, 5)) == 4 * (2 * 15 + 2 * 9 + 2 * 25)
    # a side longer than max_precond_dim is not rotated: right side of (3, 5) at 4
    one = cost_model("soap", precondition_frequency=10, max_precond_dim=4)
    # rotations 3 * 90 = 270, L 90 -> 360; refresh (2 + 8/3) * 27 = 126
    assert one.flops((3, 5)).amortised == pytest.approx(360 + 12.6)
    assert one.state_bytes((3, 5)) == 4 * (2 * 15 + 2 * 9)


@pytest.mark.parametrize("shape, max_dim", [((6, 10), 10000), ((10, 6), 10000), ((6, 10), 8), ((7, 7), 10000)])
def test_soap_flops_and_state_equal_the_count(shape, max_dim):
    f_ = 3
    rule = cost_model("soap", precondition_frequency=f_, max_precond_dim=max_dim)
    counters, state = run_steps(rule, shape, 1 + 2 * f_)
    f = rule.flops(shape)
    first, rest = counters[0], counters[1:]
    rot = rule.rotated(shape)
    assert len(first.eigh) == sum(rot) and not first.qr
    refresh = [c for c in rest if c.qr]
    steady = [c for c in rest if not c.qr]
    assert len(refresh) == 2 and all(len(c.qr) == sum(rot) for c in refresh)
    assert f.peak == pytest.approx(max(c.modelled for c in counters), rel=1e-12)
    for c in rest:
        assert c.modelled <= f.peak * (1 + 1e-12)
    # updates 1..f (steps 2..f+1; the refresh is the f-th): mean = amortised
    assert sum(c.modelled for c in rest[:f_]) / f_ == pytest.approx(f.amortised, rel=1e-12)
    assert len(steady) == 2 * f_ - 2 and steady[0].modelled == pytest.approx(f.amortised - (
        refresh[0].modelled - steady[0].modelled) / f_, rel=1e-12)
    assert state_nbytes(state) == rule.state_bytes(shape)


def test_soap_peak_covers_the_first_step_of_flat_matrices():
    rule = cost_model("soap", precondition_frequency=10)
    counters, _ = run_steps(rule, (2, 50), 1)
    assert rule.flops((2, 50)).peak >= counters[0].modelled


# ------------------------------------------------------------ every rule, generic


RULES = [("muon", {}), ("shampoo", {"max_preconditioner_dim": 65536}), ("shampoo", {}), ("soap", {})]


@pytest.mark.parametrize("name, kw", RULES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 256), (1024, 96), (5120, 25600)])
def test_amortised_at_most_peak(name, kw, shape):
    f = cost_model(name, **kw).flops(shape)
    assert 0 < f.amortised <= f.peak


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_precondition_frequency_spreads_the_peak(name):
    shape = (96, 160)
    fs = [1, 2, 10, 100, 1000]
    flops = [cost_model(name, precondition_frequency=f).flops(shape) for f in fs]
    assert len({f.peak for f in flops}) == 1  # the refresh step costs the same at any frequency
    amortised = [f.amortised for f in flops]
    assert all(a > b for a, b in zip(amortised, amortised[1:]))  # strictly cheaper on average
    periodic = flops[0].peak - flops[0].amortised  # f = 1: refresh every step
    if name == "shampoo":
        assert periodic == 0
        # peak - amortised = roots * (1 - 1/f)
        roots = (EIGH_FLOPS_PER_K3 + 2) * (96**3 + 160**3)
        for f, fl in zip(fs, flops):
            assert fl.peak - fl.amortised == pytest.approx(roots * (1 - 1 / f))
    else:
        refresh = (2 + QR_FLOPS_PER_K3) * (96**3 + 160**3)
        for f, fl in zip(fs, flops):
            assert fl.peak - fl.amortised == pytest.approx(refresh * (1 - 1 / f))
    # Muon has no periodic work
    assert MUON.flops(shape).amortised == MUON.flops(shape).peak


@pytest.mark.parametrize("name, kw", RULES)
def test_rules_are_cost_models(name, kw):
    rule = cost_model(name, **kw)
    assert rule.name == name
    assert isinstance(rule.flops((4, 4)), Flops)
    assert rule.state_bytes((64, 32)) > 0


def test_cost_model_bad_names_and_values():
    with pytest.raises(ValueError, match="'adam'.*Allowed"):
        cost_model("adam")
    with pytest.raises(ValueError, match="precondition_frequency=0"):
        cost_model("shampoo", precondition_frequency=0)
    with pytest.raises(ValueError, match="max_preconditioner_dim=0"):
        cost_model("shampoo", max_preconditioner_dim=0)
    with pytest.raises(ValueError, match="ns_steps=0"):
        cost_model("muon", ns_steps=0)


# --------------------------------------------------------------------- TP rule


@pytest.mark.parametrize("pdim, local", [(0, (64, 256)), (1, (256, 64))])
@pytest.mark.parametrize("name, kw", RULES)
def test_tp_split_spec_charged_share_and_full(pdim, local, name, kw):
    model = cost_model(name, **kw)
    s = ParamSpec("w", local, tp_partition_dim=pdim, tp_size=4)
    assert s.is_tp_split and s.full_matrix_shape == (256, 256)
    full = model.flops((256, 256))
    assert task_cost(s, "flops", model) == pytest.approx(full.amortised / 4)
    assert task_cost(s, "flops", model, hosted=True) == full.amortised
    assert task_cost(s, "peak_flops", model) == pytest.approx(full.peak / 4)
    assert task_cost(s, "peak_flops", model, hosted=True) == full.peak
    state = model.state_bytes((256, 256))
    assert task_cost(s, "memory", model) == pytest.approx(64 * 256 * MASTER_GRAD_BYTES + state / 4)
    assert task_cost(s, "memory", model, hosted=True) == 256 * 256 * MASTER_GRAD_BYTES + state
    assert task_cost(s, "numel") == 64 * 256 and task_cost(s, "numel", hosted=True) == 256 * 256
    # the TP group's 4 DP owners' shares add up to the hosted matrix's cost
    for cost in COST_MODELS:
        assert 4 * task_cost(s, cost, model) == pytest.approx(task_cost(s, cost, model, hosted=True))


def test_unsplit_and_aux_specs():
    plain = ParamSpec("w", (64, 256))
    for cost in COST_MODELS:
        assert task_cost(plain, cost, MUON) == task_cost(plain, cost, MUON, hosted=True)
    assert task_cost(plain, "flops", MUON) == MUON.flops((64, 256)).amortised
    # tp_size 1 with a partition dim is not split
    assert not ParamSpec("w", (64, 256), tp_partition_dim=0, tp_size=1).is_tp_split
    heads = ParamSpec("qkv", (32, 16), num_heads=4)
    assert task_cost(heads, "flops", MUON) == MUON.flops((32, 16), 4).amortised == 4 * MUON.flops((8, 16)).amortised
    aux = ParamSpec("norm", (8,), "aux")
    assert cost_vector([aux], "flops", MUON) == [0.0] and cost_vector([aux], "peak_flops", MUON) == [0.0]
    assert cost_vector([aux], "memory", MUON) == [8 * AUX_BYTES_PER_ELEMENT]
    assert cost_vector([aux], "numel") == [8.0]


def test_cost_errors_are_named():
    s = ParamSpec("w", (4, 4))
    with pytest.raises(ValueError, match="cost model='bytes'.*Allowed"):
        task_cost(s, "bytes", MUON)
    for cost in ("flops", "peak_flops", "memory"):
        with pytest.raises(ValueError, match=f"cost model '{cost}' needs the optimizer's cost model"):
            task_cost(s, cost)
    assert_bits(task_cost(s, "numel"), 16.0)  # numel needs no model


def test_slice_cost_rule():
    s = ParamSpec("w", (10, 10))
    load = task_cost(s, "memory", MUON)
    assert_bits(slice_cost(s, "flops", 7.0, 30), 7.0)  # the whole step runs on every rank it touches
    assert_bits(slice_cost(s, "peak_flops", 7.0, 30), 7.0)
    assert_bits(slice_cost(s, "numel", 100.0, 30), 30.0)
    assert slice_cost(s, "memory", load, 30) == 30 * MASTER_GRAD_BYTES + MUON.state_bytes((10, 10))
    aux = ParamSpec("b", (10,), "aux")
    assert slice_cost(aux, "memory", task_cost(aux, "memory"), 4) == 4 * AUX_BYTES_PER_ELEMENT  # element-wise
    with pytest.raises(ValueError, match="part=101"):
        slice_cost(s, "flops", 7.0, 101)


def test_local_shard_shapes_misweight_hosted_matrices_qwen3_32b_tp8():
    """The issue: weighing a TP-split matrix by its TP-local shard's shape.  Muon on
    Qwen3-32B, TP=8 (per layer: qkv, proj, fc1, fc2)."""
    specs = matrix_specs(model_specs("qwen3-32b", tp=8))
    assert len(specs) == 4 * 64 and all(s.is_tp_split for s in specs)
    local = [MUON.flops(s.matrix_shape).amortised for s in specs]
    share = cost_vector(specs, "flops", MUON)
    hosted = cost_vector(specs, "flops", MUON, hosted=True)
    share_ratio = [a / b for a, b in zip(share, local)]
    hosted_ratio = [a / b for a, b in zip(hosted, local)]
    by_kind = {s.name.split(".", 3)[-1]: (round(sr, 3), round(hr, 2))
               for s, sr, hr in zip(specs[:4], share_ratio, hosted_ratio)}
    # hosted (full) matrix vs its local shard: 6.0x (fc1) .. 47.7x (proj): the "6-47x"
    assert min(hosted_ratio) == pytest.approx(6.0, rel=1e-3)
    assert max(hosted_ratio) == pytest.approx(47.73, rel=1e-3)
    assert by_kind == {"self_attention.linear_qkv.weight": (4.444, 35.56),
                       "self_attention.linear_proj.weight": (5.966, 47.73),
                       "mlp.linear_fc1.weight": (0.75, 6.0),
                       "mlp.linear_fc2.weight": (1.341, 10.73)}
    # DP owner's share (full / 8) vs the local shard: 0.75x (fc1) .. 5.97x (proj), so local
    # shapes do not just scale the loads: they distort the weights between matrix kinds by ~8x
    assert min(share_ratio) == pytest.approx(0.75) and max(share_ratio) == pytest.approx(5.966, rel=1e-3)
    assert max(share_ratio) / min(share_ratio) > 7.5
    qkv, proj, fc1, fc2 = range(4)
    # the order of the kinds is the same (fc1 > fc2 > qkv > proj) ...
    assert sorted(range(4), key=lambda i: -local[i]) == sorted(range(4), key=lambda i: -share[i]) == [fc1, fc2, qkv, proj]
    # ... but by local shapes an fc1 weighs 39.8 projs, by what its owner runs 5.0
    assert local[fc1] / local[proj] == pytest.approx(39.77, rel=1e-3)
    assert share[fc1] / share[proj] == pytest.approx(5.0)

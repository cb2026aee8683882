"""Shampoo and SOAP rules (single process): the math the docstrings state, the optimizer equal
to the reference, checkpoint round trips, and the no-gradient semantics."""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import copy

import pytest
import torch

from canzona_ds.config import CanzonaConfig
from canzona_ds.optimizer import CanzonaOptimizer
from canzona_ds.reference import ReferenceOptimizer
from canzona_ds.optim.rule import MatrixInfo
from canzona_ds.optim.shampoo import ShampooRule, inverse_root
from canzona_ds.optim.soap import SOAPRule
from canzona_testkit.models import HP, batches, make_model

TYPES = ("CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP")


def _run(model, opt, steps, start=0):
    for x, y in batches(start + steps, 4)[start:]:
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()


@pytest.mark.parametrize("opt_type", TYPES)
def test_optimizer_equals_reference_single_process(opt_type):
    torch.set_num_threads(test_threads())
    cfg = CanzonaConfig.from_ds(opt_type, HP[opt_type])
    a, b = make_model(0), make_model(0)
    _run(a, CanzonaOptimizer(a.named_parameters(), cfg), 5)
    _run(b, ReferenceOptimizer(b.named_parameters(), cfg), 5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("opt_type", TYPES)
def test_state_dict_round_trip_resumes_bit_exactly(opt_type):
    torch.set_num_threads(test_threads())
    cfg = CanzonaConfig.from_ds(opt_type, HP[opt_type])
    a = make_model(0)
    oa = CanzonaOptimizer(a.named_parameters(), cfg)
    _run(a, oa, 3)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    _run(a, oa, 3, start=3)
    b = make_model(1)
    b.load_state_dict(saved_model)
    ob = CanzonaOptimizer(b.named_parameters(), cfg)
    ob.load_state_dict(saved_opt)
    assert ob.param_groups[0]["step"] == 3
    _run(b, ob, 3, start=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_loading_another_rules_state_is_refused():
    a = make_model(0)
    muon = CanzonaOptimizer(a.named_parameters(), CanzonaConfig.from_ds("CanzonaMuon", HP["CanzonaMuon"]))
    _run(a, muon, 1)
    soap = CanzonaOptimizer(a.named_parameters(), CanzonaConfig.from_ds("CanzonaSOAP", HP["CanzonaSOAP"]))
    with pytest.raises(ValueError, match="'muon'.*'soap'"):
        soap.load_state_dict(muon.state_dict())


@pytest.mark.parametrize("opt_type", TYPES)
def test_parameter_without_gradient_is_stepped_with_zero_gradient(opt_type):
    """DeepSpeed ZeRO's semantics (its flat gradient partition has no None): momentum and weight
    decay still move a parameter that got no gradient; the optimizer and the reference agree."""
    torch.set_num_threads(test_threads())
    cfg = CanzonaConfig.from_ds(opt_type, HP[opt_type])
    models = [make_model(0), make_model(0)]
    opts = [CanzonaOptimizer(models[0].named_parameters(), cfg), ReferenceOptimizer(models[1].named_parameters(), cfg)]
    for s, (x, y) in enumerate(batches(4, 4)):
        for m, o in zip(models, opts):
            m.zero_grad(set_to_none=True)
            m(x, y).backward()
            if s == 3:  # fc2 and proj.bias unused in this step
                m.fc2.weight.grad = None
                m.proj.bias.grad = None
            before = m.fc2.weight.detach().clone()
            o.step()
        if s == 3:
            assert not torch.equal(models[0].fc2.weight, before)  # decay + momentum still applied
    for (n, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


# ------------------------------------------------------------------ Shampoo
def _grads(shape, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def test_shampoo_inverse_root():
    A = torch.randn(12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    L = A @ A.T
    R = inverse_root(L, 4, 1e-6, torch.float64)
    eye = torch.eye(12, dtype=torch.float64)
    torch.testing.assert_close(torch.linalg.matrix_power(R, 4) @ (L + 1e-6 * eye), eye, rtol=0, atol=1e-8)


def test_shampoo_statistics_sum_when_beta2_is_one_and_roots_on_schedule():
    rule = ShampooRule(betas=(0.0, 1.0), precondition_frequency=3, start_preconditioning_step=2)
    info = MatrixInfo("w", (6, 10))
    grads = _grads((6, 10), 6)
    state = rule.init_state(info, like=grads[0])
    refreshed = []
    for t, G in enumerate(grads, start=1):
        before = state.get("Linv.0.0")
        rule.direction(G, state, info, t)
        after = state.get("Linv.0.0")
        refreshed.append(after is not None and (before is None or not torch.equal(before, after)))
    assert refreshed == [False, True, False, False, True, False]  # steps 2 and 5
    torch.testing.assert_close(state["L.0.0"], sum(G @ G.T for G in grads), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state["R.0.0"], sum(G.T @ G for G in grads), rtol=1e-5, atol=1e-5)


def test_shampoo_grafting_sets_the_step_size_and_shampoo_the_direction():
    rule = ShampooRule(betas=(0.0, 1.0), start_preconditioning_step=1, precondition_frequency=1, grafting="adagrad",
                       epsilon=1e-6)
    info = MatrixInfo("w", (8, 5))
    G = _grads((8, 5), 1, seed=3)[0]
    state = rule.init_state(info, like=G)
    D = rule.direction(G, state, info, 1)
    graft = G / (G * G).sqrt().add(rule.grafting_epsilon)  # AdaGrad after one step
    S = state["Linv.0.0"] @ G @ state["Rinv.0.0"]
    torch.testing.assert_close(D.norm(), graft.norm(), rtol=1e-5, atol=0)
    torch.testing.assert_close(D / D.norm(), S / S.norm(), rtol=1e-5, atol=1e-6)


def test_shampoo_before_preconditioning_is_the_grafted_optimizer():
    rule = ShampooRule(betas=(0.9, 1.0), start_preconditioning_step=5, grafting="adam", grafting_beta2=0.99)
    info = MatrixInfo("w", (4, 7))
    state = rule.init_state(info, like=torch.zeros(4, 7))
    m = v = torch.zeros(4, 7)
    for t, G in enumerate(_grads((4, 7), 3, seed=4), start=1):
        D = rule.direction(G, state, info, t)
        m, v = 0.9 * m + 0.1 * G, 0.99 * v + 0.01 * G * G
        adam = (m / (1 - 0.9**t)) / ((v / (1 - 0.99**t)).sqrt() + 1e-8)
        torch.testing.assert_close(D, adam, rtol=1e-5, atol=1e-6)


def test_shampoo_blocks_precondition_independently():
    """max_preconditioner_dim=4 cuts a 6 x 8 matrix into 2 x 2 blocks; each block equals
    Shampoo on that block alone."""
    blocked = ShampooRule(max_preconditioner_dim=4, start_preconditioning_step=1, precondition_frequency=1)
    whole = ShampooRule(max_preconditioner_dim=1024, start_preconditioning_step=1, precondition_frequency=1)
    info = MatrixInfo("w", (6, 8))
    state = blocked.init_state(info, like=torch.zeros(6, 8))
    assert sorted(k for k in state if k.startswith("L.")) == ["L.0.0", "L.0.1", "L.1.0", "L.1.1"]
    assert state["L.1.0"].shape == (2, 2) and state["R.0.1"].shape == (4, 4)
    grads = _grads((6, 8), 3, seed=5)
    block_states = {}
    for t, G in enumerate(grads, start=1):
        D = blocked.direction(G, state, info, t)
        for i, rows in enumerate((slice(0, 4), slice(4, 6))):
            for j, cols in enumerate((slice(0, 4), slice(4, 8))):
                sub = G[rows, cols]
                sinfo = MatrixInfo("b", tuple(sub.shape))
                st = block_states.setdefault((i, j), whole.init_state(sinfo, like=sub))
                torch.testing.assert_close(D[rows, cols], whole.direction(sub, st, sinfo, t), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ SOAP
def test_soap_first_step_builds_the_basis_and_does_not_move_the_weights():
    cfg = CanzonaConfig.from_ds("CanzonaSOAP", dict(HP["CanzonaSOAP"], weight_decay=0.5))
    model = make_model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = CanzonaOptimizer(model.named_parameters(), cfg)
    _run(model, opt, 1)
    for n in ("qkv.weight", "fc1.weight"):
        assert torch.equal(model.get_parameter(n), before[n]), n
        st = opt.matrix_state[n]
        for key, side in (("Q_L", "L"), ("Q_R", "R")):
            Q, F = st[key], st[side]
            torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[0]), rtol=0, atol=1e-5)
            off = Q.T @ F @ Q
            assert (off - torch.diag(torch.diagonal(off))).abs().max() < 1e-4 * F.abs().max()
    assert not torch.equal(model.embed.weight, before["embed.weight"])  # AdamW half steps from step 1


def test_soap_without_rotation_is_adam_with_bias_correction():
    """Both sides longer than max_precond_dim: no eigenbasis, so from step 2 SOAP is Adam
    (first moment in the original space) with the step size's bias correction over k = t-1."""
    rule = SOAPRule(betas=(0.9, 0.95), max_precond_dim=3)
    info = MatrixInfo("w", (5, 6))
    state = rule.init_state(info, like=torch.zeros(5, 6))
    assert "L" not in state and "R" not in state
    m = v = torch.zeros(5, 6)
    for t, G in enumerate(_grads((5, 6), 4, seed=6), start=1):
        D = rule.direction(G, state, info, t)
        if t == 1:
            assert rule.scales(0.1, 0.0, info, 1) == (1.0, 0.0)
            continue
        m, v = 0.9 * m + 0.1 * G, 0.95 * v + 0.05 * G * G
        torch.testing.assert_close(D, m / (v.sqrt() + 1e-8), rtol=1e-5, atol=1e-6)
        k = t - 1
        assert rule.scales(0.1, 0.0, info, t)[1] == pytest.approx(0.1 * (1 - 0.95**k) ** 0.5 / (1 - 0.9**k))


def test_soap_refresh_keeps_an_orthonormal_basis_and_permutes_the_second_moment():
    rule = SOAPRule(precondition_frequency=2)
    info = MatrixInfo("w", (6, 9))
    grads = _grads((6, 9), 4, seed=7)
    state = rule.init_state(info, like=grads[0])
    for t, G in enumerate(grads[:2], start=1):
        rule.direction(G, state, info, t)
    V_before, Q_before = state["exp_avg_sq"].clone(), state["Q_L"].clone()
    rule.direction(grads[2], state, info, 3)  # k = 2: a refresh after this update
    Q = state["Q_L"]
    torch.testing.assert_close(Q.T @ Q, torch.eye(6), rtol=0, atol=1e-5)
    assert not torch.equal(Q, Q_before)
    assert state["exp_avg_sq"].shape == V_before.shape


def test_cost_amortisation():
    s = ShampooRule(precondition_frequency=10, max_preconditioner_dim=4096)
    f = s.flops((1024, 4096))
    assert f.peak > f.amortised
    once = ShampooRule(precondition_frequency=1, max_preconditioner_dim=4096).flops((1024, 4096))
    assert once.amortised == pytest.approx(once.peak)
    soap = SOAPRule(precondition_frequency=10).flops((1024, 4096))
    assert soap.peak > soap.amortised
    assert SOAPRule().state_bytes((3, 5)) == 4 * (2 * 15 + 2 * 9 + 2 * 25)
    assert ShampooRule().state_bytes((3, 5)) == 4 * (2 * 15 + 2 * (9 + 25))

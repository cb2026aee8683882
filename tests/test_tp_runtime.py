"""The micro-group runtime (TP-ASC) on real gloo processes, TP=2, for every matrix rule.

Optimizer level: identical full gradients each step, sharded Megatron-style (GQA QKV
``[q_r; k_r; v_r]``, row-parallel proj, fused SwiGLU fc1 ``[gate_r; up_r]``, row-parallel
fc2, a tall column-parallel matrix).  For Muon, Shampoo and SOAP (refresh periods of 2, so
the 4 steps include preconditioner / eigenbasis refreshes; Shampoo blocked at 32, SOAP
leaving sides > 48 unrotated) the TP result must be

  * bit-identical (rtol=atol=0) to :class:`ReferenceOptimizer` (the single-process rule)
    on the concatenated-shard matrix, for every schedule and for TP-SC;
  * for Muon also equal, within bf16 rounding, to Muon on the TP=1 fused layout
    (``[gate; up]``, ``[q; k; v]``): Newton-Schulz is permutation-equivariant (proved in
    fp64 below).  Blocked Shampoo and SOAP's factors are not, so for them the concatenated
    layout is the definition of the update (canzona_ds/tp/runtime.py).

Replicated (non-split) matrices are not the runtime's job (CanzonaOptimizer updates them
locally; tests/test_tp_megatron.py covers them end to end).

One ``run_distributed`` per rule; inside it every scenario runs in its own ``try`` and
reports its own result or traceback, so a failing scenario fails only its own tests.

Cost: 3 rank runs; 1 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import traceback
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from canzona_ds.config import CanzonaConfig, TPConfig
from canzona_ds.optim.muon import NS_COEFFICIENTS, MuonRule, _standard_iterations
from canzona_ds.reference import ReferenceOptimizer
from canzona_ds.optim.rule import MatrixRule
from canzona_ds.optim.shampoo import ShampooRule
from canzona_ds.optim.soap import SOAPRule
from canzona_testkit.dist import run_distributed
from canzona_testkit.megatron_standin import shard_tensor, unshard_tensor
from canzona_ds.tp import MicroGroupRuntime, TPMatrix

TP, LR, WD, STEPS = 2, 0.05, 0.1, 4
#: Muon vs the TP=1 fused layout: STEPS x adjusted lr (<= 0.1 here) x ~1 bf16 ulp (2**-8)
#: of an O(0.5) update element, rounded up (measured max 7.0e-4)
BF16_TOL = 2e-3

# name: (TP=1 full shape, partition dim, fused blocks along it)
MATRICES: dict[str, tuple[tuple[int, int], int, list[int]]] = {
    "qkv": ((4 * 8 + 2 * 2 * 8, 24), 0, [32, 16, 16]),    # heads 4, kv 2, head_dim 8
    "proj": ((24, 32), 1, [32]),
    "fc1": ((2 * 40, 24), 0, [40, 40]),                   # [gate; up]
    "fc2": ((24, 40), 1, [40]),
    "col_tall": ((64, 12), 0, [64]),
}
NAMES = list(MATRICES)

#: refresh every 2 steps; Shampoo blocks sides > 32 (qkv, fc1, fc2, col_tall are blocked),
#: SOAP leaves sides > 48 unrotated (qkv, fc1, col_tall rows)
RULES: dict[str, MatrixRule] = {
    "muon": MuonRule(momentum=0.95),
    "shampoo": ShampooRule(betas=(0.9, 0.99), precondition_frequency=2, start_preconditioning_step=2,
                           max_preconditioner_dim=32, epsilon=1e-8),
    "soap": SOAPRule(betas=(0.9, 0.95), precondition_frequency=2, max_precond_dim=48),
}

#: scenario -> (baseline class name or None for MicroGroupRuntime, TPConfig fields, matrix names)
SCENARIOS: dict[str, tuple[str | None, dict, list[str]]] = {
    "asc_pipe": (None, dict(pipelined=True, c_max=3000), NAMES),        # several micro-groups
    "asc_block": (None, dict(pipelined=False, c_max=3000), NAMES),
    "asc_onegroup": (None, dict(c_max=1e9), NAMES),
    "no_fusion": (None, dict(scheduler="no_fusion"), NAMES),
    "round_robin": (None, dict(scheduler="round_robin"), NAMES),
    # one split matrix: one rank hosts it, the other hosts nothing (empty receives)
    "hosts_nothing": (None, dict(c_max=1e9), ["fc1"]),
    "sc": ("SynchronousTP", {}, NAMES),
    "local": ("ShardLocalTP", {}, NAMES),
}
ASC = ("asc_pipe", "asc_block", "asc_onegroup", "no_fusion", "round_robin", "hosts_nothing")
EXACT = ("asc_pipe", "asc_block", "asc_onegroup", "no_fusion", "round_robin", "sc")


def full_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(*shape, generator=g) for n, (shape, _, _) in MATRICES.items()}


def full_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(*shape, generator=g) * 0.1 for n, (shape, _, _) in MATRICES.items()}


def shard(t: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    _, dim, blocks = MATRICES[name]
    return shard_tensor(t, dim, blocks, TP, rank)


def tp_matrix(name: str) -> TPMatrix:
    shape, dim, _ = MATRICES[name]
    return TPMatrix(name, shape, dim, (shape[dim] // TP,) * TP)


# ---------------------------------------------------------------- the workers
def _run_scenario(rank: int, rule: MatrixRule, scenario: str) -> dict[str, Any]:
    import torch.distributed as dist

    from canzona_testkit import baselines
    from canzona_testkit.comm import CommCounter

    baseline, tp_kw, names = SCENARIOS[scenario]
    mats = [tp_matrix(n) for n in names]
    group = dist.group.WORLD
    if baseline is None:
        rt = MicroGroupRuntime(mats, rule, group, TPConfig(**tp_kw), state={})
    else:
        rt = getattr(baselines, baseline)(mats, rule, group)
    fp = full_params()
    params = [shard(fp[n], n, rank) for n in names]
    counts, sizes, stats = [], [], []
    for s in range(STEPS):
        fg = full_grads(s)
        grads = [shard(fg[n], n, rank) for n in names]
        with CommCounter() as cc:
            st = rt.step(params, grads, lr=LR, weight_decay=WD, step=s + 1)
        counts.append({op: calls for op, (calls, _, _) in cc.by_op("torch").items()})
        sizes.append(cc.by_group("torch"))
        stats.append((dict(st.collectives), st.bytes_sent, st.flops))
    out = {"params": {n: p.numpy() for n, p in zip(names, params)}, "counts": counts, "group_sizes": sizes,
           "stats": stats, "expected": rt.expected_collectives()}
    if baseline is None:
        out.update(groups=len(rt.plan.groups), hosted=rt.hosted_names(), state_keys=sorted(rt.state))
    return out


def _isolated(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"ok": fn()}`` or ``{"error": traceback}``: one scenario's failure stays its own."""
    try:
        return {"ok": fn()}
    except Exception:  # noqa: BLE001 - reported to the scenario's own test
        return {"error": traceback.format_exc()}


def _cmax_error(rule: MatrixRule) -> str:
    import torch.distributed as dist

    try:
        MicroGroupRuntime([tp_matrix("fc1"), tp_matrix("fc2")], rule, dist.group.WORLD, TPConfig(c_max=100))
    except ValueError as e:
        return str(e)
    return "no error"


def _worker(rank: int, world: int, rule_name: str) -> dict[str, dict[str, Any]]:
    rule = RULES[rule_name]
    out = {sc: _isolated(lambda sc=sc: _run_scenario(rank, rule, sc)) for sc in SCENARIOS}
    out["cmax_error"] = _isolated(lambda: _cmax_error(rule))
    return out


@lru_cache(maxsize=None)
def _results(rule_name: str) -> tuple[list, str | None]:
    try:
        return run_distributed(_worker, TP, rule_name, timeout=240), None
    except RuntimeError as e:
        return [], str(e)


def scenario(rule_name: str, name: str) -> list[dict[str, Any]]:
    """Per-rank results of one scenario (fails the calling test with that scenario's traceback)."""
    res, err = _results(rule_name)
    if err is not None:
        pytest.fail(f"{rule_name}: the TP=2 processes failed:\n{err}")
    for r in range(TP):
        if "error" in res[r][name]:
            pytest.fail(f"{rule_name}/{name} failed on rank {r}:\n{res[r][name]['error']}")
    return [res[r][name]["ok"] for r in range(TP)]


def assembled(per_rank: list[dict[str, Any]], name: str, layout: str) -> torch.Tensor:
    """The full matrix from the TP shards: ``"tp"`` = concatenated shards, ``"fused"`` = TP=1 layout."""
    _, dim, blocks = MATRICES[name]
    shards = [torch.from_numpy(per_rank[r]["params"][name]) for r in range(TP)]
    return torch.cat(shards, dim=dim) if layout == "tp" else unshard_tensor(shards, dim, blocks)


# ---------------------------------------------------------------- the single-process oracle
@contextmanager
def one_thread() -> Iterator[None]:
    """The ranks run 1 thread; the reference does too (same GEMM reduction order)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(test_threads())
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@lru_cache(maxsize=None)
def reference(rule_name: str, layout: str, names: tuple[str, ...] = tuple(NAMES)) -> dict[str, torch.Tensor]:
    """``ReferenceOptimizer`` (the rule on whole matrices) on the ``layout`` full matrices."""

    def to_layout(t: torch.Tensor, n: str) -> torch.Tensor:
        return t.clone() if layout == "fused" else torch.cat([shard(t, n, r) for r in range(TP)],
                                                              dim=MATRICES[n][1])

    fp = full_params()
    params = {n: torch.nn.Parameter(to_layout(fp[n], n)) for n in names}
    config = CanzonaConfig(rule=RULES[rule_name], lr=LR, adam_lr=LR, weight_decay=WD)
    opt = ReferenceOptimizer(params.items(), config)
    assert [n for n, _ in opt.matrices] == list(names)  # every one is a matrix for the rule
    with one_thread():
        for s in range(STEPS):
            fg = full_grads(s)
            for n, p in params.items():
                p.grad = to_layout(fg[n], n)
            opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", EXACT)
@pytest.mark.parametrize("rule_name", list(RULES))
def test_tp2_bit_identical_to_rule_on_concatenated_matrix(rule_name: str, mode: str) -> None:
    res = scenario(rule_name, mode)
    ref = reference(rule_name, "tp")
    for n in NAMES:
        torch.testing.assert_close(assembled(res, n, "tp"), ref[n], rtol=0, atol=0,
                                   msg=lambda m, n=n: f"{rule_name} {mode} {n}: {m}")
    init = full_params()
    assert all(not torch.equal(ref[n], torch.cat([shard(init[n], n, r) for r in range(TP)], dim=MATRICES[n][1]))
               for n in NAMES)  # the rule really moved every matrix


@pytest.mark.parametrize("mode", ["asc_pipe", "sc"])
def test_muon_tp2_equals_tp1_fused_layout_up_to_bf16_rounding(mode: str) -> None:
    res = scenario("muon", mode)
    ref = reference("muon", "fused")
    for n in NAMES:
        # NS is permutation-equivariant (exactly: the fp64 test); a permutation of the GEMM's
        # inner dimension (fc1, qkv are tall: their row permutation becomes one) changes the
        # summation order, i.e. bf16 rounding
        torch.testing.assert_close(assembled(res, n, "fused"), ref[n], rtol=0, atol=BF16_TOL,
                                   msg=lambda m, n=n: f"{mode} {n}: {m}")


@pytest.mark.parametrize("rule_name", list(RULES))
def test_blocking_and_pipelined_bit_identical(rule_name: str) -> None:
    pipe, block = scenario(rule_name, "asc_pipe"), scenario(rule_name, "asc_block")
    for r in range(TP):
        for n in NAMES:
            np.testing.assert_array_equal(pipe[r]["params"][n], block[r]["params"][n], err_msg=f"rank {r} {n}")


def _ns_fp64(G: torch.Tensor) -> torch.Tensor:
    """Muon's quintic iteration (the product's ``_standard_iterations``) in fp64, with
    ``newton_schulz``'s orientation and normalisation (its public entry point is bf16-only)."""
    tall = G.size(0) > G.size(1)
    X = G.mT if tall else G
    X = _standard_iterations(X / X.norm().clamp(min=1e-7), 5, NS_COEFFICIENTS)
    return X.mT if tall else X


@pytest.mark.parametrize("name", ["fc1", "qkv"])
def test_newton_schulz_equivariant_to_fused_tp_layout_fp64(name: str) -> None:
    """In fp64 the TP layout's update is the permuted TP=1 update to 1e-12: the proof."""
    shape, dim, blocks = MATRICES[name]
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    O = _ns_fp64(G)
    for tp in (2, 4):
        G_tp = torch.cat([shard_tensor(G, dim, blocks, tp, r) for r in range(tp)], dim=dim)
        assert not torch.equal(G_tp, G)  # the layouts really differ
        back = unshard_tensor(list(_ns_fp64(G_tp).split(shape[dim] // tp, dim=dim)), dim, blocks)
        torch.testing.assert_close(back, O, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- plan, collectives, hosting
@pytest.mark.parametrize("rule_name", list(RULES))
def test_collectives_per_step_match_plan(rule_name: str) -> None:
    for mode in ASC:
        for r, res in enumerate(scenario(rule_name, mode)):
            assert res["expected"] == {"all_to_all_single": 2 * res["groups"]}, (mode, r)
            for counts, sizes in zip(res["counts"], res["group_sizes"]):
                assert counts == res["expected"], (mode, r, counts)
                assert sizes == {TP: 2 * res["groups"]}, (mode, r, sizes)  # all on the TP group
    groups = {mode: scenario(rule_name, mode)[0]["groups"] for mode in ASC}
    assert groups["asc_pipe"] >= 2  # c_max=3000 forces several micro-groups
    assert groups["asc_onegroup"] == 1
    assert groups["no_fusion"] == len(NAMES)  # one per matrix
    for res in scenario(rule_name, "sc"):
        assert res["counts"] == [{"all_gather_into_tensor": len(NAMES)}] * STEPS
    for res in scenario(rule_name, "local"):
        assert res["counts"] == [{}] * STEPS


@pytest.mark.parametrize("rule_name", list(RULES))
def test_hosts_keep_the_state_of_exactly_their_matrices(rule_name: str) -> None:
    for mode in ASC:
        res = scenario(rule_name, mode)
        hosted = [res[r]["hosted"] for r in range(TP)]
        names = SCENARIOS[mode][2]
        assert sorted(hosted[0] + hosted[1]) == sorted(names), mode  # each matrix hosted once
        for r in range(TP):
            assert res[r]["state_keys"] == sorted(hosted[r]), (mode, r)


@pytest.mark.parametrize("rule_name", list(RULES))
def test_rank_hosting_nothing(rule_name: str) -> None:
    res = scenario(rule_name, "hosts_nothing")
    assert sorted([res[0]["hosted"], res[1]["hosted"]]) == [[], ["fc1"]]
    ref = reference(rule_name, "tp", ("fc1",))
    torch.testing.assert_close(assembled(res, "fc1", "tp"), ref["fc1"], rtol=0, atol=0)


@pytest.mark.parametrize("rule_name", list(RULES))
def test_asc_computes_each_matrix_once_sc_on_every_rank(rule_name: str) -> None:
    """FLOPs (the runtime's own count, from the rule's cost model): ASC splits the work,
    SC repeats it on every rank.  Bytes on the wire (this rank's sends): ASC sends fp32
    gradient shards in and direction shards back in the rule's direction dtype, so Muon
    (bf16 directions) moves 3/4 of SC's fp32 all-gather and Shampoo/SOAP (fp32) as much."""
    rule = RULES[rule_name]
    asc, sc = scenario(rule_name, "asc_onegroup"), scenario(rule_name, "sc")
    first = 0  # step 1 (the counts are per step and the same every step)
    asc_flops = [asc[r]["stats"][first][2] for r in range(TP)]
    sc_flops = [sc[r]["stats"][first][2] for r in range(TP)]
    full = sum(rule.flops(tp_matrix(n).info.shape2d).amortised for n in NAMES)
    assert sc_flops == [pytest.approx(full)] * TP
    assert sum(asc_flops) == pytest.approx(full) and max(asc_flops) < full
    numel = sum(np.prod(MATRICES[n][0]) for n in NAMES)
    direction_bytes = torch.empty(0, dtype=rule.direction_dtype(torch.float32)).element_size()
    assert sum(asc[r]["stats"][first][1] for r in range(TP)) == numel * (TP - 1) / TP * (4 + direction_bytes)
    assert sum(sc[r]["stats"][first][1] for r in range(TP)) == numel * (TP - 1) * 4
    if rule_name == "muon":
        assert sum(asc[r]["stats"][first][1] for r in range(TP)) < sum(sc[r]["stats"][first][1] for r in range(TP))


#: matrices whose shard-local update is exact anyway: Shampoo blocked at 32 rows preconditions
#: each 32-row shard of qkv (64 rows) and col_tall (64 rows) as its own block on the full
#: matrix too, so cutting there changes nothing
SHARD_LOCAL_EXACT = {"muon": (), "shampoo": ("qkv", "col_tall"), "soap": ()}


@pytest.mark.parametrize("rule_name", list(RULES))
def test_shard_local_is_not_the_exact_update(rule_name: str) -> None:
    """The DeepSpeed-Muon-under-AutoTP baseline updates each shard as a whole matrix.  Its
    4-step update misses the exact one (the rule on the concatenated matrix) by more than
    10% (relative L2 per matrix; measured 16-63% Muon, 17-22% Shampoo, 62-66% SOAP), far
    outside any rounding, except where the rule itself never looks across the shard cut."""
    res = scenario(rule_name, "local")
    ref = reference(rule_name, "tp")
    init = full_params()
    for n in NAMES:
        start = torch.cat([shard(init[n], n, r) for r in range(TP)], dim=MATRICES[n][1])
        miss = float((assembled(res, n, "tp") - ref[n]).norm() / (ref[n] - start).norm())
        if n in SHARD_LOCAL_EXACT[rule_name]:
            assert_bits(miss, 0.0, (n, miss))
        else:
            assert miss > 0.1, (n, miss)


@pytest.mark.parametrize("rule_name", list(RULES))
def test_cmax_error_names_the_matrix(rule_name: str) -> None:
    res, err = _results(rule_name)
    if err is not None:
        pytest.fail(err)
    for r in range(TP):
        assert "ok" in res[r]["cmax_error"], res[r]["cmax_error"]
        msg = res[r]["cmax_error"]["ok"]
        assert "'fc1'" in msg and "c_max=100" in msg, msg


def test_bad_config_values_name_the_value() -> None:
    with pytest.raises(ValueError, match="canzona_tp.scheduler='bogus'"):
        TPConfig(scheduler="bogus")
    with pytest.raises(ValueError, match="canzona_tp.c_max=-1"):
        TPConfig(c_max=-1)
    with pytest.raises(ValueError, match="canzona_tp.cost='bytes'"):
        TPConfig(cost="bytes")
    with pytest.raises(TypeError, match="canzona_tp.pipelined='yes'"):
        TPConfig(pipelined="yes")
    with pytest.raises(ValueError, match=r"Unknown canzona_tp key\(s\) \['c_maxx'\]"):
        TPConfig.from_section({"c_maxx": 3})
    with pytest.raises(ValueError, match="canzona_tp.strategy was removed"):
        TPConfig.from_section({"strategy": "sc"})
    with pytest.raises(ValueError, match="momentum=1.5"):
        MuonRule(momentum=1.5)
    with pytest.raises(ValueError, match="cut into 2 pieces but the group has 1 ranks"):
        MicroGroupRuntime([tp_matrix("fc1")], RULES["muon"], None, TPConfig())
    with pytest.raises(ValueError, match="shard_sizes"):
        TPMatrix("a", (8, 4), 0, (3, 3))
    with pytest.raises(ValueError, match="partition_dim=2"):
        TPMatrix("a", (8, 4), 2, (4, 4))

"""TP-ASC runtime on real gloo processes against single-process Muon.

Optimizer-level: identical full gradients each step, sharded Megatron-style (fused fc1
[gate_r; up_r], GQA QKV [q_r; k_r; v_r], column, row, replicated).  The TP result must be
  * bit-identical (rtol=atol=0) to Muon on the concatenated-shard matrix, and
  * equal within float summation order to Muon on the TP=1 fused layout ([gate; up],
    [q; k; v]) after mapping by the permutation -- the equivariance argument.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from canzona_ds.optim.muon import muon_update
from canzona_ds.testing.megatron_standin import shard_tensor, unshard_tensor
from canzona_ds.tp import TPMatrix, TPMuonConfig, TPMuonRuntime

LR, WD, STEPS = 0.05, 0.1, 3
#: STEPS x adjusted lr (<= 0.1 here) x ~1 bf16 ulp (2**-8) of an O(0.5) update element
BF16_TOL = 2e-3

# name: (TP=1 full shape, partition dim, fused blocks along it)
MATRICES = {
    "qkv": ((4 * 8 + 2 * 2 * 8, 24), 0, [32, 16, 16]),    # heads 4, kv 2, head_dim 8
    "proj": ((24, 32), 1, [32]),
    "fc1": ((2 * 40, 24), 0, [40, 40]),                   # [gate; up]
    "fc2": ((24, 40), 1, [40]),
    "col_tall": ((64, 12), 0, [64]),
    "mix": ((24, 24), None, []),                           # replicated
}


def full_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(*shape, generator=g) for n, (shape, _, _) in MATRICES.items()}


def full_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(*shape, generator=g) * 0.1 for n, (shape, _, _) in MATRICES.items()}


class CollectiveCounter:
    """Counts every torch.distributed collective called while active."""

    OPS = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
           "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
           "send", "recv", "isend", "irecv", "barrier", "all_gather_object", "broadcast_object_list")

    def __enter__(self):
        self.counts: dict[str, int] = {}
        self._saved = {}
        for op in self.OPS:
            fn = getattr(dist, op)
            self._saved[op] = fn

            def wrapped(*a, _fn=fn, _op=op, **k):
                self.counts[_op] = self.counts.get(_op, 0) + 1
                return _fn(*a, **k)

            setattr(dist, op, wrapped)
        return self

    def __exit__(self, *exc):
        for op, fn in self._saved.items():
            setattr(dist, op, fn)


def _run_config(rank: int, tp: int, cfg: TPMuonConfig, names=None):
    names = names or list(MATRICES)
    mats = []
    for n in names:
        shape, dim, _ = MATRICES[n]
        sizes = (shape[dim] // tp,) * tp if dim is not None else ()
        mats.append(TPMatrix(n, shape, dim, sizes))
    rt = TPMuonRuntime(mats, None, cfg)
    fp = full_params()
    params = [shard_tensor(fp[n], MATRICES[n][1], MATRICES[n][2], tp, rank) for n in names]
    counts, stats = [], []
    for s in range(STEPS):
        fg = full_grads(s)
        grads = [shard_tensor(fg[n], MATRICES[n][1], MATRICES[n][2], tp, rank) for n in names]
        with CollectiveCounter() as cc:
            st = rt.step(params, grads)
        counts.append(cc.counts)
        stats.append((dict(st.collectives), st.bytes_sent, st.flops))
    return {"params": {n: p.numpy() for n, p in zip(names, params)}, "counts": counts, "expected": rt.expected_collectives(),
            "stats": stats, "groups": len(rt.plan.groups) if rt.plan else 0,
            "hosted": [rt.matrices[i].name for i in rt.hosted()]}


def _worker_optimizer(rank, world):
    out = {}
    base = dict(lr=LR, weight_decay=WD)
    out["asc_pipe"] = _run_config(rank, world, TPMuonConfig(**base, pipelined=True, c_max=3000))
    out["asc_block"] = _run_config(rank, world, TPMuonConfig(**base, pipelined=False, c_max=3000))
    out["asc_onegroup"] = _run_config(rank, world, TPMuonConfig(**base, c_max=1e9))
    out["round_robin"] = _run_config(rank, world, TPMuonConfig(**base, scheduler="round_robin"))
    out["no_fusion"] = _run_config(rank, world, TPMuonConfig(**base, scheduler="no_fusion"))
    out["sc"] = _run_config(rank, world, TPMuonConfig(**base, strategy="sc"))
    out["local"] = _run_config(rank, world, TPMuonConfig(**base, strategy="local"))
    # one big matrix, one tiny: with TP=2 rank 1 hosts only the tiny one; with a single
    # split matrix rank 1 hosts nothing at all (empty receive in both all-to-alls)
    out["hosts_nothing"] = _run_config(rank, world, TPMuonConfig(**base, c_max=1e9), names=["fc1", "mix"])
    try:
        TPMuonRuntime([TPMatrix("fc1", (80, 24), 0, (40, 40)), TPMatrix("fc2", (24, 40), 1, (20, 20))],
                      None, TPMuonConfig(c_max=100))
        out["cmax_error"] = None
    except ValueError as e:
        out["cmax_error"] = str(e)
    return out


def _reference(layout: str, names=None) -> dict[str, torch.Tensor]:
    """Single-process Muon; layout 'tp' = concatenated shards, 'fused' = TP=1 normal layout."""
    names = names or list(MATRICES)
    torch.set_num_threads(1)

    def to_layout(t, n):
        shape, dim, blocks = MATRICES[n]
        if layout == "fused" or dim is None:
            return t.clone()
        return torch.cat([shard_tensor(t, dim, blocks, 2, r) for r in range(2)], dim=dim)

    fp = full_params()
    params = {n: to_layout(fp[n], n) for n in names}
    bufs = {n: torch.zeros_like(p) for n, p in params.items()}
    for s in range(STEPS):
        fg = full_grads(s)
        for n in names:
            muon_update(params[n], to_layout(fg[n], n), bufs[n], lr=LR, weight_decay=WD, momentum=0.95)
    return params


@pytest.fixture(scope="module")
def tp2_results():
    # tensors travel back as numpy arrays (torch's shared-memory pickling dies with the worker)
    res = run_distributed(_worker_optimizer, 2)
    for per_rank in res:
        for v in per_rank.values():
            if isinstance(v, dict) and "params" in v:
                v["params"] = {n: torch.from_numpy(a) for n, a in v["params"].items()}
    return res


@pytest.mark.parametrize("mode", ["asc_pipe", "asc_block", "asc_onegroup", "no_fusion", "round_robin", "sc"])
def test_tp2_bit_identical_to_full_matrix_muon(tp2_results, mode):
    ref = _reference("tp")
    for n, (shape, dim, blocks) in MATRICES.items():
        shards = [tp2_results[r][mode]["params"][n] for r in range(2)]
        got = shards[0] if dim is None else torch.cat(shards, dim=dim)
        torch.testing.assert_close(got, ref[n], rtol=0, atol=0, msg=f"{mode} {n}")


@pytest.mark.parametrize("mode", ["asc_pipe", "sc"])
def test_tp2_equals_tp1_fused_layout_up_to_permutation(tp2_results, mode):
    ref = _reference("fused")
    for n, (shape, dim, blocks) in MATRICES.items():
        shards = [tp2_results[r][mode]["params"][n] for r in range(2)]
        got = unshard_tensor(shards, dim, blocks)
        # NS is permutation-equivariant (exactly, see the fp64 test); a permutation of the
        # GEMM's inner dimension (fc1 is tall, so its row permutation becomes one) changes
        # the summation order, i.e. bf16 rounding: ~1 bf16 ulp of the update per step.
        torch.testing.assert_close(got, ref[n], rtol=0, atol=BF16_TOL, msg=f"{mode} {n}")


def test_blocking_and_pipelined_bit_identical(tp2_results):
    for r in range(2):
        a, b = tp2_results[r]["asc_pipe"]["params"], tp2_results[r]["asc_block"]["params"]
        for n in a:
            assert torch.equal(a[n], b[n]), n


def test_collectives_per_step_match_plan(tp2_results):
    for r in range(2):
        for mode in ("asc_pipe", "asc_block", "asc_onegroup", "no_fusion", "hosts_nothing"):
            res = tp2_results[r][mode]
            assert res["expected"] == {"all_to_all_single": 2 * res["groups"]}
            for counts in res["counts"]:
                assert counts == res["expected"], (mode, counts)
        assert tp2_results[r]["asc_pipe"]["groups"] >= 2  # c_max=3000 forces several groups
        assert tp2_results[r]["asc_onegroup"]["groups"] == 1
        assert tp2_results[r]["no_fusion"]["groups"] == 5  # one per split matrix
        for counts in tp2_results[r]["sc"]["counts"]:
            assert counts == {"all_gather_into_tensor": 5}
        for counts in tp2_results[r]["local"]["counts"]:
            assert counts == {}


def test_asc_moves_fewer_bytes_and_flops_than_sc(tp2_results):
    for r in range(2):
        asc = tp2_results[r]["asc_onegroup"]["stats"][0]
        sc = tp2_results[r]["sc"]["stats"][0]
        assert asc[2] < sc[2]  # FLOPs: hosted share vs every matrix on every rank
    total_asc = sum(tp2_results[r]["asc_onegroup"]["stats"][0][2] for r in range(2))
    total_sc_one = tp2_results[0]["sc"]["stats"][0][2]
    from canzona_ds.planning.cost import muon_flops

    mix = muon_flops(MATRICES["mix"][0])  # replicated: computed on every rank by design
    assert total_asc - 2 * mix == pytest.approx(total_sc_one - mix)  # split matrices: once each


def test_shard_local_muon_is_not_the_tp1_update(tp2_results):
    ref = _reference("fused")
    dev = 0.0
    for n, (shape, dim, blocks) in MATRICES.items():
        if dim is None:
            continue
        got = unshard_tensor([tp2_results[r]["local"]["params"][n] for r in range(2)], dim, blocks)
        dev = max(dev, (got - ref[n]).abs().max().item())
    assert dev > 10 * BF16_TOL  # the inexact baseline is far outside rounding noise


@pytest.mark.parametrize("name", ["fc1", "qkv"])
def test_newton_schulz_equivariant_to_fused_tp_layout_fp64(name):
    """In fp64 the TP layout's update is the permuted TP=1 update to 1e-12: the proof."""
    from canzona_ds.optim.muon import newton_schulz

    shape, dim, blocks = MATRICES[name]
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for tp in (2, 4):
        G_tp = torch.cat([shard_tensor(G, dim, blocks, tp, r) for r in range(tp)], dim=dim)
        O_tp = newton_schulz(G_tp, dtype=torch.float64)
        O = newton_schulz(G, dtype=torch.float64)
        shard_size = shape[dim] // tp
        back = unshard_tensor(list(O_tp.split(shard_size, dim=dim)), dim, blocks)
        torch.testing.assert_close(back, O, rtol=0, atol=1e-12)
        assert not torch.equal(G_tp, G)  # the layouts really differ


def test_rank_hosting_nothing(tp2_results):
    hosted = [tp2_results[r]["hosts_nothing"]["hosted"] for r in range(2)]
    assert sorted(hosted[0] + hosted[1]) == ["fc1"] and [] in hosted
    ref = _reference("tp", names=["fc1", "mix"])
    got = torch.cat([tp2_results[r]["hosts_nothing"]["params"]["fc1"] for r in range(2)], dim=0)
    torch.testing.assert_close(got, ref["fc1"], rtol=0, atol=0)
    for r in range(2):
        torch.testing.assert_close(tp2_results[r]["hosts_nothing"]["params"]["mix"], ref["mix"], rtol=0, atol=0)


def test_cmax_error_names_parameter(tp2_results):
    msg = tp2_results[0]["cmax_error"]
    assert msg is not None and "fc1" in msg and "c_max=100" in msg


def test_bad_config_values_name_the_value():
    with pytest.raises(ValueError, match="strategy='nope'"):
        TPMuonConfig(strategy="nope")
    with pytest.raises(ValueError, match="c_max=-1"):
        TPMuonConfig(c_max=-1)
    with pytest.raises(ValueError, match="momentum=1.5"):
        TPMuonConfig(momentum=1.5)
    with pytest.raises(ValueError, match="scheduler='bogus'"):
        TPMuonConfig(scheduler="bogus")
    with pytest.raises(ValueError, match="2 shards but the TP group has 1"):
        TPMuonRuntime([TPMatrix("a", (4, 4), 0, (2, 2))], None, TPMuonConfig())
    with pytest.raises(ValueError, match="shard_sizes"):
        TPMatrix("a", (8, 4), 0, (3, 3))
    with pytest.raises(ValueError, match="unknown|Unknown"):
        TPMuonConfig.from_dict({"c_maxx": 3})

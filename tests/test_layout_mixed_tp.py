"""The mixed ZeRO-1/2 layout with tensor-parallel matrices (issue 18's DP x TP case).

Under DP x TP every TP rank's ZeRO buffer holds its TP-local shards, laid out by one DP plan.
The mixed layout hosts a TP-split matrix over the DP x TP grid (``tp/runtime.GridSplit``: each
TP shard cut into the plan's DP pieces; one all-to-all gathers and one scatters per micro-group),
a replicated one over each TP rank's DP group (``FlatSplit``), and the owned TP-split matrices
keep the TP runtime: three runtimes, stepped in that order on every rank.

* pure: GridSplit's pieces and assembly equal TPMatrix's layout; the TP host choice, seeded with
  the owned TP runtime's load on each (dp, tp) cell (planning/mixed.tp_cells: a constructed plan
  where ignoring it gives a worse cell, and Qwen3-8B at TP=8); a layout record whose grid hosts
  sit at other TP ranks is another layout (its fingerprint, integration/ckpt/emit.record_fingerprint); the plan refuses a
  mixed layout of TP-split matrices only where no grid group exists;
* real processes (gloo, the Megatron stand-in of tests/test_zero_tp.py, DP2 x TP2 = 4 ranks,
  ``layout: "mixed"``): Muon, Shampoo and SOAP at ZeRO-1 (Muon and SOAP at ZeRO-2 too) are
  bit-identical (rtol=atol=0) to the owned layout's run of the same world and to the
  single-process ReferenceOptimizer on the run's own gradients (the reference test_zero_tp.py
  uses); a TP-split matrix is grid-hosted (every rule) and a replicated one DP-hosted (Muon's
  plan: then all three runtimes run in one step); the optimizer step's
  collectives, counted by canzona_testkit/comm.CommCounter per group, are the plans' all-to-alls;
  the grid hosts' TP ranks are the planner's;
* PP=2 x TP=2 x DP=2 (a PipelineModule, a grid group per stage): mixed equals owned bit for bit.

Resuming a mixed DP2 x TP2 checkpoint (at the same layout, owned <-> mixed, with other grid
hosts, at TP 1) is rows and tests of the scenario table (tests/test_ckpt_resume.py, family
``tp``).

One cached 4-rank run (and one 8-rank pipeline run); each scenario in its own ``try`` (one
failure, one test).

Cost: 1 rank run; 7 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import functools
import traceback
from typing import Any

import numpy as np
import pytest
import torch

import test_zero_tp as zt
from canzona_testkit import megatron_standin as ms
from canzona_testkit.dist import run_distributed

TP, DP, WORLD = zt.TP, zt.DP, zt.WORLD
STEPS = zt.STEPS
SPLIT = zt.SPLIT
#: (optimizer, ZeRO stage, layout)
RUNS = [(t, 1, lay) for t in zt.TYPES for lay in ("owned", "mixed")] + \
    [("CanzonaMuon", 2, "mixed"), ("CanzonaSOAP", 2, "mixed")]


# ------------------------------------------------------------------------------ pure
def test_grid_split_is_tpmatrix_layout_cut_into_dp_pieces():
    from canzona_ds.tp.runtime import GridSplit, TPMatrix

    cells = ((0, 0), (1, 0), (0, 1), (1, 1))  # Megatron numbering: grid rank g = d * TP + t
    for dim, shape in ((0, (6, 5)), (1, (4, 6))):
        whole = torch.arange(30.0 if dim == 0 else 24.0).view(shape)
        tpm = TPMatrix("w", shape, dim, (shape[dim] // 2,) * 2)
        n = tpm.local_numel(0)
        g = GridSplit("w", shape, dim, tpm.shard_sizes, (0, 4), (4, n - 4), cells)
        pieces = [g.piece(whole, r) for r in range(4)]
        assert [p.numel() for p in pieces] == [4, 4, n - 4, n - 4]
        for r, (t, d) in enumerate(cells):
            assert torch.equal(pieces[r], tpm.piece(whole, t)[(0, 4)[d]:(0, 4)[d] + (4, n - 4)[d]])
        assert torch.equal(g.assemble(pieces), whole)
        assert torch.equal(g.assemble(pieces), tpm.assemble([tpm.piece(whole, t) for t in range(2)]))
        assert g.rank_of(1, 1) == 3 and g.local_shape(1) == (4,) and g.num_experts is None
    with pytest.raises(ValueError, match="cells"):
        GridSplit("w", (6, 5), 0, (3, 3), (0, 4), (4, 11), ((0, 0), (0, 0), (0, 1), (1, 1)))
    with pytest.raises(ValueError, match="cover"):
        GridSplit("w", (6, 5), 0, (3, 3), (0, 4), (4, 10), cells)


def test_grid_tp_hosts_balance_each_dp_host():
    from canzona_ds.planning.mixed import grid_tp_hosts

    # DP host 0 gets costs 5, 4, 3, 1 over TP=2: 5 -> t0, 4 -> t1, 3 -> t1, 1 -> t0; DP host 1 alone
    assert grid_tp_hosts([0, 0, 0, 1, 0], [3.0, 5.0, 4.0, 2.0, 1.0], 2) == [1, 0, 1, 0, 0]
    assert grid_tp_hosts([], [], 4) == []
    with pytest.raises(ValueError, match="tp_size"):
        grid_tp_hosts([0], [1.0], 0)


def test_grid_tp_hosts_start_from_the_seed():
    from canzona_ds.planning.mixed import grid_tp_hosts

    # cell (0, 0) already carries 6: the heaviest grid matrix (5) goes to TP rank 1, then 4 too
    # (5 < 6), then 3 to TP rank 0 (6 < 9); DP host 1 is unseeded
    assert grid_tp_hosts([0, 0, 0, 1], [3.0, 5.0, 4.0, 2.0], 2, seed={(0, 0): 6.0}) == [0, 1, 1, 0]
    assert grid_tp_hosts([0, 0, 0, 1], [3.0, 5.0, 4.0, 2.0], 2) == [1, 0, 1, 0]
    for bad in ({(0, 2): 1.0}, {(0, 0): -1.0}, {0: 1.0}, {(0, 0): float("nan")}):
        with pytest.raises(ValueError, match="seed entry"):
            grid_tp_hosts([0], [1.0], 2, seed=bad)


def _constructed_plan():
    """DP=2 x TP=2: DP rank 0 owns the TP-split A (full 512 x 256) and hosts the TP-split B and C
    (full 256 x 256 each) over the grid; DP rank 1 owns the replicated D."""
    from canzona_ds.planning.dp import MIXED, OwnershipPlan
    from canzona_ds.planning.params import ParamSpec

    specs = (ParamSpec("a", (256, 256), tp_partition_dim=0, tp_size=2),
             ParamSpec("b", (128, 256), tp_partition_dim=0, tp_size=2),
             ParamSpec("c", (256, 128), tp_partition_dim=1, tp_size=2), ParamSpec("d", (256, 128)))
    return OwnershipPlan(planner=MIXED, world_size=2, specs=specs, owner=(0, -1, -1, 1), rank_params=((0,), (3,)),
                         rank_load=(0.0, 0.0), rank_numel=(0, 0), order=(0, 1, 2, 3), host=(0, 0, 0, 1))


def test_tp_cells_balance_grid_hosts_against_the_owned_tp_runtime():
    """Ignoring the owned TP runtime's load (A on TP rank 0) puts B on that rank too: its cell
    carries A + B.  Seeded with it, B and C both go to TP rank 1, and the worst cell is lower."""
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.mixed import full_matrix_flops, tp_cells

    rule = cost_model("muon")
    plan = _constructed_plan()
    a, b, c, d = (full_matrix_flops(s, rule) for s in plan.specs)
    assert a > b == c > 0 and a < b + c  # A alone is heavier than B, lighter than B and C together
    before, after = tp_cells(plan, 2, rule, seed_owned=False), tp_cells(plan, 2, rule)
    for got in (before, after):
        assert got["owned_tp"] == {0: 0}  # the owned TP runtime's LPT: A (alone) on TP rank 0
    assert before["grid_tp"] == {1: 0, 2: 1} and after["grid_tp"] == {1: 1, 2: 1}
    assert before["cell_flops"] == [[a + b, c], [d, d]] and after["cell_flops"] == [[a, b + c], [d, d]]
    mean = (a + b + c + 2 * d) / 4
    assert max(map(max, after["cell_flops"])) / mean < max(map(max, before["cell_flops"])) / mean


def test_tp_cells_on_qwen3_at_tp8_lower_the_worst_cell():
    """Real shapes (Qwen3-8B, TP=8, the mixed plan): seeding lowers the worst (dp, tp) cell's FLOPs."""
    from canzona_ds.optim import cost_model
    from canzona_ds.planning.cost import cost_vector
    from canzona_ds.planning.dp import plan_mixed_dp
    from canzona_ds.planning.mixed import tp_cells
    from canzona_ds.planning.models import matrix_specs, model_specs

    rule = cost_model("muon")
    specs = matrix_specs(model_specs("qwen3-8b", 8))
    for dp in (8, 32):
        plan = plan_mixed_dp(specs, dp, cost_vector(specs, "flops", rule), "flops", rule)
        before, after = (max(map(max, tp_cells(plan, 8, rule, seed_owned=s)["cell_flops"])) for s in (False, True))
        assert after < 0.9 * before, (dp, before, after)


def test_layout_fingerprint_covers_the_grid_hosts_tp_ranks():
    from canzona_ds.integration.ckpt.emit import record_fingerprint as fp

    rec = {"fingerprint": "f", "hosted": {"w": {"host": 0, "tp_host": 1}, "m": {"host": 1}}}
    assert fp(rec) == fp(dict(rec))
    moved = {"fingerprint": "f", "hosted": {"w": {"host": 0, "tp_host": 0}, "m": {"host": 1}}}
    assert fp(rec) != fp(moved) and fp({**rec, "fingerprint": "g"}) != fp(rec)
    assert fp({"fingerprint": "f"}) == fp({"fingerprint": "f", "hosted": {}})  # an owned layout's record


def test_plan_hosts_tp_matrices_only_with_a_grid_group():
    import warnings

    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import _plan
    from canzona_ds.planning.dp import DEFAULT_MAX_PADDING
    from canzona_ds.planning.params import ParamSpec

    big = [ParamSpec(f"w{i}", (512 * (2 + i), 1024), tp_partition_dim=0, tp_size=2) for i in range(4)]
    mixed = CanzonaConfig.from_ds("CanzonaMuon", {"layout": "mixed"})
    with pytest.raises(ValueError, match="grid"):
        _plan(big, 4, mixed, mixed.rule)
    plan = _plan(big, 4, mixed, mixed.rule, grid=True)
    assert plan.mixed and any(plan.specs[i].is_tp_split for i in plan.hosted)
    auto = CanzonaConfig.from_ds("CanzonaMuon", {})
    with pytest.warns(UserWarning, match="cannot host"):  # no grid: owned kept, and said so
        assert not _plan(big, 8, auto, auto.rule).mixed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = _plan(big, 8, auto, auto.rule, grid=True)  # "auto" may now pick mixed under TP
    assert chosen.mixed and chosen.padding_fraction <= DEFAULT_MAX_PADDING


def test_parallel_groups_validate_the_grid_cells():
    from canzona_ds.parallel import ParallelGroups

    ok = ParallelGroups(dp_size=2, tp_size=2, grid_cells=((0, 0), (1, 0), (0, 1), (1, 1)), source="test")
    assert len(ok.grid_cells) == 4
    with pytest.raises(ValueError, match="grid_cells"):
        ParallelGroups(dp_size=2, tp_size=2, grid_cells=((0, 0), (1, 0), (0, 1)), source="test")


# ------------------------------------------------------------------------------ real processes
def _config(optimizer: str, stage: int, layout: str) -> dict:
    cfg = zt.ds_config(optimizer, stage)
    cfg["optimizer"]["params"]["layout"] = layout
    return cfg


class _StepComm:
    """Per engine step, the inner optimizer step's collectives as CommCounter counts them:
    (op, the group's global ranks) -> calls (ZeRO steps the inner optimizer once per group)."""

    def __init__(self, inner) -> None:
        from canzona_testkit.comm import CommCounter

        self.pending: dict = {}
        stock = inner.step

        def step(*a, **k):
            with CommCounter() as c:
                out = stock(*a, **k)
            for layer in ("torch", "deepspeed"):
                for key, n in c.by_group_ranks(layer).items():
                    self.pending[(layer,) + key] = self.pending.get((layer,) + key, 0) + n
            return out

        inner.step = step

    def take(self) -> dict:
        out, self.pending = self.pending, {}
        return out


def _train(engine, steps, tap=None, comm=None) -> tuple[list, list]:
    grads, calls = [], []
    for s in steps:
        ids = zt.batch(s, ms.get_data_parallel_rank())
        if tap is not None:
            grads.append(tap(engine.module, ids))
        engine.backward(zt.loss_of(engine, ids))
        engine.step()
        if comm is not None:
            calls.append(comm.take())
    return grads, calls


def _pieces(engine) -> dict:
    inner = engine.optimizer.optimizer
    return {n: {k: v.detach().clone().numpy() for k, v in st.items()} for n, st in inner.piece_state.items()}


def _expected(inner) -> dict:
    """The plans' collectives per group: every hosted runtime's all-to-alls on its group's ranks."""
    import torch.distributed as dist

    hosted = inner.placement.hosted
    out: dict = {}
    for part in getattr(hosted, "parts", (hosted,)) if hosted is not None else ():
        ranks = tuple(dist.get_process_group_ranks(part.runtime.group))
        for op, n in part.runtime.expected_collectives().items():
            out[("torch", op, ranks)] = out.get(("torch", op, ranks), 0) + n
    return out


def _one(optimizer: str, stage: int, layout: str) -> dict[str, Any]:
    from canzona_ds.tp.runtime import GridSplit

    a = zt.build_engine(_config(optimizer, stage, layout))
    inner = a.optimizer.optimizer
    comm, tap = _StepComm(inner), zt.GradTap()
    grads, calls = _train(a, range(STEPS), tap, comm)
    hosted = inner.placement.hosted
    out = {"sd": zt.numpy_sd(a.module), "grads": grads, "calls": calls,
           "expected": _expected(inner), "mixed": a.optimizer.canzona_layout.mixed,
           "kinds": {n: type(m).__name__ for n, m in (hosted.split.items() if hosted is not None else ())},
           "hosted_here": sorted(hosted.hosted_names()) if hosted is not None else [],
           "state": zt.matrix_state(a), "pieces": _pieces(a), "dp_pieces": inner.expected_collectives(),
           "stats": dict(inner.step_stats.collectives) if inner.step_stats is not None else {},
           "tp_host": {n: h.get("tp_host") for n, h in a.optimizer.canzona_layout_meta()["hosted"].items()}}
    out["grid_names"] = sorted(n for n, k in out["kinds"].items() if k == GridSplit.__name__)
    out["planned_tp_host"] = _planned_tp_hosts(inner) if out["mixed"] else {}
    return out


def _planned_tp_hosts(inner) -> dict[str, int]:
    """The grid hosts' TP ranks the planner gives for this optimizer's plan (planning/mixed.tp_cells,
    seeded with the owned TP runtime's load), by name."""
    from canzona_ds.planning.mixed import tp_cells

    plan, tpc = inner.plan, inner.config.tp
    got = tp_cells(plan, inner.tp_size, inner.rule, scheduler=tpc.scheduler, c_max=tpc.c_max, cost=tpc.cost)
    return {plan.specs[i].name: t for i, t in got["grid_tp"].items()}


def _grid_per_stage() -> dict[str, Any]:
    """integration/groups.with_grid_group on 4 ranks arranged as PP=2 x TP=2 (DP=1): one grid
    group per pipeline stage, its cells in global-rank order."""
    import torch.distributed as dist

    from canzona_ds.integration.groups import with_grid_group
    from canzona_ds.parallel import ParallelGroups

    rank = dist.get_rank()
    tp_groups = [dist.new_group([2 * s, 2 * s + 1]) for s in range(2)]
    pp_groups = [dist.new_group([t, t + 2]) for t in range(2)]
    groups = ParallelGroups(tp_size=2, tp_rank=rank % 2, tp_group=tp_groups[rank // 2], pp_size=2,
                            pp_rank=rank // 2, pp_group=pp_groups[rank % 2], source="test")
    got = with_grid_group(groups)
    return {"ranks": tuple(dist.get_process_group_ranks(got.grid_group)), "cells": got.grid_cells,
            "rank": dist.get_rank(got.grid_group)}


def _isolated(fn) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except Exception:  # noqa: BLE001 - reported to the test that reads it
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int) -> dict:
    ms.initialize_model_parallel(TP)
    out = {run: _isolated(lambda run=run: _one(*run)) for run in RUNS}
    out["grid_pp"] = _isolated(_grid_per_stage)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=420)


def _res(runs, key) -> list[Any]:
    return zt._ok(runs, key)


def _id(run) -> str:
    return f"{run[0]}-stage{run[1]}-{run[2]}"


MIXED_RUNS = [r for r in RUNS if r[2] == "mixed"]


@pytest.mark.parametrize("run", MIXED_RUNS, ids=[_id(r) for r in MIXED_RUNS])
def test_mixed_tp_hosts_tp_matrices_over_the_grid(run, runs):
    """A TP-split matrix is grid-hosted (one grid host, its full rule state there, Muon's momentum
    in pieces on every rank); the replicated matrix is DP-hosted under Muon (Shampoo's and
    SOAP's plans keep it owned at these shapes and settings)."""
    res = _res(runs, run)
    r0 = res[0]
    assert r0["mixed"] and r0["grid_names"], r0["kinds"]
    assert all(n in SPLIT for n in r0["grid_names"])
    def hosted(r: dict) -> dict:  # (owned TP-split matrices run over the TP group of their DP index only)
        return {n: k for n, k in r["kinds"].items() if k != "TPMatrix"}

    for r in res:
        assert hosted(r) == hosted(r0)  # every rank runs the DP-hosted and grid runtimes
    if run[0] == "CanzonaMuon":
        assert r0["kinds"].get("mix.weight") == "FlatSplit", r0["kinds"]
    for n in r0["grid_names"]:
        hosts = [rank for rank, r in enumerate(res) if n in r["hosted_here"]]
        assert len(hosts) == 1, (n, hosts)  # one host in the grid, its state the only full copy
        assert [rank for rank, r in enumerate(res) if n in r["state"]] == hosts
        assert r0["tp_host"][n] == hosts[0] % TP  # the checkpoint records the host's TP rank (Megatron numbering)
        if run[0] == "CanzonaMuon":  # momentum with the pieces: every rank its piece of its TP shard
            assert all(set(r["pieces"][n]) == {"momentum_buffer"} for r in res)
            assert sum(r["pieces"][n]["momentum_buffer"].size for r in res) == \
                sum(r["sd"][n].size for r in res) // DP  # the whole matrix once
    assert {n: t for n, t in r0["tp_host"].items() if t is not None} == r0["planned_tp_host"]  # the planner's choice


@pytest.mark.parametrize("run", MIXED_RUNS, ids=[_id(r) for r in MIXED_RUNS])
def test_mixed_tp_is_the_reference_on_the_same_gradients(run, runs):
    res = _res(runs, run)
    zt.check_exact(res, zt.reference_on_run_gradients(run[0], res), _id(run))


@pytest.mark.parametrize("optimizer", zt.TYPES)
def test_mixed_tp_equals_the_owned_layout_bit_for_bit(optimizer, runs):
    owned, mixed = _res(runs, (optimizer, 1, "owned")), _res(runs, (optimizer, 1, "mixed"))
    assert not owned[0]["mixed"] and mixed[0]["mixed"]
    for rank, (o, m) in enumerate(zip(owned, mixed)):
        for n in o["sd"]:
            np.testing.assert_array_equal(m["sd"][n], o["sd"][n], err_msg=f"rank {rank} {n}")


@pytest.mark.parametrize("run", MIXED_RUNS, ids=[_id(r) for r in MIXED_RUNS])
def test_mixed_tp_step_collectives_are_the_plans(run, runs):
    """Every step: exactly the plans' all-to-alls, each on its runtime's group (the TP group for
    owned TP-split matrices, the DP group for DP-hosted ones, all four ranks for the grid), and
    nothing else; the runtime's own counts agree."""
    res = _res(runs, run)
    grid = tuple(range(WORLD))
    assert any(key[2] == grid and n >= 2 for key, n in res[0]["expected"].items()), res[0]["expected"]
    if run[0] == "CanzonaMuon":  # the owner of qkv runs all three: TP group, DP group, grid
        assert max(len(r["expected"]) for r in res) == 3, [r["expected"] for r in res]
    for r in res:
        assert len(r["calls"]) == STEPS
        for step in r["calls"]:
            assert step == r["expected"], (step, r["expected"])
        total = sum(r["expected"].values())
        assert r["dp_pieces"] == {"all_to_all_single": total} and r["stats"] == {"all_to_all_single": total}


def test_grid_group_per_pipeline_stage(runs):
    for rank, r in enumerate(_res(runs, "grid_pp")):
        stage = rank // 2
        assert r["ranks"] == (2 * stage, 2 * stage + 1) and r["cells"] == ((0, 0), (1, 0)), r
        assert r["rank"] == rank % 2


# ------------------------------------------------------------------------------ PP x TP x DP
class GLUBlock(torch.nn.Module):
    """A Megatron-style gated MLP (ColumnParallel fc1 and up, RowParallel fc2) over the stand-in's
    TP group: full weights from a seed, this rank's shards kept.  At DP=2 the mixed plan of its
    three TP-local shapes hosts one (up)."""

    FFN = 48

    def __init__(self, seed: int) -> None:
        from canzona_testkit.models import D

        super().__init__()
        self.fc1 = ms.ColumnParallelLinear(D, self.FFN)
        self.up = ms.ColumnParallelLinear(D, self.FFN)
        self.fc2 = ms.RowParallelLinear(self.FFN, D)
        g = torch.Generator().manual_seed(seed)
        r, tp = ms.get_tensor_model_parallel_rank(), ms.get_tensor_model_parallel_world_size()
        with torch.no_grad():
            for w, dim in ((self.fc1.weight, 0), (self.up.weight, 0), (self.fc2.weight, 1)):
                full = list(w.shape)
                full[dim] *= tp
                w.copy_((torch.randn(*full, generator=g) * 0.3).chunk(tp, dim)[r])

    def forward(self, h):
        import torch.nn.functional as F

        return h + self.fc2(F.gelu(self.fc1(h)) * self.up(h))


PP_STEPS, PP_GAS, PP_MICRO = 2, 2, 2


def _pp_worker(rank: int, world: int) -> dict:
    """PP=2 x TP=2 x DP=2 (Megatron-DeepSpeed's 3D grid, a PipelineModule): the owned and the
    mixed layout trained alike in the same processes."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    from canzona_testkit.models import HP
    from canzona_testkit.pipeline import Embedding, Head, dataset, loss_fn, rank_micro_batches

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    grid = PipelineParallelGrid(topology=topo)
    ms._TP_GROUP, ms._TP_SIZE, ms._DP_GROUP = grid.get_slice_parallel_group(), 2, grid.get_data_parallel_group()
    out = {}
    for layout in ("owned", "mixed"):
        def run() -> dict:
            layers = [LayerSpec(Embedding, 0), LayerSpec(GLUBlock, 1), LayerSpec(GLUBlock, 2), LayerSpec(Head, 3)]
            module = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
            cfg = {"train_micro_batch_size_per_gpu": PP_MICRO, "gradient_accumulation_steps": PP_GAS,
                   "train_batch_size": PP_MICRO * PP_GAS * 2, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
                   "optimizer": {"type": "CanzonaMuon", "params": dict(HP["CanzonaMuon"], layout=layout)},
                   "zero_optimization": {"stage": 1}}
            engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
            opt = engine.optimizer.optimizer
            x, y = dataset(PP_STEPS * PP_GAS * PP_MICRO * 2, 1)
            data = iter(rank_micro_batches(x, y, 2, opt.groups.dp_rank, PP_MICRO))
            for _ in range(PP_STEPS):
                engine.train_batch(data)
            hosted = opt.placement.hosted
            return {"sd": {n: p.detach().clone().numpy() for n, p in module.named_parameters()},
                    "kinds": {n: type(m).__name__ for n, m in (hosted.split.items() if hosted is not None else ())},
                    "coords": opt.groups.coordinates, "mixed": engine.optimizer.canzona_layout.mixed}
        out[layout] = _isolated(run)
    return out


@functools.lru_cache(maxsize=None)
def _pp_runs() -> list[dict]:
    return run_distributed(_pp_worker, 8, timeout=420)


def test_mixed_tp_under_pipeline_parallelism_equals_owned():
    """PP=2 x TP=2 x DP=2 at ZeRO-1 (a grid group per stage): each stage grid-hosts a TP-split
    matrix, and the mixed layout's weights equal the owned layout's bit for bit on every rank."""
    res = _pp_runs()
    owned, mixed = zt._ok(res, "owned"), zt._ok(res, "mixed")
    for rank, (o, m) in enumerate(zip(owned, mixed)):
        assert m["mixed"] and "GridSplit" in m["kinds"].values(), (rank, m["kinds"])
        for n in o["sd"]:
            np.testing.assert_array_equal(m["sd"][n], o["sd"][n], err_msg=f"rank {rank} {n}")
    assert sorted({r["coords"]["pp"] for r in mixed}) == [0, 1]

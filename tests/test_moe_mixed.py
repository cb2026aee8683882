"""The mixed ZeRO-1/2 layout (``layout: "mixed"``) under DeepSpeed MoE: one plan per matrix
group (dense over DP; each expert group over its expert-data-parallel group), each group's
hosted matrices cut over THAT group's DP group and stepped in its own group's step.

The tiny MoE of ``canzona_testkit.moe`` keeps each expert's second Linear on AdamW here
(``matrix_exclude`` + ``".2.weight"``), so an expert group has one matrix per local expert and
an odd count of them does not divide over its expert-DP group: a matrix is hosted.

* world 2, ep_size 1, 3 experts: dense ``proj.weight`` hosted over the DP pair, expert 2's
  ``0.weight`` hosted over the expert-DP pair (experts 0 and 1 owned, one per rank); every
  rule at ZeRO 1 and 2, and Muon with clipping: bit for bit against the single-process
  reference (``canzona_testkit.moe.reference_run``, the same optimizer params); and at ep_size 2 (4
  experts; expert-DP groups of one rank, whose mixed layout hosts nothing) SOAP at ZeRO 2;
* world 4, ep_size 2, 2 experts: each rank's one local expert matrix is hosted over its
  expert-DP pair ({0, 2}, {1, 3}; two different groups stepping at once), ``proj.weight`` over
  the 4 DP ranks: every owner's/host's updates replayed bit for bit in one process from the
  gradients each matrix saw (pieces joined), the experts bit-exact against the reference after
  one step (two-term expert-DP sums);
* every matrix group's inner step issues exactly its plan's all-to-alls (2 per micro-group,
  none for a group that hosts nothing) and sends the plan's bytes (planning.mixed.step_bytes);
  Muon's momentum of a hosted matrix stays in pieces;
* MoE x TP (world 4 = DP 2 x TP 2, ep_size 2, Megatron stand-in mpu): the mixed layout's run
  (the TP-split dense ``down.weight`` hosted over the DP x TP grid) equals the owned layout's
  bit for bit, and the loss falls;
* checkpoints (world 4): a same-size round trip continues bit for bit, and the index loop
  (a resize's; resizes are rows of tests/test_ckpt_resume.py) restores the same state.

One ``run_distributed`` per world size; each scenario runs in its own ``try``.

Cost: 2 rank runs; 7 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from functools import lru_cache

import numpy as np
import pytest

from canzona_ds.planning.params import DEFAULT_EXCLUDE
from canzona_testkit.dist import run_distributed
from canzona_testkit.models import HP, TYPES
from canzona_testkit.kernels import assert_bits

STEPS = 3  # Shampoo/SOAP in HP refresh every 2 steps
CLIP = 0.05  # well below the gradient norm: every step clips
EXCLUDE = list(DEFAULT_EXCLUDE) + [".2.weight"]  # each expert: one matrix (0.weight), its 2.weight on AdamW
#: world -> (ep_size, num_experts)
SETUP = {2: (1, 3), 4: (2, 2)}

SCENARIOS = {
    2: {**{f"z{s}_{t}": (s, t, {}) for s in (1, 2) for t in TYPES},
        "z1_CanzonaMuon_clip": (1, "CanzonaMuon", {"clip": CLIP}),
        # ep_size 2, 4 experts: expert-DP groups of one rank, whose mixed layout hosts nothing
        "z2_CanzonaSOAP_ep2": (2, "CanzonaSOAP", {"setup": (2, 4)})},
    4: {"z1_CanzonaMuon": (1, "CanzonaMuon", {}), "z2_CanzonaShampoo": (2, "CanzonaShampoo", {}),
        "z1_CanzonaSOAP": (1, "CanzonaSOAP", {}), "checkpoint": (2, "CanzonaMuon", {"checkpoint": True}),
        # last: it installs the Megatron stand-in's TP groups in this process
        "tp2": (1, "CanzonaMuon", {"tp": True})},
}


def _params(opt_type: str) -> dict:
    return dict(HP[opt_type], layout="mixed", matrix_exclude=EXCLUDE)


class _Recorder:
    """Per optimizer step, every (gradient, weight before, weight after) each matrix step of this
    rank saw, by whole-model name: whole owned matrices and pieces of hosted ones."""

    def __init__(self, opt) -> None:
        self.steps: dict[int, dict] = {}
        stock_items, stock_step = opt.placement.items, opt._matrix_step
        pending: dict = {}
        glob = opt.global_name

        def items(group):
            out = stock_items(group)
            pending.clear()
            pending.update({glob(n): (g.detach().clone(), p.detach().clone(), p) for n, p, g in out})
            return out

        def step(group):
            stock_step(group)
            self.steps.setdefault(group["step"], {}).update(
                {n: (g, b, a.detach().clone()) for n, (g, b, a) in pending.items()})

        opt.placement.items, opt._matrix_step = items, step


def _replay(lr: float, weight_decay: float, rule, infos: dict, records: list[dict]) -> float:
    """Rerun the rule on whole matrices from what every rank recorded (pieces joined in rank
    order, which is each group's DP order here)."""
    import torch

    from canzona_ds.optim.rule import MatrixInfo, rule_step

    state, worst = {}, 0.0
    for t in sorted(records[0]):
        for name, (shape, heads, experts) in infos.items():
            held = [rec[t][name] for rec in records if name in rec[t] and rec[t][name][0].numel()]
            if not held:
                raise AssertionError(f"no rank recorded {name} at step {t}")
            g, before, after = (torch.cat([h[k].reshape(-1) for h in held]).view(shape) for k in range(3))
            W = before.clone()
            rule_step(rule, W, g.clone(), state, MatrixInfo(name, shape, heads, experts), t, lr, weight_decay)
            worst = max(worst, float((W - after).abs().max()))
    return worst


def _train(rank, world, stage, opt_type, options, ckpt=None):
    import torch
    import torch.distributed as tdist

    from canzona_ds.planning.mixed import hosted_pieces, step_bytes
    from canzona_testkit.comm import CommCounter
    from canzona_testkit.models import batches
    from canzona_testkit.moe import moe_ds_config, run_moe_engine

    ep, experts = options.get("setup", SETUP[world])
    calls, hooks, first = [], {}, {}

    def attach(engine):
        inner = engine.optimizer.optimizer
        hooks["rec"] = _Recorder(inner)
        stock = inner.step

        def counted(*a, **k):
            (group,) = [g for g in inner.param_groups if g["params"]]  # ZeRO steps one group at a time
            with CommCounter() as c:
                out = stock(*a, **k)
            hosted = inner.placement.hosted_for(group) if group["canzona_role"] == "matrix" else None
            calls.append((group["canzona_role"], group.get("canzona_partition"),
                          c.count("torch") + c.count("deepspeed"),
                          hosted.runtime.stats.bytes_sent if hosted is not None else 0))
            return out

        inner.step = counted

    def after_step(step, params):
        if step == 1:
            first.update(params)
        if ckpt is not None and step == 2:
            hooks["engine"].save_checkpoint(ckpt, tag="two")

    def keep(engine):
        hooks["engine"] = engine
        attach(engine)

    cfg = moe_ds_config(world, optimizer=opt_type, stage=stage, gradient_clipping=options.get("clip", 0.0),
                        params=_params(opt_type))
    data = batches(STEPS, 2 * world)
    params, _, engine = run_moe_engine(rank, world, ep, cfg, STEPS, after_init=keep, after_step=after_step,
                                       data=data, num_experts=experts)
    zopt, opt = engine.optimizer, engine.optimizer.optimizer
    groups = {}
    for i in zopt._canzona_groups:
        key = zopt._canzona_partition(i)
        layout, plan = zopt.canzona_layouts[i], opt.plans[key]
        edp = zopt.real_dp_process_group[i]
        host_at = [plan.host[plan.buffer_order()[k]] if o < 0 else -1 for k, o in enumerate(layout.owners())]
        per_host = [sum(1 for h in host_at if h == r) for r in range(layout.world_size)]
        planned = step_bytes(layout, host_at, direction_bytes=opt.rule.direction_dtype(torch.float32).itemsize)
        hosted_names = [opt.partition_matrices[key][k] for k in layout.hosted_indices()]
        flat = zopt.single_partition_of_fp32_groups[i]
        hosted = opt.placement.hosted_of.get(id(flat))
        pieces = {opt.global_name(opt.partition_matrices[key][k]): list(hosted_pieces(layout, k)[1])
                  for k in layout.hosted_indices()}
        groups[str(key)] = dict(
            mixed=layout.mixed, hosted=[opt.global_name(n) for n in hosted_names], pieces=pieces,
            dp=layout.world_size, dp_ranks=tdist.get_process_group_ranks(edp),
            expected=2 * max(per_host), planned_sent=planned["hosted_sent"][tdist.get_rank(group=edp)],
            runtime_expected=hosted.runtime.expected_collectives() if hosted is not None else {},
            pieces_ok=all(set(opt.piece_state.get(n, {})) == set(opt.rule.elementwise_state) and
                          not set(opt.matrix_state.get(n, {})) & set(opt.rule.elementwise_state)
                          for n in hosted_names))
    records = [None] * world
    tdist.all_gather_object(records, hooks["rec"].steps)
    infos = [None] * world
    tdist.all_gather_object(infos, {opt.global_name(n): (i.shape, i.num_heads, i.num_experts)
                                    for n, i in opt.infos.items()})
    out = dict(params=params, first=first, calls=calls, groups=groups)
    if ckpt is not None:
        state = {n: {k: v.clone() for k, v in st.items()} for n, st in opt.matrix_state.items()}
        pieces = {n: {k: v.clone() for k, v in st.items()} for n, st in opt.piece_state.items()}

        at_load = {}

        def load(engine):
            engine.load_checkpoint(ckpt, tag="two")
            inner = engine.optimizer.optimizer
            at_load.update(state={n: {k: v.clone() for k, v in st.items()} for n, st in inner.matrix_state.items()},
                           pieces={n: {k: v.clone() for k, v in st.items()} for n, st in inner.piece_state.items()})

        resumed, _, engine2 = run_moe_engine(rank, world, ep, cfg, 1, after_init=load, data=data[2:],
                                             num_experts=experts)
        opt2 = engine2.optimizer.optimizer
        def same(a, b):
            return a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])

        out.update(resumed=resumed, same_state=same(state, opt2.matrix_state),
                   same_pieces=same(pieces, opt2.piece_state))
        from canzona_ds.integration.ckpt import route as ckpt_index

        try:  # the index loop (what a resize or another plan takes) at the same size: the state
            index = ckpt_index.read_index(os.path.join(ckpt, "two"))  # DeepSpeed's own same-size load restored
            ckpt_index.load(engine2, ckpt, "two", index)
            out["elastic"] = "loaded"
            out.update(elastic_state=same(at_load["state"], opt2.matrix_state),
                       elastic_pieces=same(at_load["pieces"], opt2.piece_state))
        except ValueError as e:
            out["elastic"] = str(e)
    if rank == 0:
        merged = {k: v for d in infos for k, v in d.items()}
        group = next(g for g in opt.param_groups if g["canzona_role"] == "matrix")
        out["replay"] = _replay(group["lr"], group["weight_decay"], opt.rule, merged, records)
    return out


def _tp_owned_vs_mixed(rank, stage, opt_type):
    """MoE x TP (DP 2 x TP 2, ep_size 2; canzona_testkit.moe.TinyMoETP): the same run with the owned and
    the mixed layout; the mixed one hosts the TP-split dense ``down.weight`` over the DP x TP grid."""
    import numpy as np

    from canzona_testkit import megatron_standin as ms
    from canzona_testkit.models import batches
    from canzona_testkit.moe import moe_ds_config, run_moe_tp_engine

    ms.initialize_model_parallel(2)
    data = batches(1, 2 * 2) * STEPS  # the same batch every step: the loss must fall
    out = {}
    for layout in ("owned", "mixed"):
        cfg = moe_ds_config(2, optimizer=opt_type, stage=stage, micro=2, params=dict(HP[opt_type], layout=layout))
        params, losses, engine = run_moe_tp_engine(rank, 2, 2, cfg, STEPS, data, micro=2)
        z = engine.optimizer
        hosted = {str(z._canzona_partition(i)): [z._canzona.partition_matrices[z._canzona_partition(i)][k]
                                                 for k in lay.hosted_indices()] for i, lay in z.canzona_layouts.items()}
        out[layout] = (params, losses, hosted, [lay.mixed for lay in z.canzona_layouts.values()])
    owned, mixed = out["owned"][0], out["mixed"][0]
    return dict(diff=max(float(np.abs(owned[n] - mixed[n]).max()) for n in owned), losses=out["mixed"][1],
                hosted=out["mixed"][2], mixed=out["mixed"][3], owned_mixed=out["owned"][3])


def _world_worker(rank, world, scenarios):
    from canzona_testkit.moe import reference_run

    out, refs = {}, {}
    for name, (stage, opt_type, options) in scenarios.items():
        ep, experts = options.get("setup", SETUP[world])
        try:
            if options.get("tp"):
                out[name] = _tp_owned_vs_mixed(rank, stage, opt_type)
                continue
            if options.get("checkpoint"):
                with tempfile.TemporaryDirectory() as d:
                    import torch.distributed as tdist

                    shared = [d]
                    tdist.broadcast_object_list(shared, src=0)
                    res = _train(rank, world, stage, opt_type, options, ckpt=shared[0])
                    tdist.barrier()
            else:
                res = _train(rank, world, stage, opt_type, options)
            if rank == 0 and not options.get("checkpoint"):
                key = (opt_type, options.get("clip", 0.0), ep, experts)
                if key not in refs:
                    steps = STEPS if world == 2 else 1
                    refs[key] = reference_run(world, ep, steps, opt_type, clip=key[1], params=_params(opt_type),
                                              num_experts=experts)
                res["ref"] = refs[key]
            out[name] = res
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
    return out


@lru_cache(maxsize=None)
def _run(world: int) -> list:
    return run_distributed(_world_worker, world, SCENARIOS[world], timeout=900)


def _results(world: int, name: str) -> list:
    res = [r[name] for r in _run(world)]
    for r in res:
        if isinstance(r, str):
            pytest.fail(r)
    return res


def _check_plan_and_collectives(res: list, world: int, setup: tuple | None = None) -> None:
    ep, experts = setup or SETUP[world]
    key = f"ep_size_{ep}"
    for rank, r in enumerate(res):
        g = r["groups"]
        assert sorted(g) == ["None", key]
        # both matrix groups host something, each over its own DP group
        assert g["None"]["hosted"] == ["proj.weight"] and g["None"]["dp_ranks"] == list(range(world))
        assert g[key]["dp_ranks"] == list(range(rank % ep, world, ep))
        if ep == world:  # expert-DP groups of one rank: nothing to host there
            assert g[key]["hosted"] == [] and g[key]["mixed"] and g[key]["expected"] == 0
        elif world == 2:  # 3 experts over the pair: expert 2 hosted, 0 and 1 owned
            assert g[key]["hosted"] == ["moe.deepspeed_moe.experts.deepspeed_experts.2.0.weight"]
        else:  # one local expert per rank (global expert ep_rank), hosted over its pair
            assert g[key]["hosted"] == [f"moe.deepspeed_moe.experts.deepspeed_experts.{rank % ep}.0.weight"]
        for info in g.values():
            assert info["mixed"] and info["pieces_ok"]
            if not info["hosted"]:
                assert info["runtime_expected"] == {}
                continue
            # every hosted matrix is really cut: pieces on two ranks or more
            assert all(sum(1 for n in lengths if n) >= 2 for lengths in info["pieces"].values()), info["pieces"]
            assert info["runtime_expected"] == {"all_to_all_single": info["expected"]} and info["expected"] > 0
        # the counted collectives and bytes of every matrix group's step equal its plan's
        matrix_calls = [c for c in r["calls"] if c[0] == "matrix"]
        assert len(matrix_calls) == 2 * STEPS, r["calls"]
        for _, part, n, sent in matrix_calls:
            info = g[str(part)]
            assert (n, sent) == (info["expected"], info["planned_sent"]), (part, n, sent, info)
        assert all(n == 0 for role, _, n, _ in r["calls"] if role == "aux")
    assert_bits(res[0]["replay"], 0.0)


def _assert_equal(got: dict, ref: dict, what: str) -> None:
    assert set(got) <= set(ref)
    for n in got:
        np.testing.assert_array_equal(got[n], ref[n], err_msg=f"{what}: {n}")


@pytest.mark.parametrize("name", sorted(SCENARIOS[2]))
def test_world2_bit_exact(name):
    res = _results(2, name)
    _check_plan_and_collectives(res, 2, SCENARIOS[2][name][2].get("setup"))
    for r in res:
        _assert_equal(r["params"], res[0]["ref"], name)


@pytest.mark.parametrize("name", sorted(n for n in SCENARIOS[4] if n not in ("checkpoint", "tp2")))
def test_world4_ep2_replays_exactly(name):
    res = _results(4, name)
    _check_plan_and_collectives(res, 4)
    for r in res:  # the experts' sums have two terms: bit-exact after one step
        _assert_equal({n: v for n, v in r["first"].items() if ".experts." in n}, res[0]["ref"], f"{name} step 1")


def test_world4_checkpoint_round_trip_and_index_loop_load():
    """A same-size round trip continues bit for bit; the index loop (a resize's, tested at other
    sizes in tests/test_ckpt_resume.py) restores the same state, pieces included."""
    res = _results(4, "checkpoint")
    _check_plan_and_collectives(res, 4)
    for r in res:
        _assert_equal(r["resumed"], r["params"], "resumed")
        assert r["same_state"] and r["same_pieces"]
        assert r["elastic"] == "loaded", r["elastic"]
        assert r["elastic_state"] and r["elastic_pieces"]


def test_world4_tp2_mixed_equals_owned():
    """MoE x TP x the mixed layout: bit for bit the owned layout's run (itself exact against the
    reference in tests/test_moe_tp.py), the TP-split dense matrix hosted over the grid."""
    res = _results(4, "tp2")
    for r in res:
        assert r["hosted"]["None"] == ["down.weight"] and all(r["mixed"]) and not any(r["owned_mixed"]), r
        assert_bits(r["diff"], 0.0)
        assert r["losses"][-1] < r["losses"][0]


def test_auto_picks_mixed_per_matrix_group_under_moe():
    """``layout: "auto"`` under MoE: each matrix group (dense over DP 16, the expert group over its
    expert-DP group of 8) by the dense rule on its own: wide matrices whose owned padding is large
    and whose mixed step costs less get the mixed layout (a mixed MoE checkpoint resumes at
    another size: tests/test_ckpt_resume.py); "owned" keeps owned."""
    import torch

    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import CanzonaOptimizer
    from canzona_ds.parallel import ExpertGroups, ParallelGroups

    shapes = {"qkv": (3072, 128), "proj": (1024, 128), "fc1": (2560, 128), "fc2": (1024, 320)}
    named = [(f"{where}.{n}", torch.nn.Parameter(torch.zeros(s))) for where in ("dense", "experts.0")
             for n, s in shapes.items()]
    groups = ParallelGroups(dp_size=16, ep_size=2, source="test",
                            experts=(ExpertGroups("ep_size_2", 2, 0, None, 8, 0, None),))
    partitions = {n: "ep_size_2" for n, _ in named if n.startswith("experts.")}
    for layout, mixed in (("auto", True), ("owned", False)):
        opt = CanzonaOptimizer(named, CanzonaConfig.from_ds("CanzonaMuon", {"layout": layout}), groups,
                               placement="owned", partitions=partitions)
        assert sorted(opt.plans, key=str) == [None, "ep_size_2"]
        for key, plan in opt.plans.items():
            assert plan.mixed == mixed, (layout, key, plan.extra.get("layout_choice"))
            if mixed:
                assert plan.hosted and plan.extra["layout_choice"].endswith(": mixed"), plan.extra["layout_choice"]


def test_auto_under_moe_with_tensor_parallelism_chooses_as_without():
    """MoE x TP: ``"auto"`` chooses each matrix group's layout by the same rule as without MoE (a
    mixed MoE x TP checkpoint resumes at another size or layout: tests/test_ckpt_resume.py's
    moetp rows)."""
    from canzona_ds.optim import cost_model
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import _plan
    from canzona_ds.planning.params import ParamSpec

    specs = [ParamSpec(n, s) for n, s in (("qkv", (3072, 128)), ("proj", (1024, 128)), ("fc1", (2560, 128)),
                                          ("fc2", (1024, 320)))]
    rule = cost_model("muon")
    cfg = CanzonaConfig.from_ds("CanzonaMuon", {"layout": "auto"})
    assert _plan(specs, 16, cfg, rule).mixed and _plan(specs, 16, cfg, rule, grid=True).mixed

"""DeepSpeed AutoTP path: group discovery from ``deepspeed.utils.groups`` and the
micro-group runtime on real ``LinearLayer`` / ``LinearAllreduce`` shards (including AutoTP's
uneven splits), for Muon, Shampoo and SOAP: bit-identical to the single-process rule
(:class:`ReferenceOptimizer`) on the full matrices.

One pair of processes runs every rule, each in its own ``try``: one rule's failure fails
only its own test.

Cost: 1 rank run; under a second on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import traceback
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import pytest
import torch

from canzona_ds.config import CanzonaConfig, TPConfig
from canzona_ds.optim.muon import MuonRule
from canzona_ds.reference import ReferenceOptimizer
from canzona_ds.optim.rule import MatrixRule
from canzona_ds.optim.shampoo import ShampooRule
from canzona_ds.optim.soap import SOAPRule
from canzona_testkit.dist import run_distributed

pytest.importorskip("deepspeed")

TP, STEPS, LR, WD = 2, 4, 0.05, 0.1
#: (out, in) of nn.Linear; "down" is row-parallel (LinearAllreduce); 33 rows -> uneven shards
SHAPES: dict[str, tuple[int, int]] = {"up": (40, 24), "down": (24, 40), "odd": (33, 16)}
#: refresh every 2 steps, so 4 steps include refreshes
RULES: dict[str, MatrixRule] = {
    "muon": MuonRule(momentum=0.95),
    "shampoo": ShampooRule(precondition_frequency=2, start_preconditioning_step=2, epsilon=1e-8),
    "soap": SOAPRule(precondition_frequency=2),
}


def full_weight(i: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(i))


def full_grads(step: int) -> list[torch.Tensor]:
    return [full_weight(100 + 10 * step + i, s) for i, s in enumerate(SHAPES.values())]


def _run_rule(rule: MatrixRule, g) -> dict[str, Any]:
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode

    from canzona_ds.tp import MicroGroupRuntime, TPMatrix

    set_autotp_mode(training=True)  # as deepspeed.tp_model_init: the layers partition for training
    layers = {}
    for i, (name, (out_f, in_f)) in enumerate(SHAPES.items()):
        lin = torch.nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            lin.weight.copy_(full_weight(i, (out_f, in_f)))
        layers[name] = (LinearAllreduce if name == "down" else LinearLayer)(lin, g.tp_group)
    mats = [TPMatrix.from_param(n, layers[n].weight, g.tp_size) for n in SHAPES]
    rt = MicroGroupRuntime(mats, rule, g.tp_group, TPConfig(), state={})
    params = [layers[n].weight.data for n in SHAPES]
    for step in range(STEPS):
        grads = []
        for m, G in zip(mats, full_grads(step)):
            off = sum(m.shard_sizes[: g.tp_rank])
            grads.append(G.narrow(m.partition_dim, off, m.shard_sizes[g.tp_rank]).clone())
        rt.step(params, grads, lr=LR, weight_decay=WD, step=step + 1)
    return {"mats": [(m.name, m.full_shape, m.partition_dim, m.shard_sizes) for m in mats],
            "params": {n: p.numpy().copy() for n, p in zip(SHAPES, params)}, "hosted": rt.hosted_names()}


def _isolated(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except Exception:  # noqa: BLE001 - reported to the rule's own test
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    from canzona_ds.integration.ds_compat import require
    from canzona_ds.integration.megatron import groups_from_deepspeed

    # what the builder requires before planning AutoTP matrices (refused by name on older releases)
    require("autotp_partition_meta", "the TP runtime on DeepSpeed AutoTP layers")
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing process group
    # the TP groups the engine makes for autotp_size (releases before 0.19: a device mesh)
    init = getattr(groups, "_init_tp_groups_with_new_group", None) or groups._init_tp_mesh_device
    init(tensor_model_parallel_size=world)
    g = groups_from_deepspeed()
    out: dict[str, Any] = {"groups": (g.tp_rank, g.tp_size, g.dp_rank, g.dp_size, dist.get_world_size(g.tp_group))}
    out.update({name: _isolated(lambda rule=rule: _run_rule(rule, g)) for name, rule in RULES.items()})
    return out


@lru_cache(maxsize=None)
def _results() -> list[dict[str, Any]]:
    return run_distributed(_worker, TP, timeout=240)


def reference(rule: MatrixRule) -> dict[str, torch.Tensor]:
    """The rule on the full matrices, one process (1 thread, as the ranks)."""
    params = {n: torch.nn.Parameter(full_weight(i, s)) for i, (n, s) in enumerate(SHAPES.items())}
    opt = ReferenceOptimizer(params.items(), CanzonaConfig(rule=rule, lr=LR, adam_lr=LR, weight_decay=WD))
    saved = torch.get_num_threads()
    torch.set_num_threads(test_threads())
    try:
        for step in range(STEPS):
            for p, G in zip(params.values(), full_grads(step)):
                p.grad = G
            opt.step()
    finally:
        torch.set_num_threads(saved)
    return {n: p.detach() for n, p in params.items()}


def test_autotp_groups_from_deepspeed() -> None:
    res = _results()
    for r in range(TP):
        assert res[r]["groups"] == (r, TP, 0, 1, TP)


@pytest.mark.parametrize("rule_name", list(RULES))
def test_autotp_shards_updated_exactly(rule_name: str) -> None:
    per_rank = []
    for r, res in enumerate(_results()):
        if "error" in res[rule_name]:
            pytest.fail(f"{rule_name} failed on rank {r}:\n{res[rule_name]['error']}")
        per_rank.append(res[rule_name]["ok"])
    dims = {n: (full, d) for n, full, d, _ in per_rank[0]["mats"]}
    assert dims == {"up": ((40, 24), 0), "down": ((24, 40), 1), "odd": ((33, 16), 0)}
    sizes = {n: s for n, _, _, s in per_rank[0]["mats"]}
    assert sizes["odd"] in ((17, 16), (16, 17))  # AutoTP split it unevenly
    assert sorted(per_rank[0]["hosted"] + per_rank[1]["hosted"]) == sorted(SHAPES)
    ref = reference(RULES[rule_name])
    for n in SHAPES:
        dim = dims[n][1]
        got = np.concatenate([per_rank[r]["params"][n] for r in range(TP)], axis=dim)
        assert (got != full_weight(list(SHAPES).index(n), SHAPES[n]).numpy()).any(), n  # it moved
        np.testing.assert_array_equal(got, ref[n].numpy(), err_msg=f"{rule_name} {n}")

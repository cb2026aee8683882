"""DeepSpeed AutoTP path: group discovery from deepspeed.utils.groups and the TP runtime
on real ``LinearLayer`` / ``LinearAllreduce`` shards (including AutoTP's uneven splits)."""
from __future__ import annotations

import pytest
import torch

from _dist import run_distributed

pytest.importorskip("deepspeed")

SHAPES = {"up": (40, 24), "down": (24, 40), "odd": (33, 16)}  # (out, in) of nn.Linear; 33 rows -> uneven shards


def _full(seed, shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _worker(rank, world):
    import torch.distributed as dist
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from deepspeed.utils import groups

    from canzona_ds.integration.megatron import groups_from_deepspeed
    from canzona_ds.optim.muon import muon_update
    from canzona_ds.tp import TPMatrix, TPMuonConfig, TPMuonRuntime

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing process group
    groups._init_tp_groups_with_new_group(tensor_model_parallel_size=world)
    g = groups_from_deepspeed()
    layers = {}
    for i, (name, (out_f, in_f)) in enumerate(SHAPES.items()):
        lin = torch.nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            lin.weight.copy_(_full(i, (out_f, in_f)))
        wrap = LinearAllreduce if name == "down" else LinearLayer
        layers[name] = wrap(lin, g.tp_group)
    mats = [TPMatrix.from_param(n, layers[n].weight, g.tp_size) for n in SHAPES]
    rt = TPMuonRuntime(mats, g.tp_group, TPMuonConfig(lr=0.05, weight_decay=0.1))
    params = [layers[n].weight.data for n in SHAPES]
    ref_params = [_full(i, s) for i, s in enumerate(SHAPES.values())]
    bufs = [torch.zeros_like(p) for p in ref_params]
    ok = True
    for step in range(2):
        full_grads = [_full(100 + 10 * step + i, s) for i, s in enumerate(SHAPES.values())]
        grads = []
        for m, G in zip(mats, full_grads):
            off = sum(m.shard_sizes[: g.tp_rank])
            grads.append(G.narrow(m.partition_dim, off, m.shard_sizes[g.tp_rank]).clone())
        rt.step(params, grads)
        for P, G, B in zip(ref_params, full_grads, bufs):
            muon_update(P, G, B, lr=0.05, weight_decay=0.1, momentum=0.95)
    for m, p, P in zip(mats, params, ref_params):
        off = sum(m.shard_sizes[: g.tp_rank])
        ok &= torch.equal(p, P.narrow(m.partition_dim, off, m.shard_sizes[g.tp_rank]))
    return {"groups": (g.tp_rank, g.tp_size, g.dp_rank, g.dp_size, dist.get_world_size(g.tp_group)),
            "mats": [(m.name, m.full_shape, m.partition_dim, m.shard_sizes) for m in mats], "exact": ok}


def test_autotp_groups_and_exact_update():
    res = run_distributed(_worker, 2)
    for r in range(2):
        assert res[r]["groups"] == (r, 2, 0, 1, 2)
        assert res[r]["exact"]
        dims = {n: (full, d) for n, full, d, _ in res[r]["mats"]}
        assert dims == {"up": ((40, 24), 0), "down": ((24, 40), 1), "odd": ((33, 16), 0)}
        assert res[r]["mats"][2][3] in ((17, 16), (16, 17))  # AutoTP split it unevenly

"""NV-layerwise baseline (canzona_testkit.baselines.LayerwiseOptimizer) under DeepSpeed ZeRO stage 0.

One real 2-process gloo run: a three-layer model whose layers differ in size, so the
layer LPT gives the heaviest layer to one rank and the other two to the other.  Each rank
updates only the matrices of its layers (their Muon state lives only there), AdamW runs
replicated, owners broadcast their matrices; the fp32 result equals the single-process
reference (``canzona_testkit.models.run_reference`` -> ``reference.ReferenceOptimizer``) bit
for bit: at DP=2 DeepSpeed's all-reduced average is exact.

Cost: 1 rank run; 1 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from canzona_testkit.dist import run_distributed
from canzona_testkit.models import D, HP, VOCAB, batches, ds_config, params_of, run_reference

DP, STEPS, MICRO = 2, 3, 2
FFN = (40, 24, 32)  # layer 0 is the heaviest: alone on one rank, layers 1 and 2 on the other


class Block(nn.Module):
    def __init__(self, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.fc1 = nn.Linear(D, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        h = h + self.proj(F.silu(q) * k + v)
        return h + self.fc2(F.gelu(self.fc1(h)))


class StackLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(f) for f in FFN])
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten())


def make_stack(seed: int = 0) -> StackLM:
    torch.manual_seed(seed)
    return StackLM()


def _layerwise(rank: int, dp: int, steps: int) -> dict:
    import canzona_ds  # noqa: F401 - registration, as in a user job
    import deepspeed

    from canzona_ds.config import CanzonaConfig
    from canzona_testkit.baselines import LayerwiseOptimizer

    model = make_stack(0)
    opt = LayerwiseOptimizer(model.named_parameters(), CanzonaConfig.from_ds("CanzonaMuon", HP["CanzonaMuon"]))
    cfg = ds_config(dp, micro=MICRO, stage=0)
    cfg.pop("optimizer")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    calls = []
    for x, y in batches(steps, MICRO * dp):
        loss = engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        calls.append(dict(opt.collectives))
    return {"params": params_of(engine.module), "owned": opt.owned_names(), "state": sorted(opt.matrix_state),
            "calls": calls, "expected": opt.expected_collectives(), "step": opt.param_groups[0]["step"],
            "matrices": list(opt.matrix_names)}


def test_layerwise_matches_reference_bit_for_bit_at_dp2():
    res = run_distributed(_layerwise, DP, STEPS)
    ref = run_reference(DP, STEPS, "CanzonaMuon", micro=MICRO, model=make_stack(0))
    matrices = res[0]["matrices"]
    assert len(matrices) == 4 * len(FFN)
    # whole layers: layer 0 (the heaviest) on one rank, layers 1 and 2 on the other
    owned = [set(r["owned"]) for r in res]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(matrices)
    for names in owned:
        layers = {n.split(".")[1] for n in names}
        assert all({f"layers.{i}.{m}.weight" for m in ("qkv", "proj", "fc1", "fc2")} <= names for i in layers)
    assert sorted(len({n.split(".")[1] for n in names}) for names in owned) == [1, 2]
    for r in res:
        assert r["state"] == sorted(r["owned"])  # rule state only where the matrix is owned
        assert r["step"] == STEPS
        assert r["expected"] == {"broadcast": DP}  # one flat broadcast per owner
        assert r["calls"] == [r["expected"]] * STEPS
    for r in res:  # every rank, every parameter: the reference's bits
        assert set(r["params"]) == set(ref)
        for n in ref:
            np.testing.assert_array_equal(r["params"][n], ref[n], err_msg=n)
    moved = max(float(np.abs(ref[n] - params_of(make_stack(0))[n]).max()) for n in matrices)
    assert moved > 1e-3  # the matrices really trained

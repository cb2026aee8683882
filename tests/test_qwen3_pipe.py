"""The pipeline form of the Qwen3 decoder (canzona_ds/models/qwen3_pipe.py) against the plain
model: same initial values by canonical name (one stage and two), same loss, and the same
training under DeepSpeed's PipelineEngine with stock AdamW as the plain model with torch's AdamW
(bit for bit: fp32, PP=2, DP=1, untied).

Cost: 5 rank runs; 3 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

from canzona_testkit.kernels import assert_bits, test_threads
import pytest
import torch

from canzona_ds.models.qwen3 import Qwen3Config, build_model
from canzona_ds.models.qwen3_pipe import (DecoderLayerPipe, InitialValues, LMHeadPipe, canonical_name,
                                          qwen3_initial_values)
from canzona_testkit.dist import run_distributed

SEED = 3
ADAMW = {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _cfg(tied: bool) -> Qwen3Config:
    return Qwen3Config(vocab_size=64, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_seq_len=16, tie_word_embeddings=tied)


def _batch(cfg: Qwen3Config, rows: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (rows, 8), generator=g),
            torch.randint(0, cfg.vocab_size, (rows, 8), generator=g))


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_initial_values_replay_build_model(tied):
    cfg = _cfg(tied)
    plain = dict(build_model(cfg, SEED).named_parameters())
    values = qwen3_initial_values(cfg, SEED)
    assert set(values) == set(plain)
    assert all(torch.equal(values[n], plain[n]) for n in plain)
    some = qwen3_initial_values(cfg, SEED, lambda n: n.startswith("model.layers.1."))
    assert some and all(n.startswith("model.layers.1.") and torch.equal(v, plain[n]) for n, v in some.items())


def test_preset_tiny_replays():
    from canzona_ds.models.qwen3 import preset

    cfg = preset("tiny")
    plain = dict(build_model(cfg, 0).named_parameters())
    values = qwen3_initial_values(cfg, 0)
    assert all(torch.equal(values[n], plain[n]) for n in plain)


def test_layer_built_alone_equals_plain_layer():
    cfg = _cfg(False)
    plain = build_model(cfg, SEED)
    layer = DecoderLayerPipe(cfg, 1, InitialValues(cfg, SEED))
    for n, p in plain.model.layers[1].named_parameters():
        assert torch.equal(dict(layer.named_parameters())[n], p), n
    x = torch.randn(2, 8, cfg.hidden_size)
    T = x.shape[1]
    assert torch.equal(layer(x), plain.model.layers[1](x, plain.model.rope_cos[:T], plain.model.rope_sin[:T]))
    assert torch.equal(LMHeadPipe(cfg, InitialValues(cfg, SEED)).lm_head.weight, plain.lm_head.weight)


def test_canonical_names():
    cfg = _cfg(False)
    L = cfg.num_layers
    assert canonical_name(cfg, "0.embed_tokens.weight") == "model.embed_tokens.weight"
    assert canonical_name(cfg, "tied_modules.embed.embed_tokens.weight") == "model.embed_tokens.weight"
    assert canonical_name(cfg, "2.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert canonical_name(cfg, f"{L + 1}.weight") == "model.norm.weight"
    assert canonical_name(cfg, f"{L + 2}.lm_head.weight") == "lm_head.weight"


# ---------------------------------------------------------------------------- real processes
def _build_worker(rank, world, cfg, stages):
    import deepspeed

    from canzona_ds.models.qwen3_pipe import Qwen3Pipe, qwen3_loss

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    pipe = Qwen3Pipe(cfg, SEED, num_stages=stages)
    names = pipe.canonical_names()
    out = {"params": {names[n]: p.detach().numpy().copy() for n, p in pipe.named_parameters()},
           "stage_names": sorted(names)}
    if stages == 1:
        x, y = _batch(cfg, 2)
        with torch.no_grad():
            out["loss"] = float(qwen3_loss(pipe(x), y))
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("stages", [1, 2])
def test_pipe_stages_hold_build_model_values(stages, tied):
    cfg = _cfg(tied)
    plain = build_model(cfg, SEED)
    expected = {n: p.detach().numpy() for n, p in plain.named_parameters()}
    results = run_distributed(_build_worker, stages, cfg, stages)
    seen = set()
    for r in results:
        for n, v in r["params"].items():
            assert_bits(v, expected[n], n)
        seen |= set(r["params"])
    assert seen == set(expected)
    if tied and stages == 2:  # the tied embedding lives on both stages
        assert all("tied_modules.embed.embed_tokens.weight" in r["stage_names"] for r in results)
    if stages == 1:
        x, y = _batch(cfg, 2)
        with torch.no_grad():
            assert_bits(results[0]["loss"], float(plain(x, y)[1]))


def _train_worker(rank, world, cfg, steps, gas, micro):
    import deepspeed

    from canzona_ds.models.qwen3_pipe import Qwen3Pipe
    from canzona_testkit.models import ds_config

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    pipe = Qwen3Pipe(cfg, SEED, num_stages=world)
    ds = ds_config(1, micro=micro, gas=gas, stage=1, optimizer={"type": "AdamW", "params": dict(ADAMW, torch_adam=True)})
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=list(pipe.parameters()), config=ds)
    x, y = _batch(cfg, steps * gas * micro)
    data = iter([(x[i:i + micro], y[i:i + micro]) for i in range(0, len(x), micro)])
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    names = pipe.canonical_names()
    return {"params": {names[n]: p.detach().numpy().copy() for n, p in pipe.named_parameters()}, "losses": losses}


def test_pipe_trains_like_plain_model():
    """PipelineEngine (PP=2, gas 2, stock AdamW) == the plain model, loss/gas per micro-batch,
    torch.optim.AdamW, bit for bit (untied: a tied plain model sums the two uses per micro-batch,
    the pipeline per stage first; see tests/test_pipeline_harness.py)."""
    cfg, steps, gas, micro = _cfg(False), 2, 2, 2
    results = run_distributed(_train_worker, 2, cfg, steps, gas, micro)
    torch.set_num_threads(test_threads())
    plain = build_model(cfg, SEED)
    opt = torch.optim.AdamW(plain.parameters(), **ADAMW)
    x, y = _batch(cfg, steps * gas * micro)
    losses = []
    for s in range(steps):
        total = None
        for m in range(gas):
            rows = slice((s * gas + m) * micro, (s * gas + m + 1) * micro)
            loss = plain(x[rows], y[rows])[1]
            total = loss.detach() if total is None else total + loss.detach()
            (loss / gas).backward()
        losses.append(float(total / gas))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in results:
        assert_bits(r["losses"], losses)
        for n, v in r["params"].items():
            assert_bits(v, dict(plain.named_parameters())[n].detach().numpy(), n)

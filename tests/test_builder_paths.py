"""Every path that builds a Canzona optimizer goes through the one builder (integration/builder.py),
so every path gets the settings agreement, the config checks and per-head tagging.

The Megatron-DeepSpeed stage-0 hook once built its optimizer itself and never applied
``per_head_muon``: a TP=2 attention block built through the hook must be tagged per head and
update each head as its own matrix, exactly as the single-process per-head reference does.

Cost: 1 rank run; under a second on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

from canzona_testkit.kernels import test_threads
import types

import numpy as np
import pytest
import torch

from canzona_testkit.dist import run_distributed

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, TP = 4, 2, 8, 6, 2
SHAPES = {"q_proj.weight": (HEADS * HEAD_DIM, HIDDEN), "k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
          "v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj.weight": (HIDDEN, HEADS * HEAD_DIM)}
SPLIT_DIM = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1}
PARAMS = {"lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "per_head_muon": True}


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _shard(t: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    return t.chunk(TP, dim=SPLIT_DIM[name])[rank].clone()


def _hook_worker(rank, world, per_head):
    from canzona_ds.integration.megatron import patch_megatron_training
    from canzona_testkit import megatron_standin as ms

    ms.initialize_model_parallel(TP)
    block = torch.nn.Module()
    block.config = types.SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, hidden_size=HIDDEN,
                                         head_dim=HEAD_DIM, model_type="llama")
    block.q_proj = ms.ColumnParallelLinear(HIDDEN, HEADS * HEAD_DIM)
    block.k_proj = ms.ColumnParallelLinear(HIDDEN, KV_HEADS * HEAD_DIM)
    block.v_proj = ms.ColumnParallelLinear(HIDDEN, KV_HEADS * HEAD_DIM)
    block.o_proj = ms.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN)
    init = _full(0)
    with torch.no_grad():
        for n, p in block.named_parameters():
            p.copy_(_shard(init[n], n, rank))
    ds = {"optimizer": {"type": "CanzonaMuon", "params": dict(PARAMS, per_head_muon=per_head)},
          "zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0}
    training = types.SimpleNamespace(get_megatron_optimizer=lambda model, *a, **k: "megatron's own optimizer")
    patch_megatron_training(training, get_args=lambda: types.SimpleNamespace(deepspeed_config_dict=ds), mpu=ms.mpu)
    opt = training.get_megatron_optimizer([block])
    for step in range(2):
        grads = _full(100 + step)
        for n, p in block.named_parameters():
            p.grad = _shard(grads[n], n, rank)
        opt.step()
    return {"heads": {n: i.num_heads for n, i in opt.infos.items()},
            "params": {n: p.detach().numpy().copy() for n, p in block.named_parameters()}}


def _reference(per_head: bool) -> dict[str, np.ndarray]:
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer

    torch.set_num_threads(test_threads())
    params = {n: torch.nn.Parameter(t) for n, t in _full(0).items()}
    heads = {"q_proj.weight": HEADS, "k_proj.weight": KV_HEADS, "v_proj.weight": KV_HEADS}
    for n, p in params.items():
        p.muon_num_heads = heads.get(n) if per_head else None
    opt = ReferenceOptimizer(params.items(), CanzonaConfig.from_ds("CanzonaMuon", dict(PARAMS, per_head_muon=per_head)))
    for step in range(2):
        for n, g in _full(100 + step).items():
            params[n].grad = g
        opt.step()
    return {n: p.detach().numpy() for n, p in params.items()}


def test_megatron_stage0_hook_applies_per_head_muon():
    res = run_distributed(_hook_worker, TP, True)
    assert res[0]["heads"] == {"q_proj.weight": HEADS, "k_proj.weight": KV_HEADS, "v_proj.weight": KV_HEADS,
                               "o_proj.weight": None}
    ref = _reference(per_head=True)
    for n in SHAPES:
        got = np.concatenate([res[r]["params"][n] for r in range(TP)], axis=SPLIT_DIM[n])
        np.testing.assert_array_equal(got, ref[n], err_msg=n)
    whole = _reference(per_head=False)
    assert max(float(np.abs(ref[n] - whole[n]).max()) for n in SHAPES) > 1e-4  # per-head is another update


def test_megatron_hook_accepts_a_pipeline_module_without_mpu():
    """Megatron-DeepSpeed with pipeline parallelism passes its PipelineModule and no mpu (DeepSpeed
    takes the module's grid): the wrapped deepspeed.initialize routes it (ZeRO-1 x PP x TP); a plain
    module without mpu is still refused, naming both ways."""
    import pytest
    from deepspeed.pipe import PipelineModule

    from canzona_ds.integration.megatron import patch_megatron_training
    from canzona_testkit import megatron_standin as ms

    calls: list = []
    fake_ds = types.SimpleNamespace(initialize=lambda **k: calls.append(k) or "engine")
    training = types.SimpleNamespace(get_megatron_optimizer=lambda model, *a, **k: "orig", deepspeed=fake_ds)
    ds = {"optimizer": {"type": "CanzonaMuon", "params": {}}, "zero_optimization": {"stage": 1}}
    patch_megatron_training(training, get_args=lambda: types.SimpleNamespace(deepspeed_config_dict=ds), mpu=ms.mpu)
    placeholder = training.get_megatron_optimizer([None])
    pipe = object.__new__(PipelineModule)  # only its type matters to the route
    assert fake_ds.initialize(model=pipe, optimizer=placeholder, mpu=None, config=ds) == "engine"
    assert calls[0]["optimizer"] is None and calls[0]["model"] is pipe
    with pytest.raises(ValueError, match="pass mpu= to deepspeed.initialize .* or a PipelineModule"):
        fake_ds.initialize(model="a plain module", optimizer=placeholder, mpu=None, config=ds)


@pytest.mark.parametrize("axis,what", [("tp", "tensor parallelism"), ("pp", "pipeline parallelism")])
def test_zero3_with_tensor_or_pipeline_parallelism_is_refused(axis, what):
    """ZeRO-3 x TP / PP is not implemented: the builder names the parallelism and its size."""
    import torch

    from canzona_ds.integration.builder import RunSettings, build_optimizer
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.parallel import ParallelGroups

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    settings = RunSettings.from_ds_config({"optimizer": {"type": "CanzonaMuon"}, "zero_optimization": {"stage": 3}})
    groups = ParallelGroups(**{f"{axis}_size": 2}, source="mpu")
    with pytest.raises(ValueError, match=rf"stage 3 with {what} \({axis}_size=2\) is not implemented"):
        build_optimizer(list(model.named_parameters()), CanzonaConfig.from_ds("CanzonaMuon", {}), groups, settings)

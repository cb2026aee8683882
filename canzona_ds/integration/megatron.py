"""Megatron-DeepSpeed and DeepSpeed-AutoTP glue for the TP runtime (canzona_ds.tp).

Three things:

1. Group discovery.  :func:`groups_from_mpu` reads a Megatron ``parallel_state`` /
   Megatron-DeepSpeed ``mpu`` (``get_tensor_model_parallel_*`` with the older
   ``get_model_parallel_*`` names as fallback, ``get_data_parallel_*``);
   :func:`groups_from_deepspeed` reads ``deepspeed.utils.groups`` after DeepSpeed set up
   AutoTP (``"tensor_parallel": {"autotp_size": N}``).

2. The optimizer.  :func:`build_tp_optimizer` turns a model (Megatron-marked or AutoTP
   parameters) and a ds_config into :class:`canzona_ds.tp.optimizer.TPMuon`::

       "optimizer": {"type": "CanzonaMuon", "params": {"lr": 0.02, "momentum": 0.95, ...}},
       "canzona_tp": {"scheduler": "lpt_rollback", "c_max": null, "pipelined": true,
                      "strategy": "asc", "cost": "numel"}

   ``params`` is parsed by the ZeRO-1 integration's ``CanzonaMuonConfig`` (one parser,
   one set of names); ``canzona_tp`` keys are :class:`canzona_ds.tp.TPMuonConfig` fields
   (unknown keys are a ValueError).

3. The Megatron-DeepSpeed hook.  Megatron-DeepSpeed builds its own optimizer
   (``megatron/training.py: setup_model_and_optimizer -> get_megatron_optimizer``) and
   passes it to ``deepspeed.initialize`` as a client optimizer, so ds_config's optimizer
   section is never read.  :func:`patch_megatron_training` replaces
   ``megatron.training.get_megatron_optimizer`` so that, when ds_config says
   ``"type": "CanzonaMuon"``, the client optimizer is ``TPMuon`` (otherwise the original
   runs).  ``launch/megatron_pretrain_gpt.py`` applies it before running pretrain_gpt.py.

   Limit of the *client-optimizer* hook: under ZeRO stage >= 1 or bf16/fp16 DeepSpeed
   re-flattens a client optimizer's parameters and loses the TP shard identity, so the
   hook requires ``zero_optimization.stage`` 0 and fp32 (DP then replicates the Muon step).

4. ZeRO-1 x TP (works, fp32/bf16/fp16): pass *no* client optimizer and give DeepSpeed the
   mpu, ``deepspeed.initialize(model=..., model_parameters=..., config=ds_config, mpu=mpu)``
   with ``"type": "CanzonaMuon"`` and ``"zero_optimization": {"stage": 1}``.  The ZeRO-1
   integration (deepspeed_zero1.py) plans DP ownership over the TP-local shapes and steps
   its owned TP-split matrices through ``TPMuonRuntime`` with the ``canzona_tp`` keys above;
   docs/tp.md, tests/test_zero1_tp.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch.distributed as dist

from ..tp.optimizer import TPMuon
from ..tp.runtime import TPMuonConfig

DS_CONFIG_TP_KEY = "canzona_tp"


@dataclass(frozen=True)
class ParallelGroups:
    tp_group: Any
    tp_rank: int
    tp_size: int
    dp_group: Any
    dp_rank: int
    dp_size: int


def _first(obj, *names: str) -> Callable:
    for n in names:
        fn = getattr(obj, n, None)
        if fn is not None:
            return fn
    raise ValueError(f"mpu {obj!r} has none of {list(names)}")


def groups_from_mpu(mpu) -> ParallelGroups:
    """TP and DP groups from a Megatron ``parallel_state`` / Megatron-DeepSpeed ``mpu``."""
    tp_group = _first(mpu, "get_tensor_model_parallel_group", "get_model_parallel_group")()
    tp_rank = _first(mpu, "get_tensor_model_parallel_rank", "get_model_parallel_rank")()
    tp_size = _first(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")()
    dp_group = _first(mpu, "get_data_parallel_group")()
    dp_rank = _first(mpu, "get_data_parallel_rank")()
    dp_size = _first(mpu, "get_data_parallel_world_size")()
    if dist.is_initialized() and dist.get_world_size(tp_group) != tp_size:
        raise ValueError(f"mpu reports tp_size={tp_size} but its TP group has {dist.get_world_size(tp_group)} ranks")
    return ParallelGroups(tp_group, tp_rank, tp_size, dp_group, dp_rank, dp_size)


def groups_from_deepspeed() -> ParallelGroups:
    """TP and DP groups DeepSpeed created for AutoTP (``deepspeed.utils.groups``)."""
    from deepspeed.utils import groups

    return groups_from_mpu(groups)


def tp_config_from_ds_config(ds_config: Mapping[str, Any]) -> tuple[TPMuonConfig, dict, Callable]:
    """(TPMuonConfig, AdamW kwargs, is_matrix(name, shape)) from a CanzonaMuon ds_config."""
    from .config import CanzonaMuonConfig

    opt = ds_config.get("optimizer") or {}
    if opt.get("type") != "CanzonaMuon":
        raise ValueError(f"ds_config optimizer type={opt.get('type')!r}; the TP hook needs 'CanzonaMuon'")
    c = CanzonaMuonConfig.from_params(opt.get("params"))
    tp_keys = dict(ds_config.get(DS_CONFIG_TP_KEY) or {})
    tp = TPMuonConfig.from_dict(dict(
        lr=c.muon_lr, weight_decay=c.weight_decay, momentum=c.momentum, nesterov=c.nesterov,
        ns_steps=c.ns_steps, adjust_lr_fn=c.adjust_lr_fn, ns_method=c.ns_method, **tp_keys))
    adamw = dict(adamw_lr=c.adam_lr, adamw_betas=tuple(c.betas), adamw_eps=c.eps, adamw_weight_decay=c.weight_decay)
    return tp, adamw, c.is_matrix


def _zero_stage(ds_config: Mapping[str, Any]) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def build_tp_optimizer(model, ds_config: Mapping[str, Any], mpu=None) -> TPMuon:
    """``TPMuon`` over ``model`` (a module or a list of Megatron model chunks)."""
    if _zero_stage(ds_config) != 0:
        raise ValueError(
            f"zero_optimization.stage={_zero_stage(ds_config)}: the Megatron TP hook passes a client "
            "optimizer, which DeepSpeed re-flattens under ZeRO; use stage 0 here, or for ZeRO-1 x TP pass no "
            "client optimizer and call deepspeed.initialize(model=..., model_parameters=..., config=ds_config, "
            "mpu=mpu): CanzonaMuon's ZeRO-1 integration then runs the TP runtime (docs/tp.md)")
    for key in ("bf16", "fp16"):
        if (ds_config.get(key) or {}).get("enabled", False):
            raise ValueError(
                f"{key}.enabled=true: DeepSpeed wraps a client optimizer in its {key.upper()} optimizer, which "
                "flattens (and for bf16 DP-partitions) the parameters and loses the TP shards; the Megatron TP "
                "hook runs fp32 at ZeRO stage 0; for bf16/fp16 use ZeRO-1 x TP: no client optimizer, "
                "deepspeed.initialize(..., mpu=mpu) with zero_optimization.stage=1 (docs/tp.md)")
    groups = groups_from_mpu(mpu) if mpu is not None else groups_from_deepspeed()
    tp, adamw, is_matrix = tp_config_from_ds_config(ds_config)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    named: list = []
    for k, chunk in enumerate(chunks):
        prefix = f"chunk{k}." if len(chunks) > 1 else ""
        named += [(prefix + n, p) for n, p in chunk.named_parameters()]
    return TPMuon(named, groups.tp_group, tp, tp_size=groups.tp_size, matrix_filter=is_matrix, **adamw)


def _load_ds_config(args) -> dict:
    cfg = getattr(args, "deepspeed_config_dict", None)
    if cfg:
        return dict(cfg)
    path = getattr(args, "deepspeed_config", None)
    if not path:
        raise ValueError("Megatron args carry no deepspeed_config / deepspeed_config_dict")
    with open(path) as f:
        return json.load(f)


def patch_megatron_training(training_module=None, get_args: Callable | None = None, mpu=None) -> Callable:
    """Make Megatron-DeepSpeed's ``setup_model_and_optimizer`` build TPMuon from ds_config.

    Defaults are the real modules (``megatron.training``, ``megatron.get_args``,
    ``megatron.core.mpu``); tests pass the stand-in.  Returns the original function.
    Idempotent.
    """
    if training_module is None:
        import megatron.training as training_module  # type: ignore[no-redef]
    if get_args is None:
        from megatron import get_args  # type: ignore[no-redef]
    if mpu is None:
        from megatron.core import mpu  # type: ignore[no-redef]
    original = training_module.get_megatron_optimizer
    if getattr(original, "_canzona_patched", False):
        return original._canzona_original

    def get_megatron_optimizer(model, *a, **k):
        ds_config = _load_ds_config(get_args())
        if (ds_config.get("optimizer") or {}).get("type") != "CanzonaMuon":
            return original(model, *a, **k)
        return build_tp_optimizer(model, ds_config, mpu=mpu)

    get_megatron_optimizer._canzona_patched = True
    get_megatron_optimizer._canzona_original = original
    training_module.get_megatron_optimizer = get_megatron_optimizer
    return original


def named_tp_params(modules: Iterable) -> list[tuple[str, Any]]:
    """(name, param) of every parameter marked tensor-parallel (Megatron or AutoTP)."""
    return [(n, p) for m in modules for n, p in m.named_parameters() if getattr(p, "tensor_model_parallel", False)]

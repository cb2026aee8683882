"""ds_config ``"type"`` names -> :class:`~canzona_ds.optim.optimizer.CanzonaOptimizer`; engine patches.

:func:`install` (run by ``import canzona_ds`` as soon as ``deepspeed`` is imported) wraps
three ``DeepSpeedEngine`` methods on the class; each falls through to the stock code
unless the optimizer is one of ``OPTIMIZER_TYPES`` ("CanzonaMuon", "CanzonaShampoo",
"CanzonaSOAP"):

* ``_is_supported_optimizer``: accept our type names (stock: built-ins and ``torch.optim``);
* ``_configure_basic_optimizer``: build the optimizer from ds_config (:func:`build_optimizer`);
* ``_configure_zero_optimizer``: build :mod:`canzona_ds.integration.zero`'s subclass instead
  of the stock ``DeepSpeedZeroOptimizer`` (engine.py reads that class from a module global,
  so the global is swapped for the duration of this one call).

and ``DeepSpeedConfig._do_sanity_check`` validates our optimizer section as soon as DeepSpeed
has parsed the ds_config, so a bad key or value is a clear error before DeepSpeed's own
checks trip over it (e.g. ``params`` given as a list).

``CanzonaOptimizer`` is added to ZeRO's exact-type list of supported optimizers.
"""
from __future__ import annotations

import json

import torch

from ..optim import OPTIMIZER_TYPES
from ..optim.config import CanzonaConfig
from ..optim.optimizer import MATRIX, CanzonaOptimizer
from .pinned import check_deepspeed

DS_CONFIG_TP_KEY = "canzona_tp"

_installed = False


# ---------------------------------------------------------------------------- config checks
def check_engine_config(engine, cfg: CanzonaConfig) -> None:
    """Refuse ds_config settings the Canzona optimizers do not support, naming the setting."""
    stage = engine.zero_optimization_stage()
    name = engine.optimizer_name()
    if stage not in (0, 1, 2):
        raise ValueError(f"{name} supports zero_optimization.stage 0, 1 or 2; got stage={stage}. ZeRO-3 partitions "
                         "every parameter across ranks, which whole-matrix updates cannot use.")
    if stage == 0 and (engine.bfloat16_enabled() or engine.fp16_enabled()):
        kind = "bf16" if engine.bfloat16_enabled() else "fp16"
        raise ValueError(f"{name} with {kind}.enabled=true needs zero_optimization.stage 1 or 2 (at stage 0 DeepSpeed "
                         f"wraps the optimizer in its {kind.upper()} optimizer, which flattens the matrices).")
    if stage and engine.zero_round_robin_gradients():
        raise ValueError(f"{name} does not support zero_optimization.round_robin_gradients=true (it reorders "
                         "parameters, breaking the ownership plan). Set it to false.")
    if stage and engine.zero_use_cpu_optimizer() and not engine.zero_cpu_offload():
        device = engine.zero_offload_optimizer().device
        raise ValueError(f"{name} does not support zero_optimization.offload_optimizer.device="
                         f"{str(getattr(device, 'value', device))!r}. Allowed: 'cpu', 'none' (NVMe offload of "
                         "per-matrix optimizer state is not implemented).")
    if getattr(engine, "zenflow", False):
        raise ValueError(f"{name} does not support zero_optimization.zenflow.")
    if engine.has_moe_layers:
        raise ValueError(f"{name} does not support MoE layers yet.")


#: lr settings of schedulers that are absolute values (a scalar means "every param group");
#: with a Canzona optimizer they are the matrix lr, and the AdamW group gets them times
#: adam_lr / lr, so the ds_config's lr split survives the schedule.  Schedulers not listed
#: scale each group's own lr (WarmupCosineLR, torch's LambdaLR, StepLR, ...) and keep it anyway.
SCHEDULER_LR_KEYS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr",),
    "OneCycleLR": ("max_lr",),
    "CyclicLR": ("base_lr", "max_lr"),
}


def group_lr_ratios(optimizer: CanzonaOptimizer) -> list[float]:
    """Per param group, its lr relative to the matrix lr (1 for the matrix group)."""
    return [1.0 if g["canzona_role"] == MATRIX else optimizer.config.adam_lr_ratio for g in optimizer.param_groups]


def scale_scheduler_params(name: str, params: dict, optimizer: CanzonaOptimizer) -> dict:
    """Scheduler params with every absolute lr setting made per group (see SCHEDULER_LR_KEYS)."""
    params = dict(params)
    ratios = group_lr_ratios(optimizer)
    for key in SCHEDULER_LR_KEYS.get(name, ()):
        value = params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            params[key] = [value * r for r in ratios]
    return params


def elastic_needed(engine, load_dir, tag) -> bool:
    """True when ``engine`` runs a Canzona optimizer under ZeRO and the checkpoint was written at
    another DP or TP size, or with another plan (reads one optimizer file's layout record)."""
    import os

    from .elastic import OPTIM_FILE, ElasticError, _load, checkpoint_size
    from .runtime_info import canzona_optimizer
    from .zero import LAYOUT_KEY

    opt = canzona_optimizer(engine)
    if opt is None or getattr(engine.optimizer, "canzona_layout", None) is None:
        return False
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return False
        with open(latest) as f:
            tag = f.read().strip()
    if not os.path.isdir(os.path.join(load_dir, tag)):
        return False
    try:
        sizes = checkpoint_size(load_dir, tag)
    except ElasticError:
        return False
    if sizes != (_dp_world_size(engine), opt.tp_size):
        return True
    first = sorted(f for f in os.listdir(os.path.join(load_dir, tag)) if OPTIM_FILE.search(f))[0]
    saved = _load(os.path.join(load_dir, tag, first), mmap=True)  # the layout record only, no tensor data
    meta = saved["optimizer_state_dict"].get(LAYOUT_KEY) or {}
    return meta.get("fingerprint") != engine.optimizer.canzona_layout_meta()["fingerprint"]


def _dp_world_size(engine) -> int:
    from deepspeed import comm as dist

    return dist.get_world_size(group=engine.seq_data_parallel_group)


def _named_parameters(engine, model_parameters) -> list:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    params = []
    if model_parameters is None:
        model_parameters = engine.module.parameters()
    items = list(model_parameters) if not isinstance(model_parameters, torch.Tensor) else [model_parameters]
    for item in items:
        if isinstance(item, dict):
            extra = sorted(set(item) - {"params"})
            if extra:
                raise ValueError(f"{engine.optimizer_name()} does not take per-group settings (got keys {extra} in a "
                                 "model_parameters group). Pass plain parameters and set hyper-parameters in "
                                 "ds_config optimizer.params.")
            params.extend(item["params"])
        elif isinstance(item, torch.Tensor):
            params.append(item)
        else:
            raise TypeError(f"model_parameters must be parameters or param-group dicts, got {type(item).__name__}.")
    missing = [p for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"{len(missing)} of model_parameters are not parameters of the model given to "
                         f"deepspeed.initialize; {engine.optimizer_name()} needs their names.")
    zero_init = [names[id(p)] for p in params if hasattr(p, "ds_id") or hasattr(p, "ds_status")]
    if zero_init:
        raise ValueError(f"{engine.optimizer_name()} cannot use parameters built under deepspeed.zero.Init (e.g. "
                         f"{zero_init[0]!r} is partitioned, ZeRO-3 style, with shape {tuple(params[0].shape)}): build "
                         "the model without zero.Init for ZeRO stage 0/1/2.")
    return [(names[id(p)], p) for p in params]


def _tp_groups(engine, named, cfg: CanzonaConfig):
    """(tp_group, tp_size) from the engine's mpu (Megatron's, or DeepSpeed's AutoTP groups)."""
    mpu = getattr(engine, "mpu", None)
    if mpu is not None:
        from .megatron import groups_from_mpu

        groups = groups_from_mpu(mpu)
        if groups.tp_size > 1:
            return groups.tp_group, groups.tp_size
        return None, 1  # a TP group of one: the tagged parameters are whole
    tagged = [n for n, p in named if getattr(p, "tensor_model_parallel", False)
              and (hasattr(p, "partition_dim") or getattr(p, "ds_autotp_universal_checkpoint_meta", None))]
    if tagged:
        # without the TP group every rank would update its own shard: an approximation
        raise ValueError(
            f"{len(tagged)} parameters are marked tensor_model_parallel (e.g. {tagged[0]!r}) but "
            f"{engine.optimizer_name()} found no TP group: deepspeed.initialize got no mpu. Pass mpu=<Megatron "
            "parallel_state> to deepspeed.initialize (or use tensor_parallel.autotp_size).")
    return None, 1


def run_settings(engine, cfg: CanzonaConfig, named: list) -> dict:
    """What must be equal on every rank: the resolved optimizer config, the ZeRO and precision
    settings, the parallel sizes and the model's parameters (flat keys for clear messages)."""
    import hashlib

    model_dtype, grad_accum_dtype = engine.get_data_types()
    out = {"optimizer.type": engine.optimizer_name()}
    for section, values in cfg.describe().items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    out.update({"zero_optimization.stage": engine.zero_optimization_stage(), "model dtype": str(model_dtype),
                "gradient accumulation dtype": str(grad_accum_dtype),
                "offload_optimizer": engine.zero_use_cpu_optimizer(), "gradient_clipping": engine.gradient_clipping(),
                "gradient_accumulation_steps": engine.gradient_accumulation_steps()})
    shapes = json.dumps([(n, list(p.shape)) for n, p in named])
    out["model parameters (sha256 of names and shapes)"] = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    return out


def build_optimizer(engine, model_parameters) -> CanzonaOptimizer:
    """ds_config ``"type": "Canzona*"`` -> a :class:`CanzonaOptimizer` over the engine's module."""
    from .agreement import check_agreement

    ds = engine._config._param_dict
    cfg = CanzonaConfig.from_ds(engine.optimizer_name(), engine.optimizer_params(), ds.get(DS_CONFIG_TP_KEY))
    named = _named_parameters(engine, model_parameters)
    # before anything a rank could wait in: ranks with different settings meet here and fail
    check_agreement(run_settings(engine, cfg, named))
    check_engine_config(engine, cfg)
    tp_group, tp_size = _tp_groups(engine, named, cfg)
    if cfg.per_head_muon:
        from .heads import tag_heads

        tag_heads(engine.module, named, tp_size)
    stage = engine.zero_optimization_stage()
    dp = _dp_world_size(engine) if stage in (1, 2) else 1
    return CanzonaOptimizer(named, cfg, dp_world_size=dp, zero=stage in (1, 2), tp_group=tp_group, tp_size=tp_size)


# ---------------------------------------------------------------------------- install
def install() -> None:
    """Teach DeepSpeed's engine the Canzona optimizer types (idempotent)."""
    global _installed
    if _installed:
        return
    check_deepspeed()
    import deepspeed.runtime.engine as engine_mod
    from deepspeed.runtime.zero import utils as zero_utils

    from .zero import zero_optimizer_class

    from deepspeed.runtime.config import DeepSpeedConfig

    stock_sanity = DeepSpeedConfig._do_sanity_check

    def _do_sanity_check(self):
        if self.optimizer_name in OPTIMIZER_TYPES:
            CanzonaConfig.from_ds(self.optimizer_name, self.optimizer_params, self._param_dict.get(DS_CONFIG_TP_KEY))
        return stock_sanity(self)

    DeepSpeedConfig._do_sanity_check = _do_sanity_check
    Engine = engine_mod.DeepSpeedEngine
    stock_is_supported = Engine._is_supported_optimizer
    stock_basic = Engine._configure_basic_optimizer
    stock_zero = Engine._configure_zero_optimizer

    def _is_supported_optimizer(self, optimizer_name):
        return optimizer_name in OPTIMIZER_TYPES or stock_is_supported(self, optimizer_name)

    def _configure_basic_optimizer(self, model_parameters):
        if self.optimizer_name() in OPTIMIZER_TYPES:
            return build_optimizer(self, model_parameters)
        return stock_basic(self, model_parameters)

    def _configure_zero_optimizer(self, optimizer):
        if not isinstance(optimizer, CanzonaOptimizer):
            return stock_zero(self, optimizer)
        check_engine_config(self, optimizer.config)
        if optimizer.plan is None:  # no matrices: plain AdamW, stock ZeRO
            return stock_zero(self, optimizer)
        stock_cls = engine_mod.DeepSpeedZeroOptimizer
        engine_mod.DeepSpeedZeroOptimizer = zero_optimizer_class()
        try:
            return stock_zero(self, optimizer)
        finally:
            engine_mod.DeepSpeedZeroOptimizer = stock_cls

    stock_bf16 = Engine._configure_bf16_optimizer

    def _configure_bf16_optimizer(self, optimizer):
        # DeepSpeed sends bf16 + grad_accum_dtype fp32 at stage 1 to BF16_Optimizer, which
        # flattens and re-partitions the parameters blind to matrices.  ZeRO-1 supports fp32
        # gradient accumulation itself (a per-parameter fp32 accumulator), so route it there, and
        # reduce in fp32 as BF16_Optimizer does unless communication_data_type is set.
        if isinstance(optimizer, CanzonaOptimizer):
            if self._config.communication_data_type is None:
                self.communication_data_type = torch.float32
            return self._configure_zero_optimizer(optimizer)
        return stock_bf16(self, optimizer)

    stock_scheduler = Engine._scheduler_from_config

    def _scheduler_from_config(self, optimizer):
        basic = getattr(self, "basic_optimizer", None)
        name = self.scheduler_name()
        if not isinstance(basic, CanzonaOptimizer) or name not in SCHEDULER_LR_KEYS:
            return stock_scheduler(self, optimizer)
        saved = self._config.scheduler_params
        self._config.scheduler_params = scale_scheduler_params(name, saved or {}, basic)
        try:
            return stock_scheduler(self, optimizer)
        finally:
            self._config.scheduler_params = saved

    stock_load = Engine.load_checkpoint

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        # a Canzona checkpoint written at another DP/TP size (or with another plan) resumes
        # through integration/elastic.py; everything else is DeepSpeed's own load
        if (load_optimizer_states and not load_module_only and custom_load_fn is None
                and elastic_needed(self, load_dir, tag)):
            from . import elastic

            return elastic.load(self, load_dir, tag)
        return stock_load(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                          load_module_only, custom_load_fn)

    Engine.load_checkpoint = load_checkpoint
    Engine._configure_bf16_optimizer = _configure_bf16_optimizer
    Engine._scheduler_from_config = _scheduler_from_config
    Engine._is_supported_optimizer = _is_supported_optimizer
    Engine._configure_basic_optimizer = _configure_basic_optimizer
    Engine._configure_zero_optimizer = _configure_zero_optimizer
    if CanzonaOptimizer not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CanzonaOptimizer)
    _installed = True

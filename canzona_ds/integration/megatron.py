"""Megatron-DeepSpeed and DeepSpeed-AutoTP glue for the TP runtime (canzona_ds.tp).

1. Groups come from ``integration/groups.py`` (``groups_from_mpu`` for a Megatron
   ``parallel_state`` / Megatron-DeepSpeed ``mpu``, ``groups_from_deepspeed`` for AutoTP),
   re-exported here.

2. ZeRO stage 0 client optimizer.  :func:`build_tp_optimizer` turns a model (Megatron-
   marked or AutoTP parameters) and a ds_config into a :class:`CanzonaOptimizer` whose
   TP-split matrices go through the micro-group runtime and whose other parameters are
   updated locally (every DP rank steps everything: ZeRO stage 0).  With DeepSpeed MoE layers
   it first creates DeepSpeed's expert groups as the engine would (``moe.create_expert_groups``,
   with the mpu given), which ``deepspeed.initialize`` then reuses::

       "optimizer": {"type": "CanzonaMuon" | "CanzonaShampoo" | "CanzonaSOAP", "params": {...}},
       "canzona_tp": {"scheduler": "lpt_rollback", "c_max": null, "pipelined": true, "cost": "numel"}

3. The Megatron-DeepSpeed hook.  Megatron-DeepSpeed builds its own optimizer
   (``megatron/training.py: setup_model_and_optimizer -> get_megatron_optimizer``), builds
   its ``OptimizerParamScheduler`` against it and passes both to ``deepspeed.initialize``
   as client optimizer / client lr scheduler, so ds_config's optimizer section is never
   read.  :func:`patch_megatron_training` replaces
   ``megatron.training.get_megatron_optimizer`` (any other optimizer type runs the
   original) and wraps ``deepspeed.initialize``:

   * ``zero_optimization.stage`` 0 (fp32 only): the client optimizer is the stage-0
     CanzonaOptimizer of item 2;
   * stage 1/2 (fp32/bf16/fp16): ``get_megatron_optimizer`` returns a
     :class:`DeferredCanzona` placeholder, which Megatron builds its scheduler against.
     The wrapped ``deepspeed.initialize`` recognises the placeholder and calls the real one
     with ``optimizer=None`` (DeepSpeed builds the optimizer from ds_config: ZeRO x TP),
     the mpu, and the Megatron scheduler as a *callable* client scheduler re-targeted at
     the DeepSpeed-built optimizer (:class:`MegatronSchedulerTarget`: matrix group
     ``lr_mult`` 1, AdamW group ``adam_lr / lr``).  Every other call passes through.

   The patched ``get_megatron_optimizer`` also runs Megatron's ``get_param_groups`` (its
   ``no_weight_decay_cond`` / ``scale_lr_cond`` / ``lr_mult``) and marks every parameter with its
   group's multipliers (:func:`tag_megatron_param_groups`): biases and norms get no weight decay,
   as with Megatron's own optimizer.  After ``deepspeed.initialize`` rank 0 prints one line naming
   the Canzona type, its lrs, ZeRO stage, DP/TP/PP sizes and the plans' balance (the builder's one
   start-up line, ``integration/builder.py`` :func:`startup_line`).

   It also wraps ``megatron.training.training_log``: at every ``--log-interval`` iteration the
   optimizer's step metrics (``optimizer.metrics()``, docs/optimizers.md "Step metrics") go to
   Megatron's TensorBoard writer as ``canzona/<name>`` at the iteration, where it has one
   (``--tensorboard-dir``), and into one log line after Megatron's, ``canzona optimizer step
   <iteration> | <name>: <value> | ...``, both from Megatron's last rank (its own logging rank).

   ``launch/megatron_pretrain_gpt.py`` applies the patch before running pretrain_gpt.py.

4. ZeRO x TP without Megatron's training loop: pass *no* client optimizer and give
   DeepSpeed the mpu, ``deepspeed.initialize(model=..., model_parameters=...,
   config=ds_config, mpu=mpu)``, ZeRO stage 1 or 2 (docs/tp.md, tests/test_zero_tp.py).
"""
from __future__ import annotations

import json
from collections.abc import MutableMapping
import sys
from typing import Any, Callable, Mapping, Sequence

from ..optim import OPTIMIZER_TYPES
from ..config import CanzonaConfig
from ..optimizer import MATRIX, CanzonaOptimizer
from .groups import groups_from_deepspeed, groups_from_mpu
from .metrics import metrics_config
from .registry import DS_CONFIG_TP_KEY

__all__ = ["DeferredCanzona", "MegatronSchedulerTarget", "build_tp_optimizer", "config_from_ds_config",
           "groups_from_deepspeed", "groups_from_mpu", "patch_megatron_training",
           "tag_megatron_param_groups", "tag_megatron_tp_blocks"]


def config_from_ds_config(ds_config: Mapping[str, Any]) -> CanzonaConfig:
    """The CanzonaConfig of a ds_config whose optimizer type is a Canzona type."""
    opt = ds_config.get("optimizer") or {}
    if opt.get("type") not in OPTIMIZER_TYPES:
        raise ValueError(f"ds_config optimizer type={opt.get('type')!r}; the TP hook needs one of "
                         f"{sorted(OPTIMIZER_TYPES)}")
    return CanzonaConfig.from_ds(opt["type"], opt.get("params"), ds_config.get(DS_CONFIG_TP_KEY))


def _zero_stage(ds_config: Mapping[str, Any]) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def build_tp_optimizer(model, ds_config: Mapping[str, Any], mpu=None) -> CanzonaOptimizer:
    """ZeRO stage 0 CanzonaOptimizer over ``model`` (a module or a list of Megatron model
    chunks): TP-split matrices hosted by the micro-group runtime, everything else local."""
    if _zero_stage(ds_config) != 0:
        raise ValueError(
            f"zero_optimization.stage={_zero_stage(ds_config)}: a client optimizer needs stage 0 (DeepSpeed re-flattens "
            "a client optimizer under ZeRO). For ZeRO x TP use stage 1/2 through patch_megatron_training "
            "(Megatron-DeepSpeed) or call deepspeed.initialize(model=..., model_parameters=..., config=ds_config, "
            "mpu=mpu) with no client optimizer (docs/tp.md)")
    for key in ("bf16", "fp16"):
        if (ds_config.get(key) or {}).get("enabled", False):
            raise ValueError(
                f"{key}.enabled=true: DeepSpeed wraps a client optimizer in its {key.upper()} optimizer, which "
                "flattens the parameters and loses the TP shards; the stage-0 TP optimizer runs fp32. For bf16/fp16 "
                "use ZeRO x TP: no client optimizer, deepspeed.initialize(..., mpu=mpu) with zero_optimization.stage "
                "1 or 2 (docs/tp.md)")
    from .builder import RunSettings, build_optimizer

    cfg = config_from_ds_config(ds_config)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    named: list = []
    modules = []
    for k, chunk in enumerate(chunks):
        prefix = f"chunk{k}." if len(chunks) > 1 else ""
        chunk_named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        named += [(prefix + n, p) for n, p in chunk_named]
        modules.append((chunk, chunk_named))
    from .moe import create_expert_groups, expert_partitions

    if expert_partitions(named):
        # DeepSpeed MoE: the expert groups the engine would create in deepspeed.initialize, created
        # now (with this mpu), so the experts are planned over them and the engine reuses them
        create_expert_groups(chunks, ds_config, mpu)
    groups = groups_from_mpu(mpu) if mpu is not None else groups_from_deepspeed()
    # the same builder as the ds_config path: settings agreement, config checks, head tagging
    opt = build_optimizer(named, cfg, groups, RunSettings.from_ds_config(ds_config), modules=modules)
    opt.set_metrics(metrics_config(ds_config))  # (the engine reads the section only for the optimizers it builds)
    # Megatron's OptimizerParamScheduler sets lr = schedule_lr * lr_mult for every group:
    # with --lr = the matrix lr, the AdamW group keeps its ratio
    for g in opt.param_groups:
        g["lr_mult"] = _lr_mult(g, cfg.adam_lr_ratio)
    return opt


def _lr_mult(group: Mapping[str, Any], adam_lr_ratio: float) -> float:
    """Megatron's ``lr_mult`` of a Canzona param group: 1 (matrix) or ``adam_lr / lr`` (AdamW), times
    the group's own multiplier (Megatron's ``scale_lr_cond`` / ``lr_mult``: ``param_lr_mult``)."""
    return (1.0 if group.get("canzona_role") == MATRIX else adam_lr_ratio) * group.get("param_lr_mult", 1.0)


#: Megatron-DeepSpeed's universal-checkpoint key for a parameter whose TP shard is 2 sub-parameters
#: concatenated along dim 0 (SwiGLU's ``dense_h_to_4h``: ``[gate_r; up_r]``); deepspeed.checkpoint.constants
SUB_PARAMS_2_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"


def tag_megatron_tp_blocks(chunks: Sequence, args) -> dict[str, tuple[int, ...]]:
    """Give Megatron-DeepSpeed's fused TP parameters their TP=1 blocks (``canzona_tp_blocks``,
    canzona_ds/tp/layout.py), so that the checkpoint index's shard frames describe them and a
    resume at another TP size regroups them (docs/checkpoints.md, "Tensor-parallel layouts"):

    * what the model records in its universal-checkpoint info (``universal_checkpoint_info()``,
      ``parameter_with_2_sub_params_cat_dim_0``: ``--swiglu``'s ``dense_h_to_4h`` weight and bias,
      ``[gate_r; up_r]`` on TP rank r): two equal blocks;
    * the fused ``self_attention.query_key_value`` weight and bias, which that info does not record:
      Megatron-DeepSpeed's ``ParallelAttention.forward`` cuts its output into ``[Q_r; K_r; V_r]``
      (``num_attention_heads`` and twice ``num_key_value_heads`` heads of ``kv_channels``): blocks
      ``(Q, K, V)`` of the TP=1 ``[Q; K; V]``.  A size that does not add up is a ``ValueError``.

    Returns name -> blocks of what it tagged."""
    import re

    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    out: dict[str, tuple[int, ...]] = {}
    if tp <= 1:
        return out
    for chunk in chunks:
        info_of = getattr(chunk, "universal_checkpoint_info", None)
        info = info_of() if callable(info_of) else {}
        two = [re.compile(p) for p in (info or {}).get(SUB_PARAMS_2_DIM_0, [])]
        for name, p in chunk.named_parameters():
            if not getattr(p, "tensor_model_parallel", False) or int(getattr(p, "partition_dim", -1)) != 0:
                continue
            full = p.shape[0] * tp
            if any(r.fullmatch(name) or r.match(name) for r in two):
                if full % 2:
                    raise ValueError(f"{name!r}: {full} rows cannot be [gate; up] halves")
                blocks: tuple[int, ...] = (full // 2, full // 2)
            elif name.endswith(("query_key_value.weight", "query_key_value.bias")):
                hn = int(args.kv_channels)
                q, kv = int(args.num_attention_heads) * hn, int(args.num_key_value_heads or args.num_attention_heads) * hn
                if q + 2 * kv != full:
                    raise ValueError(f"{name!r}: {full} rows at TP=1 are not Q + K + V = {q} + {kv} + {kv} "
                                     "(num_attention_heads, num_key_value_heads, kv_channels)")
                blocks = (q, kv, kv)
            else:
                continue
            p.canzona_tp_blocks = blocks
            out[name] = blocks
    return out


def tag_megatron_param_groups(groups: Sequence[Mapping[str, Any]]) -> None:
    """Mark every parameter of Megatron's ``get_param_groups`` result with its group's ``wd_mult``
    and ``lr_mult`` (``canzona_wd_mult`` / ``canzona_lr_mult``), which CanzonaOptimizer groups by:
    Megatron's ``no_weight_decay_cond`` (default: biases and 1-D parameters, i.e. norms, get no
    weight decay), ``scale_lr_cond`` and ``lr_mult`` hold as with Megatron's own optimizer."""
    for g in groups:
        for p in g["params"]:
            p.canzona_wd_mult = float(g.get("wd_mult", 1.0))
            p.canzona_lr_mult = float(g.get("lr_mult", 1.0))


def _load_ds_config(args) -> dict:
    cfg = getattr(args, "deepspeed_config_dict", None)
    if cfg:
        return dict(cfg)
    path = getattr(args, "deepspeed_config", None)
    if not path:
        raise ValueError("Megatron args carry no deepspeed_config / deepspeed_config_dict")
    with open(path) as f:
        return json.load(f)


class DeferredCanzona:
    """What the patched ``get_megatron_optimizer`` returns at ZeRO stage 1/2: a placeholder.

    Megatron builds its ``OptimizerParamScheduler`` against it (the scheduler writes
    ``lr``/``weight_decay`` into ``param_groups``, harmless here) and hands both to
    ``deepspeed.initialize``, whose patched wrapper replaces them (see
    :func:`patch_megatron_training`).  Stepping it is an error: it means the call did not
    go through the wrapped ``deepspeed.initialize``.
    """

    def __init__(self, ds_config: Mapping[str, Any], mpu) -> None:
        self.ds_config = dict(ds_config)
        self.mpu = mpu
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]
        self.state: dict = {}

    def _not_routed(self, *a, **k):
        raise RuntimeError("DeferredCanzona is a placeholder for the ZeRO CanzonaOptimizer that "
                           "deepspeed.initialize builds; this call did not go through the deepspeed.initialize "
                           "wrapped by canzona_ds.integration.megatron.patch_megatron_training")

    step = zero_grad = state_dict = load_state_dict = _not_routed


class _GroupView(MutableMapping):
    """A param group as Megatron's scheduler sees it: ``lr_mult`` supplied here, writes go
    to the real group."""

    def __init__(self, group: dict, lr_mult: float) -> None:
        self._g, self._extra = group, {"lr_mult": lr_mult}

    def __getitem__(self, k):
        return self._extra[k] if k in self._extra else self._g[k]

    def __setitem__(self, k, v):
        self._g[k] = v

    def __delitem__(self, k):
        del self._g[k]

    def __iter__(self):
        return iter({**self._g, **self._extra})

    def __len__(self):
        return len({**self._g, **self._extra})


class MegatronSchedulerTarget:
    """``param_groups`` of a DeepSpeed-built :class:`CanzonaOptimizer` for Megatron's scheduler.

    Megatron's ``OptimizerParamScheduler.step`` sets ``group['lr'] = lr * group.get('lr_mult', 1)``
    and ``group['weight_decay'] = wd * group.get('wd_mult', 1)`` for every group.  Here the
    matrix group has ``lr_mult`` 1 (Megatron ``--lr`` is the matrix lr) and the AdamW group
    ``adam_lr / lr`` (ds_config ``optimizer.params``).  Both groups' ``lr`` and
    ``weight_decay`` are read at every step, by the local update and the TP runtime alike.

    ``param_groups`` are views over the optimizer's groups *as they are now*: DeepSpeed's load
    (torch's ``Optimizer.load_state_dict``) replaces the group dicts, and a view kept from build
    time would take the scheduler's writes to dicts nothing reads any more.
    """

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[_GroupView]:
        """Views of the optimizer's live groups, read at every access: DeepSpeed's load replaces
        the group dicts, and a view taken at build time would write to the dead ones."""
        ratio = self.optimizer.config.adam_lr_ratio
        return [_GroupView(g, _lr_mult(g, ratio)) for g in self.optimizer.param_groups]


def _retarget_scheduler(scheduler) -> Callable:
    """A DeepSpeed client-scheduler callable: point Megatron's scheduler at the optimizer
    DeepSpeed built (``engine.basic_optimizer``, the CanzonaOptimizer ZeRO wraps) and apply
    its current lr/wd."""

    def build(basic_optimizer):
        if not hasattr(scheduler, "optimizer") or not hasattr(scheduler, "step"):
            raise TypeError(f"expected Megatron's OptimizerParamScheduler (.optimizer, .step), got "
                            f"{type(scheduler).__name__}")
        scheduler.optimizer = MegatronSchedulerTarget(basic_optimizer)
        scheduler.step(increment=0)
        return scheduler

    return build


def _wrap_deepspeed_initialize(deepspeed_module) -> None:
    original = deepspeed_module.initialize
    if getattr(original, "_canzona_patched", False):
        return

    def initialize(*args, **kwargs):
        placeholder = kwargs.get("optimizer")
        if not isinstance(placeholder, DeferredCanzona):
            return original(*args, **kwargs)
        if args:
            raise TypeError("patched deepspeed.initialize: pass arguments by keyword (as Megatron-DeepSpeed does)")
        if kwargs.get("mpu") is None and not _is_pipeline_module(kwargs.get("model")):
            raise ValueError(
                "Canzona ZeRO x TP through Megatron-DeepSpeed needs the process groups: pass mpu= to "
                "deepspeed.initialize (Megatron-DeepSpeed does with --no-pipeline-parallel) or a PipelineModule "
                "(with pipeline parallelism DeepSpeed takes its grid)")
        from . import install

        install()
        kwargs["optimizer"] = None
        scheduler = kwargs.get("lr_scheduler")
        if scheduler is not None:
            kwargs["lr_scheduler"] = _retarget_scheduler(scheduler)
        return original(**kwargs)  # (DeepSpeed builds the optimizer through the builder: its start-up line)

    initialize._canzona_patched = True
    initialize._canzona_original = original
    deepspeed_module.initialize = initialize


def metrics_log_line(iteration: int, metrics) -> str:
    """The step metrics' line after Megatron's own at ``--log-interval``."""
    return f" canzona optimizer step {iteration} | " + " | ".join(
        f"{name}: {value:.6g}" for name, value in metrics.scalars().items()) + " |"


def _wrap_training_log(training_module, get_args: Callable) -> None:
    """After Megatron's ``training_log``, at ``--log-interval``: the step metrics of the optimizer
    the engine (``model[0]``) steps, to Megatron's TensorBoard writer and log line (last rank)."""
    original = getattr(training_module, "training_log", None)
    if original is None or getattr(original, "_canzona_patched", False):
        return
    import torch.distributed as dist

    from .runtime_info import canzona_optimizer

    def training_log(*args, **kwargs):
        out = original(*args, **kwargs)
        # (Megatron's signature: loss_dict, total_loss_dict, learning_rate, iteration, ..., model, optimizer)
        iteration = kwargs.get("iteration", args[3] if len(args) > 3 else None)
        model = kwargs.get("model", args[10] if len(args) > 10 else None)
        engine = model[0] if isinstance(model, (list, tuple)) and model else model
        opt = canzona_optimizer(engine)
        interval = getattr(get_args(), "log_interval", 1) or 1
        metrics = opt.metrics() if opt is not None and iteration is not None and iteration % interval == 0 else None
        # the last rank only, as Megatron's print_rank_last (its training module's own is_last_rank;
        # every process prints where no process group is up)
        is_last = getattr(training_module, "is_last_rank", None)
        if metrics is None or (is_last is not None and dist.is_initialized() and not is_last()):
            return out
        get_writer = getattr(training_module, "get_tensorboard_writer", None)
        writer = get_writer() if get_writer is not None else None
        if writer is not None:
            for name, value in metrics.scalars().items():
                writer.add_scalar(f"canzona/{name}", value, iteration)
        print(metrics_log_line(iteration, metrics), flush=True)
        return out

    training_log._canzona_patched = True
    training_module.training_log = training_log


def _is_pipeline_module(model) -> bool:
    """Megatron-DeepSpeed with pipeline parallelism passes its PipelineModule and no mpu:
    DeepSpeed then takes the module's grid (data, pipe and slice = tensor groups)."""
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PipelineModule)


def patch_megatron_training(training_module=None, get_args: Callable | None = None, mpu=None,
                            deepspeed_module=None) -> Callable:
    """Route Megatron-DeepSpeed's ``setup_model_and_optimizer`` to the Canzona optimizer of the ds_config.

    Stage 0: ``get_megatron_optimizer`` returns the stage-0 CanzonaOptimizer.  Stage 1/2: it
    returns a :class:`DeferredCanzona`, and the wrapped ``deepspeed.initialize`` builds the
    optimizer (ZeRO x TP) with no client optimizer and re-targets Megatron's scheduler.
    Defaults are the real modules (``megatron.training``, ``megatron.get_args``,
    ``megatron.core.mpu``, the ``deepspeed`` that ``megatron.training`` imported); tests
    pass stand-ins.  Returns the original ``get_megatron_optimizer``.  Idempotent.
    """
    if training_module is None:
        import megatron.training as training_module  # type: ignore[no-redef]
    if get_args is None:
        from megatron import get_args  # type: ignore[no-redef]
    if mpu is None:
        from megatron.core import mpu  # type: ignore[no-redef]
    if deepspeed_module is None:
        deepspeed_module = getattr(training_module, "deepspeed", None)
        if deepspeed_module is None:
            import deepspeed as deepspeed_module  # type: ignore[no-redef]
    _wrap_deepspeed_initialize(deepspeed_module)
    _wrap_training_log(training_module, get_args)
    original = training_module.get_megatron_optimizer
    if getattr(original, "_canzona_patched", False):
        return original._canzona_original

    def get_megatron_optimizer(model, no_weight_decay_cond=None, scale_lr_cond=None, lr_mult=1.0):
        ds_config = _load_ds_config(get_args())
        if (ds_config.get("optimizer") or {}).get("type") not in OPTIMIZER_TYPES:
            return original(model, no_weight_decay_cond, scale_lr_cond, lr_mult)
        # Megatron's own param-group rule (megatron/optimizer/__init__.py: get_param_groups), where
        # the module that defined get_megatron_optimizer has it
        param_groups = getattr(sys.modules.get(getattr(original, "__module__", ""), None), "get_param_groups", None)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if param_groups is not None:
            tag_megatron_param_groups(param_groups(chunks, no_weight_decay_cond, scale_lr_cond, lr_mult))
        if hasattr(get_args(), "kv_channels"):  # Megatron's args (a stand-in's may lack them)
            tag_megatron_tp_blocks(chunks, get_args())
        if _zero_stage(ds_config) in (1, 2):
            config_from_ds_config(ds_config)  # fail early on bad keys
            return DeferredCanzona(ds_config, mpu)
        return build_tp_optimizer(model, ds_config, mpu=mpu)

    get_megatron_optimizer._canzona_patched = True
    get_megatron_optimizer._canzona_original = original
    training_module.get_megatron_optimizer = get_megatron_optimizer
    return original

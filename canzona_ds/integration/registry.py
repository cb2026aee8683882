"""ds_config ``"type"`` names -> :class:`~canzona_ds.optimizer.CanzonaOptimizer`; engine patches.

:func:`install` (run by ``import canzona_ds`` as soon as ``deepspeed`` is imported) wraps
``DeepSpeedEngine`` methods on the class; each falls through to the stock code unless the
optimizer is one of ``OPTIMIZER_TYPES`` ("CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"):

* ``_is_supported_optimizer``: accept our type names (stock: built-ins and ``torch.optim``);
* ``_configure_basic_optimizer``: build the optimizer from ds_config (:func:`build_optimizer`);
* ``_configure_zero_optimizer``: build :mod:`canzona_ds.integration.zero`'s subclass instead
  of the stock ``DeepSpeedZeroOptimizer`` (engine.py reads that class from a module global,
  so the global is swapped for the duration of this one call);
* ``_configure_bf16_optimizer``, ``_scheduler_from_config``: keep matrices whole under bf16
  ZeRO-1, the ds_config's lr split under absolute-lr schedulers;
* ``save_checkpoint``: a sha256 manifest beside DeepSpeed's files, then ``latest``;
  ``load_checkpoint``: the manifest verified first (a bad file is a CheckpointError naming
  it, or the newest intact tag with ``canzona_checkpoint.fallback``), then one comparison: the
  same layout -> DeepSpeed's own load, anything else -> the checkpoint index's loop
  (integration/ckpt/hooks.py, integration/ckpt/);

``_take_model_step`` at ZeRO stage 0 in fp32 skips and reports a step with a non-finite
gradient, as DeepSpeed's ZeRO 1-3 do (integration/stage0.py); and
``DeepSpeedConfig._do_sanity_check`` validates our sections as soon as DeepSpeed
has parsed the ds_config, so a bad key or value is a clear error before DeepSpeed's own
checks trip over it (e.g. ``params`` given as a list).

``_take_model_step`` also closes the optimizer's step metrics at the step's end and sends them
to the ds_config's monitors (integration/metrics.py); the ``canzona_metrics`` section is checked
with the others.

``CanzonaOptimizer`` is added to ZeRO's exact-type list of supported optimizers.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..optim import OPTIMIZER_TYPES
from ..config import CanzonaConfig, CheckpointConfig
from ..optimizer import MATRIX, CanzonaOptimizer
from .ds_compat import check_deepspeed
from .metrics import metrics_config

DS_CONFIG_TP_KEY = "canzona_tp"

_installed = False


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
    """Per param group, its lr relative to the matrix lr (1 for the matrix group, ``adam_lr / lr`` for
    AdamW), times the group's own multiplier where it has one (``param_lr_mult``, optimizer.py)."""
    return [(1.0 if g["canzona_role"] == MATRIX else optimizer.config.adam_lr_ratio) * g.get("param_lr_mult", 1.0)
            for g in optimizer.param_groups]


def scale_scheduler_params(name: str, params: dict, optimizer: CanzonaOptimizer) -> dict:
    """Scheduler params with every absolute lr setting made per group (see SCHEDULER_LR_KEYS)."""
    params = dict(params)
    ratios = group_lr_ratios(optimizer)
    for key in SCHEDULER_LR_KEYS.get(name, ()):
        value = params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            params[key] = [value * r for r in ratios]
    return params


def _refuse_foreign_optimizer(engine, load_dir, tag) -> None:
    """A Canzona checkpoint (it has a checkpoint index) opened with its optimizer state by an
    engine running another optimizer: DeepSpeed would fail with a misleading layout or
    param-group error; refused by name with the way out instead."""
    from ..ckpt.index import INDEX
    from .ckpt.route import latest_tag

    tag = latest_tag(load_dir) if tag is None else tag
    if tag is None or not os.path.isfile(os.path.join(str(load_dir), str(tag), INDEX)):
        return
    raise ValueError(f"{os.path.join(str(load_dir), str(tag))} was written by a Canzona optimizer; this engine runs "
                     f"{type(engine.optimizer).__name__}, which cannot read its optimizer state. Load the weights only "
                     "(load_module_only=True), or consolidate it with `canzona-ckpt convert "
                     f"{load_dir} OUT --tag {tag}` (OUT/model.safetensors, OUT/optimizer.pt by parameter name).")


def micro_group_section(ds: dict, zero_stage: int):
    """The ds_config's ``canzona_tp`` section (the micro-group runtime); at ZeRO stage 3, where
    the runtime hosts every matrix over the DP group, the load it balances defaults to the
    rule's FLOPs ("cost": "flops") instead of the element count."""
    section = ds.get(DS_CONFIG_TP_KEY)
    if zero_stage != 3 or (section is not None and not isinstance(section, dict)):
        return section
    return {"cost": "flops", **(section or {})}


def _named_parameters(engine, model_parameters) -> list:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    params = []
    if model_parameters is None:
        model_parameters = engine.module.parameters()
    items = list(model_parameters) if not isinstance(model_parameters, torch.Tensor) else [model_parameters]
    for item in items:
        if isinstance(item, dict):
            # DeepSpeed's MoE grouping (split_params_into_different_moe_groups_for_optimizer, which
            # deepspeed.initialize also applies itself to an MoE model's parameters) names groups and
            # marks the expert ones; the expert groups are re-derived from the parameters
            extra = sorted(set(item) - {"params", "name", "moe"})
            if extra:
                raise ValueError(f"{engine.optimizer_name()} does not take per-group settings (got keys {extra} in a "
                                 "model_parameters group). Pass plain parameters (or DeepSpeed's MoE groups, keys "
                                 "'params', 'name', 'moe') and set hyper-parameters in ds_config optimizer.params.")
            if item.get("moe"):
                from .moe import is_expert

                dense = [names.get(id(p), "?") for p in item["params"] if not is_expert(p)]
                if dense:
                    raise ValueError(f"model_parameters group {item.get('name')!r} is marked 'moe' but holds "
                                     f"{len(dense)} non-expert parameters (e.g. {dense[0]!r}).")
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
    if zero_init and engine.zero_optimization_stage() != 3:
        raise ValueError(f"{engine.optimizer_name()} cannot use parameters built under deepspeed.zero.Init (e.g. "
                         f"{zero_init[0]!r} is partitioned, ZeRO-3 style, with shape {tuple(params[0].shape)}): build "
                         "the model without zero.Init for ZeRO stage 0/1/2, or use zero_optimization.stage 3.")
    return [(names[id(p)], p) for p in params]


def build_optimizer(engine, model_parameters) -> CanzonaOptimizer:
    """ds_config ``"type": "Canzona*"`` -> the one builder (integration/builder.py) over the
    engine's module and its groups."""
    from .builder import RunSettings
    from .builder import build_optimizer as build
    from .groups import groups_from_engine

    ds = engine._config._param_dict
    cfg = CanzonaConfig.from_ds(engine.optimizer_name(), engine.optimizer_params(),
                                micro_group_section(ds, int(engine.zero_optimization_stage())))
    named = _named_parameters(engine, model_parameters)
    opt = build(named, cfg, groups_from_engine(engine), RunSettings.from_engine(engine),
                modules=[(engine.module, named)], zero_config=ds.get("zero_optimization") or {})
    opt.set_metrics(metrics_config(ds))
    return opt


# ---------------------------------------------------------------------------- install
_refusal_installed = False


def _install_refusal(message: str) -> None:
    """A DeepSpeed outside the supported range (or lacking an internal): the engine still accepts
    the Canzona type names, so that a ds_config naming one fails with ``message`` (one line) when
    the optimizer is built, instead of DeepSpeed's unknown-optimizer error; nothing else is touched."""
    global _refusal_installed
    try:
        import deepspeed.runtime.engine as engine_mod
    except Exception:  # a DeepSpeed this different: nothing to register with
        return
    Engine = getattr(engine_mod, "DeepSpeedEngine", None)
    if _refusal_installed or Engine is None or not all(hasattr(Engine, m) for m in (
            "_is_supported_optimizer", "_configure_basic_optimizer", "optimizer_name")):
        return
    _refusal_installed = True
    stock_is_supported = Engine._is_supported_optimizer
    stock_basic = Engine._configure_basic_optimizer

    def _is_supported_optimizer(self, optimizer_name):
        return optimizer_name in OPTIMIZER_TYPES or stock_is_supported(self, optimizer_name)

    def _configure_basic_optimizer(self, model_parameters):
        if self.optimizer_name() in OPTIMIZER_TYPES:
            raise RuntimeError(message)
        return stock_basic(self, model_parameters)

    Engine._is_supported_optimizer = _is_supported_optimizer
    Engine._configure_basic_optimizer = _configure_basic_optimizer


def install() -> None:
    """Teach DeepSpeed's engine the Canzona optimizer types (idempotent)."""
    global _installed
    if _installed:
        return
    try:
        check_deepspeed()
    except RuntimeError as err:
        _install_refusal(str(err))
        raise
    import deepspeed.runtime.engine as engine_mod
    from deepspeed.runtime.zero import utils as zero_utils

    from deepspeed.runtime.config import DeepSpeedConfig

    from ..ckpt.tag import engine_hooks_on
    from .ckpt import emit as ckpt_emit
    from .ckpt import hooks as checkpoint_hooks
    from .ckpt import route as ckpt_route
    from . import metrics as step_metrics
    from .runtime_info import canzona_optimizer
    from .zero import zero_optimizer_class

    from .stage0 import install as install_stage0_skip

    install_stage0_skip(engine_mod.DeepSpeedEngine)  # stage 0, fp32: a non-finite step is skipped (stage0.py)
    stock_sanity = DeepSpeedConfig._do_sanity_check

    def _do_sanity_check(self):
        if self.optimizer_name in OPTIMIZER_TYPES:
            CanzonaConfig.from_ds(self.optimizer_name, self.optimizer_params, self._param_dict.get(DS_CONFIG_TP_KEY))
        if ckpt_emit.DS_CONFIG_CHECKPOINT_KEY in self._param_dict:
            CheckpointConfig.from_section(self._param_dict[ckpt_emit.DS_CONFIG_CHECKPOINT_KEY])
        step_metrics.metrics_config(self._param_dict)
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
        from .builder import RunSettings, check_settings

        check_settings(RunSettings.from_engine(self), optimizer.config)
        if self.zero_optimization_stage() == 3:
            import deepspeed.runtime.zero.stage3 as stage3_mod

            from .zero3 import zero3_optimizer_class

            # engine.py imports the class from its module at this call: swap it for this one call
            cls = zero3_optimizer_class()
            stock_cls3 = stage3_mod.DeepSpeedZeroOptimizer_Stage3
            stage3_mod.DeepSpeedZeroOptimizer_Stage3 = cls
            try:
                return stock_zero(self, optimizer)
            finally:
                stage3_mod.DeepSpeedZeroOptimizer_Stage3 = stock_cls3
        if not optimizer.plans and optimizer.groups.pp_size == 1:  # no matrices: plain AdamW, stock ZeRO
            return stock_zero(self, optimizer)
        # (under pipeline parallelism a stage without matrices runs our subclass too: every stage
        # must issue the same collectives in its step, see zero.py's gradient norm)
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

    stock_clip = Engine.clip_fp32_gradients

    def clip_fp32_gradients(self):
        # ZeRO stage 0 (fp32): DeepSpeed's clip_grad_norm_ sums squared norms and averages the
        # norm over DP ranks, one rounding off torch's; every rank holds the same averaged
        # gradients here, so torch's arithmetic needs no DP collective.
        # Under pipeline parallelism DeepSpeed's stage-0 clip counts only the gradients of the ranks
        # whose model-parallel rank is 0, i.e. the first stage's; ours gathers every stage's.
        opt = getattr(self, "basic_optimizer", None)
        if isinstance(opt, CanzonaOptimizer) and opt.moe is not None and opt.moe.active:
            # DeepSpeed's stage-0 clip under MoE averages each rank's norm of the experts it holds
            from .clip import PipelineNorm, clip_moe_module_gradients

            #: the whole model's gradient norm of this step (torch's), as clipped
            if opt.groups.pp_size > 1:  # MoE in a PipelineModule: the stages' norms stacked in stage order
                if getattr(self, "_canzona_pipeline_norm", None) is None:
                    self._canzona_pipeline_norm = PipelineNorm(opt.groups.pp_group, opt.groups.pp_size)
                self._canzona_clip_norm = clip_moe_module_gradients(self.module, opt, self.gradient_clipping(),
                                                                    self._canzona_pipeline_norm)
            else:
                self._canzona_clip_norm = clip_moe_module_gradients(self.module, opt, self.gradient_clipping())
            return
        if isinstance(opt, CanzonaOptimizer) and opt.tp_size == 1:
            from .clip import PipelineNorm, clip_module_gradients

            if getattr(self, "_canzona_pipeline_norm", None) is None:
                self._canzona_pipeline_norm = PipelineNorm(opt.groups.pp_group, opt.groups.pp_size)
            self._canzona_clip_norm = clip_module_gradients(list(self.module.parameters()), self.gradient_clipping(),
                                                            self._canzona_pipeline_norm)
            return
        return stock_clip(self)

    stock_load = Engine.load_checkpoint
    stock_save = Engine.save_checkpoint

    def load_unverified(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        # the one comparison (integration/ckpt/): the same layout -> DeepSpeed's own load;
        # anything else -> the index loop, which fills this run's layout or refuses by name.
        # A Canzona engine's reads (DeepSpeed's and the index's) unpickle only data (ckpt/safe.py);
        # its own tags load through the index under load_universal too (ckpt/hooks.py)
        reads, universal = contextlib.nullcontext(), contextlib.nullcontext()
        if canzona_optimizer(self) is not None:
            from .ckpt.safe import engine_reads

            reads = engine_reads(self, load_dir, tag, ckpt_emit.checkpoint_config(self).allow_unsafe_pickle)
            universal = checkpoint_hooks.canzona_tag_is_universal(self, load_dir, tag)
        with reads, universal:
            if load_optimizer_states and not load_module_only and custom_load_fn is None:
                index = ckpt_route.index_route(self, load_dir, tag)
                if index is not None:
                    out = ckpt_route.load(self, load_dir, tag, index, load_module_strict, load_lr_scheduler_states)
                else:
                    out = stock_load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                     load_lr_scheduler_states, load_module_only, custom_load_fn)
                # either route: the param groups' hyper-parameters as saved (the schedule's last lr,
                # betas, ...), which no scheduler's load_state_dict writes (integration/ckpt/param_groups.py)
                if out[0] is not None:
                    ckpt_route.restore_param_groups(self, load_dir, tag)
                return out
            return stock_load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                              load_lr_scheduler_states, load_module_only, custom_load_fn)

    @functools.wraps(stock_load)
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                      custom_load_fn=custom_load_fn)
        if canzona_optimizer(self) is None and load_optimizer_states and not load_module_only:
            _refuse_foreign_optimizer(self, load_dir, tag)
        # verified first (canzona_ds.checkpoint.load turns this off: it has just verified)
        if canzona_optimizer(self) is not None and engine_hooks_on():
            return checkpoint_hooks.load_checkpoint(self, load_unverified, load_dir, tag, **kwargs)
        return load_unverified(self, load_dir, tag, **kwargs)

    @functools.wraps(stock_save)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DeepSpeed's
                        exclude_frozen_parameters=False):
        if canzona_optimizer(self) is not None and engine_hooks_on():
            return checkpoint_hooks.save_checkpoint(self, stock_save, save_dir, tag, client_state, save_latest,
                                                    exclude_frozen_parameters)
        if canzona_optimizer(self) is not None and not checkpoint_hooks._no_manifest_reason(self):
            # inside canzona_ds.checkpoint.save (a .partial tag it publishes itself): the index too
            tag = str(tag if tag is not None else f"global_step{self.global_steps}")
            out = checkpoint_hooks.write_tag(self, stock_save, save_dir, tag, client_state, exclude_frozen_parameters)
            if save_latest and self.global_rank == 0:  # as DeepSpeed's save would
                with open(os.path.join(save_dir, "latest"), "w") as fd:
                    fd.write(tag)
            return out
        return stock_save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    stock_save_moe = Engine._save_moe_checkpoint

    def _save_moe_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):  # noqa: B006
        # DeepSpeed lets expert-DP rank 0 write the MoE files; under tensor parallelism that misses
        # the other TP ranks' files (moe.checkpoint_writers): one writer per model-parallel rank
        if canzona_optimizer(self) is None:
            return stock_save_moe(self, save_dir, tag, client_state=client_state,
                                  exclude_frozen_parameters=exclude_frozen_parameters)
        from .moe import every_model_parallel_rank_writes

        with every_model_parallel_rank_writes(self):
            return stock_save_moe(self, save_dir, tag, client_state=client_state,
                                  exclude_frozen_parameters=exclude_frozen_parameters)

    stock_take_step = Engine._take_model_step

    def _take_model_step(self, lr_kwargs):
        try:
            # the step's metrics closed at its end, skipped or not, and sent to the ds_config's
            # monitors (integration/metrics.py)
            with step_metrics.around_step(self, canzona_optimizer(self)):
                return stock_take_step(self, lr_kwargs)
        finally:
            # QK-clip's maxima belong to one step, applied or skipped (fp16 overflow): a skipped
            # step clips nothing and its logits do not leak into the next step's maximum
            opt = canzona_optimizer(self)
            if opt is not None and opt.qk_clip is not None:
                opt.qk_clip.reset()

    Engine._take_model_step = _take_model_step
    Engine._save_moe_checkpoint = _save_moe_checkpoint
    Engine.load_checkpoint = load_checkpoint
    Engine.clip_fp32_gradients = clip_fp32_gradients
    Engine.save_checkpoint = save_checkpoint
    Engine._configure_bf16_optimizer = _configure_bf16_optimizer
    Engine._scheduler_from_config = _scheduler_from_config
    Engine._is_supported_optimizer = _is_supported_optimizer
    Engine._configure_basic_optimizer = _configure_basic_optimizer
    Engine._configure_zero_optimizer = _configure_zero_optimizer
    if CanzonaOptimizer not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CanzonaOptimizer)
    _installed = True

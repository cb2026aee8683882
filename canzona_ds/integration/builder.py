"""The ONE way a Canzona optimizer is built, whichever path the user takes:

    ds_config "type": "Canzona*"          registry.install -> engine._configure_basic_optimizer
    Megatron-DeepSpeed (stage 0 client)   megatron.build_tp_optimizer
    the main job (AutoTP at stage 0)      train.trainer -> megatron.build_tp_optimizer

Every path runs the same steps, in this order::

    settings  = RunSettings (from the engine, or from a ds_config dict before there is one)
    pipeline_refusal(...)  if pp > 1, ZeRO 1, stages differ in expert groups  # every rank (one store exchange)
    data_before_refusal    if pp > 1, MoE in a stage, use_data_before_expert_parallelism  # the same exchange
    check_agreement(what every rank must share)        # before anything a rank could wait in
    check_settings(settings)                           # refuse what cannot work, by name
    require_tp_group(...)                              # TP-tagged params need a TP group
    tag_heads(...)   if per_head_muon                  # DeepSpeed's own head resolution
    with_grid_group(groups)  at ZeRO 1/2 with TP, unless layout="owned" (the mixed layout's grid)
    CanzonaOptimizer(named, config, groups, placement="owned" at ZeRO 1/2, "sharded" at ZeRO 3,
                     else "local")
    opt.enable_qk_clip(models/qk_record.attach(modules), dp_group)   if qk_clip

What must agree, and over which ranks: the ds_config side (optimizer type and resolved config,
ZeRO stage, precisions, offload, clipping, accumulation, the parallel degrees) on every rank;
the model (names and shapes of the parameters) among the ranks that hold the same layers,
i.e. within one pipeline stage (its DP and TP peers; TP shards have equal shapes), so a
pipeline's stages may hold different layers.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..config import CanzonaConfig
from ..optimizer import CanzonaOptimizer
from ..parallel import ParallelGroups
from ..planning.params import model_num_experts
from .agreement import check_agreement
from .ds_compat import engine_super_offload, known_bugs
from .groups import require_tp_group


@dataclass(frozen=True)
class RunSettings:
    """The DeepSpeed settings an optimizer build depends on, from an engine or a ds_config."""

    optimizer_type: str
    zero_stage: int
    model_dtype: str
    grad_accum_dtype: str
    bf16: bool
    fp16: bool
    offload_optimizer: bool
    offload_device: str
    cpu_offload: bool
    round_robin_gradients: bool
    zenflow: bool
    moe: bool
    gradient_clipping: float
    gradient_accumulation_steps: int
    # ZeRO-3 settings (integration/zero3.py)
    offload_param_device: str = "none"
    partial_offload: float = 1.0
    super_offload: bool = False
    zero_hpz_partition_size: int = 1
    elastic_checkpoint: bool = False
    #: ds_config ``use_data_before_expert_parallelism``: DeepSpeed MoE's expert groups laid out D + E
    expert_data_before: bool = False

    @classmethod
    def from_engine(cls, engine) -> "RunSettings":
        model_dtype, grad_accum_dtype = engine.get_data_types()
        device = engine.zero_offload_optimizer().device if engine.zero_use_cpu_optimizer() else "none"
        offload_param = engine.zero_offload_param()
        param_device = getattr(offload_param, "device", None) if offload_param is not None else None
        return cls(optimizer_type=engine.optimizer_name(), zero_stage=int(engine.zero_optimization_stage()),
                   model_dtype=str(model_dtype), grad_accum_dtype=str(grad_accum_dtype),
                   bf16=bool(engine.bfloat16_enabled()), fp16=bool(engine.fp16_enabled()),
                   offload_optimizer=bool(engine.zero_use_cpu_optimizer()),
                   offload_device=str(getattr(device, "value", device)), cpu_offload=bool(engine.zero_cpu_offload()),
                   round_robin_gradients=bool(engine.zero_round_robin_gradients()),
                   zenflow=bool(getattr(engine, "zenflow", False)), moe=bool(engine.has_moe_layers),
                   gradient_clipping=float(engine.gradient_clipping()),
                   gradient_accumulation_steps=int(engine.gradient_accumulation_steps()),
                   offload_param_device=str(getattr(param_device, "value", param_device) or "none"),
                   partial_offload=float(engine.zero_partial_offload() or 1.0),
                   super_offload=engine_super_offload(engine),
                   zero_hpz_partition_size=int(engine.zero_hpz_partition_size() or 1),
                   elastic_checkpoint=bool(engine.zero_elastic_checkpoint()),
                   expert_data_before=bool(getattr(engine._config, "use_data_before_expert_parallel_", False)))

    @classmethod
    def from_ds_config(cls, ds: Mapping[str, Any]) -> "RunSettings":
        """Before an engine exists (a client optimizer): what the ds_config says."""
        zero = ds.get("zero_optimization") or {}
        offload = zero.get("offload_optimizer") or {}
        device = str(offload.get("device", "none"))
        param_device = str((zero.get("offload_param") or {}).get("device", "none"))
        bf16 = bool((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled", False))
        fp16 = bool((ds.get("fp16") or {}).get("enabled", False))
        dtype = "torch.bfloat16" if bf16 else "torch.float16" if fp16 else "torch.float32"
        return cls(optimizer_type=str((ds.get("optimizer") or {}).get("type")), zero_stage=int(zero.get("stage", 0)),
                   model_dtype=dtype, grad_accum_dtype=dtype, bf16=bf16, fp16=fp16,
                   offload_optimizer=device not in ("none", ""), offload_device=device, cpu_offload=device == "cpu",
                   round_robin_gradients=bool(zero.get("round_robin_gradients", False)),
                   zenflow=bool(zero.get("zenflow")), moe=False,
                   gradient_clipping=float(ds.get("gradient_clipping", 1.0)),
                   gradient_accumulation_steps=int(ds.get("gradient_accumulation_steps", 1) or 1),
                   offload_param_device=param_device, partial_offload=float(offload.get("ratio", 1.0)),
                   super_offload=bool(offload.get("super_offload", False)),
                   zero_hpz_partition_size=int(zero.get("zero_hpz_partition_size", 1) or 1),
                   elastic_checkpoint=bool(zero.get("elastic_checkpoint", False)),
                   expert_data_before=bool(ds.get("use_data_before_expert_parallelism", False)))


def check_settings(s: RunSettings, cfg: CanzonaConfig) -> None:
    """Refuse DeepSpeed settings the Canzona optimizers do not support, naming the setting."""
    name = s.optimizer_type
    if s.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"{name} supports zero_optimization.stage 0, 1, 2 or 3; got stage={s.zero_stage}.")
    if s.zero_stage == 0 and (s.bf16 or s.fp16):
        kind = "bf16" if s.bf16 else "fp16"
        raise ValueError(f"{name} with {kind}.enabled=true needs zero_optimization.stage 1, 2 or 3 (at stage 0 "
                         f"DeepSpeed wraps the optimizer in its {kind.upper()} optimizer, which flattens the "
                         "matrices).")
    if s.zero_stage and s.round_robin_gradients:
        raise ValueError(f"{name} does not support zero_optimization.round_robin_gradients=true (it reorders "
                         "parameters, breaking the ownership plan). Set it to false.")
    if s.zero_stage == 3:
        check_zero3_settings(s)
    if s.zero_stage and s.offload_optimizer and not s.cpu_offload:
        raise ValueError(f"{name} does not support zero_optimization.offload_optimizer.device={s.offload_device!r}. "
                         "Allowed: 'cpu', 'none' (NVMe offload of per-matrix optimizer state is not implemented).")
    if s.zenflow:
        raise ValueError(f"{name} does not support zero_optimization.zenflow.")


def check_zero3_settings(s: RunSettings) -> None:
    """What stage 3 cannot run with a Canzona optimizer, named."""
    name = s.optimizer_type
    if s.offload_optimizer and not s.cpu_offload:
        raise ValueError(f"{name} at zero_optimization.stage 3 does not support offload_optimizer.device="
                         f"{s.offload_device!r} (NVMe swapping of the fp32 partitions and per-matrix rule state is not "
                         "implemented). Allowed: 'cpu', 'none'.")
    if s.offload_param_device not in ("none", "", "cpu"):
        raise ValueError(f"{name} at zero_optimization.stage 3 does not support offload_param.device="
                         f"{s.offload_param_device!r}. Allowed: 'cpu', 'none'.")
    if s.partial_offload != 1.0:
        raise ValueError(f"{name} does not support zero_optimization.offload_optimizer.ratio={s.partial_offload} "
                         "(partial offload steps part of the sub-groups with DeepSpeedCPUAdam). Remove it or set 1.0.")
    if s.super_offload:
        raise ValueError(f"{name} does not support zero_optimization.super_offload (its optimizer is DeepSpeed's CPU "
                         "Adam). Set it to false.")
    if s.zero_hpz_partition_size > 1:
        raise ValueError(f"{name} does not support zero_optimization.zero_hpz_partition_size="
                         f"{s.zero_hpz_partition_size} (hierarchical partitioning: the pieces of a matrix live in a "
                         "sub-group of the DP group). Set it to 1.")
    if s.elastic_checkpoint:
        raise ValueError(f"{name} at stage 3 does not support zero_optimization.elastic_checkpoint=true (DeepSpeed "
                         "refuses it at stage 3 too). Set it to false.")


#: RunSettings field -> the name a user knows it by (agreement messages)
_DS_KEYS = {"zero_stage": "zero_optimization.stage", "model_dtype": "model dtype",
            "grad_accum_dtype": "gradient accumulation dtype", "bf16": "bf16.enabled", "fp16": "fp16.enabled",
            "offload_optimizer": "offload_optimizer", "round_robin_gradients": "zero_optimization.round_robin_gradients",
            "gradient_clipping": "gradient_clipping", "gradient_accumulation_steps": "gradient_accumulation_steps"}


def agreement_settings(s: RunSettings, cfg: CanzonaConfig, named: list, groups: ParallelGroups) -> dict:
    """What must be equal on every rank (flat keys for clear messages); the model's names and
    shapes are scoped to this rank's pipeline stage (see the module docstring)."""
    out: dict[str, Any] = {"optimizer.type": s.optimizer_type}
    for section, values in cfg.describe().items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    settings = asdict(s)
    out.update({key: settings[field] for field, key in _DS_KEYS.items()})
    out.update({f"parallel.{k}": v for k, v in groups.degrees.items()})
    if groups.pp_size > 1:
        # MoE in some pipeline stages only (ZeRO 0): the expert degree is a stage's own
        out["parallel.ep"] = {"scope": groups.pp_rank, "value": groups.ep_size,
                              "what": f"expert-parallel size of pipeline stage {groups.pp_rank}"}
    shapes = json.dumps([(n, list(getattr(p, "ds_shape", p.shape))) for n, p in named])
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    stage = f" of pipeline stage {groups.pp_rank}" if groups.pp_size > 1 else ""
    out["model parameters (sha256 of names and shapes)"] = {"scope": groups.pp_rank, "value": digest,
                                                             "what": f"model parameters{stage}"}
    return out


def build_optimizer(named: list, cfg: CanzonaConfig, groups: ParallelGroups, settings: RunSettings,
                    modules: list | None = None, zero_config: Mapping | None = None) -> CanzonaOptimizer:
    """Every check, then the optimizer.  ``named``: (name, parameter) in the model's order;
    ``modules``: (module, its named parameters) pairs for per-head resolution and the model
    config's expert count (one per model chunk; names relative to that module).  A parameter
    ZeRO-3 already partitioned (``deepspeed.zero.Init``) has its whole shape in ``ds_shape``.
    DeepSpeed MoE expert parameters (integration/moe.py) are planned over their
    expert-data-parallel groups."""
    from .ds_compat import require, require_supported
    from .moe import check_moe, expert_partitions, moe_info

    require_supported()  # a DeepSpeed outside the supported range: one line naming both
    if cfg.per_head_muon:
        require("per_head_muon", f"{settings.optimizer_type} per_head_muon=true")
    if settings.zero_stage in (1, 2):
        require("zero12_param_padding", f"{settings.optimizer_type} at zero_optimization.stage {settings.zero_stage}",
                " or use zero_optimization.stage 0 or 3")
    if groups.pp_size > 1:
        require("pipeline_grad_scaling", f"{settings.optimizer_type} with pipeline parallelism (pp_size="
                f"{groups.pp_size})")
    shapes = {n: tuple(p.ds_shape) for n, p in named if hasattr(p, "ds_shape")}
    partitions = expert_partitions(named)
    if groups.pp_size > 1:
        # MoE in a PipelineModule: what DeepSpeed 0.19.8 itself runs is planned per stage; the
        # layout its ZeRO-1 optimizer deadlocks on is refused on every rank, the stages without MoE
        # layers included (one store exchange, the same decision everywhere)
        from .agreement import gather
        from .moe import data_before_refusal, pipeline_refusal

        stages = gather({"stage": groups.pp_rank, "moe": bool(partitions or settings.moe),
                         "groups": sorted(set(partitions.values()))})
        moe_ranks: dict[int, list[int]] = {}
        for r, v in enumerate(stages):
            if v["moe"]:
                moe_ranks.setdefault(v["stage"], []).append(r)
        if moe_ranks and settings.expert_data_before:  # (every rank, the stages without MoE layers too)
            raise data_before_refusal(settings.optimizer_type, "pipeline parallelism (pp_size", groups.pp_size)
        if moe_ranks and settings.zero_stage != 0:
            per_stage = {v["stage"]: tuple(v["groups"]) for v in stages}
            uniform = len(moe_ranks) == groups.pp_size and len(set(per_stage.values())) == 1
            if not uniform:
                raise pipeline_refusal(settings.optimizer_type, groups.pp_size, moe_ranks, settings.zero_stage,
                                       per_stage)
    if partitions or settings.moe:
        from .groups import with_expert_groups

        groups = with_expert_groups(groups, partitions.values())
    # before anything a rank could wait in: ranks with different settings meet here and fail
    check_agreement(agreement_settings(settings, cfg, named, groups))
    info = None
    if partitions or settings.moe:
        if not partitions:
            raise ValueError(f"{settings.optimizer_type}: the engine has MoE layers but none of the optimizer's "
                             "parameters is an expert parameter (deepspeed.moe.layer.MoE marks them allreduce=False).")
        check_moe(settings, groups, zero_config or {}, named, modules or [])
        info = moe_info(named, modules or [], groups)
    check_settings(settings, cfg)
    if settings.zero_stage == 3 and (groups.tp_size > 1 or groups.pp_size > 1):
        kind, size = ("tensor parallelism (tp_size", groups.tp_size) if groups.tp_size > 1 else \
            ("pipeline parallelism (pp_size", groups.pp_size)
        raise ValueError(f"{settings.optimizer_type} at zero_optimization.stage 3 with {kind}={size}) is not "
                         "implemented; use ZeRO stage 1 with tensor or pipeline parallelism.")
    if any(getattr(p, "tensor_model_parallel", False) and not hasattr(p, "partition_dim") for _, p in named):
        require("autotp_partition_meta", f"{settings.optimizer_type} with DeepSpeed AutoTP layers",
                " or use Megatron-style TP parameters (partition_dim) with an mpu")
    require_tp_group(named, groups, settings.optimizer_type)
    if cfg.per_head_muon and modules:
        from .heads import tag_heads

        for module, module_named in modules:
            tag_heads(module, module_named, groups.tp_size)
    placement = {1: "owned", 2: "owned", 3: "sharded"}.get(settings.zero_stage, "local")
    if placement == "owned" and groups.tp_size > 1 and cfg.placement.layout != "owned":
        from .groups import with_grid_group

        # the mixed layout may host TP-split matrices over the DP x TP grid (a world collective:
        # the condition is the same on every rank, the settings agreed above)
        groups = with_grid_group(groups)
    num_experts = next((e for m, _ in modules or () if (e := model_num_experts(m)) is not None), None)
    opt = CanzonaOptimizer(named, cfg, groups=groups, placement=placement, shapes=shapes, partitions=partitions,
                           num_experts=num_experts)
    #: DeepSpeed MoE: the expert groups and whole-model names (gradient clipping, checkpoints)
    opt.moe = info
    for module, _ in modules or ():
        # a pipeline stage may name its parameters as the plain model does (canonical_names(),
        # e.g. models/qwen3_pipe.py): checkpoints then index them by those names, so a resume
        # may move between pipeline sizes and the model without a pipeline
        names = getattr(module, "canonical_names", None)
        if callable(names):
            opt.whole_names.update(names())
    if cfg.qk_clip is not None:
        from ..models.qk_record import attach

        # names relative to each module, as ``named`` (one module: the engine's)
        opt.enable_qk_clip(attach([(m, "") for m, _ in modules or ()]), groups.dp_group)
    announce(opt, settings.optimizer_type, settings.zero_stage)
    return opt


def startup_line(opt: CanzonaOptimizer, optimizer_type: str, zero_stage: int) -> str:
    """What runs, in one line: the Canzona type and rule, its two lrs, the ZeRO stage and sizes,
    the DP ownership plans' and the TP hosts' balance (max / mean of the planner's load over the
    ranks), and what a client's own settings mean here (the HF Trainer's ``"auto"`` lr,
    Megatron-DeepSpeed's ``--optimizer``)."""
    cfg, g = opt.config, opt.groups
    line = (f"canzona_ds: {optimizer_type} ({opt.rule.name} on {len(opt.matrix_names)} matrices, AdamW on "
            f"{len(opt.aux_names)} parameters): matrix lr {cfg.lr:g}, AdamW lr {cfg.adam_lr:g}; ZeRO stage "
            f"{zero_stage}, DP {g.dp_size} TP {g.tp_size} PP {g.pp_size}; ")

    def balance(loads) -> float:
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean else 1.0

    plans = [f"{'' if key is None else key + ' '}plan {plan.planner} over {plan.world_size} ranks, "
             f"load max/mean {balance(list(plan.rank_load)):.3f} ({plan.cost_model})" for key, plan in opt.plans.items()]
    tp_plan = getattr(getattr(opt, "tp_runtime", None), "plan", None)
    if tp_plan is not None and list(getattr(tp_plan, "rank_load", None) or []):
        loads = list(tp_plan.rank_load)
        plans.append(f"TP hosts over {len(loads)} ranks, load max/mean {balance(loads):.3f}")
    if plans:
        line += "; ".join(plans)
    elif zero_stage == 3:
        line += "matrices hosted over the DP group by the micro-group runtime (no ownership plan)"
    else:
        line += "every rank updates every matrix it holds (no DP ownership plan)"
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is not None and getattr(hf, "deepspeed_config", lambda: None)() is not None:
        line += ('. HF Trainer: a ds_config "lr": "auto" is TrainingArguments.learning_rate, so that lr is the '
                 "matrix (Muon) lr too (set optimizer.params lr and adam_lr to choose them)")
    if "megatron.training" in sys.modules:
        line += (". Megatron-DeepSpeed: this optimizer replaces the one --optimizer names; --lr is the matrix lr, "
                 "adam_lr / lr scales the AdamW groups")
    bugs = known_bugs()
    if bugs:
        import deepspeed

        line += (f". deepspeed=={deepspeed.__version__} has DeepSpeed bugs later releases fix, for any optimizer "
                 f"(docs/support.md, \"DeepSpeed releases\"): {', '.join(sorted(bugs))}")
    return line


def announce(opt: CanzonaOptimizer, optimizer_type: str, zero_stage: int) -> None:
    """:func:`startup_line` once per build, on global rank 0: through the ``canzona_ds`` logger
    at INFO where logging is set up to show it, else printed (the HF Trainer and DeepSpeed show
    no INFO record at their default levels, so a user would otherwise see nothing)."""
    import logging

    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized() and tdist.get_rank() != 0:
        return
    line = startup_line(opt, optimizer_type, zero_stage)
    log = logging.getLogger("canzona_ds")
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(line)
    else:
        print(line, flush=True)


"""The one place that knows the DeepSpeed releases canzona-ds supports and what differs between them.

Supported: ``deepspeed>=0.18.0,<0.20`` (:data:`SUPPORTED_RANGE`; ``setup.cfg`` names the same range).
Every supported release runs stage 0 and ZeRO-3 (with offload, clipping, TP through the Megatron
path and AutoTP at stage 0, DeepSpeed MoE at stage 0, checkpoints).  What only newer releases
can run is a :data:`FEATURES` entry, detected by what the module has (:func:`has`: the members,
and where presence is not enough a probe of a signature or an override), and refused by name
on a release without it (:func:`require`, one line naming the setting, the release it needs, the
installed one and what works instead):

* ``zero12_param_padding`` (0.19.7): ZeRO stage 1/2.  The integration (integration/zero.py)
  writes the ownership plan into DeepSpeed's per-parameter padding
  (``flatten_dense_tensors_aligned(..., param_padding=)``, ``round_robin_bit16_padding``), which
  gradient routing, the partitioned step, checkpoints and the release's own ``zero_to_fp32.py``
  honour; before it a ZeRO partition is one contiguous run of parameters, cut blind to matrices.
* ``pipeline_grad_scaling`` (0.19.3): pipeline parallelism.  Older releases scale the gradients
  the stages before the last receive a second time by the accumulation steps (0.18.9, 0.19.0)
  or otherwise differ from the single-process model (0.17.6, 0.18.0): DeepSpeed's own arithmetic;
  0.19.3's ``PipelineEngine`` overrides ``_backward_prologue_per_tensor`` to scale once.
* ``autotp_partition_meta`` (0.19.6): DeepSpeed AutoTP.  Older releases' AutoTP layers tag their
  weights ``tensor_model_parallel`` without recording every rank's share of the split
  (``DS_AUTOTP_UC_META``'s ``partition_sizes``; before 0.18.9 no split at all).
* ``per_head_muon`` (0.19.8): DeepSpeed's own head resolution.

Internals that older releases lack or name differently get one shim here each
(:func:`engine_super_offload`, :func:`checkpoint_mp_rank`, :func:`expert_ckpt_file`,
:func:`zero3_partition_group`, :func:`zero3_builtin_muon_active`, :func:`zero12_builtin_muon_active`); :data:`CLASS_MEMBERS` (and
:data:`ZERO_INSTANCE_ATTRS`, checked on an instance by :func:`check_instance`) are what every
supported release has, checked when ``import canzona_ds`` registers the optimizer types
(:func:`check_deepspeed`).  DeepSpeed bugs of supported releases that no attribute tells apart
are :data:`KNOWN_BUGS` (the one comparison of version strings inside the range:
:func:`known_bugs`); they are DeepSpeed's for any optimizer, and docs/support.md says what each does.
The ceiling is the next minor release: its private internals are unknown, so it is refused until
a release of canzona-ds is tested on it.

Outside the range ``import canzona_ds`` warns and ``import deepspeed`` keeps working; a ds_config
naming a Canzona type, or any other build of a Canzona optimizer, fails with
:func:`range_error`'s one line (integration/registry.py, integration/builder.py).
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import Callable, NamedTuple

#: the DeepSpeed releases canzona-ds supports (setup.cfg's install_requires says the same)
SUPPORTED_RANGE = ">=0.18.0,<0.20"
MIN_VERSION = (0, 18, 0)
BELOW_VERSION = (0, 20, 0)

#: (module, attribute path) that every supported release has
CLASS_MEMBERS: tuple[tuple[str, str], ...] = (
    # engine methods wrapped by integration/registry.py
    ("deepspeed.runtime.engine", "DeepSpeedEngine._is_supported_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._configure_basic_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._configure_zero_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._configure_bf16_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._scheduler_from_config"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.clip_fp32_gradients"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.use_node_local_storage"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.load_universal_checkpoint"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.scheduler_name"),
    # engine accessors the integration reads
    ("deepspeed.runtime.engine", "DeepSpeedEngine.optimizer_name"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.optimizer_params"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_optimization_stage"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.get_data_types"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_round_robin_gradients"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_offload_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_cpu_offload"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_use_cpu_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.bfloat16_enabled"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.fp16_enabled"),
    # the module global integration/launcher.py gives a shorter sleep in the forked launch.py
    ("deepspeed.launcher.launch", "time"),
    # early validation of our optimizer section
    ("deepspeed.runtime.config", "DeepSpeedConfig._do_sanity_check"),
    # the module global _configure_zero_optimizer instantiates (swapped for one call)
    ("deepspeed.runtime.engine", "DeepSpeedZeroOptimizer"),
    # ZeRO-1/2 methods the subclass overrides or calls
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.state_dict"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._load_legacy_checkpoint"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._load_universal_checkpoint"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.scaled_global_norm"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.unscale_and_clip_grads"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.get_param_id"),
    # ZeRO-3 (integration/zero3.py): the class engine.py imports at _configure_zero_optimizer, the
    # methods the subclass overrides or calls, the engine accessors of its settings
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_norm_groups"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.state_dict"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.load_state_dict"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.get_param_id"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_offload_param"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._get_all_ckpt_names"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._get_ckpt_name"),
    ("deepspeed.runtime.engine", "get_fp32_state_dict_from_zero_checkpoint"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._unflatten_partitioned_parameters"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_partial_offload"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_hpz_partition_size"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.zero_elastic_checkpoint"),
    # exact-type list of ZeRO-supported optimizers
    ("deepspeed.runtime.zero.utils", "ZERO_SUPPORTED_OPTIMIZERS"),
    # the CPU accelerator's fp16 capability (canzona_ds.integration.accelerator)
    ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator.is_fp16_supported"),
)

#: DeepSpeedZeroOptimizer instance attributes the subclass reads or writes
ZERO_INSTANCE_ATTRS: tuple[str, ...] = (
    "bit16_groups", "bit16_groups_flat", "round_robin_bit16_groups", "round_robin_bit16_offsets",
    "round_robin_bit16_padding", "real_dp_process_group", "dp_process_group", "parameter_alignment",
    "nccl_start_alignment_factor", "partition_size", "params_in_partition", "first_offset", "groups_padding",
    "single_partition_of_fp32_groups", "optimizer", "cpu_offload", "partition_gradients",
    # gradient clipping (integration/clip.py)
    "clip_grad", "model_parallel_world_size", "has_moe_layers", "param_names", "param_to_partition_ids",
    "grad_start_offset", "grad_partition_insertion_offset", "averaged_gradients",
)


class Feature(NamedTuple):
    """Internals only some supported releases have: the release that added them, what a user
    loses without them (the refusal's words), the (module, attribute path) pairs that must be
    present and, where presence is not enough (a new argument, an override), a probe over them."""
    since: str
    why: str
    members: tuple[tuple[str, str], ...]
    probe: Callable[[], bool] | None = None


def _takes(module: str, path: str, argument: str) -> Callable[[], bool]:
    return lambda: argument in inspect.signature(_resolve(module, path)).parameters


def _overrides(module: str, path: str) -> Callable[[], bool]:
    cls_path, _, member = path.rpartition(".")
    return lambda: member in vars(_resolve(module, cls_path))


_Z12 = "deepspeed.runtime.zero.stage_1_and_2"
#: internals only newer supported releases have, detected by what the module has (:func:`has`)
FEATURES: dict[str, Feature] = {
    # ZeRO-1/2 realise the ownership plan through per-parameter padding (integration/zero.py)
    "zero12_param_padding": Feature(
        "0.19.7", "it writes the ownership plan into DeepSpeed's per-parameter padding of the ZeRO-1/2 flat buffer "
        "(flatten_dense_tensors_aligned(param_padding=), which older releases lack: their partitions cut "
        "matrices apart)",
        ((_Z12, "DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned"), (_Z12, "DeepSpeedZeroOptimizer._is_muon_group")),
        _takes(_Z12, "DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned", "param_padding")),
    # pipeline gradients scaled by the accumulation steps once, on the last stage (older releases
    # scale the gradients a stage receives again, or differ otherwise: docs/support.md)
    "pipeline_grad_scaling": Feature(
        "0.19.3", "older releases' PipelineEngine scales the gradients of the stages before the last twice by the "
        "gradient accumulation steps (measured: the pipeline run differs from the single-process model)",
        (("deepspeed.runtime.pipe.engine", "PipelineEngine._backward_prologue_per_tensor"),),
        _overrides("deepspeed.runtime.pipe.engine", "PipelineEngine._backward_prologue_per_tensor")),
    # AutoTP layers that record their split (partition_dim, shard sizes) on each weight: the TP
    # runtime reads it to gather whole matrices (canzona_ds/tp/runtime.py tp_split)
    "autotp_partition_meta": Feature(
        "0.19.6", "older releases' AutoTP layers do not record every rank's share of a split weight (partition_sizes "
        "in DS_AUTOTP_UC_META), so the whole matrix cannot be gathered",
        (("deepspeed.module_inject.layers", "_build_param_uc_restore_meta"),
         ("deepspeed.checkpoint.constants", "DS_AUTOTP_UC_META")),
        _takes("deepspeed.module_inject.layers", "_build_param_uc_restore_meta", "partition_sizes")),
    # per_head_muon: DeepSpeed's own head resolution (same semantics as its Muon), integration/heads.py
    "per_head_muon": Feature(
        "0.19.8", "canzona_ds uses DeepSpeed's own head resolution",
        (("deepspeed", "_per_head_muon_meta"), ("deepspeed", "_resolve_attention_head_count"),
         ("deepspeed", "_owner_modules"), ("deepspeed", "_leaf_module_name"),
         ("deepspeed", "_report_per_head_tagging"), ("deepspeed", "_layer_shape"))),
    # the ZeRO-1/2 Muon path's loss-scale bookkeeping (zero12_builtin_muon_active)
    "zero12_muon_loss_scale": Feature(
        "0.19.8", "DeepSpeed's ZeRO-1/2 Muon path tracks the loss scale",
        ((_Z12, "DeepSpeedZeroOptimizer._muon_update_lacks_loss_scale"),)),
}

#: DeepSpeed bugs of supported releases that no attribute tells apart: bug -> (fixed in, what goes
#: wrong).  Not canzona_ds's to fix (DeepSpeed's own code, any optimizer); :func:`known_bugs`
#: names those of the installed release, docs/support.md says what each does.
KNOWN_BUGS: dict[str, tuple[str, str]] = {
    "zero3_gather_race_gloo": (
        "0.19.8", "ZeRO-3 GatheredParameters over several parameters waits on the last all-gather only "
        "(Init._allgather_params_coalesced): on gloo (CPU) the gathered weights, and with them "
        "engine.save_16bit_model's file, can hold unwritten memory"),
    "moe_stage0_fp32_checkpoint_load": (
        "0.19.3", "an fp32 stage-0 engine with MoE layers loads its optimizer state from the model-states file "
        "instead of the expert-parallel optimizer file it saved (DeepSpeedEngine._load_checkpoint), so every "
        "resume stops with KeyError: 'optimizer', whatever the optimizer"),
}


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _present(module: str, path: str) -> bool:
    try:
        _resolve(module, path)
        return True
    except (ImportError, AttributeError):
        return False


def missing_members() -> list[str]:
    return [f"{module}.{path}" for module, path in CLASS_MEMBERS if not _present(module, path)]


def has(feature: str) -> bool:
    """Whether the installed DeepSpeed has every internal of ``feature`` (a key of FEATURES)."""
    if feature not in FEATURES:
        raise KeyError(f"unknown DeepSpeed feature {feature!r}; known: {sorted(FEATURES)}")
    f = FEATURES[feature]
    return all(_present(m, p) for m, p in f.members) and (f.probe is None or bool(f.probe()))


class UnsupportedByRelease(ValueError):
    """A setting the installed DeepSpeed release cannot run (it lacks ``feature``)."""

    def __init__(self, feature: str, message: str) -> None:
        super().__init__(message)
        self.feature = feature


def require(feature: str, what: str, instead: str = "") -> None:
    """:class:`UnsupportedByRelease` naming ``what`` (a setting), the release it needs and the
    installed one, unless the installed DeepSpeed has ``feature``; ``instead``: what else works."""
    if not has(feature):
        import deepspeed

        f = FEATURES[feature]
        raise UnsupportedByRelease(feature, f"{what} needs deepspeed>={f.since}: {f.why}; deepspeed=="
                                   f"{deepspeed.__version__} is installed. Upgrade DeepSpeed "
                                   f"(pip install 'deepspeed>={f.since},<{'.'.join(map(str, BELOW_VERSION[:2]))}')"
                                   f"{instead or f' or remove {what}'}.")


def known_bugs() -> dict[str, str]:
    """The :data:`KNOWN_BUGS` of the installed release: bug -> what goes wrong."""
    import deepspeed

    v = version_tuple(deepspeed.__version__)
    return {bug: what for bug, (fixed, what) in KNOWN_BUGS.items() if v < version_tuple(fixed)}


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.19.8"``, ``"0.19.8+abc"``, ``"0.20.0rc1"`` -> (0, 19, 8) / (0, 20, 0)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot read a DeepSpeed version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def in_range(version: str) -> bool:
    return MIN_VERSION <= version_tuple(version) < BELOW_VERSION


def range_error(version: str) -> str:
    """The one line for a DeepSpeed release outside SUPPORTED_RANGE."""
    return (f"canzona_ds supports deepspeed{SUPPORTED_RANGE} but deepspeed=={version} is installed; "
            f"install a release in that range (pip install 'deepspeed{SUPPORTED_RANGE}').")


def require_supported() -> None:
    """RuntimeError (one line) unless the installed DeepSpeed is in SUPPORTED_RANGE."""
    import deepspeed

    if not in_range(deepspeed.__version__):
        raise RuntimeError(range_error(deepspeed.__version__))


def check_deepspeed() -> None:
    """RuntimeError unless the installed DeepSpeed is in the range and has every internal."""
    import deepspeed

    require_supported()
    missing = missing_members()
    if missing:
        raise RuntimeError(f"deepspeed=={deepspeed.__version__} lacks internals canzona_ds needs: {missing}. "
                           f"Reinstall DeepSpeed (canzona_ds supports deepspeed{SUPPORTED_RANGE}).")


def check_instance(obj, attrs: tuple[str, ...] = ZERO_INSTANCE_ATTRS) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        import deepspeed

        raise RuntimeError(f"{type(obj).__mro__[1].__name__} of deepspeed=={deepspeed.__version__} lacks attributes "
                           f"canzona_ds relies on: {missing} (canzona_ds supports deepspeed{SUPPORTED_RANGE}).")


# ------------------------------------------------------------------ shims (one per feature caller)
def engine_super_offload(engine) -> bool:
    """ZeRO-3's ``super_offload`` setting (releases before it have no such setting: False)."""
    get = getattr(type(engine), "super_offload", None)
    return bool(get(engine)) if get is not None else False


def checkpoint_mp_rank(engine) -> int:
    """The model-parallel rank in the engine's checkpoint file names (``checkpoint_mp_rank``;
    releases before it name files by ``mpu.get_model_parallel_rank()``, 0 without an mpu)."""
    m = getattr(engine, "checkpoint_mp_rank", None)
    if m is None:
        m = 0 if engine.mpu is None else engine.mpu.get_model_parallel_rank()
    return int(m)


def expert_ckpt_file(engine, layer: int, expert: int) -> str:
    """The file name of expert ``expert`` of MoE layer ``layer`` in the engine's checkpoint."""
    import os

    name = engine._get_expert_ckpt_name
    if "checkpoint_mp_rank" in inspect.signature(name).parameters:
        path = name("", layer, expert, "", checkpoint_mp_rank=checkpoint_mp_rank(engine))
    else:  # named by the mpu's model-parallel rank, which is checkpoint_mp_rank there
        path = name("", layer, expert, "", mpu=engine.mpu)
    return os.path.basename(path)


def zero3_partition_group(zopt, i: int):
    """The process group ZeRO-3 partitions sub-group ``i`` over (releases before 0.19.x's
    ``_get_sub_group_process_group`` partition every sub-group over ``dp_process_group``)."""
    get = getattr(zopt, "_get_sub_group_process_group", None)
    return get(i) if get is not None else zopt.dp_process_group


def zero3_builtin_muon_active(zopt) -> bool:
    """Whether DeepSpeed's own ZeRO-3 Muon path is on (releases without it have no ``use_muon``)."""
    return bool(getattr(zopt, "use_muon", False))


def zero12_builtin_muon_active(zopt, group: list, i: int) -> bool:
    """Whether DeepSpeed's own ZeRO-1/2 Muon path would run on group ``i`` of ``zopt``
    (its ``_is_muon_group`` and, where the release has it, ``_muon_update_lacks_loss_scale``)."""
    return bool(zopt._is_muon_group(group)) or \
        (has("zero12_muon_loss_scale") and bool(zopt._muon_update_lacks_loss_scale(i)))

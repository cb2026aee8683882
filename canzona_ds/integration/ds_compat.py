"""The one place that knows the DeepSpeed releases canzona-ds supports and what differs between them.

Supported: ``deepspeed>=0.19.8,<0.20`` (:data:`SUPPORTED_RANGE`; ``setup.cfg`` names the same range).
The ZeRO-1/2 integration (integration/zero.py) realises the ownership plan through DeepSpeed's
per-parameter padding (``parameter_alignment``: ``flatten_dense_tensors_aligned(...,
param_padding=)``, ``round_robin_bit16_padding`` and ``round_robin_bit16_offsets``), which
DeepSpeed added in 0.19.7; before it a ZeRO partition is one contiguous run of parameters, and the
release's own ``zero_to_fp32.py`` (copied into every checkpoint folder) would misread a padded
buffer.  0.19.7 has it, but its ZeRO-3 ``GatheredParameters`` over several parameters races on
gloo (``Init._allgather_params_coalesced`` waits on the last all-gather only; 0.19.8 waits on
each), which no attribute tells apart: the floor is 0.19.8 (docs/support.md).  The ceiling is the next minor release: its
private internals are unknown, so it is refused until a release of canzona-ds is tested on it.

Inside the range nothing branches on the version string: :data:`CLASS_MEMBERS` (and
:data:`ZERO_INSTANCE_ATTRS`, checked on an instance by :func:`check_instance`) are what every
supported release has, checked when ``import canzona_ds`` registers the optimizer types
(:func:`check_deepspeed`); :data:`FEATURES` are internals only newer releases have, detected
by what the module has (:func:`has`), with a shim here for each caller
(:func:`zero12_builtin_muon_active`) or a refusal by name (:func:`require`: ``per_head_muon``).

Outside the range ``import canzona_ds`` warns and ``import deepspeed`` keeps working; a ds_config
naming a Canzona type, or any other build of a Canzona optimizer, fails with
:func:`range_error`'s one line (integration/registry.py, integration/builder.py).
"""
from __future__ import annotations

import importlib
import re

#: the DeepSpeed releases canzona-ds supports (setup.cfg's install_requires says the same)
SUPPORTED_RANGE = ">=0.19.8,<0.20"
MIN_VERSION = (0, 19, 8)
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
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._is_muon_group"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.scaled_global_norm"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.unscale_and_clip_grads"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.get_param_id"),
    # ZeRO-3 (integration/zero3.py): the class engine.py imports at _configure_zero_optimizer, the
    # methods the subclass overrides or calls, the engine accessors of its settings
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_sub_group_process_group"),
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
    ("deepspeed.runtime.engine", "DeepSpeedEngine.super_offload"),
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


#: internals only some supported releases have: feature -> (the release that added them, members)
FEATURES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    # per_head_muon: DeepSpeed's own head resolution (same semantics as its Muon), integration/heads.py
    "per_head_muon": ("0.19.8", (("deepspeed", "_per_head_muon_meta"), ("deepspeed", "_resolve_attention_head_count"),
                                 ("deepspeed", "_owner_modules"), ("deepspeed", "_leaf_module_name"),
                                 ("deepspeed", "_report_per_head_tagging"), ("deepspeed", "_layer_shape"))),
    # the ZeRO-1/2 Muon path's loss-scale bookkeeping (zero12_builtin_muon_active)
    "zero12_muon_loss_scale": ("0.19.8", (("deepspeed.runtime.zero.stage_1_and_2",
                                           "DeepSpeedZeroOptimizer._muon_update_lacks_loss_scale"),)),
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
    return all(_present(m, p) for m, p in FEATURES[feature][1])


def require(feature: str, what: str) -> None:
    """ValueError naming ``what`` (a setting) unless the installed DeepSpeed has ``feature``."""
    if not has(feature):
        import deepspeed

        raise ValueError(f"{what} needs deepspeed>={FEATURES[feature][0]} (canzona_ds uses DeepSpeed's own "
                         f"implementation); deepspeed=={deepspeed.__version__} is installed. Upgrade DeepSpeed "
                         f"or remove {what}.")


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
def zero12_builtin_muon_active(zopt, group: list, i: int) -> bool:
    """Whether DeepSpeed's own ZeRO-1/2 Muon path would run on group ``i`` of ``zopt``
    (its ``_is_muon_group`` and, where the release has it, ``_muon_update_lacks_loss_scale``)."""
    return bool(zopt._is_muon_group(group)) or \
        (has("zero12_muon_loss_scale") and bool(zopt._muon_update_lacks_loss_scale(i)))

"""Every DeepSpeed internal canzona-ds relies on, named once, checked at install.

canzona-ds is pinned to ``deepspeed==SUPPORTED_DEEPSPEED``: the ZeRO integration
subclasses ``DeepSpeedZeroOptimizer`` and wraps a few ``DeepSpeedEngine`` methods.
:func:`check_deepspeed` runs when ``import canzona_ds`` registers the optimizer types
(after ``import deepspeed``): a wrong version or a missing internal is a RuntimeError
that names it, instead of an AttributeError deep inside ``deepspeed.initialize``.
Instance attributes can only be checked on an instance: the ZeRO subclass checks
``ZERO_INSTANCE_ATTRS`` right after DeepSpeed's constructor (:func:`check_instance`).
"""
from __future__ import annotations

import importlib

SUPPORTED_DEEPSPEED = "0.19.8"

#: (module, attribute path) that must exist on the installed DeepSpeed
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
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._muon_update_lacks_loss_scale"),
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
    # per_head_muon: DeepSpeed's own head resolution (same semantics as its Muon)
    ("deepspeed", "_per_head_muon_meta"),
    ("deepspeed", "_resolve_attention_head_count"),
    ("deepspeed", "_owner_modules"),
    ("deepspeed", "_leaf_module_name"),
    ("deepspeed", "_report_per_head_tagging"),
    ("deepspeed", "_layer_shape"),
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


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_members() -> list[str]:
    out = []
    for module, path in CLASS_MEMBERS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            out.append(f"{module}.{path}")
    return out


def check_deepspeed() -> None:
    """RuntimeError unless the installed DeepSpeed is the pinned version with every internal."""
    import deepspeed

    if deepspeed.__version__ != SUPPORTED_DEEPSPEED:
        raise RuntimeError(
            f"canzona_ds is pinned to deepspeed=={SUPPORTED_DEEPSPEED} (its ZeRO integration overrides private "
            f"internals of that release), but deepspeed=={deepspeed.__version__} is installed. "
            f"Install deepspeed=={SUPPORTED_DEEPSPEED}.")
    missing = missing_members()
    if missing:
        raise RuntimeError(f"deepspeed=={deepspeed.__version__} lacks internals canzona_ds needs: {missing}. "
                           f"Reinstall deepspeed=={SUPPORTED_DEEPSPEED}.")


def check_instance(obj, attrs: tuple[str, ...] = ZERO_INSTANCE_ATTRS) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise RuntimeError(f"{type(obj).__mro__[1].__name__} lacks attributes canzona_ds relies on: {missing}. "
                           f"Install deepspeed=={SUPPORTED_DEEPSPEED}.")

"""DeepSpeed integration: the only package that knows DeepSpeed internals (the supported releases).

    ds_compat.py    the supported range; every private DeepSpeed attribute relied on, checked at install;
                    what differs between releases, detected by what the module has
    groups.py       the one place process groups are read (mpu, pipeline grid, AutoTP, plain DP)
                    into a canzona_ds.parallel.ParallelGroups
    builder.py      the one optimizer builder (settings agreement, checks, head tagging)
    registry.py     ds_config "type" names -> the builder; engine patches
    zero.py         ZeRO stage 1/2 subclass realising the planned-padding layout
    clip.py         ZeRO-1/2 gradient clipping with torch's clip_grad_norm_ arithmetic
    heads.py        per_head_muon: DeepSpeed's own attention-head resolution
    megatron.py     the Megatron-DeepSpeed hook (stage-0 client optimizer, ZeRO x TP routing)
    runtime_info.py what the main job reads from an engine (timers, groups, plans)
    metrics.py      the optimizer's step metrics: the engine's step boundary, DeepSpeed's monitors
    hf.py           the step metrics in a Hugging Face Trainer's logs (a callback; imports transformers)
    ckpt/           a Canzona engine's checkpoints: the engine hooks, the index emitted at save, the
                    one comparison and the index loop at load (its __init__ draws the path)
    accelerator.py  asking (and, for tests, widening) the CPU accelerator's capabilities
    stage0.py       ZeRO stage 0, fp32: a step with a non-finite gradient skipped, as at stages 1-3
    config_check.py pre-launch checks: the optimizer types DeepSpeed builds, its ds_config parse
    launcher.py     the per-node launch command (DeepSpeed's launch.py) of the main job, run forked
    cpu_info.py     py-cpuinfo's answer (DeepSpeed's CPU op loads ask it) cached once per machine

``install()`` registers ``"CanzonaMuon"``, ``"CanzonaShampoo"`` and ``"CanzonaSOAP"`` with
DeepSpeed's engine; ``import canzona_ds`` arranges for it to run as soon as ``deepspeed``
is imported.
"""
from __future__ import annotations


def install() -> None:
    """Register the Canzona optimizer types with DeepSpeed now (imports deepspeed); answer
    py-cpuinfo's question from the machine's cache (cpu_info.py)."""
    from .cpu_info import install as cache_cpu_info
    from .registry import install as _install

    cache_cpu_info()

    _install()

"""The test kit, shared by tests/ and benchmarks/ (no test imports another test).

Not part of the installed package: it sits beside ``canzona_ds/`` at the repository root, so it
is importable exactly where the checkout's ``canzona_ds`` is (pytest from the root, with
``pythonpath = .`` in setup.cfg; benchmarks, which put the root on ``sys.path``; every child
process the runners start, which inherit that path), and ``pip install .`` leaves it out
(setup.cfg packages ``canzona_ds`` only; tests/test_packaging.py checks the wheel).

    dist.py              spawned multi-process runner (gloo on CPU, NCCL on CUDA)
    comm.py              collective counter (calls and bytes, by process-group size)
    models.py            tiny models, data, ds_config builder, engine and reference runners
    zero3.py             ZeRO stage 3: ds_config, whole parameters of a partitioned module,
                         a replay recorder of the hosted updates, a rule-call counter
    pipeline.py          a tiny decoder as a DeepSpeed PipelineModule, a PipelineEngine runner,
                         and its DeepSpeed-free single-process reference
    megatron_standin.py  a faithful CPU stand-in for the Megatron pieces canzona_ds touches
    baselines.py         what canzona-ds is compared against: TP-SC, shard-local TP,
                         layer-wise ownership (benchmarks only, never the product)
    moe.py               tiny DeepSpeed MoE models (+ TP, + pipeline) and their reference
    hf_moe.py            a tiny transformers Qwen3MoeForCausalLM and its per-expert reference
    fuzz.py              invalid optimizer settings generated from the config dataclasses
    megatron_real.py     the real Megatron-DeepSpeed for the megatron_real tier: source, minimal
                         CPU patches, helpers build, byte-token dataset, the documented launch
    megatron_capture/    a sitecustomize that records a real run's optimizer steps (that tier only)
"""

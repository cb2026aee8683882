"""The test kit, shared by tests/ and benchmarks/ (no test imports another test).

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
"""

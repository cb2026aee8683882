"""Run Megatron-DeepSpeed's ``pretrain_gpt.py`` with the Canzona optimizer from ds_config.

    deepspeed --num_gpus 8 launch/megatron_pretrain_gpt.py $MEGATRON_DS/pretrain_gpt.py \
        <pretrain_gpt.py args> --deepspeed --deepspeed_config configs/ds_megatron_tp.json

Megatron-DeepSpeed hands its own optimizer and lr scheduler to ``deepspeed.initialize``
(ds_config's optimizer section is ignored); this shim calls
``canzona_ds.integration.megatron.patch_megatron_training()`` (patches
``megatron.training.get_megatron_optimizer`` and wraps ``deepspeed.initialize``) and then runs
the script as ``__main__``.  With ``"type"`` any Canzona type (``"CanzonaMuon"``,
``"CanzonaShampoo"``, ``"CanzonaSOAP"``):

* ``"zero_optimization": {"stage": 1}`` or ``2`` (the shipped config: stage 1; fp32/bf16/fp16):
  ``get_megatron_optimizer`` returns a ``DeferredCanzona`` placeholder; deepspeed.initialize
  gets no client optimizer and builds ``CanzonaOptimizer`` from ds_config with Megatron's mpu
  (ZeRO x TP: DP ownership, TP-split matrices hosted by the micro-group runtime); Megatron's
  OptimizerParamScheduler drives its lr/wd.  Needs ``--no-pipeline-parallel``.
* stage 0 (fp32 only): the client optimizer is a stage-0 ``CanzonaOptimizer`` (DP replicates
  the step; TP-split matrices still go through the micro-group runtime).

Any other optimizer type runs Megatron's own optimizer unchanged.  docs/tp.md.
"""
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))  # Megatron-DeepSpeed's root: import megatron
    from canzona_ds.integration.megatron import patch_megatron_training

    patch_megatron_training()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

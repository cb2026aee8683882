"""Run Megatron-DeepSpeed's ``pretrain_gpt.py`` with the optimizer from ds_config.

    deepspeed --num_gpus 8 launch/megatron_pretrain_gpt.py $MEGATRON_DS/pretrain_gpt.py \
        <pretrain_gpt.py args> --deepspeed --deepspeed_config configs/ds_megatron_tp.json

Megatron-DeepSpeed hands its own optimizer and lr scheduler to ``deepspeed.initialize``
(ds_config's optimizer section is ignored); this shim calls
``canzona_ds.integration.megatron.patch_megatron_training()`` (patches
``megatron.training.get_megatron_optimizer`` and wraps ``deepspeed.initialize``) and then runs
the script as ``__main__``.  With ``"type": "CanzonaMuon"``:

* ``"zero_optimization": {"stage": 1}`` (the shipped config; fp32/bf16/fp16): deepspeed.initialize
  gets no client optimizer and builds CanzonaMuon from ds_config with Megatron's mpu (ZeRO-1 x
  TP-ASC); Megatron's OptimizerParamScheduler drives its lr/wd.  Needs ``--no-pipeline-parallel``.
* stage 0 (fp32 only): the client optimizer is TPMuon (DP replicates the Muon step).

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

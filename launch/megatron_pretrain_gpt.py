"""Run Megatron-DeepSpeed's ``pretrain_gpt.py`` with the optimizer from ds_config.

    deepspeed --num_gpus 8 launch/megatron_pretrain_gpt.py $MEGATRON_DS/pretrain_gpt.py \
        <pretrain_gpt.py args> --deepspeed --deepspeed_config configs/ds_megatron_tp.json

Megatron-DeepSpeed hands its own optimizer to ``deepspeed.initialize`` (ds_config's
optimizer section is ignored); this shim patches ``megatron.training.get_megatron_optimizer``
(canzona_ds.integration.megatron.patch_megatron_training) and then runs the script as
``__main__``.  With ``"type": "CanzonaMuon"`` the client optimizer becomes TPMuon (exact
TP-ASC Muon for tensor-parallel matrices, AdamW for the rest); any other type runs
Megatron's own optimizer unchanged.
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

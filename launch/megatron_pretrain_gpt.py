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
  OptimizerParamScheduler drives its lr/wd (with or without pipeline parallelism).
* stage 0 (fp32 only): the client optimizer is a stage-0 ``CanzonaOptimizer`` (DP replicates
  the step; TP-split matrices still go through the micro-group runtime).

Any other optimizer type runs Megatron's own optimizer unchanged.  docs/tp.md.
"""
import os
import runpy
import sys


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(script, its argv[1:]) from this shim's arguments.

    The ``deepspeed`` launcher runs ``python -u shim --local_rank=N <user args>``: the
    launcher's ``--local_rank`` comes *before* the script.  Those leading launcher options
    (``--local_rank=N``, ``--local_rank N``, ``--local-rank...``) are moved after the script's
    own arguments, where Megatron's argument parser reads them; the first other argument is
    the script, which must be a ``.py`` file that exists.
    """
    launcher: list[str] = []
    rest = list(argv)
    while rest and rest[0].split("=", 1)[0] in ("--local_rank", "--local-rank"):
        opt = rest.pop(0)
        launcher.append(opt)
        if "=" not in opt and rest:
            launcher.append(rest.pop(0))
    if not rest:
        raise SystemExit(f"no script given (arguments: {argv!r})\n\n{__doc__}")
    script = rest[0]
    if script.startswith("-") or not script.endswith(".py") or not os.path.isfile(script):
        raise SystemExit(f"the first argument after the launcher's options must be Megatron-DeepSpeed's "
                         f"pretrain_gpt.py (an existing .py file), got {script!r} (arguments: {argv!r})")
    return os.path.abspath(script), rest[1:] + launcher


def main() -> None:
    script, args = split_argv(sys.argv[1:])
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(script))  # Megatron-DeepSpeed's root: import megatron
    from canzona_ds.integration.megatron import patch_megatron_training

    patch_megatron_training()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

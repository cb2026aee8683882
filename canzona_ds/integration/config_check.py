"""ds_config checks that need DeepSpeed's own tables, run in one process before any rank starts.

* :func:`check_optimizer_type` - the ``"optimizer": {"type": ...}`` names DeepSpeed 0.19.8 can
  build once ``import canzona_ds`` has registered ours, with a "did you mean" for a near miss:

      Canzona types      CanzonaMuon, CanzonaShampoo, CanzonaSOAP          exact spelling
      DeepSpeed's own    adam, adamw, lamb, lion, muon, ...                any case (DeepSpeed
                                                                           lower-cases them)
      torch.optim        SGD, RMSprop, ... (a class of torch.optim)        exact spelling

* :func:`validate_ds_config` - DeepSpeed's own parse of the ds_config (its pydantic models and
  our sections' sanity check, :mod:`canzona_ds.integration.registry`), the same parse
  ``deepspeed.initialize`` makes on every rank, here once, without a process group.
"""
from __future__ import annotations

import difflib


def supported_optimizer_types() -> tuple[list[str], list[str]]:
    """(exact-case names, case-insensitive names) of the ds_config optimizer types this
    installation builds (torch.optim classes are in the first list)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    from canzona_ds.optim import OPTIMIZER_TYPES

    torch_optims = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                          and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
                          and n != "Optimizer")
    return [*OPTIMIZER_TYPES, *torch_optims], list(DEEPSPEED_OPTIMIZERS)


def check_optimizer_type(opt_type: object, where: str) -> None:
    """ValueError naming ``opt_type``, the valid types and the nearest one, unless DeepSpeed
    (with canzona_ds registered) can build it."""
    from canzona_ds.optim import OPTIMIZER_TYPES

    exact, any_case = supported_optimizer_types()
    name = str(opt_type)
    if isinstance(opt_type, str) and (name in exact or name.lower() in any_case):
        return
    by_lower = {n.lower(): n for n in [*exact, *any_case]}
    guess = by_lower.get(name.lower()) or next(
        iter(difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)), None)
    hint = f" Did you mean {by_lower.get(guess, guess)!r}?" if guess else ""
    raise ValueError(f"{where}: optimizer type {opt_type!r} is not a type DeepSpeed can build.{hint} Valid: "
                     f"{', '.join(OPTIMIZER_TYPES)} (exact spelling); DeepSpeed's {', '.join(any_case)} (any "
                     "case); or a torch.optim class name (e.g. SGD).")


def validate_ds_config(ds: dict, where: str) -> None:
    """DeepSpeed's parse of ``ds`` (a ds_config with the batch keys filled in), as
    ``deepspeed.initialize`` does it, without a process group: a bad key or value is a
    ValueError naming ``where``.  ``train_batch_size`` is left out: without a process group
    DeepSpeed counts one rank, and the run config's batch layout was checked against the real
    data-parallel size already (canzona_ds.train.trainer.build_ds_config).  Anything else
    DeepSpeed objects to here (an assert about the machine) is left to the ranks."""
    import logging

    import canzona_ds  # noqa: F401 - our sections' sanity check runs inside DeepSpeed's parse
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    probe = {k: v for k, v in ds.items() if k != "train_batch_size"}
    level = logger.level
    logger.setLevel(logging.WARNING)  # its info lines belong to the ranks' start-up, not to a check
    try:
        DeepSpeedConfig(probe)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"DeepSpeed rejected {where}: {e}") from None
    except Exception:  # noqa: BLE001 - not a config verdict (see above): the ranks will meet it
        pass
    finally:
        logger.setLevel(level)

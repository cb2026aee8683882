"""The warm-up-then-decay lr schedule the resume scenarios run (tests/test_ckpt_resume.py), on
both sides: the engine gets torch's ``LambdaLR`` as a client scheduler (a callable, as the HF
Trainer passes its scheduler to DeepSpeed), the single-process references the same factor
applied to their groups (:func:`reference_lr`: ``base_lr * lr_factor(k)``, the expression
``LambdaLR`` evaluates).

:func:`scheduled` is a worker wrapper: it runs a family's ``save``/``resume`` with every
``deepspeed.initialize`` in that process given the schedule, and returns the lr every param
group held at each step the engine took (read from the optimizer's live groups when the engine
steps the scheduler, i.e. right after the optimizer step that used them).
"""
from __future__ import annotations

#: linear warm-up over WARMUP steps to the peak, then linear decay (step k, 0-based, runs at
#: base * lr_factor(k): 0.5, 1.0, 0.7, 0.4, ...; a resumed step never runs at the fresh schedule's
#: first value nor at the configured peak, so a resume that loses the schedule shows)
WARMUP = 2


def lr_factor(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return max(0.1, 1.0 - 0.3 * (step + 1 - WARMUP))


#: (step k, [(role, lr) per param group], (matrix lr, AdamW lr) configured) per scheduler step
RECORDS: list = []


def _recorded_lambda_lr():
    import torch

    class RecordedLambdaLR(torch.optim.lr_scheduler.LambdaLR):
        """LambdaLR(lr_factor) that records the groups' lrs of each step it follows."""

        def __init__(self, optimizer) -> None:
            self._recording = False
            super().__init__(optimizer, lr_factor)
            self._recording = True
            cfg = getattr(optimizer, "config", None)
            self._bases = None if cfg is None else (cfg.lr, cfg.adam_lr)

        def step(self, *args, **kwargs):
            if self.__dict__.get("_recording"):
                RECORDS.append((self.last_epoch, [(g.get("canzona_role"), g["lr"]) for g in self.optimizer.param_groups],
                                self._bases))
            return super().step(*args, **kwargs)

        def state_dict(self):
            return {k: v for k, v in super().state_dict().items() if k not in ("_recording", "_bases")}

    return RecordedLambdaLR


def scheduled(rank: int, world: int, fn, *args):
    """A worker: ``fn(rank, world, *args)`` with the schedule given to every engine built; its
    result (a dict gets ``"lrs"``: :data:`RECORDS`; anything else becomes ``{"result", "lrs"}``)."""
    import deepspeed

    cls = _recorded_lambda_lr()
    original = deepspeed.initialize

    def initialize(*a, **kw):
        if kw.get("lr_scheduler") is None:
            kw["lr_scheduler"] = cls  # a callable: DeepSpeed calls it with the optimizer it built
        return original(*a, **kw)

    RECORDS.clear()
    deepspeed.initialize = initialize
    try:
        out = fn(rank, world, *args)
    finally:
        deepspeed.initialize = original
    return dict(out, lrs=list(RECORDS)) if isinstance(out, dict) else {"result": out, "lrs": list(RECORDS)}


def check_lrs(results: list, steps: range, prefix: bool = False) -> None:
    """Every rank's engine stepped exactly ``steps`` (``prefix``: at least, first) and each param
    group ran each step at its configured lr (matrix or AdamW) times ``lr_factor(k)``, bit for bit."""
    for rank, r in enumerate(results):
        records = r["lrs"]
        ks = [k for k, _, _ in records]
        assert (ks[:len(steps)] if prefix else ks) == list(steps), (rank, ks)
        for k, groups, (lr, adam_lr) in records:
            want = {"matrix": lr * lr_factor(k), "aux": adam_lr * lr_factor(k)}
            for role, got in groups:
                assert got == want[role], f"rank {rank} step {k}: the {role} group ran at lr {got!r}, the schedule " \
                                          f"says {want[role]!r} (fresh schedule: {want[role] / lr_factor(k) * lr_factor(0)!r})"


def reference_lr(opt) -> None:
    """Set a single-process reference's lrs for its next step (``opt.step_count`` steps taken):
    its configured lrs times ``lr_factor``."""
    k = opt.step_count
    opt.set_lr(opt.config.lr * lr_factor(k), opt.config.adam_lr * lr_factor(k))

"""Test-kit only: record optimizer steps of a real Megatron-DeepSpeed run.

tests/test_megatron_real.py puts this folder on ``PYTHONPATH`` and sets ``CANZONA_CAPTURE_DIR``
for one launch; Python imports ``sitecustomize`` at start-up in every process of that launch.
In the training processes (``sys.argv[0]`` is launch/megatron_pretrain_gpt.py) it wraps two
methods, which still run unchanged:

* ``CanzonaOptimizer.step``: its first call writes every parameter's value before, gradient
  (what the optimizer reads) and value after, with its param group's role, lr and weight decay,
  to ``$CANZONA_CAPTURE_DIR/opt<global rank>.pt`` (meaningful at ZeRO 0, where the optimizer holds
  the model's parameters);
* ``MicroGroupRuntime.step`` (the TP-split matrices' step at ZeRO 0, 1 and 2): its first call
  writes each matrix's shard before, gradient shard and shard after, with the lr, weight decay
  and step count it was given; every call appends its (step, lr, weight decay) -- to
  ``$CANZONA_CAPTURE_DIR/tp<global rank>.pt``;
* ``DeepSpeedEngine._take_model_step`` (every engine's optimizer step, the pipeline engine's
  too): every call appends the (lr, weight decay) of each param group it steps with, read on
  entry (Megatron's scheduler sets them after the previous step, or the load), to
  ``$CANZONA_CAPTURE_DIR/steps<global rank>.pt``.

Without ``CANZONA_CAPTURE_DIR`` this module does nothing.
"""
import os
import sys

if os.environ.get("CANZONA_CAPTURE_DIR") and any(a.endswith("megatron_pretrain_gpt.py") for a in sys.argv[:1]):
    import torch

    from canzona_ds.optimizer import CanzonaOptimizer
    from canzona_ds.tp.runtime import MicroGroupRuntime, TPMatrix

    def _rank() -> int:
        import torch.distributed as tdist

        return tdist.get_rank() if tdist.is_initialized() else 0

    def _out(kind: str) -> str:
        return os.path.join(os.environ["CANZONA_CAPTURE_DIR"], f"{kind}{_rank()}.pt")

    _opt_step = CanzonaOptimizer.step
    _opt_done = []

    def opt_step(self, closure=None):
        if _opt_done:
            return _opt_step(self, closure)
        _opt_done.append(True)
        before, grads, meta = {}, {}, {}
        for names, group in zip(self.group_names, self.param_groups):
            for n, p in zip(names, group["params"]):
                before[n] = p.detach().clone()
                grads[n] = None if p.grad is None else p.grad.detach().clone()
                meta[n] = {"role": group["canzona_role"], "lr": float(group["lr"]),
                           "weight_decay": float(group["weight_decay"]),
                           "tensor_model_parallel": bool(getattr(p, "tensor_model_parallel", False)),
                           "partition_dim": getattr(p, "partition_dim", None)}
        out = _opt_step(self, closure)
        after = {n: p.detach().clone() for names, g in zip(self.group_names, self.param_groups)
                 for n, p in zip(names, g["params"])}
        torch.save({"before": before, "grads": grads, "after": after, "meta": meta, "tp_rank": self.groups.tp_rank,
                    "tp_size": self.groups.tp_size}, _out("opt"))
        return out

    _tp_step = MicroGroupRuntime.step
    _tp_record: dict = {}

    def tp_step(self, params, grads, lr, weight_decay, step):
        # the first call of a runtime over TP shards (TPMatrix; a grid runtime's pieces are not recorded)
        first = not _tp_record and all(isinstance(m, TPMatrix) for m in self.matrices)
        if first:
            _tp_record.update(matrices={}, calls=[], tp_rank=self.tp_rank)
            for m, p, g in zip(self.matrices, params, grads):
                _tp_record["matrices"][m.name] = {"before": p.detach().clone().view(m.local_shape(self.tp_rank)),
                                                  "grad": g.detach().clone().view(m.local_shape(self.tp_rank)),
                                                  "partition_dim": m.partition_dim, "full_shape": m.full_shape}
        out = _tp_step(self, params, grads, lr, weight_decay, step)
        if first:
            for m, p in zip(self.matrices, params):
                _tp_record["matrices"][m.name].update(after=p.detach().clone().view(m.local_shape(self.tp_rank)),
                                                      lr=float(lr), weight_decay=float(weight_decay), step=int(step))
        if _tp_record:
            _tp_record["calls"].append((int(step), float(lr), float(weight_decay)))
            torch.save(_tp_record, _out("tp"))
        return out

    from deepspeed.runtime.engine import DeepSpeedEngine

    _take_step = DeepSpeedEngine._take_model_step
    _steps: list = []

    def take_step(self, *args, **kwargs):
        _steps.append([(float(g["lr"]), float(g["weight_decay"])) for g in self.optimizer.param_groups])
        torch.save(_steps, _out("steps"))
        return _take_step(self, *args, **kwargs)

    CanzonaOptimizer.step = opt_step
    MicroGroupRuntime.step = tp_step
    DeepSpeedEngine._take_model_step = take_step

"""Test-kit only: record the first ``CanzonaOptimizer.step`` of a real Megatron-DeepSpeed run.

tests/test_megatron_real.py puts this folder on ``PYTHONPATH`` and sets ``CANZONA_CAPTURE_DIR``
for one launch; Python imports ``sitecustomize`` at start-up in every process of that launch.
In the training processes (those that import torch anyway) it wraps ``CanzonaOptimizer.step``
so that the first step writes, per rank, every parameter's value before, gradient (what the
optimizer reads) and value after, with its param group's role, lr and weight decay, to
``$CANZONA_CAPTURE_DIR/rank<global rank>.pt``.  Nothing else changes: the step itself runs
unchanged.  Without ``CANZONA_CAPTURE_DIR`` this module does nothing.
"""
import os
import sys

if os.environ.get("CANZONA_CAPTURE_DIR") and any(a.endswith("megatron_pretrain_gpt.py") for a in sys.argv[:1]):
    import torch

    from canzona_ds.optimizer import CanzonaOptimizer

    _step = CanzonaOptimizer.step
    _done = []

    def step(self, closure=None):
        if _done:
            return _step(self, closure)
        _done.append(True)
        before, grads, meta = {}, {}, {}
        for names, group in zip(self.group_names, self.param_groups):
            for n, p in zip(names, group["params"]):
                before[n] = p.detach().clone()
                grads[n] = None if p.grad is None else p.grad.detach().clone()
                meta[n] = {"role": group["canzona_role"], "lr": float(group["lr"]),
                           "weight_decay": float(group["weight_decay"]),
                           "tensor_model_parallel": bool(getattr(p, "tensor_model_parallel", False)),
                           "partition_dim": getattr(p, "partition_dim", None)}
        out = _step(self, closure)
        after = {n: p.detach().clone() for names, g in zip(self.group_names, self.param_groups)
                 for n, p in zip(names, g["params"])}
        import torch.distributed as tdist

        rank = tdist.get_rank() if tdist.is_initialized() else 0
        torch.save({"before": before, "grads": grads, "after": after, "meta": meta, "tp_rank": self.groups.tp_rank,
                    "tp_size": self.groups.tp_size},
                   os.path.join(os.environ["CANZONA_CAPTURE_DIR"], f"rank{rank}.pt"))
        return out

    CanzonaOptimizer.step = step

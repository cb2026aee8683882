"""Count collective calls and bytes moved, by wrapping ``deepspeed.comm`` and ``torch.distributed``.

``with CommCounter() as c: ...`` records every collective issued inside the block as
``(layer, op, payload_bytes, wire_bytes)``.  ``payload_bytes`` is the tensor the caller
hands in (for all-gathers: the gathered output); ``wire_bytes`` is what one rank sends
under the usual bandwidth-optimal algorithms with p ranks (ring / reduce-scatter based):

    all_reduce                 2 (p-1)/p * n        reduce                 (p-1)/p * n
    all_gather(_into_tensor)     (p-1)/p * out      reduce_scatter(_tensor)  (p-1)/p * in
    broadcast                          n            all_to_all(_single)      (p-1)/p * n

DeepSpeed calls reach torch.distributed through ``deepspeed.comm``; both layers are
wrapped, and ``count("deepspeed")`` / ``count("torch")`` keep them apart so nothing is
counted twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

OPS = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "all_gather_object",
       "broadcast_object_list", "barrier", "send", "recv", "isend", "irecv")

_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "broadcast": lambda p: 1.0, "barrier": lambda p: 0.0}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


@dataclass
class CommCounter:
    records: list = field(default_factory=list)

    def __enter__(self) -> "CommCounter":
        import torch.distributed as tdist

        self._saved = []
        modules = [("torch", tdist)]
        try:
            import deepspeed.comm as dcomm

            modules.append(("deepspeed", dcomm))
        except ImportError:
            pass
        world = tdist.get_world_size() if tdist.is_initialized() else 1
        for layer, mod in modules:
            for op in OPS:
                fn = getattr(mod, op, None)
                if fn is None:
                    continue
                self._saved.append((mod, op, fn))
                setattr(mod, op, self._wrap(layer, op, fn, world))
        return self

    def _wrap(self, layer, op, fn, world):
        def wrapped(*args, **kwargs):
            tensors = [a for a in args[:2] if isinstance(a, (torch.Tensor, list, tuple))]
            if op in ("all_gather_into_tensor", "all_gather"):
                payload = _nbytes(tensors[0]) if tensors else 0  # output holds all p pieces
            else:
                payload = _nbytes(tensors[-1] if op in ("reduce_scatter",) and len(tensors) > 1 else
                                  (tensors[0] if tensors else None))
            factor = _FACTOR.get(op, lambda p: (p - 1) / p)(world)
            self.records.append((layer, op, payload, payload * factor))
            return fn(*args, **kwargs)

        wrapped.__wrapped__ = fn
        return wrapped

    def __exit__(self, *exc) -> None:
        for mod, op, fn in reversed(self._saved):
            setattr(mod, op, fn)

    # -- summaries -----------------------------------------------------------------
    def count(self, layer: str = "deepspeed", ops: tuple[str, ...] | None = None) -> int:
        return sum(1 for l, o, _, _ in self.records if l == layer and (ops is None or o in ops))

    def wire_bytes(self, layer: str = "deepspeed", ops: tuple[str, ...] | None = None) -> float:
        return sum(w for l, o, _, w in self.records if l == layer and (ops is None or o in ops))

    def by_op(self, layer: str = "deepspeed") -> dict:
        out: dict = {}
        for l, o, p, w in self.records:
            if l == layer:
                c, pb, wb = out.get(o, (0, 0, 0.0))
                out[o] = (c + 1, pb + p, wb + w)
        return out

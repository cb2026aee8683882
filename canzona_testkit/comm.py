"""Count collective calls and bytes, by wrapping ``deepspeed.comm`` and ``torch.distributed``.

``with CommCounter() as c: ...`` records every collective issued inside the block as a
:class:`Record`: the layer ("torch" or "deepspeed"), the op, the size of the process group
it ran on, the payload the caller handed in (for all-gathers: the gathered output), and
the bytes one rank sends under the usual bandwidth-optimal algorithms with p ranks in THAT
group (ring / reduce-scatter based)::

    all_reduce                 2 (p-1)/p * n        reduce                 (p-1)/p * n
    all_gather(_into_tensor)     (p-1)/p * out      reduce_scatter(_tensor)  (p-1)/p * in
    broadcast                          n            all_to_all(_single)      (p-1)/p * n

DeepSpeed's calls reach torch.distributed through ``deepspeed.comm``; both layers are
wrapped, and ``count("deepspeed")`` / ``count("torch")`` keep them apart so nothing is
counted twice.  Neither layer sees every DeepSpeed collective: ``deepspeed.comm`` functions
call each other through module globals (``allgather_fn`` -> ``all_gather_into_tensor``, as
ZeRO-3's parameter gathers do), and its torch backend calls ``torch.distributed`` with keyword
arguments and through stored references (``all_gather_function``).  The third layer,
``"backend"``, wraps the methods of DeepSpeed's communication backend object
(``deepspeed.comm.comm.cdb``), through which every DeepSpeed collective passes exactly once;
arguments are bound by name.  The fourth, ``"direct"``, records the ``torch.distributed``
calls made outside that backend (canzona-ds's own all-to-alls and norms, user code), also
bound by name.  ``"backend"`` + ``"direct"`` is every collective once: what ZeRO-3
measurements count.  All-to-alls are counted exactly in both (the bytes leaving this rank:
the input minus this rank's own split), not by the formula.  ``by_group()`` splits counts by group size, ``by_group_ranks()`` by the
group's global ranks (the TP group vs the DP group of a DP x TP run).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

OPS = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "all_gather_object",
       "broadcast_object_list", "barrier", "send", "recv", "isend", "irecv")

#: DeepSpeed backend method -> (argument holding the payload, how its bytes are counted):
#: "allreduce" 2(p-1)/p, "ring" (p-1)/p (gathers: the gathered output; reductions: the input),
#: "broadcast" n, "a2a" exactly what leaves this rank
BACKEND_OPS = {
    "all_reduce": ("tensor", "allreduce"), "inference_all_reduce": ("tensor", "allreduce"),
    "all_reduce_coalesced": ("tensors", "allreduce"), "reduce": ("tensor", "ring"),
    "reduce_scatter": ("input_list", "ring"), "reduce_scatter_tensor": ("input_tensor", "ring"),
    "broadcast": ("tensor", "broadcast"), "all_gather": ("tensor_list", "ring"),
    "all_gather_into_tensor": ("output_tensor", "ring"), "all_gather_base": ("output_tensor", "ring"),
    "all_gather_coalesced": ("output_tensors", "ring"), "all_to_all_single": ("input", "a2a"),
    "all_to_all": ("input_tensor_list", "a2a"),
}

_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "broadcast": lambda p: 1.0 if p > 1 else 0.0,
           "barrier": lambda p: 0.0}


class Record(NamedTuple):
    layer: str
    op: str
    group_size: int
    payload_bytes: int
    wire_bytes: float
    #: global ranks of the process group (None: the default group)
    group_ranks: tuple | None = None


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _backend_signature(fn) -> tuple[inspect.Signature, bool]:
    """The signature of a backend method under DeepSpeed's decorators (``stage_on_cpu`` wraps
    it as ``wrapper(self, *args, **kwargs)`` without functools.wraps, keeping it as ``func``)."""
    f = getattr(fn, "__func__", fn)
    for _ in range(8):
        inner = inspect.getclosurevars(f).nonlocals.get("func") if getattr(f, "__closure__", None) else None
        if not callable(inner):
            break
        f = inner
    has_self = f is not fn  # unwrapped to the class's function: its first parameter is self
    return inspect.signature(f), has_self


#: torch.distributed function -> (argument holding the payload, how its bytes are counted), for
#: the "direct" layer (same conventions as BACKEND_OPS)
DIRECT_OPS = {
    "all_reduce": ("tensor", "allreduce"), "reduce": ("tensor", "ring"), "reduce_scatter": ("input_list", "ring"),
    "reduce_scatter_tensor": ("input", "ring"), "broadcast": ("tensor", "broadcast"),
    "all_gather": ("tensor_list", "ring"), "all_gather_into_tensor": ("output_tensor", "ring"),
    "all_to_all_single": ("input", "a2a"), "all_to_all": ("input_tensor_list", "a2a"),
}


def _bound_record(layer: str, op: str, bound: dict, spec: tuple[str, str]) -> Record:
    """A Record from arguments bound by name (``spec``: payload argument, byte rule)."""
    p, ranks = _group(bound.get("group"))
    name, kind = spec
    payload = _nbytes(bound.get(name))
    if kind == "a2a":
        wire = _a2a_sent(op, bound, p) if p > 1 else 0.0
    else:
        wire = payload * {"allreduce": _FACTOR["all_reduce"](p), "broadcast": _FACTOR["broadcast"](p),
                          "ring": (p - 1) / p}[kind]
    return Record(layer, op, p, payload, wire, ranks)


def _a2a_sent(op: str, bound: dict, p: int) -> float:
    """Bytes an all-to-all sends off this rank (its own chunk stays)."""
    import torch.distributed as tdist

    me = tdist.get_rank(bound.get("group")) if tdist.is_initialized() else 0
    if op == "all_to_all":
        chunks = list(bound.get("input_tensor_list") or [])
        return float(sum(_nbytes(t) for r, t in enumerate(chunks) if r != me))
    x = bound.get("input")
    splits = bound.get("input_split_sizes")
    if not isinstance(x, torch.Tensor):
        return 0.0
    if splits:
        return float((x.numel() - splits[me]) * x.element_size())
    return x.numel() * x.element_size() * (p - 1) / p


def _group(group) -> tuple[int, tuple | None]:
    """(size, global ranks or None for the default group) of a process group."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return 1, None
    if group is None or not isinstance(group, torch.distributed.ProcessGroup):
        return tdist.get_world_size(), None  # the default group (or a wrapper deepspeed.comm passes)
    return tdist.get_world_size(group), tuple(tdist.get_process_group_ranks(group))


@dataclass
class CommCounter:
    records: list = field(default_factory=list)

    def __enter__(self) -> "CommCounter":
        import torch.distributed as tdist

        self._saved = []
        self._depth = 0  # > 0 while inside a DeepSpeed backend call (its torch calls are not "direct")
        modules = [("torch", tdist)]
        try:
            import deepspeed.comm as dcomm

            modules.append(("deepspeed", dcomm))
        except ImportError:
            pass
        for layer, mod in modules:
            for op in OPS:
                fn = getattr(mod, op, None)
                if fn is None:
                    continue
                self._saved.append((mod, op, fn))
                setattr(mod, op, self._wrap(layer, op, fn))
        try:
            import deepspeed.comm.comm as dcomm_impl
        except ImportError:
            dcomm_impl = None
        cdb = getattr(dcomm_impl, "cdb", None)
        if cdb is not None:
            for op in BACKEND_OPS:
                fn = getattr(cdb, op, None)
                if fn is None:
                    continue
                self._saved.append((cdb, op, None))  # None: the instance attribute is deleted on exit
                setattr(cdb, op, self._wrap_backend(op, fn))
        return self

    def _wrap_backend(self, op, fn):
        sig, has_self = _backend_signature(fn)

        def wrapped(*args, **kwargs):
            bound = sig.bind_partial(*(((None,) if has_self else ()) + args), **kwargs).arguments
            self.records.append(_bound_record("backend", op, bound, BACKEND_OPS[op]))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        wrapped.__wrapped__ = fn
        return wrapped

    def _wrap(self, layer, op, fn):
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None

        def wrapped(*args, **kwargs):
            if layer == "torch" and self._depth == 0 and op in DIRECT_OPS and sig is not None:
                try:
                    bound = sig.bind_partial(*args, **kwargs).arguments
                except TypeError:
                    bound = None
                if bound is not None:
                    self.records.append(_bound_record("direct", op, bound, DIRECT_OPS[op]))
            group = kwargs.get("group")
            if group is None and sig is not None:
                try:
                    group = sig.bind_partial(*args, **kwargs).arguments.get("group")
                except TypeError:
                    group = None
            p, ranks = _group(group)
            tensors = [a for a in args[:2] if isinstance(a, (torch.Tensor, list, tuple))]
            if op in ("all_gather_into_tensor", "all_gather"):
                payload = _nbytes(tensors[0]) if tensors else 0  # output holds all p pieces
            elif op == "reduce_scatter" and len(tensors) > 1:
                payload = _nbytes(tensors[-1])
            else:
                payload = _nbytes(tensors[0]) if tensors else 0
            factor = _FACTOR.get(op, lambda q: (q - 1) / q)(p)
            self.records.append(Record(layer, op, p, payload, payload * factor, ranks))
            return fn(*args, **kwargs)

        wrapped.__wrapped__ = fn
        return wrapped

    def __exit__(self, *exc) -> None:
        for mod, op, fn in reversed(self._saved):
            if fn is None:
                delattr(mod, op)
            else:
                setattr(mod, op, fn)

    # -- summaries -----------------------------------------------------------------
    def count(self, layer: str = "deepspeed", ops: tuple[str, ...] | None = None) -> int:
        return sum(1 for r in self.records if r.layer == layer and (ops is None or r.op in ops))

    def wire_bytes(self, layer: str = "deepspeed", ops: tuple[str, ...] | None = None) -> float:
        return sum(r.wire_bytes for r in self.records if r.layer == layer and (ops is None or r.op in ops))

    def by_op(self, layer: str = "deepspeed") -> dict:
        """op -> (calls, payload bytes, wire bytes)."""
        out: dict = {}
        for r in self.records:
            if r.layer == layer:
                c, pb, wb = out.get(r.op, (0, 0, 0.0))
                out[r.op] = (c + 1, pb + r.payload_bytes, wb + r.wire_bytes)
        return out

    def by_group(self, layer: str = "torch") -> dict:
        """group size -> calls."""
        out: dict = {}
        for r in self.records:
            if r.layer == layer:
                out[r.group_size] = out.get(r.group_size, 0) + 1
        return out

    def by_group_ranks(self, layer: str = "torch") -> dict:
        """(op, group's global ranks or "world") -> calls: tells apart groups of equal size,
        e.g. the TP and the DP group of a DP x TP run."""
        out: dict = {}
        for r in self.records:
            if r.layer == layer:
                key = (r.op, r.group_ranks if r.group_ranks is not None else "world")
                out[key] = out.get(key, 0) + 1
        return out

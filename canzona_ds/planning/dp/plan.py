"""The plan type: :class:`OwnershipPlan` (which DP rank owns, i.e. updates and keeps the state
of, each matrix; for the mixed layout also who hosts the rest), and the checks and bookkeeping
every planner starts and ends with (``_validate``, ``_finish``)."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..params import ParamSpec

#: the mixed layout's planner name (planning/mixed.py); not an atomic planner
MIXED = "mixed"


@dataclass(frozen=True)
class OwnershipPlan:
    """Result of a DP planner over one parameter group (the matrices)."""

    planner: str
    world_size: int
    specs: tuple[ParamSpec, ...]
    #: owner rank of spec i (for ``equal_chunk``: the rank holding its first element)
    owner: tuple[int, ...]
    #: per rank, spec indices in buffer order
    rank_params: tuple[tuple[int, ...], ...]
    #: per rank, the cost-model load (e.g. Newton-Schulz FLOPs)
    rank_load: tuple[float, ...]
    #: per rank, elements of its parameters (before padding)
    rank_numel: tuple[int, ...]
    #: matrices cut by a rank boundary (only ``equal_chunk`` has any)
    split_params: tuple[int, ...] = ()
    cost_model: str = "numel"
    alpha: float | None = None
    plan_ms: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    #: mixed layout (``planner == "mixed"``, planning/mixed.py): the explicit buffer order
    order: tuple[int, ...] = ()
    #: mixed layout: per spec, the DP rank that computes its update (its owner, or the host of
    #: a hosted matrix); ``owner`` is -1 for hosted matrices
    host: tuple[int, ...] = ()

    @property
    def mixed(self) -> bool:
        return self.planner == MIXED

    @property
    def hosted(self) -> tuple[int, ...]:
        """Spec indices updated through the hosted step over the DP group (mixed layout)."""
        return tuple(i for i in self.order if self.owner[i] < 0) if self.mixed else ()

    @property
    def total_numel(self) -> int:
        return sum(s.numel for s in self.specs) if self.mixed else sum(self.rank_numel)

    def layout(self, param_alignment: int = 1, start_alignment: int | None = None):
        """The planned-padding layout of this plan (:func:`canzona_ds.planning.layout.plan_layout`,
        the one place padding is computed); defaults: DeepSpeed ZeRO's alignment."""
        from ..layout import DS_START_ALIGNMENT, plan_layout

        if self.mixed:
            from ..mixed import place

            return place([self.owner[i] for i in self.order], [self.specs[i].numel for i in self.order],
                         self.world_size, param_alignment,
                         DS_START_ALIGNMENT if start_alignment is None else start_alignment)
        if self.split_params:
            raise ValueError(f"planner {self.planner!r} splits matrices: it has no planned-padding layout.")
        return plan_layout([len(r) for r in self.rank_params], [self.specs[i].numel for i in self.buffer_order()],
                           param_alignment, DS_START_ALIGNMENT if start_alignment is None else start_alignment)

    @property
    def padding_fraction(self) -> float:
        """Padding of the planned layout (DeepSpeed's alignment) / useful elements; for
        ``equal_chunk`` the stock layout's tail padding.

        A plan whose rank 0 owns nothing (possible for ``naive_atomic``/``alpha_balanced``
        when a big matrix sits first) has no layout as labelled; the runtime relabels its
        ranks with :func:`~canzona_ds.planning.layout.nonempty_first` first, which changes
        no rank's contents, so the padding is that of the relabelled plan."""
        if self.mixed:
            return self.layout().padding_fraction
        if self.split_params or self.planner == "equal_chunk":
            chunk = -(-self.total_numel // self.world_size)
            return (chunk * self.world_size - self.total_numel) / self.total_numel if self.total_numel else 0.0
        return self.nonempty_first().layout().padding_fraction

    def nonempty_first(self) -> "OwnershipPlan":
        """This plan with its ranks relabelled by :func:`~canzona_ds.planning.layout.nonempty_first`
        (ranks that own something keep their order, empty ones move last), so that rank 0
        owns a matrix as the planned layout needs; ``self`` when that is already so.  No
        rank's contents change, so every balance metric is the same."""
        from ..layout import nonempty_first

        if self.mixed:  # the first buffer parameter is rank 0's or hosted: no relabelling needed
            return self
        order = nonempty_first(self.rank_params)
        if order == list(range(self.world_size)):
            return self
        if self.split_params:
            raise ValueError(f"planner {self.planner!r} splits matrices: its ranks cannot be relabelled.")
        new_of = {old: new for new, old in enumerate(order)}
        extra = dict(self.extra)
        if "bucket_rank_numel" in extra:
            extra["bucket_rank_numel"] = [[row[r] for r in order] for row in extra["bucket_rank_numel"]]
        return replace(self, rank_params=tuple(self.rank_params[r] for r in order),
                       rank_load=tuple(self.rank_load[r] for r in order),
                       rank_numel=tuple(self.rank_numel[r] for r in order),
                       owner=tuple(new_of[o] for o in self.owner), extra=extra)

    def rank_offsets(self, rank: int) -> list[tuple[int, int]]:
        """(spec index, element offset inside the rank's range) in buffer order."""
        out, off = [], 0
        for i in self.rank_params[rank]:
            out.append((i, off))
            off += self.specs[i].numel
        return out

    def buffer_order(self) -> list[int]:
        """All spec indices in flat-buffer order (rank 0's first)."""
        if self.order:
            return list(self.order)
        return [i for r in range(self.world_size) for i in self.rank_params[r]]

    def fingerprint(self) -> str:
        """Stable hash of everything the runtime layout depends on."""
        payload = {
            "planner": self.planner,
            "world_size": self.world_size,
            "specs": [(s.name, list(s.shape)) for s in self.specs],
            "rank_params": [list(r) for r in self.rank_params],
        }
        if self.mixed:
            payload["order"], payload["host"] = list(self.order), list(self.host)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _validate(specs: Sequence[ParamSpec], world_size: int, alpha: float | None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}. Must be an int >= 1.")
    if len(specs) == 0:
        raise ValueError("Empty parameter list: nothing to plan (specs=[]).")
    if alpha is not None and not (0.0 <= alpha <= 1.0):
        raise ValueError(f"Invalid alpha={alpha!r}. Must be within [0, 1].")


def _finish(
    planner: str,
    specs: Sequence[ParamSpec],
    world_size: int,
    rank_params: list[list[int]],
    loads: Sequence[float],
    t0: float,
    cost_model: str,
    alpha: float | None = None,
    split_params: tuple[int, ...] = (),
    owner: list[int] | None = None,
    rank_numel: list[int] | None = None,
    rank_load: list[float] | None = None,
    extra: dict | None = None,
) -> OwnershipPlan:
    if owner is None:
        owner = [-1] * len(specs)
        for r, idxs in enumerate(rank_params):
            for i in idxs:
                owner[i] = r
    if rank_numel is None:
        rank_numel = [sum(specs[i].numel for i in idxs) for idxs in rank_params]
    if rank_load is None:
        rank_load = [sum(loads[i] for i in idxs) for idxs in rank_params]
    return OwnershipPlan(
        planner=planner,
        world_size=world_size,
        specs=tuple(specs),
        owner=tuple(owner),
        rank_params=tuple(tuple(r) for r in rank_params),
        rank_load=tuple(float(x) for x in rank_load),
        rank_numel=tuple(rank_numel),
        split_params=split_params,
        cost_model=cost_model,
        alpha=alpha,
        plan_ms=(time.perf_counter() - t0) * 1e3,
        extra=dict(extra or {}),
    )

"""``CanzonaOptimizer``: one matrix rule on the matrices this rank updates, AdamW on the rest.

The optimizer holds no placement logic: it chooses a strategy (``canzona_ds/placement/``) and
runs it::

    placement="local"  every matrix is updated here (one process; ZeRO stage 0, where every
                       DP rank steps everything)
    placement="owned"  ZeRO stage 1/2: the DP ownership plan (planning/dp/) over
                       ``groups.dp_size``; ZeRO lays the matrix group out by it and binds this
                       rank's flat fp32 partition (:meth:`bind_partition`); no collective
    placement="sharded" ZeRO stage 3: every matrix in flat pieces over the DP group
                       (``groups.dp_group``); ZeRO binds this rank's flat fp32 partition and
                       the pieces (:meth:`bind_sharded`); per micro-group the pieces go to a
                       planned host, which runs the rule on the whole matrix (placement/sharded.py)
    + hosted           matrices split by tensor parallelism (``groups.tp_size`` > 1; Megatron
                       ``tensor_model_parallel``, AutoTP) go through the micro-group runtime

Process groups come in one :class:`~canzona_ds.parallel.ParallelGroups`; nothing here
discovers them.

Param groups (``canzona_role``)::

    "matrix"  the matrix rule; params in the DP plan's buffer order (rank 0's first)
    "aux"     AdamW (torch's functional AdamW, bit-exact vs torch.optim.AdamW)

Expert parallelism (DeepSpeed MoE, ``partitions``): each expert group (``groups.experts``)
gets its own pair, after the dense one, marked as DeepSpeed's ZeRO expects (``"moe": True``,
``"name"``: the expert group), and its own ownership plan over its expert-data-parallel group
(``canzona_partition``: the expert group's name; absent on the dense groups)::

    [matrix (dense, plan over DP)] [aux (dense)] [matrix (ep_size_2, plan over its EDP)] [aux (ep_size_2)] ...

Both groups carry ``lr`` and ``weight_decay`` read at every step, so any lr scheduler
drives them.  The optimizer's step count (``param_groups[matrix]["step"]``) is the
``step`` the rules see.  A parameter without a gradient is stepped with a zero gradient
(momentum and weight decay still apply): DeepSpeed's ZeRO does the same for every
optimizer, since its flat gradient partition has no "None", and the single-process
reference (``reference.py``) follows the same rule so that results stay equal.

Per-matrix rule state lives in ``matrix_state`` (name -> dict of tensors, on the matrix's
device), saved under ``"canzona"`` in :meth:`state_dict`.  Keyed by name, it can follow
its matrix to another rank when the DP or TP size changes.

An expert stack (a >= 3-D parameter of E experts along dim 0: ``planning.params.matrix_experts``)
is ONE parameter of the groups, the plan and ZeRO's layout (its experts stay together on one
owner: docs/zero.md explains why) and E matrices to the rule: E updates, E states keyed
``"<stack>[e]"``, E times one expert's cost.

Parameters are never tagged ``use_muon`` here, and the class name contains no "muon":
DeepSpeed's ZeRO would otherwise run its own Newton-Schulz on them.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Mapping

import torch
from torch import Tensor

from .parallel import ParallelGroups
from .placement import HOLDING, FlatView, HostedPlacement, StepContext, describe_matrix
from .planning.cost import stack_bound
from .planning.dp import OwnershipPlan, choose_layout
from .planning.params import ParamSpec
from .config import CanzonaConfig, MetricsConfig
from .optim.adamw import adamw_group_step
from .optim.rule import MatrixInfo

MATRIX, AUX = "matrix", "aux"
#: warn when keeping expert stacks whole forces the busiest DP rank above this x the average load
STACK_WARN_RATIO = 1.25
STATE_KEY = "canzona"

__all__ = ["AUX", "MATRIX", "STATE_KEY", "CanzonaOptimizer", "FlatView"]


def _mults(p: Tensor) -> tuple[float, float]:
    """A parameter's (weight-decay, lr) multipliers: its ``canzona_wd_mult`` / ``canzona_lr_mult``
    attributes (what Megatron's ``no_weight_decay_cond`` / ``scale_lr_cond`` / ``lr_mult`` decide,
    set by integration/megatron.py), 1.0 where unset."""
    out = []
    for attr in ("canzona_wd_mult", "canzona_lr_mult"):
        v = getattr(p, attr, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"Invalid {attr}={v!r} on a parameter of shape {list(p.shape)}. Must be a number >= 0.")
        out.append(float(v))
    return out[0], out[1]


def _matrix_mults(mats) -> tuple[float, float]:
    """The one multiplier class of a matrix group (the rule steps a partition's matrices as one group)."""
    classes: dict[tuple[float, float], list[str]] = {}
    for n, p in mats:
        classes.setdefault(_mults(p), []).append(n)
    if len(classes) > 1:
        raise ValueError("Matrices with different weight-decay / lr multipliers (canzona_wd_mult, canzona_lr_mult): "
                         + "; ".join(f"{k}: {v[:3]}" for k, v in classes.items())
                         + ". The matrix rule takes one class per group: exclude such matrices from the rule "
                         "(use_muon=False) or give them the same multipliers.")
    return next(iter(classes))


def _mult_keys(mult: tuple[float, float]) -> dict:
    """A group's multiplier keys (Megatron's scheduler reads ``wd_mult``; ``param_lr_mult`` scales
    its ``lr_mult``); none for the default class, so groups without multipliers are as before."""
    return {} if mult == (1.0, 1.0) else {"wd_mult": mult[0], "param_lr_mult": mult[1]}


class CanzonaOptimizer(torch.optim.Optimizer):
    """A matrix rule (Muon, Shampoo, SOAP, ...) + AdamW, placed by a strategy.

    Args:
        named_parameters: ``(name, parameter)`` pairs in the model's order; frozen ones are skipped.
        config: a :class:`CanzonaConfig` (``CanzonaConfig.from_ds(type, params)``).
        groups: the process groups (default: one process).  ``dp_size`` is what the
            "owned" plan balances over; ``tp_group``/``tp_size`` host the TP-split matrices.
        placement: "local", "owned" or "sharded" (module docstring).
        shapes: the whole shape of parameters whose tensor does not show it (ZeRO-3 partitions
            parameters built under ``deepspeed.zero.Init``), by name.
        partitions: parameter name -> expert group name for expert parameters (DeepSpeed MoE;
            each name one of ``groups.experts``); the others are dense.
        num_experts: the model config's number of experts, where one is at hand
            (``planning.params.model_num_experts``): every expert stack's dim 0 must equal it.
        metrics: the step metrics (:meth:`metrics`; default: on, DP reduction every 10 steps);
            ``MetricsConfig(enabled=False)`` records nothing.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], config: CanzonaConfig,
                 groups: ParallelGroups | None = None, placement: str = "local",
                 shapes: Mapping[str, tuple[int, ...]] | None = None,
                 partitions: Mapping[str, str] | None = None, num_experts: int | None = None,
                 metrics: MetricsConfig | None = None) -> None:
        if not isinstance(config, CanzonaConfig):
            raise TypeError(f"config must be a CanzonaConfig, got {type(config).__name__}")
        groups = ParallelGroups.single() if groups is None else groups
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a canzona_ds.parallel.ParallelGroups, got {type(groups).__name__}")
        if placement not in HOLDING:
            raise ValueError(f"Invalid placement={placement!r}. Allowed: {sorted(HOLDING)}.")
        given = list(named_parameters)
        named = [(n, p) for n, p in given if p.requires_grad]
        shapes = dict(shapes or {})
        shape_of = {n: tuple(shapes.get(n, tuple(p.shape))) for n, p in named}
        if not named:
            raise ValueError("CanzonaOptimizer got no trainable parameters.")
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError("A parameter appears twice in named_parameters (tied weights must be passed once).")
        self.config = config
        self.rule = config.rule
        self.groups = groups
        #: trainable parameter names in the order given (the model's): the order in which
        #: gradient clipping stacks per-parameter norms, as clip_grad_norm_(model.parameters())
        self.param_order = [n for n, _ in named]
        matrices, aux = [], []
        for n, p in named:
            (matrices if config.is_matrix(n, shape_of[n], getattr(p, "use_muon", None)) else aux).append((n, p))
        # an expert stack is E matrices (optim/rule.rule_step); an unknown >= 3-D parameter is refused
        experts = {n: config.experts_of(n, shape_of[n], num_experts) for n, p in matrices}
        #: every matrix's description, by name (full shape for TP-split matrices)
        self.infos: dict[str, MatrixInfo] = {}
        #: TP-split matrices (name -> TPMatrix), hosted over the TP group
        self.tp_matrices: dict = {}
        specs = []
        if placement == "sharded" and groups.tp_size > 1:
            raise ValueError(f"placement='sharded' (ZeRO stage 3) with tp_size={groups.tp_size}: ZeRO-3 x tensor "
                             "parallelism is not implemented; use ZeRO stage 1 with TP.")
        for n, p in matrices:
            if placement == "sharded":  # ZeRO-3: the whole shape, pieces over DP (no TP split)
                heads = getattr(p, "muon_num_heads", None) if config.per_head_muon and experts[n] is None else None
                self.infos[n] = MatrixInfo(n, shape_of[n], heads, experts[n])  # a stack: hosted per expert
                continue
            spec, info, tpm = describe_matrix(n, p, groups.tp_size, config.per_head_muon, experts[n])
            specs.append(spec)
            self.infos[n] = info
            if tpm is not None:
                self.tp_matrices[n] = tpm
        if self.tp_matrices and groups.tp_size < 2:
            raise ValueError(f"{len(self.tp_matrices)} matrices are tensor-parallel but tp_size={groups.tp_size}")
        if not matrices:
            warnings.warn(
                f"CanzonaOptimizer({self.rule.name}): no parameter qualifies as a matrix (ndim >= 2, name without "
                f"{list(config.placement.matrix_exclude)}); every parameter uses AdamW. Set matrix_include to "
                "change this.", stacklevel=2)
        unknown = sorted(set(partitions or {}) - {n for n, _ in given})
        if unknown:
            raise ValueError(f"partitions names {unknown[:3]}, which are not among named_parameters.")
        trainable = {n for n, _ in named}
        partitions = {n: key for n, key in (partitions or {}).items() if n in trainable}
        keys = [None] + sorted(set(partitions.values()))
        for key in keys[1:]:
            groups.expert(key)  # a ValueError naming the known expert groups
        split_experts = [n for n in self.tp_matrices if n in partitions]
        if split_experts:  # whole experts with TP-split dense matrices are fine (docs/moe.md)
            first = split_experts[0]
            raise ValueError(f"Expert parameter {first!r} (expert group {partitions[first]!r}) is tensor-parallel:"
                             " experts split over tensor parallelism are not supported; keep the "
                             "experts whole on every TP rank (deepspeed.moe.layer.MoE with "
                             "enable_expert_tensor_parallelism=False).")
        spec_of = dict(zip([n for n, _ in matrices], specs))
        #: the ownership plan of each partition's matrices over its DP group ("owned" placement;
        #: None: dense, else the expert group's name); ``plan`` is the dense one
        self.plans: dict[str | None, OwnershipPlan] = {}
        #: matrix names per partition, in param-group (buffer) order
        self.partition_matrices: dict[str | None, list[str]] = {}
        param_groups = []
        group_names: list[list[str]] = []
        ordered_matrices, ordered_aux = [], []
        for key in keys:
            mats = [(n, p) for n, p in matrices if partitions.get(n) == key]
            rest = [(n, p) for n, p in aux if partitions.get(n) == key]
            if mats and placement == "owned":
                self.plans[key] = _plan([spec_of[n] for n, _ in mats], groups.partition_size(key), config, self.rule,
                                       grid=groups.grid_group is not None)
                mats = [mats[i] for i in self.plans[key].buffer_order()]
            moe = {} if key is None else {"moe": True, "name": key, "canzona_partition": key}
            if mats:
                self.partition_matrices[key] = [n for n, _ in mats]
                mult = _matrix_mults(mats)
                param_groups.append(dict(params=[p for _, p in mats], canzona_role=MATRIX, lr=config.lr * mult[1],
                                         weight_decay=config.weight_decay * mult[0], step=0, **moe,
                                         **_mult_keys(mult)))
                group_names.append([n for n, _ in mats])
            # AdamW: one group per (weight-decay, lr) multiplier class (module doc), in the model's order
            classes: dict[tuple[float, float], list] = {}
            for n, p in rest:
                classes.setdefault(_mults(p), []).append((n, p))
            for mult, members in classes.items():
                param_groups.append(dict(params=[p for _, p in members], canzona_role=AUX,
                                         lr=config.adam_lr * mult[1], betas=tuple(config.adam_betas),
                                         eps=config.adam_eps, weight_decay=config.weight_decay * mult[0], **moe,
                                         **_mult_keys(mult)))
                group_names.append([n for n, _ in members])
                ordered_aux += members
            ordered_matrices += mats
        #: the DP ownership plan of the dense matrices (None: none, or every matrix is updated here)
        self.plan: OwnershipPlan | None = self.plans.get(None)
        #: the parameter names of every param group, in its order
        self.group_names = group_names
        self.matrix_names = [n for n, _ in ordered_matrices]
        self.aux_names = [n for n, _ in ordered_aux]
        super().__init__(param_groups, {})
        #: rule state by matrix name (this rank's owned/local matrices and hosted TP matrices; one
        #: entry per expert of a stack, ``"<stack>[e]"``)
        self.matrix_state: dict[str, dict[str, Tensor]] = {}
        #: whole shape of every trainable parameter, by name
        self.shapes = shape_of
        #: DeepSpeed MoE's expert groups and whole-model names (integration/moe.MoEInfo; None: no MoE)
        self.moe = None
        #: parameter name here -> its name in the whole model, where the module names it otherwise
        #: (a pipeline stage's ``canonical_names()``: the plain model's names), for checkpoints
        self.whole_names: dict[str, str] = {}
        #: the mixed ZeRO layout: this rank's piece of the element-wise rule state of every matrix
        #: hosted over DP (MatrixRule.elementwise_state, e.g. Muon's momentum), by name; the host's
        #: matrix_state entry holds the other keys
        self.piece_state: dict[str, dict[str, Tensor]] = {}
        #: every rule-state key's matrix: the infos, with each stack replaced by its experts
        self.state_infos: dict[str, MatrixInfo] = {i.name: i for info in self.infos.values()
                                                   for i in info.state_infos()}
        #: MuonClip's QK-clip (optim/qk_clip.QKClip; None: off): set by :meth:`enable_qk_clip`
        self.qk_clip = None
        self.placement = HOLDING[placement](self.matrix_names)
        self.set_metrics(MetricsConfig() if metrics is None else metrics)
        if placement == "local":
            self.placement.track(ordered_matrices)
            self.placement.hosted = self._hosted(self.matrix_names)

    # ------------------------------------------------------------------ placement
    @property
    def tp_group(self):
        return self.groups.tp_group

    @property
    def tp_size(self) -> int:
        return self.groups.tp_size

    @property
    def tp_runtime(self):
        """The micro-group runtime of the hosted matrices (None without any); where a rank runs
        several (the mixed layout under TP), a :class:`~canzona_ds.placement.hosted.RuntimeSet`
        that reads them as one (matrices, hosted names, summed stats and collectives)."""
        return None if self.placement.hosted is None else self.placement.hosted.runtime

    @tp_runtime.setter
    def tp_runtime(self, runtime) -> None:  # benchmarks and tests swap in a baseline runtime
        if self.placement.hosted is None:
            raise RuntimeError("This optimizer hosts no TP-split matrices.")
        if not isinstance(self.placement.hosted, HostedPlacement):
            raise RuntimeError("This optimizer runs several hosted runtimes (the mixed layout under TP); swap one "
                               "of placement.hosted.parts[i].runtime instead.")
        self.placement.hosted.runtime = runtime

    def _hosted(self, names: list[str]) -> HostedPlacement | None:
        """The hosted strategy for the split matrices among ``names`` (None if there are none)."""
        split = [self.tp_matrices[n] for n in names if n in self.tp_matrices]
        if not split:
            return None
        return HostedPlacement(split, self.rule, self.groups.tp_group, self.config.tp, self.matrix_state)

    def bind_partition(self, flat_param: Tensor, views: Iterable[FlatView], dp_hosted: list | None = None,
                       dp_group=None, partition: str | None = None) -> None:
        """ZeRO: ``flat_param`` (this rank's partition of the matrix group) holds ``views``.  The
        mixed layout: ``views`` also holds this rank's piece (1-D, maybe empty) of every hosted
        matrix, and ``dp_hosted`` their cuts, hosted where the plan says:
        :class:`~canzona_ds.tp.runtime.FlatSplit` over ``dp_group`` (matrices not split by TP),
        :class:`~canzona_ds.tp.runtime.GridSplit` over ``groups.grid_group`` (TP-split ones: the
        plan's DP host, at the TP rank :func:`~canzona_ds.planning.mixed.grid_tp_hosts` picks, seeded with
        the owned TP runtime's load on each cell: :func:`~canzona_ds.planning.mixed.tp_cells`).
        Under TP a rank then runs up to three runtimes, in this order on every rank: the owned
        TP-split matrices over the TP group, the flat ones over DP, the grid ones.

        ``partition``: the matrix group's partition (None: dense; DeepSpeed MoE: its expert
        group's name), whose plan places the hosted matrices and whose DP group (an expert
        group's expert-data-parallel group) is ``dp_group``: every matrix group gets its own
        hosted strategy, stepped in that group's step."""
        if self.placement.kind != "owned":
            raise RuntimeError(f"bind_partition on a CanzonaOptimizer with placement={self.placement.kind!r}; ZeRO "
                               "stage 1/2 needs placement='owned'.")
        make = self._hosted
        if dp_hosted:
            from .placement import HostedSet
            from .planning.mixed import tp_cells
            from .tp.runtime import GridSplit

            if partition not in self.plans:
                raise RuntimeError(f"bind_partition: no ownership plan for partition {partition!r} (plans: "
                                   f"{sorted(self.plans, key=str)}).")
            plan = self.plans[partition]
            index = {s.name: i for i, s in enumerate(plan.specs)}
            unplanned = [m.name for m in dp_hosted if m.name not in index]
            if unplanned:
                raise RuntimeError(f"bind_partition: hosted matrices {unplanned[:3]} are not in the plan of partition "
                                   f"{partition!r}.")
            flat = [m for m in dp_hosted if not isinstance(m, GridSplit)]
            grid = [m for m in dp_hosted if isinstance(m, GridSplit)]
            wrong = [m.name for m in flat if m.name in self.tp_matrices] + \
                [m.name for m in grid if m.name not in self.tp_matrices]
            if wrong:
                raise RuntimeError(f"bind_partition: {wrong[:3]} are cut as if they were (not) tensor-parallel; a "
                                   "TP-split matrix's hosted cut is a GridSplit, any other's a FlatSplit.")
            if grid and self.groups.grid_group is None:
                raise RuntimeError("The mixed layout hosts tensor-parallel matrices over the DP x TP grid, but "
                                   "groups.grid_group is None (integration/groups.with_grid_group builds it).")
            dp_hosts = [plan.host[index[m.name]] for m in grid]
            # the TP rank of each grid host: balanced with what the owned TP runtime already puts on
            # each (dp, tp) cell, from the plan alone (every rank the same; planning/mixed.tp_cells)
            tp_hosts = []
            if grid:
                tpc = self.config.tp
                grid_tp = tp_cells(plan, self.groups.tp_size, self.rule, scheduler=tpc.scheduler, c_max=tpc.c_max,
                                   cost=tpc.cost, full_shapes={n: m.full_shape for n, m in self.tp_matrices.items()}
                                   )["grid_tp"]
                planned = sorted(plan.specs[i].name for i in grid_tp)
                if planned != sorted(m.name for m in grid):
                    raise RuntimeError(f"bind_partition: the plan hosts {planned[:3]}... over the DP x TP grid, the "
                                       f"layout cut {sorted(m.name for m in grid)[:3]}... as GridSplits.")
                tp_hosts = [grid_tp[index[m.name]] for m in grid]
            hosted = {m.name for m in dp_hosted}

            def make_mixed(names: list[str]):
                parts = []
                owned = self._hosted([n for n in names if n not in hosted])  # owned TP-split: over TP
                if owned is not None:
                    parts.append(owned)
                if flat:
                    parts.append(HostedPlacement(flat, self.rule, dp_group, self.config.tp, self.matrix_state,
                                                 hosts=[plan.host[index[m.name]] for m in flat],
                                                 piece_states=self.piece_state))
                if grid:
                    parts.append(HostedPlacement(grid, self.rule, self.groups.grid_group, self.config.tp,
                                                 self.matrix_state,
                                                 hosts=[m.rank_of(t, h) for m, t, h in zip(grid, tp_hosts, dp_hosts)],
                                                 piece_states=self.piece_state))
                return parts[0] if len(parts) == 1 else HostedSet(parts)

            make = make_mixed
        self.placement.bind(flat_param, views, make_hosted=make)

    def bind_sharded(self, partition_numel: int, pieces: Iterable, splits: Iterable, group=None) -> None:
        """ZeRO-3: the matrix group's flat fp32 partition (``partition_numel`` elements) holds
        ``pieces`` (:class:`~canzona_ds.placement.FlatPiece`, in ``matrix_names`` order); every
        matrix is cut over ``group`` (default: the DP group) as ``splits``
        (:class:`~canzona_ds.tp.FlatSplit`)."""
        if self.placement.kind != "sharded":
            raise RuntimeError(f"bind_sharded on a CanzonaOptimizer with placement={self.placement.kind!r}; ZeRO "
                               "stage 3 needs placement='sharded'.")
        self.placement.bind(partition_numel, list(pieces), list(splits), self.rule,
                            self.groups.dp_group if group is None else group, self.config.tp, self.matrix_state)

    def set_metrics(self, config: MetricsConfig) -> None:
        """Record the step metrics as ``config`` says (the DeepSpeed integration passes the
        ds_config's ``canzona_metrics`` section); the DP reduction runs over ``groups.dp_group``."""
        from .step_metrics import StepRecorder

        if not isinstance(config, MetricsConfig):
            raise TypeError(f"metrics must be a canzona_ds.config.MetricsConfig, got {type(config).__name__}")
        self.metrics_recorder = StepRecorder(config, self.groups.dp_group, self._device) if config.enabled else None

    def metrics(self):
        """The last step's :class:`~canzona_ds.step_metrics.StepMetrics` on this rank (None before
        the first step, or with metrics off); docs/optimizers.md, "Step metrics"."""
        return None if self.metrics_recorder is None else self.metrics_recorder.last()

    @property
    def step_stats(self):
        """What the last step's hosted runtime did on this rank (``StepStats``: collectives,
        bytes_sent, flops), or None without hosted matrices."""
        runtime = self.tp_runtime
        return None if runtime is None else runtime.stats

    def expected_collectives(self) -> dict[str, int]:
        """Collectives one step of the hosted runtime(s) issues on this rank, from the plans
        alone (summed over the runtimes, each on its own group)."""
        runtime = self.tp_runtime
        return {} if runtime is None else runtime.expected_collectives()

    def handled_names(self) -> list[str]:
        """Matrices whose rule state this rank keeps: owned/local ones that are not TP-split,
        and the TP-split ones it hosts."""
        return self.placement.handled_names()

    def handled_state_names(self) -> list[str]:
        """The rule-state keys of :meth:`handled_names` (an expert stack's: one per expert)."""
        return [i.name for n in self.handled_names() for i in self.infos[n].state_infos()]

    def enable_qk_clip(self, layers: list, group=None) -> None:
        """Turn on ``config.qk_clip`` for ``layers`` (:class:`~canzona_ds.optim.qk_clip.AttentionLayer`,
        whose ``observe`` the model's forward calls), reduced over ``group`` (the DP group).

        Every q/k projection must be a matrix of the rule (AdamW's flat pieces are not head
        rows) and an expert-free 2-D parameter of this optimizer."""
        from .optim.qk_clip import QKClip

        if self.config.qk_clip is None:
            raise ValueError("enable_qk_clip on an optimizer whose config has no qk_clip section.")
        found = len(layers)
        if self.groups.pp_size > 1:  # a stage may hold no attention layer, the whole pipeline must
            import torch.distributed as dist

            count = torch.tensor([found], dtype=torch.int64, device=self._device())
            dist.all_reduce(count, group=self.groups.pp_group)  # once, at construction
            found = int(count.item())
        if not found:
            raise ValueError("qk_clip is on but the model has no attention layer it can clip (looked for q_proj/k_proj "
                             "attention modules: the project's Qwen3Attention, transformers' Llama-style attention"
                             + (f"; none on any of the {self.groups.pp_size} pipeline stages" if self.groups.pp_size > 1
                                else "") + ").")
        for layer in layers:
            for n, rows in ((layer.q_name, layer.num_heads * layer.head_dim),
                            (layer.k_name, layer.num_kv_heads * layer.head_dim)):
                if n not in self.infos:
                    why = "an AdamW parameter (matrix_exclude)" if n in self.shapes else "not a trainable parameter"
                    raise ValueError(f"qk_clip: {n!r} is {why}; QK-clip scales the head rows of q/k projections "
                                     "updated by the matrix rule.")
                info = self.infos[n]
                tpm = self.tp_matrices.get(n)
                if tpm is not None:
                    # tensor-parallel: this rank records its own heads, which must be exactly the
                    # rows of its shard (column-parallel, one block: the TP layout is the natural one)
                    r = self.groups.tp_rank
                    if tpm.partition_dim != 0 or tpm.shard_sizes[r] != rows:
                        raise ValueError(
                            f"qk_clip: {n!r} is tensor-parallel (partition_dim={tpm.partition_dim}, shard rows "
                            f"{list(tpm.shard_sizes)}) but its attention layer on TP rank {r} has "
                            f"{rows // layer.head_dim} heads x {layer.head_dim} = {rows} rows: QK-clip needs W_q/W_k "
                            "split on their rows "
                            "(column-parallel, unfused), each TP rank's shard holding exactly its own heads.")
                    layer.tp_rows[n] = (sum(tpm.shard_sizes[:r]), info.shape[0])
                elif info.num_experts is not None or len(info.shape) != 2 or info.shape[0] != rows:
                    raise ValueError(f"qk_clip: {n!r} has shape {list(info.shape)}, not ({rows}, hidden) as its "
                                     f"attention layer's {layer.num_heads} heads x {layer.head_dim} imply.")
        self.qk_clip = QKClip(self.config.qk_clip, layers, group)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rec = self.metrics_recorder
        whole = rec.span() if rec is not None else None
        matrix = []  # one span per matrix group (under MoE they alternate with AdamW groups)
        for group in self.param_groups:
            if not group["params"]:  # ZeRO-3 steps one sub-group at a time, the other groups empty
                continue
            if group["canzona_role"] == MATRIX:
                span = rec.span() if rec is not None else None
                self._matrix_step(group)
                if span is not None:
                    matrix.append(span.stop())
            else:
                adamw_group_step(group, self.state)
        if rec is not None:
            if matrix:
                rec.matrix_call(matrix, self.step_stats, None if self.qk_clip is None else self.qk_clip.stats)
            rec.step_call(whole)
            if not rec.engine_closes:
                rec.close()
        return loss

    def _matrix_step(self, group: dict) -> None:
        group["step"] += 1
        ctx = StepContext(self.rule, self.infos, self.matrix_state, group["step"], group["lr"], group["weight_decay"])
        if self.qk_clip is not None:
            # one all-reduce(MAX) per step, at the step's first matrix group (every rank of the
            # DP group steps it); the factors land on the whole matrices right after their update
            ctx.qk_scales = self.qk_clip.row_scales(group["step"], self._device())
        self.placement.step(group, ctx)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd[STATE_KEY] = {
            "rule": self.rule.name,
            "matrix_state": {n: dict(st) for n, st in self.matrix_state.items()},
            "piece_state": {n: dict(st) for n, st in self.piece_state.items()},
            "config": self.config.describe(),
        }
        return sd

    def global_name(self, name: str) -> str:
        """``name``'s name in the whole model: a DeepSpeed MoE expert renumbered globally, a
        pipeline stage's parameter by the plain model's name (``whole_names``)."""
        moe = self.moe
        name = moe.global_names.get(name, name) if moe is not None else name
        return self.whole_names.get(name, name)

    def load_state_dict(self, state_dict: Mapping) -> None:
        state_dict = dict(state_dict)
        canzona = state_dict.pop(STATE_KEY, None)
        super().load_state_dict(state_dict)
        if canzona is None:
            return
        if canzona.get("rule") != self.rule.name:
            raise ValueError(f"This optimizer state was written by rule {canzona.get('rule')!r}; this optimizer runs "
                             f"{self.rule.name!r}. Load it with the same optimizer type.")
        self.load_matrix_state(canzona["matrix_state"])
        self.load_piece_state(canzona.get("piece_state", {}))

    def load_matrix_state(self, matrix_state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Replace the rule state of the matrices named in ``matrix_state``, each tensor moved
        to that matrix's device (keeping its dtype)."""
        device = self._device()
        for name, st in matrix_state.items():
            if name not in self.state_infos:
                raise ValueError(f"Saved optimizer state has matrix {name!r}, which this model does not have.")
            self.matrix_state[name] = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in st.items()}

    def load_piece_state(self, piece_state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Replace this rank's pieces of hosted matrices' element-wise state (mixed layout)."""
        device = self._device()
        self.piece_state.clear()
        for name, st in piece_state.items():
            if name not in self.infos:
                raise ValueError(f"Saved optimizer state has matrix {name!r}, which this model does not have.")
            self.piece_state[name] = {k: v.to(device) for k, v in st.items()}

    def _device(self) -> torch.device:
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")


def _plan(specs: list[ParamSpec], dp: int, config: CanzonaConfig, rule, grid: bool = False) -> OwnershipPlan:
    """The ownership plan of one partition's matrices; ``grid``: a DP x TP grid group exists, so
    the mixed layout may host TP-split matrices (tp/runtime.GridSplit)."""
    placement = config.placement
    tp_split = [s.name for s in specs if s.is_tp_split]
    if placement.layout == "mixed" and tp_split and not grid:
        raise ValueError(f"layout='mixed' hosts tensor-parallel matrices ({len(tp_split)} here, e.g. "
                         f"{tp_split[0]!r}) over the DP x TP grid, but no grid group was given "
                         "(ParallelGroups.grid_group; the DeepSpeed integration builds it at ZeRO stage 1/2). Use "
                         "layout 'owned' or 'auto', or pass groups with a grid_group.")
    plan, _, why = choose_layout(specs, dp, layout=placement.layout, max_padding=placement.max_padding,
                                 planner=placement.planner, alpha=placement.alpha, cost=placement.cost_model,
                                 model=rule, bucket_numel=placement.bucket_numel,
                                 # (under MoE each matrix group by the same rule, over its own DP group)
                                 allow_mixed=grid or not tp_split,
                                 blocked="tensor-parallel ones without a DP x TP grid group")
    plan.extra["layout_choice"] = why  # reported in checkpoints (canzona_layout.layout_choice)
    if "cannot host" in why:
        warnings.warn(f"CanzonaOptimizer: {why} (DP={dp}); the replicated ZeRO buffer carries that padding.",
                      stacklevel=3)
    if plan.split_params:
        raise ValueError(f"planner={placement.planner!r} cut {len(plan.split_params)} matrices across ranks; "
                         "a matrix optimizer needs every matrix whole on one rank.")
    if sorted(plan.buffer_order()) != list(range(len(specs))):
        raise RuntimeError(f"Planner {placement.planner!r} did not assign every matrix exactly once.")
    bound = stack_bound(specs, dp, placement.cost_model, rule)
    if bound > STACK_WARN_RATIO:
        warnings.warn(f"An expert stack bounds the DP plan: its busiest rank carries >= {bound:.2f}x the average "
                      f"{placement.cost_model} load at dp={dp}, because ZeRO-1/2 keeps each stack of experts whole on "
                      "one owner (docs/zero.md, 'Mixture of experts'). Expert parallelism (fewer experts per stack and "
                      "rank) or a smaller DP group balances it; `canzona-plan` shows the ratios.", stacklevel=3)
    if plan.mixed:
        return plan
    return plan.nonempty_first()  # rank 0 must own a matrix (planning/layout.py): relabel ranks

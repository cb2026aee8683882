"""Process groups, read once, into a :class:`~canzona_ds.parallel.ParallelGroups`.

The only place canzona-ds discovers groups.  What users have, and where it is read from:

    plain DP (no mpu)                   the engine's data-parallel group
    Megatron parallel_state / mpu       get_tensor_model_parallel_* , get_data_parallel_*,
                                        get_pipeline_model_parallel_* (when present)
    PipelineModule (PipelineEngine)     its PipelineParallelGrid (engine.mpu): data, slice
                                        (= tensor) and pipe groups
    DeepSpeed AutoTP                    deepspeed.utils.groups (DeepSpeed sets engine.mpu to it)
    DeepSpeed MoE (expert parallelism)  deepspeed.utils.groups' expert-parallel and expert-data-
                                        parallel groups, one pair per expert group name

An mpu's *model-parallel* group spans pipeline AND tensor ranks on a pipeline grid, so the
tensor group is read by its tensor/slice names first and by the legacy model-parallel name
only where nothing else exists (old Megatron, where model parallel meant tensor parallel).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from ..parallel import ExpertGroups, ParallelGroups


def _call(obj: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for n in names:
        fn = getattr(obj, n, None)
        if callable(fn):
            return fn()
    if default is not None:
        return default
    raise ValueError(f"mpu {type(obj).__name__} has none of {list(names)}.")


_TP = {"group": ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group"),
       "rank": ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"),
       "size": ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                "get_model_parallel_world_size")}
_PP = {"group": ("get_pipeline_model_parallel_group", "get_pipe_parallel_group"),
       "rank": ("get_pipeline_model_parallel_rank", "get_pipe_parallel_rank"),
       "size": ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")}


def groups_from_mpu(mpu, source: str = "mpu") -> ParallelGroups:
    """Every degree an mpu reports (Megatron's, a PipelineParallelGrid, DeepSpeed's groups)."""
    if any(callable(getattr(mpu, n, None)) for n in _PP["size"]) and \
            not callable(getattr(mpu, "get_tensor_model_parallel_group", None)) and \
            not callable(getattr(mpu, "get_slice_parallel_group", None)):
        raise ValueError(f"mpu {type(mpu).__name__} has pipeline groups but no tensor-parallel group getter "
                         "(get_tensor_model_parallel_group or get_slice_parallel_group): its model-parallel group "
                         "would mix pipeline stages with tensor shards.")
    tp_size = int(_call(mpu, _TP["size"]))
    pp_size = int(_call(mpu, _PP["size"], default=1))
    return ParallelGroups(
        dp_size=int(_call(mpu, ("get_data_parallel_world_size",))),
        dp_rank=int(_call(mpu, ("get_data_parallel_rank",))),
        dp_group=_call(mpu, ("get_data_parallel_group",)),
        tp_size=tp_size, tp_rank=int(_call(mpu, _TP["rank"])) if tp_size > 1 else 0,
        tp_group=_call(mpu, _TP["group"]) if tp_size > 1 else None,
        pp_size=pp_size, pp_rank=int(_call(mpu, _PP["rank"], default=0)) if pp_size > 1 else 0,
        pp_group=_call(mpu, _PP["group"]) if pp_size > 1 else None,
        source=source)


def groups_from_deepspeed() -> ParallelGroups:
    """The groups DeepSpeed created for AutoTP (``deepspeed.utils.groups``); where DeepSpeed has no
    tensor-parallel group and no mpu (plain data parallelism, e.g. a client optimizer built before
    ``deepspeed.initialize`` without an mpu), its data-parallel group, as the engine will take it."""
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    if groups.mpu is None and groups.mesh_device is None and groups._TENSOR_MODEL_PARALLEL_GROUP is None:
        dp = groups._get_data_parallel_group()
        return ParallelGroups(dp_size=dist.get_world_size(group=dp), dp_rank=dist.get_rank(group=dp), dp_group=dp,
                              source="dp")
    return groups_from_mpu(groups, source="autotp")


def groups_from_engine(engine) -> ParallelGroups:
    """An engine's groups: its mpu (Megatron, a PipelineModule grid, AutoTP) or plain DP."""
    mpu = getattr(engine, "mpu", None)
    if mpu is not None:
        source = "pipeline" if getattr(engine, "pipeline_parallelism", False) else (
            "autotp" if getattr(engine, "autotp_size", lambda: 0)() > 1 else "mpu")
        return groups_from_mpu(mpu, source=source)
    from deepspeed import comm as dist

    group = engine.seq_data_parallel_group
    return ParallelGroups(dp_size=dist.get_world_size(group=group), dp_rank=dist.get_rank(group=group),
                          dp_group=group, source="dp")


def require_tp_group(named: list, groups: ParallelGroups, who: str, hint: Callable[[], str] | None = None) -> None:
    """Refuse TP-tagged parameters when no TP group exists: every rank would update its own
    shard as if it were the whole matrix (an approximation, not the TP=1 update)."""
    if groups.tp_size > 1:
        return
    tagged = [n for n, p in named if getattr(p, "tensor_model_parallel", False)
              and (hasattr(p, "partition_dim") or getattr(p, "ds_autotp_universal_checkpoint_meta", None))]
    if tagged and groups.source in ("single", "dp"):
        raise ValueError(
            f"{len(tagged)} parameters are marked tensor_model_parallel (e.g. {tagged[0]!r}) but {who} found no TP "
            "group: deepspeed.initialize got no mpu. Pass mpu=<Megatron parallel_state> to deepspeed.initialize (or "
            "use tensor_parallel.autotp_size)." + (hint() if hint else ""))


def with_expert_groups(groups: ParallelGroups, names: Iterable[str]) -> ParallelGroups:
    """``groups`` with DeepSpeed MoE's expert groups ``names`` (the ``group_name`` of the expert
    parameters, e.g. "ep_size_2") read from ``deepspeed.utils.groups``; ``ep_*`` are the largest
    expert group's."""
    from deepspeed import comm as dist
    from deepspeed.utils import groups as ds_groups

    experts = []
    for name in sorted(set(names)):
        try:
            ep, edp = ds_groups._get_expert_parallel_group(name), ds_groups._get_expert_data_parallel_group(name)
        except (KeyError, AssertionError) as exc:
            raise ValueError(f"Expert parameters name expert group {name!r}, which DeepSpeed has not created "
                             "(deepspeed.initialize creates one per deepspeed.moe.layer.MoE ep_size).") from exc
        experts.append(ExpertGroups(name, dist.get_world_size(group=ep), dist.get_rank(group=ep), ep,
                                    dist.get_world_size(group=edp), dist.get_rank(group=edp), edp))
    if not experts:
        return groups
    largest = max(experts, key=lambda e: e.ep_size)
    return dataclasses.replace(groups, experts=tuple(experts), ep_size=largest.ep_size, ep_rank=largest.ep_rank,
                               ep_group=largest.ep_group if largest.ep_size > 1 else None)


def with_grid_group(groups: ParallelGroups) -> ParallelGroups:
    """``groups`` with the DP x TP grid of this rank's pipeline stage (``grid_group``,
    ``grid_cells``), over which the mixed ZeRO-1/2 layout hosts tensor-parallel matrices
    (tp/runtime.GridSplit).  A collective over the whole world: every rank posts its
    (pp_rank, dp_rank, tp_rank), then every rank creates one group per pipeline stage, stages in
    order (``new_group`` must be called by every rank, in the same order); torch numbers a
    group's ranks in global-rank order, so each group rank's (tp_rank, dp_rank) is recorded."""
    import torch.distributed as dist

    if groups.tp_size < 2 or not dist.is_initialized():
        return groups
    coords: list = [None] * dist.get_world_size()
    dist.all_gather_object(coords, (groups.pp_rank, groups.dp_rank, groups.tp_rank))
    me = dist.get_rank()
    stages = []
    for stage in sorted({c[0] for c in coords}):
        ranks = sorted(r for r, c in enumerate(coords) if c[0] == stage)
        stage_cells = tuple((coords[r][2], coords[r][1]) for r in ranks)
        if len(ranks) != groups.dp_size * groups.tp_size or len(set(stage_cells)) != len(ranks):
            # another parallel dimension shares the stage (e.g. sequence parallelism): no grid, so
            # the mixed layout hosts no TP-split matrices (optim._plan says so); the same on every rank
            return groups
        stages.append((ranks, stage_cells))
    mine, cells = None, ()
    for ranks, stage_cells in stages:
        group = dist.new_group(ranks)
        if me in ranks:
            mine, cells = group, stage_cells
    return dataclasses.replace(groups, grid_group=mine, grid_cells=cells)

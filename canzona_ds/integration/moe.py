"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``, Megatron-DeepSpeed's MoE): which parameters are
experts, which expert group each belongs to, and each one's name in the whole model.

DeepSpeed marks an expert parameter with ``allreduce = False`` and ``group_name`` (the expert
group, ``"ep_size_<n>"``); an MoE layer with ``num_experts`` E over ``ep_size`` ranks holds
``E / ep_size`` local experts, ``...deepspeed_moe.experts.deepspeed_experts.<local id>.*``, and
local expert ``j`` on expert-parallel rank ``k`` is global expert ``k * E/ep_size + j`` (the
numbering DeepSpeed's expert checkpoint files use)::

    world 4, ep_size 2          expert-parallel groups {0,1} {2,3}: different experts
    rank 0: experts 0,1         expert-data-parallel groups {0,2} {1,3}: the same experts,
    rank 1: experts 2,3         their gradients averaged (divided by the DP size, summed over
    rank 2: experts 0,1         the expert-DP group), their ownership planned over it
    rank 3: experts 2,3

:class:`MoEInfo` is what the optimizer build and gradient clipping need: the partition of every
expert parameter (its expert group's name) and the whole model's parameter order with every
expert in it (the order ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms in, for a
single-process model holding every expert).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..parallel import ParallelGroups
from .ds_compat import checkpoint_mp_rank

EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


@dataclass(frozen=True)
class MoEInfo:
    #: expert parameter name -> its expert group name ("ep_size_2")
    partitions: dict = field(default_factory=dict)
    #: local parameter name -> its name in the whole model (experts renumbered globally)
    global_names: dict = field(default_factory=dict)
    #: every trainable parameter of the whole model, in its order (all experts of every layer)
    global_order: tuple = ()

    @property
    def active(self) -> bool:
        return bool(self.partitions)


def is_expert(param) -> bool:
    """DeepSpeed's own test (``deepspeed.moe.utils.is_moe_param``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def expert_partitions(named: list) -> dict[str, str]:
    """Expert parameter name -> its expert group name."""
    out = {}
    for n, p in named:
        if is_expert(p):
            group = getattr(p, "group_name", None)
            if not isinstance(group, str):
                raise ValueError(f"Expert parameter {n!r} (allreduce=False) has no DeepSpeed expert group_name; "
                                 "build MoE layers with deepspeed.moe.layer.MoE.")
            out[n] = group
    return out


def moe_layers(modules: list) -> dict[str, tuple[int, str]]:
    """Experts prefix (``<layer>.deepspeed_moe.experts.deepspeed_experts.``) -> (num_experts,
    expert group name) of every ``deepspeed.moe.layer.MoE`` in ``modules`` ((module, its named
    parameters) pairs, names relative to that module)."""
    from deepspeed.moe.layer import MoE

    out = {}
    for module, _ in modules:
        for path, m in module.named_modules():
            if isinstance(m, MoE):
                out[(path + EXPERTS) if path else EXPERTS[1:]] = (int(m.num_experts), m.expert_group_name)
    return out


def create_expert_groups(modules: list, ds_config, mpu=None) -> dict[str, tuple[list, list]]:
    """Create DeepSpeed's expert groups before ``deepspeed.initialize``, exactly as the engine will.

    A client optimizer (Megatron-DeepSpeed's stage-0 path, :func:`megatron.build_tp_optimizer`)
    is built before the engine exists, so before DeepSpeed has created the expert-parallel and
    expert-data-parallel groups its expert parameters are planned over.  This does what
    ``DeepSpeedEngine._configure_distributed_model`` does (DeepSpeed 0.19.8): set
    ``deepspeed.utils.groups.mpu`` to the user's mpu, then, for every ``deepspeed.moe.layer.MoE``,
    what its ``set_deepspeed_parallelism`` -> ``_create_process_groups`` does with the ds_config's
    ``use_data_before_expert_parallelism``, except binding the group to the layer (the engine's own
    call does that, once).  ``_create_process_groups`` creates a group name only if it does not
    exist, so the engine later finds and reuses these same group objects.  ``modules``: the model
    chunks.  Returns expert group name -> (expert-parallel ranks, expert-data-parallel ranks) of
    this rank.
    """
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.config import get_expert_data_topo_config
    from deepspeed.utils import groups as ds_groups

    if not dist.is_initialized():
        deepspeed.init_distributed()
    if mpu is not None:
        if ds_groups.mpu is not None and ds_groups.mpu is not mpu:
            raise ValueError(f"deepspeed.utils.groups.mpu is already another mpu ({type(ds_groups.mpu).__name__}); "
                             "pass the same mpu to build_tp_optimizer and deepspeed.initialize.")
        ds_groups.mpu = mpu
    before = bool(get_expert_data_topo_config(dict(ds_config)))
    names = set()
    for module in modules:
        for _, m in module.named_modules():
            if not isinstance(m, MoE):
                continue
            names.add(m.expert_group_name)
            # MoE._create_process_groups without its last line (the layer's _set_ep_group, which
            # the engine's own set_deepspeed_parallelism call does and which may run only once)
            if m.expert_group_name in ds_groups._get_expert_parallel_group_dict():
                continue
            if ds_groups.mpu is None or not m.enable_expert_tensor_parallelism:
                ds_groups._create_expert_and_data_parallel(m.ep_size, use_data_before_expert_parallel_=before)
            else:
                ds_groups._create_expert_data_and_model_parallel(m.ep_size, mpu=ds_groups.mpu,
                                                                 use_data_before_expert_parallel_=before)
    return {name: (list(ds_groups._get_expert_parallel_group_ranks(name)),
                   list(ds_groups._get_expert_data_parallel_group_ranks(name))) for name in sorted(names)}


def checkpoint_writers(engine) -> dict[str, bool]:
    """Expert group name -> whether this rank writes that group's files in
    ``engine._save_moe_checkpoint`` (every expert group of the engine's MoE layers and the largest,
    whose expert-DP rank decides the ``expp_rank`` optimizer file and the model-states file).

    DeepSpeed 0.19.8 lets expert-DP rank 0 write: the experts' files
    (``layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt``) and, of the largest group, the stage-0
    optimizer file (``expp_rank_<k>_mp_rank_<m>_optim_states.pt``) and the model-states file
    (``mp_rank_<m>_model_states.pt``, DP rank 0 of those).  Every file name carries the writer's
    model-parallel rank ``m``, and each rank loads the files of its own ``m``.  Under tensor
    parallelism with whole experts the expert-DP group spans TP ranks (TP 2 x DP 2 at ep_size 1:
    one expert-DP group of all four ranks), so expert-DP rank 0 has one ``m`` and the other TP
    ranks' files were never written: their dense TP shards, experts and optimizer state (rule
    state of the matrices they host) lost, their resume failing.  Here one rank per (expert-DP
    group, model-parallel rank) writes: expert-DP rank 0 for its own ``m`` (DeepSpeed's writer),
    for every other ``m`` the group's DP-rank-0 member of that ``m`` if any (so that the
    model-states file is written), else its lowest member.  The ranks of one expert-DP group with
    one ``m`` hold the same experts, TP shards and (at stage 0, every DP rank stepping everything)
    optimizer state, so each file is what every reader of it holds.  One ``all_gather_object``
    over each expert-DP group."""
    import torch.distributed as tdist
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups as ds_groups

    names = {m.expert_group_name for _, m in engine.module.named_modules() if isinstance(m, MoE)}
    names.add(ds_groups._get_max_expert_size_name())
    me = (checkpoint_mp_rank(engine), int(ds_groups._get_data_parallel_rank()))
    out = {}
    for name in sorted(names):
        group = ds_groups._get_expert_data_parallel_group(name)
        ranks = list(ds_groups._get_expert_data_parallel_group_ranks(name))
        held: list = [None] * len(ranks)
        tdist.all_gather_object(held, me, group=group)
        mine = ranks.index(tdist.get_rank())
        mp = held[mine][0]
        if held[0][0] == mp:
            writer = 0
        else:
            writer = min((i for i, (m, _) in enumerate(held) if m == mp), key=lambda i: (held[i][1] != 0, i))
        out[name] = writer == mine
    return out


@contextmanager
def every_model_parallel_rank_writes(engine):
    """Around DeepSpeed's ``_save_moe_checkpoint``: each rank's expert-DP rank reads as 0 where
    :func:`checkpoint_writers` makes it a writer, 1 elsewhere (DeepSpeed asks
    ``checkpoint_engine.is_data_parallel_writer(exp_dp_rank)``, which is ``exp_dp_rank == 0``;
    nothing else in that call reads it for native MoE layers)."""
    from deepspeed.utils import groups as ds_groups

    writes = checkpoint_writers(engine)
    stock = ds_groups._get_expert_data_parallel_rank

    def expert_dp_rank(group_name):
        return 0 if writes[group_name] else max(1, stock(group_name))

    ds_groups._get_expert_data_parallel_rank = expert_dp_rank
    try:
        yield writes
    finally:
        ds_groups._get_expert_data_parallel_rank = stock


def moe_info(named: list, modules: list, groups: ParallelGroups) -> MoEInfo:
    """The partitions and whole-model names of ``named``'s expert parameters (see the module
    docstring); every expert parameter must lie inside a ``deepspeed.moe.layer.MoE``."""
    partitions = expert_partitions(named)
    if not partitions:
        return MoEInfo(global_names={n: n for n, _ in named}, global_order=tuple(n for n, _ in named))
    layers = moe_layers(modules)
    # the model's order (DeepSpeed's MoE param groups list the dense parameters first)
    given = dict(named)
    in_model = [n for module, _ in modules for n, _ in module.named_parameters() if n in given]
    named = [(n, given[n]) for n in in_model] + [(n, p) for n, p in named if n not in set(in_model)]
    pattern = re.compile(r"(\d+)(\..*)")
    global_names, order, done = {}, [], set()
    blocks: dict[str, list] = {}
    for n, _ in named:
        if n not in partitions:
            continue
        prefix = next((pre for pre in layers if n.startswith(pre)), None)
        m = pattern.fullmatch(n[len(prefix):]) if prefix else None
        if m is None:
            raise ValueError(f"Expert parameter {n!r} (DeepSpeed group {partitions[n]!r}) is not an expert of a "
                             "deepspeed.moe.layer.MoE; expert parallelism supports DeepSpeed's MoE layers only.")
        blocks.setdefault(prefix, []).append((int(m.group(1)), m.group(2), n))
    for prefix, items in blocks.items():
        num_experts, group_name = layers[prefix]
        eg = groups.expert(group_name)
        local = num_experts // eg.ep_size
        for j, suffix, n in items:
            if partitions[n] != group_name:
                raise ValueError(f"Expert parameter {n!r} is in group {partitions[n]!r}, its layer in {group_name!r}.")
            global_names[n] = f"{prefix}{eg.ep_rank * local + j}{suffix}"
    for n, _ in named:
        if n not in partitions:
            global_names[n] = n
            order.append(n)
            continue
        prefix = next(pre for pre in layers if n.startswith(pre))
        if prefix in done:
            continue
        done.add(prefix)
        suffixes = [suffix for j, suffix, _ in blocks[prefix] if j == 0]
        order += [f"{prefix}{e}{suffix}" for e in range(layers[prefix][0]) for suffix in suffixes]
    if len(set(order)) != len(order) or not set(global_names.values()) <= set(order):
        raise RuntimeError("MoE: the whole-model parameter order does not cover this rank's parameters.")
    return MoEInfo(partitions, global_names, tuple(order))


def check_moe(settings, groups: ParallelGroups, zero: dict, named: list = (), modules: list = ()) -> None:
    """Refuse, by name, what DeepSpeed MoE cannot combine with and what canzona-ds does not
    support with expert parallelism yet.

    Tensor parallelism (an mpu): the dense matrices are TP-split and hosted over the TP group as
    without MoE; the experts are whole on every rank (``enable_expert_tensor_parallelism=False``,
    DeepSpeed's default), planned over their expert-DP group (docs/moe.md, "MoE x tensor
    parallelism").  Experts split over TP (``enable_expert_tensor_parallelism=True``) are refused."""
    name = settings.optimizer_type
    if settings.zero_stage == 3:
        raise ValueError(f"{name}: DeepSpeed MoE layers (deepspeed.moe.layer.MoE) do not run under "
                         "zero_optimization.stage=3 (DeepSpeed refuses native MoE at stage 3). Use stage 0, 1 or 2.")
    if getattr(settings, "expert_data_before", False) and groups.tp_size > 1:
        raise data_before_refusal(name, "tensor parallelism (tp_size", groups.tp_size)
    if groups.tp_size > 1 and groups.pp_size > 1:
        raise ValueError(f"{name}: DeepSpeed MoE with pipeline AND tensor parallelism (pp_size={groups.pp_size}, "
                         f"tp_size={groups.tp_size}) is not supported yet (MoE x PP and MoE x TP each are: "
                         "docs/moe.md). Use one of them with MoE.")
    if groups.tp_size > 1:
        _check_moe_tp(name, settings, groups, named, modules)
    if settings.zero_stage in (1, 2):
        # offload_optimizer "cpu" combines (DeepSpeed runs MoE with offload; tests/test_moe_offload.py),
        # "nvme" is refused for every model (builder.check_settings)
        if not zero.get("reduce_scatter", True):
            raise ValueError(f"{name}: DeepSpeed MoE needs zero_optimization.reduce_scatter=true (got false).")
        if settings.zero_stage == 2 and not zero.get("contiguous_gradients", True):
            raise ValueError(f"{name}: DeepSpeed MoE at ZeRO stage 2 needs zero_optimization.contiguous_gradients="
                             "true (got false).")


def data_before_refusal(name: str, kind: str, size: int) -> ValueError:
    """ds_config ``use_data_before_expert_parallelism: true`` (DeepSpeed's D + E layout of the expert
    groups) runs with data parallelism at ZeRO 0, 1 and 2 (tests/test_moe_data_before.py); with
    tensor or pipeline parallelism it is not tested, so refused (``kind``: what, ``size``: its degree)."""
    return ValueError(f"{name}: DeepSpeed MoE with use_data_before_expert_parallelism=true and {kind}={size}) is "
                      "not supported yet (not tested; it runs with data and expert parallelism at ZeRO stage 0, 1 "
                      "and 2: docs/moe.md). Set use_data_before_expert_parallelism to false, or run without "
                      "tensor and pipeline parallelism.")


def pipeline_refusal(name: str, pp_size: int, moe_ranks: dict, zero_stage: int, per_stage: dict) -> ValueError:
    """The refusal of the one MoE x pipeline layout DeepSpeed 0.19.8 itself deadlocks on.

    DeepSpeed's own limit (docs/moe.md, "MoE and pipeline parallelism"): under the
    ``PipelineEngine`` at ZeRO stage 1, ``DeepSpeedZeroOptimizer.get_grad_norm_direct``
    all-reduces each parameter group's norm over the pipeline's model-parallel group, one call
    per group; a stage holding other expert parameter groups than another makes a different
    number of calls, and the first ``train_batch`` deadlocks (MoE in one stage of two, its own
    ``"AdamW"``).  ZeRO stage 0 (any layout) and ZeRO 1 with the same expert groups in every
    stage run.  ``moe_ranks``: pipeline stage -> the ranks whose stage holds MoE layers;
    ``per_stage``: stage -> its expert group names (gathered at setup, builder.build_optimizer)."""
    where = ", ".join(f"stage {s} (ranks {r})" for s, r in sorted(moe_ranks.items()))
    holds = "; ".join(f"stage {s}: {list(g) if g else 'no expert groups'}" for s, g in sorted(per_stage.items()))
    return ValueError(
        f"{name}: DeepSpeed MoE layers (deepspeed.moe.layer.MoE) with pipeline parallelism (pp_size={pp_size}; "
        f"MoE layers on {where}) at zero_optimization.stage={zero_stage} need the same expert groups in every "
        f"pipeline stage (got {holds}). DeepSpeed 0.19.8's ZeRO optimizer all-reduces each parameter group's "
        "gradient norm over the pipeline stages (DeepSpeedZeroOptimizer.get_grad_norm_direct), so stages with "
        "different expert groups deadlock in the first train_batch. Allowed: ZeRO stage 0 (MoE in any stages), "
        "ZeRO stage 1 with MoE layers of the same ep_size in every stage, or pp=1 (docs/moe.md).")


def _check_moe_tp(name: str, settings, groups: ParallelGroups, named: list, modules: list) -> None:
    """MoE x tensor parallelism: a Megatron-style mpu, whole experts only."""
    from deepspeed.moe.layer import MoE

    if groups.source == "autotp":
        raise ValueError(f"{name}: MoE with DeepSpeed AutoTP (tensor_parallel.autotp_size, tp_size={groups.tp_size}) "
                         "is not supported yet (not tested); MoE runs with tensor parallelism from a Megatron mpu "
                         "passed to deepspeed.initialize (docs/moe.md).")

    split_layers = [path or "<root>" for module, _ in modules for path, m in module.named_modules()
                    if isinstance(m, MoE) and m.enable_expert_tensor_parallelism]
    split_params = [n for n, p in named if is_expert(p) and getattr(p, "tensor_model_parallel", False)]
    if split_layers or split_params:
        what = f"MoE layer {split_layers[0]!r}" if split_layers else f"expert parameter {split_params[0]!r}"
        raise ValueError(f"{name}: {what} splits its experts over tensor parallelism (tp_size={groups.tp_size}, "
                         "deepspeed.moe.layer.MoE(enable_expert_tensor_parallelism=True) or TP-split expert weights); "
                         "tensor-parallel experts are not supported. Build the MoE layers with "
                         "enable_expert_tensor_parallelism=False (DeepSpeed's default: whole experts on every rank).")

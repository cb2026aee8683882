"""CanzonaMuon under DeepSpeed ZeRO stage 1: the ONLY module that touches DeepSpeed internals.

Pinned to DeepSpeed 0.19.8 (``SUPPORTED_DEEPSPEED``); :func:`install` refuses any other
version, because everything below leans on private methods of that release.

What :func:`install` changes (all on classes, each a thin wrapper that falls through to
the stock code unless the optimizer is ``"CanzonaMuon"``):

* ``DeepSpeedEngine._is_supported_optimizer``: accept the name ``"CanzonaMuon"`` (stock
  accepts built-ins and attributes of ``torch.optim`` only).
* ``DeepSpeedEngine._configure_basic_optimizer``: build :class:`CanzonaMuon` from the
  engine's named parameters, the ds_config ``params`` and the DP world size.
* ``DeepSpeedEngine._configure_zero_optimizer``: check the ds_config (stage, bf16 path,
  round-robin, offload) and build :class:`CanzonaZeroOneOptimizer` instead of the stock
  ``DeepSpeedZeroOptimizer`` (engine.py reads that class from a module global, so the
  global is swapped for the duration of this one call).
* ``zero.utils.ZERO_SUPPORTED_OPTIMIZERS`` gains ``CanzonaMuon`` (exact-type check).

The layout ("planned padding"), for the matrix param group, dp = 2:

    stock equal chunks       | W0  W1  W2 | W2' W3  W4 |     W2 straddles: both ranks need it
    planned padding          | W0  W3  pad | W1  W2  W4 |    every rank range is P elements,
                               ^ rank 0 (P)  ^ rank 1 (P)   each matrix lies in one range

We only choose the parameter order (the plan's ``buffer_order``) and the per-parameter
padding list that ZeRO-1 0.19.8 already supports (``round_robin_bit16_padding``, used for
``parameter_alignment``); the stock equal-chunk code (gradient routing to owners, partitioned
step, all-gather, checkpoints, ``zero_to_fp32``) then works unchanged.  The AdamW group
keeps stock slicing.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

from canzona_ds.integration.config import CanzonaMuonConfig
from canzona_ds.integration.optimizer import AUX, MATRIX, CanzonaMuon, FlatView

SUPPORTED_DEEPSPEED = "0.19.8"
OPTIMIZER_NAME = "CanzonaMuon"
LAYOUT_KEY = "canzona_layout"
TP_STATE_KEY = "canzona_tp_runtime"

_installed = False


def check_deepspeed_version() -> None:
    import deepspeed

    if deepspeed.__version__ != SUPPORTED_DEEPSPEED:
        raise RuntimeError(
            f"canzona_ds's ZeRO-1 integration is pinned to deepspeed=={SUPPORTED_DEEPSPEED} (it overrides "
            f"private ZeRO-1 internals), but deepspeed=={deepspeed.__version__} is installed. "
            f"Install deepspeed=={SUPPORTED_DEEPSPEED}."
        )


# ---------------------------------------------------------------------------- config checks
def check_engine_config(engine, cfg: CanzonaMuonConfig) -> None:
    """Refuse ds_config settings CanzonaMuon does not support, naming the setting."""
    stage = engine.zero_optimization_stage()
    if cfg.replicated:
        if stage != 0:
            raise ValueError(f"CanzonaMuon with replicated=true needs zero_optimization.stage=0, got stage={stage}.")
    elif stage != 1:
        raise ValueError(
            f"CanzonaMuon needs zero_optimization.stage=1, got stage={stage}. Allowed: 1 "
            "(or 0 together with optimizer.params.replicated=true)."
        )
    model_dtype, grad_accum_dtype = engine.get_data_types()
    if stage == 1 and model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32:
        raise ValueError(
            "CanzonaMuon does not support bf16 with data_types.grad_accum_dtype='fp32' (DeepSpeed routes that to "
            "BF16_Optimizer, not ZeRO-1). Remove grad_accum_dtype or set it to 'bf16'."
        )
    if engine.zero_round_robin_gradients():
        raise ValueError("CanzonaMuon does not support zero_optimization.round_robin_gradients=true "
                         "(it reorders parameters, breaking the ownership plan). Set it to false.")
    if engine.zero_offload_optimizer() is not None or engine.zero_cpu_offload():
        raise ValueError("CanzonaMuon does not support zero_optimization.offload_optimizer. Remove it "
                         "(device must be 'none').")
    if getattr(engine, "zenflow", False):
        raise ValueError("CanzonaMuon does not support zero_optimization.zenflow.")
    if engine.has_moe_layers:
        raise ValueError("CanzonaMuon does not support MoE layers yet.")


def _dp_world_size(engine) -> int:
    from deepspeed import comm as dist

    return dist.get_world_size(group=engine.seq_data_parallel_group)


def build_basic_optimizer(engine, model_parameters) -> CanzonaMuon:
    """``"type": "CanzonaMuon"`` -> a :class:`CanzonaMuon` over the engine's module."""
    cfg = CanzonaMuonConfig.from_params(engine.optimizer_params())
    check_engine_config(engine, cfg)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    params = []
    for item in model_parameters:
        if isinstance(item, dict):
            extra = sorted(set(item) - {"params"})
            if extra:
                raise ValueError(f"CanzonaMuon does not take per-group settings yet (got keys {extra} in a "
                                 "model_parameters group). Pass plain parameters and set hyper-parameters in "
                                 "ds_config optimizer.params.")
            params.extend(item["params"])
        else:
            params.append(item)
    missing = [p for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"{len(missing)} of model_parameters are not parameters of the model given to "
                         "deepspeed.initialize; CanzonaMuon needs their names.")
    dp = 1 if cfg.replicated else _dp_world_size(engine)
    opt = CanzonaMuon(((names[id(p)], p) for p in params), cfg, dp_world_size=dp)
    opt._canzona_tp = _tp_settings(engine, cfg)
    return opt


def _tp_settings(engine, cfg: CanzonaMuonConfig):
    """(ParallelGroups, TPMuonConfig) when deepspeed.initialize got an mpu with TP > 1, else None.

    The TP runtime's settings come from the same ds_config keys as the Megatron hook:
    ``optimizer.params`` (lr, momentum, ...) plus the optional top-level ``canzona_tp``
    section (scheduler, c_max, pipelined, strategy, cost; docs/tp.md).
    """
    mpu = getattr(engine, "mpu", None)  # Megatron's mpu, or deepspeed.utils.groups under AutoTP
    if mpu is None or cfg.replicated:
        tagged = [n for n, p in engine.module.named_parameters() if getattr(p, "tensor_model_parallel", False)]
        if tagged:
            # without the TP group every rank would orthogonalise its own shard: an approximation
            raise ValueError(
                f"{len(tagged)} parameters are marked tensor_model_parallel (e.g. {tagged[0]!r}) but CanzonaMuon "
                + ("runs with replicated=true, which has no tensor-parallel path"
                   if cfg.replicated else "found no TP group: deepspeed.initialize got no mpu")
                + ". Pass mpu=<Megatron parallel_state> to deepspeed.initialize (or use "
                "tensor_parallel.autotp_size), with zero_optimization.stage=1 and replicated=false.")
        return None
    from canzona_ds.integration.megatron import groups_from_mpu, tp_config_from_ds_config
    from canzona_ds.optim.muon import NS_COEFFICIENTS

    groups = groups_from_mpu(mpu)
    if groups.tp_size == 1:
        return None
    if tuple(cfg.ns_coefficients) != tuple(NS_COEFFICIENTS) or cfg.ns_eps != 1e-7:
        raise ValueError("CanzonaMuon with tensor parallelism (mpu TP size "
                         f"{groups.tp_size}) supports only the default ns_coefficients and ns_eps (the TP "
                         "runtime does not take them); remove them from optimizer.params.")
    tp_cfg, _, _ = tp_config_from_ds_config(engine._config._param_dict)
    return groups, tp_cfg


# ---------------------------------------------------------------------------- ZeRO-1 subclass
def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _make_zero_class():
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class CanzonaZeroOneOptimizer(DeepSpeedZeroOptimizer):
        """Stock ZeRO-1 with the matrix group laid out by the ownership plan (planned padding).

        Overrides, each small: ``flatten_dense_tensors_aligned`` (choose the padding of the
        matrix group, once, at construction), ``state_dict`` / ``_load_legacy_checkpoint``
        (record and verify the layout), ``_load_universal_checkpoint`` (refused).
        """

        #: route each gradient slice to its owner with dist.reduce (True) instead of DeepSpeed's
        #: default all-reduce of whole buckets (False).  Measured cheaper: docs/zero1.md.
        reduce_to_owner = True

        def __init__(self, init_optimizer: CanzonaMuon, *args: Any, **kwargs: Any) -> None:
            if not isinstance(init_optimizer, CanzonaMuon):
                raise TypeError(f"CanzonaZeroOneOptimizer needs a CanzonaMuon, got {type(init_optimizer).__name__}")
            roles = [g["canzona_role"] for g in init_optimizer.param_groups]
            self._canzona = init_optimizer
            self._canzona_matrix_group = roles.index(MATRIX) if MATRIX in roles else None
            self._canzona_shard_numel = None
            if self.reduce_to_owner:
                kwargs["use_multi_rank_bucket_allreduce"] = False
            super().__init__(init_optimizer, *args, **kwargs)
            if self._canzona_matrix_group is not None:
                self._canzona_finish_layout(self._canzona_matrix_group)

        # -- layout ------------------------------------------------------------------
        def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
            i = len(self.bit16_groups_flat)
            if (param_padding is not None and i == self._canzona_matrix_group
                    and self._canzona_shard_numel is None):
                self._canzona_plan_padding(i, param_padding)
            return super().flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data, param_padding)

        def _canzona_plan_padding(self, i: int, param_padding: list) -> None:
            """Rewrite group i's per-parameter padding so rank ranges end on parameter boundaries."""
            plan = self._canzona.plan
            group = self.round_robin_bit16_groups[i]
            if [id(p) for p in group] != [id(p) for p in self.bit16_groups[i]] or len(group) != len(plan.specs):
                raise RuntimeError("ZeRO reordered or dropped matrices of the CanzonaMuon group; cannot lay out "
                                   "the ownership plan.")
            dp = dist.get_world_size(group=self.real_dp_process_group[i])
            if dp != plan.world_size:
                raise RuntimeError(f"Plan made for {plan.world_size} DP ranks, ZeRO group has {dp}.")
            element_size = group[0].element_size()
            param_alignment = 16 // math.gcd(16, element_size) if self.parameter_alignment else 1
            counts = [len(r) for r in plan.rank_params]
            # inner (stock alignment) padding, per rank; then each range padded to P
            rank_used, inner, k = [], [0] * len(group), 0
            for c in counts:
                used = 0
                for j in range(k, k + c):
                    used += group[j].numel()
                    if j < k + c - 1:
                        inner[j] = (-used) % param_alignment
                        used += inner[j]
                rank_used.append(used)
                k += c
            P = _round_up(max(max(rank_used), 1), math.lcm(self.nccl_start_alignment_factor, param_alignment))
            if counts[0] == 0:
                raise RuntimeError(f"Planner {plan.planner!r} left rank 0 without matrices; the padded layout "
                                   "needs a parameter to carry rank 0's padding.")
            padding, offsets, off, k = list(inner), [], 0, 0
            last_of_rank = {}
            for r, c in enumerate(counts):
                if c:
                    last_of_rank[r] = k + c - 1
                k += c
            for j, p in enumerate(group):
                offsets.append(off)
                off += p.numel() + padding[j]
                if j in last_of_rank.values():
                    r = max(rr for rr, jj in last_of_rank.items() if jj == j)
                    # pad to the end of this rank and of every following rank without matrices
                    nxt = r + 1
                    while nxt < dp and counts[nxt] == 0:
                        nxt += 1
                    padding[j] = nxt * P - (off - padding[j])
                    off = nxt * P
            param_padding[:] = padding
            self.round_robin_bit16_offsets[i][:] = offsets
            self._canzona_shard_numel = P
            self._canzona_rank_used = rank_used

        def _canzona_finish_layout(self, i: int) -> None:
            """Check the realised layout against the plan, agree across ranks, bind views."""
            plan = self._canzona.plan
            P = self._canzona_shard_numel
            rank = dist.get_rank(group=self.real_dp_process_group[i])
            dp = plan.world_size
            if P is None or self.partition_size[i] != P or self.bit16_groups_flat[i].numel() != dp * P:
                raise RuntimeError(f"Planned layout not realised: partition_size={self.partition_size[i]}, "
                                   f"P={P}, flat={self.bit16_groups_flat[i].numel()}, dp={dp}.")
            group = self.round_robin_bit16_groups[i]
            offsets = self.round_robin_bit16_offsets[i]
            owners = [r for r in range(dp) for _ in plan.rank_params[r]]
            names = [self._canzona.matrix_names[j] for j in range(len(group))]
            for p, off, owner, name in zip(group, offsets, owners, names):
                lo, hi = off, off + p.numel()
                if not (owner * P <= lo and hi <= (owner + 1) * P):
                    raise RuntimeError(f"Matrix {name} [{lo}, {hi}) straddles the ZeRO-1 partition boundary of its "
                                       f"owner rank {owner} (P={P}).")
            mine = [p for p, o in zip(group, owners) if o == rank]
            if [id(p) for p in self.params_in_partition[i]] != [id(p) for p in mine] or self.first_offset[i] != 0:
                raise RuntimeError("ZeRO-1's partition bookkeeping disagrees with the ownership plan.")
            # Checkpoints strip groups_padding[i] trailing elements of each rank's partition and
            # zero_to_fp32 concatenates what is left, walking round_robin_bit16_padding: with our
            # explicit per-parameter padding up to dp*P nothing may be stripped.
            self.groups_padding[i] = 0
            if self._is_muon_group(group) or self._muon_update_lacks_loss_scale(i):
                raise RuntimeError("DeepSpeed's built-in Muon path is active on CanzonaMuon parameters "
                                   "(use_muon is set); it would orthogonalise twice.")
            layout = self._canzona_layout_meta()
            gathered = [None] * dp
            torch.distributed.all_gather_object(gathered, layout["fingerprint"], group=self.real_dp_process_group[i])
            if len(set(gathered)) != 1:
                raise RuntimeError(f"DP ranks disagree on the CanzonaMuon layout fingerprint: {gathered}. Every rank "
                                   "must see the same model, ds_config and canzona_ds/deepspeed versions.")
            views = [FlatView(off - rank * P, tuple(p.shape), name)
                     for p, off, owner, name in zip(group, offsets, owners, names) if owner == rank]
            self._canzona.bind_flat_partition(self.single_partition_of_fp32_groups[i], views)
            if getattr(self._canzona, "_canzona_tp", None) is not None:
                mine_named = [(n, p) for p, owner, n in zip(group, owners, names) if owner == rank]
                self._canzona_bind_tp(rank, mine_named)

        def _canzona_bind_tp(self, dp_rank: int, owned: list) -> None:
            """DP x TP: check the DP plan is the same on every TP rank, build the TP runtime
            over the owned TP-split matrices (partition attributes of the module params)."""
            from canzona_ds.tp import TPMatrix, TPMuonRuntime, verify_same_across_group

            groups, tp_cfg = self._canzona._canzona_tp
            plan = self._canzona.plan
            verify_same_across_group(plan.fingerprint(), groups.tp_group,
                                     what="CanzonaMuon DP ownership plan (over the TP-local matrix shapes)")
            # the shards of one matrix must sit on the same DP index on every TP rank
            verify_same_across_group(f"dp_rank={dp_rank}", groups.tp_group,
                                     what="DP rank within the TP group (mpu layout)")
            mats = [TPMatrix.from_param(n, p, groups.tp_size) for n, p in owned]
            split = [m for m in mats if m.is_split]
            self._canzona_tp_runtime = TPMuonRuntime(split, groups.tp_group, tp_cfg)
            self._canzona.bind_tp_runtime(self._canzona_tp_runtime, [m.name for m in split])

        def _canzona_layout_meta(self) -> dict:
            plan = self._canzona.plan
            if plan is None:
                return {"fingerprint": "no-matrices", "world_size": None, "planner": None, "shard_numel": None}
            i = self._canzona_matrix_group
            payload = [plan.fingerprint(), self._canzona_shard_numel, list(self.round_robin_bit16_padding[i])]
            digest = hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]
            return {"fingerprint": digest, "world_size": plan.world_size, "planner": plan.planner,
                    "shard_numel": self._canzona_shard_numel}

        # -- checkpoints --------------------------------------------------------------
        def state_dict(self):
            sd = super().state_dict()
            sd[LAYOUT_KEY] = self._canzona_layout_meta()
            rt = getattr(self, "_canzona_tp_runtime", None)
            if rt is not None:  # host momentum of the TP-split matrices this rank hosts
                sd[TP_STATE_KEY] = rt.state_dict()
            return sd

        def _load_legacy_checkpoint(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False):
            dp = dist.get_world_size(group=self.dp_process_group)
            rank = dist.get_rank(group=self.dp_process_group)
            # DeepSpeed may load only this rank's shard (others are None)
            mine = state_dict_list[rank] if rank < len(state_dict_list) else None
            mine = mine if mine is not None else next((s for s in state_dict_list if s is not None), None)
            saved = mine.get(LAYOUT_KEY) if mine is not None else None
            current = self._canzona_layout_meta()
            if saved is None:
                raise ValueError("This ZeRO checkpoint was not written by CanzonaMuon (no 'canzona_layout'); "
                                 "load it with the optimizer that wrote it, or load the module weights only "
                                 "(load_optimizer_states=False, load_module_only=True).")
            if len(state_dict_list) != dp or saved["fingerprint"] != current["fingerprint"]:
                raise ValueError(
                    f"CanzonaMuon checkpoint layout differs from this run: saved with DP={saved['world_size']} "
                    f"(planner={saved['planner']}, P={saved['shard_numel']}, {len(state_dict_list)} shards), "
                    f"now DP={current['world_size']} (planner={current['planner']}, P={current['shard_numel']}). "
                    "Resuming at a different DP size or plan is not supported: resume with the same DP size and "
                    "optimizer params, or convert with deepspeed.utils.zero_to_fp32 and start the optimizer fresh."
                )
            out = super()._load_legacy_checkpoint(state_dict_list, load_optimizer_states, load_from_fp32_weights)
            rt = getattr(self, "_canzona_tp_runtime", None)
            if rt is not None and load_optimizer_states:
                own = state_dict_list[rank] if rank < len(state_dict_list) else None
                if own is None or TP_STATE_KEY not in own:
                    raise ValueError("This CanzonaMuon checkpoint has no TP runtime state for this rank "
                                     f"('{TP_STATE_KEY}'); it was saved without tensor parallelism. Resume at the "
                                     "same DP x TP, or load with load_optimizer_states=False.")
                rt.load_state_dict(own[TP_STATE_KEY])
            return out

        def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
            raise ValueError("CanzonaMuon does not support universal checkpoints (load_universal_checkpoint).")

    return CanzonaZeroOneOptimizer


_ZERO_CLASS = None


def zero_optimizer_class():
    global _ZERO_CLASS
    if _ZERO_CLASS is None:
        _ZERO_CLASS = _make_zero_class()
    return _ZERO_CLASS


# ---------------------------------------------------------------------------- install
def install() -> None:
    """Teach DeepSpeed's engine the ``"CanzonaMuon"`` optimizer type (idempotent)."""
    global _installed
    if _installed:
        return
    check_deepspeed_version()
    import deepspeed.runtime.engine as engine_mod
    from deepspeed.runtime.zero import utils as zero_utils

    Engine = engine_mod.DeepSpeedEngine
    stock_is_supported = Engine._is_supported_optimizer
    stock_basic = Engine._configure_basic_optimizer
    stock_zero = Engine._configure_zero_optimizer

    def _is_supported_optimizer(self, optimizer_name):
        return optimizer_name == OPTIMIZER_NAME or stock_is_supported(self, optimizer_name)

    def _configure_basic_optimizer(self, model_parameters):
        if self.optimizer_name() == OPTIMIZER_NAME:
            return build_basic_optimizer(self, model_parameters)
        return stock_basic(self, model_parameters)

    def _configure_zero_optimizer(self, optimizer):
        if not isinstance(optimizer, CanzonaMuon):
            return stock_zero(self, optimizer)
        check_engine_config(self, optimizer.config)
        if optimizer.plan is None:  # no matrices: plain AdamW, stock ZeRO-1
            return stock_zero(self, optimizer)
        stock_cls = engine_mod.DeepSpeedZeroOptimizer
        engine_mod.DeepSpeedZeroOptimizer = zero_optimizer_class()
        try:
            return stock_zero(self, optimizer)
        finally:
            engine_mod.DeepSpeedZeroOptimizer = stock_cls

    Engine._is_supported_optimizer = _is_supported_optimizer
    Engine._configure_basic_optimizer = _configure_basic_optimizer
    Engine._configure_zero_optimizer = _configure_zero_optimizer
    if CanzonaMuon not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CanzonaMuon)
    _installed = True


# ---------------------------------------------------------------------------- process exit
def release_shm_buffer() -> bool:
    """Unlink this rank's DeepSpeed CPU shared-memory all-reduce buffer; True if one was removed.

    DeepSpeed 0.19.8's CPU comm op (``ops/csrc/cpu/comm/shm.cpp``, ``shm_initialize``)
    creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
    (~69 MB) per rank and never unlinks it, so every run leaves them behind in RAM-backed
    tmpfs.  Call once per process after its last collective: unlinking removes only the
    name, the other ranks' existing mappings stay valid.
    """
    import os

    addr, port, rank = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if not (addr and port and rank):
        return False
    path = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False

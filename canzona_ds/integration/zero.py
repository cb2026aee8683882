"""ZeRO stage 1/2 with planned padding: a :class:`~canzona_ds.planning.layout.Layout` realised
in DeepSpeed's flat buffer.

DeepSpeed flattens each param group into one buffer and cuts it into dp equal ranges.  We
choose only two things for the matrix group, both of which DeepSpeed 0.19.8 already
supports: the parameter order (the optimizer puts the matrices in the plan's buffer
order) and the per-parameter padding list (``round_robin_bit16_padding``, which DeepSpeed
uses for ``parameter_alignment``)::

    stock equal chunks       | W0  W1  W2 | W2' W3  W4 |     W2 straddles: both ranks need it
    planned padding          | W0  W3  pad | W1  W2  W4 |    every rank range is P elements,
                               ^ rank 0 (P)  ^ rank 1 (P)   each matrix lies in one range

Under DeepSpeed MoE there is one matrix group per partition (dense; each expert group, which
ZeRO partitions over its expert-data-parallel group), each laid out by its own plan.

The stock equal-range code then works unchanged: stage 1 reduces each gradient slice to
its owner, stage 2 keeps only the owner's gradient partition (the partition boundaries are
parameter boundaries, so no parameter's gradient is split), the partitioned step, the
post-step all-gather, checkpoints and ``zero_to_fp32``.  The AdamW group keeps stock
slicing.  Our overrides, each small:

* ``flatten_dense_tensors_aligned`` - write the layout's padding and offsets for the
  matrix group, once, at construction;
* ``_load_legacy_checkpoint`` - DeepSpeed's own load, reached only where the checkpoint index's
  fingerprints equal this run's (engine.load_checkpoint takes any other layout through the
  checkpoint index, canzona_ds/integration/ckpt/); a file without Canzona optimizer
  state is refused by name;
* ``_load_universal_checkpoint`` - refused with a message;
* ``scaled_global_norm`` / ``unscale_and_clip_grads`` - gradient clipping with
  ``torch.nn.utils.clip_grad_norm_``'s arithmetic (integration/clip.py), so a clipped run equals
  the single-process ``clip_grad_norm_`` + optimizer bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

from ..optimizer import MATRIX, STATE_KEY, CanzonaOptimizer, FlatView
from .ds_compat import check_instance, zero12_builtin_muon_active

def _make_zero_class():
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class CanzonaZeroOptimizer(DeepSpeedZeroOptimizer):
        """Stock ZeRO-1/2 with the matrix group laid out by the ownership plan."""

        #: route each gradient slice to its owner with dist.reduce (DeepSpeed's
        #: use_multi_rank_bucket_allreduce=false) instead of all-reducing whole buckets
        reduce_to_owner = True

        def __init__(self, init_optimizer: CanzonaOptimizer, *args: Any, **kwargs: Any) -> None:
            if not isinstance(init_optimizer, CanzonaOptimizer):
                raise TypeError(f"CanzonaZeroOptimizer needs a CanzonaOptimizer, got {type(init_optimizer).__name__}")
            roles = [g["canzona_role"] for g in init_optimizer.param_groups]
            self._canzona = init_optimizer
            #: the matrix param groups (one per partition: dense, and each MoE expert group)
            self._canzona_groups = [i for i, r in enumerate(roles) if r == MATRIX]
            self._canzona_group = self._canzona_groups[0] if self._canzona_groups else None
            #: group index -> its realised Layout; ``canzona_layout`` is the first (the dense one)
            self.canzona_layouts: dict = {}
            self.canzona_layout = None
            self._canzona_clip = None  # integration/clip.TorchClip, built on the first clipped step
            if self.reduce_to_owner:
                kwargs["use_multi_rank_bucket_allreduce"] = False
            super().__init__(init_optimizer, *args, **kwargs)
            check_instance(self)
            for i in self._canzona_groups:
                self._canzona_finish_layout(i)

        # -- layout ------------------------------------------------------------------
        def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
            i = len(self.bit16_groups_flat)
            if param_padding is not None and i in self._canzona_groups and i not in self.canzona_layouts:
                self._canzona_apply_layout(i, param_padding)
            return super().flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data, param_padding)

        def _canzona_apply_layout(self, i: int, param_padding: list) -> None:
            """Replace group i's per-parameter padding and offsets by the plan's layout."""
            plan = self._canzona_plan(i)
            group = self.round_robin_bit16_groups[i]
            if [id(p) for p in group] != [id(p) for p in self.bit16_groups[i]] or len(group) != len(plan.specs):
                raise RuntimeError("ZeRO reordered or dropped matrices of the CanzonaOptimizer group; cannot lay out "
                                   "the ownership plan.")
            dp = dist.get_world_size(group=self.real_dp_process_group[i])
            if dp != plan.world_size:
                raise RuntimeError(f"Plan made for {plan.world_size} DP ranks, ZeRO group {i} has {dp}.")
            param_alignment = 16 // math.gcd(16, group[0].element_size()) if self.parameter_alignment else 1
            layout = plan.layout(param_alignment, self.nccl_start_alignment_factor)
            if list(layout.numels) != [p.numel() for p in group]:
                raise RuntimeError("The ownership plan's matrix sizes differ from the ZeRO group's parameters.")
            param_padding[:] = layout.padding
            self.round_robin_bit16_offsets[i][:] = layout.offsets
            self.canzona_layouts[i] = layout
            if self.canzona_layout is None:
                self.canzona_layout = layout

        def _canzona_partition(self, i: int):
            """Group i's partition: None (dense) or its MoE expert group's name."""
            return self._canzona.param_groups[i].get("canzona_partition")

        def _canzona_plan(self, i: int):
            return self._canzona.plans[self._canzona_partition(i)]

        def _canzona_finish_layout(self, i: int) -> None:
            """Check the realised layout against the plan, agree across ranks, bind views."""
            layout = self.canzona_layouts.get(i)
            opt = self._canzona
            names = opt.partition_matrices[self._canzona_partition(i)]
            rank = dist.get_rank(group=self.real_dp_process_group[i])
            if layout is None or self.partition_size[i] != layout.shard_numel or \
                    self.bit16_groups_flat[i].numel() != layout.buffer_numel:
                raise RuntimeError(f"Planned layout not realised: partition_size={self.partition_size[i]}, "
                                   f"layout={None if layout is None else layout.shard_numel}.")
            group = self.round_robin_bit16_groups[i]
            P = layout.shard_numel
            owners = layout.owners()
            for p, off, owner, name in zip(group, layout.offsets, owners, names):
                if owner >= 0 and not (owner * P <= off and off + p.numel() <= (owner + 1) * P):
                    raise RuntimeError(f"Matrix {name} [{off}, {off + p.numel()}) straddles the ZeRO partition "
                                       f"boundary of its owner rank {owner} (P={P}).")
            if layout.mixed:  # owned matrices and the pieces of hosted ones that cross this range
                lo, hi = rank * P, (rank + 1) * P
                spans = [(p, off, off + p.numel()) for p, off in zip(group, layout.offsets) if p.numel()]
                mine = [p for p, a, b in spans if a < hi and b > lo]
                first = next((lo - a for _, a, b in spans if a < lo < b), 0)
            else:
                mine, first = [p for p, o in zip(group, owners) if o == rank], 0
            if [id(p) for p in self.params_in_partition[i]] != [id(p) for p in mine] or self.first_offset[i] != first:
                raise RuntimeError("ZeRO's partition bookkeeping disagrees with the ownership plan.")
            # Checkpoints strip groups_padding[i] trailing elements of each rank's partition and
            # zero_to_fp32 walks round_robin_bit16_padding: with our explicit per-parameter
            # padding up to dp*P nothing may be stripped.
            self.groups_padding[i] = 0
            if zero12_builtin_muon_active(self, group, i):
                raise RuntimeError("DeepSpeed's built-in Muon path is active on CanzonaOptimizer parameters; it "
                                   "would orthogonalise twice.")
            fingerprint = self._canzona_group_fingerprint(i)
            gathered = [None] * layout.world_size
            torch.distributed.all_gather_object(gathered, fingerprint, group=self.real_dp_process_group[i])
            if len(set(gathered)) != 1:
                raise RuntimeError(f"DP ranks disagree on the CanzonaOptimizer layout: {gathered}. Every rank must see "
                                   "the same model, ds_config and canzona_ds/deepspeed versions.")
            views = [FlatView(names[j], off, tuple(group[j].shape)) for j, off in layout.rank_views(rank)]
            if opt.tp_size > 1:
                self._canzona_check_tp(rank, self._canzona_partition(i))
            splits = []
            if layout.mixed:  # this rank's piece (maybe empty) of every hosted matrix, and the cuts
                from ..planning.mixed import hosted_pieces
                from ..tp.runtime import FlatSplit, GridSplit

                for k in layout.hosted_indices():
                    name = names[k]
                    starts, lengths = hosted_pieces(layout, k)
                    tpm = opt.tp_matrices.get(name)
                    if tpm is not None:  # TP-local shards, each cut like this one: pieces over the DP x TP grid
                        splits.append(GridSplit(name, tpm.full_shape, tpm.partition_dim, tpm.shard_sizes, starts,
                                                lengths, tuple(opt.groups.grid_cells), tpm.num_heads))
                    else:
                        splits.append(FlatSplit(name, tuple(group[k].shape), starts, lengths,
                                                opt.infos[name].num_heads, opt.infos[name].num_experts))
                    local = max(layout.offsets[k] + starts[rank] - rank * P, 0) if lengths[rank] else 0
                    views.append(FlatView(name, local, (lengths[rank],)))
            opt.bind_partition(self.single_partition_of_fp32_groups[i], views, dp_hosted=splits,
                               dp_group=self.real_dp_process_group[i], partition=self._canzona_partition(i))

        def _canzona_hosted_meta(self, i: int | None = None) -> dict:
            """Matrix group i's (default: the first, the dense one) hosted matrices of the mixed
            layout: name -> host rank in the group's DP group (an expert group's: its expert-DP
            group) and every rank's piece (start in the matrix, or in its TP-local shard, and
            length), as the step and elastic resume use them; a TP-split one also its host's TP
            rank ("tp_host")."""
            from ..planning.mixed import hosted_pieces
            from ..tp.runtime import GridSplit

            i = self._canzona_groups[0] if i is None else i
            layout, opt = self.canzona_layouts[i], self._canzona
            key = self._canzona_partition(i)
            plan = opt.plans[key]
            hosted = opt.placement.hosted
            split = hosted.split if hosted is not None else {}
            grid_hosts = {}
            for part in getattr(hosted, "parts", (hosted,)) if hosted is not None else ():
                for m, h in zip(part.runtime.matrices, part.runtime.plan.host if part.runtime.plan else ()):
                    if isinstance(m, GridSplit):
                        grid_hosts[m.name] = m.cells[h][0]
            out = {}
            for k in layout.hosted_indices():
                name = opt.partition_matrices[key][k]
                starts, lengths = hosted_pieces(layout, k)
                out[name] = {"host": plan.host[plan.buffer_order()[k]], "starts": list(starts),
                             "lengths": list(lengths)}
                if isinstance(split.get(name), GridSplit):
                    out[name]["tp_host"] = grid_hosts[name]
            return out

        def _canzona_group_fingerprint(self, i: int) -> str:
            """Group i's plan and layout (what every rank of its DP group must agree on)."""
            payload = [self._canzona_plan(i).fingerprint(), self.canzona_layouts[i].fingerprint()]
            return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

        def _canzona_check_tp(self, dp_rank: int, partition: str | None = None) -> None:
            """DP x TP: every TP rank must hold the same DP plan, at the same DP index, so
            the shards of a matrix meet on one host.  An MoE expert group (whole experts on
            every TP rank, planned over its expert-DP group): every TP rank must hold the same
            expert plan over an expert-DP group of the same size (the ranks' expert-DP groups
            differ where the TP ranks hold different experts, DeepSpeed's expert groups under an
            mpu: docs/moe.md), so each TP rank steps its experts as its TP peers step theirs."""
            from ..tp import verify_same_across_group

            opt = self._canzona
            if partition is not None:
                plan = opt.plans[partition]
                verify_same_across_group(f"{partition}:{plan.world_size}:{plan.fingerprint()}", opt.tp_group,
                                         what=f"expert ownership plan of MoE group {partition!r} (expert-DP size, "
                                              "whole expert shapes)")
                return
            if not opt.tp_matrices:
                return
            verify_same_across_group(opt.plan.fingerprint(), opt.tp_group,
                                     what="DP ownership plan (over the TP-local matrix shapes)")
            verify_same_across_group(f"dp_rank={dp_rank}", opt.tp_group, what="DP rank within the TP group (mpu)")

        def canzona_layout_meta(self) -> dict:
            """What the layout depends on (its fingerprint: ckpt/emit.layout_fingerprint), with the
            tensor-parallel layout of every TP-split parameter.  canzona-ds wrote this record into
            every ZeRO file before the checkpoint index (ckpt/route.unindexed compares it with this run's)."""
            from ..tp.layout import tp_blocks
            from ..tp.runtime import TPMatrix, tp_split

            opt, layout = self._canzona, self.canzona_layout
            if not self.canzona_layouts:
                return {"fingerprint": "no-matrices", "world_size": None, "planner": None, "shard_numel": None}
            first = self._canzona_groups[0]
            payload = [self._canzona_plan(first).fingerprint(), layout.fingerprint()]
            experts = {}  # DeepSpeed MoE: each expert group's matrices, planned over its expert-DP group
            for i in self._canzona_groups:
                key = self._canzona_partition(i)
                if key is None:
                    continue
                lay = self.canzona_layouts[i]
                payload.append([key, self._canzona_plan(i).fingerprint(), lay.fingerprint()])
                eg = opt.groups.expert(key)
                moe = opt.moe
                # every expert parameter of this group on this rank -> its whole-model name (local
                # expert j on expert-parallel rank k is global expert k*E/ep + j): what a resume at
                # another DP or expert-parallel size finds it by (the checkpoint index)
                global_names = {n: moe.global_names.get(n, n) for n, part in moe.partitions.items() if part == key} \
                    if moe is not None else {}
                experts[key] = {"world_size": lay.world_size, "shard_numel": lay.shard_numel,
                                "matrix_names": list(opt.partition_matrices[key]),
                                "rank_counts": list(lay.rank_counts), "offsets": list(lay.offsets),
                                "layout": "mixed" if lay.mixed else "owned", "owner_at": list(lay.owners()),
                                "hosted": self._canzona_hosted_meta(i),
                                "edp_rank": dist.get_rank(group=self.real_dp_process_group[i]),
                                "ep_size": eg.ep_size, "ep_rank": eg.ep_rank, "global_names": global_names}
            tp_params = {}
            for group in self.bit16_groups:
                for p in group:
                    if TPMatrix.is_split(p, opt.tp_size):  # a matrix or a 1-D bias
                        dim, sizes, full = tp_split(self.param_names[p], p, opt.tp_size)
                        tp_params[self.param_names[p]] = [dim, list(sizes), list(tp_blocks(p, full[dim]))]
            tp_rank = dist.get_rank(group=opt.tp_group) if opt.tp_size > 1 else 0
            return {"fingerprint": hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16],
                    "world_size": layout.world_size, "planner": self._canzona_plan(first).planner,
                    "shard_numel": layout.shard_numel,
                    "matrix_names": list(opt.partition_matrices[self._canzona_partition(first)]),
                    "rank_counts": list(layout.rank_counts), "offsets": list(layout.offsets),
                    "layout": "mixed" if layout.mixed else "owned", "owner_at": list(layout.owners()),
                    "hosted": self._canzona_hosted_meta(), "layout_choice": opt.plan.extra.get("layout_choice"),
                    "rule": opt.rule.name, "roles": [g["canzona_role"] for g in opt.param_groups], "moe": experts,
                    "tp_size": opt.tp_size, "tp_rank": tp_rank, "tp_params": tp_params,
                    "pp_size": opt.groups.pp_size, "pp_rank": opt.groups.pp_rank,
                    "dp_rank": dist.get_rank(group=self.dp_process_group)}

        # -- gradient clipping ----------------------------------------------------------
        def _canzona_torch_clip(self):
            """The torch-exact norm and clip (integration/clip.py), or None where DeepSpeed's own
            runs (no clipping and no pipeline; tensor parallelism, whose norms DeepSpeed reduces
            over the model-parallel group).  Under MoE the slots are the whole model's (every
            expert once, integration/moe.py).  Under pipeline parallelism it runs even without clipping
            (the norm is computed for every step): DeepSpeed's own all-reduces the norm over the
            model-parallel group (all stages) once per param group, and a stage without matrices
            has one group where the others have two, which deadlocks."""
            groups = self._canzona.groups
            moe = self._canzona.moe
            if groups.tp_size > 1 and moe is not None and moe.active and groups.pp_size == 1:
                # MoE x TP: DeepSpeed's own norm drops the experts of TP ranks other than 0 (also
                # without clipping: the norm is reported, engine.get_global_grad_norm)
                if self._canzona_clip is None:
                    from .clip import TorchClipMoETP

                    self._canzona_clip = TorchClipMoETP(self, list(moe.global_order), moe.global_names,
                                                        groups.tp_group, groups.tp_rank, moe.partitions)
                return self._canzona_clip
            if groups.tp_size > 1 or self.model_parallel_world_size != groups.pp_size:
                return None
            if self.clip_grad <= 0.0 and groups.pp_size == 1:
                return None
            if self._canzona_clip is None:
                from .clip import TorchClip

                moe = self._canzona.moe
                if moe is not None and moe.active:  # slots of the whole model: every expert counted once
                    # (pipeline: this stage's whole-model slots, stacked in stage order)
                    self._canzona_clip = TorchClip(self, list(moe.global_order), groups.pp_group, groups.pp_size,
                                                   rename=moe.global_names)
                else:
                    self._canzona_clip = TorchClip(self, self._canzona.param_order, groups.pp_group, groups.pp_size)
            return self._canzona_clip

        def scaled_global_norm(self, norm_type=2):
            clip = self._canzona_torch_clip()
            if norm_type == 2 and clip is not None:
                from deepspeed.accelerator import get_accelerator

                return clip.global_norm(self, get_accelerator().current_device_name())
            if self._canzona.groups.pp_size > 1:
                return self._canzona_pipeline_norm()
            return super().scaled_global_norm(norm_type)

        def _canzona_pipeline_norm(self):
            """DeepSpeed's norm (squared partition norms, tied copies skipped, TP shards counted
            once per TP group) with ONE reduction over the DP group and ONE over the model-parallel
            group for all param groups together, so that every pipeline stage issues the same
            collectives whatever its number of param groups (pipeline x tensor parallelism)."""
            from deepspeed.accelerator import get_accelerator
            from deepspeed.runtime.utils import is_model_parallel_parameter

            from .clip import TorchClip

            device = get_accelerator().current_device_name()
            total = torch.zeros(1, dtype=torch.float32, device=device)
            for i in range(len(self.bit16_groups)):
                pieces = TorchClip.partition_pieces(self, i)
                for p in self.params_in_partition[i]:
                    if getattr(p, "ds_pipe_replicated", False):
                        continue
                    if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                        g = pieces[self.get_param_id(p)]
                        total += torch.linalg.vector_norm(g.float(), 2.0).pow(2).to(device)
            dist.all_reduce(total, group=self.dp_process_group)
            self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
            norm = total.sqrt().squeeze(0)
            return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, -1.0))

        def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
            clip = self._canzona_torch_clip()
            if clip is None or self.clip_grad <= 0.0:  # without clipping: DeepSpeed's unscale (fp16) only
                return super().unscale_and_clip_grads(grad_groups_flat, total_norm)
            clip.clip(grad_groups_flat, total_norm, self.clip_grad, self.loss_scale)

        # -- checkpoints --------------------------------------------------------------
        def _load_legacy_checkpoint(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False):
            # DeepSpeed's stock load: engine.load_checkpoint takes it only where the checkpoint
            # index's fingerprints equal this run's (integration/ckpt/route.index_route); what is
            # left to refuse is a file no Canzona optimizer wrote
            if load_optimizer_states and not all(STATE_KEY in (sd.get("base_optimizer_state") or {})
                                                 for sd in state_dict_list if sd is not None):
                raise ValueError("This ZeRO checkpoint was not written by a Canzona optimizer (its optimizer state has "
                                 f"no {STATE_KEY!r} entry); load it with the optimizer that wrote it, or load the "
                                 "module weights only (load_optimizer_states=False, load_module_only=True).")
            return super()._load_legacy_checkpoint(state_dict_list, load_optimizer_states, load_from_fp32_weights)

        def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
            raise ValueError("Canzona optimizers do not load DeepSpeed universal checkpoints (ds_to_universal drops "
                             "per-matrix optimizer state); engine.load_checkpoint() of a Canzona checkpoint resumes at "
                             "another DP/TP size or ZeRO stage directly, and `canzona-ckpt convert` writes consolidated "
                             "files by parameter name (docs/checkpoints.md).")

    return CanzonaZeroOptimizer


_ZERO_CLASS = None


def zero_optimizer_class():
    global _ZERO_CLASS
    if _ZERO_CLASS is None:
        _ZERO_CLASS = _make_zero_class()
    return _ZERO_CLASS

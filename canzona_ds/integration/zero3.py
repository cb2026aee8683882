"""ZeRO stage 3: whole-matrix updates hosted over ZeRO-3's partitions (placement/sharded.py).

DeepSpeed's ZeRO-3 cuts every parameter over the DP group (rank r holds ``[r*P, (r+1)*P)`` of
its flat elements, P = ceil(numel / dp), the last piece padded), keeps one flat fp32 partition
per sub-group and reduce-scatters each gradient into the matching gradient partition.  Its step
walks the sub-groups: gradient partition ready, unscale/clip, ``optimizer.step()`` with the
param group holding that one flat partition, fp32 -> bit16 copy.  We keep all of it stock and
change two things:

* ``_create_fp16_sub_groups`` - the matrix group is ONE sub-group whatever
  ``sub_group_size`` says: the micro-group runtime exchanges the pieces of all matrices
  in one step (every rank has the same sub-groups: partition sizes are equal on every rank);
  the AdamW group keeps stock sub-groups;
* after construction, this rank's piece of every matrix in that partition
  (``FlatPiece``: offset, real length, padding tail excluded) and every matrix's cut over the
  DP group (``FlatSplit.even``, checked against ``ds_tensor.ds_numel``) are bound to the
  optimizer's sharded placement.

So the matrix sub-group's ``optimizer.step()`` runs the micro-group runtime on views into the
fp32 partition and its gradient partition; the AdamW sub-groups run torch's AdamW element-wise
on theirs.  The fp32 partitions, their layout, ``zero_to_fp32``, the bit16 all-gather,
offload and the loss scaler are DeepSpeed's.  Further overrides, each small:

* ``_get_norm_groups`` / ``unscale_and_clip_grads`` (gradient clipping on) - torch
  ``clip_grad_norm_``'s arithmetic bit for bit (:class:`TorchNorm3`): every parameter's gradient
  pieces go to one rank (a matrix's host, the others balanced by size; one all_to_all_single),
  which takes the norm of the WHOLE gradient as torch does; the norms meet in one all_reduce
  (each is non-zero on one rank: exact), ``total = vector_norm(norms in model order)``,
  ``coef = clamp(max_norm / (total + 1e-6), max=1)``, one multiply.  DeepSpeed's own norm sums
  squared partition norms over the ranks: the same math, other roundings, which a matrix rule
  amplifies (optim/clip.py says why);
* ``load_state_dict`` - DeepSpeed's own load, reached only where the checkpoint index's
  fingerprints equal this run's; a file without Canzona optimizer state is refused by name.

A checkpoint written at another DP size, plan or ZeRO stage resumes through the checkpoint
index (integration/ckpt/): this rank's new piece of every fp32 parameter and AdamW
moment read from the saved chunks it overlaps, every matrix's rule state handed to its new host
by name (a tag written before the index resumes only at the layout it was saved at).
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

from ..optimizer import MATRIX, STATE_KEY, CanzonaOptimizer
from ..placement import FlatPiece
from ..tp.runtime import FlatSplit
from .ds_compat import check_instance, zero3_builtin_muon_active, zero3_partition_group

#: DeepSpeedZeroOptimizer_Stage3 instance attributes the subclass reads
ZERO3_INSTANCE_ATTRS: tuple[str, ...] = (
    "fp16_groups", "fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat_numel", "sub_group_to_group_id",
    "grad_position", "clip_grad", "loss_scale", "dp_process_group", "offload_optimizer", "swap_optimizer",
    "partition_count", "averaged_gradients", "module",
)


def _make_zero3_class():
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class CanzonaZero3Optimizer(DeepSpeedZeroOptimizer_Stage3):
        """Stock ZeRO-3 with the matrix group stepped by the sharded placement."""

        def __init__(self, module, init_optimizer: CanzonaOptimizer, *args: Any, **kwargs: Any) -> None:
            if not isinstance(init_optimizer, CanzonaOptimizer):
                raise TypeError(f"CanzonaZero3Optimizer needs a CanzonaOptimizer, got {type(init_optimizer).__name__}")
            if init_optimizer.placement.kind != "sharded":
                raise RuntimeError(f"ZeRO stage 3 needs a CanzonaOptimizer built with placement='sharded', got "
                                   f"{init_optimizer.placement.kind!r}.")
            roles = [g["canzona_role"] for g in init_optimizer.param_groups]
            self._canzona = init_optimizer
            self._canzona_group = roles.index(MATRIX) if MATRIX in roles else None
            # the matrix group's parameters, before ZeRO-3 empties the param groups
            self._canzona_matrix_params = [] if self._canzona_group is None else \
                list(init_optimizer.param_groups[self._canzona_group]["params"])
            self._canzona_matrix_ids = {id(p) for p in self._canzona_matrix_params}
            self._canzona_sub_group = None
            super().__init__(module, init_optimizer, *args, **kwargs)
            check_instance(self, ZERO3_INSTANCE_ATTRS)
            if zero3_builtin_muon_active(self):
                raise RuntimeError("DeepSpeed's built-in Muon path is active on CanzonaOptimizer parameters; it "
                                   "would orthogonalise twice.")
            if self._canzona_group is not None:
                self._canzona_bind()

        # -- layout ------------------------------------------------------------------
        def _create_fp16_sub_groups(self, params_group):
            if params_group and all(id(p) in self._canzona_matrix_ids for p in params_group):
                return [params_group]  # the matrix group: one sub-group (module docstring)
            return super()._create_fp16_sub_groups(params_group)

        def _canzona_bind(self) -> None:
            """This rank's piece of every matrix in the matrix sub-group's flat partition, checked
            against ZeRO-3's cut, bound to the sharded placement."""
            opt = self._canzona
            subs = [i for i in range(len(self.fp16_groups)) if self.sub_group_to_group_id[i] == self._canzona_group]
            if len(subs) != 1:
                raise RuntimeError(f"ZeRO-3 made {len(subs)} sub-groups of the CanzonaOptimizer matrix group; the "
                                   "sharded step needs exactly one.")
            i = subs[0]
            group = self.fp16_groups[i]
            if [id(p) for p in group] != [id(p) for p in self._canzona_matrix_params]:
                raise RuntimeError("ZeRO-3 reordered or dropped matrices of the CanzonaOptimizer group; cannot bind "
                                   "their partitions.")
            pg = zero3_partition_group(self, i)
            world, rank = dist.get_world_size(group=pg), dist.get_rank(group=pg)
            if world != opt.groups.dp_size:
                raise RuntimeError(f"ZeRO-3 partitions the matrices over {world} ranks but the optimizer was built for "
                                   f"dp_size={opt.groups.dp_size}.")
            pieces, splits, offset = [], [], 0
            for name, p in zip(opt.matrix_names, group):
                shape = opt.shapes[name]
                split = FlatSplit.even(name, shape, world, opt.infos[name].num_heads, opt.infos[name].num_experts)
                P = p.partition_numel()
                if p.ds_numel != math.prod(shape) or P != p.ds_tensor.ds_numel or \
                        split.starts[rank] != min(rank * P, p.ds_numel) or \
                        split.lengths[rank] != max(0, min(P, p.ds_numel - rank * P)):
                    raise RuntimeError(f"ZeRO-3's partition of {name} (numel {p.ds_numel}, {P} per rank) is not the "
                                       f"cut FlatSplit.even expects for shape {shape} over {world} ranks.")
                if self.grad_position[self.get_param_id(p)][1] != offset:
                    raise RuntimeError(f"ZeRO-3's gradient partition of {name} is not at offset {offset}.")
                pieces.append(FlatPiece(name, offset, split.lengths[rank]))
                splits.append(split)
                offset += P
            numel = int(self.fp16_partitioned_groups_flat_numel[i])
            if offset != numel or self.fp32_partitioned_groups_flat[i].numel() != numel:
                raise RuntimeError(f"ZeRO-3's matrix partition has {self.fp32_partitioned_groups_flat[i].numel()} "
                                   f"elements, the pieces span {offset}.")
            self._canzona_sub_group = i
            opt.bind_sharded(numel, pieces, splits, group=pg)
            self._canzona_comm_device = _comm_device(self)
            if opt.tp_runtime is not None:
                opt.tp_runtime.comm_device = self._canzona_comm_device

        def canzona_layout_meta(self) -> dict:
            """What the rule state's placement depends on (its fingerprint:
            ckpt/emit.layout_fingerprint); written into every ZeRO-3 file before the checkpoint
            index (ckpt/route.unindexed compares it with this run's)."""
            opt = self._canzona
            runtime = opt.tp_runtime
            payload = {"dp": self.partition_count, "runtime": None if runtime is None else runtime.fingerprint(),
                       "matrices": list(opt.matrix_names), "rule": opt.rule.name}
            names = {id(p): n for n, p in self.module.named_parameters()}
            return {"kind": "zero3", "world_size": self.partition_count,
                    "fingerprint": hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16],
                    "matrix_names": list(opt.matrix_names), "rule": opt.rule.name,
                    "hosted": sorted(opt.handled_names()), "dp_rank": dist.get_rank(group=self.dp_process_group),
                    # what a resume at another DP size needs to cut the flat partitions back into
                    # parameters: every sub-group's parameters (in flat order) and its param group
                    "sub_groups": [[names[id(p)] for p in g] for g in self.fp16_groups],
                    "sub_group_param_group": [int(self.sub_group_to_group_id[i]) for i in range(len(self.fp16_groups))],
                    "numels": {names[id(p)]: int(p.ds_numel) for g in self.fp16_groups for p in g}}

        # -- gradient clipping ----------------------------------------------------------
        def _get_norm_groups(self):
            if self.clip_grad <= 0.0:
                return super()._get_norm_groups()
            if getattr(self, "_canzona_norm", None) is None:
                self._canzona_norm = TorchNorm3(self)
            return [self._canzona_norm.total()]

        def unscale_and_clip_grads(self, sub_group_id, total_norm):
            if self.clip_grad <= 0.0:
                return super().unscale_and_clip_grads(sub_group_id, total_norm)
            grad = self.fp32_partitioned_groups_flat[sub_group_id].grad
            norm = total_norm / self.loss_scale
            # torch.nn.utils.clip_grad_norm_'s arithmetic
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            gathered = [grad]
            if sub_group_id == getattr(self, "_canzona_sub_group", None) and self._canzona.tp_runtime is not None:
                # the matrix sub-group: its hosts already hold every piece of their matrices'
                # gradients (the norm's all-to-all); the same element-wise arithmetic there makes
                # them what the runtime's own gradient all-to-all would have delivered
                pieces = self._canzona_norm.take_gathered()
                gathered += [x for parts in pieces.values() for x in parts]
                self._canzona.tp_runtime.gathered = pieces
            for g in gathered:
                if self.loss_scale != 1.0:  # a power of two: exact
                    g.mul_(1.0 / self.loss_scale)
                g.mul_(coef.to(g.device, g.dtype) if torch.is_tensor(coef) else coef)

        # -- checkpoints --------------------------------------------------------------
        def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                            checkpoint_folder=None, load_serial=None, param_shapes=None):
            # DeepSpeed's stock load: engine.load_checkpoint takes it only where the checkpoint
            # index's fingerprints equal this run's (integration/ckpt/route.index_route)
            if checkpoint_folder:
                raise ValueError("Canzona optimizers do not load DeepSpeed universal checkpoints (ds_to_universal "
                                 "drops per-matrix optimizer state); engine.load_checkpoint() of a Canzona checkpoint "
                                 "resumes at another DP size or ZeRO stage directly (docs/checkpoints.md).")
            if load_optimizer_states and not all(STATE_KEY in (sd.get("optimizer_state_dict") or {})
                                                 for sd in state_dict_list if sd is not None):
                raise ValueError("This checkpoint was not written by a Canzona optimizer at ZeRO stage 3 (its "
                                 f"optimizer state has no {STATE_KEY!r} entry); load it with the optimizer and stage "
                                 "that wrote it, or load the module weights only (load_optimizer_states=False).")
            return super().load_state_dict(state_dict_list, load_optimizer_states, load_from_fp32_weights,
                                           checkpoint_folder, load_serial, param_shapes)

    return CanzonaZero3Optimizer


def _comm_device(zopt):
    """The device the DP group's collectives need: the accelerator where the fp32 partitions are
    offloaded to host memory on a GPU run (NCCL carries device tensors only), else None (the
    partitions' own device)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if zopt.offload_optimizer and accel.device_name() != "cpu":
        return torch.device(accel.current_device_name())
    return None


class TorchNorm3:
    """``torch.nn.utils.get_total_norm`` of the whole gradients, from ZeRO-3's pieces::

        rank r: piece_r(g_k) for every parameter k (real elements, padding excluded)
        all_to_all_single: the pieces of g_k -> norm host h(k)   (a matrix's rule host; the
                           others by size, largest first, onto the least loaded rank)
        host: norms[k] = ||cat(pieces of g_k)|| (torch's per-tensor norm);  0 elsewhere
        all_reduce(SUM) over the DP group (one non-zero term per entry: exact)
        total = vector_norm(norms in the model's parameter order)

    A matrix's norm host is its rule host, so that all-to-all has already brought the host
    every piece of the matrix's gradient: the host keeps them (:meth:`take_gathered`), the
    clip scales them as it scales the partitions, and the runtime's step skips its own
    gradient all-to-all (``MicroGroupRuntime.pregathered``): matrix gradients cross the wire
    once per step, not twice.
    """

    def __init__(self, zopt) -> None:
        from deepspeed import comm as dist

        from ..optim.clip import stack_order
        from ..planning.tp import min_heap_solver

        opt = zopt._canzona
        self.zopt = zopt
        self.group = zopt.dp_process_group
        self.world, self.rank = dist.get_world_size(group=self.group), dist.get_rank(group=self.group)
        by_id = {}
        for i, sub in enumerate(zopt.fp16_groups):
            for j, p in enumerate(sub):
                by_id[id(p)] = (i, j, p)
        ids = {n: id(p) for n, p in zopt.module.named_parameters()}
        #: (name, sub-group, index in it, parameter) in the model's parameter order (clip_grad_norm_'s)
        self.params = []
        for name in opt.param_order:
            hit = by_id.get(ids.get(name))
            if hit is None:
                raise RuntimeError(f"ZeRO-3 holds no partition of parameter {name!r}.")
            self.params.append((name, *hit))
        runtime = opt.tp_runtime
        host = {} if runtime is None else {m.name: h for m, h in zip(runtime.matrices, runtime.plan.host)}
        others = [(float(p.ds_numel), k) for k, (n, _, _, p) in enumerate(self.params) if n not in host]
        assign, _ = min_heap_solver(others, self.world)
        extra = {k: r for r, ks in enumerate(assign) for k in ks}
        self.host = [host[n] if n in host else extra[k] for k, (n, _, _, _) in enumerate(self.params)]
        self.order = stack_order([("g", "fp32")] * len(self.params))
        self.lengths = [[max(0, min(p.partition_numel(), p.ds_numel - r * p.partition_numel()))
                         for r in range(self.world)] for _, _, _, p in self.params]
        #: the matrices' gradient pieces this rank hosts, from the last total() (take_gathered)
        self.runtime_names = set(host)
        self.gathered: dict[str, list] | None = None
        if runtime is not None:
            runtime.pregathered = True

    def take_gathered(self) -> dict[str, list]:
        """This step's hosted matrices' gradient pieces (name -> one flat fp32 piece per DP rank),
        handed over once."""
        if self.gathered is None:
            raise RuntimeError("ZeRO-3 clipping: the matrix sub-group is stepped without this step's gradient norm")
        out, self.gathered = self.gathered, None
        return out

    def _piece(self, i: int, j: int, p):
        """This rank's real gradient piece of ``p`` (parameter ``j`` of sub-group ``i``), flat."""
        zopt = self.zopt
        n = max(0, min(p.partition_numel(), p.ds_numel - self.rank * p.partition_numel()))
        if zopt.offload_optimizer:
            _, off, _ = zopt.grad_position[zopt.get_param_id(p)]
            return zopt.fp32_partitioned_groups_flat[i].grad.narrow(0, off, n)
        return zopt.averaged_gradients[i][j].reshape(-1).narrow(0, 0, n)

    def total(self) -> torch.Tensor:
        import torch.distributed as tdist

        from ..optim.clip import per_tensor_norms, total_norm

        world, me = self.world, self.rank
        comm = getattr(self.zopt, "_canzona_comm_device", None)
        pieces = [self._piece(i, j, p).float() for _, i, j, p in self.params]
        device = pieces[0].device if comm is None else comm
        pieces = [x.to(device) for x in pieces]
        send = torch.cat([pieces[k] for h in range(world) for k in range(len(pieces)) if self.host[k] == h])
        in_splits = [sum(self.lengths[k][me] for k in range(len(pieces)) if self.host[k] == h) for h in range(world)]
        mine = [k for k in range(len(pieces)) if self.host[k] == me]
        out_splits = [sum(self.lengths[k][r] for k in mine) for r in range(world)]
        recv = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
        tdist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        chunks = list(recv.split(out_splits))
        cursors = [0] * world
        whole = []
        self.gathered = {}
        for k in mine:
            parts = []
            for r in range(world):
                n = self.lengths[k][r]
                parts.append(chunks[r][cursors[r]:cursors[r] + n])
                cursors[r] += n
            whole.append(torch.cat(parts))
            if self.params[k][0] in self.runtime_names:
                self.gathered[self.params[k][0]] = parts
        norms = torch.zeros(len(pieces), dtype=torch.float32, device=device)
        for k, n in zip(mine, per_tensor_norms(whole)):
            norms[k] = n
        tdist.all_reduce(norms, group=self.group)
        total = total_norm(norms[self.order])
        return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0))


_ZERO3_CLASS = None


def zero3_optimizer_class():
    global _ZERO3_CLASS
    if _ZERO3_CLASS is None:
        _ZERO3_CLASS = _make_zero3_class()
    return _ZERO3_CLASS

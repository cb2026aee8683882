"""ZeRO-1/2 gradient clipping that equals ``torch.nn.utils.clip_grad_norm_`` bit for bit.

DeepSpeed's ZeRO-1/2 clip (``scaled_global_norm`` + ``unscale_and_clip_grads``) sums squared
partition norms and multiplies by ``1 / ((norm + 1e-6) / clip)``: the same math as torch, other
roundings, and the matrix rules amplify one ulp of the clip factor into visible differences
(``optim/clip.py`` says why).  :class:`TorchClip` reproduces torch's arithmetic from ZeRO's
partitions::

    ZeRO partitions of one param group (P elements each)
    rank 0                 rank 1                 rank 2
    | W_a | W_b | e[0:k]  | e[k:] | n | W_c      | ...            e straddles ranks 0 and 1
      ^ whole: its norm is computed where it lies
                  ^ e's pieces go to the rank holding its larger piece (one all_to_all_single
                    per group and step, only if a parameter straddles), which computes ||e||

    norms[model index] = ||g|| on exactly one rank, 0 elsewhere;  all_reduce(SUM) is exact
    total = vector_norm(norms);  coef = clamp(clip / (total + 1e-6), max=1);  g *= coef

Matrices are whole on their owner by construction (the Canzona layout), so only AdamW
parameters that DeepSpeed's equal chunks cut cost traffic: at most ``dp - 1`` pieces per group.

Pipeline parallelism: each stage holds other parameters; a stage's norms (without the
``ds_pipe_replicated`` copy of a tied weight, which the first holder counts) are gathered over
the pipeline group and stacked in stage order, which is the model's parameter order
(:class:`PipelineNorm`).  With tensor parallelism, DeepSpeed's own clip runs (its
model-parallel reduction of squared norms: equal to rounding, not bit for bit), except under
DeepSpeed MoE (:class:`TorchClipMoETP`).

DeepSpeed MoE: the slots are the whole model's parameters (every expert of every
expert-parallel rank, ``MoEInfo.global_order``); an expert group's partitions span its
expert-data-parallel group, whose owner fills the slot of each expert it holds, so the sum over
the DP group still has one non-zero term per slot (:func:`clip_moe_module_gradients` at stage 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import Tensor

from ..optim.clip import clip_coefficient, per_tensor_norms, total_norm


class PipelineNorm:
    """torch's total norm over every pipeline stage's per-parameter norms, stacked in stage order
    (each stage passes its own, 1-D fp32, in its parameters' order).  The stages' counts are
    fixed for a run: gathered once (host objects), then one all-gather per step."""

    def __init__(self, pp_group=None, pp_size: int = 1) -> None:
        self.pp_group, self.pp_size = pp_group, pp_size
        self.counts: list[int] | None = None

    def total(self, stage_norms: Tensor) -> Tensor:
        if self.pp_size == 1:
            return total_norm(stage_norms)
        if self.counts is None:
            counts: list = [None] * self.pp_size
            tdist.all_gather_object(counts, int(stage_norms.numel()), group=self.pp_group)
            self.counts = [int(c) for c in counts]
        longest = max(self.counts)
        padded = torch.zeros(longest, dtype=stage_norms.dtype, device=stage_norms.device)
        padded[:stage_norms.numel()] = stage_norms
        gathered = torch.empty(self.pp_size * longest, dtype=stage_norms.dtype, device=stage_norms.device)
        tdist.all_gather_into_tensor(gathered, padded, group=self.pp_group)
        # the group's rank r is pipeline stage r (the grid builds the pipe group along its pipe axis)
        return total_norm(torch.cat([gathered[r * longest:r * longest + n] for r, n in enumerate(self.counts)]))


def clip_module_gradients(params: list, max_norm: float, pipeline: PipelineNorm) -> Tensor:
    """ZeRO stage 0: every rank holds the averaged gradients of its stage's trainable parameters;
    ``torch.nn.utils.clip_grad_norm_`` over all stages (a tied weight's replicated copy counted
    once, a parameter without gradient as a zero one, as ZeRO steps it)."""
    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    counted = [g for p, g in zip(params, grads) if not getattr(p, "ds_pipe_replicated", False)]
    device = params[0].device
    local = torch.stack([n.to(device) for n in per_tensor_norms(counted)]) if counted else \
        torch.zeros(0, device=device)
    norm = pipeline.total(local)
    coef = clip_coefficient(norm, max_norm)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))
    return norm


@dataclass(frozen=True)
class _Piece:
    rank: int      # partition (DP rank in the group) holding the piece
    start: int     # first element of the parameter it holds
    numel: int


@dataclass(frozen=True)
class _Straddler:
    param_id: int
    index: int     # position in the model's parameter order
    numel: int
    pieces: tuple[_Piece, ...]
    norm_rank: int  # the rank that assembles it (largest piece; lowest rank on ties)


class TorchClip:
    """Per-step global norm and clip of a :class:`CanzonaZeroOptimizer`, torch's arithmetic."""

    def __init__(self, zero, model_order: list[str], pp_group=None, pp_size: int = 1,
                 rename: dict | None = None) -> None:
        # MoE: ``model_order`` is the whole model's (every expert), ``rename`` maps this rank's
        # parameter names to it; each expert's norm comes from its owner in its expert-DP group
        index = {name: k for k, name in enumerate(model_order)}
        if rename:
            index = {local: index[whole] for local, whole in rename.items()}
        self.num_params = len(model_order)
        self.pipeline = PipelineNorm(pp_group, pp_size)
        self._indices: dict = {}
        #: model-order slots counted in the norm (a tied weight's replicated copy is not)
        replicated = {zero.param_names[p] for g in zero.bit16_groups for p in g
                      if getattr(p, "ds_pipe_replicated", False)}
        self.counted = [k for k, name in enumerate(model_order) if name not in replicated]
        #: per group: [(param_id, model index)] of parameters whole on this rank
        self.whole: list[list[tuple[int, int]]] = []
        #: per group: parameters cut across ranks
        self.straddlers: list[list[_Straddler]] = []
        for i, group in enumerate(zero.bit16_groups):
            rank = tdist.get_rank(group=zero.real_dp_process_group[i])
            P = int(zero.partition_size[i])
            whole, cut = [], []
            for p in group:
                pid = zero.get_param_id(p)
                name = zero.param_names[p]
                if name not in index:
                    raise RuntimeError(f"Gradient clipping: ZeRO parameter {name!r} is not among the optimizer's "
                                       "trainable parameters.")
                parts = zero.param_to_partition_ids[i][pid]
                if len(parts) == 1:
                    if parts[0] == rank:
                        whole.append((pid, index[name]))
                    continue
                pieces = []
                for r in parts:
                    start = int(zero.grad_start_offset[i][r][pid])
                    dest = int(zero.grad_partition_insertion_offset[i][r][pid])
                    pieces.append(_Piece(r, start, min(p.numel() - start, P - dest)))
                if sum(pc.numel for pc in pieces) != p.numel():
                    raise RuntimeError(f"Gradient clipping: the ZeRO pieces of {name!r} do not cover it.")
                norm_rank = max(pieces, key=lambda pc: (pc.numel, -pc.rank)).rank
                cut.append(_Straddler(pid, index[name], p.numel(), tuple(pieces), norm_rank))
            self.whole.append(whole)
            self.straddlers.append(cut)

    # ------------------------------------------------------------------ gradients
    @staticmethod
    def partition_pieces(zero, i: int) -> dict[int, Tensor]:
        """param_id -> this rank's (1-D) piece of its averaged gradient, in group i."""
        rank = tdist.get_rank(group=zero.real_dp_process_group[i])
        P = int(zero.partition_size[i])
        out = {}
        if zero.cpu_offload:  # the fp32 gradient partition is already filled
            flat = zero.single_partition_of_fp32_groups[i].grad
            for p in zero.params_in_partition[i]:
                pid = zero.get_param_id(p)
                start = int(zero.grad_start_offset[i][rank][pid])
                dest = int(zero.grad_partition_insertion_offset[i][rank][pid])
                out[pid] = flat.narrow(0, dest, min(p.numel() - start, P - dest))
            return out
        if not zero.params_in_partition[i]:  # a rank owning only padding (its buffer is not always flagged)
            return out
        grads = [g for g in zero.averaged_gradients[i] if not getattr(g, "_zero_padding", False)]
        if len(grads) != len(zero.params_in_partition[i]):
            raise RuntimeError("Gradient clipping: ZeRO's gradient list does not match its partition's parameters.")
        for p, g in zip(zero.params_in_partition[i], grads):
            out[zero.get_param_id(p)] = g.reshape(-1)
        return out

    def _assemble(self, zero, i: int, pieces: dict[int, Tensor], device) -> list[tuple[int, Tensor]]:
        """Bring every straddling parameter's pieces to its norm rank (one all_to_all_single);
        return (model index, whole gradient) of those this rank assembles."""
        cut = self.straddlers[i]
        if not cut:
            return []
        group = zero.real_dp_process_group[i]
        rank, world = tdist.get_rank(group=group), tdist.get_world_size(group=group)
        send: list[list[Tensor]] = [[] for _ in range(world)]
        recv_sizes = [0] * world
        for s in cut:
            for pc in s.pieces:
                if pc.rank == s.norm_rank:
                    continue
                if pc.rank == rank:
                    send[s.norm_rank].append(pieces[s.param_id])
                if s.norm_rank == rank:
                    recv_sizes[pc.rank] += pc.numel
        dtype = next(iter(pieces.values())).dtype if pieces else torch.float32
        send_sizes = [sum(t.numel() for t in ts) for ts in send]
        flat_send = torch.cat([t.to(device) for ts in send for t in ts]) if sum(send_sizes) else \
            torch.empty(0, dtype=dtype, device=device)
        flat_recv = torch.empty(sum(recv_sizes), dtype=flat_send.dtype, device=device)
        tdist.all_to_all_single(flat_recv, flat_send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                group=group)
        offsets = [sum(recv_sizes[:r]) for r in range(world)]
        out = []
        for s in cut:
            if s.norm_rank != rank:
                continue
            full = torch.empty(s.numel, dtype=flat_recv.dtype, device=device)
            for pc in s.pieces:
                if pc.rank == rank:
                    full.narrow(0, pc.start, pc.numel).copy_(pieces[s.param_id])
                else:
                    full.narrow(0, pc.start, pc.numel).copy_(flat_recv.narrow(0, offsets[pc.rank], pc.numel))
                    offsets[pc.rank] += pc.numel
            out.append((s.index, full))
        return out

    # ------------------------------------------------------------------ norm and clip
    def global_norm(self, zero, device) -> Tensor:
        """torch's total gradient norm (0-dim fp32 on ``device``; -1 if not finite, DeepSpeed's
        sentinel for an overflow)."""
        norms = self._local_norms(zero, device)
        # one rank holds each norm, zeros elsewhere: the sum is exact in any order (MoE: the DP
        # group spans every expert-parallel rank, so every expert's owner)
        tdist.all_reduce(norms, group=zero.dp_process_group)
        counted = norms if len(self.counted) == self.num_params else \
            norms[self._index("counted", self.counted, device)]
        total = self.pipeline.total(counted)
        return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0))

    def _local_norms(self, zero, device) -> Tensor:
        """One slot per parameter: the norm of every whole gradient this rank holds (its own, or
        assembled from the pieces it received), zeros elsewhere."""
        norms = torch.zeros(self.num_params, dtype=torch.float32, device=device)
        for i in range(len(zero.bit16_groups)):
            pieces = self.partition_pieces(zero, i)
            items = [(k, pieces[pid]) for pid, k in self.whole[i]] + self._assemble(zero, i, pieces, device)
            if not items:
                continue
            values = per_tensor_norms([t if t.dtype == torch.float32 else t.float() for _, t in items])
            at = self._index(("group", i), [k for k, _ in items], device)
            norms.index_copy_(0, at, torch.stack([v.to(device) for v in values]))
        return norms

    def _index(self, key, positions: list[int], device) -> Tensor:
        """The (fixed) slot positions as a device tensor, made once: no host-to-device copy per step."""
        if key not in self._indices:
            self._indices[key] = torch.tensor(positions, dtype=torch.long, device=device)
        return self._indices[key]

    @staticmethod
    def clip(grads: list, norm: Tensor, clip_grad: float, loss_scale: float) -> None:
        """Unscale (fp16) and multiply by torch's clamped clip coefficient, in place."""
        flat = [g for x in grads for g in (x if isinstance(x, list) else [x])]
        norm = torch.where(norm < 0, torch.full_like(norm, float("inf")), norm)  # overflow sentinel
        if loss_scale != 1.0:
            norm = norm / loss_scale
            for g in flat:
                g.data.mul_(1.0 / loss_scale)
        coef = clip_coefficient(norm, clip_grad)
        for g in flat:
            g.data.mul_(coef.to(g.device))


class TorchClipMoETP(TorchClip):
    """DeepSpeed MoE x tensor parallelism (ZeRO 1/2): torch's total norm of the whole model's
    per-parameter norms, one slot per parameter of the whole model (every expert once).

    DeepSpeed's own norm is wrong here: it counts a parameter without TP attributes only on
    model-parallel rank 0, and under an mpu DeepSpeed's expert groups put different experts on
    the TP ranks (TP 2 x DP 2, ep_size 2: experts 0,1 on TP rank 0, experts 2,3 on TP rank 1),
    so the experts of the other TP ranks drop out of the norm.  Here each slot gets exactly one
    contribution in the whole world, summed over the DP group, then over the TP group::

        replicated dense parameter   its DP owner on TP rank 0: ||g||
        expert parameter             its owner in its expert-DP group: ||g||   (every copy of an
                                     expert is in one expert-DP group)
        TP-split dense parameter     its DP owner on every TP rank: ||shard||^2, and the slot's
                                     norm is sqrt(sum over TP) - the one rounding off torch's
                                     (equal to the single-process clip up to rounding, as
                                     DeepSpeed's TP norm)

    One all-reduce over the DP group and one over the TP group per step."""

    def __init__(self, zero, model_order: list[str], rename: dict, tp_group, tp_rank: int,
                 partitions: dict) -> None:
        from deepspeed.runtime.utils import is_model_parallel_parameter

        super().__init__(zero, model_order, rename=rename)
        self.tp_group, self.tp_rank = tp_group, tp_rank
        index = {name: k for k, name in enumerate(model_order)}
        split, replicated = set(), set()
        for group in zero.bit16_groups:
            for p in group:
                name = zero.param_names[p]
                if is_model_parallel_parameter(p):
                    if name in partitions:
                        raise RuntimeError(f"Gradient clipping: expert parameter {name!r} is tensor-parallel "
                                           "(refused at build: integration/moe.check_moe).")
                    split.add(index[rename[name]])
                elif name not in partitions:
                    replicated.add(index[rename[name]])
        #: slots of TP-split parameters (squared shard norms summed over TP)
        self.split = sorted(split)
        #: slots of replicated dense parameters (counted on TP rank 0 only)
        self.replicated = sorted(replicated)

    def global_norm(self, zero, device) -> Tensor:
        norms = self._local_norms(zero, device)
        if self.tp_rank != 0 and self.replicated:
            norms.index_fill_(0, self._index("replicated", self.replicated, device), 0.0)
        squares = torch.zeros(self.num_params, dtype=torch.float32, device=device)
        if self.split:
            at = self._index("split", self.split, device)
            squares.index_copy_(0, at, norms.index_select(0, at).pow(2))
            norms.index_fill_(0, at, 0.0)
        both = torch.cat([norms, squares])
        # one term per slot in the world (sums of shard squares for TP-split ones): DP, then TP
        tdist.all_reduce(both, group=zero.dp_process_group)
        tdist.all_reduce(both, group=self.tp_group)
        norms, squares = both[:self.num_params], both[self.num_params:]
        if self.split:
            at = self._index("split", self.split, device)
            norms.index_copy_(0, at, squares.index_select(0, at).sqrt())
        total = total_norm(norms)
        return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0))


def clip_moe_module_gradients(module, opt, max_norm: float, pipeline: PipelineNorm | None = None) -> Tensor:
    """ZeRO stage 0 with DeepSpeed MoE: ``torch.nn.utils.clip_grad_norm_`` over the whole model
    (every expert of every expert-parallel rank), each parameter's norm in its whole-model slot:
    dense ones from DP rank 0, experts from expert-DP rank 0 of their group; one all-reduce over
    the DP group (a sum with one non-zero term per slot: exact).

    Under tensor parallelism (an mpu) the slots are filled as in :class:`TorchClipMoETP`:
    replicated dense parameters on TP rank 0 only, TP-split ones as squared shard norms summed
    over the TP group (torch's norm up to that rounding), experts by their expert-DP rank 0 (every
    copy of an expert lies in one expert-DP group); a second all-reduce over the TP group.

    Under pipeline parallelism ``module`` is this stage's, the slots this stage's whole-model
    parameters (every expert of the stage), and ``pipeline`` stacks the stages' norms in stage
    order (the stages without MoE layers pass theirs to the same :class:`PipelineNorm` from
    :func:`clip_module_gradients`)."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    moe, groups = opt.moe, opt.groups
    tp = groups.tp_size > 1
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    # a tied layer's replicated copy in a later pipeline stage is counted once (by its first stage)
    replicated = {moe.global_names[n] for n, p in named if getattr(p, "ds_pipe_replicated", False)}
    order = [name for name in moe.global_order if name not in replicated]
    slot = {name: k for k, name in enumerate(order)}
    device = named[0][1].device
    mine, at, square = [], [], []
    for n, p in named:
        part = moe.partitions.get(n)
        split = tp and part is None and is_model_parallel_parameter(p)
        if moe.global_names[n] in replicated:
            counts = False
        elif part is not None:
            counts = groups.expert(part).edp_rank == 0
        else:
            counts = groups.dp_rank == 0 and (split or groups.tp_rank == 0)
        if counts:
            mine.append(p.grad if p.grad is not None else torch.zeros_like(p))
            at.append(slot[moe.global_names[n]])
            square.append(split)
    size = len(order)
    norms = torch.zeros(2 * size if tp else size, dtype=torch.float32, device=device)
    if mine:
        values = torch.stack([v.to(device) for v in
                              per_tensor_norms([g if g.dtype == torch.float32 else g.float() for g in mine])])
        is_square = torch.tensor(square, dtype=torch.bool, device=device)
        values = torch.where(is_square, values.pow(2), values)  # a TP shard's squared norm
        at_slots = torch.tensor(at, dtype=torch.long, device=device) + is_square.long() * size
        norms.index_copy_(0, at_slots, values)
    if groups.dp_size > 1:
        tdist.all_reduce(norms, group=groups.dp_group)
    if tp:
        tdist.all_reduce(norms, group=groups.tp_group)
        squares, norms = norms[size:], norms[:size]
        norms = torch.where(squares > 0, squares.sqrt(), norms)
    norm = pipeline.total(norms) if pipeline is not None else total_norm(norms)
    coef = clip_coefficient(norm, max_norm)
    for _, p in named:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))
    return norm

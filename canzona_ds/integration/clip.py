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
Used when clipping is on and there is no model (tensor) parallelism or MoE; otherwise DeepSpeed's
own clip runs (its model-parallel reduction of squared norms: equal to rounding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import Tensor

from ..optim.clip import clip_coefficient, per_tensor_norms, total_norm


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

    def __init__(self, zero, model_order: list[str]) -> None:
        index = {name: k for k, name in enumerate(model_order)}
        self.num_params = len(model_order)
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
    def _my_pieces(zero, i: int) -> dict[int, Tensor]:
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
        norms = torch.zeros(self.num_params, dtype=torch.float32, device=device)
        for i in range(len(zero.bit16_groups)):
            pieces = self._my_pieces(zero, i)
            items = [(k, pieces[pid]) for pid, k in self.whole[i]] + self._assemble(zero, i, pieces, device)
            if not items:
                continue
            values = per_tensor_norms([t if t.dtype == torch.float32 else t.float() for _, t in items])
            at = torch.tensor([k for k, _ in items], dtype=torch.long, device=device)
            norms.index_copy_(0, at, torch.stack([v.to(device) for v in values]))
        # one rank holds each norm, zeros elsewhere: the sum is exact in any order
        tdist.all_reduce(norms, group=zero.dp_process_group)
        total = total_norm(norms)
        return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0))

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

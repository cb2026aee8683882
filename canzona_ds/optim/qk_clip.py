"""MuonClip's QK-clip (Kimi K2 tech report): cap each attention head's largest pre-softmax logit.

Plain torch (``torch.distributed`` for the one collective), no DeepSpeed.  Three pieces:

* :func:`max_logits` -- per query head, the largest logit ``(q_i . k_j) * scale`` over every
  position pair the head attends to (mask applied), computed block by block of query rows so
  at most one ``(B, H, block, T_k)`` block of scores exists at a time;
* :func:`qk_clip_scales` -- the rule: per-head maxima -> the factors for W_q's and W_k's head rows;
* :class:`QKClip` -- what the optimizer holds: the attention layers it clips (their q/k matrix
  names and head counts), each layer's running maximum over the step's micro-batches (written by
  the model's forward, ``observe``), and :meth:`QKClip.row_scales`, which reduces the maxima over
  the data-parallel group (one ``all_reduce(MAX)`` of ``sum(num_heads)`` fp32 values per step)
  and turns them into one per-row factor vector per clipped matrix.

Where a matrix is scaled: by whoever updates it, right after its rule update, on the same tensor:
a whole matrix (``placement.base.Placement.step``: the ZeRO-1/2 owner's fp32 master slice, which
DeepSpeed then copies into the bit16 weight and all-gathers; the stage-0 parameter) by its rows,
a matrix updated in pieces (ZeRO-3, the mixed layout's hosted matrices, TP shards) piece by
piece (``placement.hosted.scale_piece``).  DeepSpeed MoE's matrix groups (dense, then each
expert group) share the step's one collective (:meth:`QKClip.row_scales` caches it per step); its
attention is dense, so its q/k matrices are clipped as without MoE.

Tensor parallelism (Megatron-style or AutoTP; W_q / W_k column-parallel, split on their rows)::

    whole W_q (H*d rows, the TP layout = the shards concatenated in TP-rank order)
    | heads of TP rank 0 | heads of TP rank 1 | ...        rank r's rows start at sum(shard_sizes[:r])

Each TP rank's forward sees only its own heads, so it records their maxima and reduces them over
its DP group (the ranks with the same heads); no TP collective is needed: after the hosted
runtime's scatter, every TP rank applies the update to its own shard and then scales that shard,
whose rows are exactly its own heads.  Its factors are placed at its rows of a whole-matrix vector
(ones elsewhere, :attr:`AttentionLayer.tp_rows`), which ``scale_piece`` cuts as it cut the update
(the TP shard itself, or the mixed layout's DP pieces of it).  The logged figures of a rank are
those of its own heads (the main job reduces them over TP, train/trainer.optimizer_metrics).

Row layout of the projections (HF / the project's model; ``d`` = head_dim)::

    W_q (H*d, hidden):   rows [h*d, (h+1)*d) belong to query head h      h = 0..H-1
    W_k (KV*d, hidden):  rows [g*d, (g+1)*d) belong to key head g       g = 0..KV-1
    query head h reads key head g = h // (H / KV)                       (GQA groups of H/KV)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

#: query rows per block of scores in :func:`max_logits` (memory: B * H * BLOCK * T_k floats)
BLOCK = 256


@dataclass(frozen=True)
class QKClipConfig:
    """``optimizer.params.qk_clip``: MuonClip's QK-clip (docs/qk_clip.md).  Absent: off."""

    #: tau: after each optimizer step, every attention head whose largest pre-softmax logit over the step's global batch exceeded tau has its W_q / W_k head rows scaled so that logit becomes <= tau (Kimi K2 uses 100). A finite number > 0
    threshold: float = 100.0

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"Invalid qk_clip.threshold={t!r}. Must be a finite number > 0.")
        object.__setattr__(self, "threshold", float(t))

    @classmethod
    def from_value(cls, value: Any) -> "QKClipConfig | None":
        """The ``qk_clip`` value of ``optimizer.params``: null (off), or an object of the keys."""
        if value is None or isinstance(value, QKClipConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"Invalid qk_clip={value!r}. Must be a JSON object such as {{\"threshold\": 100.0}} "
                            "(absent: off).")
        allowed = sorted(f.name for f in cls.__dataclass_fields__.values())
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"Unknown qk_clip key(s) {unknown}. Allowed: {allowed}.")
        if "threshold" in value and value["threshold"] is None:
            raise ValueError("Invalid qk_clip.threshold=None. Must be a finite number > 0.")
        return cls(**dict(value))

    def describe(self) -> dict:
        return {"threshold": self.threshold}


# ---------------------------------------------------------------------------- the rule
def qk_clip_scales(s_max: Tensor, threshold: float, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """Per-head factors for W_q and W_k from the heads' largest logits (fp32).

    Kimi K2's MuonClip, per query head h with largest logit S_h (over the step's global batch)::

        gamma_h = tau / S_h   if S_h > tau   else 1          (torch.sqrt(tau / S_h) below, in fp32)

    Multi-head attention (every key head serves one query head): W_q's and W_k's rows of head h
    are each multiplied by ``sqrt(gamma_h)``, so the bilinear logit q.k scales by exactly gamma_h
    and a clipped head's largest logit becomes tau (on the same inputs).

    Grouped-query attention (key head g shared by the G = H/KV query heads of its group): one
    factor on W_k's rows acts on every head of the group, so the per-head rule cannot hold for
    all of them.  We use, with gamma_min = min over the group of gamma_h::

        key head g:    k_g = sqrt(gamma_min)
        query head h:  q_h = sqrt(gamma_h)                   if gamma_h == gamma_min
                       q_h = min(1, gamma_h / sqrt(gamma_min))  otherwise

    so head h's logit scales by q_h * k_g = min(gamma_h, sqrt(gamma_min)) <= gamma_h:

    * no head's logit grows and no weight grows (every factor <= 1);
    * every clipped head ends <= tau (its factor is <= gamma_h), and exactly at tau when
      gamma_h <= sqrt(gamma_min) (in particular the group's worst head);
    * a head of a group with no clipped head is untouched (all factors exactly 1); an unclipped
      head in a clipped group is scaled by sqrt(gamma_min) at most -- less than Megatron-core's
      group rule, which scales every head of the group by the group's gamma_min (split between
      Q and K by ``qk_clip_alpha``: ``SelfAttention.clip_qk`` takes the max logit over each
      query group).  The unclamped form q_h = gamma_h / sqrt(gamma_min) would keep every
      head's logit factor exactly gamma_h, but grows W_q rows of unclipped heads (by up to
      1/sqrt(gamma_min) per step, compounding while their group keeps clipping) -- refused
      here for that reason.

    For MHA (G = 1) gamma_min = gamma_h and both factors are ``sqrt(gamma_h)``: the published
    rule, bit for bit.

    Args:
        s_max: (H,) fp32, each query head's largest logit (-inf: the head saw no position pair).
        threshold: tau > 0.
        num_kv_heads: KV, dividing H.

    Returns:
        (q_scale (H,), k_scale (KV,)) fp32 factors, exactly 1.0 where nothing clips.
    """
    H = s_max.numel()
    if num_kv_heads < 1 or H % num_kv_heads:
        raise ValueError(f"Invalid num_kv_heads={num_kv_heads}: must divide the {H} query heads.")
    s = s_max.float()
    one = torch.ones_like(s)
    clipped = s > threshold
    # sqrt(tau / S) as the published rule computes it; 1 where the head does not clip
    gamma = torch.where(clipped, threshold / torch.where(clipped, s, one), one)
    sqrt_gamma = torch.where(clipped, torch.sqrt(gamma), one)
    groups = gamma.view(num_kv_heads, -1)                            # (KV, G)
    gamma_min, worst = groups.min(dim=1)                             # (KV,)
    k_scale = torch.sqrt(gamma_min)
    k_scale = torch.where(gamma_min < 1, k_scale, torch.ones_like(k_scale))
    is_min = groups == gamma_min[:, None]
    q_other = torch.clamp(groups / k_scale[:, None], max=1.0)
    q_scale = torch.where(is_min, sqrt_gamma.view(num_kv_heads, -1), q_other).reshape(H)
    return q_scale, k_scale


# ---------------------------------------------------------------------------- recording
def max_logits(q: Tensor, k: Tensor, scale: float, mask: Tensor | None = None, causal: bool = False,
               block: int = BLOCK) -> Tensor:
    """Each query head's largest pre-softmax logit over the attended position pairs, fp32 (H,).

    ``q`` (B, H, T_q, d) and ``k`` (B, KV, T_k, d) as the model computed them (after rotary
    embeddings; GQA: query head h reads key head h // (H/KV)).  The logit is
    ``(q @ k^T) * scale`` (HF's eager attention's order) in fp32.  ``mask``, broadcastable to
    (B, H, T_q, T_k): bool (True = attended, SDPA's convention) or additive float (attended
    where the value is above half its dtype's lowest, i.e. not HF's ``finfo.min`` / -inf; its
    finite values are not added: Llama-style masks carry 0 there).  ``causal`` without a mask:
    query i attends keys j <= i (SDPA's upper-left alignment).  Pairs never attended give
    -inf.  Rows are processed ``block`` at a time (the only score tensor alive is one block)."""
    B, H, Tq, d = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    if H % KV:
        raise ValueError(f"max_logits: {KV} key heads do not divide {H} query heads.")
    G = H // KV
    qf = q.detach().float()
    kf = k.detach().float()
    out = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    for i0 in range(0, Tq, block):
        i1 = min(Tq, i0 + block)
        # (B, KV, G, b, d) @ (B, KV, 1, d, T_k): each key head against its G query heads, no repeat
        scores = torch.matmul(qf[:, :, i0:i1].reshape(B, KV, G, i1 - i0, d), kf.transpose(-1, -2)[:, :, None])
        scores = (scores * scale).reshape(B, H, i1 - i0, Tk)
        if mask is not None:
            m = mask[..., i0:i1, :] if mask.shape[-2] != 1 else mask
            scores = scores.masked_fill(~m, float("-inf"))
        elif causal:
            rows = torch.arange(i0, i1, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(Tk, device=q.device)[None, :] > rows, float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out


@dataclass
class AttentionLayer:
    """One attention layer the clip acts on: its projections' parameter names and head counts,
    and the running maximum of the current step (written by :meth:`QKClip.observe`)."""

    q_name: str
    k_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    #: (num_heads,) fp32 running max over this step's forward passes (None: none recorded yet)
    running: Tensor | None = field(default=None, repr=False)
    #: tensor parallelism: projection name -> (first row of this rank's heads, rows of the whole
    #: matrix) in the TP layout (empty: the projections are whole here); set by the optimizer
    tp_rows: dict[str, tuple[int, int]] = field(default_factory=dict)

    def whole_rows(self, name: str, local: Tensor) -> Tensor:
        """``local`` (this rank's heads' per-row factors of ``name``) laid out as the whole
        matrix: at this rank's rows, ones elsewhere (the other TP ranks' heads, scaled by them)."""
        if name not in self.tp_rows:
            return local
        start, rows = self.tp_rows[name]
        whole = torch.ones(rows, dtype=local.dtype, device=local.device)
        whole[start:start + local.numel()] = local
        return whole

    def observe(self, q: Tensor, k: Tensor, scale: float, mask: Tensor | None = None, causal: bool = False) -> None:
        m = max_logits(q, k, scale, mask, causal)
        self.running = m if self.running is None else torch.maximum(self.running, m)


@dataclass
class QKStats:
    """What the last step's clip saw (the main job logs it)."""

    #: largest logit over every layer and head (-inf: nothing recorded)
    max_logit: float = float("-inf")
    #: query heads whose logit exceeded the threshold
    clipped_heads: int = 0
    #: per layer (q matrix name), its heads' maxima after the DP reduction
    per_layer: dict[str, list[float]] = field(default_factory=dict)


class QKClip:
    """The optimizer's QK-clip: layers, their running maxima, and the per-step factors.

    Each training forward of a recorded attention layer calls ``layer.observe`` (the project's
    model: canzona_ds/models/qwen3.py; HF models: canzona_ds/models/qk_record.py), which keeps
    the max over the step's micro-batches.  The optimizer's first matrix group of each step
    calls :meth:`row_scales`: one all-reduce(MAX) over ``group`` of every layer's maxima
    (concatenated), the rule, and the running maxima cleared for the next step."""

    def __init__(self, config: QKClipConfig, layers: list[AttentionLayer], group=None) -> None:
        self.config = config
        self.layers = layers
        self.group = group
        names = [n for l in layers for n in (l.q_name, l.k_name)]
        if len(set(names)) != len(names):
            raise ValueError(f"qk_clip: a projection appears in two attention layers ({names}).")
        #: name -> layer, for both projections
        self.by_name = {n: l for l in layers for n in (l.q_name, l.k_name)}
        self.stats = QKStats()
        self._cache: tuple[int, dict[str, Tensor]] | None = None

    def reset(self) -> None:
        """Forget this step's maxima (after a step, also a skipped one)."""
        for l in self.layers:
            l.running = None

    @property
    def collective_bytes(self) -> int:
        """Bytes of the one all-reduce per step (fp32, one value per query head)."""
        return 4 * sum(l.num_heads for l in self.layers)

    def row_scales(self, step: int, device: torch.device | None = None) -> dict[str, Tensor]:
        """Matrix name -> (rows,) fp32 factors of the matrices that clip at ``step`` (cached per
        step: a step's several matrix groups, e.g. MoE's, share one collective)."""
        if self._cache is not None and self._cache[0] == step:
            return self._cache[1]
        import torch.distributed as dist

        if not self.layers:
            self._cache = (step, {})
            return {}
        dev = device or next((l.running.device for l in self.layers if l.running is not None), torch.device("cpu"))
        flat = torch.cat([l.running.to(dev) if l.running is not None
                          else torch.full((l.num_heads,), float("-inf"), device=dev) for l in self.layers])
        if self.group is not None and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        self.reset()
        # the step's one device-to-host copy (on a GPU: its one sync): which layers recorded,
        # which clip, and the logged figures are read from it; the factors stay on the device
        host = flat.cpu().numpy()
        sizes = [l.num_heads for l in self.layers]
        bounds = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        host_maxima = np.split(host, bounds[:-1])  # (numpy on the host copy: no device sync below)
        silent = [l.q_name for l, vs in zip(self.layers, host_maxima) if np.isneginf(vs).all()]
        if silent:
            # (after the collective: every rank of the group sees the same maxima and raises alike)
            raise RuntimeError(f"qk_clip: attention layer of {silent[0]!r} recorded no logit in this step on any "
                               "data-parallel rank: its forward did not reach the recorder (a custom attention "
                               "forward, or the layer unused), so its heads cannot be clipped.")
        out: dict[str, Tensor] = {}
        per_layer, clipped = {}, 0
        tau = self.config.threshold
        for l, s, values in zip(self.layers, flat.split(sizes), host_maxima):
            per_layer[l.q_name] = [float(v) for v in values]
            n = np.count_nonzero(values > np.float32(tau))  # (fp32, as qk_clip_scales compares)
            if n == 0:  # nothing to scale: the weights are not touched
                continue
            clipped += int(n)
            q_scale, k_scale = qk_clip_scales(s, tau, l.num_kv_heads)
            out[l.q_name] = l.whole_rows(l.q_name, q_scale.repeat_interleave(l.head_dim))
            out[l.k_name] = l.whole_rows(l.k_name, k_scale.repeat_interleave(l.head_dim))
        self.stats = QKStats(max_logit=max((v for vs in per_layer.values() for v in vs), default=float("-inf")),
                             clipped_heads=clipped, per_layer=per_layer)
        self._cache = (step, out)
        return out


def apply_row_scale(param: Tensor, scale: Tensor) -> None:
    """``param`` (rows, ...) *= ``scale`` (rows,) in place, in ``param``'s dtype, on its device."""
    if param.shape[0] != scale.numel():
        raise RuntimeError(f"qk_clip: a factor vector of {scale.numel()} rows for a matrix of {param.shape[0]} rows.")
    param.mul_(scale.to(device=param.device, dtype=param.dtype).view(-1, *([1] * (param.ndim - 1))))


__all__ = ["AttentionLayer", "BLOCK", "QKClip", "QKClipConfig", "QKStats", "apply_row_scale", "max_logits",
           "qk_clip_scales"]

"""One optimizer step's metrics, measured where they happen: ``CanzonaOptimizer.metrics()``.

Plain torch (no DeepSpeed); what it records, per step, on this rank::

    optimizer.step()        one call per step, or several (ZeRO-3 steps one sub-group per call)
        every call          -> step_ms (summed over the step's calls)
        a matrix group      -> matrix_ms, the hosted runtime's collectives / bytes (step_stats),
                               QK-clip's max logit and clipped heads
    close(step, skipped)    the step boundary: the end of each step() call in plain torch; under
                            DeepSpeed the engine's _take_model_step (integration/metrics.py),
                            which also sees the steps it skips (fp16 overflow, non-finite grads)
        every step that is a multiple of ``interval``: ONE all_gather of this rank's step_ms over
        the DP group -> dp_max_step_ms / dp_mean_step_ms on that step's record (None on the
        others), so the busiest-vs-mean figure costs no collective on the other steps

Wall times are host clocks on CPU; on CUDA they are event pairs on the current stream, read
when the record is read (``last()``; the interval's reduction reads its own step), so
recording adds no device synchronisation.  Names, units and definitions: docs/optimizers.md,
"Step metrics".
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .config import MetricsConfig

__all__ = ["StepMetrics", "StepRecorder"]


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step on this rank (docs/optimizers.md, "Step metrics")."""

    #: the step these figures describe: DeepSpeed's ``engine.global_steps`` after it (skipped
    #: steps count), else the number of steps this optimizer has closed
    step: int
    #: wall time of this rank's optimizer step (every ``optimizer.step()`` call of the step), ms
    step_ms: float
    #: of which the matrix rule: the matrix groups, hosted runtime and QK-clip included, ms
    matrix_ms: float
    #: collectives the hosted runtime (TP-split matrices, the mixed layout, ZeRO-3) issued on this rank
    hosted_collectives: int
    #: bytes the hosted runtime put on the wire from this rank (self-sends excluded)
    hosted_bytes: int
    #: DeepSpeed skipped the step (fp16 overflow, non-finite gradients): no parameter changed
    skipped: bool
    #: the largest pre-softmax logit over this rank's attention layers and heads, max over DP (qk_clip on)
    qk_max_logit: float | None = None
    #: query heads whose logit exceeded qk_clip.threshold and were clipped this step (qk_clip on)
    qk_clipped_heads: int | None = None
    #: the busiest DP rank's step_ms, on every ``canzona_metrics.interval``-th step (else None), ms
    dp_max_step_ms: float | None = None
    #: the mean over the DP group's ranks of step_ms, on the same steps, ms
    dp_mean_step_ms: float | None = None

    def scalars(self) -> dict[str, float]:
        """The figures that have a value this step, as floats by name (``step`` excluded): what
        the monitors, the HF Trainer's logs and Megatron's writer receive."""
        return {k: float(v) for k, v in asdict(self).items() if k != "step" and v is not None}


class _Span:
    """One timed interval: host clock, or a CUDA event pair read later."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self.t0 = time.perf_counter()
        self.t1: float | None = None

    def stop(self) -> "_Span":
        if self.events is not None:
            self.events[1].record()
        else:
            self.t1 = time.perf_counter()
        return self

    def ms(self) -> float:
        if self.events is not None:
            self.events[1].synchronize()
            return float(self.events[0].elapsed_time(self.events[1]))
        return (self.t1 - self.t0) * 1e3


@dataclass
class _Open:
    """The step being recorded (spans unread)."""

    steps: list
    matrix: list
    collectives: int = 0
    nbytes: int = 0
    qk: tuple[float, int] | None = None


class StepRecorder:
    """Records each step's :class:`StepMetrics` for one optimizer.

    ``group`` is the DP group of the interval's all_gather (None: one process), ``device`` where
    its tensor lives (NCCL gathers device tensors).  ``engine_closes``: DeepSpeed's engine closes
    each step (integration/metrics.py); otherwise every ``step()`` call is a step."""

    def __init__(self, config: MetricsConfig, group=None, device: Callable[[], torch.device] | None = None) -> None:
        self.config = config
        self.group = group
        self.device = device or (lambda: torch.device("cpu"))
        self.engine_closes = False
        self._open = _Open([], [])
        self._closed = 0
        self._last: tuple | None = None
        self._resolved: StepMetrics | None = None

    def span(self) -> _Span:
        return _Span(self.device())

    def step_call(self, span: _Span) -> None:
        self._open.steps.append(span.stop())

    def matrix_call(self, spans: list, stats, qk) -> None:
        """A step() call's matrix groups: their stopped spans, the hosted runtime's ``StepStats``
        after them (None: no hosted matrices), QK-clip's ``QKStats`` of this step (None: off)."""
        self._open.matrix.extend(spans)
        if stats is not None:
            self._open.collectives += sum(stats.collectives.values())
            self._open.nbytes += int(stats.bytes_sent)
        if qk is not None:
            self._open.qk = (float(qk.max_logit), int(qk.clipped_heads))

    def close(self, step: int | None = None, skipped: bool = False) -> None:
        """End the step: its record becomes ``last()``; a step that is a multiple of ``interval``
        gathers step_ms over the DP group (every rank of the group closes the same steps)."""
        rec, self._open = self._open, _Open([], [])
        self._closed += 1
        step = self._closed if step is None else int(step)
        dp = None
        interval = self.config.interval
        if interval and step % interval == 0:  # (the engine's global step: every DP rank the same, resumes too)
            mine = sum(s.ms() for s in rec.steps)
            size = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
            if size > 1:
                t = torch.tensor([mine], dtype=torch.float64, device=self.device())
                every = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(every, t, group=self.group)
                times = [float(x[0]) for x in every]
            else:
                times = [mine]
            dp = (max(times), sum(times) / len(times))
        self._last = (step, rec, bool(skipped), dp)
        self._resolved = None

    def last(self) -> StepMetrics | None:
        """The last closed step's metrics (None before the first)."""
        if self._last is None:
            return None
        if self._resolved is None:
            step, rec, skipped, dp = self._last
            self._resolved = StepMetrics(
                step=step, step_ms=sum(s.ms() for s in rec.steps), matrix_ms=sum(s.ms() for s in rec.matrix),
                hosted_collectives=rec.collectives, hosted_bytes=rec.nbytes, skipped=skipped,
                qk_max_logit=None if rec.qk is None else rec.qk[0],
                qk_clipped_heads=None if rec.qk is None else rec.qk[1],
                dp_max_step_ms=None if dp is None else dp[0], dp_mean_step_ms=None if dp is None else dp[1])
        return self._resolved

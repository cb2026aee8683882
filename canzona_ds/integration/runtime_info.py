"""What the main job reads from a DeepSpeed engine: everything here touches engine internals,
so nothing outside ``integration/`` has to.

* :class:`TimerTap` - the step-time breakdown from DeepSpeed's own timers;
* :func:`canzona_optimizer` - the CanzonaOptimizer an engine runs (its plan, layout, rule);
* :func:`data_parallel_rank` - this rank's index in the data-parallel group;
* :func:`release_shm_buffer` - DeepSpeed's leaked CPU shared-memory buffer.

Step-time breakdown from DeepSpeed's own engine/ZeRO timers, captured instead of printed.

With ``wall_clock_breakdown`` DeepSpeed times each phase and *prints and resets* its timers
through ``SynchronizedWallClockTimer.log``.  ``TimerTap`` replaces ``log`` on the engine's
timer object (this instance only, nothing global) with one that adds the elapsed
milliseconds into a dict the trainer drains once per optimizer step.

What each column is (DeepSpeed 0.19.8 ZeRO stage 1):

    fwd_bwd_ms       "fwd" + "bwd_inner": forward and backward compute
    grad_reduce_ms   "bwd_allreduce": reducing gradients to their owner ranks at the
                     accumulation boundary, including waiting for the slowest rank.  The
                     built-in Muon runs its Newton-Schulz here too (in get_flat_partition),
                     so for "Muon" this column also holds optimizer math.
    optimizer_ms     "optimizer_gradients" + "optimizer_step": flattening/unscaling the
                     owned gradient partition and the partitioned optimizer step
    allgather_ms     "optimizer_allgather": the post-step parameter all-gather
"""
from __future__ import annotations

from collections import defaultdict

#: column -> DeepSpeed timer names summed into it
COLUMNS: dict[str, tuple[str, ...]] = {
    "fwd_bwd_ms": ("fwd", "bwd_inner"),
    "grad_reduce_ms": ("bwd_allreduce",),
    "optimizer_ms": ("optimizer_gradients", "optimizer_step"),
    "allgather_ms": ("optimizer_allgather",),
}


def work_timed_in(optimizer_type: str) -> str:
    """Which step-time column holds an optimizer type's update, in words (the summary table's
    footnote: without it DeepSpeed's Muon reads as ~300x faster than CanzonaMuon)."""
    t = str(optimizer_type).lower()
    if t == "muon":
        return ("Newton-Schulz runs inside gradient reduction (DeepSpeed's get_flat_partition): in 'reduce'; "
                "'opt' holds only its element-wise momentum/AdamW step")
    if t.startswith("canzona"):
        return "the matrix rule (Newton-Schulz / preconditioners) on each owned matrix and the AdamW half: in 'opt'"
    return "its element-wise step: in 'opt'"


class TimerTap:
    def __init__(self, engine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.attached = False
        seen = set()
        for owner in (engine, getattr(engine, "optimizer", None)):
            timers = getattr(owner, "timers", None)
            if timers is None or id(timers) in seen or not hasattr(timers, "timers"):
                continue  # NoopTimer (wall_clock_breakdown off) has no .timers dict
            seen.add(id(timers))
            timers.log = self._make_log(timers)
            self.attached = True

    def _make_log(self, timers):
        def log(names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None):
            for name in names:
                if name in timers.timers:
                    self.totals[name] += timers.timers[name].elapsed(reset=reset) / normalizer
        return log

    def drain(self) -> dict[str, float | None]:
        """Columns for the step just finished (None when DeepSpeed did not time them)."""
        out: dict[str, float | None] = {}
        for col, names in COLUMNS.items():
            present = [n for n in names if n in self.totals]
            out[col] = sum(self.totals[n] for n in present) if present else None
        self.totals.clear()
        return out


def canzona_optimizer(engine):
    """The :class:`~canzona_ds.optimizer.CanzonaOptimizer` ``engine`` steps, or None."""
    from ..optimizer import CanzonaOptimizer

    for obj in (getattr(engine, "basic_optimizer", None), getattr(engine, "optimizer", None),
                getattr(getattr(engine, "optimizer", None), "optimizer", None)):
        if isinstance(obj, CanzonaOptimizer):
            return obj
    return None


def realised_layout(engine):
    """The planned-padding Layout ZeRO realised for the matrix group (None without one)."""
    return getattr(getattr(engine, "optimizer", None), "canzona_layout", None)


def data_parallel_rank(engine) -> int:
    """This rank's index in the data-parallel group DeepSpeed set up (plain DP, an mpu, AutoTP,
    a PipelineEngine's grid): read by integration/groups.py, the one group reader."""
    from .groups import groups_from_engine

    return groups_from_engine(engine).dp_rank


def _shm_buffer_path() -> str | None:
    """This rank's buffer name, as shm.cpp builds it (from the same environment variables)."""
    import os

    addr, port, rank = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if not (addr and port and rank):
        return None
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer() -> bool:
    """Unlink this rank's DeepSpeed CPU shared-memory all-reduce buffer; True if one was removed.

    DeepSpeed 0.19.8's CPU comm op (``ops/csrc/cpu/comm/shm.cpp``, ``shm_initialize``)
    creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
    (~69 MB) per rank and never unlinks it, so every run leaves them behind in RAM-backed
    tmpfs.  Call once per process any time after all ranks have passed ``init_distributed``
    (e.g. after a barrier: by then every rank has mapped every buffer); unlinking removes only
    the name, the existing mappings stay valid.
    """
    import os

    path = _shm_buffer_path()
    if path is None:
        return False
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


#: (pid, path) of the buffers this process's DeepSpeed backends created
_CREATED: list[tuple[int, str]] = []


def _unlink_created() -> None:
    import os

    for pid, path in _CREATED:
        if pid == os.getpid():  # a forked child runs its parent's atexit hooks: not its buffer
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def release_shm_buffers_at_exit() -> None:
    """From now on, a DeepSpeed comm backend this process creates with the CPU shm op has its
    buffer unlinked when the process exits normally (``atexit``), whoever wrote the script:
    ``import canzona_ds`` calls this once DeepSpeed is imported.  By exit every peer has long
    mapped it (they all passed ``init_distributed`` together).  A process killed by a signal
    runs no atexit hook: the main job unlinks right after start-up (canzona_ds/cli/train.py)
    and the launcher sweeps what is left.  Idempotent."""
    import atexit
    import functools
    import importlib

    cls = importlib.import_module("deepspeed.comm.torch").TorchBackend  # the module, not the name torch
    if getattr(cls.__init__, "_canzona_shm_tracked", False):
        return
    stock = cls.__init__

    @functools.wraps(stock)
    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        path = _shm_buffer_path() if getattr(self, "shm_comm_op", None) is not None else None
        if path is not None:
            import os

            _CREATED.append((os.getpid(), path))

    __init__._canzona_shm_tracked = True
    cls.__init__ = __init__
    atexit.register(_unlink_created)

"""Where the suite's minutes go: per test, and inside the ranks a test starts, per phase.

Off unless ``CANZONA_PHASES=<folder>`` is set (``.ci/run`` sets it; ``benchmarks/suite_profile.py``
renders what it leaves).  Then:

* the pytest process appends one line per test to ``<folder>/tests.jsonl``: its wall time, the
  CPU seconds of the pytest process and of its waited-for children (a ``deepspeed`` launcher
  run's whole process tree lands there), and the wall time spent inside ``run_distributed``;
* every rank ``canzona_testkit.dist.run_distributed`` starts appends one line to
  ``<folder>/ranks.jsonl``: the test, the rank, its CPU seconds, and its wall time split into
  phases, each counted once (a phase nested in another is taken out of the outer one):

    start        from the parent's ``Process.start()`` to the rank's first line (fork from the
                 preloaded fork server, unpickling the test function: its module's imports)
    rendezvous   ``torch.distributed.init_process_group`` (gloo's TCP store and handshake)
    ops          DeepSpeed's op loading (``OpBuilder.load``: the JIT cache check and the .so)
    cpuinfo      py-cpuinfo's CPU detection, which DeepSpeed's op loads ask for
    engine       ``deepspeed.initialize`` less the two above (config, groups, plan, ZeRO build)
    checkpoint   ``engine.save_checkpoint`` / ``engine.load_checkpoint``
    body         the rest of the test function in the rank: forward, backward, steps, the
                 rank-side replays and comparisons
    teardown     ``destroy_process_group`` and handing the result back

The wrappers are installed only in rank processes and only when the variable is set, so a
normal run measures nothing and pays nothing.
"""
from __future__ import annotations

import json
import os
import resource
import time

ENV = "CANZONA_PHASES"
PHASES = ("start", "rendezvous", "ops", "cpuinfo", "engine", "checkpoint", "body", "teardown")


def folder() -> str | None:
    return os.environ.get(ENV) or None


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def append(name: str, record: dict) -> None:
    """One JSON line into ``<folder>/<name>`` (one ``write`` of a line: appends from several
    processes do not interleave)."""
    root = folder()
    if root is None:
        return
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, name), "a") as f:
        f.write(json.dumps(record) + "\n")


class Clock:
    """Exclusive wall time per phase: time inside a nested phase is not the outer phase's."""

    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._stack: list[list] = []  # [name, start, time spent in nested phases]

    def enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def leave(self) -> None:
        name, start, nested = self._stack.pop()
        spent = time.perf_counter() - start
        self.totals[name] += spent - nested
        if self._stack:
            self._stack[-1][2] += spent

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] += seconds

    def timed(self, name: str, fn):
        clock = self

        def wrapper(*args, **kwargs):
            clock.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.leave()

        wrapper._canzona_phase = name
        return wrapper


def _patch(owner, attr: str, clock: Clock, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is not None and getattr(fn, "_canzona_phase", None) is None:
        setattr(owner, attr, clock.timed(name, fn))


def instrument_rank(clock: Clock) -> None:
    """Time DeepSpeed's op loading, CPU detection, engine build and checkpoints in this rank."""
    import cpuinfo
    import deepspeed
    import torch.distributed as dist
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.runtime.engine import DeepSpeedEngine

    _patch(dist, "init_process_group", clock, "rendezvous")
    _patch(OpBuilder, "load", clock, "ops")
    _patch(cpuinfo, "get_cpu_info", clock, "cpuinfo")
    _patch(deepspeed, "initialize", clock, "engine")
    _patch(DeepSpeedEngine, "save_checkpoint", clock, "checkpoint")
    _patch(DeepSpeedEngine, "load_checkpoint", clock, "checkpoint")
    _patch(dist, "destroy_process_group", clock, "teardown")


#: wall seconds the running test has spent inside run_distributed (the pytest process)
in_ranks = [0.0]

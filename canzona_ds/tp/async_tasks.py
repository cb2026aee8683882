"""A small explicit async scheduler for the micro-group pipeline (after dion's AsyncTask).

A task is a generator.  Each ``yield`` marks the point right after it launched a
collective with ``async_op=True``; resuming it means "wait for that collective, then do
the next stage".  A micro-group task has three stages::

    stage 1  pack gradient shards, launch all_to_all #1 (gather to hosts)      -> yield
    stage 2  wait #1, hosts run Muon, pack update shards, launch all_to_all #2 -> yield
    stage 3  wait #2, apply the update shards to the local parameter shards

:func:`run_pipelined` starts task k (its gather is in flight), then resumes the younger
tasks first: task k-1 computes while gather k and scatter k-2 are on the wire, then task
k-2 applies.  Round k therefore looks like::

    issue gather(k) | wait gather(k-1), compute(k-1), issue scatter(k-1) | wait scatter(k-2), apply(k-2)

The order in which collectives are *issued* depends only on the task list, never on
timing, so every rank of the group issues the same sequence (required by all collective
backends).  :func:`run_blocking` runs each task to completion before starting the next.
"""
from __future__ import annotations

from typing import Generator, Iterable

Task = Generator[None, None, None]


class AsyncTask:
    """A generator driven one stage at a time; ``done`` once it returns."""

    def __init__(self, gen: Task) -> None:
        self._gen = gen
        self.done = False
        self.resume()

    def resume(self) -> None:
        if self.done:
            return
        try:
            next(self._gen)
        except StopIteration:
            self.done = True


def run_pipelined(tasks: Iterable[Task]) -> None:
    """Start each task, then advance the in-flight ones youngest first (see module doc)."""
    in_flight: list[AsyncTask] = []
    for gen in tasks:
        new = AsyncTask(gen)
        for task in reversed(in_flight):
            task.resume()
        in_flight = [t for t in in_flight if not t.done]
        if not new.done:
            in_flight.append(new)
    while in_flight:
        for task in reversed(in_flight):
            task.resume()
        in_flight = [t for t in in_flight if not t.done]


def run_blocking(tasks: Iterable[Task]) -> None:
    """Each task from start to finish before the next one starts."""
    for gen in tasks:
        task = AsyncTask(gen)
        while not task.done:
            task.resume()

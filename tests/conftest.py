"""Test-session hygiene.

DeepSpeed 0.19.8's CPU shared-memory all-reduce leaves a ~69 MB
``/dev/shm/deepspeed_allreduce_buffer_*`` file per rank per process group (it never unlinks
it).  The suite starts dozens of DeepSpeed process groups, so without cleanup it would fill
RAM-backed tmpfs.  After each test, remove this user's buffers that no live process maps.
(The main job unlinks its own: ``canzona_ds.integration.runtime_info.release_shm_buffer``.)
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


def _mapped_paths() -> set[str]:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours
            continue
        mapped.update(line.split(None, 5)[5] for line in text.splitlines()
                      if "deepspeed_allreduce_buffer" in line and len(line.split(None, 5)) == 6)
    return mapped


def leaked_deepspeed_shm_buffers() -> list[Path]:
    if not SHM.is_dir():
        return []
    import time

    # a buffer younger than a minute may belong to a job starting right now: DeepSpeed
    # writes it before every rank maps it, and deleting it then hangs that job's ranks
    now = time.time()
    mine = [p for p in sorted(SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))
            if now - p.stat().st_mtime > 60]
    if not mine:
        return []
    mapped = _mapped_paths()
    return [p for p in mine if str(p) not in mapped]


@pytest.fixture(autouse=True)
def _release_deepspeed_shm_buffers():
    yield
    for path in leaked_deepspeed_shm_buffers():
        path.unlink(missing_ok=True)

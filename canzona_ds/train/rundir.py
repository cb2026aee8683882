"""Where a run writes: its own folder per run unless the run config names one.

    log_dir unset (null):  <runs_dir>/<config stem>-<optimizer>-<YYYYmmdd-HHMMSS>/
                           e.g. runs/run_tiny-canzonamuon-20261124-013000/
                           (<optimizer> is the ds_config's type lower-cased, "compare" for --compare;
                           the config stem is "defaults" without --config)
    checkpoint_dir unset:  <log_dir>/checkpoints
    <runs_dir>/latest:     a symlink to the folder of the run started (or resumed) last

``--resume`` without a log_dir continues the newest run of the *same config stem and
optimizer* (newest by the timestamp in its name), not simply ``runs/latest``: after a Muon run
and a Shampoo run, resuming the Muon config finds the Muon run.  No such run: a new folder,
starting at step 0 (and the job says so).  An explicit ``log_dir`` always wins (resume then
reads ``<log_dir>/checkpoints`` unless ``checkpoint_dir`` is set too).

Rank 0 resolves the folder (:func:`resolve`), every rank gets it by broadcast, so all ranks
agree on the timestamp.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import replace
from pathlib import Path

from canzona_ds.train.config import RunConfig

LATEST = "latest"
_STAMP = r"\d{8}-\d{6}(?:-\d+)?"


def run_prefix(config_path: str | None, optimizer: str) -> str:
    stem = Path(config_path).stem if config_path else "defaults"
    return f"{stem}-{re.sub(r'[^A-Za-z0-9_.]+', '_', optimizer).lower()}"


def runs_of(runs_dir: str | Path, prefix: str) -> list[Path]:
    """Run folders ``<prefix>-<stamp>`` in ``runs_dir``, oldest first."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    pat = re.compile(re.escape(prefix) + r"-(" + _STAMP + r")")
    found = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and pat.fullmatch(p.name)]

    def key(p: Path):
        stamp = pat.fullmatch(p.name).group(1)  # YYYYmmdd-HHMMSS[-n]
        return stamp[:15], int(stamp[16:] or 1)

    return sorted(found, key=key)


def _new_run_dir(runs_dir: Path, prefix: str, now: float | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    runs_dir.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = runs_dir / (f"{prefix}-{stamp}" if n == 1 else f"{prefix}-{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run folder {prefix}-{stamp}* in {runs_dir}")


def point_latest(runs_dir: str | Path, run_dir: str | Path) -> Path:
    """``<runs_dir>/latest`` -> ``run_dir`` (relative link, replaced atomically)."""
    runs_dir = Path(runs_dir)
    link = runs_dir / LATEST
    tmp = runs_dir / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(Path(run_dir).resolve(), runs_dir.resolve()), tmp)
    os.replace(tmp, link)
    return link


def resolve(cfg: RunConfig, config_path: str | None, optimizer: str, resume: bool,
            now: float | None = None) -> tuple[RunConfig, str | None]:
    """The run config with ``log_dir`` and ``checkpoint_dir`` filled in (rank 0 only: creates
    the folder and points ``latest`` at it), and a note for the console (or None)."""
    note = None
    if cfg.log_dir is None:
        runs_dir = Path(cfg.runs_dir)
        prefix = run_prefix(config_path, optimizer)
        earlier = runs_of(runs_dir, prefix) if resume else []
        if earlier:
            log_dir = earlier[-1]
            note = f"resume: continuing the newest {prefix} run, {log_dir}"
        else:
            log_dir = _new_run_dir(runs_dir, prefix, now)
            if resume:
                note = f"resume: no earlier {prefix}-* run in {runs_dir}/; starting a new run in {log_dir}"
        point_latest(runs_dir, log_dir)
        cfg = replace(cfg, log_dir=str(log_dir))
    Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    if cfg.checkpoint_dir is None:
        cfg = replace(cfg, checkpoint_dir=str(Path(cfg.log_dir) / "checkpoints"))
    return cfg, note



def resolve_collective(cfg: RunConfig, config_path: str | None, optimizer: str, resume: bool) -> RunConfig:
    """:func:`resolve` on rank 0, broadcast to every rank (all ranks call it); rank 0 prints the note."""
    import torch.distributed as dist

    if cfg.log_dir is not None and cfg.checkpoint_dir is not None:
        return cfg
    box = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            resolved, note = resolve(cfg, config_path, optimizer, resume)
            if note:
                print(f"canzona_ds.cli.train: {note}", flush=True)
            box[0] = resolved
        except OSError as e:  # every rank raises it, none waits for a folder that is not coming
            box[0] = ValueError(f"cannot create the run folder in {cfg.runs_dir!r}: {e}")
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]

"""Where a run writes: its own folder per run unless the run config names one.

    log_dir unset (null):  <runs_dir>/<config stem>-<optimizer>-<YYYYmmdd-HHMMSS>/
                           e.g. runs/run_tiny-canzonamuon-20261124-013000/
                           (<optimizer> is the ds_config's type lower-cased, "compare" for --compare;
                           the config stem is "defaults" without --config)
    checkpoint_dir unset:  <log_dir>/checkpoints
    <runs_dir>/latest:     a symlink to the folder of the run started (or resumed) last

``--resume`` without a log_dir continues the newest run of the *same config stem and
optimizer* (newest by the timestamp in its name) **that this run can resume**, not simply
``runs/latest``: after a Muon run and a Shampoo run, resuming the Muon config finds the Muon
run.  A run is passed over, and the note says which and why, when it has no checkpoint or its
newest checkpoint's layout is one this run's load refuses (:func:`resume_refusal`):

    a Canzona type  any ZeRO stage, pp and rank count (the checkpoint index fills any layout)
    other types     the same ZeRO stage and pp; another rank count only at pp=1, ZeRO stage 0
                    (DeepSpeed's own load)

No such run: a new folder, starting at step 0 (and the job says so).  An explicit ``log_dir``
always wins (resume then reads ``<log_dir>/checkpoints`` unless ``checkpoint_dir`` is set
too); a *named* checkpoint folder (``log_dir`` or ``checkpoint_dir`` set) without a checkpoint
is a checkpoint error (:func:`check_named_checkpoint`), not a silent start at step 0.

:func:`check_writable` finds an unwritable runs_dir / log_dir / checkpoint_dir before any rank
starts (the launcher's pre-launch check, canzona_ds/cli/launch.py).

Rank 0 resolves the folder (:func:`resolve`), every rank gets it by broadcast, so all ranks
agree on the timestamp.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Layout:
    """What a checkpoint was written with, or what this run is: the keys resume compares."""
    zero_stage: int
    pp: int
    world_size: int | None  # None: not recorded (a checkpoint without a manifest)
    #: a Canzona optimizer type (its checkpoints resume at another stage, pp and rank count)
    canzona: bool = False

    def __str__(self) -> str:
        ranks = "? ranks" if self.world_size is None else f"{self.world_size} rank{'s' * (self.world_size != 1)}"
        return f"ZeRO {self.zero_stage}, pp={self.pp}, {ranks}"


def saved_pipeline_stages(ckpt_dir: str | Path) -> int:
    """Pipeline stages of a checkpoint: a PipelineEngine writes ``layer_XX-model_states.pt``
    and one ``mp_rank_XX_model_states.pt`` per stage; anything else counts as 1."""
    d = Path(ckpt_dir)
    if not any(d.glob("layer_*-model_states.pt")):
        return 1
    return max(1, len(list(d.glob("mp_rank_*_model_states.pt"))))


def saved_layout(ckpt_dir: str | Path) -> tuple[str, Layout] | None:
    """(tag, layout) of the checkpoint ``--resume`` would load first from ``ckpt_dir`` (the one
    ``latest`` names, else the newest published tag); None when there is none.  Reads the
    manifest and the model-states file's stored ds_config (memory-mapped, no tensor data; a file
    that holds anything but data raises the loader's UnsafeCheckpointError naming it)."""
    from canzona_ds.ckpt import tag as checkpoint
    from canzona_ds.ckpt.safe_load import UnsafeCheckpointError
    from canzona_ds.integration.ckpt.safe import read

    ckpt_dir = Path(ckpt_dir)
    tags = checkpoint.published_tags(str(ckpt_dir))
    tag = checkpoint.read_latest(str(ckpt_dir))  # (a tag directory of ckpt_dir, else refused by name)
    tag = tag if tag is not None else (tags[0] if tags else None)
    if not tag or not (ckpt_dir / tag).is_dir():
        return None
    path = ckpt_dir / tag
    world = None
    try:  # (a regular file, read bounded: ckpt/tag.read_json)
        manifest = checkpoint.read_json(str(path / checkpoint.MANIFEST))
        world = manifest.get("world_size") if isinstance(manifest, dict) else None
        world = world if type(world) is int else None
    except checkpoint.CheckpointError:
        pass
    stage = 0
    files = sorted(path.glob("mp_rank_*model_states.pt")) or sorted(path.glob("*model_states.pt"))
    try:
        ds = read(checkpoint.member(str(path), files[0].name, "the tag directory"), mmap=True)["ds_config"]
        stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
        canzona = str(ds["optimizer"]["type"]).startswith("Canzona")
    except UnsafeCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - unreadable: DeepSpeed's load (and the verification) will say why
        return tag, Layout(-1, saved_pipeline_stages(path), world)
    return tag, Layout(stage, saved_pipeline_stages(path), world, canzona)


def resume_refusal(saved: Layout, now: Layout) -> str | None:
    """Why a run laid out as ``now`` cannot resume a checkpoint laid out as ``saved`` (None: it can)."""
    if saved.zero_stage < 0:
        return "its model states are unreadable"
    if saved.canzona and now.canzona:
        return None  # any stage, pp and rank count: the checkpoint index (docs/checkpoints.md)
    if saved.zero_stage != now.zero_stage:
        return f"written at ZeRO stage {saved.zero_stage}, this run is stage {now.zero_stage}"
    if saved.pp != now.pp:
        return f"written with pp={saved.pp}, this run has pp={now.pp}"
    if saved.world_size not in (None, now.world_size):
        if now.pp > 1:
            return f"written on {saved.world_size} ranks, this run has {now.world_size} (pp > 1 resumes at the same size)"
        if not now.canzona and now.zero_stage > 0:
            return (f"written on {saved.world_size} ranks, this run has {now.world_size} (only the Canzona types, "
                    "or ZeRO stage 0, resume at another rank count)")
    return None


def choose_resume_run(runs_dir: Path, prefix: str, layout: Layout | None) -> tuple[Path | None, list[str]]:
    """The newest ``prefix`` run in ``runs_dir`` whose newest checkpoint this run can resume
    (``layout`` None: any run with a checkpoint), and the newer runs passed over, each with why."""
    skipped = []
    for run in reversed(runs_of(runs_dir, prefix)):
        found = saved_layout(run / "checkpoints")
        if found is None:
            skipped.append(f"{run.name} (no checkpoint)")
            continue
        tag, saved = found
        why = resume_refusal(saved, layout) if layout is not None else None
        if why is None:
            return run, skipped
        skipped.append(f"{run.name} ({tag}: {why})")
    return None, skipped


def resolve(cfg: RunConfig, config_path: str | None, optimizer: str, resume: bool,
            now: float | None = None, layout: Layout | None = None) -> tuple[RunConfig, str | None]:
    """The run config with ``log_dir`` and ``checkpoint_dir`` filled in (rank 0 only: creates
    the folder and points ``latest`` at it), and a note for the console (or None).  ``layout``:
    this run's, to pass over runs it cannot resume (None: any run with a checkpoint)."""
    note = None
    if cfg.log_dir is None:
        runs_dir = Path(cfg.runs_dir)
        prefix = run_prefix(config_path, optimizer)
        chosen, skipped = choose_resume_run(runs_dir, prefix, layout) if resume else (None, [])
        passed = f"; passed over: {', '.join(skipped)}" if skipped else ""
        if chosen is not None:
            log_dir = chosen
            why = f" ({layout})" if layout is not None else ""
            note = f"resume: continuing the newest {prefix} run this run can resume{why}, {log_dir}{passed}"
        else:
            log_dir = _new_run_dir(runs_dir, prefix, now)
            if resume:
                note = (f"resume: no earlier {prefix}-* run in {runs_dir}/ with a checkpoint this run can resume"
                        f"{passed}; starting a new run in {log_dir}")
        point_latest(runs_dir, log_dir)
        cfg = replace(cfg, log_dir=str(log_dir))
    Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    if cfg.checkpoint_dir is None:
        cfg = replace(cfg, checkpoint_dir=str(Path(cfg.log_dir) / "checkpoints"))
    return cfg, note



def check_named_checkpoint(cfg: RunConfig) -> None:
    """``--resume`` from a folder the run config names (``checkpoint_dir``, or ``log_dir`` and its
    ``checkpoints/``) that holds no checkpoint: a CheckpointError (a mistyped path must not
    start a fresh run at step 0).  No-op without resume or without a named folder."""
    from canzona_ds.ckpt import tag as checkpoint

    if not cfg.resume or (cfg.log_dir is None and cfg.checkpoint_dir is None):
        return
    ckpt = cfg.checkpoint_dir if cfg.checkpoint_dir is not None else str(Path(cfg.log_dir) / "checkpoints")
    key = "checkpoint_dir" if cfg.checkpoint_dir is not None else "log_dir"
    if checkpoint.published_tags(ckpt) or os.path.isfile(os.path.join(ckpt, checkpoint.LATEST)):
        return
    what = "does not exist" if not os.path.exists(ckpt) else "holds no checkpoint"
    raise checkpoint.CheckpointError(
        f"--resume: {ckpt!r} (from {key}) {what}. Check the path, or drop --resume (or {key}) to start a new run.",
        ckpt)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def planned_checkpoint_dir(cfg: RunConfig, resumed_run: Path | None = None) -> str | None:
    """The folder :func:`resolve` will give the run's checkpoints, decided without creating
    anything: ``checkpoint_dir``; else ``<log_dir>/checkpoints``; else, where ``--resume``
    continues an earlier run (``resumed_run``: :func:`choose_resume_run`'s choice), that run's
    ``checkpoints/``.  None: a new run folder under ``runs_dir`` (whose own check covers it)."""
    if cfg.checkpoint_dir is not None:
        return cfg.checkpoint_dir
    log_dir = cfg.log_dir if cfg.log_dir is not None else resumed_run
    return None if log_dir is None else str(Path(log_dir) / "checkpoints")


def check_writable(cfg: RunConfig, resumed_run: Path | None = None) -> list[tuple[str, str]]:
    """(run-config key, problem) for each folder the run will write that it cannot: the folder,
    or the nearest existing folder above it, must be a writable directory.  Checked without
    creating anything.  The checkpoint folder is the one the run will use
    (:func:`planned_checkpoint_dir`: named, derived from ``log_dir``, or the resumed run's), so
    that no run finds it at its first save."""
    wanted = [("log_dir", cfg.log_dir) if cfg.log_dir is not None else ("runs_dir", cfg.runs_dir)]
    ckpt = planned_checkpoint_dir(cfg, resumed_run)
    if cfg.checkpoint_every and ckpt is not None:
        wanted.append(("checkpoint_dir", ckpt))
    problems = []
    for key, value in wanted:
        base = _nearest_existing(Path(value))
        if not base.is_dir():
            kind = " (a file)" if base.is_file() else ""
            made = ":" if base == Path(value).absolute() else " cannot be created:"
            problems.append((key, f"{key}={value!r}{made} {str(base)!r} is not a directory{kind}"))
        elif not os.access(base, os.W_OK | os.X_OK):
            where = "" if base == Path(value).absolute() else f" (its nearest existing folder {str(base)!r})"
            problems.append((key, f"{key}={value!r}{where} is not writable"))
    return problems


def resolve_collective(cfg: RunConfig, config_path: str | None, optimizer: str, resume: bool,
                       layout: Layout | None = None) -> RunConfig:
    """:func:`resolve` on rank 0, broadcast to every rank (all ranks call it); rank 0 prints the note."""
    import torch.distributed as dist

    if cfg.log_dir is not None and cfg.checkpoint_dir is not None:
        return cfg
    box = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            resolved, note = resolve(cfg, config_path, optimizer, resume, layout=layout)
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

"""Training entry of the main job.

    # 2 CPU ranks through DeepSpeed's launcher (what launch/train.sh runs)
    deepspeed --num_gpus 2 --module canzona_ds.cli.train --config configs/run_tiny.yaml
    # pipeline parallelism: 2 stages x 2 DP ranks (launch/train.sh: NUM_RANKS=4 launch/train.sh --set pp=2)
    deepspeed --num_gpus 4 --module canzona_ds.cli.train --config configs/run_tiny.yaml --set pp=2
    # one process, no launcher
    python -m canzona_ds.cli.train --config configs/run_tiny.yaml --set steps=20
    # resume from the latest intact checkpoint; compare Canzona* / Muon / AdamW + exact reference
    ... --resume          ... --compare

``--set key=value`` overrides one run-config key (value parsed as YAML); ``--ds-config``
overrides the run config's ds_config.  Exit status: 0 done (also a ``--resume`` with nothing
left to train: it says so and leaves the run's files as they are), 2 bad config (run config or
ds_config: one line naming the bad key or value), 3 optimizer type unavailable, 4 checkpoint
error (``--resume`` found checkpoints but none intact or loadable by this run, e.g. written by
another optimizer type, or a save failed: one line naming each bad file; ``--resume`` from a
named log_dir / checkpoint_dir holding no checkpoint; an unwritable checkpoint_dir), 130 / 143
stopped by SIGINT / SIGTERM.  Errors are one line from rank 0; the other ranks exit quietly
with the same status, and DeepSpeed's launcher exits with it.  ``launch/train.sh``
(canzona_ds/cli/launch.py) runs :func:`precheck` first, in one process: every error that
needs no process group is reported there, before any rank starts.

Where a run writes: ``log_dir`` unset -> a new folder per run,
``runs/<config stem>-<optimizer>-<YYYYmmdd-HHMMSS>``, with ``runs/latest`` pointing at it;
checkpoints in ``<log_dir>/checkpoints`` unless ``checkpoint_dir`` is set.  ``--resume``
without a log_dir continues the newest run of the same config stem and optimizer that this
run can resume (same ZeRO stage and pp; the note names the runs passed over and why), not
simply runs/latest.  See canzona_ds/train/rundir.py.

DeepSpeed's CPU all-reduce leaves a ~69 MB ``/dev/shm`` buffer per rank that it never
unlinks.  Every rank unlinks its own as soon as all ranks have mapped every buffer (right
after ``init_distributed`` and a barrier): the mappings stay valid, and the name is gone
whatever happens to the process later (SIGKILL included).  SIGTERM / SIGINT handlers and
the ``finally`` cover a stop during start-up; ``launch/train.sh`` removes what a rank killed
before that point left.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; every option's help states its default itself."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="canzona_ds.cli.train", description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("--config", default=None,
                    help="YAML run config (default: none, the built-in defaults = configs/run_tiny.yaml's values; "
                         "launch/train.sh passes RUN_CONFIG, default configs/run_tiny.yaml)")
    ap.add_argument("--ds-config", default=None,
                    help="DeepSpeed JSON config, overrides the run config's ds_config "
                         "(default: the run config's, configs/ds_cpu_canzona.json unless it says otherwise)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the latest intact checkpoint: of log_dir / checkpoint_dir when set (an "
                         "error if it holds none), else of the newest run of this config and optimizer that this "
                         "run can resume (same ZeRO stage and pp; see canzona_ds/train/rundir.py) (default: off)")
    ap.add_argument("--compare", action="store_true",
                    help="run the run config's compare_ds_configs one after another + a single-process Muon "
                         "reference (default: off)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a run-config key, value parsed as YAML (repeatable; default: none)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar, logs only (default: a bar on rank 0)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _ensure_dist_env() -> None:
    """Single process without a launcher: a world of one on loopback."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _is_launch_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(code: int, message: str) -> int:
    """One line from rank 0 (every rank reaches the same verdict; the others exit quietly
    with the same status, which DeepSpeed's launcher passes on)."""
    if _is_launch_rank0():
        print(f"canzona_ds.cli.train: {message}", file=sys.stderr, flush=True)
    return code


def check_config(args: argparse.Namespace, world: int, deep: bool = False):
    """The run config of ``args`` for ``world`` ranks, every check that needs no process group
    made (ValueError / TypeError naming the bad key or value): run config, ds_config files,
    batch layout, pp, optimizer type ("did you mean"), the Canzona optimizer params, --compare's
    reference.  ``deep``: also DeepSpeed's own parse of each ds_config (the launcher's
    pre-launch check; the ranks meet it inside ``deepspeed.initialize`` anyway)."""
    from canzona_ds.train.config import load_run_config, parse_override
    from canzona_ds.train.trainer import build_ds_config, check_optimizer_section, data_parallel_size

    overrides = dict(parse_override(item) for item in args.overrides)
    if args.ds_config:
        overrides["ds_config"] = args.ds_config
    if args.resume:
        overrides["resume"] = True
    cfg = load_run_config(args.config, overrides, overrides_from="the --set override(s)")
    if args.compare and cfg.pp > 1:
        raise ValueError(f"--compare runs pp=1 only (got pp={cfg.pp}); drop --set pp or --compare.")
    for path in (cfg.compare_ds_configs if args.compare else [cfg.ds_config]):
        ds = build_ds_config(cfg, path, data_parallel_size(path, world, cfg.pp))
        check_optimizer_section(ds, path)
        if deep:
            from canzona_ds.integration.config_check import validate_ds_config

            validate_ds_config(ds, str(path))
        from canzona_ds.train.compare import REFERENCE_TYPES

        if args.compare and cfg.reference_steps and str(ds["optimizer"]["type"]).lower() in REFERENCE_TYPES:
            from canzona_ds.train.reference import reference_config

            reference_config(ds["optimizer"])
    return cfg


def precheck(argv: list[str], world: int) -> int:
    """Everything the job checks before a process group exists, in this one process (the
    launcher's pre-launch check, canzona_ds/cli/launch.py): 0 go, 2 config error, 4 checkpoint
    error (an unwritable checkpoint_dir; --resume from a named folder without a checkpoint),
    each one line; argparse's own usage errors are 2 as well.  ``--help`` prints the help and
    returns :data:`HELP_SHOWN` (nothing to launch)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed by argparse)
        return HELP_SHOWN if e.code in (0, None) else int(e.code)
    try:
        cfg = check_config(args, world, deep=True)
        from canzona_ds.train.rundir import check_writable

        problems = check_writable(cfg, _resumed_run(cfg, args, world))
    except (ValueError, TypeError) as e:
        return _fail(2, f"config error: {_one_line(e)}")
    for key, problem in problems:
        return _fail(4 if key == "checkpoint_dir" else 2,
                     f"{'checkpoint' if key == 'checkpoint_dir' else 'config'} error: {problem}")
    if not args.compare:
        from canzona_ds.ckpt.tag import CheckpointError
        from canzona_ds.train.rundir import check_named_checkpoint

        try:
            check_named_checkpoint(cfg)
        except CheckpointError as e:
            return _fail(4, f"checkpoint error: {_one_line(e)}")
    return 0


def _resumed_run(cfg, args, world: int):
    """The earlier run folder ``--resume`` (without a log_dir) will continue, as the ranks'
    :func:`_run_dirs` will choose it (canzona_ds/train/rundir.py), or None: a new run."""
    if not cfg.resume or args.compare or cfg.log_dir is not None or cfg.checkpoint_dir is not None:
        return None
    from pathlib import Path

    from canzona_ds.optim import OPTIMIZER_TYPES
    from canzona_ds.train.rundir import Layout, choose_resume_run, run_prefix
    from canzona_ds.train.trainer import load_ds_config, zero_stage

    ds = load_ds_config(cfg.ds_config)
    optimizer = str(ds["optimizer"]["type"])
    layout = Layout(zero_stage(ds), cfg.pp, world, optimizer in OPTIMIZER_TYPES)
    return choose_resume_run(Path(cfg.runs_dir), run_prefix(args.config, optimizer), layout)[0]


#: :func:`precheck`'s status after printing ``--help`` (the launcher exits 0 without starting ranks)
HELP_SHOWN = 10


def main(argv: list[str] | None = None) -> int:
    previous = _install_signal_handlers()  # first: a stop during the imports below is an exit, not a traceback
    try:
        return _main(argv)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    try:
        _ensure_dist_env()
        cfg = check_config(args, int(os.environ["WORLD_SIZE"]))  # fail before any process group exists
    except (ValueError, TypeError) as e:
        return _fail(2, f"config error: {_one_line(e)}")

    import canzona_ds  # noqa: F401 - registers the Canzona optimizer types with DeepSpeed (when available)
    from canzona_ds.ckpt.tag import CheckpointError
    from canzona_ds.integration.runtime_info import release_shm_buffer
    from canzona_ds.train.trainer import (ConfigError, OptimizerUnavailable, is_rank0, setup_process,
                                          shutdown_distributed, train)

    setup_process(cfg)
    try:
        import deepspeed
        import torch.distributed as dist

        deepspeed.init_distributed(dist_backend="gloo" if not _has_gpu() else None, verbose=False)
        # every rank has mapped every rank's shm buffer once all are past init_distributed:
        # unlink ours now, so no exit path (SIGKILL included) can leave it in /dev/shm
        dist.barrier()
        release_shm_buffer()
        cfg = _run_dirs(cfg, args)
        if args.compare:
            from canzona_ds.train.compare import run_compare

            report = run_compare(cfg, progress=not args.no_progress)
            if is_rank0():
                print("artifacts:", flush=True)
                for k, v in report["artifacts"].items():
                    print(f"  {k:14s} {v}", flush=True)
        else:
            from canzona_ds.train.rundir import check_named_checkpoint

            check_named_checkpoint(cfg)  # every rank reads the same folder: the same verdict
            result = train(cfg, progress=not args.no_progress)
            if is_rank0():
                _final_report(cfg, result)
        shutdown_distributed()
    except OptimizerUnavailable as e:  # raised on every rank before the engine exists
        shutdown_distributed()
        return _fail(3, _one_line(e))
    except CheckpointError as e:  # the same verdict on every rank (canzona_ds.checkpoint)
        shutdown_distributed()
        return _fail(4, f"checkpoint error: {_one_line(e)}")
    except ConfigError as e:  # DeepSpeed rejected the ds_config: the same on every rank
        shutdown_distributed()
        return _fail(2, f"config error: {_one_line(e)}")
    finally:
        release_shm_buffer()  # no-op when already unlinked; covers a failure before the barrier
    return 0


def _one_line(e: BaseException) -> str:
    """An error message on one line (pydantic's span several; its doc links are dropped)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return "; ".join(lines) or type(e).__name__


def _run_dirs(cfg, args):
    """log_dir / checkpoint_dir of this run (canzona_ds/train/rundir.py), the same on every rank."""
    import torch.distributed as dist

    from canzona_ds.optim import OPTIMIZER_TYPES
    from canzona_ds.train.rundir import Layout, resolve_collective
    from canzona_ds.train.trainer import load_ds_config, zero_stage

    ds = load_ds_config(cfg.ds_config)
    optimizer = "compare" if args.compare else str(ds["optimizer"]["type"])
    layout = Layout(zero_stage(ds), cfg.pp, dist.get_world_size(), optimizer in OPTIMIZER_TYPES)
    return resolve_collective(cfg, args.config, optimizer, resume=cfg.resume and not args.compare, layout=layout)


def _install_signal_handlers() -> dict:
    """SIGTERM / SIGINT: unlink this rank's shm buffer, then exit 128 + signal number through
    ``SystemExit`` (so ``finally`` blocks run).  A rank blocked inside a C++ collective runs
    the handler once the collective returns or fails (a dead peer fails gloo's).  Returns the
    previous handlers (restored when ``main`` returns); nothing outside the main thread."""
    import threading

    from canzona_ds.integration.runtime_info import release_shm_buffer

    if threading.current_thread() is not threading.main_thread():
        return {}

    stopping = []

    def handler(signum, frame):
        if stopping:  # launch.py forwards the same signal the group already got: exit once
            return
        stopping.append(signum)
        release_shm_buffer()
        print(f"canzona_ds.cli.train: rank {os.environ.get('RANK', '0')} received "
              f"{signal.Signals(signum).name}; exiting", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _qk_threshold(cfg) -> float | None:
    """The run's qk_clip threshold (the ds_config's optimizer.params.qk_clip; None: off)."""
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.train.trainer import load_ds_config

    section = load_ds_config(cfg.ds_config)["optimizer"]
    qk = CanzonaConfig.from_ds(str(section["type"]), section.get("params")).qk_clip
    return None if qk is None else float(qk.threshold)


def _final_report(cfg, result) -> None:
    from pathlib import Path

    from canzona_ds.train.metrics import (MATPLOTLIB_MISSING, have_matplotlib, plot_loss, plot_qk_logits,
                                          plot_rank_load, read_metrics, summary_table)

    if not result.trained:  # a resume with nothing left to train: it said so; nothing to report
        return
    log_dir = Path(result.log_dir)
    print(summary_table({result.name: result.summary}), flush=True)
    artifacts = {"metrics_jsonl": result.metrics_path, "metrics_csv": str(log_dir / "metrics.csv"),
                 "summary": str(log_dir / "summary.json"), "plan_summary": str(log_dir / "plan_summary.json")}
    if have_matplotlib():
        artifacts["loss_png"] = str(plot_loss({result.name: read_metrics(result.metrics_path)}, log_dir / "loss.png",
                                              f"{cfg.model} on {cfg.corpus}"))
        artifacts["rank_load_png"] = str(plot_rank_load(result.plan_summary, log_dir / "rank_load.png"))
        rows = read_metrics(result.metrics_path)
        if any(r.get("qk_max_logit") is not None for r in rows):  # optimizer.params.qk_clip on
            artifacts["qk_logits_png"] = str(plot_qk_logits({result.name: rows}, log_dir / "qk_logits.png",
                                                            threshold=_qk_threshold(cfg)))
    else:
        print(MATPLOTLIB_MISSING, flush=True)
    if result.checkpoint_dir:
        artifacts["checkpoints"] = result.checkpoint_dir
    print("artifacts:", flush=True)
    for k, v in artifacts.items():
        print(f"  {k:14s} {v}", flush=True)


if __name__ == "__main__":
    status = main()
    # the run is over (files closed, process group destroyed, shm buffer unlinked): skip the
    # interpreter's teardown of torch, dynamo and deepspeed, which every rank pays and
    # DeepSpeed's launch.py waits for (about a second on 2 cores)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

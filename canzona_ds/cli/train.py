"""Training entry of the main job.

    # 2 CPU ranks through DeepSpeed's launcher (what launch/train.sh runs)
    deepspeed --num_gpus 2 --module canzona_ds.cli.train --config configs/run_tiny.yaml
    # one process, no launcher
    python -m canzona_ds.cli.train --config configs/run_tiny.yaml --set steps=20
    # resume from the latest intact checkpoint; compare Canzona* / Muon / AdamW + exact reference
    ... --resume          ... --compare

``--set key=value`` overrides one run-config key (value parsed as YAML); ``--ds-config``
overrides the run config's ds_config.  Exit status: 0 done, 2 bad config (one line naming
the bad key or value), 3 optimizer type unavailable, 4 checkpoint error (``--resume`` found
checkpoints but none intact, or a save failed: one line naming each bad file), 130 / 143
stopped by SIGINT / SIGTERM.

DeepSpeed's CPU all-reduce leaves a ~69 MB ``/dev/shm`` buffer per rank that it never
unlinks.  Every rank unlinks its own as soon as all ranks have mapped every buffer (right
after ``init_distributed`` and a barrier): the mappings stay valid, and the name is gone
whatever happens to the process later (SIGKILL included).  SIGTERM / SIGINT handlers and
the ``finally`` cover a stop during start-up; ``launch/train.sh`` removes what a rank killed
before that point left.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="canzona_ds.cli.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML run config (default: built-in defaults = run_tiny)")
    ap.add_argument("--ds-config", default=None, help="DeepSpeed JSON config (overrides the run config's)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--compare", action="store_true",
                    help="run compare_ds_configs one after another + a single-process Muon reference")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a run-config key (repeatable)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar (logs only)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from canzona_ds.train.config import load_run_config, parse_override

    try:
        overrides = dict(parse_override(item) for item in args.overrides)
        if args.ds_config:
            overrides["ds_config"] = args.ds_config
        if args.resume:
            overrides["resume"] = True
        cfg = load_run_config(args.config, overrides)
        _ensure_dist_env()
        world = int(os.environ["WORLD_SIZE"])
        from canzona_ds.train.trainer import build_ds_config, data_parallel_size

        # fail before any process group exists
        for path in (cfg.compare_ds_configs if args.compare else [cfg.ds_config]):
            ds = build_ds_config(cfg, path, data_parallel_size(path, world))
            from canzona_ds.train.compare import REFERENCE_TYPES

            if args.compare and cfg.reference_steps and str(ds["optimizer"]["type"]).lower() in REFERENCE_TYPES:
                from canzona_ds.train.reference import reference_config

                reference_config(ds["optimizer"])
    except (ValueError, TypeError) as e:
        print(f"canzona_ds.cli.train: config error: {e}", file=sys.stderr, flush=True)
        return 2

    import canzona_ds  # noqa: F401 - registers the Canzona optimizer types with DeepSpeed (when available)
    from canzona_ds.checkpoint import CheckpointError
    from canzona_ds.integration.runtime_info import release_shm_buffer
    from canzona_ds.train.trainer import OptimizerUnavailable, is_rank0, setup_process, shutdown_distributed, train

    previous = _install_signal_handlers()
    setup_process(cfg)
    try:
        import deepspeed
        import torch.distributed as dist

        deepspeed.init_distributed(dist_backend="gloo" if not _has_gpu() else None, verbose=False)
        # every rank has mapped every rank's shm buffer once all are past init_distributed:
        # unlink ours now, so no exit path (SIGKILL included) can leave it in /dev/shm
        dist.barrier()
        release_shm_buffer()
        if args.compare:
            from canzona_ds.train.compare import run_compare

            report = run_compare(cfg, progress=not args.no_progress)
            if is_rank0():
                print("artifacts:", json.dumps(report["artifacts"], indent=1), flush=True)
        else:
            result = train(cfg, progress=not args.no_progress)
            if is_rank0():
                _final_report(cfg, result)
        shutdown_distributed()
    except OptimizerUnavailable as e:  # raised on every rank before the engine exists
        print(f"canzona_ds.cli.train: {e}", file=sys.stderr, flush=True)
        shutdown_distributed()
        return 3
    except CheckpointError as e:  # the same verdict on every rank (canzona_ds.checkpoint)
        if is_rank0():
            print(f"canzona_ds.cli.train: checkpoint error: {e}", file=sys.stderr, flush=True)
        shutdown_distributed()
        return 4
    finally:
        release_shm_buffer()  # no-op when already unlinked; covers a failure before the barrier
        for sig, h in previous.items():
            signal.signal(sig, h)
    return 0


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


def _final_report(cfg, result) -> None:
    from pathlib import Path

    from canzona_ds.train.metrics import (MATPLOTLIB_MISSING, have_matplotlib, plot_loss, plot_rank_load,
                                          read_metrics, summary_table)

    log_dir = Path(result.log_dir)
    print(summary_table({result.name: result.summary}), flush=True)
    artifacts = {"metrics_jsonl": result.metrics_path, "metrics_csv": str(log_dir / "metrics.csv"),
                 "summary": str(log_dir / "summary.json"), "plan_summary": str(log_dir / "plan_summary.json")}
    if have_matplotlib():
        artifacts["loss_png"] = str(plot_loss({result.name: read_metrics(result.metrics_path)}, log_dir / "loss.png",
                                              f"{cfg.model} on {cfg.corpus}"))
        artifacts["rank_load_png"] = str(plot_rank_load(result.plan_summary, log_dir / "rank_load.png"))
    else:
        print(MATPLOTLIB_MISSING, flush=True)
    if result.checkpoint_dir:
        artifacts["checkpoints"] = result.checkpoint_dir
    print("artifacts:", flush=True)
    for k, v in artifacts.items():
        print(f"  {k:14s} {v}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""The main job's launcher (what ``launch/train.sh`` runs): check, then start the ranks, stop them cleanly.

    launch/train.sh [train args]  =  python3 -m canzona_ds.cli.launch [train args]

    environment         default                     meaning
    NUM_RANKS           2                           ranks (CPU processes, or GPUs)
    RUN_CONFIG          configs/run_tiny.yaml       the run config (--config)
    DS_CONFIG           (the run config's)          the ds_config (--ds-config)
    MASTER_PORT         29500 + a random 0..999     the rendezvous port
    STOP_GRACE_S        45                          seconds a stopped job gets before SIGKILL

In order, in this one process:

1. **Pre-launch check** (``canzona_ds.cli.train.precheck``, a few seconds, no rank started):
   ``--help`` printed once (exit 0); the run config, each ds_config (DeepSpeed's own parse
   included), the batch layout, the optimizer type (with "did you mean"), the Canzona
   params: one line and exit 2; an unwritable checkpoint folder, or ``--resume`` naming a
   folder without a checkpoint: one line and exit 4.
2. **Launch**: DeepSpeed's per-node launcher (``deepspeed.launcher.launch`` with the
   arguments DeepSpeed's ``deepspeed`` runner would give it: canzona_ds/integration/launcher.py)
   in a forked child of this process, in a session of its own, ranks running
   ``canzona_ds.cli.train``.  Forked, not a new interpreter: this process imported deepspeed
   for step 1, so the launcher starts without paying ``import deepspeed`` again.
   ``TORCH_EXTENSIONS_DIR`` is this environment's op cache (``canzona_ds.op_cache_dir``, set
   by ``import canzona_ds``), the folder ``launch/install.sh`` built DeepSpeed's CPU op in.
3. **Stop**: SIGINT / SIGTERM to this process, however it was started (a Ctrl-C, ``kill``, or
   a ``launch/train.sh &`` from a non-interactive shell, where the shell starts it with SIGINT
   ignored: Python can still catch it, bash cannot) go to the ranks; they exit 130 / 143
   (canzona_ds/cli/train.py), DeepSpeed's ``launch.py`` follows with that status, no
   traceback; after STOP_GRACE_S the job's processes are SIGKILLed.
4. **Sweep**: once every process of the job has ended, the DeepSpeed ``/dev/shm`` all-reduce
   buffers of this user and MASTER_PORT left by a rank killed during start-up are removed.

Exit status: the job's (0; 2 bad config; 3 optimizer unavailable; 4 checkpoint error; a rank's
failure status), or 130 / 143 when stopped by SIGINT / SIGTERM.
"""
from __future__ import annotations

import glob
import logging
import os
import random
import signal
import sys
import time

#: DeepSpeed's one start-up warning on a machine without a GPU (the ranks print it again)
_CPU_NOTICE = "Setting accelerator to CPU"


def _quiet_cpu_notice() -> None:
    """Drop DeepSpeed's "Setting accelerator to CPU" warning in this process: a pre-launch
    verdict is one line."""
    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return _CPU_NOTICE not in record.getMessage()

    logging.getLogger("DeepSpeed").addFilter(_Drop())


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, depth) of every live process below ``pid`` (children depth 1), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.split("/")[2]))
    out, todo = [], [(pid, 0)]
    while todo:
        parent, depth = todo.pop()
        for child in children.get(parent, []):
            out.append((child, depth + 1))
            todo.append((child, depth + 1))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep_shm(port: str) -> list[str]:
    """Remove this user's DeepSpeed all-reduce buffers of ``port`` (call when the job is over)."""
    removed = []
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stop: list[int] = []  # the signal that stops the job (first one wins)
    signalled: set[int] = set()
    started: list[int] = []  # the pid of DeepSpeed's launch.py (a forked child), once started

    def forward() -> None:
        """The stop signal to the ranks (and anything below them) not signalled yet: the
        processes below DeepSpeed's launch.py, this process's child.  A rank started after the
        stop gets it too.  launch.py then sees a rank end with 130 / 143, stops the others and
        exits with that status (launch.py itself is not signalled: its handler would SIGTERM
        the ranks while they handle the SIGINT)."""
        if not started or not stop:
            return
        for pid, depth in _descendants(started[0]):
            if pid not in signalled:
                signalled.add(pid)
                try:
                    os.kill(pid, stop[0])
                except ProcessLookupError:
                    pass

    def on_signal(signum, frame):
        if stop:
            return  # one forwarding is enough; a repeated Ctrl-C must not abort the cleanup
        stop.append(signum)
        forward()

    # installed before anything else: a handler, unlike SIG_IGN inherited from a non-interactive
    # shell's `&`, is reset to the default in the children, so the ranks get their signals
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    ranks = int(os.environ.get("NUM_RANKS", "2"))
    port = os.environ.get("MASTER_PORT") or str(29500 + random.randrange(1000))
    grace = float(os.environ.get("STOP_GRACE_S", "45"))
    train_args = ["--config", os.environ.get("RUN_CONFIG", "configs/run_tiny.yaml")]
    if os.environ.get("DS_CONFIG"):
        train_args += ["--ds-config", os.environ["DS_CONFIG"]]
    train_args += argv

    try:
        return _check_and_run(train_args, ranks, port, grace, stop, forward, lambda p: started.append(p))
    finally:
        if started:
            # launch.py is gone; wait for the rest of its session (the ranks)
            t0 = time.monotonic()
            while _group_alive(started[0]):
                if time.monotonic() - t0 > grace:
                    os.killpg(started[0], signal.SIGKILL)
                time.sleep(0.2)
        sweep_shm(port)  # every exit path: also buffers an earlier job on this port left


def _check_and_run(train_args: list[str], ranks: int, port: str, grace: float, stop: list[int], forward,
                   on_start) -> int:
    _quiet_cpu_notice()
    import canzona_ds  # noqa: F401 - sets TORCH_EXTENSIONS_DIR (inherited by the ranks)
    from canzona_ds.cli.train import HELP_SHOWN, precheck

    rc = precheck(train_args, ranks)
    if stop:
        return 128 + stop[0]
    if rc == HELP_SHOWN:
        print(__doc__.split("\n\n")[0].strip() + " -- environment: NUM_RANKS, RUN_CONFIG, DS_CONFIG, MASTER_PORT, "
              "STOP_GRACE_S (python -m canzona_ds.cli.launch's docstring)", flush=True)
        return 0
    if rc:
        return rc

    from canzona_ds.integration.launcher import fork_local_launch

    pid = fork_local_launch(ranks, port, "canzona_ds.cli.train", train_args)
    on_start(pid)
    deadline = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
        forward()  # no-op until stopped
        if stop and deadline is None:
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
    if stop:
        return 128 + stop[0]
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    status = main()
    # the job is over and its buffers swept: nothing here needs the interpreter's teardown of
    # torch and deepspeed (imported by the pre-launch check; about a second on 2 cores)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

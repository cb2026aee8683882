"""The command that starts the main job's ranks on this machine: DeepSpeed's per-node launcher.

``deepspeed --num_gpus N --master_port P --module M ARGS`` (the runner, deepspeed/launcher/
runner.py) on a single node only builds this command and waits for it; calling it directly saves
the runner's own Python start and ``import deepspeed`` (a few seconds of every launch)::

    python -u -m deepspeed.launcher.launch --world_info=<base64 {"localhost": [0..N-1]}>
        --master_addr=127.0.0.1 --master_port=P --module M ARGS

exactly the runner's local command for ``--num_gpus N`` (DeepSpeed 0.19.8,
``runner.main``: ``world_info_base64``, then ``deepspeed_launch``; ``--log_level`` left at its
default).  launch.py sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* per rank, starts the ranks,
stops the rest when one fails (with that status), and forwards SIGINT / SIGTERM.

:func:`fork_local_launch` runs that command's ``launch.main()`` in a forked child instead of a
new interpreter: the main job's launcher has imported deepspeed (and torch) for its pre-launch
check already, so the child skips the interpreter start, ``import deepspeed`` (~2 s) and the
interpreter's teardown; the ranks are started by launch.py exactly as before.  One change in
that child only: launch.py polls its ranks with ``time.sleep(1)`` and sleeps once more after the
last one ended (1-2 s at the end of every job); its module global ``time`` is given a ``sleep``
capped at :data:`POLL_S`.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import sys
import time

LAUNCH_MODULE = "deepspeed.launcher.launch"
#: how often the forked launch.py looks at its ranks (its own loop sleeps 1 s)
POLL_S = 0.05


class _PollingTime:
    """``time`` for launch.py's module global: every function as is, ``sleep`` capped at POLL_S."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(min(seconds, POLL_S))


def local_launch_args(num_ranks: int, master_port: int | str, module: str, args: list[str]) -> list[str]:
    """The arguments of DeepSpeed's launch.py for ``num_ranks`` local ranks running ``python -m module args``."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"Invalid num_ranks={num_ranks!r}. Must be an int >= 1.")
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_ranks))}).encode()).decode()
    return [f"--world_info={world_info}", "--master_addr=127.0.0.1", f"--master_port={master_port}", "--module",
            module, *args]


def local_launch_command(num_ranks: int, master_port: int | str, module: str, args: list[str]) -> list[str]:
    """DeepSpeed's per-node launch command for ``num_ranks`` local ranks running ``python -m module args``."""
    return [sys.executable, "-u", "-m", LAUNCH_MODULE, *local_launch_args(num_ranks, master_port, module, args)]


def fork_local_launch(num_ranks: int, master_port: int | str, module: str, args: list[str]) -> int:
    """:func:`local_launch_command` run as a forked child of this process, in a session of its
    own; returns the child's pid (reap it with ``os.waitpid``; its exit status is launch.py's).

    The child drops RANK / WORLD_SIZE / LOCAL_RANK from its environment (launch.py sets them
    per rank), restores the default SIGINT / SIGTERM handling until launch.py installs its own,
    and leaves with ``os._exit``: nothing of the parent (its ``finally`` blocks, atexit hooks)
    runs in it.  Call it from the main thread.  The child runs only launch.py (argument parsing,
    environment variables, ``subprocess``, ``psutil``), no torch call, so a thread that
    ``import torch`` started in the parent (not copied by fork) holds nothing it needs."""
    launch_args = local_launch_args(num_ranks, master_port, module, args)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(key, None)
        sys.argv = [LAUNCH_MODULE, *launch_args]
        from deepspeed.launcher import launch

        launch.time = _PollingTime()  # ds_compat.py: deepspeed.launcher.launch.time
        launch.main()
        code = 0
    except SystemExit as e:  # launch.py exits with a failed rank's status, or 1 after a signal
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported here, the status goes to the parent
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: the status still goes back
                pass
        os._exit(code)

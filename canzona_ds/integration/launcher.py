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
"""
from __future__ import annotations

import base64
import json
import sys


def local_launch_command(num_ranks: int, master_port: int | str, module: str, args: list[str]) -> list[str]:
    """DeepSpeed's per-node launch command for ``num_ranks`` local ranks running ``python -m module args``."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"Invalid num_ranks={num_ranks!r}. Must be an int >= 1.")
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_ranks))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
            "--master_addr=127.0.0.1", f"--master_port={master_port}", "--module", module, *args]

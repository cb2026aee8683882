"""One helper for real multi-process runs: spawn ``world_size`` processes with a process group.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in each
process with ``torch.distributed`` initialised and returns the per-rank return values
(must be picklable).  ``device="cpu"`` uses gloo; ``device="cuda"`` uses NCCL with one GPU
per rank (``rank``-th device), for the CUDA tier when enough GPUs are present.  A failure
on any rank raises here with that rank's traceback; a rank that does not answer within
``timeout`` seconds is reported (and every process is stopped), so a hang fails its test
instead of the whole suite.  A rank that asserted bit for bit (``canzona_testkit.kernels``)
says so with its result, and the parent enrolls the running test in .ci/kernels' rerun.
"""
from __future__ import annotations

from canzona_testkit import kernels
from canzona_testkit.kernels import test_threads
import os
import queue as queue_mod
import socket
import time
import traceback

import torch.multiprocessing as mp

DEVICES = ("cpu", "cuda")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, device, fn, args, queue, profile=None):
    import torch
    import torch.distributed as dist

    clock = None
    if profile is not None:  # CANZONA_PHASES: (test id, the parent's time at Process.start)
        from canzona_testkit import phases

        clock = phases.Clock()
        clock.add("start", time.time() - profile[1])
        phases.instrument_rank(clock)
        cpu0 = phases.cpu_seconds()
        clock.enter("body")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size))
    torch.set_num_threads(test_threads())
    # Eager only, as the main job runs (RunConfig.disable_torch_compile): DeepSpeed's own "Muon"
    # (the tests' baseline) compiles its update with inductor, and on AVX-512 Xeons with
    # avx512_bf16/fp16 that compiled CPU kernel corrupts the heap ("corrupted size vs. prev_size",
    # "malloc(): unaligned tcache chunk detected"; fine with ATEN_CPU_CAPABILITY=avx2 or
    # TORCH_COMPILE_DISABLE=1).  Nothing under test here depends on torch.compile.
    import torch._dynamo

    torch._dynamo.config.disable = True
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size)
        kernels.record_exact_assertions()
        out = fn(rank, world_size, *args)
        if clock is not None:
            clock.leave()
            clock.enter("teardown")
        queue.put((rank, "ok", (out, kernels.asserted[0])))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if clock is not None:
            while clock._stack:
                clock.leave()
            phases.append("ranks.jsonl", {"test": profile[0], "rank": rank, "world": world_size,
                                          "cpu": round(phases.cpu_seconds() - cpu0, 3),
                                          **{k: round(v, 3) for k, v in clock.totals.items()}})


#: modules the fork server imports once, so that every rank starts with them loaded instead
#: of spending ~20 s of CPU importing torch._dynamo and DeepSpeed; the server imports nothing
#: that starts threads or devices.  DeepSpeed's Muon module is imported by every engine build
#: (``is_zero_supported_optimizer`` imports it lazily, for every optimizer type) and calls
#: ``torch.compile`` at import, which imports torch._inductor: measured 1.4 -> 0.25 s of CPU per
#: rank of a 2-rank ZeRO-1 test once the server has it (docs/ci.md)
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
           "canzona_ds.integration.registry", "canzona_testkit.models"]
_CTX = None


def _context(device: str):
    """A fork server with PRELOAD imported (CPU), or plain spawn (CUDA: no fork after CUDA)."""
    global _CTX
    if device == "cuda":
        return mp.get_context("spawn")
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, device: str = "cpu"):
    if device not in DEVICES:
        raise ValueError(f"Invalid device={device!r}. Allowed: {list(DEVICES)}.")
    import torch

    if torch.get_num_threads() != test_threads():
        raise RuntimeError(f"run_distributed: this process runs {torch.get_num_threads()} intra-op threads, its ranks "
                           f"would run test_threads()={test_threads()}: a reference computed here would not run the "
                           "ranks' kernels (a test marked 'solo' must not start ranks; canzona_testkit/kernels.py)")
    ctx = _context(device)
    queue = ctx.Queue()
    port = free_port()
    from canzona_testkit import phases

    started = time.perf_counter()
    profile = (kernels.current[0], time.time()) if phases.folder() else None
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, device, fn, args, queue, profile))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                errors.append(f"ranks {missing} did not finish within {timeout:.0f} s (hang or deadlock)")
                break
            if status == "ok":
                results[rank] = kernels.rank_report(*payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
    phases.in_ranks[0] += time.perf_counter() - started
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA runtime: no GPU tier
        return 0


def device_params(world_size: int) -> list:
    """pytest params for a multi-rank test body run on every device: ``cpu`` (gloo) always;
    ``cuda`` (NCCL, one GPU per rank) when there are ``world_size`` GPUs, else skipped with the
    reason (the suite never depends on a GPU)."""
    import pytest

    gpus = cuda_count()
    return [pytest.param("cpu", id="cpu"),
            pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
                gpus < world_size, reason=f"needs {world_size} CUDA GPUs for NCCL; this machine has {gpus}")])]


def rank_device(device: str, rank: int):
    """The torch device rank ``rank`` computes on."""
    import torch

    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")


def scratch_dir(prefix: str) -> str:
    """A fresh temporary directory removed when the process exits (checkpoints shared between
    the save and the load runs of a test module)."""
    import atexit
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root

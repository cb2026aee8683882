"""Fault injection against real main-job checkpoints: what ``--resume`` does with each fault.

1. A real 2-rank run of the main job through ``launch/train.sh`` (tiny preset, seq_len 64,
   ``steps`` optimizer steps, a checkpoint every ``every`` steps): the reference trajectory
   and its checkpoints.
2. For each fault: a copy of the checkpoint folder as a run interrupted after step
   ``steps - every`` leaves it (``latest`` = that step, the last checkpoint absent), the fault
   injected into real files (bytes overwritten in the middle, truncation, deletion, an
   unpublished ``.partial`` save, ...), then ``launch/train.sh --resume`` to ``steps``.
3. Recorded per fault: exit status, what the job printed about the checkpoint, the step it
   resumed from, whether the resumed losses equal the uninterrupted run's bit for bit,
   whether the intact checkpoint it fell back to is byte-for-byte untouched, whether the
   final checkpoint verifies, and whether any /dev/shm buffer of the run's port is left.

    python benchmarks/fault_injection.py                 # ~10 min on 2 shared CPU cores
    python benchmarks/fault_injection.py --only overwrite_model_states,all_damaged

Writes ``benchmarks/results/faults.json`` and ``faults.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canzona_ds.ckpt import tag as ck  # noqa: E402

MODEL = "mp_rank_00_model_states.pt"
OPT = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
JOB = ["--set", "seq_len=64", "--set", "micro_batch=4", "--set", "eval_batches=2", "--set", "warmup_steps=2",
       "--no-progress", "--ds-config", "configs/ds_cpu_canzona.json"]


# ------------------------------------------------------------------------ the faults
def overwrite(path: Path, n: int = 64) -> str:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        old = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in old))
    return f"{n} bytes at offset {size // 2} of {size} complemented"


def truncate(path: Path, keep: float = 0.5) -> str:
    size = path.stat().st_size
    os.truncate(path, int(size * keep))
    return f"truncated {size} -> {int(size * keep)} bytes"


def faults(last: str, prev: str, nxt: str) -> dict:
    """name -> (what, fn(ckpt_dir) -> detail).  ``last``: the newest checkpoint (latest)."""
    def rm(p: Path) -> str:
        (shutil.rmtree if p.is_dir() else Path.unlink)(p)
        return f"removed {p.name}"

    def partial(d: Path) -> str:
        # a save of the next checkpoint killed before it was published: every rank's files
        # (here the reference run's, so they are complete) but no manifest and no rename
        shutil.copytree(d.parent / "_reference_ckpt" / nxt, d / f"{nxt}{ck.PARTIAL}")
        (d / f"{nxt}{ck.PARTIAL}" / ck.MANIFEST).unlink()
        return f"{nxt}.partial written, not published"

    def torn_latest(d: Path) -> str:
        (d / "latest").write_text(last[:2])  # a non-atomic writer cut short
        return f"latest = {last[:2]!r}"

    def all_damaged(d: Path) -> str:
        return overwrite(d / last / MODEL) + "; " + truncate(d / prev / OPT.format(0))

    return {
        "overwrite_model_states": (f"64 bytes overwritten mid {last}/{MODEL}", lambda d: overwrite(d / last / MODEL)),
        "overwrite_optim_rank0": (f"64 bytes overwritten mid {last}/{OPT.format(0)}",
                                  lambda d: overwrite(d / last / OPT.format(0))),
        "overwrite_optim_rank1": (f"64 bytes overwritten mid {last}/{OPT.format(1)}",
                                  lambda d: overwrite(d / last / OPT.format(1))),
        "truncate_model_states": (f"{last}/{MODEL} truncated to half", lambda d: truncate(d / last / MODEL)),
        "truncate_optim_rank1": (f"{last}/{OPT.format(1)} truncated to half",
                                 lambda d: truncate(d / last / OPT.format(1))),
        "empty_optim_rank0": (f"{last}/{OPT.format(0)} truncated to 0 bytes (disk full)",
                              lambda d: truncate(d / last / OPT.format(0), 0.0)),
        "missing_optim_rank0": (f"{last}/{OPT.format(0)} deleted", lambda d: rm(d / last / OPT.format(0))),
        "missing_tag_dir": (f"{last}/ deleted (latest still names it)", lambda d: rm(d / last)),
        "missing_manifest": (f"{last}/{ck.MANIFEST} deleted", lambda d: rm(d / last / ck.MANIFEST)),
        "torn_latest": ("latest holds a cut-off tag name", torn_latest),
        "missing_latest": ("latest deleted", lambda d: rm(d / "latest")),
        "unpublished_partial": (f"crash while saving {nxt}: {nxt}.partial left", partial),
        "all_damaged": (f"{last} overwritten and {prev} truncated", all_damaged),
    }


# ------------------------------------------------------------------------ running the job
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_sh(args: list[str], timeout: int = 420, tries: int = 2) -> tuple[int, str, int, float]:
    """``launch/train.sh`` with a fresh port; (exit status, output, port, seconds).

    A run that does not finish within ``timeout`` is stopped with SIGTERM (train.sh forwards
    it to the launcher's group) and tried again: on a machine shared with test sessions, a
    session's /dev/shm sweep (tests/conftest.py) can unlink a starting rank's buffer before
    its peer maps it, and DeepSpeed's shm_initialize then waits for it forever."""
    for attempt in range(tries):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(MASTER_PORT=str(port), PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
        t0 = time.time()
        proc = subprocess.Popen(["bash", "launch/train.sh", *JOB, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out, port, time.time() - t0
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
            print(f"run timed out after {timeout} s (attempt {attempt + 1}); stopped with SIGTERM", flush=True)
    return 124, out, port, time.time() - t0


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def digests(d: Path) -> dict:
    return {p.name: ck.sha256_file(p)[1] for p in sorted(d.iterdir()) if p.is_file()} if d.is_dir() else {}


def same_value(a, b) -> bool:
    """Equal content: tensors element for element (and dtype/shape), containers recursively,
    objects by their attributes."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, type):
        return same_value(vars(a), vars(b))
    return a == b


def same_checkpoint(d1: Path, d2: Path) -> bool | str:
    """True when every DeepSpeed file of two checkpoints holds the same state (``torch.load``
    of both, compared with :func:`same_value`); a string naming the first difference."""
    import torch

    n1 = sorted(p.name for p in d1.iterdir() if p.name != ck.MANIFEST)
    if n1 != sorted(p.name for p in d2.iterdir() if p.name != ck.MANIFEST):
        return "different file lists"
    for n in n1:
        if not same_value(torch.load(d1 / n, weights_only=False), torch.load(d2 / n, weights_only=False)):
            return f"{n} differs"
    return True


def shm_left(port: int) -> list[str]:
    return sorted(str(p) for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated fault names (default: all)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temp dir, removed)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--render", action="store_true", help="only rewrite faults.md from faults.json")
    args = ap.parse_args(argv)
    if args.render:
        render(Path(args.out))
        print((Path(args.out) / "faults.md").read_text())
        return 0
    steps, every = args.steps, args.every
    last, prev, nxt = f"step{steps - every}", f"step{steps - 2 * every}", f"step{steps}"
    table = faults(last, prev, nxt)
    names = [n for n in args.only.split(",") if n] or list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; known: {list(table)}")

    work = Path(args.work or tempfile.mkdtemp(prefix="canzona_faults_"))
    work.mkdir(parents=True, exist_ok=True)
    ref = work / "reference"
    t_start = time.time()
    rc, log, port, secs = train_sh(["--set", f"steps={steps}", "--set", f"checkpoint_every={every}",
                                    "--set", f"eval_every={every}", "--set", f"log_dir={ref}",
                                    "--set", f"checkpoint_dir={ref}/ckpt"])
    if rc != 0:
        print(log[-4000:], file=sys.stderr)
        return 1
    print(f"reference run: {steps} steps in {secs:.0f} s", flush=True)
    ref_loss = {r["step"]: r["loss"] for r in rows(ref / "metrics.jsonl")}

    records = []
    for name in names:
        what, inject = table[name]
        case = work / name
        ck_dir = case / "ckpt"
        # what a run interrupted after step `last` leaves: checkpoints up to `last`, latest = last
        shutil.copytree(ref / "ckpt", ck_dir, ignore=shutil.ignore_patterns(nxt))
        shutil.copytree(ref / "ckpt" / nxt, case / "_reference_ckpt" / nxt)  # for the .partial fault
        ck.write_atomic(str(ck_dir / "latest"), last)
        # metrics of the interrupted run (cut back by the resumed one to the checkpoint's step)
        case.joinpath("metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows(ref / "metrics.jsonl") if r["step"] <= steps - every))
        detail = inject(ck_dir)
        shutil.rmtree(case / "_reference_ckpt")
        before = {t: digests(ck_dir / t) for t in (prev, last)}
        rc, log, port, secs = train_sh(["--set", f"steps={steps}", "--set", f"checkpoint_every={every}",
                                        "--set", f"eval_every={every}", "--set", f"log_dir={case}",
                                        "--set", f"checkpoint_dir={ck_dir}", "--resume"])
        said = [ln.strip() for ln in log.splitlines()
                if re.search(r"is corrupt or incomplete|resumed from|checkpoint error|resume: no checkpoint|"
                             r"no 'latest' file", ln)]
        m = re.search(r"resumed from (\S+?)[ :]", log)
        resumed = m.group(1) if m else None
        got = {r["step"]: r["loss"] for r in rows(case / "metrics.jsonl")}
        start = int(resumed[4:]) if resumed else None
        identical = (rc == 0 and start is not None and sorted(got) == list(range(1, steps + 1))
                     and all(got[s] == ref_loss[s] for s in range(start + 1, steps + 1)))
        # the checkpoint it resumed from is byte-for-byte what it was before the run
        source_untouched = resumed is not None and digests(ck_dir / resumed) == before.get(resumed)
        final_ok = None
        if rc == 0:
            try:
                ck.verify(ck_dir, nxt)
                final_ok = same_checkpoint(ck_dir / nxt, ref / "ckpt" / nxt)
            except ck.CheckpointError as e:
                final_ok = f"final checkpoint does not verify: {e}"
        untouched_on_refusal = None
        if rc != 0:  # refused: nothing written over what was there
            untouched_on_refusal = all(digests(ck_dir / t) == before[t] for t in (prev, last))
        rec = {"fault": name, "injected": what, "detail": detail, "exit": rc, "said": said, "resumed_from": resumed,
               "losses_identical": identical, "source_untouched": source_untouched,
               "final_checkpoint_same_state_as_uninterrupted": final_ok,
               "untouched_on_refusal": untouched_on_refusal, "shm_left": shm_left(port), "seconds": round(secs, 1)}
        records.append(rec)
        print(json.dumps({k: rec[k] for k in ("fault", "exit", "resumed_from", "losses_identical")}), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/fault_injection.py" + (f" --only {args.only}" if args.only else ""),
            "steps": steps, "every": every, "world_size": 2, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "total_seconds": round(time.time() - t_start, 1)}
    (out / "faults.json").write_text(json.dumps({"meta": meta, "faults": records}, indent=1))
    (out / "faults.md").write_text(markdown(meta, records, last, nxt))
    print((out / "faults.md").read_text())
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def fault_table(records: list) -> str:
    """The table alone (header, separator, one row per fault) from ``faults.json["faults"]``
    (benchmarks/tables.py's ``faults`` table)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tables

    return tables.render_table(tables.TABLES["faults"], {"faults": records})


def markdown(meta: dict, records: list, last: str, nxt: str) -> str:
    intro = [f"Faults injected into real checkpoints of a 2-rank main-job run ({meta['steps']} steps, a checkpoint "
             f"every {meta['every']}; a copy of its checkpoints as a run interrupted after {last} leaves them, the "
             f"fault injected, then `launch/train.sh --resume` to step {meta['steps']}). Command: "
             f"`{meta['command']}` ({meta['total_seconds']:.0f} s, {meta['machine']}). Bad inputs tried: "
             f"{len(records)}. *Nothing lost*: the resumed losses equal the uninterrupted run's bit for bit, the "
             f"checkpoint resumed from is byte-for-byte untouched, and the final checkpoint {nxt} verifies and holds "
             "the same state (every tensor equal) as the uninterrupted run's; for a refusal, no checkpoint file "
             "changed. */dev/shm*: DeepSpeed buffers of the run's port left afterwards.", ""]
    return "\n".join(intro) + "\n" + fault_table(records) + "\n"


def render(out: Path) -> None:
    """Rewrite faults.md from faults.json (no runs)."""
    data = json.loads((out / "faults.json").read_text())
    steps, every = data["meta"]["steps"], data["meta"]["every"]
    (out / "faults.md").write_text(markdown(data["meta"], data["faults"], f"step{steps - every}", f"step{steps}"))


if __name__ == "__main__":
    sys.exit(main())

"""The main job's fixed start-up cost: a 2-step ``launch/train.sh`` run, code trees side by side.

    git worktree add /tmp/wt-base e19c463                                          # the "before" tree
    python benchmarks/bench_startup.py --tree before=/tmp/wt-base --tree after=. --trace   # -> results/startup.json

Each repeat runs ``launch/train.sh --set steps=2`` (configs/run_tiny.yaml: tiny preset, 2 CPU
ranks, CanzonaMuon, one evaluation and a checkpoint at step 2, the loss plots) once per tree,
in the order given, ``--repeats`` times (interleaved: a slow patch of the shared machine hits
every tree alike), with ``PYTHONPATH`` pointing at that tree so its ``canzona_ds`` is the one
imported.  Wall time is from starting ``bash launch/train.sh`` to its exit.  The phases come
from when the job's own output lines arrive (no instrumentation, so both trees are measured
the same way):

    phase               ends at the first line ...
    check + launch      "spawned with command" of the last rank: the launcher's interpreter, its
                        pre-launch check (torch, deepspeed, the configs) and DeepSpeed's launch.py
    rank start-up       "deepspeed_shm_comm_op built successfully" of the last rank: interpreter,
                        torch, deepspeed, the rank's config check, torch._dynamo, gloo init and
                        the CPU op load
    engine + plan       "[<name>] model=": model, deepspeed.initialize, the partition plan
    2 steps + eval      "[<name>] step 2:": two optimizer steps and the held-out evaluation
    checkpoint + report "artifacts:": the step-2 checkpoint, summary and the loss plots
    exit                the launcher's exit: the ranks' process-group shutdown and exit,
                        DeepSpeed's launch.py noticing, the /dev/shm sweep, the launcher's end

``--trace`` adds one run of the last tree with :data:`TRACER` on its PYTHONPATH (a
sitecustomize that times the imports of torch, deepspeed, torch._dynamo, DeepSpeed's Muon module
and matplotlib, and the job's main calls) and records the launcher's and rank 0's spans.

Times are of a shared 2-core machine: compare trees only within one file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "startup.json"

#: (phase, substring of the line that ends it, which occurrence: "first" or "last")
PHASES = (
    ("check + launch", "spawned with command", "last"),
    ("rank start-up", "built successfully", "last"),
    ("engine + plan", "] model=", "first"),
    ("2 steps + eval", "] step 2:", "first"),
    ("checkpoint + report", "artifacts:", "first"),
)

#: ``--trace``: a sitecustomize put first on the job's PYTHONPATH; every process of the job logs
#: when these modules are imported and these functions run (begin / end, wall clock)
TRACER = r"""
import functools, importlib.abc, importlib.util, os, sys, time
_DIR = os.environ.get("BENCH_STARTUP_TRACE")
IMPORTS = ("torch", "deepspeed", "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer", "matplotlib.pyplot")
CALLS = {"canzona_ds.cli.train": ("check_config",), "canzona_ds.integration.launcher": ("fork_local_launch",),
         "deepspeed": ("init_distributed", "initialize"), "canzona_ds.checkpoint": ("save",),
         "canzona_ds.train.trainer": ("setup_process", "build_model", "train", "evaluate", "shutdown_distributed")}

def _log(kind, name):
    with open(os.path.join(_DIR, f"{os.getpid()}.log"), "a") as f:
        f.write(f"{time.time():.4f}\t{os.environ.get('RANK', 'launcher')}\t{kind}\t{name}\n")

def _wrap(module, name):
    fn = getattr(module, name)
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _log("begin", name + "()")
        try:
            return fn(*args, **kwargs)
        finally:
            _log("end", name + "()")
    setattr(module, name, traced)

class _Finder(importlib.abc.MetaPathFinder):
    inside = False
    def find_spec(self, fullname, path, target=None):
        if self.inside or (fullname not in IMPORTS and fullname not in CALLS):
            return None
        self.inside = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.inside = False
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        def exec_module(module):
            _log("begin", "import " + fullname)
            run(module)
            _log("end", "import " + fullname)
            for name in CALLS.get(fullname, ()):
                _wrap(module, name)
        spec.loader.exec_module = exec_module
        return spec

if _DIR:
    _log("begin", "process")
    sys.meta_path.insert(0, _Finder())
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(tree: Path, steps: int, log_dir: Path, trace: Path | None = None) -> dict:
    """One ``launch/train.sh --set steps=<steps>`` of ``tree``: wall time and phase durations (s);
    with ``trace`` (a folder holding TRACER as sitecustomize.py) also the traced spans."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_PORT=str(_port()), PYTHONPATH=str(tree), PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    if trace is not None:
        env.update(PYTHONPATH=f"{trace}{os.pathsep}{tree}", BENCH_STARTUP_TRACE=str(trace))
    t_start = time.time()
    cmd = ["bash", str(tree / "launch" / "train.sh"), "--set", f"steps={steps}", "--set", f"log_dir={log_dir}",
           "--no-progress"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    rc = proc.wait()
    wall = time.monotonic() - t0
    if rc:
        raise SystemExit(f"{' '.join(cmd)} in {tree} failed ({rc}):\n" + "\n".join(x for _, x in lines[-40:]))
    ends = {}
    for phase, marker, which in PHASES:
        hits = [t for t, x in lines if marker in x]
        if not hits:
            raise SystemExit(f"{tree}: no line with {marker!r} in the job's output (phase {phase!r})")
        ends[phase] = hits[0] if which == "first" else hits[-1]
    ends["exit"] = wall
    phases, prev = {}, 0.0
    for phase, end in ends.items():
        phases[phase] = round(end - prev, 2)
        prev = end
    out = {"wall_s": round(wall, 2), "phases_s": phases}
    if trace is not None:
        out["spans"] = spans(trace, t_start) + [{"process": "launcher", "what": "job over (launch/train.sh exits)",
                                                  "start_s": round(wall, 2), "duration_s": None}]
    return out


def spans(trace: Path, t_start: float) -> list[dict]:
    """The traced spans of the launcher and rank 0: process, what ran, start and duration (s)."""
    events = sorted(line.split("\t") for f in trace.glob("*.log") for line in f.read_text().splitlines())
    out, open_ = [], {}
    for t, who, kind, name in events:
        if who not in ("launcher", "0"):
            continue
        if kind == "begin":
            open_[(who, name)] = float(t)
            if name == "process":
                out.append({"process": who, "what": "interpreter start", "start_s": 0.0,
                            "duration_s": round(float(t) - t_start, 2)} if who == "launcher" else
                           {"process": who, "what": "process up", "start_s": round(float(t) - t_start, 2),
                            "duration_s": None})
        elif (who, name) in open_:
            t0 = open_.pop((who, name))
            out.append({"process": who, "what": name, "start_s": round(t0 - t_start, 2),
                        "duration_s": round(float(t) - t0, 2)})
    for span in out:
        span["process"] = "launcher" if span["process"] == "launcher" else f"rank {span['process']}"
    return sorted(out, key=lambda s: (s["process"] != "launcher", s["start_s"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a code tree to run (repeatable; run in this order within each repeat)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per tree, interleaved (default: 3)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run (default: 2)")
    ap.add_argument("--trace", action="store_true",
                    help="after the timed runs, one more run of the last tree with TRACER (imports and calls of "
                         "the launcher and rank 0, timed; not counted in the timings)")
    ap.add_argument("--out", default=str(OUT), help=f"results JSON (default: {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    trees = {}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not name or not (Path(path) / "launch" / "train.sh").is_file():
            raise SystemExit(f"Invalid --tree {item!r}. Must be NAME=PATH with PATH/launch/train.sh a file.")
        trees[name] = Path(path).resolve()
    if args.repeats < 1 or args.steps < 1:
        raise SystemExit(f"Invalid --repeats={args.repeats} / --steps={args.steps}. Both must be >= 1.")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, tree in trees.items():
                started = time.strftime("%H:%M:%S", time.gmtime())
                r = {"started_utc": started, **run_once(tree, args.steps, Path(tmp) / f"{name}-{i}")}
                runs[name].append(r)
                print(f"repeat {i + 1} {name}: {r['wall_s']:.2f} s {r['phases_s']}", flush=True)
        traced = None
        if args.trace:
            name, tree = list(trees.items())[-1]
            folder = Path(tmp) / "trace"
            folder.mkdir()
            (folder / "sitecustomize.py").write_text(TRACER)
            traced = {"tree": name, **run_once(tree, args.steps, Path(tmp) / "traced", folder)}
    commits = {}
    for name, tree in trees.items():
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "canzona_ds", "launch"],
                               cwd=tree, capture_output=True, text=True).stdout.strip()
        commits[name] = head.stdout.strip() + (" + uncommitted changes" if dirty else "")
    summary = {}
    for name, rs in runs.items():
        summary[name] = {"median_wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
                         "median_phases_s": {p: round(statistics.median(r["phases_s"][p] for r in rs), 2)
                                             for p in rs[0]["phases_s"]}}
    data = {"command": "python benchmarks/bench_startup.py " + " ".join(f"--tree {t}" for t in args.tree)
            + f" --repeats {args.repeats} --steps {args.steps}" + (" --trace" if args.trace else ""),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)", "steps": args.steps,
            "job": f"launch/train.sh --set steps={args.steps} (configs/run_tiny.yaml, 2 ranks)",
            "commits": commits, "runs": runs, "summary": summary}
    if traced is not None:
        data["traced"] = traced
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

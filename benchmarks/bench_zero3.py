"""Measured, side by side in one run: matrix optimizers at ZeRO stage 3, DP = 2, 4, 8 (gloo, CPU).

Per optimizer step and rank we record the thread CPU time of the matrix rule's work
(``time.thread_time``: DP = 8 runs 8 processes on 2 cores, and CPU time, unlike wall time,
is not inflated by a rank waiting for a core) and the bytes the rank puts on the wire.  Every
kind runs in the same rank processes, iterations interleaved (alternating order), so all see
the same background load.  Reported per kind: the BUSIEST rank (the step ends when it is
done), the mean over ranks, and the TOTAL over ranks (the work), each the mean over the timed
steps (Shampoo's and SOAP's preconditioner refreshes included: ``--steps`` is a multiple of
their ``precondition_frequency``).

Kinds (the model: a 7-layer Qwen3ForCausalLM, hidden 320, SwiGLU 864, 4 query heads of 80,
2 key/value heads; its 49 projection matrices take the matrix rule, embeddings, head and
norms AdamW; every engine with ``gradient_clipping: 1.0`` and DeepSpeed's other stage-3
defaults)::

    ds_muon        DeepSpeed 0.19.8's own Muon ("type": "Muon", ns_method "standard") at
                   zero_optimization.stage 3 with "reduce_scatter": false (DeepSpeed refuses
                   Muon with reduce-scatter): full gradients all-reduced in backward; at the
                   step (stage3.py _apply_muon_to_accumulated_grads -> _muon_update_sub_group)
                   gradients and momenta all-gathered, matrices dealt round-robin in model
                   order, each rank runs ``muon_update`` on its share, updates and momenta
                   all-gathered.  Rule work = thread CPU time inside ``muon_update``.
    zero3_adamw    stock DeepSpeed stage 3 with AdamW (reduce_scatter on): the collectives
                   every ZeRO-3 engine issues whatever its optimizer (parameter all-gathers in
                   forward and backward, gradient reduce-scatter); no rule.
    engine/<rule>  the Canzona ZeRO-3 engine: ``deepspeed.initialize`` with CanzonaMuon /
                   CanzonaShampoo / CanzonaSOAP at stage 3 (integration/zero3.py,
                   placement/sharded.py): stock ZeRO-3 reduce-scatter, then per micro-group one
                   all-to-all of gradient pieces to the planned host, the rule on the whole
                   matrix there, one all-to-all of direction pieces back.  Rule work = thread
                   CPU time inside the optimizer's ``rule.direction``; bytes = DeepSpeed's
                   collectives (CommCounter layer ``backend``) + the torch.distributed calls
                   made outside DeepSpeed (layer ``direct``: the hosted all-to-alls and the
                   torch-exact clipping norm's all-to-all and all-reduce).
    hosted/<rule>  (engine-free cross-check) the same hosted step without the engine:
                   ``tp.MicroGroupRuntime`` over ``FlatSplit.even`` pieces of every matrix
                   (ZeRO-3's ceil(numel/DP) cut) on the DP group: per micro-group one
                   all-to-all brings the gradient pieces to the planned host (plan: LPT
                   micro-groups on the rule's FLOPs, ``TPConfig(cost="flops")``), the host
                   runs the rule on the whole matrix, one all-to-all returns the direction
                   pieces, every rank applies its piece.  Rule work = thread CPU time inside
                   ``rule.direction``; bytes = the runtime's own off-rank bytes
                   (``StepStats.bytes_sent``, equal to the plan's prediction) PLUS the
                   measured ``zero3_adamw`` bytes (the ZeRO-3 collectives it rides on).
    replicated/<rule>  the stage-3 replicated baseline: after ZeRO-3's reduce-scatter every
                   rank all-gathers every matrix's gradient pieces (one all_gather_into_tensor
                   of the padded pieces), runs the rule on EVERY whole matrix (rule state
                   replicated on every rank), and applies its own piece of each direction.
                   Rule work = ``rule.direction`` on every rank; bytes = that all-gather +
                   the ``zero3_adamw`` bytes.

The hosted/replicated kinds take their gradients from a plain replica of the model
(forward/backward on the rank's micro-batch, then an uncounted all-reduce standing in for
ZeRO-3's gradient reduce-scatter, whose bytes ``zero3_adamw`` measures).  They measure the
optimizer step the engine runs without the engine around it (``--no-engine`` for a run
without the engine kinds; ``--no-hosted`` without these).

    python benchmarks/bench_zero3.py                 # -> results/bench_zero3.{md,json}
    python benchmarks/bench_zero3.py --dp 2 --steps 2 --warmup 1 --out /tmp/bz3/r.md   # quick look
    python benchmarks/bench_zero3.py --render         # rewrite the .md from the .json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Qwen3-shaped: q = hidden (like Qwen3-1.7B/8B), GQA 2:1, SwiGLU 2.7 x hidden
MODEL = dict(vocab_size=256, hidden_size=320, intermediate_size=864, num_layers=7, num_heads=4, num_kv_heads=2,
             head_dim=80, max_seq_len=256)
MUON = dict(lr=0.02, adam_lr=1e-3, momentum=0.95, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
#: the matrix rules of the hosted / replicated kinds (ds_config params of their Canzona type)
RULE_PARAMS = {
    "muon": ("CanzonaMuon", MUON),
    # full-matrix preconditioners (no blocking): the cubic cost the planner must balance
    "shampoo": ("CanzonaShampoo", dict(lr=1e-3, weight_decay=0.1, precondition_frequency=5,
                                       start_preconditioning_step=5, max_preconditioner_dim=4096)),
    "soap": ("CanzonaSOAP", dict(lr=3e-3, weight_decay=0.1, precondition_frequency=5)),
}
DS_MUON = {"type": "Muon", "params": dict(MUON, ns_method="standard", torch_adam=True)}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                     "torch_adam": True}}
#: every engine clips (DeepSpeed's default value, stated): the Canzona engine's torch-exact norm
#: moves every gradient piece to a norm host (one all-to-all), DeepSpeed's sums partition norms
GRADIENT_CLIPPING = 1.0
#: TP/DP micro-group runtime settings of the hosted kinds
TP_SETTINGS = dict(cost="flops")


def ds_config(optimizer: dict, dp: int, micro: int, reduce_scatter: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "train_batch_size": micro * dp,
            "zero_optimization": {"stage": 3, "reduce_scatter": reduce_scatter}, "optimizer": optimizer,
            "gradient_clipping": GRADIENT_CLIPPING, "steps_per_print": 10 ** 9,
            # the step metrics' DP all_gather (every 10th step by default) is not the optimizer's traffic
            "canzona_metrics": {"interval": 0}}


class RuleTimer:
    """Thread CPU time and call count of the wrapped functions (the rule's work)."""

    def __init__(self) -> None:
        self.total, self.calls = 0.0, 0

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*a, **k):
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.thread_time() - c
                self.calls += 1
        timed.__wrapped__ = fn
        return timed


def make_rule(name: str):
    from canzona_ds.config import CanzonaConfig

    opt_type, params = RULE_PARAMS[name]
    return CanzonaConfig.from_ds(opt_type, params).rule


def matrices_of(model) -> list[tuple[str, tuple[int, ...]]]:
    from canzona_ds.planning.params import default_is_matrix

    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if default_is_matrix(n, p.shape)]


def plan_bytes(runtime, rank: int, grad_bytes: int) -> int:
    """Off-rank bytes one ``MicroGroupRuntime.step`` sends from ``rank``, from the plan alone:
    its gradient pieces of matrices hosted elsewhere (none when ``runtime.pregathered``: the
    engine's clipping norm already moved them), and (where it hosts) the other ranks' pieces of
    the direction, in the rule's direction dtype."""
    dbytes = torch.empty(0, dtype=runtime.rule.direction_dtype(torch.float32)).element_size()
    total = 0
    for i, host in enumerate(runtime.plan.host):
        m = runtime.matrices[i]
        if host != rank:
            total += 0 if runtime.pregathered else m.local_numel(rank) * grad_bytes
        else:
            total += sum(m.local_numel(r) for r in range(len(m.lengths)) if r != rank) * dbytes
    return total


class Hosted:
    """hosted/<rule>: the Canzona ZeRO-3 optimizer step over FlatSplit pieces on the DP group."""

    def __init__(self, rule_name: str, mats, full: dict, rank: int, timer: RuleTimer) -> None:
        from canzona_ds.config import TPConfig
        from canzona_ds.tp import MicroGroupRuntime

        self.rule = make_rule(rule_name)
        object.__setattr__(self.rule, "direction", timer.wrap(self.rule.direction))
        self.rank, self.mats = rank, mats
        self.runtime = MicroGroupRuntime(mats, self.rule, None, TPConfig(**TP_SETTINGS), state={})
        self.params = [m.piece(full[m.name], rank).clone() for m in mats]
        self.lr, self.wd = RULE_PARAMS[rule_name][1]["lr"], RULE_PARAMS[rule_name][1]["weight_decay"]

    def step(self, grads: dict, t: int) -> dict:
        from canzona_testkit.comm import CommCounter

        pieces = [m.piece(grads[m.name], self.rank) for m in self.mats]
        with CommCounter() as c:
            stats = self.runtime.step(self.params, pieces, lr=self.lr, weight_decay=self.wd, step=t)
        return {"bytes": c.wire_bytes("direct"), "collectives": dict(stats.collectives),
                "runtime_bytes": stats.bytes_sent, "counted": {op: n for op, (n, _, _) in c.by_op("direct").items()},
                "hosted": len(self.runtime.hosted())}


class Replicated:
    """replicated/<rule>: all-gather every matrix's pieces, the rule on every whole matrix on
    every rank, each rank keeps its piece of every direction."""

    def __init__(self, rule_name: str, mats, full: dict, rank: int, world: int, timer: RuleTimer) -> None:
        self.rule = make_rule(rule_name)
        object.__setattr__(self.rule, "direction", timer.wrap(self.rule.direction))
        self.rank, self.world, self.mats, self.state = rank, world, mats, {}
        self.params = [m.piece(full[m.name], rank).clone() for m in mats]
        self.per = [-(-math.prod(m.full_shape) // world) for m in mats]
        self.lr, self.wd = RULE_PARAMS[rule_name][1]["lr"], RULE_PARAMS[rule_name][1]["weight_decay"]

    def step(self, grads: dict, t: int) -> dict:
        import torch.distributed as dist

        from canzona_ds.optim.rule import apply_rule_update, rule_state
        from canzona_testkit.comm import CommCounter

        mine = torch.zeros(sum(self.per))
        off = 0
        for m, per in zip(self.mats, self.per):
            p = m.piece(grads[m.name], self.rank)
            mine[off:off + p.numel()] = p
            off += per
        out = torch.empty(self.world * mine.numel())
        with CommCounter() as c:
            dist.all_gather_into_tensor(out, mine)
        rows = out.view(self.world, -1)
        off = 0
        for i, (m, per) in enumerate(zip(self.mats, self.per)):
            G = rows[:, off:off + per].reshape(-1)[:math.prod(m.full_shape)].view(m.full_shape)
            off += per
            D = self.rule.direction(G, rule_state(self.state, m.name, self.rule, m.info, like=G), m.info, t)
            apply_rule_update(self.params[i], m.piece(D, self.rank), self.rule, m.info, t, self.lr, self.wd)
        return {"bytes": c.wire_bytes("direct"), "counted": {op: n for op, (n, _, _) in c.by_op("direct").items()}}


def engine_step(engine, x, y, timer: RuleTimer) -> dict:
    """One forward/backward/step of a DeepSpeed engine, counted: DeepSpeed's collectives at its
    backend, plus the torch.distributed calls made outside it (a Canzona engine's hosted
    all-to-alls and its torch-exact gradient norm); the hosted runtime's own StepStats beside."""
    from canzona_testkit.comm import CommCounter

    with CommCounter() as c:
        engine.backward(engine(x, y)[1])
        engine.step()
    out = {"bytes": c.wire_bytes("backend") + c.wire_bytes("direct"),
           "counted": {op: n for op, (n, _, _) in c.by_op("backend").items()},
           "wire_by_op": {op: w for op, (_, _, w) in c.by_op("backend").items()},
           "direct_counted": {op: n for op, (n, _, _) in c.by_op("direct").items()},
           "direct_wire_by_op": {op: w for op, (_, _, w) in c.by_op("direct").items()}}
    canzona = _canzona_of(engine)
    if canzona is not None:
        stats = canzona.step_stats
        out["collectives"] = dict(stats.collectives)
        out["runtime_bytes"] = stats.bytes_sent
    return out


def _canzona_of(engine):
    from canzona_ds.optimizer import CanzonaOptimizer

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return inner if isinstance(inner, CanzonaOptimizer) else None


def _worker(rank: int, dp: int, model_kw: dict, rules: list, steps: int, warmup: int, micro: int, seq: int,
            with_ds: bool, with_engine: bool = True, with_hosted: bool = True,
            replicated: list | None = None) -> dict:
    """One rank: every kind, interleaved.  ``replicated``: the rules of the replicated baseline
    (default: every rule but Muon, whose baseline is DeepSpeed's Muon; every rule without it)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.muon import original_muon

    import canzona_ds  # noqa: F401  (registers the Canzona optimizer types)

    from canzona_ds.models.qwen3 import Qwen3Config, build_model
    from canzona_testkit.comm import CommCounter
    from canzona_ds.tp import FlatSplit

    cfg = Qwen3Config(**model_kw)
    timer = RuleTimer()
    # stage3.py imports muon_update from this module at call time: the wrapper is what it calls
    original_muon.muon_update = timer.wrap(original_muon.muon_update)
    engines = {}
    builds = [("ds_muon", DS_MUON, False), ("zero3_adamw", ADAMW, True)] if with_ds else []
    if with_engine:
        builds += [(f"engine/{r}", {"type": RULE_PARAMS[r][0], "params": RULE_PARAMS[r][1]}, True) for r in rules]
    for label, opt, rs in builds:
        model = build_model(cfg, seed=0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(opt, dp, micro, rs))
        canzona = _canzona_of(engine)
        if label.startswith("engine/"):
            if canzona is None or canzona.placement.kind != "sharded":
                raise RuntimeError(f"{label}: expected a CanzonaOptimizer with the sharded placement, got "
                                   f"{type(engine.optimizer).__name__}")
            object.__setattr__(canzona.rule, "direction", timer.wrap(canzona.rule.direction))
        engines[label] = engine
    if with_ds:
        ds_matrices = sorted(n for n, p in engines["ds_muon"].module.named_parameters() if getattr(p, "use_muon", 0))
    replica = build_model(cfg, seed=0)
    mat_shapes = matrices_of(replica)
    if with_ds and ds_matrices != sorted(n for n, _ in mat_shapes):
        raise RuntimeError(f"DeepSpeed's Muon and Canzona's matrix filter differ: {ds_matrices} vs {mat_shapes}")
    mats = [FlatSplit.even(n, s, dp) for n, s in mat_shapes]
    full = {n: p.detach().clone() for n, p in replica.named_parameters()}
    kinds = {}
    if replicated is None:
        replicated = [r for r in rules if r != "muon" or not with_ds]
    for r in rules:
        if with_hosted:
            kinds[f"hosted/{r}"] = Hosted(r, mats, full, rank, timer)
        if r in replicated:
            kinds[f"replicated/{r}"] = Replicated(r, mats, full, rank, dp, timer)
    for r in replicated:
        if f"replicated/{r}" not in kinds:
            kinds[f"replicated/{r}"] = Replicated(r, mats, full, rank, dp, timer)
    labels = list(engines) + list(kinds)
    res = {label: {"rule_cpu": [], "bytes": [], "calls": []} for label in labels}
    extra: dict = {label: {} for label in labels}
    g = torch.Generator().manual_seed(1)
    for s in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (micro * dp, seq), generator=g)
        y = torch.randint(0, cfg.vocab_size, (micro * dp, seq), generator=g)
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        # the replica's gradient (DP-averaged), shared by every hosted / replicated kind
        replica.zero_grad(set_to_none=True)
        replica(x, y)[1].backward()
        flat = torch.cat([p.grad.reshape(-1) for _, p in replica.named_parameters()])
        dist.all_reduce(flat)
        flat /= dp
        grads, off = {}, 0
        for n, p in replica.named_parameters():
            grads[n] = flat[off:off + p.numel()].view(p.shape)
            off += p.numel()
        order = labels if s % 2 else labels[::-1]
        for label in order:
            dist.barrier()
            timer.reset()
            if label in engines:
                out = engine_step(engines[label], x, y, timer)
            else:
                out = kinds[label].step(grads, s + 1)
            if s >= warmup:
                r = res[label]
                r["rule_cpu"].append(timer.total)
                r["bytes"].append(out["bytes"])
                r["calls"].append(timer.calls)
                extra[label] = {k: v for k, v in out.items() if k != "bytes"}
    for label, engine in engines.items():
        canzona = _canzona_of(engine)
        if canzona is not None:
            rt = canzona.tp_runtime
            extra[label]["expected"] = canzona.expected_collectives()
            extra[label]["plan_bytes"] = plan_bytes(rt, rank, 4)
            extra[label]["groups"] = len(rt.plan.groups)
            extra[label]["plan_load"] = list(rt.plan.rank_load)
            extra[label]["hosted"] = len(rt.hosted())
    for label, k in kinds.items():
        if isinstance(k, Hosted):
            extra[label]["expected"] = k.runtime.expected_collectives()
            extra[label]["plan_bytes"] = plan_bytes(k.runtime, rank, 4)
            extra[label]["groups"] = len(k.runtime.plan.groups)
            extra[label]["plan_load"] = list(k.runtime.plan.rank_load)
    return {"res": res, "extra": extra}


def summarize(out: list[dict], dp: int) -> dict:
    rows = {}
    for label in out[0]["res"]:
        per_rank = [o["res"][label] for o in out]
        mean_cpu = [statistics.fmean(r["rule_cpu"]) for r in per_rank]
        med_cpu = [statistics.median(r["rule_cpu"]) for r in per_rank]
        bytes_ = [statistics.fmean(r["bytes"]) for r in per_rank]
        rows[f"{label}@dp{dp}"] = {
            "kind": label, "dp": dp,
            "rule_cpu_busiest_ms": 1e3 * max(mean_cpu), "rule_cpu_mean_ms": 1e3 * statistics.fmean(mean_cpu),
            "rule_cpu_total_ms": 1e3 * sum(mean_cpu), "rule_cpu_per_rank_ms": [1e3 * v for v in mean_cpu],
            "rule_cpu_median_busiest_ms": 1e3 * max(med_cpu),
            "rule_calls_per_rank": [statistics.median(r["calls"]) for r in per_rank],
            "own_bytes_per_rank": bytes_, "own_bytes_busiest": max(bytes_),
            "extra_per_rank": [o["extra"][label] for o in out],
        }
    shared = rows.get(f"zero3_adamw@dp{dp}")
    for r in rows.values():
        # what the kind sends per step in a ZeRO-3 run: its own collectives, plus, for the
        # engine-free kinds, the stage-3 collectives they ride on (measured on zero3_adamw)
        base = shared["own_bytes_per_rank"] if shared and r["kind"].startswith(("hosted/", "replicated/")) else None
        r["bytes_per_rank"] = [a + (base[i] if base else 0.0) for i, a in enumerate(r["own_bytes_per_rank"])]
        r["bytes_busiest"] = max(r["bytes_per_rank"])
    return rows


def measure(dps: list[int], rules: list[str], steps: int, warmup: int, micro: int, seq: int,
            with_ds: bool = True, with_engine: bool = True, with_hosted: bool = True) -> dict:
    from canzona_testkit.dist import run_distributed

    rows: dict = {}
    for dp in dps:
        out = run_distributed(_worker, dp, MODEL, rules, steps, warmup, micro, seq, with_ds, with_engine,
                              with_hosted, timeout=3600)
        dp_rows = summarize(out, dp)
        rows.update(dp_rows)
        for r in dp_rows.values():
            print(f"dp={dp} {r['kind']:20s} rule CPU busiest {r['rule_cpu_busiest_ms']:8.1f} mean "
                  f"{r['rule_cpu_mean_ms']:8.1f} total {r['rule_cpu_total_ms']:8.1f} ms  MB/step busiest "
                  f"{r['bytes_busiest'] / 1e6:.2f}", flush=True)
    return rows


def goals(rows: dict) -> dict:
    """The issue's goals at the largest DP measured, from the rows."""
    dps = sorted({r["dp"] for r in rows.values()})
    top = dps[-1]
    out: dict = {"dp": top}
    src = "engine" if f"engine/muon@dp{top}" in rows else "hosted"
    out["source"] = src
    ours, ds = rows.get(f"{src}/muon@dp{top}"), rows.get(f"ds_muon@dp{top}")
    if ours and ds:
        out["busiest_vs_ds_muon"] = ours["rule_cpu_busiest_ms"] / ds["rule_cpu_busiest_ms"]
        out["busiest_vs_own_mean"] = ours["rule_cpu_busiest_ms"] / ours["rule_cpu_mean_ms"]
        out["ds_busiest_vs_own_mean"] = ds["rule_cpu_busiest_ms"] / ds["rule_cpu_mean_ms"]
        out["bytes_vs_ds_muon"] = ours["bytes_busiest"] / ds["bytes_busiest"]
    for rule in RULE_PARAMS:
        totals = {dp: rows[f"{src}/{rule}@dp{dp}"]["rule_cpu_total_ms"] for dp in dps
                  if f"{src}/{rule}@dp{dp}" in rows}
        if len(totals) > 1:
            out[f"{rule}_total_vs_dp{dps[0]}"] = {str(dp): v / totals[dps[0]] for dp, v in totals.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rules", nargs="+", default=list(RULE_PARAMS), choices=list(RULE_PARAMS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps (a multiple of precondition_frequency=5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-engine", action="store_true", help="skip the Canzona ZeRO-3 engine kinds")
    ap.add_argument("--no-hosted", action="store_true", help="skip the engine-free hosted kinds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the markdown from the results JSON (no measurement)")
    args = ap.parse_args()
    out = Path(args.out or ROOT / "benchmarks" / "results" / "bench_zero3.md")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tables

    if args.render:
        out.write_text(tables.bench_zero3_markdown(json.loads(out.with_suffix(".json").read_text())))
        print(out.read_text())
        return
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    rows = measure(args.dp, args.rules, args.steps, args.warmup, args.micro, args.seq,
                   with_engine=not args.no_engine, with_hosted=not args.no_hosted)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = ("the Canzona ZeRO-3 engine (deepspeed.initialize with CanzonaMuon / CanzonaShampoo / CanzonaSOAP at "
              "zero_optimization.stage 3), measured end to end" if not args.no_engine else
              "the engine-free hosted step (tp.MicroGroupRuntime over FlatSplit.even pieces on the DP group)")
    if not args.no_engine and not args.no_hosted:
        source += "; the engine-free hosted step (`hosted` rows) beside it as a cross-check"
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    code = {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "uncommitted changes": "yes" if git("status", "--porcelain", "--untracked-files=no") else "no"}
    data = {"command": cmd, "source": source, "code": code,
            "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread per rank",
            "model": MODEL, "steps": args.steps, "warmup": args.warmup, "micro": args.micro, "seq": args.seq,
            "rules": {k: {"type": t, "params": p} for k, (t, p) in RULE_PARAMS.items()},
            "ds_muon": DS_MUON, "tp_settings": TP_SETTINGS, "rows": rows, "goals": goals(rows)}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.write_text(tables.bench_zero3_markdown(data))
    print(out.read_text())


if __name__ == "__main__":
    main()

"""Measured, side by side in one run: matrix optimizers under DeepSpeed ZeRO on CPU ranks (gloo).

Every *kind* (an optimizer section + ZeRO settings) gets its own DeepSpeed engine in the
same rank processes, and their iterations are interleaved (alternating order), so they see
the same background load.  Per iteration and rank we record:

    iter      wall time of forward + backward + engine.step
    opt_cpu   thread CPU time inside the optimizer DeepSpeed steps (``time.thread_time``):
              the rule's and AdamW's work on this rank.  CPU time is not inflated by ranks
              waiting for a core (DP > cores oversubscribes the machine), wall time is.
    mat_cpu   thread CPU time of the matrix rule alone (Newton-Schulz etc.): inside our
              optimizer's matrix step, and for DeepSpeed's Muon inside its ``muon_update``
              calls, which run during the gradient reduction (in backward), not in the step
    bytes     wire bytes this rank sends through deepspeed.comm (canzona_testkit.comm.CommCounter:
              collectives actually issued, sized by their process group)

and report per kind the median over iterations of the BUSIEST rank (max over ranks: a step
ends when the slowest rank is done) and the SUM over ranks (total work).

Suites (``--suite``):

    rules    each rule (muon, shampoo, soap) with three placements at DP=2 and DP=4:
               balanced   the default plan (multi_lpt on the rule's amortised FLOPs)
               naive      the paper's naive atomic assignment (planner paper_naive, eq. 1) over
                          buckets of dp mean-sized matrices (naive_bucket_numel)
               replicated ZeRO stage 0: every rank updates every matrix (synchronous)
    muon     CanzonaMuon vs DeepSpeed's Muon vs AdamW at ZeRO stage 1 and 2, with and
             without optimizer offload to CPU, plus NV-layerwise (canzona_testkit.baselines) and
             stock AdamW with use_multi_rank_bucket_allreduce=false (the setting CanzonaMuon
             uses), at DP=1 and 2
    scaling  CanzonaMuon vs DeepSpeed's Muon at DP=2, 4, 8 (above the core count): the matrix
             optimizer's per-rank CPU time, busiest rank and total

    python benchmarks/bench_zero.py --suite rules      # -> results/bench_rules.{md,json}
    python benchmarks/bench_zero.py --suite muon       # -> results/bench_muon.{md,json}
    python benchmarks/bench_zero.py --suite scaling    # -> results/bench_scaling.{md,json}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Qwen3-shaped decoder layer with fused weights: qkv, proj, fc1 = [gate; up], fc2."""

    def __init__(self, h: int, heads: int, kv: int, hd: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd, self.ffn = heads, kv, hd, ffn
        self.norm1 = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, (heads + 2 * kv) * hd, bias=False)
        self.proj = nn.Linear(heads * hd, h, bias=False)
        self.norm2 = nn.RMSNorm(h)
        self.fc1 = nn.Linear(h, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
        q = q.view(B, T, self.heads, self.hd).transpose(1, 2)
        k = k.view(B, T, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
        v = v.view(B, T, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(a)
        gate, up = self.fc1(self.norm2(x)).split(self.ffn, -1)
        return x + self.fc2(F.silu(gate) * up)


class QwenLike(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                 layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, head_dim, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1).float(), y.flatten())


#: a 5-layer Qwen3-shaped stack whose matrices do not divide evenly over 2 or 4 ranks
SHAPES = {
    "rules": dict(vocab=256, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=352, layers=5),
    "muon": dict(vocab=512, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, layers=6),
    "scaling": dict(vocab=512, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=704, layers=5),
}
DEFAULT_DPS = {"rules": [2, 4], "muon": [1, 2], "scaling": [2, 4, 8]}
RULE_PARAMS = {
    "CanzonaMuon": dict(lr=0.02, adam_lr=1e-3, momentum=0.95, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8),
    # full-matrix preconditioners (no blocking): the cost the planner must balance is cubic
    "CanzonaShampoo": dict(lr=1e-3, weight_decay=0.1, precondition_frequency=5, start_preconditioning_step=5,
                           max_preconditioner_dim=4096),
    "CanzonaSOAP": dict(lr=3e-3, weight_decay=0.1, precondition_frequency=5),
}


def kinds_for(suite: str) -> dict[str, dict]:
    """label -> {"optimizer": section, "stage": int}."""
    out: dict[str, dict] = {}
    if suite == "rules":
        for opt_type, params in RULE_PARAMS.items():
            rule = opt_type.removeprefix("Canzona").lower()
            out[f"{rule}/balanced"] = {"optimizer": {"type": opt_type, "params": params}, "stage": 1}
            out[f"{rule}/naive"] = {"optimizer": {"type": opt_type, "params": dict(params, planner="paper_naive")},
                                    "stage": 1}
            out[f"{rule}/replicated"] = {"optimizer": {"type": opt_type, "params": params}, "stage": 0}
    elif suite in ("muon", "scaling"):
        muon = RULE_PARAMS["CanzonaMuon"]
        ds_muon = {"type": "Muon", "params": dict(muon, ns_method="standard", torch_adam=True)}
        adamw = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                             "torch_adam": True}}
        stages = (1, 2) if suite == "muon" else (1,)
        for stage in stages:
            out[f"canzona/stage{stage}"] = {"optimizer": {"type": "CanzonaMuon", "params": muon}, "stage": stage}
            out[f"ds_muon/stage{stage}"] = {"optimizer": ds_muon, "stage": stage}
            if suite == "muon":
                out[f"adamw/stage{stage}"] = {"optimizer": adamw, "stage": stage}
        if suite == "muon":
            for stage in (1, 2):
                out[f"canzona/stage{stage}+offload"] = {"optimizer": {"type": "CanzonaMuon", "params": muon},
                                                        "stage": stage, "offload": True}
                out[f"ds_muon/stage{stage}+offload"] = {"optimizer": ds_muon, "stage": stage, "offload": True}
            out["adamw/stage1+reduce_to_owner"] = {"optimizer": adamw, "stage": 1, "reduce_to_owner": True}
            out["layerwise/stage0"] = {"optimizer": {"type": "CanzonaMuon", "params": muon}, "stage": 0,
                                       "client": "layerwise"}
    else:
        raise ValueError(f"Unknown suite {suite!r}. Allowed: ['rules', 'muon', 'scaling'].")
    return out


def ds_cfg(kind: dict, dp: int, micro: int) -> dict:
    zero = {"stage": kind["stage"]}
    if kind.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if kind.get("reduce_to_owner"):
        zero["use_multi_rank_bucket_allreduce"] = False
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "train_batch_size": micro * dp,
           "zero_optimization": zero, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9}
    if kind.get("client"):
        return cfg  # a client optimizer (the layer-wise baseline) is passed to deepspeed.initialize
    if kind.get("offload"):
        cfg["zero_force_ds_cpu_optimizer"] = False
    cfg["optimizer"] = kind["optimizer"]
    return cfg


class _MatrixTimer:
    """Thread CPU time of the matrix rule: ours (CanzonaOptimizer._matrix_step) and DeepSpeed's
    Muon (every ``muon_update`` call, patched on its module; ZeRO imports it at call time)."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.thread_time() - c
        return timed


def _worker(rank: int, dp: int, shape: dict, kinds: dict, steps: int, warmup: int, micro: int, seq: int):
    import canzona_ds  # noqa: F401
    import deepspeed
    from deepspeed.runtime.zero.muon import original_muon

    from canzona_ds.config import CanzonaConfig
    from canzona_ds.optimizer import CanzonaOptimizer
    from canzona_testkit.baselines import LayerwiseOptimizer
    from canzona_testkit.comm import CommCounter

    matrix_timer = _MatrixTimer()
    original_muon.muon_update = matrix_timer.wrap(original_muon.muon_update)
    engines, timers = {}, {}
    for label, kind in kinds.items():
        torch.manual_seed(0)
        model = QwenLike(**shape)
        client = None
        if kind.get("client") == "layerwise":
            opt_section = kind["optimizer"]
            client = LayerwiseOptimizer(model.named_parameters(),
                                        CanzonaConfig.from_ds(opt_section["type"], opt_section["params"]))
            client._matrix_step = matrix_timer.wrap(client._matrix_step) if hasattr(client, "_matrix_step") else None
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_cfg(kind, dp, micro), optimizer=client)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        if isinstance(inner, CanzonaOptimizer):
            inner._matrix_step = matrix_timer.wrap(inner._matrix_step)
        rec: dict = {"cpu": [], "wall": []}

        def timed(*a, _stock=inner.step, _rec=rec, **k):
            c, t = time.thread_time(), time.perf_counter()
            out = _stock(*a, **k)
            _rec["cpu"].append(time.thread_time() - c)
            _rec["wall"].append(time.perf_counter() - t)
            return out

        inner.step = timed
        engines[label], timers[label] = engine, rec
    res = {label: {"iter": [], "opt_cpu": [], "opt_wall": [], "mat_cpu": [], "bytes": None} for label in kinds}
    g = torch.Generator().manual_seed(1)
    labels = list(kinds)
    for s in range(warmup + steps):
        x = torch.randint(0, shape["vocab"], (micro * dp, seq), generator=g)
        y = torch.randint(0, shape["vocab"], (micro * dp, seq), generator=g)
        x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        for label in (labels if s % 2 else labels[::-1]):
            engine, rec, r = engines[label], timers[label], res[label]
            rec["cpu"].clear()
            rec["wall"].clear()
            torch.distributed.barrier()
            counter = CommCounter() if s == warmup else None
            if counter:
                counter.__enter__()
            matrix_timer.total = 0.0
            t0 = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            t1 = time.perf_counter()
            mat = matrix_timer.total
            if counter:
                counter.__exit__(None, None, None)
                r["bytes"] = counter.wire_bytes("deepspeed")
            if s >= warmup:
                r["iter"].append(t1 - t0)
                # ZeRO steps the inner optimizer once per param group: sum per iteration
                r["opt_cpu"].append(sum(rec["cpu"]))
                r["opt_wall"].append(sum(rec["wall"]))
                r["mat_cpu"].append(mat)
    return res


def naive_bucket_numel(shape: dict, dp: int) -> int:
    """Bucket size for ``paper_naive`` in the bench: ``dp`` mean-sized matrices per bucket, the
    regime of the paper's Figure 3c (Qwen3-32B TP=8 at DP=32 with DeepSpeed's 5e8 buckets: 8
    buckets of ~32 matrices).  With DeepSpeed's default bucket the bench model would be ONE
    bucket, which eq. 1 splits almost evenly: not the case the paper measures."""
    h, hd, ffn = shape["hidden"], shape["head_dim"], shape["ffn"]
    per_layer = [h * (shape["heads"] + 2 * shape["kv_heads"]) * hd, shape["heads"] * hd * h, h * 2 * ffn, ffn * h]
    return max(1, round(dp * sum(per_layer) / len(per_layer)))


def measure(suite: str, dps: list[int], steps: int, warmup: int, micro: int, seq: int) -> dict:
    from canzona_testkit.dist import run_distributed

    kinds = kinds_for(suite)
    rows: dict = {}
    for dp in dps:
        dp_kinds = {k: v for k, v in kinds.items() if not (dp == 1 and v["stage"] == 0 and "replicated" in k)}
        for k, v in dp_kinds.items():
            params = v["optimizer"]["params"]
            if params.get("planner") == "paper_naive":
                dp_kinds[k] = dict(v, optimizer=dict(v["optimizer"], params=dict(
                    params, bucket_numel=naive_bucket_numel(SHAPES[suite], dp))))
        out = run_distributed(_worker, dp, SHAPES[suite], dp_kinds, steps, warmup, micro, seq, timeout=3600)
        for label in dp_kinds:
            per_rank = [o[label] for o in out]
            med = {key: [statistics.median(r[key]) for r in per_rank] for key in ("iter", "opt_cpu", "opt_wall",
                                                                                  "mat_cpu")}
            mean = {key: [statistics.fmean(r[key]) for r in per_rank] for key in ("opt_cpu", "mat_cpu")}
            rows[f"{label}@dp{dp}"] = {
                "kind": label, "dp": dp,
                "iter_ms": 1e3 * statistics.median([max(r["iter"][i] for r in per_rank) for i in range(steps)]),
                "opt_cpu_busiest_ms": 1e3 * max(med["opt_cpu"]),
                "opt_cpu_total_ms": 1e3 * sum(med["opt_cpu"]),
                "opt_cpu_per_rank_ms": [1e3 * v for v in med["opt_cpu"]],
                "opt_wall_busiest_ms": 1e3 * max(med["opt_wall"]),
                "opt_cpu_mean_busiest_ms": 1e3 * max(mean["opt_cpu"]),
                "mat_cpu_busiest_ms": 1e3 * max(med["mat_cpu"]),
                "mat_cpu_total_ms": 1e3 * sum(med["mat_cpu"]),
                "mat_cpu_mean_busiest_ms": 1e3 * max(mean["mat_cpu"]),
                "mat_cpu_per_rank_ms": [1e3 * v for v in med["mat_cpu"]],
                "bytes_per_rank": per_rank[0]["bytes"],
                "bytes_max_rank": max(r["bytes"] for r in per_rank),
            }
            r = rows[f"{label}@dp{dp}"]
            print(f"dp={dp} {label:22s} iter {r['iter_ms']:8.1f} ms  optimizer CPU busiest {r['opt_cpu_busiest_ms']:8.1f} "
                  f"total {r['opt_cpu_total_ms']:8.1f} ms  bytes {r['bytes_per_rank']:.0f}", flush=True)
    return rows


def write_report(suite: str, rows: dict, args, cmd: str, out: Path) -> None:
    lines = [f"# ZeRO benchmark, suite `{suite}` (measured)", "", f"Command: `{cmd}`", "",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread per rank. Model: "
             f"Qwen3-shaped stack {SHAPES[suite]}, micro-batch {args.micro} x seq {args.seq}, {args.steps} timed "
             f"iterations after {args.warmup} warm-up; every kind in the same processes, iterations interleaved.", "",
             "`optimizer CPU` is the thread CPU time inside the optimizer step DeepSpeed calls (the matrix rule and "
             "AdamW on this rank), median over iterations: `busiest` = the slowest rank (the step's makespan), "
             "`total` = summed over ranks (the work).  CPU time is unaffected by ranks sharing cores; wall time "
             "(`iteration`) is not, and at DP=4 four ranks share two cores.", ""]
    if suite == "rules":
        lines += ["| rule | DP | placement | optimizer CPU ms, busiest rank | vs replicated | vs naive | "
                  "mean (refresh steps included) | optimizer CPU ms, total | per rank | iteration ms (wall) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for key, r in rows.items():
            rule, placement = r["kind"].split("/")
            rep = rows.get(f"{rule}/replicated@dp{r['dp']}")
            naive = rows.get(f"{rule}/naive@dp{r['dp']}")
            vs_rep = f"{r['opt_cpu_busiest_ms'] / rep['opt_cpu_busiest_ms']:.2f}x" if rep else "-"
            vs_naive = f"{r['opt_cpu_busiest_ms'] / naive['opt_cpu_busiest_ms']:.2f}x" if naive else "-"
            lines.append(f"| {rule} | {r['dp']} | {placement} | {r['opt_cpu_busiest_ms']:.1f} | {vs_rep} | {vs_naive} | "
                         f"{r['opt_cpu_mean_busiest_ms']:.1f} | {r['opt_cpu_total_ms']:.1f} | {', '.join(f'{v:.0f}' for v in r['opt_cpu_per_rank_ms'])} | "
                         f"{r['iter_ms']:.1f} |")
        lines += ["", "`balanced` = the default plan (multi_lpt on the rule's amortised FLOPs); `naive` = the paper's "
                  "naive atomic assignment (planner `paper_naive`, eq. 1) with `bucket_numel` = DP mean-sized matrices per bucket "
                  "(the paper's Figure 3c regime: ~one matrix per rank per bucket; with one bucket eq. 1 is nearly balanced "
                  "on a model this small); `replicated` = ZeRO stage 0, every rank updates "
                  "every matrix (the synchronous baseline). Shampoo uses full-matrix preconditioners "
                  f"({RULE_PARAMS['CanzonaShampoo']}); SOAP {RULE_PARAMS['CanzonaSOAP']}."]
    elif suite == "muon":
        lines += ["| kind | DP | iteration ms (wall) | matrix rule CPU ms, busiest | optimizer step CPU ms, busiest | "
                  "bytes / iteration, busiest rank |", "|---|---|---|---|---|---|"]
        for r in rows.values():
            lines.append(f"| {r['kind']} | {r['dp']} | {r['iter_ms']:.1f} | {r['mat_cpu_busiest_ms']:.1f} | "
                         f"{r['opt_cpu_busiest_ms']:.1f} | {r['bytes_max_rank']:,.0f} |")
        lines += ["", "`matrix rule CPU` = Newton-Schulz and momentum: inside our optimizer's matrix step; for "
                  "DeepSpeed's Muon inside its `muon_update` calls, which it makes during the gradient reduction "
                  "(backward), so its `optimizer step CPU` holds only its AdamW half; for `layerwise` the owned "
                  "layers' updates and the owners' broadcasts. Bytes: wire bytes of the collectives actually issued "
                  "(canzona_testkit.comm.CommCounter, sized by their process group) in one iteration. "
                  "`adamw/stage1+reduce_to_owner` is stock AdamW with `use_multi_rank_bucket_allreduce: false`, the "
                  "reduction CanzonaMuon uses (reduce each gradient slice to its owner instead of all-reducing "
                  "whole buckets): the fair byte baseline. `+offload`: `offload_optimizer.device=cpu` (here the "
                  "device is the CPU, so this measures DeepSpeed's offload code path, not a PCIe transfer)."]
    else:
        lines += ["| DP | kind | matrix rule CPU ms, busiest rank | mean | total over ranks | per rank | "
                  "busiest vs DeepSpeed Muon |", "|---|---|---|---|---|---|---|"]
        for r in rows.values():
            ds = rows.get(f"ds_muon/stage1@dp{r['dp']}")
            ratio = f"{r['mat_cpu_busiest_ms'] / ds['mat_cpu_busiest_ms']:.2f}x" if ds else "-"
            lines.append(f"| {r['dp']} | {r['kind']} | {r['mat_cpu_busiest_ms']:.1f} | {r['mat_cpu_mean_busiest_ms']:.1f}"
                         f" | {r['mat_cpu_total_ms']:.1f} | {', '.join(f'{v:.0f}' for v in r['mat_cpu_per_rank_ms'])} "
                         f"| {ratio} |")
        lines += ["", "The matrix optimizer's work per rank (Newton-Schulz and momentum), thread CPU time: DeepSpeed's "
                  "Muon computes every matrix that touches a rank's equal chunk, so a matrix cut by a chunk boundary "
                  "is orthogonalised on every rank it touches (the total grows with DP); CanzonaMuon computes each "
                  "matrix once, on its owner, with the planned balance. DP 4 and 8 run on 2 cores: CPU time still "
                  "counts each rank's own work (waiting for a core is not CPU time), though cache and memory "
                  "contention inflate it somewhat for everyone alike."]
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="rules", choices=["rules", "muon", "scaling"])
    ap.add_argument("--dp", type=int, nargs="+", default=None, help="default: rules 2 4, muon 1 2, scaling 2 4 8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dps = args.dp or DEFAULT_DPS[args.suite]
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    rows = measure(args.suite, dps, args.steps, args.warmup, args.micro, args.seq)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"bench_{args.suite}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
    write_report(args.suite, rows, args, cmd, out)
    print(out.read_text())


if __name__ == "__main__":
    main()

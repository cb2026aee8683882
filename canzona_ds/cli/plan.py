"""``canzona-plan``: compare DP planners and TP schedulers for a model, offline.

    canzona-plan --model qwen3-32b --dp 32 --tp 8
    canzona-plan --model qwen3-32b --dp 32 --tp 8 --json
    canzona-plan --model path/to/config.json --dp 16 --tp 4 --optimizer shampoo --cost flops
    canzona-plan --model qwen3-14b --dp 32 --tp 4 --optimizer soap --precondition-frequency 10
    canzona-plan --model qwen3-8b --dp 16 --tp 4 --plot loads.png     (needs matplotlib)
    canzona-plan --model qwen3-32b --dp 32 --tp 8 --bucket-numel 40000000   (Megatron's default buckets)
    canzona-plan --model qwen3-30b-a3b --dp 128 --ep 8 --cost flops       (MoE with expert parallelism)

DP planners (``--json``: ``dp_planners.<name>``): ``equal_chunk`` (DeepSpeed's stock
slicing, cuts matrices), ``paper_naive`` (the paper's eq. 1 over buckets), ``naive_atomic``,
``alpha_balanced`` (Algorithm 1 over buckets), ``layerwise`` (whole layers by LPT, the
NV-layerwise baseline), ``lpt`` and ``multi_lpt`` (the default).

The ZeRO-1/2 layout section (``--json``: ``layout``) compares the owned layout of the chosen
planner with the mixed one (docs/zero.md): padding, balance, hosted matrices, per-step bytes,
and what ``layout: "auto"`` picks.

The DP plan covers the matrices of one TP rank (TP-local shards); the TP schedule covers
the TP-split matrices owned by the busiest DP rank of the default DP plan (see
``canzona_ds.planning.compare``).
"""
from __future__ import annotations

import argparse
import json
import sys

from canzona_ds.planning.compare import Comparison, compare
from canzona_ds.planning.cost import COST_MODELS
from canzona_ds.planning.dp import DEFAULT_BUCKET_NUMEL, DEFAULT_DP_PLANNER, DP_PLANNERS
from canzona_ds.planning.report import rank_costs
from canzona_ds.planning.tp import DEFAULT_TP_SCHEDULER, TP_SCHEDULERS

#: documented keys of every DP planner / TP scheduler entry in --json (each entry has more)
DP_KEYS = ("flops_ratio", "peak_flops_ratio", "memory_ratio", "padding_fraction", "split_matrices", "plan_ms")
TP_KEYS = ("flops_ratio", "memory_ratio", "micro_groups", "plan_ms")
#: --max-preconditioner-dim: the rule's field of that meaning
MAX_DIM_FIELD = {"shampoo": "max_preconditioner_dim", "soap": "max_precond_dim"}


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Text table: the first column left-aligned, the others right-aligned, every column as wide
    as its widest cell plus two spaces (a value never runs into its neighbour); short rows are
    padded with blanks."""
    rows = [r + [""] * (len(head) - len(r)) for r in rows]
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]
    return [row[0].ljust(widths[0]) + "".join(c.rjust(w + 2) for c, w in zip(row[1:], widths[1:])).rstrip()
            for row in (head, *rows)]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written; an option whose help does not state its default gets it appended."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required
                or action.default in (None, argparse.SUPPRESS, False)):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="canzona-plan", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--model", required=True, help="name in configs/models.yaml or path to an HF config.json")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size of a mixture-of-experts model (DeepSpeed MoE's ep_size; must divide "
                        "--dp and the number of experts): each EP rank holds E/ep experts of every stack, planned "
                        "over its expert-data-parallel group of dp/ep ranks, the dense matrices over all dp ranks; it sets "
                        "the 'Expert stacks' section (the DP planner tables plan every matrix over dp)")
    p.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"],
                   help="whose FLOPs and state the cost models count (with its usual hyper-parameters; see "
                        "--precondition-frequency)")
    p.add_argument("--precondition-frequency", type=int, default=None,
                   help="Shampoo/SOAP refresh period (amortises the eigendecompositions); default: the rule's")
    p.add_argument("--max-preconditioner-dim", type=int, default=None,
                   help="Shampoo: longest side of a preconditioned block (max_preconditioner_dim, default 1024: "
                        "blocked Shampoo, cost ~ numel); SOAP: sides longer than this are not rotated "
                        "(max_precond_dim, default 10000)")
    p.add_argument("--alpha", type=float, default=1.0, help="alpha of alpha_balanced, in [0, 1]")
    p.add_argument("--cost", default="numel", choices=list(COST_MODELS),
                   help="load the planners balance (default: numel, the paper's; the main job's optimizer balances "
                        "its cost_model, default flops: pass --cost flops to see its plan)")
    p.add_argument("--c-max", type=float, default=None, help="TP micro-group capacity in --cost units (default: largest task)")
    p.add_argument("--bucket-numel", type=int, default=DEFAULT_BUCKET_NUMEL,
                   help="bucket size (elements) of alpha_balanced and paper_naive; 0 = one bucket (default: DeepSpeed's "
                        "reduce_bucket_size)")
    p.add_argument("--dp-planner", default=DEFAULT_DP_PLANNER, choices=sorted(DP_PLANNERS), help="the plan the TP schedule starts from")
    p.add_argument("--tp-scheduler", default=DEFAULT_TP_SCHEDULER, choices=sorted(TP_SCHEDULERS),
                   help="the TP micro-group scheduler the summary leads with")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object (default: text tables)")
    p.add_argument("--plot", metavar="PNG", help="draw per-rank loads (paper Figure 3 style); needs matplotlib "
                                                 "(default: no plot)")
    return p


def rule_options(args: argparse.Namespace) -> dict:
    """The rule hyper-parameters the flags set (ValueError for a flag the rule lacks)."""
    hp: dict = {}
    if args.precondition_frequency is not None:
        if args.optimizer == "muon":
            raise ValueError("--precondition-frequency is a Shampoo/SOAP setting; Muon has no periodic refresh.")
        hp["precondition_frequency"] = args.precondition_frequency
    if args.max_preconditioner_dim is not None:
        if args.optimizer not in MAX_DIM_FIELD:
            raise ValueError("--max-preconditioner-dim is a Shampoo/SOAP setting; Muon has no preconditioner.")
        hp[MAX_DIM_FIELD[args.optimizer]] = args.max_preconditioner_dim
    return hp


def json_summary(summary: dict) -> dict:
    """The documented JSON shape: the required keys per planner plus the extra ones."""
    out = dict(summary)
    out["dp_planners"] = {n: {**{k: r[k] for k in DP_KEYS}, **r} for n, r in summary["dp_planners"].items()}
    out["tp_schedulers"] = {n: {**{k: r[k] for k in TP_KEYS}, **r} for n, r in summary["tp_schedulers"].items()}
    return out


def format_table(summary: dict) -> str:
    s = summary
    hp = {k: v for k, v in s.get("optimizer_config", {}).items()
          if k in ("ns_steps", "ns_method", "precondition_frequency", "max_preconditioner_dim", "max_precond_dim")}
    lines = [
        f"{s['model']}  dp={s['dp']} tp={s['tp']}  optimizer={s['optimizer']}"
        + (" (" + ", ".join(f"{k}={v}" for k, v in hp.items()) + ")" if hp else "")
        + f" cost={s['cost']} alpha={s['alpha']}",
        f"matrices per TP rank: {s['matrices']} ({s['matrix_numel']:,} elements)",
    ]
    if "note" in s:
        return "\n".join(lines + [s["note"]])
    lines += ["", f"DP planners (default: {s['default_dp_planner']})"]
    rows = [[name, f"{r['flops_ratio']:.3f}", f"{r['peak_flops_ratio']:.3f}", f"{r['memory_ratio']:.3f}",
             f"{r['padding_fraction']:.2%}", f"{r['split_matrices']:d}", f"{r['j_comm']:.3g}", f"{r['plan_ms']:.1f}"]
            for name, r in s["dp_planners"].items()]
    any_r = next(iter(s["dp_planners"].values()))
    rows.append(["lower bound", f"{any_r['flops_lower_bound']:.3f}", "", f"{any_r['memory_lower_bound']:.3f}"])
    lines += _table(["planner", "FLOPs max/avg", "peak max/avg", "mem max/avg", "padding", "split", "J_comm", "ms"],
                    rows)
    lines.append("(FLOPs: amortised over the refresh period; peak: the step that refreshes preconditioners)")
    if "layout" in s:
        lay = s["layout"]
        lines += ["", f"ZeRO-1/2 layout (layout \"auto\" picks {lay['auto']}: {lay['why']})"]
        lines += _table(["layout", "padding", "FLOPs max/avg", "mem max/avg", "hosted", "all-gather MiB", "a2a MiB max",
                         "a2a calls", "step MiB-eq."],
                        [[key, f"{r['padding_fraction']:.2%}", f"{r['flops_ratio']:.3f}", f"{r['memory_ratio']:.3f}",
                          f"{r['hosted_matrices']:d}", f"{r['all_gather_bytes'] / 2**20:,.1f}",
                          f"{r['hosted_sent_max'] / 2**20:,.1f}", f"{r['hosted_collectives']:d}",
                          f"{r['rank_cost'] / 2**20:,.1f}"] for key, r in ((k, lay[k]) for k in ("owned", "mixed"))])
        lines.append("(mixed: owned matrices whole in equal ZeRO chunks, the rest hosted over DP, docs/zero.md; "
                     "per step, busiest rank)")
        if "runtime_note" in lay:
            lines.append(f"note: {lay['runtime_note']}")
    if s["tp_schedulers"]:
        lines += ["", f"TP schedulers over the {next(iter(s['tp_schedulers'].values()))['tasks']} TP-split matrices of "
                  f"DP rank {s['tp_busiest_dp_rank']} (busiest; default: {s['default_tp_scheduler']})"]
        head = ["scheduler", "FLOPs max/avg", "mem max/avg", "serial", "groups", "ms"]

        def tp_rows(results: dict) -> list[list[str]]:
            return [[name, f"{r['flops_ratio']:.3f}", f"{r['memory_ratio']:.3f}", f"{r['serial_ratio']:.3f}",
                     f"{r['micro_groups']:d}", f"{r['plan_ms']:.1f}"] for name, r in results.items()]

        r = next(iter(s["tp_schedulers"].values()))
        lines += _table(head, tp_rows(s["tp_schedulers"]) + [["lower bound", f"{r['flops_lower_bound']:.3f}"]])
        lines += ["", "TP schedulers over all TP-split matrices of the model (one TP group, DP=1 view)"]
        lines += _table(head, tp_rows(s["tp_whole_model"]))
    elif "tp_note" in s:
        lines += ["", s["tp_note"]]
    if "expert_stacks" in s:
        x = s["expert_stacks"]
        lines += ["", f"Expert stacks: {x['stacks']} stacks of {x['experts_per_stack']} experts (largest "
                  f"{x['largest_stack_numel']:,} elements), {x['planner']}, ep={x['ep']}"
                  + (f" (experts over expert-DP groups of {x['expert_dp']} ranks, dense over {s['dp']}; "
                     f"max/avg over all {s['dp']} DP ranks)" if x["ep"] > 1 else "")]
        whole = "whole stack" if x["ep"] == 1 else f"stack of E/{x['ep']}"
        units = [("whole", whole), ("per_expert", f"per expert ({x['per_expert_planner']})"),
                 ("per_expert_mixed", "per expert, mixed"),  # layout "mixed" forced: hosted over each group's DP
                 ("joint", "joint (planner only)")]
        lines += _table(["ownership unit", "FLOPs max/avg", "mem max/avg", "padding", "bound"],
                        [[label, f"{x[u]['flops_ratio']:.3f}", f"{x[u]['memory_ratio']:.3f}",
                          f"{x[u]['padding_fraction']:.2%}", f"{x[u]['flops_lower_bound']:.3f}"]
                         for u, label in units if u in x])
        lines.append("(ZeRO-1/2 keeps a stack whole on one owner; DeepSpeed MoE's experts are separate matrices "
                     "(per expert): docs/zero.md, 'Mixture of experts'"
                     + ("; per expert, mixed: layout 'mixed' forced, each group's matrices that do not fit hosted "
                        "over its own DP group" if "per_expert_mixed" in x else "")
                     + ("; joint: per expert, the dense and expert partitions planned by lpt each seeded with the "
                        "other's per-rank loads, which the runtime does not do: it plans them separately)"
                        if "joint" in x else ")"))
    return "\n".join(lines)


def plot(result: Comparison, path: str, model) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.summary
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for name in dict.fromkeys(("paper_naive", "alpha_balanced", s["default_dp_planner"])):
        plan = result.dp_plans[name]
        loads = rank_costs(plan, "flops", model)
        mean = sum(loads) / len(loads)
        axes[0].plot(range(plan.world_size), [x / mean for x in loads], marker="o", ms=3, label=name)
    axes[0].set(title=f"DP: FLOPs per rank / mean ({s['model']}, dp={s['dp']})", xlabel="DP rank", ylabel="load / mean")
    axes[0].legend()
    if result.tp_plans:
        width = 0.8 / len(result.tp_plans)
        for k, (name, plan) in enumerate(result.tp_plans.items()):
            r = s["tp_schedulers"][name]
            mean = sum(plan.rank_load) / plan.tp_size or 1.0
            xs = [t + k * width for t in range(plan.tp_size)]
            axes[1].bar(xs, [x / mean for x in plan.rank_load], width, label=f"{name} ({r['flops_ratio']:.2f})")
        tp = s["tp"]
        axes[1].set_xticks([t + 0.4 - width / 2 for t in range(tp)], [str(t) for t in range(tp)])
        axes[1].set(title=f"TP: load per host / mean (tp={tp})", xlabel="TP rank", ylabel="load / mean")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'canzona-ds[plot]' (or pip install matplotlib)", file=sys.stderr)
            return 2
    from canzona_ds.optim import cost_model

    try:
        model = cost_model(args.optimizer, **rule_options(args))
        result = compare(
            args.model, args.dp, args.tp, cost_model=model, alpha=args.alpha, cost=args.cost,
            c_max=args.c_max, bucket_numel=args.bucket_numel or None,
            dp_planner=args.dp_planner, tp_scheduler=args.tp_scheduler, ep=args.ep,
        )
    except ValueError as e:
        print(f"canzona-plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_summary(result.summary)))
    else:
        print(format_table(result.summary))
    if args.plot:
        plot(result, args.plot, model)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

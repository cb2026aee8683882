"""Does DeepSpeed itself run MoE layers inside a PipelineModule?  A probe of DeepSpeed's own
``"AdamW"`` (no Canzona code in the step) on a tiny 2-stage ``PipelineModule`` with
``deepspeed.moe.layer.MoE`` layers (``canzona_testkit.moe.build_moe_pipe``: 4 experts,
ep_size 2), world 4 = PP 2 x DP 2, gloo, for each layout x ZeRO stage:

    one_stage    dense + MoE | head            (MoE in stage 0 only)
    every_stage  dense + MoE | MoE + head      (one MoE layer per stage, the same expert group)

in fp32 at ZeRO 0 and 1, and with ``bf16`` at ZeRO 0 (DeepSpeed's ``BF16_Optimizer`` wraps its
optimizer there; canzona-ds refuses bf16/fp16 at stage 0 for every model, and runs bf16 at ZeRO 1
through its ZeRO-1 path: tests/test_moe_pipeline.py).

Each case trains 3 ``train_batch`` steps (micro 2, gas 2) within ``--timeout`` seconds; a case
that does not finish is reported as deadlocked, with the innermost DeepSpeed frame each rank
was waiting in (``faulthandler`` dumps a few seconds before the timeout).

Run: ``python benchmarks/probe_moe_pipeline.py`` (~2 min on 2 cores) ->
``benchmarks/results/moe_pipeline_probe.json``.  canzona-ds runs the layouts DeepSpeed runs
(tests/test_moe_pipeline.py) and refuses the one it deadlocks on (integration/moe.py
``pipeline_refusal``, whose message states what this finds); re-run it on a new DeepSpeed version
before changing the refusal.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: canzona_ds and its test kit

from canzona_testkit.dist import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "moe_pipeline_probe.json"
LAYOUTS = {"one_stage": 1, "every_stage": 2}
CASES = {"fp32": (0, 1), "bf16": (0,)}  # precision -> ZeRO stages probed
STEPS = 3


def _worker(rank, world, moe_layers, stage, precision, dump_dir, dump_after):
    import faulthandler

    import deepspeed
    import torch

    from canzona_testkit.models import T, VOCAB
    from canzona_testkit.moe import build_moe_pipe

    dump = open(os.path.join(dump_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.dump_traceback_later(dump_after, exit=False, file=dump)
    module = build_moe_pipe(moe_layers, ep_size=2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           **({"bf16": {"enabled": True}} if precision == "bf16" else {})}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    g = torch.Generator().manual_seed(rank % 2)
    data = iter([(torch.randint(0, VOCAB, (2, T), generator=g), torch.randint(0, VOCAB, (2, T), generator=g))
                 for _ in range(2 * STEPS)])
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    faulthandler.cancel_dump_traceback_later()
    return {"losses": losses, "has_moe_layers": bool(engine.has_moe_layers),
            "optimizer": type(engine.optimizer).__name__}


def _waiting_in(path: str) -> str | None:
    """The two innermost DeepSpeed frames (outside deepspeed/comm) of a faulthandler dump (most
    recent call first), "file:function <- caller"."""
    if not os.path.exists(path):
        return None
    frames = []
    for line in open(path).read().splitlines():
        m = re.search(r'deepspeed/(?!comm/)(\S+\.py)", line (\d+) in (\w+)', line)
        if m:
            frames.append(f"deepspeed/{m.group(1)}:{m.group(3)}")
    return " <- ".join(frames[:2]) or None


def probe(timeout: float) -> list[dict]:
    out = []
    for precision, stages in CASES.items():
        for layout, moe_layers in LAYOUTS.items():
            for stage in stages:
                out.append(_case(layout, moe_layers, stage, precision, timeout))
    return out


def _case(layout: str, moe_layers: int, stage: int, precision: str, timeout: float) -> dict:
    row = {"layout": layout, "zero_stage": stage, "precision": precision, "world": 4, "pp": 2, "dp": 2,
           "ep_size": 2, "optimizer": "AdamW (DeepSpeed's)"}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            res = run_distributed(_worker, 4, moe_layers, stage, precision, tmp, max(timeout - 15, 5), timeout=timeout)
            row.update(outcome="ran", losses=res[-1]["losses"],
                       has_moe_layers=[r["has_moe_layers"] for r in res], engine_optimizer=res[0]["optimizer"])
        except RuntimeError as e:
            hung = "did not finish" in str(e)
            row.update(outcome="deadlocked" if hung else "failed",
                       waiting_in={r: _waiting_in(os.path.join(tmp, f"rank{r}.txt")) for r in range(4)},
                       error=str(e).splitlines()[-1][:300])
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as deadlocked")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import deepspeed
    import torch

    rows = probe(args.timeout)
    args.out.write_text(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                                    "command": "python benchmarks/probe_moe_pipeline.py", "cases": rows},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

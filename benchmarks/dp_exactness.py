"""How far DP runs are from the single-process optimizer, against plain data parallelism as the baseline.

    python benchmarks/dp_exactness.py          # -> benchmarks/results/dp_exactness.json (+ .md)

The main job's model (Qwen3-style decoder, ``tiny`` preset, fp32), 5 optimizer steps on
random byte windows (micro batch 2 per rank, seq 64), hyper-parameters of
``configs/ds_cpu_canzona.json``.  For DP = 2 and 4:

* **CanzonaMuon under ZeRO-1** (DeepSpeed, gloo) vs the single-process reference
  (``reference.ReferenceOptimizer``: the Muon rule on whole matrices + AdamW);
* **plain data parallelism driving ``torch.optim.Muon`` itself**: every rank all-reduces
  (sums) its gradients with gloo, divides by dp and steps ``torch.optim.Muon`` (matrices) +
  ``torch.optim.AdamW`` (the rest) on its full copy; vs the same torch optimizers in one process.

Both single-process runs take the DP average in rank order (``reference.zero_average``),
so a DP run differs from its reference only by how the all-reduce sums.  Reported: max |Δ|
over the matrices and over the other parameters after the last step.  torch's Muon runs
Newton–Schulz in bfloat16, so ulp-level differences in the summed gradient can move a matrix
by far more than an ulp: the plain-DP row is what the same optimizer does without Canzona.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "dp_exactness.json"
STEPS, MICRO, SEQ, SEED = 5, 2, 64, 1234
DS_CONFIG = ROOT / "configs" / "ds_cpu_canzona.json"


def _section() -> dict:
    return json.loads(DS_CONFIG.read_text())["optimizer"]


def _model():
    from canzona_ds.models.qwen3 import PRESETS, build_model

    return build_model(PRESETS["tiny"], SEED)


def _data(dp: int):
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, 256, (MICRO * dp, SEQ + 1), generator=g) for _ in range(STEPS)]


def _split(cfg, model):
    mats, rest = [], []
    for n, p in model.named_parameters():
        (mats if cfg.is_matrix(n, tuple(p.shape), getattr(p, "use_muon", None)) else rest).append((n, p))
    return mats, rest


def _torch_opts(cfg, model):
    mats, rest = _split(cfg, model)
    r = cfg.rule
    muon = torch.optim.Muon([p for _, p in mats], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=r.momentum,
                            nesterov=r.nesterov, ns_coefficients=r.ns_coefficients, eps=r.ns_eps, ns_steps=r.ns_steps,
                            adjust_lr_fn=r.adjust_lr_fn)
    adamw = torch.optim.AdamW([p for _, p in rest], lr=cfg.adam_lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                              weight_decay=cfg.weight_decay)
    return [muon, adamw]


def _rank_grads(model, batch, rank):
    model.zero_grad(set_to_none=True)
    rows = batch[rank * MICRO:(rank + 1) * MICRO]
    model(rows[:, :-1], rows[:, 1:])[1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _params(model) -> dict:
    """numpy copies: picklable between processes without shared memory"""
    return {n: p.detach().float().cpu().numpy().copy() for n, p in model.named_parameters()}


def single_process(dp: int, kind: str) -> dict:
    from canzona_ds.config import CanzonaConfig
    from canzona_ds.reference import ReferenceOptimizer, zero_average

    torch.set_num_threads(1)
    cfg = CanzonaConfig.from_ds("CanzonaMuon", dict(_section()["params"]))
    model = _model()
    opts = [ReferenceOptimizer(model.named_parameters(), cfg)] if kind == "canzona" else _torch_opts(cfg, model)
    for batch in _data(dp):
        avg = zero_average([_rank_grads(model, batch, r) for r in range(dp)])
        for n, p in model.named_parameters():
            p.grad = avg[n]
        for o in opts:
            o.step()
    return _params(model)


def _canzona_worker(rank, world):
    import canzona_ds  # noqa: F401 - registers the Canzona types
    import deepspeed

    model = _model()
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "train_batch_size": MICRO * world,
          "optimizer": _section(), "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
          "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    for batch in _data(world):
        rows = batch[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(rows[:, :-1], rows[:, 1:])[1])
        engine.step()
    out = _params(engine.module) if rank == 0 else None
    engine.destroy()
    return out


def _plain_dp_worker(rank, world):
    import torch.distributed as dist

    from canzona_ds.config import CanzonaConfig

    cfg = CanzonaConfig.from_ds("CanzonaMuon", dict(_section()["params"]))
    model = _model()
    opts = _torch_opts(cfg, model)
    for batch in _data(world):
        grads = _rank_grads(model, batch, rank)
        for n, p in model.named_parameters():
            g = grads[n]
            dist.all_reduce(g)  # gloo's sum
            p.grad = g / world
        for o in opts:
            o.step()
    return _params(model) if rank == 0 else None


def _diff(a: dict, b: dict, names: list[str]) -> float:
    return max(float(abs(a[n] - b[n]).max()) for n in names)


def main() -> int:
    from canzona_ds.config import CanzonaConfig
    from canzona_testkit.dist import run_distributed

    cfg = CanzonaConfig.from_ds("CanzonaMuon", dict(_section()["params"]))
    mats, rest = _split(cfg, _model())
    mat_names, rest_names = [n for n, _ in mats], [n for n, _ in rest]
    rows = []
    t0 = time.time()
    for dp in (2, 4):
        for kind, worker, label in (("canzona", _canzona_worker, "CanzonaMuon, ZeRO-1 (canzona-ds)"),
                                    ("torch", _plain_dp_worker, "torch.optim.Muon, plain DP all-reduce")):
            ref = single_process(dp, kind)
            got = run_distributed(worker, dp, timeout=900)[0]
            rows.append({"dp": dp, "run": label, "reference": "single process, same optimizer",
                         "max_abs_diff_matrices": _diff(got, ref, mat_names),
                         "max_abs_diff_other": _diff(got, ref, rest_names)})
            print(rows[-1], flush=True)
    data = {"command": "python benchmarks/dp_exactness.py", "steps": STEPS, "micro_batch": MICRO, "seq_len": SEQ,
            "model": "tiny", "dtype": "fp32", "ds_config": str(DS_CONFIG.relative_to(ROOT)), "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "seconds": round(time.time() - t0), "rows": rows}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tables

    OUT.with_suffix(".md").write_text(tables.render("dp_exactness") + "\n")
    print(f"wrote {OUT}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

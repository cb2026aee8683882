"""The main job on one GPU, launched by ``benchmarks/gpu/run.py`` through the DeepSpeed launcher::

    deepspeed --num_gpus 1 benchmarks/gpu/main_job.py --out R.json [--dry-run]

NCCL (dry run: gloo on CPU), ZeRO stage 1, DP=1, bf16, a Qwen3-shaped model (models/qwen3.py;
GPU: hidden 1024, 8 layers, 16 heads of 64, 8 KV heads, SwiGLU 3072, vocab 32768, sequence
1024, micro-batch 8; dry run: hidden 64, 2 layers, sequence 32).  Three engines, one per kind,
each on its own copy of the same initial model, in this one process, their iterations
interleaved (the order alternates every step) on the same batches:

    canzona   "CanzonaMuon" (lr 0.02, adam_lr 3e-4, weight decay 0.1, defaults otherwise)
    ds_muon   DeepSpeed's "Muon" with the same hyper-parameters (ns_method standard)
    adamw     DeepSpeed's "AdamW" (torch_adam)

Per kind, over the timed steps: median iteration ms (forward + backward + engine.step, each
ended by a device synchronize), median optimizer-step ms (engine.step alone: for DeepSpeed's
Muon at ZeRO-1 most of its Newton-Schulz runs inside backward, during gradient reduction, so its
step time understates its optimizer work; the iteration time is the comparable figure),
tokens/s (micro-batch x sequence / median iteration), peak GPU memory (max_memory_allocated
while that kind's iterations run; the other engines' resident memory included, and its increase
over the memory allocated before the iteration).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

KINDS = ("canzona", "ds_muon", "adamw")
MUON = dict(lr=0.02, adam_lr=3e-4, momentum=0.95, weight_decay=0.1)


def optimizer_section(kind: str) -> dict:
    if kind == "canzona":
        return {"type": "CanzonaMuon", "params": dict(MUON)}
    if kind == "ds_muon":
        return {"type": "Muon", "params": dict(lr=MUON["lr"], momentum=MUON["momentum"],
                                               weight_decay=MUON["weight_decay"], ns_method="standard")}
    return {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                        "torch_adam": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher passes it
    args = ap.parse_args()
    dry = args.dry_run

    import canzona_ds  # noqa: F401 - registers the Canzona optimizer types
    import deepspeed

    from canzona_ds.models.qwen3 import Qwen3Config, build_model

    deepspeed.init_distributed(dist_backend="gloo" if dry else "nccl")
    from canzona_ds.integration.runtime_info import release_shm_buffer

    torch.distributed.barrier()
    release_shm_buffer()  # the CPU (dry run) comm op's /dev/shm buffer: DeepSpeed never unlinks it
    if dry:
        torch.set_num_threads(1)
        cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=32, max_seq_len=32)
        device, micro, seq, warmup, steps = torch.device("cpu"), 2, 32, 1, 2
    else:
        cfg = Qwen3Config(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_layers=8, num_heads=16,
                          num_kv_heads=8, head_dim=64, max_seq_len=1024)
        device, micro, seq, warmup, steps = torch.device("cuda", 0), 8, 1024, 3, 10
        torch.cuda.set_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    engines = {}
    for kind in KINDS:
        ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                     "optimizer": optimizer_section(kind), "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        model = build_model(cfg, seed=0)
        engines[kind], *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g) for _ in range(warmup + steps)]
    rec = {k: {"iter": [], "opt": [], "peak": [], "peak_over_base": [], "loss": []} for k in KINDS}
    for t, batch in enumerate(data):
        x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
        for kind in (KINDS if t % 2 == 0 else KINDS[::-1]):
            engine = engines[kind]
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            sync()
            t1 = time.perf_counter()
            engine.step()
            sync()
            t2 = time.perf_counter()
            if t >= warmup:
                r = rec[kind]
                r["iter"].append(t2 - t0)
                r["opt"].append(t2 - t1)
                r["loss"].append(float(loss))
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device)
                    r["peak"].append(peak)
                    r["peak_over_base"].append(peak - base)
    out = {"model": cfg.to_dict(), "micro_batch": micro, "seq": seq, "warmup": warmup, "steps": steps,
           "zero_stage": 1, "dp": 1, "dtype": "bf16", "backend": "gloo" if dry else "nccl",
           "device": str(device) if dry else torch.cuda.get_device_name(device),
           "parameters": sum(p.numel() for p in build_model(cfg, seed=0).parameters()), "kinds": {}}
    for kind, r in rec.items():
        it = statistics.median(r["iter"])
        out["kinds"][kind] = {"iteration_ms": 1e3 * it, "optimizer_step_ms": 1e3 * statistics.median(r["opt"]),
                              "optimizer_step_share": statistics.median(r["opt"]) / it,
                              "tokens_per_s": micro * seq / it, "final_loss": r["loss"][-1],
                              "peak_mem_mib": max(r["peak"]) / 2 ** 20 if r["peak"] else None,
                              "peak_over_base_mib": max(r["peak_over_base"]) / 2 ** 20 if r["peak_over_base"] else None}
    c, d = out["kinds"]["canzona"], out["kinds"]["ds_muon"]
    out["canzona_over_ds_muon_iteration"] = c["iteration_ms"] / d["iteration_ms"]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

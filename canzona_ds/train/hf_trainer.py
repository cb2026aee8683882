"""Hugging Face ``transformers.Trainer`` example: the main job's model and corpus trained
by HF Trainer with DeepSpeed ZeRO-1 (or ZeRO-3) and ``"type": "CanzonaMuon"`` from a ds_config.

    pip install transformers accelerate          # ~25 s on the CI machine; not a dependency
    deepspeed --num_gpus 2 --module canzona_ds.train.hf_trainer --steps 20 --out runs/hf
    deepspeed --num_gpus 2 --module canzona_ds.train.hf_trainer --ds-config configs/ds_cpu_canzona_zero3.json

HF Trainer builds the engine itself (``deepspeed.initialize`` with the ds_config dict), so
the only canzona-specific line is the registration, ``canzona_ds.integration.install()``.  HF shards the
dataset over DP ranks with its own DistributedSampler; the dataset is a fixed set of
windows drawn from the shipped corpus with the run seed.  Writes ``<out>/log_history.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import canzona_ds  # noqa: F401 - registers "type": "CanzonaMuon" with DeepSpeed
from canzona_ds.data import BatchSampler, DataConfig
from canzona_ds.models.qwen3 import build_model, preset
from canzona_ds.train.trainer import load_ds_config, shutdown_distributed


class WindowDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, seed: int) -> None:
        self.x, self.y = BatchSampler(DataConfig(seq_len=seq_len, seed=seed)).global_batch(0, n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


class HFCausalLM(nn.Module):
    """HF Trainer reads ``outputs["loss"]``; our model returns a (logits, loss) tuple."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits, loss = self.model(input_ids, labels)
        return {"loss": loss, "logits": logits}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds-config", default="configs/ds_cpu_canzona.json")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/hf")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    from canzona_ds.integration import install
    from canzona_ds.integration.runtime_info import release_shm_buffer

    # explicit: transformers probes deepspeed with importlib.util.find_spec before importing
    # it, which consumes canzona_ds's one-shot import hook without running the registration
    install()
    torch.set_num_threads(1)
    ds = load_ds_config(args.ds_config)
    # HF requires these to agree with its own arguments; we state them once, here
    ds.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=1)
    ds.pop("train_batch_size", None)
    # HF checks optimizer params against its own arguments: take them from the ds_config
    opt = ds["optimizer"].get("params", {})
    hf_opt = {}
    if "betas" in opt:
        hf_opt.update(adam_beta1=float(opt["betas"][0]), adam_beta2=float(opt["betas"][1]))
    if "eps" in opt:
        hf_opt["adam_epsilon"] = float(opt["eps"])
    if "weight_decay" in opt:
        hf_opt["weight_decay"] = float(opt["weight_decay"])
    if "lr" in opt:
        hf_opt["learning_rate"] = float(opt["lr"])
    targs = TrainingArguments(**hf_opt,
        output_dir=args.out, per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=1,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
        max_grad_norm=float(ds.get("gradient_clipping", 0.0)), lr_scheduler_type="constant",
        deepspeed=ds, dataloader_drop_last=True, disable_tqdm=False, use_cpu=not torch.cuda.is_available(),
    )
    model = HFCausalLM(build_model(preset(args.model), args.seed))
    data = WindowDataset(args.micro_batch * 2 * args.steps * 4, args.seq_len, args.seed)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        engine_opt = type(getattr(trainer.model_wrapped, "optimizer", None)).__name__
        print(f"DeepSpeed optimizer: {engine_opt}; log: {Path(args.out) / 'log_history.json'}")
    release_shm_buffer()  # every rank is past init_distributed: DeepSpeed never unlinks it
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

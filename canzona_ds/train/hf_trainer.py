"""Hugging Face ``transformers.Trainer`` example: the main job's model and corpus trained
by HF Trainer with DeepSpeed ZeRO-1 (or ZeRO-3) and ``"type": "CanzonaMuon"`` from a ds_config.

    pip install transformers accelerate          # ~25 s on the CI machine; not a dependency
    deepspeed --num_gpus 2 --module canzona_ds.train.hf_trainer --steps 20 --out runs/hf
    deepspeed --num_gpus 2 --module canzona_ds.train.hf_trainer --ds-config configs/ds_cpu_canzona_zero3.json
    # resume the run above at another ZeRO stage and DP size (the checkpoint index loads any layout)
    deepspeed --num_gpus 1 --module canzona_ds.train.hf_trainer --steps 20 --micro-batch 16 --zero-stage 2 \
        --out runs/hf-resumed --resume runs/hf/checkpoint-10

HF Trainer builds the engine itself (``deepspeed.initialize`` with the ds_config dict), so
the only canzona-specific line is ``import canzona_ds`` (it registers the Canzona types with
DeepSpeed whenever DeepSpeed is imported, also through transformers' lazy import).  The run
uses a warm-up-then-cosine schedule (``--lr-scheduler``, ``--warmup-steps``; the Trainer's own,
which DeepSpeed saves with the checkpoint) and saves every ``--save-steps`` steps into
``<out>/checkpoint-<step>``; ``--resume`` continues one through
``trainer.train(resume_from_checkpoint=...)``, at any ZeRO stage and DP size.  HF shards the
dataset over DP ranks; the dataset is a fixed set of windows drawn from the shipped corpus with
the run seed, and one global batch is ``--micro-batch`` x ranks windows (keep its size when the
DP size changes; HF's sampler then deals other windows to the steps).  Writes ``<out>/log_history.json`` and ``<out>/group_lrs.json`` (the lr of every
optimizer param group at each step, as the step used it).  ``add_metrics_callback(trainer)``
(canzona_ds/integration/hf.py) adds the optimizer's step metrics to every training log.

``--model qwen3-moe-tiny``: a real transformers ``Qwen3MoeForCausalLM`` (2 layers, 8 experts
per layer stored as 3-D ``mlp.experts.*`` stacks, which the Canzona types update expert by
expert; the model's ``config.num_experts`` is checked against them)::

    deepspeed --num_gpus 2 --module canzona_ds.train.hf_trainer --model qwen3-moe-tiny \
        --ds-config configs/ds_cpu_soap.json --opt-params '{"precondition_frequency": 2}'

``--record``: every rank writes the batches its model saw (``inputs.rank<r>.pt``: input ids,
labels, HF's ``num_items_in_batch`` and the torch thread count per step; the Trainer resets the
latter) and rank 0 the initial and final weights
(``weights.pt``), so a single process can replay the run (tests/test_train_hf.py).
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


#: --model qwen3-moe-tiny: a transformers Qwen3MoeForCausalLM over the byte vocabulary
MOE_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def build_hf_moe(seed: int) -> nn.Module:
    """The tiny HF MoE model (fp32, eager attention), seeded."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE_TINY))
    model.config._attn_implementation = "eager"
    return model


class HFDataset(torch.utils.data.Dataset):
    """Windows for an HF causal LM: labels are the inputs (the model shifts them itself)."""

    def __init__(self, windows: WindowDataset) -> None:
        self.x = windows.x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Recorder:
    """Forward pre-hook: the training batches and loss kwargs a model sees (``--record``)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[dict] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if module.training:
            n = kwargs.get("num_items_in_batch")
            self.calls.append({"input_ids": kwargs["input_ids"].detach().clone(),
                               "labels": kwargs["labels"].detach().clone(),
                               "num_items_in_batch": None if n is None else torch.as_tensor(n).detach().clone(),
                               "threads": torch.get_num_threads()})


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
    ap.add_argument("--model", default="tiny", help="a preset of canzona_ds.models.qwen3, or qwen3-moe-tiny")
    ap.add_argument("--opt-params", default=None, help="JSON object merged into the ds_config's optimizer params")
    ap.add_argument("--record", action="store_true", help="write the batches and weights for a replay")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/hf")
    ap.add_argument("--lr-scheduler", default="cosine", help="TrainingArguments.lr_scheduler_type")
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--save-steps", type=int, default=10, help="0: no checkpoints")
    ap.add_argument("--zero-stage", type=int, default=None, help="override the ds_config's zero_optimization.stage")
    ap.add_argument("--resume", default=None, help="a checkpoint-<step> folder to continue")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from canzona_ds.integration.hf import add_metrics_callback
    from canzona_ds.integration.runtime_info import release_shm_buffer

    torch.set_num_threads(1)
    ds = load_ds_config(args.ds_config)
    if args.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.opt_params:
        ds["optimizer"].setdefault("params", {}).update(json.loads(args.opt_params))
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
    moe = args.model == "qwen3-moe-tiny"
    targs = TrainingArguments(**hf_opt,
        output_dir=args.out, per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=1,
        max_steps=args.steps, logging_steps=1, report_to=[], seed=args.seed,
        save_strategy="steps" if args.save_steps > 0 else "no", save_steps=max(args.save_steps, 1),
        max_grad_norm=float(ds.get("gradient_clipping", 0.0)), lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        deepspeed=ds, dataloader_drop_last=True, disable_tqdm=False, use_cpu=not torch.cuda.is_available(),
        # each rank's loss is its own tokens' mean (HF would otherwise rescale it by the token count
        # of all ranks), so the run is the plain DP average a single process can replay
        average_tokens_across_devices=False,
    )
    windows = WindowDataset(args.micro_batch * 2 * args.steps * 4, args.seq_len, args.seed)
    if moe:
        model, data = build_hf_moe(args.seed), HFDataset(windows)
    else:
        model, data = HFCausalLM(build_model(preset(args.model), args.seed)), windows
    recorder = Recorder(model) if args.record else None
    initial = {n: p.detach().clone() for n, p in model.named_parameters()} if args.record else None
    group_lrs: list = []

    class GroupLrs(TrainerCallback):
        """The lr of every optimizer param group as each step uses it (not the scheduler's report)."""

        def on_step_begin(self, targs, state, control, **kwargs):
            opt = getattr(trainer.model_wrapped, "optimizer", None)
            if opt is not None:
                group_lrs.append([state.global_step + 1, [float(g["lr"]) for g in opt.param_groups]])

    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[GroupLrs()])
    add_metrics_callback(trainer)  # optimizer.metrics() in every training log (log_history.json)
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.is_world_process_zero():
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        (Path(args.out) / "group_lrs.json").write_text(json.dumps(group_lrs))
        engine_opt = type(getattr(trainer.model_wrapped, "optimizer", None)).__name__
        print(f"DeepSpeed optimizer: {engine_opt}; log: {Path(args.out) / 'log_history.json'}")
    if recorder is not None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save(recorder.calls, Path(args.out) / f"inputs.rank{rank}.pt")
        if rank == 0:
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.save({"initial": initial, "final": final, "ds_config": ds}, Path(args.out) / "weights.pt")
    release_shm_buffer()  # every rank is past init_distributed: DeepSpeed never unlinks it
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

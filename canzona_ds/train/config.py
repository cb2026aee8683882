"""The run config of the main job (YAML), typed and strictly validated.

Every field is documented once, here.  Unknown keys, wrong types and a global batch the
data-parallel size cannot split are errors that name the bad key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from canzona_ds.models.qwen3 import PRESETS, Qwen3Config

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class RunConfig:
    """One training run.  Paths are relative to the current directory."""

    #: model preset name (see ``canzona_ds.models.qwen3.PRESETS``)
    model: str = "tiny"
    #: fields of ``Qwen3Config`` overriding the preset (e.g. ``{num_layers: 2}``)
    model_overrides: dict = field(default_factory=dict)
    #: corpus set ("austen", "pride_and_prejudice", "persuasion") or a text file path
    corpus: str = "austen"
    #: tokens per training sequence
    seq_len: int = 128
    #: sequences per rank per micro step (DeepSpeed ``train_micro_batch_size_per_gpu``)
    micro_batch: int = 8
    #: micro steps per optimizer step; null -> derived from ``global_batch``
    grad_accum: int | None = 1
    #: sequences per optimizer step over all ranks; null -> micro_batch * grad_accum * dp.
    #: When set it must be divisible by micro_batch * dp.
    global_batch: int | None = None
    #: optimizer steps to run (in total, counting steps before a resume)
    steps: int = 200
    #: seeds model init and data order (the same on every rank)
    seed: int = 1234
    #: learning-rate multiplier schedule applied on top of the ds_config learning rates
    lr_schedule: str = "cosine"
    #: linear warmup steps of the multiplier (0 -> none)
    warmup_steps: int = 10
    #: final multiplier of the cosine/linear decay
    min_lr_ratio: float = 0.1
    #: evaluate on held-out windows every N steps (0 -> only at the end)
    eval_every: int = 50
    #: held-out batches (of micro_batch windows) per evaluation
    eval_batches: int = 4
    #: DeepSpeed config JSON (its optimizer section picks Canzona* / Muon / AdamW)
    ds_config: str = "configs/ds_cpu_canzona.json"
    #: run output folder: metrics, plots, summary.  null -> a new folder per run,
    #: <runs_dir>/<config stem>-<optimizer>-<YYYYmmdd-HHMMSS>, with <runs_dir>/latest pointing at it
    #: (canzona_ds/train/rundir.py; --resume then continues the newest run of the same config and optimizer)
    log_dir: str | None = None
    #: where new per-run folders go (when log_dir is null)
    runs_dir: str = "runs"
    #: DeepSpeed checkpoint folder; null -> <log_dir>/checkpoints
    checkpoint_dir: str | None = None
    #: save a checkpoint every N steps (0 -> never; the last step is always saved when > 0)
    checkpoint_every: int = 50
    #: continue from the latest intact checkpoint in checkpoint_dir (same trajectory)
    resume: bool = False
    #: ds_configs run by ``--compare`` one after another (same seed and data)
    compare_ds_configs: list = field(default_factory=lambda: [
        "configs/ds_cpu_canzona.json", "configs/ds_cpu_muon.json", "configs/ds_cpu_adamw.json"])
    #: steps of the single-process exact Muon reference (torch.optim.Muon + AdamW) in --compare
    reference_steps: int = 5
    #: turn off torch.compile (DeepSpeed's built-in Muon compiles its update with inductor,
    #: which costs minutes per shape on CPU); numerics of the eager path are the same math
    disable_torch_compile: bool = True
    #: torch intra-op threads per rank (0 -> leave torch's default)
    threads_per_rank: int = 1
    #: pipeline-parallel stages (DeepSpeed PipelineModule + PipelineEngine over the decoder,
    #: canzona_ds/models/qwen3_pipe.py).  1 -> no pipeline.  Must divide the world size;
    #: data-parallel size = world / (pp * AutoTP degree).  pp > 1 needs ZeRO stage 0 or 1
    #: (DeepSpeed's PipelineEngine refuses 2 and 3), no AutoTP, and at most num_layers stages.
    pp: int = 1

    # --------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        hints = typing.get_type_hints(RunConfig)
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.model not in PRESETS:
            raise ValueError(f"Invalid model={self.model!r}. Allowed presets: {sorted(PRESETS)}")
        unknown = sorted(set(self.model_overrides) - set(Qwen3Config.field_names()))
        if unknown:
            raise ValueError(f"Unknown model_overrides key(s) {unknown}. Allowed: {list(Qwen3Config.field_names())}")
        for name in ("seq_len", "micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Invalid {name}={getattr(self, name)}. Must be >= 1.")
        for name in ("grad_accum", "global_batch"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"Invalid {name}={v}. Must be >= 1 or null.")
        if self.grad_accum is None and self.global_batch is None:
            raise ValueError("grad_accum and global_batch are both null: set at least one.")
        for name in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "reference_steps",
                     "threads_per_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)}. Must be >= 0.")
        if self.pp < 1:
            raise ValueError(f"Invalid pp={self.pp}. Must be an int >= 1 (pipeline stages).")
        layers = Qwen3Config(**{**PRESETS[self.model].to_dict(), **self.model_overrides}).num_layers
        if self.pp > layers:
            raise ValueError(f"Invalid pp={self.pp}: model {self.model!r} has num_layers={layers}; every pipeline "
                             f"stage needs a decoder layer (pp <= {layers}).")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"Invalid lr_schedule={self.lr_schedule!r}. Allowed: {list(LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"Invalid min_lr_ratio={self.min_lr_ratio}. Must be within [0, 1].")
        if not all(isinstance(p, str) for p in self.compare_ds_configs):
            raise TypeError(f"Invalid compare_ds_configs={self.compare_ds_configs!r}. Must be a list of paths.")
        max_len = Qwen3Config(**{**PRESETS[self.model].to_dict(), **self.model_overrides}).max_seq_len
        if self.seq_len > max_len:
            raise ValueError(f"Invalid seq_len={self.seq_len}: model {self.model!r} has max_seq_len={max_len}.")

    def model_config(self) -> Qwen3Config:
        return Qwen3Config(**{**PRESETS[self.model].to_dict(), **self.model_overrides})

    def batch_layout(self, dp: int) -> tuple[int, int]:
        """(grad_accum, global_batch) for ``dp`` data-parallel ranks; errors if they do not fit."""
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"Invalid data-parallel size dp={dp!r}. Must be an int >= 1.")
        per_micro = self.micro_batch * dp
        if self.global_batch is None:
            return self.grad_accum, self.grad_accum * per_micro
        if self.global_batch % per_micro:
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by micro_batch * dp = "
                f"{self.micro_batch} * {dp} = {per_micro}. Pick a global_batch that is a multiple of "
                f"{per_micro}, or change micro_batch / the number of ranks.")
        accum = self.global_batch // per_micro
        if self.grad_accum is not None and self.grad_accum != accum:
            raise ValueError(
                f"grad_accum={self.grad_accum} contradicts global_batch={self.global_batch} = micro_batch "
                f"{self.micro_batch} * dp {dp} * grad_accum {accum}. Set grad_accum: {accum} or null.")
        return accum, self.global_batch

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_type(name: str, value, hint) -> None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return
        hint = next(a for a in options if a is not type(None))
        origin = typing.get_origin(hint)
    expected = origin or hint
    ok = isinstance(value, expected) and not (isinstance(value, bool) and expected in (int, float))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise TypeError(f"Invalid type for {name}={value!r} ({type(value).__name__}). "
                        f"Must be {getattr(expected, '__name__', expected)}.")


def load_run_config(path: str | Path | None, overrides: dict | None = None,
                    overrides_from: str = "overrides") -> RunConfig:
    """Read a YAML run config (or defaults when ``path`` is None), apply ``overrides``.

    An unknown key is reported with where it came from: the YAML file, or ``overrides_from``
    (the CLI passes "the --set override(s)")."""
    data: dict = {}
    allowed = [f.name for f in fields(RunConfig)]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"Run config {str(path)!r} does not exist.")
        loaded = yaml.safe_load(path.read_text())
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise TypeError(f"Run config {str(path)!r} must be a YAML mapping, got {type(loaded).__name__}.")
        unknown = sorted(set(loaded) - set(allowed))
        if unknown:
            raise ValueError(f"Unknown run config key(s) {unknown} in {path}. Allowed: {allowed}")
        data.update(loaded)
    unknown = sorted(set(overrides or {}) - set(allowed))
    if unknown:
        raise ValueError(f"Unknown run config key(s) {unknown} in {overrides_from}. Allowed: {allowed}")
    data.update(overrides or {})
    return RunConfig(**data)


def parse_override(item: str) -> tuple[str, object]:
    """``key=value`` from the command line; the value is parsed as YAML (``steps=20``)."""
    if "=" not in item:
        raise ValueError(f"Invalid override {item!r}. Use key=value, e.g. steps=20.")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)

"""The main job: train the Qwen3-style decoder with DeepSpeed ZeRO-1 on the shipped corpus.

One call of :func:`train` is one run with one ds_config.  Per optimizer step:

    for micro_step in range(grad_accum):          batches: BatchSampler(seed) slice for
        loss = engine(x, y); engine.backward(loss)  (step, micro_step, rank) -- no loader state
        engine.step()                               DeepSpeed steps at the accumulation boundary
    all-reduce the loss (logging), drain the DeepSpeed timers, write metrics (rank 0)
    every checkpoint_every steps: checkpoint.save(tag=step<N>, client_state={step, base_lrs})

Checkpoints go through :mod:`canzona_ds.checkpoint`: written atomically with a manifest of
content digests.  Resume verifies the latest checkpoint and, if it is corrupt or incomplete,
falls back to the newest intact one (and says so); it continues at that checkpoint's step.
Because the data and the learning-rate multiplier are functions of the step alone, the
trajectory is the one an uninterrupted run takes.

Pipeline parallelism (run config ``pp`` > 1; ZeRO 0/1, no AutoTP): the model is
``Qwen3Pipe(num_stages=pp)`` (build_model's values, per stage), DeepSpeed builds a
PipelineEngine, and each optimizer step is one ``engine.train_batch(iterator)`` over this DP
replica's ``grad_accum`` micro-batches, the same slices ``sampler.micro_batch`` hands a pp=1
rank of that DP index (a step's global batch depends only on (seed, step, global_batch), so a
pp=2 run sees the global batches of a pp=1 run with the same global_batch).  The loss
is what train_batch returns (mean over micro-batches and DP, the same on every rank).
Evaluation goes through ``engine.eval_batch`` (:func:`evaluate_pipe`).  Every stage plans its
own matrices over its DP group; rank 0 (stage 0) gathers and prints every stage's summary.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from canzona_ds.ckpt import tag as checkpoint
from canzona_ds.data import BatchSampler, DataConfig
from canzona_ds.models.qwen3 import build_model
from canzona_ds.train.config import RunConfig
from canzona_ds.train.rundir import resolve_collective, saved_pipeline_stages
from canzona_ds.train.metrics import MetricsWriter, read_metrics, summarize_steps
from canzona_ds.train.plan_summary import format_plan, summarize
from canzona_ds.train.schedule import lr_multiplier
from canzona_ds.integration.runtime_info import TimerTap, canzona_optimizer, data_parallel_rank, realised_layout

#: ds_config keys the run config owns (set from it; a different value in the JSON is an error)
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


class OptimizerUnavailable(RuntimeError):
    """The ds_config names an optimizer type this installation cannot build."""


class ConfigError(ValueError):
    """DeepSpeed rejected the ds_config while building the engine (raised on every rank)."""


@dataclass
class RunResult:
    name: str
    optimizer_type: str
    log_dir: str
    metrics_path: str
    start_step: int
    summary: dict
    plan_summary: dict
    checkpoint_dir: str | None
    #: False when a resume found nothing left to train (no artifact was written)
    trained: bool = True


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def shutdown_distributed() -> None:
    """Destroy the process groups before the interpreter exits.

    Call on paths every rank takes together (a normal end, or an error all ranks agree on):
    left to interpreter finalisation, gloo's worker threads can outlive the Python objects
    they hold and the process aborts with "terminate called without an active exception"
    (exit 134/250) after a run that succeeded.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def load_ds_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"ds_config {str(path)!r} does not exist.")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"ds_config {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(ds.get("optimizer"), dict) or "type" not in ds["optimizer"]:
        raise ValueError(f"ds_config {str(path)!r} needs an 'optimizer': {{'type': ..., 'params': {{...}}}} section.")
    return ds


def check_optimizer_section(ds: dict, path: str | Path) -> None:
    """Validate the optimizer type (one DeepSpeed can build, else the valid ones and a "did you
    mean") and a Canzona type's params before any process group exists (the same checks
    DeepSpeed and the optimizer make later, but here every rank fails at once, naming the key)."""
    from canzona_ds.integration.config_check import check_optimizer_type
    from canzona_ds.optim import OPTIMIZER_TYPES
    from canzona_ds.config import CanzonaConfig

    check_optimizer_type(ds["optimizer"]["type"], f"ds_config {str(path)!r}")
    opt_type = str(ds["optimizer"]["type"])
    if opt_type in OPTIMIZER_TYPES:
        try:
            CanzonaConfig.from_ds(opt_type, dict(ds["optimizer"].get("params") or {}), ds.get("canzona_tp"))
        except (ValueError, TypeError) as e:
            raise type(e)(f"ds_config {str(path)!r}: optimizer {opt_type}: {e}") from None


def tensor_parallel_size(ds: dict) -> int:
    """AutoTP degree of a ds_config (1 when it has no ``tensor_parallel`` section)."""
    tp = (ds.get("tensor_parallel") or {}).get("autotp_size", 1) or 1
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"Invalid tensor_parallel.autotp_size={tp!r}. Must be an int >= 1.")
    return tp


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def data_parallel_size(ds_path: str | Path, world_size: int, pp: int = 1) -> int:
    """Data-parallel ranks of a run: world size / (pipeline stages * AutoTP degree).  pp > 1
    is refused with AutoTP and with ZeRO stage >= 2 (DeepSpeed's PipelineEngine allows 0 and 1)."""
    ds = load_ds_config(ds_path)
    tp = tensor_parallel_size(ds)
    if pp > 1:
        if tp > 1:
            raise ValueError(f"pp={pp} with tensor_parallel.autotp_size={tp} in {str(ds_path)!r}: the pipeline "
                             "does not combine with AutoTP in the main job. Use pp=1 or a ds_config without "
                             "tensor_parallel.")
        if zero_stage(ds) >= 2:
            raise ValueError(f"pp={pp} with zero_optimization.stage={zero_stage(ds)} in {str(ds_path)!r}: DeepSpeed's "
                             "PipelineEngine allows ZeRO stage 0 or 1 only.")
        if world_size % pp:
            raise ValueError(f"pp={pp} does not divide the world size {world_size}. Use a number of ranks that "
                             f"is a multiple of {pp}.")
        return world_size // pp
    if world_size % tp:
        raise ValueError(f"world size {world_size} is not divisible by tensor_parallel.autotp_size={tp} "
                         f"in {str(ds_path)!r}.")
    return world_size // tp


def build_ds_config(cfg: RunConfig, ds_path: str | Path, dp: int) -> dict:
    """The ds_config JSON with the batch layout of the run config filled in (``dp`` = data-
    parallel ranks, i.e. world size / AutoTP degree)."""
    ds = load_ds_config(ds_path)
    accum, global_batch = cfg.batch_layout(dp)
    for key, value in zip(BATCH_KEYS, (cfg.micro_batch, accum, global_batch)):
        if key == "train_batch_size" and tensor_parallel_size(ds) > 1:
            # DeepSpeed checks train_batch_size against the *world* size when AutoTP runs
            # without an mpu; micro batch + accumulation determine the step on their own
            continue
        if key in ds and ds[key] != value:
            raise ValueError(f"ds_config {str(ds_path)!r} sets {key}={ds[key]} but the run config gives {value} "
                             f"(micro_batch={cfg.micro_batch}, grad_accum={accum}, dp={dp}). Remove {key} from "
                             "the ds_config: the run config owns the batch layout.")
        ds[key] = value
    # timers are captured by TimerTap (not printed); they drive the step-time breakdown.  Not
    # under pp > 1: DeepSpeed 0.19.8's PipelineEngine with wall_clock_breakdown starts
    # "bwd_microstep" twice (its own backward, then DeepSpeedEngine's) and fails its assert
    ds["wall_clock_breakdown"] = cfg.pp == 1
    ds.setdefault("steps_per_print", 10**9)
    return ds


def _initialize(model, ds: dict, ds_path: str = "the ds_config"):
    """deepspeed.initialize, by strategy:

    * ds_config optimizer section (Canzona* / Muon / AdamW) built by DeepSpeed (ZeRO);
    * AutoTP + a Canzona type at ZeRO stage 1/2: also from ds_config; DeepSpeed sets
      ``engine.mpu`` to its AutoTP groups, so the optimizer's TP hosting runs TP-ASC;
    * AutoTP + a Canzona type at stage 0: DeepSpeed shards the Linears inside ``initialize``,
      so the stage-0 optimizer (``integration.megatron.build_tp_optimizer``) is passed as a
      client-optimizer *factory* that runs after sharding and sees the shards.
    """
    import deepspeed

    try:
        if tensor_parallel_size(ds) > 1 and str(ds["optimizer"]["type"]).startswith("Canzona") and zero_stage(ds) == 0:
            from canzona_ds.integration.megatron import build_tp_optimizer

            client = {k: v for k, v in ds.items() if k != "optimizer"}
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=lambda _params: build_tp_optimizer(model, ds),
                                                   config=client)
            return engine
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                              if p.requires_grad], config=ds)
    except AssertionError as e:  # DeepSpeed reports unknown optimizer types with an assert
        if "not a supported DeepSpeed Optimizer" in str(e):
            raise OptimizerUnavailable(
                f"optimizer type {ds['optimizer']['type']!r} is not available: {e}. The Canzona types need the "
                "canzona_ds DeepSpeed integration (import canzona_ds registers them); use configs/ds_cpu_muon.json "
                "(DeepSpeed's built-in Muon) meanwhile.") from None
        raise
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError: a bad ds_config key
        raise ConfigError(f"DeepSpeed rejected {ds_path}: {e}") from None
    return engine


def _global_mean(value: float, count: int, device: torch.device) -> float:
    # (on the engine's device: NCCL reduces device tensors only)
    t = torch.tensor([value, float(count)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t[0] / t[1]) if t[1] else float("nan")


@torch.no_grad()
def evaluate(engine, sampler: BatchSampler, n_batches: int, batch: int, rank: int, dp: int) -> float | None:
    """Mean held-out loss; batch i is computed by DP rank i % dp (every rank joins the
    all-reduce, so with AutoTP each batch is counted tp times on both sides of the mean)."""
    batches = sampler.val_batches(n_batches, batch)
    if not batches:
        return None
    module = engine.module
    was_training = module.training
    module.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(batches):
        if i % dp == rank:
            total += float(module(x.to(engine.device), y.to(engine.device))[1])
            count += 1
    module.train(was_training)
    return _global_mean(total, count, engine.device)


@torch.no_grad()
def evaluate_pipe(engine, sampler: BatchSampler, n_batches: int, batch: int, rank: int, dp: int) -> float | None:
    """:func:`evaluate` on a PipelineEngine: DP replica ``rank`` runs batches ``rank, rank + dp,
    ...`` through ``engine.eval_batch`` (one call per replica: eval_batch holds a world barrier),
    the last stage keeps each batch's loss, and the mean is over all batches (other stages add 0).
    A replica with no batch of its own (eval_batches < dp) runs batch 0 and counts nothing."""
    batches = sampler.val_batches(n_batches, batch)
    if not batches:
        return None
    mine = batches[rank::dp]
    counted = bool(mine)
    mine = mine or batches[:1]
    was_training = engine.module.training
    losses = engine.eval_batch(iter(mine), reduce_output=None, bcast_loss=False, num_micro_batches=len(mine))
    engine.module.train(was_training)
    total, count = 0.0, 0
    if engine.is_last_stage() and counted:
        total, count = sum(float(loss) for loss in losses), len(losses)
    return _global_mean(total, count, engine.device)


def stage_plans(engine, plan: dict) -> tuple[list[dict], int]:
    """Every pipeline stage's plan summary in stage order, on every rank (a stage's ranks know
    only their own plan; gathered with all_gather_object), with the stage's ranks and its
    matrices by build_model's names; and the model's parameter count (tied weight once)."""
    grid, module = engine.grid, engine.module
    names = module.canonical_names()
    mine = {"stage": grid.get_stage_id(), "rank": dist.get_rank(),
            "plan": plan | {"matrices": [names.get(n, n) for n in plan.get("matrices", [])]},
            "numel": {names[n]: p.numel() for n, p in module.named_parameters()}}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    stages: dict[int, dict] = {}
    params: dict[str, int] = {}
    for item in every:
        stages.setdefault(item["stage"], {"stage": item["stage"], "ranks": [], **item["plan"]})["ranks"].append(
            item["rank"])
        params.update(item["numel"])
    return [stages[s] for s in sorted(stages)], sum(params.values())


def train(cfg: RunConfig, name: str | None = None, progress: bool = True) -> RunResult:
    """One run of the main job in the current process group (all ranks call it)."""
    from tqdm.auto import tqdm

    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = data_parallel_size(cfg.ds_config, world, cfg.pp)
    accum, global_batch = cfg.batch_layout(dp)
    pipe = cfg.pp > 1
    ds = build_ds_config(cfg, cfg.ds_config, dp)
    opt_type = str(ds["optimizer"]["type"])
    name = name or opt_type
    if cfg.log_dir is None or cfg.checkpoint_dir is None:  # called without the CLI's resolution
        cfg = resolve_collective(cfg, None, opt_type, cfg.resume)
    log_dir = Path(cfg.log_dir)

    if pipe:
        import deepspeed

        from canzona_ds.models.qwen3_pipe import Qwen3Pipe

        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # no-op when the CLI did it
        model = Qwen3Pipe(cfg.model_config(), cfg.seed, num_stages=cfg.pp)  # build_model's values, per stage
    else:
        model = build_model(cfg.model_config(), cfg.seed)
    engine = _initialize(model, ds, str(cfg.ds_config))
    # the data shard follows the DP rank; AutoTP ranks of one DP group and the stages of one
    # pipeline read the same batch
    rank = data_parallel_rank(engine) if dp < world else (dist.get_rank() if dist.is_initialized() else 0)
    tap = TimerTap(engine)
    plan = summarize(engine.module, dp, canzona_optimizer(engine), realised_layout(engine)).to_dict()
    n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())  # ZeRO-3: whole
    if pipe:  # one plan per stage, each over its own DP group; rank 0 (stage 0) gets them all
        stages, n_params = stage_plans(engine, plan)
        plan = {"pipeline_stages": cfg.pp, "world_size": dp, "rule": plan["rule"],
                "plan_source": plan["plan_source"], "stages": stages}

    base_lrs = [float(g["lr"]) for g in engine.optimizer.param_groups]
    start_step = 0
    if cfg.resume:
        # verified load; a corrupt/incomplete newest checkpoint falls back to the newest intact one
        res = checkpoint.load(engine, cfg.checkpoint_dir, fallback=True, loader=_loader_for(opt_type, cfg.pp, world))
        if is_rank0():
            for tag, reason in res.skipped:
                print(f"[{name}] checkpoint {tag} is corrupt or incomplete ({reason}); skipped", flush=True)
            if res.note and res.path is not None:
                print(f"[{name}] {res.note}", flush=True)
        if res.path is None:
            if is_rank0():
                print(f"[{name}] resume: no checkpoint in {cfg.checkpoint_dir!r} ({res.note}); starting at step 0",
                      flush=True)
        else:
            start_step = int(res.client_state["step"])
            base_lrs = [float(x) for x in res.client_state["base_lrs"]]
            if is_rank0():
                how = f" (newest intact checkpoint; skipped {[t for t, _ in res.skipped]})" if res.skipped else ""
                print(f"[{name}] resumed from {res.tag}{how}: {res.path} at step {start_step}", flush=True)
        if start_step >= cfg.steps:
            # nothing to train: say so, and leave metrics, plots, summary and checkpoints as they are
            if is_rank0():
                print(f"[{name}] nothing to do: the checkpoint {res.tag} in {cfg.checkpoint_dir} is at step "
                      f"{start_step} and steps={cfg.steps}; the run's files in {log_dir} are left as they are "
                      f"(to train further, raise steps, e.g. --set steps={start_step + cfg.steps})", flush=True)
            if dist.is_initialized():
                dist.barrier()
            if hasattr(engine, "destroy"):
                engine.destroy()
            return RunResult(name=name, optimizer_type=opt_type, log_dir=str(log_dir),
                             metrics_path=str(log_dir / "metrics.jsonl"), start_step=start_step, summary={},
                             plan_summary=plan, checkpoint_dir=cfg.checkpoint_dir, trained=False)

    sampler = BatchSampler(DataConfig(corpus=cfg.corpus, seq_len=cfg.seq_len, seed=cfg.seed))
    writer = MetricsWriter(log_dir, start_step) if is_rank0() else None
    if is_rank0():
        (log_dir / "plan_summary.json").write_text(json.dumps(plan, indent=1))
        (log_dir / "run_config.json").write_text(json.dumps(cfg.to_dict() | {"dp": dp, "grad_accum": accum,
                                                                               "global_batch": global_batch}, indent=1))
        pp_note = f"pp={cfg.pp} " if pipe else ""
        print(f"[{name}] model={cfg.model} params={n_params:,} {pp_note}dp={dp} micro_batch={cfg.micro_batch} "
              f"grad_accum={accum} global_batch={global_batch} seq_len={cfg.seq_len} "
              f"optimizer={opt_type} ds_config={cfg.ds_config}", flush=True)
        if canzona_optimizer(engine) is not None or opt_type.lower() == "muon":
            for line in format_plan(plan):
                print(f"[{name}] {line}", flush=True)
        else:  # the plan summary costs matrices with Muon's rule: it belongs to matrix optimizers only
            print(f"[{name}] {opt_type}: element-wise, no matrix partition plan (DeepSpeed's equal chunks)",
                  flush=True)
        if pipe or not tap.attached:
            why = " (pp > 1: DeepSpeed's PipelineEngine cannot run wall_clock_breakdown)" if pipe else ""
            print(f"[{name}] DeepSpeed timers unavailable{why}: step-time breakdown will show n/a", flush=True)

    tokens_per_step = global_batch * cfg.seq_len
    bar = tqdm(total=cfg.steps, initial=start_step, desc=name, disable=not (progress and is_rank0()),
               dynamic_ncols=True)
    engine.train()
    for step in range(start_step, cfg.steps):
        mult = lr_multiplier(step, cfg.steps, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr_ratio)
        for group, base in zip(engine.optimizer.param_groups, base_lrs):
            group["lr"] = base * mult
        t0 = time.perf_counter()
        if pipe:
            # this DP replica's accum micro-batches of the step, exactly those a pp=1 rank of the
            # same DP index reads; the first stage pulls the inputs, the last the labels
            data = iter([sampler.micro_batch(step, micro, rank, dp, cfg.micro_batch, accum) for micro in range(accum)])
            loss_mean = float(engine.train_batch(data))  # mean over micro-batches and DP, on every rank
            step_ms = (time.perf_counter() - t0) * 1e3
        else:
            loss_sum = 0.0
            for micro in range(accum):
                x, y = sampler.micro_batch(step, micro, rank, dp, cfg.micro_batch, accum)
                _, loss = engine(x.to(engine.device), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                loss_sum += float(loss.detach())
            step_ms = (time.perf_counter() - t0) * 1e3
            loss_mean = _global_mean(loss_sum, accum, engine.device)
        times = tap.drain()
        times.update(optimizer_metrics(engine))
        done = step + 1
        val = None
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            val = (evaluate_pipe if pipe else evaluate)(engine, sampler, cfg.eval_batches, cfg.micro_batch, rank, dp)
        if is_rank0():
            row = {"step": done, "loss": loss_mean, "val_loss": val, "lr_mult": mult,
                   "tokens": done * tokens_per_step, "step_ms": step_ms,
                   "tokens_per_s": tokens_per_step / (step_ms / 1e3), **times}
            writer.write(row)
            bar.set_postfix_str(_postfix(row), refresh=False)
            bar.update(1)
            if val is not None:
                bar.write(f"[{name}] step {done}: loss {loss_mean:.4f} val {val:.4f}")
        if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpoint.save(engine, cfg.checkpoint_dir, f"step{done}",
                            client_state={"step": done, "base_lrs": base_lrs})
    bar.close()

    summary = {}
    if is_rank0():
        writer.write_csv()
        summary = summarize_steps(read_metrics(writer.path))
        (log_dir / "summary.json").write_text(json.dumps({"name": name, "optimizer": opt_type, **summary}, indent=1))
    if dist.is_initialized():
        dist.barrier()
    if hasattr(engine, "destroy"):  # frees DeepSpeed's groups/hooks before a --compare run builds the next engine
        engine.destroy()
    return RunResult(name=name, optimizer_type=opt_type, log_dir=str(log_dir),
                     metrics_path=str(log_dir / "metrics.jsonl"), start_step=start_step, summary=summary,
                     plan_summary=plan, checkpoint_dir=cfg.checkpoint_dir if cfg.checkpoint_every else None)


def saved_optimizer_type(ckpt_dir: str | Path) -> str | None:
    """The optimizer type in the ds_config DeepSpeed stores in a checkpoint's model states
    (memory-mapped: the tensors are not read); None when unreadable (a file that holds anything
    but data raises the loader's UnsafeCheckpointError naming it)."""
    # mp_rank_* first: a pipeline checkpoint also holds layer_*-model_states.pt (weights only)
    files = sorted(Path(ckpt_dir).glob("mp_rank_*model_states.pt")) or sorted(Path(ckpt_dir).glob("*model_states.pt"))
    if not files:
        return None
    from canzona_ds.ckpt.safe_load import UnsafeCheckpointError
    from canzona_ds.ckpt.tag import member
    from canzona_ds.integration.ckpt.safe import read

    try:
        states = read(member(str(ckpt_dir), files[0].name, "the tag directory"), mmap=True)
        return str(states["ds_config"]["optimizer"]["type"])
    except UnsafeCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - not knowable: DeepSpeed's own load decides
        return None


def _loader_for(opt_type: str, pp: int = 1, world: int | None = None):
    """``checkpoint.load``'s loader: DeepSpeed's load, but a checkpoint written with another
    optimizer type, or (DeepSpeed's own optimizers) with another number of pipeline stages (or,
    under a pipeline, another world size), is refused first, as a checkpoint error (every rank reads the same files, so
    every rank refuses; nothing is loaded)."""
    def load(engine, load_dir, tag, manifest, **kw):
        path = os.path.join(load_dir, tag)
        saved_pp = saved_pipeline_stages(path)
        saved_world = (manifest or {}).get("world_size") if isinstance(manifest, dict) else None
        # (a Canzona checkpoint resumes at any pp and world size: the checkpoint index,
        # integration/ckpt/; DeepSpeed's own optimizers' pipeline checkpoints do not)
        if not opt_type.startswith("Canzona") and (
                saved_pp != pp or (pp > 1 and world is not None and saved_world not in (None, world))):
            raise checkpoint.CheckpointError(
                f"checkpoint {path} was written with pp={saved_pp} on {saved_world} ranks; this run has pp={pp} on "
                f"{world} ranks. A pipeline checkpoint resumes only at the same pp and world size.", path)
        saved = saved_optimizer_type(path)
        if saved is not None and saved != opt_type:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} was written by a {saved} run; this run uses {opt_type}. Resume with the "
                "ds_config it was written with, or start a new run (another log_dir).", path)
        return engine.load_checkpoint(load_dir, tag=tag, **kw)
    return load


def optimizer_metrics(engine) -> dict:
    """The step's optimizer metrics as metrics.jsonl columns: what ``optimizer.metrics()``
    recorded on this rank (canzona_ds/step_metrics.py; the source DeepSpeed's monitors read),
    each as ``canzona_<name>``, and, with qk_clip on, QK-clip's figures for the whole model as
    ``qk_max_logit`` / ``qk_clipped_heads``.  None of them without a Canzona optimizer or with
    ``canzona_metrics.enabled`` false."""
    from canzona_ds.integration.runtime_info import canzona_optimizer

    opt = canzona_optimizer(engine)
    m = opt.metrics() if opt is not None else None
    if m is None:
        return {}
    out = {f"canzona_{k}": v for k, v in m.scalars().items()}
    if opt.qk_clip is not None:
        out.update(_whole_model_qk(engine, opt, m))
    return out


def _whole_model_qk(engine, opt, m) -> dict:
    """QK-clip's largest logit and clipped heads over every layer and head of the global batch:
    each pipeline stage knows its own layers, each TP rank its own heads (every rank calls;
    logging, not the clip, which needs no TP collective).  A step that recorded none (skipped,
    or a stage without matrices) adds -inf / 0."""
    max_logit = m.qk_max_logit if m.qk_max_logit is not None else float("-inf")
    clipped = m.qk_clipped_heads or 0
    for size, group in ((opt.groups.tp_size, opt.groups.tp_group), (opt.groups.pp_size, opt.groups.pp_group)):
        if size > 1:
            # (on the engine's device: NCCL reduces device tensors only)
            t = torch.tensor([max_logit], dtype=torch.float64, device=engine.device)
            n = torch.tensor([float(clipped)], dtype=torch.float64, device=engine.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(n, group=group)
            max_logit, clipped = float(t[0]), int(n[0])
    if max_logit == float("-inf"):  # a skipped step: nothing recorded anywhere
        return {}
    return {"qk_max_logit": max_logit, "qk_clipped_heads": clipped}


def _postfix(row: dict) -> str:
    def ms(key: str) -> str:
        return "n/a" if row.get(key) is None else f"{row[key]:.0f}"
    return (f"loss={row['loss']:.4f} tok/s={row['tokens_per_s']:.0f} ms: fb={ms('fwd_bwd_ms')} "
            f"red={ms('grad_reduce_ms')} opt={ms('optimizer_ms')} ag={ms('allgather_ms')}")


def setup_process(cfg: RunConfig) -> None:
    """Per-process settings that must precede building the engine."""
    if cfg.threads_per_rank:
        torch.set_num_threads(cfg.threads_per_rank)
    if cfg.disable_torch_compile:
        import torch._dynamo as dynamo

        dynamo.config.disable = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

"""The lr schedule across a resume, for the schedulers the scenario table
(tests/test_ckpt_resume.py, torch's LambdaLR in every row) does not run: Megatron's
``OptimizerParamScheduler`` through the hook's scheduler target, and DeepSpeed's own
``WarmupCosineLR`` / ``OneCycle`` from the ds_config.

Each case runs in one process (DP 1): train, save, then resume into a fresh engine at the same
ZeRO stage (DeepSpeed's stock load, which replaces the optimizer's param-group dicts) and at
another one (the checkpoint index's loop), and compare every resumed step's group
hyper-parameters and the weights with the uninterrupted run, bit for bit (the same operations
on the same inputs at DP 1).

Cost: 3 rank runs; 1 s on a 2-core AMD EPYC (docs/ci.md)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from canzona_testkit.dist import run_distributed
from canzona_testkit.kernels import assert_bits
from canzona_testkit.megatron_real import start_lines

pytestmark = pytest.mark.dist

STEPS, SAVE_AT = 5, 2


class MegatronShapedScheduler:
    """The contract of Megatron-DeepSpeed's ``OptimizerParamScheduler`` (megatron/
    optimizer_param_scheduler.py), written here: ``step(increment)`` adds to ``num_steps`` and
    sets every group's ``lr = lr(num_steps) * lr_mult`` and ``weight_decay = wd * wd_mult``;
    ``load_state_dict`` calls ``step(increment=saved num_steps)`` on top of its own count (so
    loading twice doubles it); linear warm-up, then cosine decay."""

    def __init__(self, optimizer, max_lr=0.02, min_lr=0.002, warmup=2, decay=6, wd=0.1):
        self.optimizer, self.max_lr, self.min_lr, self.warmup, self.decay, self.wd = \
            optimizer, max_lr, min_lr, warmup, decay, wd
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        if self.num_steps <= self.warmup:
            return self.max_lr * self.num_steps / self.warmup
        ratio = min(1.0, (self.num_steps - self.warmup) / (self.decay - self.warmup))
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
            g["weight_decay"] = self.wd * g.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr}

    def load_state_dict(self, sd: dict) -> None:
        self.step(increment=sd["num_steps"])


#: ds_config scheduler sections (DeepSpeed's own schedulers, built from the ds_config)
DS_SCHEDULERS = {
    "WarmupCosineLR": {"type": "WarmupCosineLR", "params": {"total_num_steps": STEPS + 1, "warmup_num_steps": 2}},
    "OneCycle": {"type": "OneCycle", "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 2,
                                                "cycle_momentum": True, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}},
}
KEYS = ("lr", "weight_decay", "betas", "momentum")


def _engine(stage: int, kind: str):
    import deepspeed

    import canzona_ds  # noqa: F401
    from canzona_ds.integration.megatron import _retarget_scheduler
    from canzona_testkit.models import ds_config, make_model

    cfg = ds_config(1, stage=stage)
    kw = {}
    if kind == "megatron":  # the hook's route: Megatron's scheduler re-targeted at the built optimizer
        kw["lr_scheduler"] = _retarget_scheduler(MegatronShapedScheduler(_Placeholder()))
    else:
        cfg["scheduler"] = DS_SCHEDULERS[kind]
    model = make_model(0)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)[0]


class _Placeholder:  # what Megatron builds its scheduler against before DeepSpeed builds the optimizer
    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _groups(engine) -> list:
    from canzona_ds.integration.runtime_info import canzona_optimizer

    return [{k: g[k] for k in KEYS if k in g} for g in canzona_optimizer(engine).param_groups]


def _run(engine, batches, kind) -> list:
    """Train on ``batches``; the groups' hyper-parameters each step ran with."""
    seen = []
    for x, y in batches:
        seen.append(_groups(engine))
        engine.backward(engine(x, y))
        # (Megatron-DeepSpeed's train_step: the engine steps its scheduler with these arguments)
        engine.step(lr_kwargs={"increment": 1} if kind == "megatron" else None)
    return seen


def _worker(rank, world, kind, ckpt):
    import contextlib
    import io

    import torch

    from canzona_testkit.models import batches, params_of

    torch.set_num_threads(1)
    data = batches(STEPS, 2, seed=3)
    with contextlib.redirect_stdout(io.StringIO()) as text:  # (the start-up line is printed on rank 0)
        whole = _engine(1, kind)
    seen = _run(whole, data[:SAVE_AT], kind)
    whole.save_checkpoint(ckpt, tag="saved")
    seen += _run(whole, data[SAVE_AT:], kind)
    out = {"uninterrupted": (seen, params_of(whole.module)), "startup": text.getvalue()}
    for stage in (1, 2):  # ZeRO 1 -> 1: DeepSpeed's stock load; 1 -> 2: the index loop
        engine = _engine(stage, kind)
        engine.load_checkpoint(ckpt, tag="saved")
        steps = getattr(engine.lr_scheduler, "num_steps", None)
        out[stage] = (_run(engine, data[SAVE_AT:], kind), params_of(engine.module), steps)
    return out


@pytest.mark.parametrize("kind", ["megatron", *DS_SCHEDULERS])
def test_schedule_continues_after_resume(tmp_path, kind):
    """Megatron's scheduler (through the hook's target, which reads the optimizer's live groups:
    DeepSpeed's load replaces the group dicts) and DeepSpeed's WarmupCosineLR and OneCycle (whose
    loads restore their counters only): after a resume at
    the same ZeRO stage and at another one, every step runs with the uninterrupted run's group
    hyper-parameters and ends at its weights, bit for bit; Megatron's scheduler is loaded once
    (its num_steps is the saved one, not twice it)."""
    (res,) = run_distributed(_worker, 1, kind, str(tmp_path / "ckpt"))
    # plain deepspeed.initialize (and the Megatron hook's route): the one start-up line, printed
    # where logging shows no INFO record (the default)
    lines = start_lines(res["startup"])  # (the reader benchmarks/bench_megatron.py uses)
    assert len(lines) == 1 and lines[0].startswith("canzona_ds: CanzonaMuon (muon on ") and \
        "matrix lr 0.02, AdamW lr" in lines[0] and "ZeRO stage 1, DP 1 TP 1 PP 1; plan " in lines[0] and \
        "load max/mean" in lines[0] and "HF Trainer" not in lines[0], lines
    seen, want = res["uninterrupted"]
    # the schedule moves across the resumed steps, and the first of them is not where a fresh one starts
    assert len({str(s) for s in seen[SAVE_AT:]}) == STEPS - SAVE_AT and seen[SAVE_AT] != seen[0], seen
    for stage in (1, 2):
        got, params, steps = res[stage]
        assert got == seen[SAVE_AT:], (kind, stage, got, seen[SAVE_AT:])
        for n in want:
            np.testing.assert_array_equal(params[n], want[n], err_msg=f"{kind} ZeRO 1 -> {stage}: {n}")
        if kind == "megatron":
            assert steps == SAVE_AT, (stage, steps)  # right after the load: the saved count, once


def test_param_group_hyper_parameters_follow_role_and_partition_across_layouts():
    """The record a save keeps (integration/ckpt/param_groups.py) goes back by role and expert
    partition, whatever the order and number of groups here: JSON keeps every float exactly, a
    tuple stays a tuple, a tensor lr is written in place (the tensor a compiled step captured),
    and a group this layout has that the save had not takes its role's values."""
    import json

    import torch

    from canzona_ds.integration.ckpt.param_groups import describe, restore

    lr = 0.1 + 0.2  # (not a short decimal: JSON must keep its bits)
    saved = [{"params": [], "canzona_role": "matrix", "lr": lr, "initial_lr": 0.3, "weight_decay": 0.01, "step": 7},
             {"params": [], "canzona_role": "aux", "lr": lr / 3, "betas": (0.85, 0.95), "eps": 1e-8},
             {"params": [], "canzona_role": "matrix", "canzona_partition": "ep_size_2", "moe": True, "name": "ep_size_2",
              "lr": lr * 7}]
    record = json.loads(json.dumps(describe(saved)))
    tensor_lr = torch.tensor(0.0)
    here = [{"params": [], "canzona_role": "aux", "lr": 0.0, "betas": (0.9, 0.99), "eps": 1e-8},
            {"params": [], "canzona_role": "matrix", "canzona_partition": "ep_size_2", "lr": 0.0, "name": "ep_size_2"},
            {"params": [], "canzona_role": "matrix", "lr": tensor_lr, "weight_decay": 0.0, "step": 0},
            {"params": [], "canzona_role": "matrix", "canzona_partition": "ep_size_4", "lr": 0.0}]
    assert restore(here, record) == 4
    assert here[0]["lr"] == lr / 3 and here[0]["betas"] == (0.85, 0.95) and isinstance(here[0]["betas"], tuple)
    assert here[1]["lr"] == lr * 7 and here[1]["name"] == "ep_size_2"
    assert here[2]["lr"] is tensor_lr and float(tensor_lr) == torch.tensor(lr).item()
    assert_bits(here[2]["initial_lr"], 0.3)
    assert_bits(here[2]["weight_decay"], 0.01)
    assert here[2]["step"] == 0  # (step: the state's)
    assert here[3]["lr"] == lr  # another expert partition than the save's: its role's values


def test_param_group_multiplier_classes_keep_their_own_hyper_parameters():
    """Megatron-DeepSpeed's groups (optimizer.py: one AdamW group per wd_mult / param_lr_mult
    class) share role and partition: each class takes back its own weight decay, not the first
    AdamW group's (biases and norms stay undecayed after a resume)."""
    from canzona_ds.integration.ckpt.param_groups import describe, restore

    saved = [{"params": [], "canzona_role": "aux", "lr": 0.02, "weight_decay": 0.01},
             {"params": [], "canzona_role": "aux", "wd_mult": 0.0, "param_lr_mult": 1.0, "lr": 0.02, "weight_decay": 0.0},
             {"params": [], "canzona_role": "aux", "wd_mult": 1.0, "param_lr_mult": 2.0, "lr": 0.04, "weight_decay": 0.01}]
    here = [{"params": [], "canzona_role": "aux", "wd_mult": 1.0, "param_lr_mult": 2.0, "lr": 0.0, "weight_decay": 0.1},
            {"params": [], "canzona_role": "aux", "wd_mult": 0.0, "param_lr_mult": 1.0, "lr": 0.0, "weight_decay": 0.1},
            {"params": [], "canzona_role": "aux", "lr": 0.0, "weight_decay": 0.1}]
    assert restore(here, describe(saved)) == 3
    assert [(g["lr"], g["weight_decay"]) for g in here] == [(0.04, 0.01), (0.02, 0.0), (0.02, 0.01)]

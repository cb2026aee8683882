"""The real Megatron-DeepSpeed ``pretrain_gpt.py`` through the Canzona hook (marker ``megatron_real``).

Megatron-DeepSpeed comes from ``MEGATRON_DEEPSPEED=<checkout>`` or the snapshot in
``../shared/third_party/`` (canzona_testkit/megatron_real.py: copied once into ``.megatron_ds/``,
patched there with the listed minimal CPU patches, dataset helpers built, a byte-token dataset
of the shipped corpus written with Megatron's own builder); without either the tier skips,
naming what to set.  Every run is the documented launch (``deepspeed --num_gpus N
launch/megatron_pretrain_gpt.py <meg>/pretrain_gpt.py ...``), over gloo on CPU, a tiny GPT (2
layers, hidden 64, 4 heads, sequence 64, byte tokens), dropout off, 4 iterations saving at 2 and 4.

Rows (one launch each; ``resume`` rows a second launch that loads iteration 2 and trains to 4):

    row      DP x TP x PP  ZeRO  dtype  optimizer        model         checks
    tp2      1 x 2 x 1     0     fp32   CanzonaMuon      default GPT   step exact, AdamW exact, weight decay,
                                                                       start line, save, resume
    dp2tp2   2 x 2 x 1     1     fp32   CanzonaMuon      --swiglu      step exact, save, resume
    tp2z2    1 x 2 x 1     2     bf16   CanzonaMuon      --swiglu      save
    pp2      1 x 1 x 2     1     fp32   CanzonaShampoo   default GPT   save
    pp2tp2   1 x 2 x 2     1     bf16   CanzonaSOAP      --swiglu      save (TP-split biases at ZeRO 1)

Default GPT has linear biases and the fused QKV; the TP rows save TP-split 1-D biases (issue 35
item 4).  Step exact: the first step of the TP-split matrices, recorded in the real run's TP
runtime (canzona_testkit/megatron_capture), is :class:`canzona_ds.reference.ReferenceOptimizer`
(one process, whole matrices) on the TP ranks' gradient shards concatenated, with the step's lr
and weight decay, bit for bit.  Resume: the lr / weight decay the resumed run steps with equal
the uninterrupted run's, and
Megatron's iteration-4 model files equal the uninterrupted run's bit for bit.
"""
from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from canzona_testkit import megatron_real as mr

pytestmark = [pytest.mark.megatron_real, pytest.mark.dist, pytest.mark.slow]

ITERS, SAVE_AT = 4, 2
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--seed", "1234"]
SCHEDULE = ["--lr", "0.02", "--min-lr", "0.002", "--lr-decay-style", "cosine", "--lr-warmup-iters", "0",
            "--train-iters", str(ITERS), "--save-interval", str(SAVE_AT), "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", "1000", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--split", "98,2,0"]
PARAMS = {
    "CanzonaMuon": {"muon_lr": 0.02, "adam_lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "nesterov": True,
                    "ns_steps": 5},
    "CanzonaShampoo": {"lr": 0.02, "adam_lr": 0.02, "weight_decay": 0.1, "precondition_frequency": 2,
                       "start_preconditioning_step": 2},
    "CanzonaSOAP": {"lr": 0.02, "adam_lr": 0.02, "weight_decay": 0.1, "precondition_frequency": 2},
}
ROWS: dict[str, dict[str, Any]] = {
    "tp2": dict(dp=1, tp=2, pp=1, zero=0, bf16=False, opt="CanzonaMuon", swiglu=False, resume=True, capture=True),
    # the owned layout: the TP-split matrices' step is the TP runtime's (the exactness check reads it)
    "dp2tp2": dict(dp=2, tp=2, pp=1, zero=1, bf16=False, opt="CanzonaMuon", swiglu=True, resume=True, capture=True,
                   params={"layout": "owned"}),
    "tp2z2": dict(dp=1, tp=2, pp=1, zero=2, bf16=True, opt="CanzonaMuon", swiglu=True),
    "pp2": dict(dp=1, tp=1, pp=2, zero=1, bf16=False, opt="CanzonaShampoo", swiglu=False),
    "pp2tp2": dict(dp=1, tp=2, pp=2, zero=1, bf16=True, opt="CanzonaSOAP", swiglu=True),
}


@lru_cache(maxsize=None)
def megatron() -> Path:
    src, why = mr.source()
    if src is None:
        pytest.skip(why)
    return mr.prepare()


def ds_config(row: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1 if row["pp"] == 1 else 2,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": row["zero"]},
            "bf16": {"enabled": row["bf16"]}, "optimizer": {"type": row["opt"], "params": {**PARAMS[row["opt"]], **row.get("params", {})}},
            "steps_per_print": 1000, "wall_clock_breakdown": False}


def launch(name: str, run: str, work: Path, extra: list[str], capture: Path | None = None,
           **override: Any) -> dict[str, Any]:
    """One documented launch of row ``name`` (``override``: other sizes); returns its log, parsed
    iterations and wall time."""
    row, meg = {**ROWS[name], **override}, megatron()
    cfg = work / f"{name}.json"
    cfg.write_text(json.dumps(ds_config(row)))
    args = [*MODEL, *SCHEDULE, "--tensor-model-parallel-size", str(row["tp"]),
            "--pipeline-model-parallel-size", str(row["pp"]),
            "--global-batch-size", str(row["dp"] * (1 if row["pp"] == 1 else 2)),
            "--data-path", mr.data_prefix(meg), "--data-cache-path", str(work / "index-cache"), *extra]
    if row["pp"] == 1:
        args.append("--no-pipeline-parallel")
    if row["swiglu"]:
        args.append("--swiglu")
    if row["bf16"]:
        args.append("--bf16")
    nprocs = row["dp"] * row["tp"] * row["pp"]
    t0 = time.monotonic()
    proc = subprocess.run(mr.command(meg, nprocs, args, str(cfg)), cwd=work, env=mr.env(capture and str(capture)),
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (work / f"{name}-{run}.log").write_text(log)
    if proc.returncode != 0:
        pytest.fail(f"{name} {run}: the launch failed (rc {proc.returncode}):\n{log[-6000:]}")
    return {"log": log, "iters": mr.iterations(log), "seconds": time.monotonic() - t0}


@lru_cache(maxsize=None)
def trained(name: str) -> dict[str, Any]:
    """Row ``name``'s uninterrupted run (and, for resume rows, the resumed one)."""
    work = Path(_tmp()) / name
    work.mkdir(parents=True)
    row = ROWS[name]
    capture = work / "capture" if row.get("capture") else None
    if capture:
        (capture / "full").mkdir(parents=True)
        (capture / "resumed").mkdir()
    out = {"work": work, "full": launch(name, "full", work, ["--save", str(work / "full")], capture and capture / "full")}
    if row.get("resume"):
        # the uninterrupted run's checkpoint at SAVE_AT, as the latest one of its folder
        start = work / "start"
        shutil.copytree(work / "full" / f"global_step{SAVE_AT}", start / f"global_step{SAVE_AT}")
        (start / "latest").write_text(f"global_step{SAVE_AT}")
        (start / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
        out["resumed"] = launch(name, "resumed", work, ["--load", str(start), "--save", str(work / "resumed")],
                                capture and capture / "resumed")
    return out


_TMP: list[str] = []


def _tmp() -> str:
    if not _TMP:
        import tempfile

        _TMP.append(tempfile.mkdtemp(prefix="megatron_real_"))
        atexit.register(shutil.rmtree, _TMP[0], True)  # the runs' checkpoints and logs, after the session
    return _TMP[0]


def model_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight in Megatron-DeepSpeed's model files of one checkpoint tag (file/key -> tensor)."""
    import sys

    out = {}
    sys.path.insert(0, str(megatron()))  # the files pickle Megatron's args
    try:
        files = {f: torch.load(f, map_location="cpu", weights_only=False)
                 for f in sorted(step_dir.glob("*model_states.pt"))}
    finally:
        sys.path.remove(str(megatron()))
    for f, sd in files.items():
        module = sd.get("module", sd) if isinstance(sd, dict) else sd
        for k, v in _flat(module):
            out[f"{f.name}/{k}"] = v
    return out


def _flat(d, prefix=""):
    if isinstance(d, torch.Tensor):
        yield prefix, d
    elif isinstance(d, dict):
        for k, v in d.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))


@pytest.mark.parametrize("name", list(ROWS))
def test_trains_and_saves(name: str) -> None:
    run = trained(name)["full"]
    iters = run["iters"]
    assert sorted(iters) == list(range(1, ITERS + 1)), f"{name}: Megatron logged iterations {sorted(iters)}"
    assert iters[ITERS][1] < iters[1][1], f"{name}: lm loss {iters[1][1]} -> {iters[ITERS][1]}"
    work = trained(name)["work"]
    for step in (SAVE_AT, ITERS):
        assert model_tensors(work / "full" / f"global_step{step}"), f"{name}: no model files at step {step}"
    assert (work / "full" / "latest").read_text().strip() == f"global_step{ITERS}"


def tp_captures(name: str, run: str) -> list[dict[str, Any]]:
    """The TP runtime records of one launch (canzona_testkit/megatron_capture), every rank that has one."""
    files = sorted((trained(name)["work"] / "capture" / run).glob("tp*.pt"))
    assert files, f"{name} {run}: no TP runtime step was recorded"
    return [torch.load(f, weights_only=False) for f in files]


@pytest.mark.parametrize("name", [n for n, r in ROWS.items() if r.get("capture")])
def test_tp_step_is_the_full_matrix_rule_on_the_captured_gradients(name: str) -> None:
    """ZeRO 0 (tp2) and ZeRO 1 (dp2tp2): the first step of every TP-split matrix, on the TP ranks
    that hold it (its DP owner's at ZeRO 1), is the whole-matrix rule bit for bit."""
    from canzona_ds.integration.megatron import config_from_ds_config
    from canzona_ds.reference import ReferenceOptimizer

    shards: dict[str, dict[int, dict[str, Any]]] = {}
    for c in tp_captures(name, "full"):
        for n, m in c["matrices"].items():
            assert c["tp_rank"] not in shards.setdefault(n, {}), f"{n}: two records of TP rank {c['tp_rank']}"
            shards[n][c["tp_rank"]] = m
    assert any("query_key_value.weight" in n for n in shards) and any("dense_4h_to_h.weight" in n for n in shards)
    cfg = config_from_ds_config(ds_config(ROWS[name]))
    for n, per_rank in shards.items():
        assert sorted(per_rank) == list(range(ROWS[name]["tp"])), f"{n}: shards of TP ranks {sorted(per_rank)}"
        ms = [per_rank[t] for t in sorted(per_rank)]
        dim, (lr, wd, step) = ms[0]["partition_dim"], (ms[0]["lr"], ms[0]["weight_decay"], ms[0]["step"])
        assert step == 1 and lr > 0 and all((m["lr"], m["weight_decay"]) == (lr, wd) for m in ms)
        before = torch.cat([m["before"] for m in ms], dim=dim)
        w = torch.nn.Parameter(before.clone())
        w.grad = torch.cat([m["grad"] for m in ms], dim=dim)
        assert tuple(w.shape) == tuple(ms[0]["full_shape"])
        ref = ReferenceOptimizer([(n, w)], cfg)
        assert list(ref.infos) == [n]
        ref.set_lr(lr, lr)
        ref.weight_decay = wd
        ref.step()
        got = torch.cat([m["after"] for m in ms], dim=dim)
        assert not torch.equal(got, before), n
        torch.testing.assert_close(got, w.detach(), rtol=0, atol=0, msg=lambda s, n=n: f"{name} {n}: {s}")


def test_tp2_adamw_params_and_weight_decay_as_megatron() -> None:
    """The non-matrix parameters' first step is torch.optim.AdamW's on the whole tensor with the
    step's lr and weight decay, and that weight decay is Megatron's: none on biases and norms
    (Megatron's get_param_groups default), Megatron's --weight-decay (0.01) on the rest."""
    from canzona_ds.integration.megatron import config_from_ds_config

    cfg = config_from_ds_config(ds_config(ROWS["tp2"]))
    work = trained("tp2")["work"]
    ranks = sorted((torch.load(work / "capture" / "full" / f"opt{r}.pt", weights_only=False) for r in range(2)),
                   key=lambda c: c["tp_rank"])
    meta = ranks[0]["meta"]
    wd = {n: m["weight_decay"] for n, m in meta.items()}
    no_decay = {n for n in meta if n.endswith(".bias") or ranks[0]["before"][n].dim() == 1}
    assert no_decay and all(wd[n] == 0.0 for n in no_decay), {n: wd[n] for n in no_decay if wd[n]}
    assert all(wd[n] == pytest.approx(0.01) for n in meta if n not in no_decay), wd
    aux = [n for n, m in meta.items() if m["role"] == "aux"]
    assert any("word_embeddings" in n for n in aux) and any(n.endswith(".bias") for n in aux)
    for n in aux:
        m = meta[n]

        def whole(key: str) -> torch.Tensor:
            if m["tensor_model_parallel"]:
                return torch.cat([c[key][n] for c in ranks], dim=m["partition_dim"])
            assert torch.equal(ranks[0][key][n], ranks[1][key][n]), f"replicated {n} {key} differs across TP"
            return ranks[0][key][n]

        p = torch.nn.Parameter(whole("before"))
        p.grad = whole("grads")
        torch.optim.AdamW([p], lr=m["lr"], betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=m["weight_decay"]).step()
        torch.testing.assert_close(whole("after"), p.detach(), rtol=0, atol=0, msg=lambda s, n=n: f"{n}: {s}")


def test_start_line_names_canzona() -> None:
    log = trained("tp2")["full"]["log"]
    lines = [x for x in log.splitlines() if x.startswith("canzona_ds: ")]
    assert len(lines) == 1, lines  # rank 0 only, once
    assert lines[0].startswith("canzona_ds: CanzonaMuon (muon on ") and "ZeRO stage 0" in lines[0], lines[0]
    assert "DP 1 TP 2 PP 1" in lines[0] and "TP hosts over 2 ranks, load max/mean" in lines[0], lines[0]
    assert "Megatron-DeepSpeed: this optimizer replaces the one --optimizer names" in lines[0], lines[0]


@pytest.mark.parametrize("name", [n for n, r in ROWS.items() if r.get("resume")])
def test_resume_continues_bit_for_bit(name: str) -> None:
    out = trained(name)
    full, resumed = out["full"]["iters"], out["resumed"]["iters"]
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1)), sorted(resumed)
    got = model_tensors(out["work"] / "resumed" / f"global_step{ITERS}")
    want = model_tensors(out["work"] / "full" / f"global_step{ITERS}")
    assert set(got) == set(want)
    if ROWS[name].get("capture"):
        # the lr and weight decay the TP runtime was handed at each step, uninterrupted vs resumed
        want_calls = tp_captures(name, "full")[0]["calls"][SAVE_AT:]
        got_calls = tp_captures(name, "resumed")[0]["calls"]
        assert got_calls == want_calls, f"{name}: after the load the optimizer steps with (step, lr, wd) " \
            f"{got_calls}, the uninterrupted run with {want_calls}"
    for i in resumed:
        assert resumed[i] == full[i], f"{name} iteration {i}: resumed {resumed[i]}, uninterrupted {full[i]}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda s, k=k: f"{name} {k}: {s}")


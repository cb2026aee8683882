"""HF Trainer example on 2 gloo ranks (runs only where transformers + accelerate are
installed: ``pip install transformers accelerate``, ~25 s; see docs/main_job.md).

With ``--model qwen3-moe-tiny`` the Trainer trains a real transformers ``Qwen3MoeForCausalLM``
(3-D expert stacks) with each Canzona type; ``--record`` writes what every rank's model saw, and
a single process replays the run with ``canzona_testkit.hf_moe.PerExpertReference`` (torch.optim.Muon / the
rule on each expert slice as its own matrix, AdamW on the rest) from ZeRO's averaged gradients:
the final weights must be equal bit for bit (fp32, DP=2).

Cost: 3 rank runs, 5 launching tests; 113 s on a 2-core AMD EPYC (docs/ci.md)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from canzona_testkit.kernels import assert_bits

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[1]


def _launch(out: Path, *extra: str, steps: int = 6, seq_len: int = 64, ranks: int = 2, micro: int = 4,
            zero_class: str = "CanzonaZeroOptimizer") -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])  # this checkout's
    r = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
                        str(port), "--module", "canzona_ds.train.hf_trainer", "--steps", str(steps), "--seq-len",
                        str(seq_len), "--micro-batch", str(micro), "--out", str(out), *extra],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"DeepSpeed optimizer: {zero_class};" in r.stdout + r.stderr
    # what a Trainer user sees at the default log level: one line naming what runs, from rank 0
    starts = [ln for ln in (r.stdout + r.stderr).splitlines() if "canzona_ds: Canzona" in ln]
    assert len(starts) == 1 and "matrix lr" in starts[0] and "AdamW lr" in starts[0] and "ZeRO stage" in starts[0] \
        and 'HF Trainer: a ds_config "lr": "auto"' in starts[0], starts
    return r


def _losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]


def test_hf_trainer_zero3_with_canzona_muon(tmp_path):
    """ZeRO-3 (HF Trainer with a stage-3 ds_config: parameters partitioned, clipping on)."""
    ds = json.loads((REPO / "configs" / "ds_cpu_canzona_zero3.json").read_text())
    ds["canzona_metrics"] = {"interval": 2}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    _launch(tmp_path, "--ds-config", str(tmp_path / "ds.json"), "--save-steps", "0",
            zero_class="CanzonaZero3Optimizer")
    losses = _losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0
    # optimizer.metrics() through canzona_ds.integration.hf's callback: in every training log, at
    # the Trainer's step; ZeRO-3 hosts every matrix over DP, so the hosted runtime moved bytes
    logs = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4, 5, 6]
    for h in logs:
        assert 0 < h["canzona_matrix_ms"] <= h["canzona_step_ms"], h
        assert h["canzona_hosted_collectives"] > 0 and h["canzona_hosted_bytes"] > 0 and not h["canzona_skipped"]
    # (rank 0's log) the DP reduction every second step: the busiest rank at least as slow as this one
    assert [("canzona_dp_max_step_ms" in h) for h in logs] == [False, True] * 3
    for h in logs[1::2]:
        assert h["canzona_dp_max_step_ms"] >= max(h["canzona_step_ms"], h["canzona_dp_mean_step_ms"]), h


def _masters(run: Path, step: int) -> dict:
    """The fp32 master weights of ``run``'s checkpoint at ``step``, by name, through its index."""
    from canzona_testkit.ckpt import read

    return read(str(run / f"checkpoint-{step}"), f"global_step{step}").params


SAVE, STEPS = 4, 8


def test_hf_trainer_resumes_at_another_zero_stage_and_dp_size(tmp_path):
    """The shipped example as a user runs it: CanzonaMuon at ZeRO-1 on 2 ranks, the Trainer's
    cosine schedule with 4 warm-up steps, a checkpoint every 4 steps; resumed from step 4 with
    ``trainer.train(resume_from_checkpoint=...)`` at ZeRO-2 (2 ranks) and at ZeRO-1 on 1 rank.
    Every resumed step runs every param group at the uninterrupted run's lr, bit for bit (the
    first resumed step is the last warm-up step; a fresh schedule would run it at 1/4 of that).
    At ZeRO-2 on 2 ranks the arithmetic is the uninterrupted run's, so the losses and the step-8
    fp32 masters are equal bit for bit.  On 1 rank HF's sampler hands the one process other
    windows than the two processes saw together (its loss at the first resumed step differs
    with the same weights), so there the continuation has no reference to equal; the lrs do."""
    whole, zero2, one = tmp_path / "whole", tmp_path / "zero2", tmp_path / "one"
    common = ("--save-steps", str(SAVE), "--warmup-steps", "4")
    _launch(whole, *common, steps=STEPS)
    ckpt = str(whole / f"checkpoint-{SAVE}")
    _launch(zero2, *common, "--zero-stage", "2", "--resume", ckpt, steps=STEPS)
    _launch(one, *common, "--resume", ckpt, steps=STEPS, ranks=1, micro=8)
    want = json.loads((whole / "group_lrs.json").read_text())
    assert [s for s, _ in want] == list(range(1, STEPS + 1)) and len({tuple(lrs) for _, lrs in want}) >= STEPS - 1
    for run in (zero2, one):
        got = json.loads((run / "group_lrs.json").read_text())
        assert got == want[SAVE:], (run.name, got, want[SAVE:])
    assert_bits(_losses(zero2), _losses(whole))
    end, end2 = _masters(whole, STEPS), _masters(zero2, STEPS)
    assert sorted(end) == sorted(end2)
    for n in end:
        assert torch.equal(end2[n], end[n]), n


def _replay(rank, world, out, opt_type):
    """In a worker (this process's BLAS): the recorded run replayed by the per-expert reference."""
    import torch

    from canzona_ds.reference import zero_average
    from canzona_testkit.hf_moe import PerExpertReference
    from canzona_ds.train.hf_trainer import build_hf_moe

    saved = torch.load(Path(out) / "weights.pt")
    calls = [torch.load(Path(out) / f"inputs.rank{r}.pt") for r in range(2)]
    # the Trainer's processes ran with the thread count accelerate gave them (BLAS reductions
    # depend on it): replay with the same
    torch.set_num_threads(calls[0][0]["threads"])
    model = build_hf_moe(1234)
    assert all(torch.equal(p, saved["initial"][n]) for n, p in model.named_parameters())
    ds = saved["ds_config"]["optimizer"]
    assert ds["type"] == opt_type
    ref = PerExpertReference(model, opt_type, ds["params"])
    for step in range(len(calls[0])):
        per_rank = []
        for r in range(2):
            c = calls[r][step]
            model.zero_grad(set_to_none=True)
            model.train()
            model(input_ids=c["input_ids"], labels=c["labels"], num_items_in_batch=c["num_items_in_batch"]).loss.backward()
            per_rank.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                             for n, p in model.named_parameters()})
        for n, g in zero_average(per_rank).items():
            model.get_parameter(n).grad = g
        ref.step()
    diffs = {n: float((p.detach() - saved["final"][n]).abs().max()) for n, p in model.named_parameters()}
    stacks = [n for n in diffs if ".experts." in n]
    return dict(diffs=diffs, stacks=stacks, steps=len(calls[0]))


MOE_RUNS = {
    "CanzonaMuon": ("configs/ds_cpu_canzona.json", {}),
    # refreshes inside the run: preconditioners from step 2 (the configs' 10 would never refresh)
    "CanzonaShampoo": ("configs/ds_cpu_shampoo.json", {"precondition_frequency": 2, "start_preconditioning_step": 2}),
    "CanzonaSOAP": ("configs/ds_cpu_soap.json", {"precondition_frequency": 2}),
}


@pytest.mark.parametrize("opt_type", list(MOE_RUNS))
def test_hf_trainer_qwen3_moe_exact_against_per_expert_reference(tmp_path, opt_type):
    from canzona_testkit.dist import run_distributed

    config, params = MOE_RUNS[opt_type]
    _launch(tmp_path, "--model", "qwen3-moe-tiny", "--ds-config", config, "--opt-params", json.dumps(params),
            "--record", "--lr-scheduler", "constant", "--warmup-steps", "0", "--save-steps", "0", steps=5, seq_len=32)
    losses = _losses(tmp_path)
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3, losses
    res = run_distributed(_replay, 1, str(tmp_path), opt_type)[0]
    assert res["steps"] == 5 and len(res["stacks"]) == 4  # 2 layers x (gate_up_proj, down_proj)
    assert_bits(res["diffs"], dict.fromkeys(res["diffs"], 0.0), f"{opt_type}: differs from the per-expert reference")

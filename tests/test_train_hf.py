"""HF Trainer example on 2 gloo ranks (runs only where transformers + accelerate are
installed: ``pip install transformers accelerate``, ~25 s; see docs/main_job.md).

With ``--model qwen3-moe-tiny`` the Trainer trains a real transformers ``Qwen3MoeForCausalLM``
(3-D expert stacks) with each Canzona type; ``--record`` writes what every rank's model saw, and
a single process replays the run with ``canzona_testkit.hf_moe.PerExpertReference`` (torch.optim.Muon / the
rule on each expert slice as its own matrix, AdamW on the rest) from ZeRO's averaged gradients:
the final weights must be equal bit for bit (fp32, DP=2)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[1]


def _launch(out: Path, *extra: str, steps: int = 6, seq_len: int = 64,
            zero_class: str = "CanzonaZeroOptimizer") -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                        str(port), "--module", "canzona_ds.train.hf_trainer", "--steps", str(steps), "--seq-len",
                        str(seq_len), "--micro-batch", "4", "--out", str(out), *extra],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"DeepSpeed optimizer: {zero_class};" in r.stdout + r.stderr
    return r


def _losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]


@pytest.mark.parametrize("ds_config,zero_class", [("configs/ds_cpu_canzona.json", "CanzonaZeroOptimizer"),
                                                   ("configs/ds_cpu_canzona_zero3.json", "CanzonaZero3Optimizer")])
def test_hf_trainer_with_canzona_muon(tmp_path, ds_config, zero_class):
    """ZeRO-1, and ZeRO-3 (HF Trainer with a stage-3 ds_config: parameters partitioned, clipping on)."""
    _launch(tmp_path, "--ds-config", ds_config, zero_class=zero_class)
    losses = _losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0


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
            "--record", steps=5, seq_len=32)
    losses = _losses(tmp_path)
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3, losses
    res = run_distributed(_replay, 1, str(tmp_path), opt_type)[0]
    assert res["steps"] == 5 and len(res["stacks"]) == 4  # 2 layers x (gate_up_proj, down_proj)
    bad = {n: d for n, d in res["diffs"].items() if d != 0.0}
    assert not bad, f"{opt_type}: differs from the per-expert reference: {bad}"

"""canzona-plan CLI (in process)."""
from __future__ import annotations

import json

import pytest

from canzona_ds.cli.plan import DP_KEYS, TP_KEYS, main
from canzona_ds.optim import cost_model
from canzona_ds.planning.dp import DP_PLANNERS
from canzona_ds.planning.tp import TP_SCHEDULERS


def test_json_has_documented_keys(capsys):
    assert main(["--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert (out["model"], out["dp"], out["tp"]) == ("qwen3-32b", 32, 8)
    assert set(out["dp_planners"]) == set(DP_PLANNERS) and set(out["tp_schedulers"]) == set(TP_SCHEDULERS)
    for r in out["dp_planners"].values():
        assert {"flops_ratio", "peak_flops_ratio", "memory_ratio", "padding_fraction", "split_matrices",
                "plan_ms"} <= set(r)
        assert set(DP_KEYS) <= set(r)
        assert r["peak_flops_ratio"] == pytest.approx(r["flops_ratio"])  # Muon: no periodic work
    for r in out["tp_schedulers"].values():
        assert {"flops_ratio", "memory_ratio", "micro_groups", "plan_ms"} <= set(r) and set(TP_KEYS) <= set(r)
    assert out["optimizer"] == "muon" and out["optimizer_config"]["rule"] == "muon"
    assert out["default_dp_planner"] in DP_PLANNERS and out["default_tp_scheduler"] in TP_SCHEDULERS
    best = out["dp_planners"][out["default_dp_planner"]]
    assert best["flops_ratio"] <= out["dp_planners"]["alpha_balanced"]["flops_ratio"]


def test_table_and_options(capsys):
    assert main(["--model", "gpt2-small", "--dp", "8", "--tp", "2", "--optimizer", "soap", "--cost", "flops"]) == 0
    text = capsys.readouterr().out
    assert "DP planners" in text and "multi_lpt" in text and "lpt_rollback" in text
    assert "optimizer=soap (precondition_frequency=10, max_precond_dim=10000)" in text
    assert "peak max/avg" in text


@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
@pytest.mark.parametrize("cost", ["flops", "peak_flops"])
def test_every_optimizer_json(optimizer, cost, capsys):
    assert main(["--model", "qwen3-1.7b", "--dp", "8", "--tp", "2", "--optimizer", optimizer, "--cost", cost,
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert out["optimizer"] == optimizer and out["cost"] == cost
    assert out["optimizer_config"] == cost_model(optimizer).describe()
    assert set(out["dp_planners"]) == set(DP_PLANNERS) and set(out["tp_schedulers"]) == set(TP_SCHEDULERS)
    for r in out["dp_planners"].values():
        assert set(DP_KEYS) <= set(r)
        assert r["flops_ratio"] >= r["flops_lower_bound"] - 1e-9
    best = out["dp_planners"][out["default_dp_planner"]]
    assert best["flops_ratio"] <= out["dp_planners"]["naive_atomic"]["flops_ratio"] + 1e-9


def test_rule_hyper_parameters(capsys):
    base = ["--model", "qwen3-1.7b", "--dp", "8", "--optimizer", "shampoo", "--json"]
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["optimizer_config"]["precondition_frequency"] == 10
    assert main(base + ["--precondition-frequency", "1"]) == 0
    every_step = json.loads(capsys.readouterr().out)
    assert every_step["optimizer_config"]["precondition_frequency"] == 1
    # Shampoo refreshing every step: amortised == peak
    for r in every_step["dp_planners"].values():
        assert r["peak_flops_ratio"] == pytest.approx(r["flops_ratio"])
    assert main(["--model", "qwen3-1.7b", "--dp", "8", "--optimizer", "soap", "--precondition-frequency", "3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer_config"]["precondition_frequency"] == 3
    assert main(["--model", "qwen3-1.7b", "--dp", "8", "--optimizer", "shampoo", "--max-preconditioner-dim", "65536",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer_config"]["max_preconditioner_dim"] == 65536
    assert main(["--model", "qwen3-1.7b", "--dp", "8", "--optimizer", "soap", "--max-preconditioner-dim", "512",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer_config"]["max_precond_dim"] == 512


def test_errors_are_clear(capsys):
    assert main(["--model", "nope", "--dp", "4"]) == 2
    assert "qwen3-0.6b" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--alpha", "2"]) == 2
    assert "alpha=2.0" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--c-max", "1"]) == 2
    assert "largest task" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--optimizer", "muon", "--precondition-frequency", "5"]) == 2
    assert "--precondition-frequency is a Shampoo/SOAP setting" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--max-preconditioner-dim", "64"]) == 2
    assert "--max-preconditioner-dim is a Shampoo/SOAP setting" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--optimizer", "shampoo", "--precondition-frequency", "0"]) == 2
    assert "precondition_frequency=0" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "0"]) == 2
    assert "world_size=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: unknown optimizer
        main(["--model", "qwen3-0.6b", "--dp", "4", "--optimizer", "adam"])
    assert "invalid choice: 'adam'" in capsys.readouterr().err


def test_model_without_matrices(tmp_path, capsys):
    cfg = {"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 0,
           "num_attention_heads": 1, "vocab_size": 16, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["--model", str(path), "--dp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dp_planners"] == {} and "no matrix parameters" in out["note"]


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--plot", str(tmp_path / "x.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_naive_and_layerwise_in_json(capsys):
    base = ["--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    naive, layerwise = out["dp_planners"]["paper_naive"], out["dp_planners"]["layerwise"]
    assert set(DP_KEYS) <= set(naive) and set(DP_KEYS) <= set(layerwise)
    assert naive["split_matrices"] == 0 and layerwise["split_matrices"] == 0
    # eq. 1 over DeepSpeed's 500M-element buckets is badly balanced; Algorithm 1 over the same is not
    assert naive["flops_ratio"] > 2.0 > 1.25 > out["dp_planners"]["alpha_balanced"]["flops_ratio"]
    assert layerwise["flops_ratio"] == pytest.approx(1.0)  # 64 equal layers over 32 ranks
    # Megatron's default buckets (40M elements at DP=32): the first matrix of each of 129 buckets on rank 0
    assert main(base + ["--bucket-numel", "40000000"]) == 0
    assert json.loads(capsys.readouterr().out)["dp_planners"]["paper_naive"]["flops_ratio"] > 20
    assert main(base + ["--bucket-numel", "0"]) == 0  # one bucket
    assert json.loads(capsys.readouterr().out)["dp_planners"]["paper_naive"]["flops_ratio"] == pytest.approx(1.0)
    assert main(base[:-1] + ["--dp-planner", "layerwise"]) == 0
    assert "TP schedulers" in capsys.readouterr().out


def _columns_hold(lines: list[str], head: str) -> list[list[str]]:
    """Rows of the text table whose header line starts with ``head``, split at 2+ spaces; every
    row must split into as many cells as the header (a value that runs into its neighbour, as
    ``122.39112139.07%`` did, makes one cell of two)."""
    import re

    i = next(i for i, ln in enumerate(lines) if ln.startswith(head))
    width = len(re.split(r"\s{2,}", lines[i].strip()))
    rows = []
    for ln in lines[i + 1:]:
        if not ln.strip() or ln.startswith("("):
            break
        cells = re.split(r"\s{2,}", ln.strip())
        assert len(cells) == width or ln.startswith("lower bound"), (lines[i], ln)
        rows.append(cells)
    return rows


def test_wide_values_keep_their_columns(capsys):
    """qwen3-30b-a3b at dp=128, ep=8: paper_naive's padding (12139.07%) is wider than any fixed
    column: every table's columns grow to their widest value."""
    assert main(["--model", "qwen3-30b-a3b", "--dp", "128", "--ep", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {r[0]: r for r in _columns_hold(lines, "planner ")}
    assert rows["paper_naive"][3:5] == ["122.391", "12139.07%"]
    _columns_hold(lines, "layout ")
    _columns_hold(lines, "ownership unit ")


def test_help_says_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for says in ("(default: 1)", "(default: numel, the paper's; the main job's optimizer balances its cost_model, "
                 "default flops", "(default: muon)", "(default: multi_lpt)", "(default: lpt_rollback)",
                 "(default: 1.0)"):
        assert says in text, says

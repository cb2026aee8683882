"""canzona-plan CLI (in process)."""
from __future__ import annotations

import json

from canzona_ds.cli.plan import main
from canzona_ds.planning.dp import DP_PLANNERS
from canzona_ds.planning.tp import TP_SCHEDULERS


def test_json_has_documented_keys(capsys):
    assert main(["--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert (out["model"], out["dp"], out["tp"]) == ("qwen3-32b", 32, 8)
    assert set(out["dp_planners"]) == set(DP_PLANNERS) and set(out["tp_schedulers"]) == set(TP_SCHEDULERS)
    for r in out["dp_planners"].values():
        assert {"flops_ratio", "memory_ratio", "padding_fraction", "split_matrices", "plan_ms"} <= set(r)
    for r in out["tp_schedulers"].values():
        assert {"flops_ratio", "memory_ratio", "micro_groups", "plan_ms"} <= set(r)
    assert out["default_dp_planner"] in DP_PLANNERS and out["default_tp_scheduler"] in TP_SCHEDULERS
    best = out["dp_planners"][out["default_dp_planner"]]
    assert best["flops_ratio"] <= out["dp_planners"]["alpha_balanced"]["flops_ratio"]


def test_table_and_options(capsys):
    assert main(["--model", "gpt2-small", "--dp", "8", "--tp", "2", "--optimizer", "soap", "--cost", "flops"]) == 0
    text = capsys.readouterr().out
    assert "DP planners" in text and "multi_lpt" in text and "lpt_rollback" in text


def test_errors_are_clear(capsys):
    assert main(["--model", "nope", "--dp", "4"]) == 2
    assert "qwen3-0.6b" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--alpha", "2"]) == 2
    assert "alpha=2.0" in capsys.readouterr().err
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--c-max", "1"]) == 2
    assert "largest task" in capsys.readouterr().err


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
    import pytest

    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main(["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

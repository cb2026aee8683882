"""CanzonaConfig: DeepSpeed-Muon compatible defaults, every bad input a clear error naming the
key the user wrote, the generated key table in sync, and the one matrix-vs-AdamW rule."""
from __future__ import annotations

from pathlib import Path

import pytest

from canzona_ds.config import CanzonaConfig, TPConfig, all_keys, markdown
from canzona_ds.planning.params import is_matrix

ROOT = Path(__file__).resolve().parents[1]


def test_muon_defaults_follow_deepspeed_muon():
    c = CanzonaConfig.from_ds("CanzonaMuon", {})
    assert (c.lr, c.adam_lr, c.rule.momentum, c.weight_decay, c.adam_betas, c.adam_eps) == (
        0.02, 3e-4, 0.95, 0.0, (0.9, 0.95), 1e-10)
    c = CanzonaConfig.from_ds("CanzonaMuon", {"lr": 0.1, "adam_lr": 0.2})
    assert (c.lr, c.adam_lr) == (0.1, 0.2)
    c = CanzonaConfig.from_ds("CanzonaMuon", {"lr": 0.1, "muon_lr": 0.05, "betas": [0.8, 0.9], "eps": 1e-6})
    assert (c.lr, c.adam_lr, c.adam_betas, c.adam_eps) == (0.05, 0.1, (0.8, 0.9), 1e-6)


def test_rule_defaults_and_lr_split():
    sh = CanzonaConfig.from_ds("CanzonaShampoo", {})
    so = CanzonaConfig.from_ds("CanzonaSOAP", {"lr": 0.01, "betas": [0.9, 0.99]})
    assert (sh.lr, sh.adam_lr) == (1e-3, 1e-3)
    assert (so.lr, so.adam_lr, so.rule.betas, so.adam_betas) == (0.01, 0.01, (0.9, 0.99), (0.9, 0.95))


# (optimizer type, params, exception, text the message must contain)
BAD = [
    ("CanzonaMuon", {"nesterow": True}, ValueError, "nesterow"),
    ("CanzonaMuon", {"lr": None}, ValueError, "lr=None"),
    ("CanzonaMuon", {"lr": -0.01}, ValueError, "lr=-0.01"),
    ("CanzonaMuon", {"muon_lr": 0.0}, ValueError, "muon_lr=0.0"),
    ("CanzonaMuon", {"adam_lr": "0.1"}, ValueError, "adam_lr='0.1'"),
    ("CanzonaMuon", {"momentum": 1.5}, ValueError, "momentum=1.5"),
    ("CanzonaMuon", {"ns_steps": 1_000_000_000}, ValueError, "ns_steps=1000000000"),
    ("CanzonaMuon", {"ns_steps": 2.5}, ValueError, "ns_steps=2.5"),
    ("CanzonaMuon", {"ns_steps": 100}, ValueError, "ns_steps=100"),  # torch.optim.Muon refuses it too
    ("CanzonaMuon", {"ns_coefficients": [1e30, -1e30, 1e30]}, ValueError, "ns_coefficients[0]"),
    ("CanzonaMuon", {"ns_coefficients": [1, 2]}, ValueError, "ns_coefficients"),
    ("CanzonaMuon", {"betas": [0.9, 1.0]}, ValueError, "betas[1]=1.0"),
    ("CanzonaMuon", {"betas": 0.9}, TypeError, "betas=0.9"),
    ("CanzonaMuon", {"eps": 0}, ValueError, "eps=0"),
    ("CanzonaMuon", {"betas": [0.9, 0.95], "adam_betas": [0.9, 0.95]}, ValueError, "'betas' and 'adam_betas'"),
    ("CanzonaMuon", {"ns_method": "svd"}, ValueError, "ns_method='svd'"),
    ("CanzonaMuon", {"ns_dtype": "float32"}, ValueError, "ns_dtype='float32'"),
    ("CanzonaMuon", {"nesterov": "yes"}, TypeError, "nesterov='yes'"),
    ("CanzonaMuon", {"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
    ("CanzonaMuon", {"planner": "equal_chunk"}, ValueError, "planner='equal_chunk'"),
    ("CanzonaMuon", {"planner": "nope"}, ValueError, "Allowed: ['naive_atomic'"),
    ("CanzonaMuon", {"alpha": 2.0}, ValueError, "alpha=2.0"),
    ("CanzonaMuon", {"cost_model": "time"}, ValueError, "cost_model='time'"),
    ("CanzonaMuon", {"matrix_exclude": "embed"}, TypeError, "matrix_exclude='embed'"),
    ("CanzonaMuon", {"matrix_include": [""]}, TypeError, "matrix_include"),
    ("CanzonaShampoo", {"per_head_muon": True}, ValueError, "per_head_muon"),
    ("CanzonaShampoo", {"precondition_frequency": 0}, ValueError, "precondition_frequency=0"),
    ("CanzonaShampoo", {"max_preconditioner_dim": 10**6}, ValueError, "max_preconditioner_dim=1000000"),
    ("CanzonaShampoo", {"grafting": "sgd"}, ValueError, "grafting='sgd'"),
    ("CanzonaShampoo", {"betas": [0.9, 0.0]}, ValueError, "betas[1]=0.0"),
    ("CanzonaShampoo", {"eigh_dtype": "fp16"}, ValueError, "eigh_dtype='fp16'"),
    ("CanzonaShampoo", {"ns_steps": 5}, ValueError, "ns_steps"),
    ("CanzonaSOAP", {"shampoo_beta": 1.0}, ValueError, "shampoo_beta=1.0"),
    ("CanzonaSOAP", {"max_precond_dim": 0}, ValueError, "max_precond_dim=0"),
    ("CanzonaSOAP", {"correct_bias": 1}, TypeError, "correct_bias=1"),
    ("CanzonaSOAP", {"momentum": 0.9}, ValueError, "momentum"),
]


def test_ns_steps_range_is_the_references():
    """ns_steps ends where torch.optim.Muon's does: the reference steps with 99 and refuses 100
    (at its first step, in its Newton-Schulz)."""
    import torch

    for steps in (99, 100):
        w = torch.nn.Parameter(torch.zeros(4, 4))
        w.grad = torch.ones(4, 4)
        opt = torch.optim.Muon([w], ns_steps=steps)
        if steps == 99:
            opt.step()
        else:
            with pytest.raises(ValueError, match="less than 100"):
                opt.step()
    assert CanzonaConfig.from_ds("CanzonaMuon", {"ns_steps": 99}).rule.ns_steps == 99


@pytest.mark.parametrize("opt_type,params,exc,text", BAD, ids=[f"{t}-{next(iter(p))}" for t, p, _, _ in BAD])
def test_bad_params_name_the_key(opt_type, params, exc, text):
    with pytest.raises(exc) as err:
        CanzonaConfig.from_ds(opt_type, params)
    assert text in str(err.value), str(err.value)


@pytest.mark.parametrize("params", [["lr", 0.1], "lr=0.1", 3])
def test_params_must_be_an_object(params):
    with pytest.raises(TypeError, match="optimizer.params"):
        CanzonaConfig.from_ds("CanzonaMuon", params)


@pytest.mark.parametrize("section,text", [({"c_mx": 5}, "c_mx"), ({"strategy": "sc"}, "strategy was removed"),
                                          ({"scheduler": "bogus"}, "canzona_tp.scheduler='bogus'"),
                                          ({"c_max": -1}, "canzona_tp.c_max=-1"), ([1], "canzona_tp"),
                                          ({"pipelined": None}, "canzona_tp.pipelined=None")])
def test_tp_section_checked_even_without_tp(section, text):
    with pytest.raises((ValueError, TypeError)) as err:
        CanzonaConfig.from_ds("CanzonaMuon", {}, section)
    assert text in str(err.value)


def test_unknown_type():
    with pytest.raises(ValueError, match="CanzonaAdam"):
        CanzonaConfig.from_ds("CanzonaAdam", {})


def test_fingerprint_covers_every_setting():
    base = CanzonaConfig.from_ds("CanzonaMuon", {"lr": 0.02})
    for change in ({"lr": 0.05}, {"momentum": 0.9}, {"ns_steps": 6}, {"weight_decay": 0.1}, {"planner": "lpt"},
                   {"betas": [0.8, 0.95]}):
        assert CanzonaConfig.from_ds("CanzonaMuon", {"lr": 0.02, **change}).fingerprint() != base.fingerprint(), change
    assert TPConfig() == CanzonaConfig.from_ds("CanzonaMuon", {}).tp


def test_generated_key_table_is_in_sync():
    """docs/config.md is generated (`python -m canzona_ds.config > docs/config.md`)."""
    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc == markdown(), "docs/config.md is stale: run `python -m canzona_ds.config > docs/config.md`"
    for opt_type in ("CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"):
        for key in all_keys(opt_type):
            assert f"`{key}`" in doc, (opt_type, key)


@pytest.mark.parametrize("name,shape,use_muon,expected", [
    ("layers.0.attn.q_proj.weight", (8, 8), None, True),
    ("layers.0.attn.q_proj.bias", (8,), None, False),
    ("embed_tokens.weight", (10, 8), None, False),
    ("lm_head.weight", (10, 8), None, False),
    ("output.weight", (10, 8), None, False),
    ("model.head.weight", (10, 8), None, False),
    ("classifier.weight", (3, 8), None, False),
    ("bert.attention.output.dense.weight", (8, 8), None, True),  # "output" is not the module here
    ("embed_tokens.weight", (10, 8), True, True),  # DeepSpeed's use_muon tag decides
    ("layers.0.mlp.fc1.weight", (8, 8), False, False),
])
def test_matrix_rule(name, shape, use_muon, expected):
    assert is_matrix(name, shape, use_muon=use_muon) is expected


def test_use_muon_on_a_vector_is_an_error():
    with pytest.raises(ValueError, match="use_muon=True"):
        is_matrix("norm.weight", (8,), use_muon=True)


def test_include_overrides_exclude():
    c = CanzonaConfig.from_ds("CanzonaMuon", {"matrix_include": ["lm_head"], "matrix_exclude": ["embed", "fc2"]})
    assert c.is_matrix("lm_head.weight", (4, 4)) and not c.is_matrix("fc2.weight", (4, 4))

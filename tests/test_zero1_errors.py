"""Clear errors for unsupported ds_config settings and bad optimizer params (named setting)."""
from __future__ import annotations

import warnings

import pytest

from _dist import run_distributed
from _models import HP, ds_config, make_model, run_engine, run_reference
from canzona_ds.integration.config import ALLOWED_KEYS, CanzonaMuonConfig

BAD_CONFIGS = {
    "stage2": (dict(zero_optimization={"stage": 2}), "zero_optimization.stage=1"),
    "stage0": (dict(zero_optimization={"stage": 0}), "zero_optimization.stage=1"),
    "bf16_fp32_accum": (dict(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}), "grad_accum_dtype"),
    "round_robin": (dict(zero_optimization={"stage": 1, "round_robin_gradients": True}), "round_robin_gradients"),
    "offload": (dict(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}), "offload_optimizer"),
    "unknown_key": (dict(optimizer={"type": "CanzonaMuon", "params": dict(HP, nesterow=True)}), "nesterow"),
    "bad_momentum": (dict(optimizer={"type": "CanzonaMuon", "params": dict(HP, momentum=1.5)}), "momentum=1.5"),
    "bad_planner": (dict(optimizer={"type": "CanzonaMuon", "params": dict(HP, planner="nope")}), "nope"),
}


def _session(rank, dp):
    import numpy as np

    out = {}
    for name, (extra, _) in BAD_CONFIGS.items():
        try:
            run_engine(rank, dp, ds_config(dp, **extra), 0)
            out[name] = None
        except (ValueError, TypeError) as err:
            out[name] = str(err)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        params, losses, engine = run_engine(rank, dp, ds_config(dp), 2, model=make_model(0, with_matrices=False))
    out["no_matrices"] = ([str(x.message) for x in w if "no parameter qualifies" in str(x.message)],
                          type(engine.optimizer).__name__, all(np.isfinite(l) for l in losses))
    tp_model = make_model(0)
    tagged = next(p for p in tp_model.parameters() if p.ndim == 2)
    tagged.tensor_model_parallel, tagged.partition_dim, tagged.partition_stride = True, 0, 1
    try:
        run_engine(rank, dp, ds_config(dp), 0, model=tp_model)
        out["tp_without_mpu"] = None
    except ValueError as err:
        out["tp_without_mpu"] = str(err)
    out["replicated"] = run_engine(rank, dp, ds_config(dp, zero_optimization={"stage": 0}, optimizer={
        "type": "CanzonaMuon", "params": dict(HP, replicated=True)}), 3)[0]
    return out


@pytest.fixture(scope="module")
def session():
    return run_distributed(_session, 1)[0]


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_names_the_setting(session, name):
    msg = session[name]
    assert msg is not None, f"{name} was accepted"
    assert BAD_CONFIGS[name][1] in msg, msg


def test_tp_tagged_params_without_mpu_are_refused_not_orthogonalised_per_shard(session):
    msg = session["tp_without_mpu"]
    assert msg is not None and "tensor_model_parallel" in msg and "mpu" in msg, msg


def test_no_matrices_falls_back_to_adamw_with_warning(session):
    warned, zero_cls, finite = session["no_matrices"]
    assert warned and finite
    assert zero_cls == "DeepSpeedZeroOptimizer"  # stock ZeRO-1, nothing to plan


def test_replicated_mode_matches_reference(session):
    import numpy as np

    ref = run_reference(1, 3)
    for n in ref:
        np.testing.assert_array_equal(session["replicated"][n], ref[n], err_msg=n)


# ---------------------------------------------------------------- no processes
def test_config_defaults_follow_deepspeed_muon():
    c = CanzonaMuonConfig.from_params({})
    assert (c.muon_lr, c.adam_lr, c.momentum, c.weight_decay, c.betas, c.eps) == (0.02, 3e-4, 0.95, 0.0,
                                                                                  (0.9, 0.95), 1e-10)
    c = CanzonaMuonConfig.from_params({"lr": 0.1, "adam_lr": 0.2})
    assert (c.muon_lr, c.adam_lr) == (0.1, 0.2)


@pytest.mark.parametrize("key,value,exc", [
    ("betas", [0.9, 1.0], ValueError), ("ns_method", "svd", ValueError), ("ns_steps", 0, ValueError),
    ("adjust_lr_fn", "x", ValueError), ("alpha", 2.0, ValueError), ("cost_model", "time", ValueError),
    ("nesterov", "yes", TypeError), ("lr", -1.0, ValueError), ("matrix_exclude", "embed", TypeError),
    ("weight_decay", -0.1, ValueError),
])
def test_config_rejects_bad_values(key, value, exc):
    with pytest.raises(exc, match=key if key != "lr" else "muon_lr"):
        CanzonaMuonConfig.from_params({key: value})


def test_every_key_documented():
    import pathlib

    doc = (pathlib.Path(__file__).parents[1] / "docs" / "zero1.md").read_text()
    for key in ALLOWED_KEYS:
        assert f"`{key}`" in doc, key


def test_matrix_filter_override():
    c = CanzonaMuonConfig.from_params({"matrix_include": ["lm_head"], "matrix_exclude": ["embed", "fc2"]})
    assert c.is_matrix("lm_head.weight", (4, 4)) and not c.is_matrix("fc2.weight", (4, 4))
    assert not c.is_matrix("proj.bias", (4,)) and c.is_matrix("qkv.weight", (4, 4))


def test_deepspeed_version_pinned(monkeypatch):
    import deepspeed

    from canzona_ds.integration import deepspeed_zero1

    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="0.19.8"):
        deepspeed_zero1.check_deepspeed_version()


def test_import_is_cheap():
    import subprocess
    import sys

    code = "import sys, canzona_ds; print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]

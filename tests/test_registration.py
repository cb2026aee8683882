"""``import canzona_ds`` registers the Canzona types with DeepSpeed, however DeepSpeed gets imported;
the DeepSpeed internals are checked at install (canzona_ds/integration/ds_compat.py).

Cost: 5 launching tests; 16 s on a 2-core AMD EPYC (docs/ci.md)."""
import subprocess
import sys

PROBE = """
import sys, importlib.util
import canzona_ds
{before}
import deepspeed
from canzona_ds.integration import registry as z
from deepspeed.runtime.engine import DeepSpeedEngine
assert z._installed, "the Canzona types were not registered"
assert all(DeepSpeedEngine._is_supported_optimizer(None, t) for t in ("CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"))
print("REGISTERED")
"""


def _run(before: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_then_deepspeed_registers():
    assert "REGISTERED" in _run("")


def test_find_spec_probe_does_not_use_up_the_hook():
    # transformers' is_deepspeed_available() probes with find_spec before importing
    assert "REGISTERED" in _run('assert importlib.util.find_spec("deepspeed") is not None\nassert "deepspeed" not in sys.modules')


def test_deepspeed_imported_first_registers():
    out = subprocess.run([sys.executable, "-c", "import deepspeed, canzona_ds\nfrom canzona_ds.integration import registry as z\nassert z._installed\nprint('REGISTERED')"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "REGISTERED" in out.stdout, out.stderr[-3000:]


def test_internals_all_present():
    from canzona_ds.integration.ds_compat import missing_members

    assert missing_members() == []


def test_supported_range_is_setup_cfgs():
    import configparser
    from pathlib import Path

    from canzona_ds.integration import ds_compat

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert f"deepspeed{ds_compat.SUPPORTED_RANGE}" in cfg["options"]["install_requires"].split()
    assert [ds_compat.in_range(v) for v in ("0.17.6", "0.18.0", "0.19.6", "0.19.8+cpu", "0.19.12", "0.20.0rc1",
                                            "1.0.0")] == [False, True, True, True, True, False, False]


def test_deepspeed_outside_the_range_is_a_clear_error(monkeypatch):
    import deepspeed
    import pytest

    from canzona_ds.integration import ds_compat

    for version in ("0.20.0", "0.17.6"):
        monkeypatch.setattr(deepspeed, "__version__", version)
        with pytest.raises(RuntimeError, match=rf"supports deepspeed>=0\.18\.0,<0\.20 but deepspeed=={version} is"):
            ds_compat.check_deepspeed()


#: a real engine build under a DeepSpeed version outside the range (the version string seen by the
#: check is the only thing changed): import canzona_ds warns, and building the optimizer fails
OUTSIDE = """
import os, warnings
import deepspeed, torch
deepspeed.__version__ = "0.20.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import canzona_ds
print("WARNED", any("supports deepspeed>=0.18.0,<0.20" in str(w.message) for w in caught))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
for opt in ("AdamW", "CanzonaMuon"):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": opt, "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 1}}
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        print(opt, "BUILT")
    except RuntimeError as err:
        print(opt, "REFUSED", str(err))
"""


def test_outside_the_range_deepspeed_works_and_canzona_refuses_in_one_line():
    import os

    from canzona_testkit.dist import free_port

    env = dict(os.environ, PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "WARNED True" in lines and "AdamW BUILT" in lines, out.stdout + out.stderr[-3000:]
    refused = [ln for ln in lines if ln.startswith("CanzonaMuon")]
    assert refused == ["CanzonaMuon REFUSED canzona_ds supports deepspeed>=0.18.0,<0.20 but deepspeed==0.20.0 is "
                       "installed; install a release in that range (pip install 'deepspeed>=0.18.0,<0.20')."], out.stdout


def test_missing_internal_is_named(monkeypatch):
    import pytest

    from canzona_ds.integration import ds_compat

    monkeypatch.setattr(ds_compat, "CLASS_MEMBERS", ds_compat.CLASS_MEMBERS + (("deepspeed.runtime.engine",
                                                                                  "DeepSpeedEngine._gone_in_next_release"),))
    with pytest.raises(RuntimeError, match="_gone_in_next_release"):
        ds_compat.check_deepspeed()


def test_feature_of_a_newer_release_is_refused_by_name(monkeypatch):
    import pytest

    from canzona_ds.integration import ds_compat

    import deepspeed
    from packaging.version import Version

    # detection by what the module has agrees with the release each feature names (ds_compat's
    # table), on the installed release
    installed = Version(deepspeed.__version__)
    assert {k: ds_compat.has(k) for k in ds_compat.FEATURES} == {
        k: installed >= Version(f.since) for k, f in ds_compat.FEATURES.items()}, installed
    monkeypatch.setitem(ds_compat.FEATURES, "per_head_muon",
                        ds_compat.Feature("0.19.8", "it uses DeepSpeed's own head resolution",
                                          (("deepspeed", "_per_head_muon_meta_gone"),)))
    with pytest.raises(ds_compat.UnsupportedByRelease, match=r"CanzonaMuon per_head_muon=true needs deepspeed>=0\.19\.8:"
                       r" it uses DeepSpeed's own head resolution; deepspeed==\S+ is installed\. Upgrade DeepSpeed "
                       r"\(pip install 'deepspeed>=0\.19\.8,<0\.20'\) or remove CanzonaMuon per_head_muon=true\.$"):
        ds_compat.require("per_head_muon", "CanzonaMuon per_head_muon=true")


def test_features_are_detected_by_what_the_release_has(monkeypatch):
    """The probes read the module, not the version: ZeRO-1/2's per-parameter padding is the
    ``param_padding`` argument, the pipeline's scaling PipelineEngine's own override."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from canzona_ds.integration import ds_compat

    assert ds_compat.has("zero12_param_padding") and ds_compat.has("pipeline_grad_scaling")
    monkeypatch.setattr(DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned",
                        lambda self, tensor_list, alignment, use_cpu_data=False: None)  # 0.19.6's signature
    monkeypatch.delattr(PipelineEngine, "_backward_prologue_per_tensor")  # the engine's, not overridden
    assert not ds_compat.has("zero12_param_padding") and not ds_compat.has("pipeline_grad_scaling")
    assert ds_compat._present("deepspeed.runtime.pipe.engine", "PipelineEngine._backward_prologue_per_tensor")


#: a real engine build where the installed DeepSpeed lacks ZeRO-1/2's per-parameter padding (its
#: probe made false; nothing else changed): stages 0 and 3 build, 1 and 2 stop at the refusal
WITHOUT_PADDING = """
import os, sys
import deepspeed, torch
from canzona_ds.integration import ds_compat
f = ds_compat.FEATURES["zero12_param_padding"]
ds_compat.FEATURES["zero12_param_padding"] = f._replace(probe=lambda: False)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
for stage in (0, 1, 2, 3):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "CanzonaMuon", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        print(stage, "BUILT")
    except ds_compat.UnsupportedByRelease as err:
        print(stage, "REFUSED", err.feature, str(err))
"""


def test_zero12_refused_by_name_where_the_release_lacks_per_parameter_padding():
    import os

    import deepspeed

    from canzona_testkit.dist import free_port

    env = dict(os.environ, PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", WITHOUT_PADDING], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln[:1].isdigit()]
    why = ("it writes the ownership plan into DeepSpeed's per-parameter padding of the ZeRO-1/2 flat buffer "
           "(flatten_dense_tensors_aligned(param_padding=), which older releases lack: their partitions cut "
           "matrices apart)")
    assert lines == ["0 BUILT"] + [
        f"{s} REFUSED zero12_param_padding CanzonaMuon at zero_optimization.stage {s} needs deepspeed>=0.19.7: "
        f"{why}; deepspeed=={deepspeed.__version__} is installed. Upgrade DeepSpeed (pip install "
        f"'deepspeed>=0.19.7,<0.20') or use zero_optimization.stage 0 or 3." for s in (1, 2)] + ["3 BUILT"], \
        out.stdout + out.stderr[-3000:]


def test_import_is_cheap():
    code = "import sys, canzona_ds; print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_known_bugs_are_those_the_installed_release_has(monkeypatch):
    """KNOWN_BUGS (DeepSpeed's own, no attribute tells them apart): named for the releases before
    the one that fixed each (the startup line names them; the tier skips what they break)."""
    import deepspeed

    from canzona_ds.integration import ds_compat

    seen = {}
    for v in ("0.18.0", "0.19.2", "0.19.3", "0.19.7", "0.19.8", "0.19.12"):
        monkeypatch.setattr(deepspeed, "__version__", v)
        seen[v] = sorted(ds_compat.known_bugs())
    both = ["moe_stage0_fp32_checkpoint_load", "zero3_gather_race_gloo"]
    assert seen == {"0.18.0": both, "0.19.2": both, "0.19.3": ["zero3_gather_race_gloo"],
                    "0.19.7": ["zero3_gather_race_gloo"], "0.19.8": [], "0.19.12": []}

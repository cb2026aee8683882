"""``import canzona_ds`` registers the Canzona types with DeepSpeed, however DeepSpeed gets imported;
the pinned DeepSpeed internals are checked at install."""
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


def test_pinned_internals_all_present():
    from canzona_ds.integration.pinned import missing_members

    assert missing_members() == []


def test_wrong_deepspeed_version_is_a_clear_error(monkeypatch):
    import deepspeed
    import pytest

    from canzona_ds.integration import pinned

    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="pinned to deepspeed==0.19.8"):
        pinned.check_deepspeed()


def test_missing_internal_is_named(monkeypatch):
    import pytest

    from canzona_ds.integration import pinned

    monkeypatch.setattr(pinned, "CLASS_MEMBERS", pinned.CLASS_MEMBERS + (("deepspeed.runtime.engine",
                                                                            "DeepSpeedEngine._gone_in_next_release"),))
    with pytest.raises(RuntimeError, match="_gone_in_next_release"):
        pinned.check_deepspeed()


def test_import_is_cheap():
    code = "import sys, canzona_ds; print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]

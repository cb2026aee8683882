"""``import canzona_ds`` registers CanzonaMuon with DeepSpeed, however DeepSpeed gets imported."""
import subprocess
import sys

PROBE = """
import sys, importlib.util
import canzona_ds
{before}
import deepspeed
from canzona_ds.integration import deepspeed_zero1 as z
from deepspeed.runtime.engine import DeepSpeedEngine
assert z._installed, "CanzonaMuon was not registered"
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
    out = subprocess.run([sys.executable, "-c", "import deepspeed, canzona_ds\nfrom canzona_ds.integration import deepspeed_zero1 as z\nassert z._installed\nprint('REGISTERED')"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "REGISTERED" in out.stdout, out.stderr[-3000:]

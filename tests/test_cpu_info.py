"""py-cpuinfo's answer cached once per machine (canzona_ds/integration/cpu_info.py): DeepSpeed's CPU
op loads ask it in every rank, and each call starts two processes and sleeps a second.
Single process, no ranks; about a second."""
from __future__ import annotations

import json

import pytest

from canzona_ds.integration import cpu_info

pytestmark = pytest.mark.solo

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
cpu MHz\t\t: 2596.100
flags\t\t: fpu avx2 avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu MHz\t\t: 2601.300
"""


@pytest.fixture
def machine(tmp_path, monkeypatch):
    proc = tmp_path / "cpuinfo"
    proc.write_text(CPUINFO)
    real = cpu_info.machine_key
    monkeypatch.setattr(cpu_info, "machine_key", lambda: real(str(proc)))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    return proc


def _counting(answer):
    calls = []

    def get_cpu_info():
        calls.append(1)
        return dict(answer)

    return get_cpu_info, calls


def test_the_first_call_on_a_machine_computes_every_later_one_reads(machine, tmp_path):
    stock, calls = _counting({"arch": "X86_64", "flags": ["avx2"]})
    first, second = cpu_info.cached(stock), cpu_info.cached(stock)  # two processes' wrappers
    assert first() == {"arch": "X86_64", "flags": ["avx2"]}
    assert second() == first() and len(calls) == 1
    path = cpu_info.cache_path()
    assert path.startswith(str(tmp_path / "ops" / "cpuinfo")) and json.loads(open(path).read())["arch"] == "X86_64"


def test_another_processor_gets_its_own_file(machine):
    key = cpu_info.machine_key()
    machine.write_text(CPUINFO.replace("avx512f", ""))
    assert cpu_info.machine_key() != key
    machine.write_text(CPUINFO.replace("2596.100", "3000.000"))  # the clock is not the processor
    assert cpu_info.machine_key() == key


def test_a_damaged_or_empty_cache_is_computed_again(machine):
    stock, calls = _counting({"arch": "X86_64"})
    cached = cpu_info.cached(stock)
    cached()
    open(cpu_info.cache_path(), "w").write("{not json")
    assert cached() == {"arch": "X86_64"} and len(calls) == 2
    open(cpu_info.cache_path(), "w").write("{}")
    assert cached() == {"arch": "X86_64"} and len(calls) == 3
    assert cached() == {"arch": "X86_64"} and len(calls) == 3


def test_a_failed_answer_is_not_cached(machine):
    stock, calls = _counting({})  # py-cpuinfo answers {} when its subprocess fails
    cached = cpu_info.cached(stock)
    assert cached() == {} and cached() == {} and len(calls) == 2


def test_no_proc_cpuinfo_means_no_cache(tmp_path, monkeypatch):
    real = cpu_info.machine_key
    monkeypatch.setattr(cpu_info, "machine_key", lambda: real(str(tmp_path / "absent")))
    stock, calls = _counting({"arch": "X86_64"})
    cached = cpu_info.cached(stock)
    cached(), cached()
    assert len(calls) == 2 and cpu_info.machine_key() is None


def test_install_wraps_py_cpuinfo_once_and_can_be_turned_off(monkeypatch):
    cpuinfo = pytest.importorskip("cpuinfo")
    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # restored after the test
    assert cpu_info.install() and getattr(cpuinfo.get_cpu_info, "_canzona_cached", False)
    wrapped = cpuinfo.get_cpu_info
    assert cpu_info.install() and cpuinfo.get_cpu_info is wrapped
    monkeypatch.setenv(cpu_info.ENV, "0")
    assert not cpu_info.install()

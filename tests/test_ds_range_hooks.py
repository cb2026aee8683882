"""The DeepSpeed-range tier's outcome rewriting (tests/conftest.py ``pytest_runtest_makereport``):
on a release that lacks a feature a tier test needs, the test passes as a skip only if it stopped
at exactly that feature's refusal; any other failure, or a pass, stays a failure; one that skips
itself is reported as such and counted at the end (issue 46).

Run in-process with pytester on tiny generated tests (no DeepSpeed engine, no ranks: ~1 s): the
refusal is DeepSpeed-free (``ds_compat.require`` on a feature whose members are made absent).
"""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

#: the hook under test, loaded from the suite's conftest as a plugin of the inner session
PLUGIN = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("_canzona_suite_conftest", {str(CONFTEST)!r})
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
pytest_runtest_makereport = _suite.pytest_runtest_makereport
pytest_runtest_logreport = _suite.pytest_runtest_logreport
pytest_terminal_summary = _suite.pytest_terminal_summary
'''

TESTS = '''
import pytest

from canzona_ds.integration import ds_compat


@pytest.fixture(autouse=True)
def release_lacks_per_head_muon(request, monkeypatch):
    """What the tier's collection hook marks on a release without the feature; the feature's
    members made absent, so ds_compat.require refuses it here with its real words."""
    request.node.user_properties.append(("canzona_refused", ["per_head_muon"]))
    real = ds_compat.FEATURES["per_head_muon"]
    monkeypatch.setitem(ds_compat.FEATURES, "per_head_muon",
                        ds_compat.Feature(real.since, real.why, (("deepspeed", "_absent_for_the_test"),)))


def test_stops_at_the_refusal():
    ds_compat.require("per_head_muon", "CanzonaMuon per_head_muon=true")


def test_fails_otherwise():
    raise RuntimeError("an unrelated failure: a shape mismatch")


def test_fails_an_assertion():
    assert 1 == 2


def test_passes():
    pass


def test_skips_itself():
    pytest.skip("nothing to run here")
'''


def test_only_the_refusal_turns_a_failure_into_a_skip(pytester):
    pytester.makepyfile(ds_range_hook_plugin=PLUGIN, test_tier=TESTS)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-p", "ds_range_hook_plugin", "-rA", "-p", "no:cacheprovider")
    outcomes = {r.nodeid.split("::")[-1]: r.outcome for r in result.reprec.getreports("pytest_runtest_logreport")
                if r.when == "call" or (r.when == "setup" and r.outcome == "skipped")}
    assert outcomes == {"test_stops_at_the_refusal": "skipped", "test_fails_otherwise": "failed",
                        "test_fails_an_assertion": "failed", "test_passes": "failed", "test_skips_itself": "skipped"}
    result.stdout.fnmatch_lines(["*refused by name as it should be (per_head_muon)*"])
    text = result.stdout.str()
    assert "but it failed otherwise" in text and "an unrelated failure" in text and "but it passed" in text
    # a test that skipped itself is reported as such, and counted
    result.stdout.fnmatch_lines(["*1 tests skipped themselves on a release lacking a feature*",
                                 "*test_tier.py::test_skips_itself",
                                 "*nothing to run here [[]skipped itself on a release lacking per_head_muon*"])

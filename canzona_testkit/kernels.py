"""Kernel configurations: which tests promise bits, and the thread count both sides run with.

A bit-for-bit assertion holds on every CPU only when both sides run the same operations on the
same inputs through the same code path (docs/zero.md, "Exactness on any CPU").  Two different
code paths can agree bit for bit on one CPU by luck (the same kernel happened to be picked, a
reduction happened to split the same way) and disagree on another: an AVX2-only AMD EPYC, another
thread count.  So CI reruns every test that asserted bit for bit under another kernel
configuration (``.ci/kernels``), and which tests those are is recorded, not hand-kept:

* ``record_exact_assertions()`` wraps the equality primitives the suite uses on floating values
  (``torch.equal``, ``torch.testing.assert_close`` and ``numpy.testing.assert_allclose`` with
  ``rtol=0, atol=0``, ``numpy.testing.assert_array_equal``/``assert_equal``); a call from test
  code (``tests/``, ``canzona_testkit/``) on floating values marks the running test, and so does
  ``canzona_testkit.models.max_abs_diff`` when it finds two results equal (``max_abs_diff(a, b)
  == 0.0``, the other spelling of a bit-for-bit assertion: ``note_exact``).  With
  ``CANZONA_EXACT_LOG=<file>`` set, the session appends the marked node ids there
  (tests/conftest.py).  A contributor who writes a bit-for-bit assertion has enrolled the test.
* ``assert_bits(actual, expected)`` (``bits_differ`` where a check collects its findings) is the
  one way a test asserts bit for bit on values the primitives above do not take (floats, lists
  of losses, dicts of arrays, a difference that must be 0.0); it enrolls the test whatever it
  compares.  ``tests/test_layering.py`` fails on the
  forms that would escape the recorder (``np.array_equal``, ``(a == b).all()``, ``==`` on a
  float literal or a loss, ``.tolist() ==``).
* In a rank process (``canzona_testkit/dist.py``) there is no running test: a bit-for-bit
  assertion there sets ``asserted`` and the rank reports it with its result, so the parent
  enrolls the test that started the ranks, and every test that reads that result later (a
  module's cached batch of scenarios: ``rank_report``).
* ``test_threads()`` is the intra-op thread count the ranks *and* the single-process references
  run with (``CANZONA_TEST_THREADS``, default 1): the same count on both sides keeps "the same
  operations" true while CI varies it.  One thread per rank, because a test's ranks already
  fill the cores (two ranks on two cores; four ranks oversubscribe).
* ``solo_threads()`` is the count for a test marked ``solo`` (a module's ``pytestmark``): it
  starts no rank and compares only computations of its own process, so both sides share
  whatever count it runs with, and it takes every core (``CANZONA_SOLO_THREADS``, default the
  larger of ``test_threads()`` and the core count).  ``run_distributed`` refuses to start ranks
  from a process whose count differs from ``test_threads()``: a ``solo`` mark on a test that
  starts ranks fails by name instead of comparing across thread counts.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

THREADS_ENV = "CANZONA_TEST_THREADS"
LOG_ENV = "CANZONA_EXACT_LOG"
_ROOT = Path(__file__).resolve().parents[1]
_TEST_DIRS = (str(_ROOT / "tests") + os.sep, str(_ROOT / "canzona_testkit") + os.sep)

#: the node id of the test running now (set by tests/conftest.py), and the ones that asserted bits
current: list[str | None] = [None]
exact: set[str] = set()
#: whether this process asserted bit for bit at all (a rank reports it to the parent: ``rank_report``)
asserted: list[bool] = [False]


def _threads_env(name: str, default: int) -> int:
    """A thread count from the environment variable ``name`` (``default`` when unset)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"Invalid {name}={raw!r}. Allowed: a positive integer.")
    return n


def test_threads() -> int:
    """Intra-op threads for ranks and references alike (``CANZONA_TEST_THREADS``, default 1)."""
    return _threads_env(THREADS_ENV, 1)


test_threads.__test__ = False  # a helper, not a test, for pytest's collector

SOLO_ENV = "CANZONA_SOLO_THREADS"


def solo_threads() -> int:
    """Intra-op threads for a test marked ``solo`` (``CANZONA_SOLO_THREADS``, default
    ``max(test_threads(), os.cpu_count())``)."""
    return _threads_env(SOLO_ENV, max(test_threads(), os.cpu_count() or 1))


def threads_for(item) -> int:
    """The intra-op thread count a pytest item runs with: ``solo_threads()`` when it is marked
    ``solo``, else ``test_threads()``."""
    return solo_threads() if item.get_closest_marker("solo") is not None else test_threads()


def _floating(x) -> bool:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        return x.is_floating_point() or x.is_complex()
    if isinstance(x, float):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "fc"
    if isinstance(x, (list, tuple)):
        return any(_floating(v) for v in x)
    if isinstance(x, dict):
        return any(_floating(v) for v in x.values())
    return False


def _from_test_code() -> bool:
    frame = sys._getframe(3)  # _from_test_code <- _mark <- the wrapper <- its caller
    return frame.f_code.co_filename.startswith(_TEST_DIRS)


def _mark(*values) -> None:
    if any(_floating(v) for v in values) and _from_test_code():
        note_exact()


def note_exact() -> None:
    """Enroll the running test: it asserted bit for bit, or a test-kit helper found two float
    results equal bit for bit (``canzona_testkit.models.max_abs_diff`` returning 0.0), or its
    result depends on this CPU's kernels (a premise a bound is derived from).  In a rank process
    the mark travels to the parent with the rank's result (``rank_report``)."""
    asserted[0] = True
    if current[0] is not None:
        exact.add(current[0])


class _Enrolling(dict):
    """A rank's result from a rank that asserted bit for bit: reading an entry enrolls the running
    test, so every test that checks its part of a cached batch of scenarios (one
    ``run_distributed`` read by many tests) is enrolled, not only the one that started it."""

    def __getitem__(self, key):
        note_exact()
        return super().__getitem__(key)

    def get(self, key, default=None):
        note_exact()
        return super().get(key, default)


def rank_report(result, report: bool):
    """The parent's side of a rank's mark: enroll the running test when the rank asserted bit for
    bit (``report``), and hand back the rank's result (``canzona_testkit.dist``), a dict as one
    whose reads enroll the test reading it."""
    if not report:
        return result
    note_exact()
    return _Enrolling(result) if type(result) is dict else result


def _differ(a, b, where: str) -> str | None:
    import numpy as np
    import torch

    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or set(a) != set(b):
            return f"{where}: keys differ: {sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__} vs " \
                   f"{sorted(map(str, b)) if isinstance(b, dict) else type(b).__name__}"
        for k in a:
            why = _differ(a[k], b[k], f"{where}[{k!r}]")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b):
            return f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = _differ(x, y, f"{where}[{i}]")
            if why:
                return why
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = (torch.as_tensor(v) for v in (a, b))
        if a.shape != b.shape:
            return f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        floating = a.is_floating_point() or a.is_complex()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if floating else a == b
        if bool(same.all()):
            return None
        diff = (a.double() - b.double()).abs()[~same]
        return f"{where}: {int((~same).sum())} of {a.numel()} elements differ, max |diff| {float(diff.max()):.3g}"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return f"{where}: shape {a.shape} vs {b.shape}"
        floating = a.dtype.kind in "fc" and b.dtype.kind in "fc"
        same = (a == b) | (np.isnan(a) & np.isnan(b)) if floating else a == b
        if bool(np.all(same)):
            return None
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))[~same]
        return f"{where}: {int((~same).sum())} of {a.size} elements differ, max |diff| {float(diff.max()):.3g}"
    if isinstance(a, float) or isinstance(b, float):
        if a == b or (a != a and b != b):
            return None
        return f"{where}: {a!r} vs {b!r} (diff {abs(a - b):.3g})"
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def bits_differ(actual, expected) -> str | None:
    """Why ``actual`` and ``expected`` are not the same values bit for bit, or None; enrolls the
    running test like ``assert_bits`` (for checks that collect their findings before asserting,
    and for ranks that return the verdict to the parent)."""
    note_exact()
    return _differ(actual, expected, "value")


def assert_bits(actual, expected, what: object = "") -> None:
    """Assert ``actual`` and ``expected`` hold the same values bit for bit, and enroll the running
    test in .ci/kernels' rerun (in a rank: report it to the parent).  Takes tensors and numpy arrays
    (same shape, equal values as ``torch.equal`` and ``assert_array_equal`` read them, NaN matching
    NaN), floats, and lists, tuples and dicts of them (same keys); a
    difference that must vanish is ``assert_bits(d, 0.0)``.  The one way the suite asserts bit for
    bit on values ``torch.equal`` and the zero-tolerance primitives do not take."""
    why = bits_differ(actual, expected)
    if why is not None:
        raise AssertionError(f"not bit for bit: {why}" + (f" ({what})" if what != "" else ""))


def _zero_tolerance(kwargs: dict, default_rtol, default_atol) -> bool:
    return kwargs.get("rtol", default_rtol) == 0 and kwargs.get("atol", default_atol) == 0


def record_exact_assertions() -> None:
    """Wrap the equality primitives once per process (idempotent)."""
    import numpy as np
    import torch

    if getattr(torch.equal, "_canzona_recorded", False):
        return

    def wrap(module, name, exact_when):
        stock = getattr(module, name)

        @functools.wraps(stock)
        def recorded(*args, **kwargs):
            if exact_when(args, kwargs):
                _mark(*args[:2])
            return stock(*args, **kwargs)

        recorded._canzona_recorded = True
        setattr(module, name, recorded)

    always = lambda a, k: True  # noqa: E731
    wrap(torch, "equal", always)
    wrap(torch.testing, "assert_close", lambda a, k: _zero_tolerance(k, None, None))
    wrap(np.testing, "assert_array_equal", always)
    wrap(np.testing, "assert_equal", always)
    wrap(np.testing, "assert_allclose", lambda a, k: _zero_tolerance(k, 1e-7, 0))


def write_log() -> None:
    path = os.environ.get(LOG_ENV)
    if path and exact:
        with open(path, "a") as f:
            f.writelines(f"{nodeid}\n" for nodeid in sorted(exact))

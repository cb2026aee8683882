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


def test_threads() -> int:
    """Intra-op threads for ranks and references alike (``CANZONA_TEST_THREADS``, default 1)."""
    raw = os.environ.get(THREADS_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"Invalid {THREADS_ENV}={raw!r}. Allowed: a positive integer.")
    return n


test_threads.__test__ = False  # a helper, not a test, for pytest's collector

SOLO_ENV = "CANZONA_SOLO_THREADS"


def solo_threads() -> int:
    """Intra-op threads for a test marked ``solo`` (``CANZONA_SOLO_THREADS``, default
    ``max(test_threads(), os.cpu_count())``)."""
    raw = os.environ.get(SOLO_ENV)
    if raw is None:
        return max(test_threads(), os.cpu_count() or 1)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"Invalid {SOLO_ENV}={raw!r}. Allowed: a positive integer.")
    return n


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
    if current[0] is not None and any(_floating(v) for v in values) and _from_test_code():
        exact.add(current[0])


def note_exact() -> None:
    """Enroll the running test: a test-kit helper found two float results equal bit for bit
    (``canzona_testkit.models.max_abs_diff`` returning 0.0, which ``== 0.0`` assertions read)."""
    if current[0] is not None:
        exact.add(current[0])


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

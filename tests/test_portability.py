"""The premises of the suite's tolerances, checked on the CPU the suite runs on.

The suite promises bit-exactness only where both sides of a comparison run the same arithmetic
on the same values (world 2: two-term sums are commutative; replays of an owner's update from the
gradient it received; one kernel on both sides).  Where the two sides sum the same terms in another
order (4-rank all-reduces, TP-split products), which bits come out depends on the CPU's kernels
(AVX-512 or AVX2 sgemm, oneDNN's bf16 kernels or ATen's fallback where a CPU has none), and the
tests bound the distance instead: ``canzona_testkit.models.muon_reordered_sum_tolerance``.
These tests pin what that bound stands on, so a CPU on which it would not hold fails here, by name.

CI reruns every test that asserted bit for bit under another kernel configuration (``.ci/kernels``:
the AVX2 kernels and more threads than cores; ``canzona_testkit/kernels.py``), so a promise that
holds only on some CPUs or thread counts fails on every machine.
"""
from __future__ import annotations

import pytest
import torch

from canzona_ds.optim.muon import newton_schulz
from canzona_testkit.models import NS_FLIP_BOUND, TEST_MATRIX_ASPECT, make_model
from canzona_testkit.kernels import assert_bits


#: every matrix shape the multi-rank tests' models hold (TinyLM; canzona_testkit.moe's dense, expert and
#: TP-split matrices)
def _test_shapes() -> set[tuple[int, int]]:
    from canzona_testkit.moe import TP_SPLIT, _shapes

    shapes = {tuple(p.shape) for p in make_model(0).parameters() if p.ndim == 2}
    shapes |= {tuple(s) for s in _shapes(4).values() if len(s) == 2}
    shapes |= {tuple(shape) for shape, _ in TP_SPLIT.values()}
    return shapes


def test_matrix_aspect_bound_covers_the_test_models():
    for rows, cols in _test_shapes():
        assert max(rows / cols, cols / rows) <= TEST_MATRIX_ASPECT, (rows, cols)


def test_bf16_newton_schulz_flip_bound():
    """Round up to 32 input elements to the neighbouring bf16 value: every output element moves by
    at most NS_FLIP_BOUND, and some do move (why reordered sums are not bit-exact under Muon)."""
    g = torch.Generator().manual_seed(0)
    shapes = sorted(_test_shapes())
    from canzona_testkit.kernels import note_exact

    note_exact()  # a premise about this CPU's kernels: .ci/kernels reruns it on the others
    worst = 0.0
    for trial in range(200):
        rows, cols = shapes[trial % len(shapes)]
        G = (torch.randn(rows, cols, generator=g) * (0.1 + trial % 7)).bfloat16()
        k = 1 + trial % 32
        idx = torch.randperm(rows * cols, generator=g)[:k]
        flipped = G.flatten().clone()
        flipped[idx] = torch.nextafter(flipped[idx], torch.full((k,), float("inf"), dtype=torch.bfloat16))
        a = newton_schulz(G.float()).float()
        b = newton_schulz(flipped.view(rows, cols).float()).float()
        worst = max(worst, float((a - b).abs().max()))
    print(f"bf16 Newton-Schulz: largest output move for <= 32 flipped input roundings = {worst:.3g}")
    assert 0.0 < worst <= NS_FLIP_BOUND


def test_fp32_ulps_in_the_input_rarely_reach_bf16():
    """The other half of the picture: a one-ulp fp32 change of every input element (what a
    reordered sum does) leaves bf16 Newton-Schulz's output unchanged unless an element sits at a
    bf16 rounding boundary, so small runs are often bit-identical by luck; which runs are depends
    on the values, and so on the CPU's kernels."""
    g = torch.Generator().manual_seed(1)
    unchanged = 0
    for trial in range(50):
        G = torch.randn(48, 16, generator=g)
        ulp = torch.nextafter(G.abs(), torch.full_like(G, float("inf"))) - G.abs()
        moved = G + ulp * torch.sign(torch.randn(48, 16, generator=g))
        unchanged += torch.equal(newton_schulz(G), newton_schulz(moved))
    assert unchanged >= 40, unchanged


def test_bit_for_bit_assertions_on_floats_enroll_the_running_test(monkeypatch):
    """.ci/kernels reruns what this records: every form of float equality from test code enrolls
    the test (the recorded primitives, ``assert_bits``, ``bits_differ``, ``max_abs_diff`` finding
    0.0, a rank's report to the parent), an integer one or a bounded comparison does not.  The
    forms the recorder cannot see are refused in the source (tests/test_layering.py)."""
    import numpy as np

    from canzona_testkit import kernels

    monkeypatch.setattr(kernels, "exact", set())
    monkeypatch.setattr(kernels, "current", ["t::ints"])
    monkeypatch.setattr(kernels, "asserted", [False])
    from canzona_testkit.models import max_abs_diff

    assert torch.equal(torch.arange(3), torch.arange(3))
    np.testing.assert_array_equal(np.arange(3), np.arange(3))
    torch.testing.assert_close(torch.ones(2), torch.ones(2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.ones(2), np.ones(2), rtol=1e-6)
    assert max_abs_diff({"w": np.ones(2)}, {"w": np.zeros(2)}) > 0.5
    assert kernels.exact == set() and not kernels.asserted[0]
    forms = {
        "t::equal": lambda: torch.equal(torch.ones(2), torch.ones(2)),
        "t::close": lambda: torch.testing.assert_close(torch.ones(2), torch.ones(2), rtol=0, atol=0),
        "t::numpy": lambda: np.testing.assert_array_equal(np.ones(2), np.ones(2)),
        "t::numpy_equal": lambda: np.testing.assert_equal(np.ones(2), np.ones(2)),
        "t::allclose": lambda: np.testing.assert_allclose(np.ones(2), np.ones(2), rtol=0, atol=0),
        "t::diff": lambda: max_abs_diff({"w": np.ones(2)}, {"w": np.ones(2)}),
        "t::bits": lambda: kernels.assert_bits([1.5, 2.5], [1.5, 2.5]),
        "t::bits_int": lambda: kernels.assert_bits(3, 3),  # assert_bits enrolls whatever it compares
        "t::differ": lambda: kernels.bits_differ({"w": np.ones(2)}, {"w": np.ones(2)}),
        "t::rank": lambda: kernels.rank_report({"loss": 1.0}, True),  # a rank that asserted bits
    }
    for name, check in forms.items():
        kernels.current[0] = name
        check()
    cached = kernels.rank_report({"same_state": True}, True)  # (by "t::rank", the last form)
    kernels.current[0] = "t::quiet_rank"
    assert type(kernels.rank_report({"steps": 3}, False)) is dict  # nothing to enroll: a plain dict
    assert kernels.exact == set(forms)
    # a later test reading a cached result of a rank that asserted bits is enrolled too
    kernels.current[0] = "t::reads_the_cache"
    assert cached["same_state"]
    forms["t::reads_the_cache"] = None
    assert kernels.exact == set(forms)
    # in a rank there is no running test: the assertion sets the flag the rank reports
    kernels.current[0], kernels.asserted[0] = None, False
    kernels.assert_bits(torch.zeros(2), torch.zeros(2))
    assert kernels.asserted[0] and kernels.exact == set(forms)


def test_assert_bits_says_what_differs():
    import numpy as np

    from canzona_testkit.kernels import assert_bits, bits_differ

    nan = float("nan")
    assert_bits({"w": torch.tensor([1.0, nan]), "l": [0.5, nan]}, {"w": torch.tensor([1.0, nan]), "l": [0.5, nan]})
    cases = [
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0))]),
         "1 of 2 elements differ"),
        (np.zeros((2, 2)), np.zeros((2, 3)), "shape (2, 2) vs (2, 3)"),
        ([0.1, 0.2], [0.1, 0.2 + 2 ** -55], "value[1]: 0.2 vs"),
        ({"a": 1.0}, {"b": 1.0}, "keys differ"),
        (1e-30, 0.0, "1e-30 vs 0.0"),
        ([1.0], [1.0, 2.0], "value: [1.0] vs [1.0, 2.0]"),
    ]
    for a, b, why in cases:
        assert why in bits_differ(a, b), (why, bits_differ(a, b))
        with pytest.raises(AssertionError, match="not bit for bit"):
            assert_bits(a, b, "context")


def test_test_threads_names_a_bad_value(monkeypatch):
    from canzona_testkit.kernels import THREADS_ENV, test_threads

    monkeypatch.setenv(THREADS_ENV, "3")
    assert test_threads() == 3
    for bad in ("0", "x"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{THREADS_ENV}={bad!r}"):
            test_threads()

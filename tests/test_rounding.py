"""The comparison rule of tests/rounding.py: it holds for every summation order a build may take, it catches a
dropped term, and it is the only tolerance the suite's numeric tests use."""
import os
import re

import pytest
import torch

from rounding import EPS32, Exact, assert_within_rounding, exact_linear

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("k", [7, 64, 1408, 4096])
def test_any_summation_order_is_within_the_bound(k):
    """float32 dot products summed forwards, backwards, pairwise and in 16 interleaved lanes (an AVX-512 tile's
    order) all pass against the float64 product, also where the terms cancel."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(5, k, generator=g), torch.randn(3, k, generator=g)
    w[0] = x[0] * torch.sign(torch.randn(k, generator=g))     # terms of equal size and random signs: cancellation
    exact = exact_linear(x, w)
    terms = x[:, None, :] * w[None, :, :]                      # [5, 3, k] float32 products

    def lanes(t, n):
        acc = torch.zeros(*t.shape[:-1], n)
        for i in range(0, t.shape[-1], n):
            chunk = t[..., i:i + n]
            acc[..., :chunk.shape[-1]] += chunk
        return acc.sum(-1)

    def pairwise(t):
        while t.shape[-1] > 1:
            if t.shape[-1] % 2:
                t = torch.cat((t, torch.zeros(*t.shape[:-1], 1)), -1)
            t = t[..., 0::2] + t[..., 1::2]
        return t[..., 0]

    forwards = torch.zeros(5, 3)
    for i in range(k):
        forwards += terms[..., i]
    backwards = torch.zeros(5, 3)
    for i in reversed(range(k)):
        backwards += terms[..., i]
    for got in (forwards, backwards, pairwise(terms), lanes(terms, 16), lanes(terms, 8)):
        assert_within_rounding(got, exact)


@pytest.mark.parametrize("k", [7, 37, 130])
def test_a_dropped_or_doubled_term_fails(k):
    """What the short cases of each operator test are for: a tail bug (the last term lost or counted twice)."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(4, k, generator=g), torch.randn(6, k, generator=g)
    exact = exact_linear(x, w)
    for wrong in (x[:, :-1] @ w[:, :-1].T, x @ w.T + x[:, -1:] * w[None, :, -1]):
        with pytest.raises(AssertionError, match="outside the rounding bound"):
            assert_within_rounding(wrong, exact)


def test_the_bound_counts_roundings_to_a_narrow_type():
    """A bf16 result of an exact value is within one bf16 rounding; a value off by two bf16 steps is not; a
    subnormal result of a product is allowed its step times the other factor."""
    value = torch.linspace(-3, 3, 101, dtype=torch.float64)
    exact = Exact(value, value.abs(), 0)
    assert_within_rounding(value.to(torch.bfloat16), exact)
    off = value.to(torch.bfloat16).double() * (1 + 4 * torch.finfo(torch.bfloat16).eps)
    with pytest.raises(AssertionError):
        assert_within_rounding(off.to(torch.bfloat16), exact)
    tiny = torch.full((3,), 1e-6, dtype=torch.float64)
    step = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps
    got = (tiny + 5 * step).to(torch.float16)
    with pytest.raises(AssertionError):
        assert_within_rounding(got, Exact(tiny, tiny, 0))
    assert_within_rounding(got, Exact(tiny, tiny, 0, subnormal_gain=8.0))
    assert EPS32 == 2 ** -23


# torch's and numpy's tolerance arguments and comparisons, and a literal added to a bound: every numeric comparison of
# tests/ goes through rounding.py instead, whose bound follows the arithmetic
FORBIDDEN = re.compile(r"\b(atol|rtol)\s*=|assert_close\(|allclose\(|isclose\(|<=[^\n#]*\+\s*\d+(\.\d+)?e-\d+")


def test_no_test_compares_with_a_fixed_tolerance():
    found = []
    for name in sorted(os.listdir(TESTS)):
        if name.endswith(".py") and name not in ("rounding.py", "test_rounding.py"):   # the rule, and these forms
            with open(os.path.join(TESTS, name)) as f:
                found += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if FORBIDDEN.search(line)]
    assert not found, "fixed tolerances (use tests/rounding.py's rule):\n" + "\n".join(found)


def test_the_check_sees_the_forms_it_forbids():
    for line in ("torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)", "np.allclose(a, b)",
                 "assert (err <= bound + 1e-6).all()", "math.isclose(a, b)"):
        assert FORBIDDEN.search(line), line
    for line in ("ops.rms_norm(out, x, w, 1e-6)", "assert_within_rounding(got, exact)"):
        assert not FORBIDDEN.search(line), line

"""Property-based fuzzing (hypothesis) of band.py's invariants over extreme inputs and every dtype.

Claims: for any old log-probability (including 0, values slightly above 0, subnormal p, -inf, the edges of each
dtype's range) and any delta > 0, band() returns finite-or-inf numbers with 0 <= lower <= 1 <= upper <= 1/p in the
input's dtype (Theorem 1's interval inside the simplex), float32 agrees with float64, the bounds are monotone in p
(Prop. 2), and ratio_bounds keeps every method's interval inside [0, max_ratio] around 1.
"""
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import band
from test_band import F  # the generators f, f', written independently of band.py
from test_band import one_thread  # noqa: F401  (autouse fixture: one torch thread per test)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIAL = [0.0, -0.0, 1e-7, 1e-3, -1e-45, -1e-38, -1e-30, -1e-12, -6e-8, -1e-7, -0.6931, -11.0, -17.0, -60.0,
           -87.3, -88.8, -103.0, -104.0, -708.0, -745.2, -746.0, -1e4, -1e30, -math.inf]
log_probs = st.lists(
    st.one_of(
        st.sampled_from(SPECIAL),
        st.floats(-80, 0),  # the range that matters in practice
        st.floats(-20, 0).map(lambda v: -(10**v)),  # log p near 0 (p near 1), down to -1e-20
        st.floats(-1e5, 1e-2, allow_nan=False),
    ),
    min_size=1,
    max_size=12,
)
deltas = st.floats(-6, math.log10(50)).map(lambda e: 10**e)
# derandomize: `make test` draws the same 120 examples every run (CI must not fail by chance); set it to False
# (or pass --hypothesis-seed with derandomize off) to explore new examples locally.
FUZZ = settings(max_examples=120, deadline=None, derandomize=True)


def inv_p(logp):
    """1/p as band documents it: exp(-log p) in the working dtype (float32 for half types), log p > 0 -> 0."""
    work = torch.float32 if logp.dtype in (torch.float16, torch.bfloat16) else logp.dtype
    return torch.exp(-logp.to(work).clamp_max(0)).to(logp.dtype)


@FUZZ
@given(log_probs, st.sampled_from(DTYPES), st.sampled_from(sorted(band.DIVERGENCES)), deltas)
def test_theorem1_fuzz_band_stays_inside_the_simplex(values, dtype, name, delta):
    """0 <= lower <= 1 <= upper <= 1/p, no NaN, same shape and dtype, for every dtype and divergence."""
    logp = torch.tensor(values, dtype=torch.float64).to(dtype)
    lower, upper = band.band(logp, name, delta)
    assert lower.dtype == upper.dtype == dtype and lower.shape == upper.shape == logp.shape
    assert not lower.isnan().any() and not upper.isnan().any()
    assert (lower >= 0).all() and (lower <= 1).all()
    assert (upper >= 1).all() and (upper <= inv_p(logp)).all()


@FUZZ
@given(st.lists(st.floats(-60, -1e-12), min_size=1, max_size=12), st.sampled_from(sorted(band.DIVERGENCES)),
       st.floats(-4, math.log10(2)).map(lambda e: 10**e))
def test_theorem1_fuzz_float32_agrees_with_float64(values, name, delta):
    """On the same (float32) log p, the float32 bounds are the float64 ones to float32 accuracy: relative 1e-5, plus
    what rounding p and delta to float32 forces, 4 u kappa with kappa = (|p dg/dp| + delta) / |r dg/dr| (large where
    the lower bound is near 0: KL's tiny roots, Hellinger near saturation), plus float32's subnormal spacing."""
    logp = torch.tensor(values, dtype=torch.float32)
    lo32, up32 = band.band(logp, name, delta)
    lo64, up64 = band.band(logp.double(), name, delta)
    f, df = F[name]
    p, q = logp.double().exp(), -logp.double().expm1()
    r = lo64.clamp_min(1e-300)
    c = (1 - p * r) / q
    g_p = f(r) - f(c) + df(c) * (1 - r) / q  # implicit function theorem on g(p, r) = delta
    g_r = p * (df(r) - df(c))
    kappa = ((p * g_p).abs() + delta) / (r * g_r).abs()
    tol_lo = (1e-5 + 4 * 2.0**-24 * kappa.nan_to_num(0, posinf=0)) * lo64 + 3e-45
    assert ((lo32.double() - lo64).abs() <= tol_lo).all(), (lo32, lo64)
    # upper: relative 1e-5 where float32 can hold it (it overflows only for delta near 2 beyond p ~ 1e-38)
    assert ((up32.double() - up64).abs() <= 1e-5 * up64).all(), (up32, up64)


@FUZZ
@given(log_probs, st.sampled_from([torch.float32, torch.float64]), st.sampled_from(sorted(band.DIVERGENCES)), deltas)
def test_prop2_fuzz_monotone_in_p(values, dtype, name, delta):
    """Prop. 2: sorting log p ascending sorts lower ascending and upper descending (within 4 ulps of rounding)."""
    logp = torch.tensor(sorted(values), dtype=torch.float64).to(dtype).clamp_max(0).sort().values
    lower, upper = band.band(logp, name, delta)
    eps = 4 * torch.finfo(dtype).eps
    assert (lower[1:] >= lower[:-1] * (1 - eps)).all(), lower
    assert (upper[1:] <= upper[:-1] * (1 + eps)).all(), upper


@FUZZ
@given(log_probs, st.sampled_from(DTYPES), st.sampled_from(sorted(band.BOUNDS)), deltas, st.floats(1, 100),
       st.one_of(st.none(), st.floats(0, 1)), st.one_of(st.none(), st.floats(0, 3)))
def test_ratio_bounds_fuzz_every_method(values, dtype, method, delta, max_ratio, eps_low, eps_high):
    """Every method of the comparison: 0 <= lower <= 1 <= upper <= max_ratio, no NaN, input dtype and shape."""
    logp = torch.tensor(values, dtype=torch.float64).to(dtype)
    lower, upper = band.ratio_bounds(logp, method, delta=delta, eps_low=eps_low, eps_high=eps_high,
                                     max_ratio=max_ratio)
    assert lower.dtype == upper.dtype == dtype and lower.shape == upper.shape == logp.shape
    assert not lower.isnan().any() and not upper.isnan().any()
    assert (lower >= 0).all() and (lower <= 1).all()
    assert (upper >= 1).all() and (upper <= torch.tensor(max_ratio, dtype=torch.float64).to(dtype)).all()

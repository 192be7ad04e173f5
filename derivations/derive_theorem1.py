"""Theorem 1 (exact scalarization): the reachable ratios are {r in [0, 1/p] : g_f(p, r) <= delta}, one interval.

With Lemma 1 the best new distribution giving token a the ratio r puts c = (1 - p r) / (1 - p) on every other
token, so D_f = g_f(p, r) = p f(r) + (1 - p) f(c). Derived here, for a symbolic f:
  dg/dr   = p [f'(r) - f'(c)]                       (dc/dr = -p / (1 - p))
  d2g/dr2 = p f''(r) + p^2 / (1 - p) f''(c) >= 0    (convex in r)
  g(p, 1) = 0 and dg/dr(p, 1) = 0                   (minimum 0 at r = 1)
so {g <= delta} is an interval [lower, upper] around 1. The specialisations (docs/paper.md §2):
  TV  g = p |r - 1|,   chi^2  g = p (r - 1)^2 / (1 - p),   KL  g = KL(Bern(p) || Bern(p r)),
  Hellinger (f = (sqrt u - 1)^2)  g = 2 - 2 (p sqrt(r) + (1 - p) sqrt(c)).
band.py evaluates g in x = log r (`band._g`): it must agree with the symbolic g, which the last test checks.

Run: python derivations/derive_theorem1.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402
from derive_lemma1 import GENERATORS, one_thread, u  # noqa: E402,F401  (one_thread: autouse fixture)

p = sp.symbols("p", positive=True)
r = sp.symbols("r", nonnegative=True)
c = (1 - p * r) / (1 - p)


def g_of(f):
    """g_f(p, r) for a sympy expression f(u)."""
    return p * f.subs(u, r) + (1 - p) * f.subs(u, c)


def test_theorem1_derivatives_of_g():
    """dg/dr = p [f'(r) - f'(c)] and d2g/dr2 = p f''(r) + p^2/(1-p) f''(c) for an arbitrary f."""
    f = sp.Function("f")
    g = p * f(r) + (1 - p) * f(c)
    fp = lambda z: sp.Subs(sp.Derivative(f(u), u), u, z)  # noqa: E731
    fpp = lambda z: sp.Subs(sp.Derivative(f(u), u, 2), u, z)  # noqa: E731
    assert sp.simplify((sp.diff(g, r) - p * (fp(r) - fp(c))).doit()) == 0
    assert sp.simplify((sp.diff(g, r, 2) - (p * fpp(r) + p**2 / (1 - p) * fpp(c))).doit()) == 0
    assert sp.simplify(g.subs(r, 1)) == f(1)  # = 0, since f(1) = 0 for every generator
    assert sp.simplify(sp.diff(g, r).subs(r, 1).doit()) == 0


def test_theorem1_convex_in_r_with_minimum_at_1():
    """For every registered generator: g(p, 1) = 0, g >= 0 and g'' >= 0 on a grid of (p, r) in the simplex."""
    for name, f in GENERATORS.items():
        g = g_of(f)
        assert sp.simplify(g.subs(r, 1)) == 0
        g_num = sp.lambdify((p, r), g, "math")
        for pv in (0.01, 0.3, 0.9):
            vals = [g_num(pv, (k + 0.5) / (40 * pv)) for k in range(40)]  # inside (0, 1/p)
            assert min(vals) >= -1e-15, name
            for a, b, cc in zip(vals, vals[1:], vals[2:]):  # discrete convexity
                assert a + cc - 2 * b >= -1e-12, name


def test_theorem1_specialisations():
    """TV, chi^2, KL and Hellinger reduce to the closed-form g of docs/paper.md §2."""
    # TV: on r <= 1 we have c >= 1 (and the reverse), so |.| opens with known signs on each side
    g_tv_below = p * (1 - r) / 2 + (1 - p) * (c - 1) / 2
    g_tv_above = p * (r - 1) / 2 + (1 - p) * (1 - c) / 2
    assert sp.simplify(g_tv_below - p * (1 - r)) == 0 and sp.simplify(g_tv_above - p * (r - 1)) == 0
    g_tv = sp.lambdify((p, r), g_of(GENERATORS["bandtv"]))
    assert all(abs(g_tv(0.3, rv) - 0.3 * abs(rv - 1)) < 1e-15 for rv in (0.0, 0.5, 1.0, 2.0, 1 / 0.3))
    assert sp.simplify(g_of(GENERATORS["bandchi2"]) - p * (r - 1) ** 2 / (1 - p)) == 0
    b = p * r  # new probability of the token
    bern_kl = p * sp.log(p / b) + (1 - p) * sp.log((1 - p) / (1 - b))
    diff_kl = sp.expand_log(g_of(GENERATORS["bandkl"]) - bern_kl, force=True)
    assert sp.simplify(diff_kl) == 0
    g_h = g_of(GENERATORS["bandhellinger"])
    assert sp.simplify(sp.expand(g_h - (2 - 2 * (p * sp.sqrt(r) + (1 - p) * sp.sqrt(c))))) == 0


def test_theorem1_band_g_matches_symbolic_g():
    """band._g(div, x, p, q, p/q) = (g_f(p, e^x), e^x dg/dr) for every registered divergence."""
    import mpmath

    mpmath.mp.dps = 40
    for name, f in GENERATORS.items():
        g = g_of(f)
        g_num = sp.lambdify((p, r), g, "mpmath")
        dg_num = sp.lambdify((p, r), r * sp.diff(g, r), "mpmath")
        for pv in (1e-6, 0.08, 0.5, 0.97):
            for xv in (-30.0, -2.0, -0.3, -1e-4):
                P = torch.tensor([pv], dtype=torch.float64)
                x = torch.tensor([xv], dtype=torch.float64)
                got, dgot = band._g(band.DIVERGENCES[name], x, P, 1 - P, P / (1 - P))
                rv = mpmath.exp(mpmath.mpf(xv))
                want, dwant = float(g_num(mpmath.mpf(pv), rv)), float(dg_num(mpmath.mpf(pv), rv))
                # Rounding: KL's -p x - q log1p(u) cancels to g ~ p x^2 / 2q near r = 1 (terms of size p |x|)
                tol = 1e-12 * abs(want) + 1e-15 * pv * abs(xv)
                assert abs(got.item() - want) <= tol, (name, pv, xv, got.item(), want)
                assert abs(dgot.item() - dwant) <= 1e-9 * abs(dwant), (name, pv, xv, dgot.item(), dwant)


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

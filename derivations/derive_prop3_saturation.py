"""Proposition 3 (saturation at the simplex), derived with sympy and compared with band.py around the thresholds.

g is convex in r with g(p, 1) = 0 (Theorem 1), so upper = 1/p (pi_new(a) may reach 1) iff g(p, 1/p) <= delta, and
lower = 0 iff g(p, 0) <= delta. At the ends c = 0 resp. c = 1/(1 - p), hence
    g(p, 1/p) = p f(1/p) + (1 - p) f(0),        g(p, 0) = p f(0) + (1 - p) f(1/(1 - p)).
Solving these = delta for p gives the thresholds (docs/paper.md §2):
                upper saturates iff        lower saturates iff
    TV          p >= 1 - delta              p <= delta
    chi^2       p >= 1/(1 + delta)          p <= delta/(1 + delta)
    KL          never (f(0) = inf)          never
    Hellinger   p >= (1 - delta/2)^2        p <= 1 - (1 - delta/2)^2      (f = (sqrt u - 1)^2, f(0) = 1)
The two columns are mirror images (derive_mirror.py): g(p, 0) = g(1 - p, 1/(1 - p)).

Run: python derivations/derive_prop3_saturation.py
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
delta = sp.symbols("delta", positive=True)
UPPER = {"bandtv": 1 - delta, "bandchi2": 1 / (1 + delta), "bandhellinger": (1 - delta / 2) ** 2}
LOWER = {"bandtv": delta, "bandchi2": delta / (1 + delta), "bandhellinger": 1 - (1 - delta / 2) ** 2}
DELTAS = (sp.Rational(1, 100), sp.Rational(1, 20), sp.Rational(1, 10), sp.Rational(1, 2))


def g_at_ends(f):
    f0 = sp.limit(f, u, 0, "+")
    return p * f.subs(u, 1 / p) + (1 - p) * f0, p * f0 + (1 - p) * f.subs(u, 1 / (1 - p))


def test_prop3_thresholds_solve_g_at_the_ends():
    """g(p, 1/p) = delta at the upper threshold and g(p, 0) = delta at the lower one; g decreases/increases in p
    through them (so the saturated side is the one stated); KL's ends are infinite."""
    for name, f in GENERATORS.items():
        g_up, g_lo = g_at_ends(f)
        if name == "bandkl":  # f(0) = inf: both ends cost an infinite divergence for every p
            assert sp.limit(f, u, 0, "+") == sp.oo and g_up.has(sp.oo) and g_lo.has(sp.oo)
            continue
        for dv in DELTAS:
            pu, pl = UPPER[name].subs(delta, dv), LOWER[name].subs(delta, dv)
            assert sp.simplify(g_up.subs(p, pu) - dv) == 0, name
            assert sp.simplify(g_lo.subs(p, pl) - dv) == 0, name
            assert sp.diff(g_up, p).subs(p, pu) < 0 < sp.diff(g_lo, p).subs(p, pl), name  # monotone through


def test_prop3_band_saturates_exactly_beyond_the_thresholds():
    """band: upper == 1/p just above the upper threshold, < 1/p just below; lower == 0 just below the lower one."""
    for name in UPPER:
        for dv in (0.01, 0.05, 0.1, 0.5):
            pu, pl = float(UPPER[name].subs(delta, dv)), float(LOWER[name].subs(delta, dv))
            ps = torch.tensor([pu * (1 - 1e-6), pu * (1 + 1e-6), pl * (1 - 1e-6), pl * (1 + 1e-6)], dtype=torch.float64)
            lower, upper = band.band(ps.log(), name, dv)
            inv_p = 1 / ps
            assert upper[0] < inv_p[0] and torch.isclose(upper[1], inv_p[1], rtol=1e-15), (name, dv)
            assert lower[2] == 0 and lower[3] > 0, (name, dv, lower)
    # KL never saturates: strictly inside the simplex wherever the bound is representable
    ps = torch.tensor([0.05, 0.3, 0.9], dtype=torch.float64)
    lower, upper = band.band(ps.log(), "bandkl", 2.0)
    assert (lower > 0).all() and (upper < 1 / ps).all()


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

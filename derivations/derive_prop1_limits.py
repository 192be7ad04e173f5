"""Proposition 1 (asymptotics of the band), derived with sympy and compared with band.py at extreme p.

p -> 1. For r < 1 fixed, c = (1 - p r)/(1 - p) -> infinity and (1 - p) f(c) = (1 - p r) f(c)/c -> (1 - r) f'_inf
with f'_inf = lim f(u)/u, so g -> f(r) + (1 - r) f'_inf and the lower bound tends to r* solving
f(r*) + (1 - r*) f'_inf = delta:
    KL e^-delta,   TV max(1 - delta, 0),   chi^2 1 (f'_inf = inf),   Hellinger (1 - delta/2)^2.
The upper bound is squeezed to 1 by r <= 1/p.
p -> 0. Write b = p r for the new probability of the token: g = p f(b/p) + (1 - p) f((1 - b)/(1 - p)) tends to
b f'_inf + f(1 - b), so the largest probability rise p (upper - 1) -> b* solving b f'_inf + f(1 - b) = delta:
    KL 1 - e^-delta (non-vanishing, unlike the clip's eps p),   TV delta,   Hellinger delta - delta^2/4,
    chi^2 0, like sqrt(delta p) (g = p (r - 1)^2 / (1 - p) exactly).
And for any r in (0, 1), g(p, r) -> p f(r) + f(1) = 0 as p -> 0, so eventually g < delta: lower -> 0.

Run: python derivations/derive_prop1_limits.py
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402
from derive_lemma1 import GENERATORS, one_thread, u  # noqa: E402,F401  (one_thread: autouse fixture)

p, r, b, delta = sp.symbols("p r b delta", positive=True)
R_STAR = {"bandkl": sp.exp(-delta), "bandtv": 1 - delta, "bandchi2": sp.Integer(1),
          "bandhellinger": (1 - delta / 2) ** 2}
DELTAS = (sp.Rational(1, 100), sp.Rational(1, 20), sp.Rational(1, 10), sp.Rational(9, 10))
B_STAR = {"bandkl": 1 - sp.exp(-delta), "bandtv": delta, "bandchi2": sp.Integer(0),
          "bandhellinger": delta - delta**2 / 4}


def slope_at_infinity(f):
    return sp.limit(f / u, u, sp.oo)


def test_prop1_lower_limit_as_p_to_1():
    """r* solves f(r*) + (1 - r*) f'_inf = delta; band's r_star entries and the solver at p -> 1 agree."""
    for name, f in GENERATORS.items():
        s = slope_at_infinity(f)
        if s == sp.oo:  # chi^2: any r < 1 costs (1 - p) f(c) -> inf, so r* = 1
            assert R_STAR[name] == 1
        else:  # exact rationals in (0, 1): TV and Hellinger's forms hold for delta < 1 and delta < 2
            for dv in DELTAS:
                rs = R_STAR[name].subs(delta, dv)
                assert sp.simplify(f.subs(u, rs) + (1 - rs) * s - dv) == 0, name
    g_kl = p * GENERATORS["bandkl"].subs(u, r) + (1 - p) * GENERATORS["bandkl"].subs(u, (1 - p * r) / (1 - p))
    assert sp.simplify(sp.limit(g_kl, p, 1, "-") + sp.log(r)) == 0  # g -> -log r, so r* = e^-delta
    for name, div in band.DIVERGENCES.items():
        for dv in (0.01, 0.05, 0.1, 0.5):
            want = float(R_STAR[name].subs(delta, dv))
            assert math.isclose(div.r_star(dv), want, rel_tol=1e-15)
            lower, upper = band.band(torch.tensor([-1e-300, 0.0], dtype=torch.float64), name, dv)
            assert torch.allclose(lower, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0), (name, lower)
            assert (upper == 1).all()


def test_prop1_probability_margin_as_p_to_0():
    """b* = lim p (upper - 1) solves b f'_inf + f(1 - b) = delta; band at p = e^-700 (float64) agrees."""
    for name, f in GENERATORS.items():
        s = slope_at_infinity(f)
        bs = B_STAR[name]
        if s != sp.oo:
            for dv in DELTAS:
                assert sp.simplify(bs.subs(delta, dv) * s + f.subs(u, 1 - bs.subs(delta, dv)) - dv) == 0, name
    # chi^2 margin ~ sqrt(delta p): p (upper - 1) = sqrt(delta p (1 - p)) exactly (Prop. 4)
    logp = torch.tensor([-700.0, -300.0], dtype=torch.float64)
    for dv in (0.01, 0.05, 0.1, 0.5):
        for name in band.DIVERGENCES:
            _, upper = band.band(logp, name, dv)
            margin = logp.exp() * (upper - 1)
            if name == "bandchi2":
                torch.testing.assert_close(margin / torch.sqrt(dv * logp.exp()), torch.ones(2, dtype=torch.float64))
            else:
                want = torch.tensor(float(B_STAR[name].subs(delta, dv)), dtype=torch.float64).expand(2)
                torch.testing.assert_close(margin, want, rtol=1e-12, atol=0)


def test_prop1_lower_tends_to_0_as_p_to_0():
    """g(p, r) -> 0 as p -> 0 for fixed r (so lower(p) < r eventually), and band's lower is 0 at p = e^-700."""
    for name, f in GENERATORS.items():
        g = p * f.subs(u, r) + (1 - p) * f.subs(u, (1 - p * r) / (1 - p))
        assert sp.limit(g.subs(r, sp.Rational(1, 3)), p, 0, "+") == 0, name
        lower, _ = band.band(torch.tensor([-700.0], dtype=torch.float64), name, 0.05)
        assert lower.item() == 0.0
    # KL never saturates (Prop. 3): at moderate p the lower bound is small but strictly positive
    lower, _ = band.band(torch.tensor([-8.0], dtype=torch.float64), "bandkl", 0.05)  # p = 3.4e-4: ~e^-148
    assert 0 < lower.item() < 1e-60


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

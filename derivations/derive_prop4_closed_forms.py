"""Proposition 4 (closed forms for TV and chi^2), solved symbolically from g_f = delta and checked against band.py.

Theorem 1's g (derive_theorem1.py): TV g = p |r - 1|, chi^2 g = p (r - 1)^2 / (1 - p). Solving g = delta:
    TV     r = 1 -+ delta / p                      ->  [max(0, 1 - delta/p), min(1/p, 1 + delta/p)]
    chi^2  r = 1 -+ sqrt(delta (1 - p) / p)        ->  [max(0, 1 - sqrt(delta (1-p)/p)), min(1/p, 1 + sqrt(...))]
(the clamps are the simplex [0, 1/p], i.e. Prop. 3's saturation). KL has no closed form: its root involves the
Lambert-W-like equation -p log r - (1 - p) log((1 - p r)/(1 - p)) = delta, solved numerically (derive_kl_solver.py).
The closed forms are what band.py uses for TV and chi^2; the generic numerical solver (the path every new
divergence takes) must reproduce them, which ties the two together.

Run: python derivations/derive_prop4_closed_forms.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402
from derive_lemma1 import one_thread  # noqa: E402,F401  (autouse fixture)

p, delta = sp.symbols("p delta", positive=True)
r = sp.symbols("r", real=True)


def test_prop4_tv_and_chi2_roots():
    """Solve g = delta on each side of r = 1 and compare with the stated closed forms."""
    lo_tv = sp.solve(sp.Eq(p * (1 - r), delta), r)  # r <= 1 branch of p |r - 1|
    hi_tv = sp.solve(sp.Eq(p * (r - 1), delta), r)
    assert len(lo_tv) == len(hi_tv) == 1
    assert sp.simplify(lo_tv[0] - (1 - delta / p)) == 0 and sp.simplify(hi_tv[0] - (1 + delta / p)) == 0
    roots = sp.solve(sp.Eq(p * (r - 1) ** 2 / (1 - p), delta), r)
    half = sp.sqrt(delta * (1 - p) / p)
    assert len(roots) == 2
    assert {sp.simplify((rt - 1) ** 2 - half**2) for rt in roots} == {0}
    for rt in roots:  # one root below 1, one above, symmetric around 1
        val = float(rt.subs({p: sp.Rational(1, 3), delta: sp.Rational(1, 20)}))
        assert abs(abs(val - 1) - float(half.subs({p: sp.Rational(1, 3), delta: sp.Rational(1, 20)}))) < 1e-15


def test_prop4_band_closed_forms_match_formula_and_numerical_solver():
    """band's TV / chi^2 bounds = the formulas, and = the generic bisection + Newton solver run on the same f."""
    ps = torch.cat([torch.logspace(-9, -0.0001, 300, dtype=torch.float64), torch.tensor([0.5, 0.9, 0.999999])])
    logp = ps.log()
    for dv in (1e-4, 0.05, 0.1, 0.5, 2.0):
        inv_p, half = 1 / ps, (dv * (1 - ps) / ps).sqrt()
        want = {
            "bandtv": ((1 - dv / ps).clamp_min(0), torch.minimum(inv_p, 1 + dv / ps)),
            "bandchi2": ((1 - half).clamp_min(0), torch.minimum(inv_p, 1 + half)),
        }
        for name, (wl, wu) in want.items():
            lower, upper = band.band(logp, name, dv)
            torch.testing.assert_close(lower, wl, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(upper, wu, rtol=1e-12, atol=0)
            nl, nu = band._solve(logp, band.DIVERGENCES[name], dv)  # the numerical path on the same generator
            torch.testing.assert_close(nl, wl, rtol=1e-9, atol=1e-15)  # bisection in log r to float64's eps * 40
            torch.testing.assert_close(nu, wu, rtol=1e-9, atol=0)


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

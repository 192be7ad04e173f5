"""Mirror identity: g_f(p, r) = g_f(1 - p, (1 - p r)/(1 - p)), hence lower(p) = [1 - (1 - p) upper(1 - p)] / p.

With p' = 1 - p and r' = c = (1 - p r)/(1 - p), the mirror's complement factor is c' = (1 - p' r')/(1 - p') =
(1 - (1 - p r))/p = r, so g(p', r') = p' f(r') + (1 - p') f(c') = (1 - p) f(c) + p f(r) = g(p, r): the same two
terms, swapped. The map r -> r' is decreasing and sends [0, 1/p] onto [1/(1 - p), 0] with 1 -> 1, so it sends the
upper root of p' = 1 - p to the lower root of p, and the lower root of 1 - p to the upper root of p:
    upper(p) = (1 - (1 - p) s) / p,   s = lower(1 - p).
band.py solves every upper bound this way: as the lower root of the mirror problem, in log s (derive_kl_solver.py).

Run: python derivations/derive_mirror.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402
from derive_lemma1 import one_thread  # noqa: E402,F401  (autouse fixture)

p, r = sp.symbols("p r", positive=True)


def test_mirror_identity_symbolic():
    """g(1 - p, c) = g(p, r) for an arbitrary f, and the change of variables is an involution."""
    f = sp.Function("f")
    g = lambda pp, rr: pp * f(rr) + (1 - pp) * f((1 - pp * rr) / (1 - pp))  # noqa: E731
    c = (1 - p * r) / (1 - p)
    mirrored = g(1 - p, c)
    assert sp.simplify(mirrored - g(p, r)) == 0
    assert sp.simplify((1 - (1 - p) * c) / p - r) == 0  # mapping back gives r: an involution
    assert sp.simplify(c.subs(r, 1)) == 1 and sp.diff(c, r) == -p / (1 - p)  # fixes 1, decreasing


def test_mirror_band_lower_from_upper_of_complement():
    """band: lower(p) = [1 - (1 - p) upper(1 - p)] / p for every divergence (float64, p away from 0 and 1)."""
    ps = torch.linspace(0.02, 0.98, 49, dtype=torch.float64)
    for name in band.DIVERGENCES:
        for dv in (0.01, 0.05, 0.3):
            lower, _ = band.band(ps.log(), name, dv)
            _, upper_c = band.band(torch.log1p(-ps), name, dv)
            mirrored = (1 - (1 - ps) * upper_c) / ps
            torch.testing.assert_close(lower, mirrored.clamp_min(0), rtol=1e-9, atol=1e-12)


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

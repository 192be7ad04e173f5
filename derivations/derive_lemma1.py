"""Lemma 1 (uniform complement rescaling), derived with sympy and tied to band.py's registry.

Claim (docs/paper.md §2): fix the new mass m = p r of the sampled token a. Among all new distributions that give
a this mass, D_f(pi_new || pi_old) = sum_v pi_old(v) f(pi_new(v) / pi_old(v)) is smallest when every other token is
rescaled by the same factor c = (1 - p r) / (1 - p).

Derivation. Write t_v = pi_new(v) / pi_old(v) for v != a, w_v = pi_old(v) (so sum w_v = 1 - p) and minimise
F(t) = sum w_v f(t_v) subject to sum w_v t_v = 1 - m.
  1. Lagrange: dF/dt_v - lam * w_v = w_v (f'(t_v) - lam) = 0, so f'(t_v) = lam for every v: with f strictly convex,
     f' is strictly increasing and all t_v are equal; the constraint then gives t_v = (1 - m) / (1 - p) = c.
  2. Global: the Hessian of F is diag(w_v f''(t_v)) >= 0, so F is convex on an affine set and the stationary point
     is the global minimum; equivalently Jensen: sum w_v f(t_v) >= (1 - p) f(sum w_v t_v / (1 - p)) = (1 - p) f(c).
     (For TV, f is convex but not strictly: the uniform point is still a minimiser, by Jensen, not the only one.)
The vocabulary-sized problem therefore collapses to the single variable r (Theorem 1, derive_theorem1.py).

Run: python derivations/derive_lemma1.py   (pytest collects the test_ functions)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Small elementwise work: one thread is fastest, and on a busy 2-core machine OpenMP barriers stall for ms.
    The other derivation scripts import this fixture (autouse there too)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

u = sp.symbols("u", positive=True)
# The generators of band.DIVERGENCES, symbolically. The other derivations import this dict.
GENERATORS = {
    "bandkl": u - 1 - sp.log(u),
    "bandtv": sp.Abs(u - 1) / 2,
    "bandchi2": (u - 1) ** 2,
    "bandhellinger": (sp.sqrt(u) - 1) ** 2,
}


def test_lemma1_registry_matches_the_generators():
    """band.DIVERGENCES holds exactly these generators: f(1) = 0, f convex (f'' >= 0), and its f(r, r - 1), f'(r, r - 1)
    agree with the symbolic f, f' from r = 1e-30 to r = 151: 1e-12 relative, plus rounding of terms of size |r - 1|
    (KL's t - log1p(t) cancels to t^2 / 2 near r = 1; the solver uses its own cancellation-free g for KL)."""
    assert set(GENERATORS) == set(band.DIVERGENCES)
    import mpmath

    mpmath.mp.dps = 40
    ts = [-1 + mpmath.mpf(10) ** -30, -1 + mpmath.mpf(10) ** -9, -0.7, -0.1, -1e-3, -1e-9, 1e-9, 1e-3, 0.4, 3.0, 150.0]
    for name, f in GENERATORS.items():
        assert f.subs(u, 1) == 0
        f2 = sp.diff(f, u, 2)
        if name != "bandtv":  # |u - 1| is convex with f'' = 0 away from 1 (a kink at 1)
            assert all(f2.subs(u, v) > 0 for v in (sp.Rational(1, 1000), sp.Rational(1, 2), 2, 10**6))
        div = band.DIVERGENCES[name]
        t = torch.tensor([float(v) for v in ts], dtype=torch.float64)
        r = torch.tensor([float(1 + mpmath.mpf(v)) for v in ts], dtype=torch.float64)
        f_mp, df_mp = sp.lambdify(u, f, "mpmath"), sp.lambdify(u, sp.diff(f, u), "mpmath")
        want_f = torch.tensor([float(f_mp(1 + mpmath.mpf(v))) for v in ts], dtype=torch.float64)
        want_df = torch.tensor([float(df_mp(1 + mpmath.mpf(v))) for v in ts], dtype=torch.float64)
        assert ((div.f(r, t) - want_f).abs() <= 1e-12 * want_f.abs() + 2e-16 * t.abs()).all(), name
        # f'(r) = 1 - 1/sqrt(r) (Hellinger) cancels near r = 1: only used for Newton's direction, 1e-6 is plenty
        torch.testing.assert_close(div.df(r, t), want_df, rtol=1e-6 if name == "bandhellinger" else 1e-12, atol=0)
        # f(0) (the saturation input of Prop. 3) and r* (Prop. 1) are re-derived in their own scripts
        assert sp.limit(f, u, 0, "+") == (sp.oo if div.f0 == float("inf") else sp.nsimplify(div.f0))


def test_lemma1_lagrange_stationarity_forces_equal_ratios():
    """Stationarity of the Lagrangian gives f'(t_v) = lam for all v, and the constraint gives t_v = c."""
    n = 4
    f = sp.Function("f")
    t = sp.symbols(f"t1:{n + 1}", positive=True)
    w = sp.symbols(f"w1:{n + 1}", positive=True)
    lam, m, p, tc = sp.symbols("lam m p tc", positive=True)
    F = sum(wi * f(ti) for wi, ti in zip(w, t))
    L = F - lam * (sum(wi * ti for wi, ti in zip(w, t)) - (1 - m))
    for wi, ti in zip(w, t):
        assert sp.expand(sp.diff(L, ti) - wi * (sp.diff(f(ti), ti) - lam)) == 0
    # equal ratios t_v = tc with sum w_v = 1 - p:  (1 - p) tc = 1 - m
    sol = sp.solve(sp.Eq((1 - p) * tc, 1 - m), tc)[0]
    assert sp.simplify(sol - (1 - m) / (1 - p)) == 0
    # the Hessian is diagonal with entries w_v f''(t_v): positive semi-definite for convex f
    H = sp.hessian(F, t)
    assert H == sp.diag(*[wi * sp.diff(f(ti), ti, 2) for wi, ti in zip(w, t)])


def test_lemma1_jensen_on_random_complements():
    """Numerically, for every generator: any complement with the same mass has D_f >= the uniform rescaling's."""
    g = torch.Generator().manual_seed(0)
    for name, div in band.DIVERGENCES.items():
        for n in (5, 17, 50):
            w = torch.rand(n, generator=g, dtype=torch.float64) + 0.01
            w = 0.7 * w / w.sum()  # pi_old on the complement, total 1 - p = 0.7
            mass = 0.55  # new mass of the complement, 1 - p r
            c = mass / 0.7
            uniform = (w * div.f(torch.full_like(w, c), torch.full_like(w, c - 1))).sum()
            for _ in range(50):
                new = torch.rand(n, generator=g, dtype=torch.float64) ** 3 + 1e-9
                new = mass * new / new.sum()
                assert (w * div.f(new / w, new / w - 1)).sum() >= uniform - 1e-12, name


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

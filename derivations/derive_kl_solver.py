"""The Band-KL solver of band.py, derived: log-space residual, proven bracket, Newton update, fixed step counts.

Theorem 1 for KL: g(p, r) = KL(Bern(p) || Bern(p r)). In x = log r (lower root; the upper root is the lower root of
the mirror problem p <-> q, derive_mirror.py), with q = 1 - p, a = p / q and u = c - 1 = -a expm1(x):
  G(x)   = -p x - q log1p(u)                                  (= g(p, e^x); the u - 1 terms of f cancel)
  G'(x)  = -u / (1 + u) = -p (1 - e^x) / (1 - p e^x)   < 0    on x < 0
  G''(x) = p q e^x / (1 - p e^x)^2                       > 0    convex, and increasing in x, so G'' <= G''(0) = p/q
Bracket of the root x* of G = delta (band._kl_bracket):
  c in [1, 1/q] on x <= 0, so  -p x + q log q <= G(x) <= -p x      =>  (q log q - delta) / p <= x* <= -delta / p
  G(0) = G'(0) = 0 and G'' <= p/q, so G(x) <= p x^2 / (2 q)        =>  x* <= -sqrt(2 delta q / p)
Newton from hi = -max(delta/p, sqrt(2 delta q/p)): by convexity the tangent lies below G - delta, so every Newton
iterate x_n (n >= 1) satisfies x_n <= x* and they increase monotonically: each is a new lower end of the bracket.
For such iterates Taylor's theorem gives e_{n+1} = G''(xi) / (2 |G'(x_n)|) e_n^2 <= C e_n^2 with
C = G''(x*) / (2 |G'(x*)|) (G'' increases and |G'| decreases in x), hence e_n <= (C e_1)^(2^(n-1)) / C.
The step count of band._KL_NEWTON_STEPS is the smallest n for which that bound is below the dtype's unit roundoff
(2^-24, 2^-53: e is the error of log r, i.e. the relative error of r) everywhere on a dense (p, delta) grid:
p in [e^-800, 1 - 1e-13], delta in [1e-5, 20]. The last test asserts that the code uses exactly these counts.

Run: python derivations/derive_kl_solver.py
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mpmath  # noqa: E402
import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402
from derive_lemma1 import one_thread  # noqa: E402,F401  (autouse fixture)

p, x, delta = sp.symbols("p x delta", positive=True)  # x stands for -x below where a sign matters
X = sp.symbols("X", negative=True)
q = 1 - p
a = p / q
U = -a * (sp.exp(X) - 1)
G = -p * X - q * sp.log(1 + U)


def test_kl_solver_residual_in_log_space():
    """G(x) is the Bernoulli KL at r = e^x; G' and G'' have the closed forms above; G'' > 0 and G'' <= p/q."""
    # KL(Bern(p) || Bern(b)), b = p e^x: p log(p/b) = -p x and q log(q/(1-b)) = -q log c with c = (1 - b)/q = 1 + u
    b = p * sp.exp(X)
    assert sp.simplify(p * sp.log(p / b) - (-p * X)) == 0
    assert sp.simplify((1 - b) / q - (1 + U)) == 0
    G1, G2 = sp.diff(G, X), sp.diff(G, X, 2)
    assert sp.simplify(G1 - (-U / (1 + U))) == 0
    assert sp.simplify(G1 - (-p * (1 - sp.exp(X)) / (1 - p * sp.exp(X)))) == 0
    assert sp.simplify(G2 - p * q * sp.exp(X) / (1 - p * sp.exp(X)) ** 2) == 0
    # G'' increasing in x: d/dx [e^x / (1 - p e^x)^2] = e^x (1 + p e^x) / (1 - p e^x)^3 > 0; G''(0) = p/q
    e = sp.exp(X)
    assert sp.simplify(sp.diff(e / (1 - p * e) ** 2, X) - e * (1 + p * e) / (1 - p * e) ** 3) == 0
    assert sp.simplify(G2.subs(X, 0) - p / q) == 0


def test_kl_solver_bracket_is_proven():
    """-p x + q log q <= G(x) <= min(-p x, p x^2 / (2q)), checked symbolically at the ends and numerically inside."""
    c = 1 + U
    assert sp.simplify(G - (-p * X - q * sp.log(c))) == 0
    assert sp.simplify(c.subs(X, 0)) == 1 and sp.limit(c, X, -sp.oo) == 1 / q  # c runs over [1, 1/q]
    G_num = sp.lambdify((p, X), G, "mpmath")
    mpmath.mp.dps = 30
    for pv in (1e-9, 0.01, 0.3, 0.7, 0.999):
        for xv in (-300.0, -20.0, -1.0, -0.05, -1e-5):
            P, Xv = mpmath.mpf(pv), mpmath.mpf(xv)
            gv, qv = G_num(P, Xv), 1 - P
            slack = mpmath.mpf(10) ** -20 * gv  # tight to ~e^x p when x << 0; log(1 + u) at 30 digits rounds
            assert -P * Xv + qv * mpmath.log(qv) <= gv + slack and gv <= min(-P * Xv, P * Xv**2 / (2 * qv)) + slack
    # and band._kl_bracket's [lo, hi] holds the root: G decreases, so G(lo) >= delta >= G(hi) (in mpmath)
    for pv in (1e-9, 0.01, 0.3, 0.7, 0.999):
        for dv in (1e-4, 0.05, 2.0):
            P = torch.tensor([pv], dtype=torch.float64)
            lo, hi = band._kl_bracket(P, 1 - P, torch.log1p(-P), dv)
            # (clamped at X_FLOOR = -1000 when the root lies lower: r = e^x is 0 there in every dtype)
            assert lo.item() == band.X_FLOOR or G_num(mpmath.mpf(pv), lo.item()) >= dv, (pv, dv)
            assert hi.item() == band.X_FLOOR or dv >= G_num(mpmath.mpf(pv), hi.item()), (pv, dv)


def test_kl_solver_newton_update_rearranged():
    """x - (G - delta)/G' = -((q l + delta)(1 + u) + p e^x x) / u, l = log1p(u) (band._kl_newton)."""
    l_ = sp.log(1 + U)
    newton = X - (G - delta) / sp.diff(G, X)
    rearranged = -((q * l_ + delta) * (1 + U) + p * sp.exp(X) * X) / U
    assert sp.simplify(newton - rearranged) == 0
    P = torch.tensor([1e-7, 0.2, 0.9], dtype=torch.float64)
    Q = 1 - P
    xs = torch.tensor([-40.0, -0.7, -0.01], dtype=torch.float64)
    got = band._kl_newton(xs, P, Q, P / Q, 0.05)
    f = sp.lambdify((p, X, delta), newton, "mpmath")
    want = torch.tensor([float(f(pv, xv, 0.05)) for pv, xv in zip(P.tolist(), xs.tolist())], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def _grid(n):
    lp = -torch.logspace(-13, math.log10(800), n, dtype=torch.float64)
    d = torch.logspace(-5, math.log10(20), n, dtype=torch.float64)
    lp, d = torch.meshgrid(lp, d, indexing="ij")
    return lp.flatten(), d.flatten()


def derived_newton_steps(n=240):
    """Smallest n with max over the grid of (C e_1)^(2^(n-1)) / C below 2^-24 and 2^-53 (see the docstring)."""
    logp, d = _grid(n)
    P, Q = logp.exp(), -torch.expm1(logp)
    A = P / Q
    lo, hi = band._kl_bracket(P, Q, torch.log1p(-P), d)
    # reference root: plain bisection, 64 halvings of a bracket at most q log(1/q) / p <= 1 wide: to the last bit
    a_, b_ = lo.clone(), hi.clone()
    for _ in range(64):
        mid = 0.5 * (a_ + b_)
        right = band._kl_g(mid, P, Q, A)[0] > d
        a_, b_ = torch.where(right, mid, a_), torch.where(right, b_, mid)
    xs = 0.5 * (a_ + b_)
    keep = xs > -700  # below, r = e^x is 0 in float64: nothing to resolve
    # the first Newton step from hi (exact rearranged update) and its error
    x1 = torch.minimum(torch.maximum(band._kl_newton(hi, P, Q, A, d), lo), hi)
    e1 = xs - x1
    assert (e1[keep] >= -1e-12 * xs[keep].abs()).all(), "first Newton step must land left of the root"
    us = -A * torch.expm1(xs)
    C = A * xs.exp() / (1 + us) ** 2 / (2 * us / (1 + us))  # G''(x*) / (2 |G'(x*)|), G'' = a e^x / (1 + u)^2
    log_ce1 = torch.log((C * e1).clamp_min(1e-300))
    steps = {}
    for dtype, target in ((torch.float32, 2.0**-24), (torch.float64, 2.0**-53)):
        for nsteps in range(1, 10):
            log_bound = 2.0 ** (nsteps - 1) * log_ce1 - torch.log(C)
            if (log_bound[keep] <= math.log(target)).all():
                steps[dtype] = nsteps
                break
    return steps, (logp[keep], d[keep], xs[keep])


def test_kl_solver_step_counts_are_derived():
    """band._KL_NEWTON_STEPS equals the counts derived from the convergence bound; the solver then meets them."""
    steps, (logp, d, xs) = derived_newton_steps()
    assert steps == band._KL_NEWTON_STEPS, steps
    # the float64 solver against the bisection reference, a few delta columns (band takes a scalar delta)
    for dv in d.unique()[::37].tolist():
        sel = d == dv
        lower, _ = band.band(logp[sel], "bandkl", dv)
        err = (lower.log() - xs[sel]).abs()
        assert (err <= 4e-16 * (xs[sel].abs() + 1)).all(), (dv, err.max())


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    print("derived Newton steps:", derived_newton_steps()[0])
    raise SystemExit(pytest.main([__file__, "-q"]))

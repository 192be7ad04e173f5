"""DPPO-Binary-KL masks exactly the tokens that Band-KL clips (DPPO: arXiv 2602.04879; docs/design.md).

verl 0.9.1 ships DPPO as the policy loss `dppo_kl` (verl/trainer/ppo/core_algos.py lines 1460-1541). Per token, with
old probability p = pi_old(a), new probability b = pi_theta(a) = p r and advantage A, it computes (lines 1515-1523)
    binary_kl = p (log p - log b) + (1 - p) log((1 - p) / (1 - b))          (+1e-8 inside that log, dropped here)
    valid     = binary_kl <= delta  or  b <= p    if A > 0,      binary_kl <= delta  or  b >= p    if A < 0
    loss      = -A sg(min(r, C)) log b valid                       (sg: no gradient; C = clip_ratio_c, truncation)
Band-KL (band.py, Theorem 1 with f(u) = u - 1 - log u) clips r to {r : g(p, r) <= delta}, g = p f(r) + (1 - p) f(c),
c = (1 - p r) / (1 - p). Derived here:
  1. g(p, r) = binary_kl: Theorem 1's g for KL is the KL between Bernoulli(p) and Bernoulli(p r);
  2. dg/dr = p (r - 1) / ((1 - p) r c), so g falls on (0, 1) and rises on (1, 1/p) from g(p, 1) = 0: the tokens DPPO
     masks, {r > 1, g > delta} for A > 0 and {r < 1, g > delta} for A < 0, are exactly r > upper and r < lower, the
     tokens whose gradient the band's clip zeroes (checked against band.ratio_bounds on a grid);
  3. elsewhere d loss / d log b = -A min(r, C) for DPPO and -A r for the clipped surrogate: equal while r <= C.
So Band-KL and DPPO-KL differ only where BandPO adds something: the cap upper <= max_ratio, the dual clip (A < 0,
r > c), and the other divergences (TV, chi^2, any f). tests/verl_bandpo_checks.py measures it on verl's own code.

Run: python derivations/derive_dppo.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sympy as sp  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402
from derive_lemma1 import GENERATORS, one_thread, u  # noqa: E402,F401  (one_thread: autouse fixture)

p = sp.symbols("p", positive=True)  # 0 < p < 1
r = sp.symbols("r", positive=True)  # 0 < r < 1/p
c = (1 - p * r) / (1 - p)
g = p * GENERATORS["bandkl"].subs(u, r) + (1 - p) * GENERATORS["bandkl"].subs(u, c)  # Theorem 1, KL
b = p * r
binary_kl = p * (sp.log(p) - sp.log(b)) + (1 - p) * sp.log((1 - p) / (1 - b))  # verl's dppo_kl, line 1515


def test_dppo_binary_kl_is_band_kl_g():
    """g_KL(p, r) = binary_kl(p, p r): the linear terms p (r - 1) + (1 - p)(c - 1) cancel, the logs are DPPO's."""
    assert sp.simplify(p * (r - 1) + (1 - p) * (c - 1)) == 0
    assert sp.simplify(sp.expand_log(g - binary_kl, force=True)) == 0


def test_dppo_mask_is_band_clip():
    """dg/dr = p (r - 1) / ((1 - p) r c): negative below r = 1, positive above (r, c > 0 inside the simplex), so
    {g > delta} = [0, lower) u (upper, 1/p]; then DPPO's mask equals the band's clip, checked on a grid against
    band.ratio_bounds (float64)."""
    assert sp.simplify(sp.diff(g, r) - p * (r - 1) / ((1 - p) * r * c)) == 0
    delta = 0.05
    kl = sp.lambdify((p, r), binary_kl, "math")
    for pv in (1e-4, 0.003, 0.08, 0.3, 0.7, 0.97, 0.999):
        lower, upper = band.ratio_bounds(torch.tensor([pv], dtype=torch.float64).log(), "bandkl", delta=delta,
                                         max_ratio=float("inf"))
        for k in range(1, 400):
            rv = k / (400 * pv)  # a grid of (0, 1/p)
            d = kl(pv, rv)
            # no grid point lies within float64 rounding of the boundary (the closest is 2.5e-4 away from delta),
            # so the comparisons below cannot flip by rounding
            assert abs(d - delta) > 1e-9
            dppo_masks_pos = not (d <= delta or rv <= 1)  # A > 0, line 1518
            dppo_masks_neg = not (d <= delta or rv >= 1)  # A < 0, line 1519
            assert dppo_masks_pos == (rv > upper.item()), (pv, rv)  # the band's upper clip
            assert dppo_masks_neg == (rv < lower.item()), (pv, rv)  # the band's lower clip


def test_dppo_gradient_equals_the_surrogate_inside_the_band():
    """With l = log b: d/dl [-A w l] = -A w (w = min(r, C) without gradient) and d/dl [-A e^(l - l_old)] = -A r, the
    PPO/Band surrogate's gradient where it is not clipped: the same while r <= C."""
    A, w, l, l_old = sp.symbols("A w l l_old", real=True)
    assert sp.diff(-A * w * l, l) == -A * w
    ratio = sp.exp(l - l_old)
    assert sp.simplify(sp.diff(-A * ratio, l) - (-A * ratio)) == 0


if __name__ == "__main__":  # the asserts pytest collects from this file, run on their own
    import pytest

    torch.set_num_threads(1)
    raise SystemExit(pytest.main([__file__, "-q"]))

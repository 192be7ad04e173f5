"""band.py against the paper's claims (docs/paper.md §2), each test named after the claim it checks.

References are never band.py itself: brute force over random full-support distributions (Lemma 1, Theorem 1), a
50-digit mpmath root of g_f(p, r) = delta computed from the definition (accuracy, Props. 1-4, mirror identity), the
paper's closed forms and its table of reference values. Property-based fuzzing lives in test_band_fuzz.py, the
symbolic derivations in derivations/.
"""
import math
import random

import mpmath as mp
import pytest
import torch

import band

F64, F32 = torch.float64, torch.float32
mp.mp.dps = 50


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is fastest, and a busy 2-core machine stalls OpenMP barriers for milliseconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- the 50-digit reference: roots of g_f(p, r) = delta from the definition ------------------------------------------
# generator f and its derivative, as mpmath functions (the same f as band.DIVERGENCES and derivations/GENERATORS)
MP_F = {
    "bandkl": (lambda v: v - 1 - mp.log(v), lambda v: 1 - 1 / v),
    "bandtv": (lambda v: abs(v - 1) / 2, lambda v: mp.sign(v - 1) / 2),
    "bandchi2": (lambda v: (v - 1) ** 2, lambda v: 2 * (v - 1)),
    "bandhellinger": (lambda v: (mp.sqrt(v) - 1) ** 2, lambda v: 1 - 1 / mp.sqrt(v)),
}
MP_F0 = {"bandkl": mp.inf, "bandtv": mp.mpf(1) / 2, "bandchi2": mp.mpf(1), "bandhellinger": mp.mpf(1)}


def _root(h, hi_val=0):
    """Root of the decreasing function h on (-inf, 0] with h(0) < 0 < h(-inf): bracket by doubling, then solve."""
    lo, hi = mp.mpf(-1), mp.mpf(hi_val)
    while h(lo) <= 0:
        lo, hi = 2 * lo, lo
        if lo < -1e30:
            return -mp.inf
    try:
        return mp.findroot(h, (lo, hi), solver="anderson")
    except ValueError:  # rare non-convergence: plain bisection, 200 halvings
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if h(mid) > 0 else (lo, mid)
        return (lo + hi) / 2


def mp_band(name, logp, delta):
    """(lower, upper) to 50 digits and the condition numbers |d log r / d log p| of both (inf where saturated)."""
    f, df = MP_F[name]
    logp, delta = mp.mpf(logp), mp.mpf(delta)
    p, q = mp.exp(logp), -mp.expm1(logp)
    g = lambda r, c: p * f(r) + q * f(c) if r > 0 else p * MP_F0[name] + q * f(c)  # noqa: E731

    # lower: r = e^x, c = (1 - p r)/q, g decreasing in x; saturated (r = 0) iff g(p, 0) <= delta (Prop. 3)
    if MP_F0[name] < mp.inf and g(0, 1 / q) <= delta:
        lower = mp.mpf(0)
    else:
        x = _root(lambda t: g(mp.exp(t), (1 - p * mp.exp(t)) / q) - delta, -mp.mpf(10) ** -40)
        lower = mp.exp(x)
    # upper: c = e^y (the other tokens' factor), r = (1 - q c)/p, g decreasing in y; saturated iff g(p, 1/p) <= delta
    if MP_F0[name] < mp.inf and p * f(1 / p) + q * MP_F0[name] <= delta:
        upper = 1 / p
    else:
        y = _root(lambda t: g((1 - q * mp.exp(t)) / p, mp.exp(t)) - delta, -mp.mpf(10) ** -40)
        upper = (1 - q * mp.exp(y)) / p

    def kappa(r):  # implicit function theorem on g(p, r) = delta: d log r / d log p = -(p g_p) / (r g_r)
        if r == 0 or r == 1 / p:
            return mp.inf
        c = (1 - p * r) / q
        g_p = f(r) - f(c) + df(c) * (1 - r) / q
        g_r = p * (df(r) - df(c))
        return abs(p * g_p / (r * g_r))

    return lower, upper, kappa(lower), kappa(upper)


def accuracy_points(n, seed):
    """(logp, delta) over the solver's domain: log p in [-60, -1e-12], delta in [1e-4, 2], edges included."""
    rng = random.Random(seed)
    pts = []
    for i in range(n):  # log p log-uniform in |log p| (near 0) and uniform (the tail), delta log-uniform
        lp = -(10 ** rng.uniform(-12, math.log10(60))) if i % 2 else -rng.uniform(1e-12, 60)
        pts.append((lp, 10 ** rng.uniform(-4, math.log10(2))))
    pts += [(lp, d) for lp in (-60.0, -30.0, -1.0, -1e-6, -1e-12) for d in (1e-4, 0.05, 2.0)]
    return pts


def band_one(name, logp, delta, dtype):
    lower, upper = band.band(torch.tensor([logp], dtype=dtype), name, delta)
    return lower.item(), upper.item()


# --- Lemma 1 and Theorem 1 by brute force -------------------------------------------------------------------------
def _kl_f(u):  # u - 1 - log u, without cancellation near u = 1 and with log u exact for tiny u
    t = u - 1
    return torch.where(u < 0.5, t - torch.log(u), t - torch.log1p(t))


F = {  # the generators f(u) and f'(u), written here independently of band.py
    "bandkl": (_kl_f, lambda u: 1 - 1 / u),
    "bandtv": (lambda u: 0.5 * (u - 1).abs(), lambda u: 0.5 * torch.sign(u - 1)),
    "bandchi2": (lambda u: (u - 1) ** 2, lambda u: 2 * (u - 1)),
    "bandhellinger": (lambda u: (u.sqrt() - 1) ** 2, lambda u: 1 - u.rsqrt()),
}


def divergence(name, new, old):
    """D_f(new || old) = sum old f(new / old) over the last dim (float64, full-support old)."""
    return (old * F[name][0](new / old)).sum(-1)


def random_old(gen, batch, n):
    """Full-support distributions over n tokens, spread from near-uniform to peaked; token 0 is the sampled one."""
    spread = torch.empty(batch, 1, dtype=F64).uniform_(0.1, 4, generator=gen)
    old = torch.exp(spread * torch.randn(batch, n, generator=gen, dtype=F64))  # log-normal weights
    return old / old.sum(-1, keepdim=True)


def _project(z, w, mass):
    """Projection onto the simplex slice {y >= 0, sum y = mass} in the metric sum (y - z)^2 / w (sort-based):
    y = max(0, z - lam w) with lam from the largest prefix of z / w that stays positive."""
    ratio, order = (z / w).sort(-1, descending=True)
    cz, cw = z.gather(-1, order).cumsum(-1), w.expand_as(z).gather(-1, order).cumsum(-1)
    lam = (cz - mass[..., None]) / cw
    k = ((ratio > lam).sum(-1, keepdim=True) - 1).clamp_min(0)
    return (z - lam.gather(-1, k) * w).clamp_min(0)


def min_complement_divergence(name, old, mass, iters=120, seed=0):
    """Projected optimiser: minimise sum_v w_v f(y_v / w_v) over the complement of token 0 (w = pi_old there) on the
    slice {y >= 0, sum y = mass} (token 0 keeps 1 - mass): scaled gradient steps y - eta w f'(y/w), projected back
    onto the slice, eta chosen as the best of a geometric grid (monotone). Starts from a random point on the slice,
    not from the uniform rescaling. Returns the smallest divergence found, per row."""
    f, df = F[name]
    w = old[:, 1:]  # (B, n-1)
    gen = torch.Generator().manual_seed(seed)
    y = w * torch.exp(torch.randn(w.shape, generator=gen, dtype=F64))
    y = mass[:, None] * y / y.sum(-1, keepdim=True)
    objective = lambda y, w: (w * f(y / w)).sum(-1)  # noqa: E731
    etas = 4.0 * 0.5 ** torch.arange(48, dtype=F64)  # (E,)
    best = objective(y, w)
    for _ in range(iters):
        grad = df(y / w).clamp(-1e8, 1e8)  # KL, Hellinger: f'(0) = -inf
        z = y[:, None, :] - etas[None, :, None] * w[:, None, :] * grad[:, None, :]  # (B, E, n-1)
        cand = _project(z, w[:, None, :], mass[:, None].expand(-1, len(etas)))
        value, j = objective(cand, w[:, None, :]).nan_to_num(math.inf).min(-1)
        better = value < best
        y = torch.where(better[:, None], cand[torch.arange(len(y)), j], y)
        best = torch.minimum(best, value)
    return best


@pytest.mark.parametrize("name", sorted(band.DIVERGENCES))
def test_lemma1_uniform_complement_is_optimal(name):
    """Lemma 1: for a fixed new mass p r of the token, rescaling every other token by c = (1 - p r)/(1 - p) gives the
    smallest D_f; a projected optimiser from random starts over 5-50 tokens never goes below it (and gets close)."""
    gen = torch.Generator().manual_seed(1)
    for n in (5, 13, 50):
        old = random_old(gen, 24, n)
        p = old[:, 0]
        # ratios below 1 and up to 0.95 / p (the complement keeps some mass)
        side = torch.where(torch.rand(24, generator=gen) < 0.5, 1, 1 / p)
        r = torch.empty(24, dtype=F64).uniform_(0.05, 0.95, generator=gen) * side
        mass = 1 - p * r  # new mass of the complement
        uniform = (1 - p) * F[name][0](mass / (1 - p))  # the complement's share of D_f at c
        best = min_complement_divergence(name, old, mass)
        assert (best >= uniform - 1e-12 * (1 + uniform)).all(), (best - uniform).min()
        if name != "bandtv":  # sanity: the optimiser does reach the minimum (TV's kinks stall gradient steps)
            assert (best <= uniform * (1 + 1e-2) + 1e-12).all(), (best - uniform).max()


@pytest.mark.parametrize("name", sorted(band.DIVERGENCES))
def test_theorem1_band_is_exactly_the_reachable_ratios(name):
    """Theorem 1: no new distribution inside the trust region (random search over 5-50 tokens, proposals of every
    scale) gives the token a ratio outside [lower, upper]; the uniformly rescaled one reaches both ends with D_f = delta
    (or sits at a simplex end, Prop. 3), and the projected optimiser finds nothing inside the region beyond them."""
    gen = torch.Generator().manual_seed(2)
    for delta in (0.05, 0.1):
        for n in (5, 20, 50):
            old = random_old(gen, 16, n)  # (B, n)
            p = old[:, 0]
            lower, upper = band.band(p.log(), name, delta)
            # random search: the token's ratio drawn around the band, the complement perturbed at random scales
            S = 1500
            r = torch.exp(torch.empty(16, S, dtype=F64).uniform_(-1, 1, generator=gen)) * torch.where(
                torch.rand(16, S, generator=gen) < 0.5, lower[:, None] + 1e-3, upper[:, None])
            r = torch.minimum(r, 1 / p[:, None])
            sigma = torch.exp(torch.empty(16, S, 1, dtype=F64).uniform_(-9, 1, generator=gen))
            comp = old[:, None, 1:] * torch.exp(sigma * torch.randn(16, S, n - 1, generator=gen, dtype=F64))
            comp = (1 - p[:, None, None] * r[..., None]) * comp / comp.sum(-1, keepdim=True)
            new = torch.cat([p[:, None, None] * r[..., None], comp], -1)
            inside = divergence(name, new, old[:, None, :]) <= delta
            ratio = new[..., 0] / p[:, None]
            assert inside.float().mean() > 0.05  # the search does land inside the region
            tol = 1e-9
            assert (ratio[inside] >= (lower[:, None].expand_as(ratio)[inside] * (1 - tol)) - 1e-15).all()
            assert (ratio[inside] <= upper[:, None].expand_as(ratio)[inside] * (1 + tol)).all()
            # the uniformly rescaled distribution at each end has D_f = delta, unless the end is a simplex end
            # (Prop. 3) or not representable (KL's r or c below 1e-300: e^-delta/p underflows)
            can_saturate = name != "bandkl"  # KL's f(0) = inf: a 0 lower bound is an underflow, not Prop. 3
            at_simplex = ((lower == 0) & can_saturate, (upper >= 1 / p * (1 - 1e-12)) & can_saturate)
            for end, sat in zip((lower, upper), at_simplex):
                c = (1 - p * end) / (1 - p)
                uniform = torch.cat([(p * end)[:, None], c[:, None] * old[:, 1:]], -1)
                d = divergence(name, uniform, old)
                check = ~sat & (end > 1e-300) & (c > 1e-300)
                assert torch.allclose(d[check], torch.full_like(d[check], delta), rtol=1e-9, atol=0), d
                assert (d[sat] <= delta * (1 + 1e-12)).all()
            # the optimiser: just beyond either end, even the best complement leaves the trust region
            for end, step in ((upper, 1 + 1e-3), (lower, 1 - 1e-3)):
                ok = (end > 0) & (end * step < 1 / p)
                r_out = end[ok] * step
                best = p[ok] * F[name][0](r_out) + min_complement_divergence(name, old[ok], 1 - p[ok] * r_out, iters=40)
                assert (best > delta).all(), (name, best)


# --- Propositions 1-4 and the mirror identity against the mpmath reference -------------------------------------------
PAPER_TABLE = [  # docs/paper.md §2, KL, delta = 0.05: (p, lower, upper)
    (0.001, 0.0, 53.548), (0.01, 0.0024974, 7.8098), (0.08, 0.26170, 2.41055), (0.2, 0.47594, 1.71768),
    (0.5, 0.69152, 1.30848), (0.8, 0.82058, 1.13101), (0.99, 0.93121, 1.01008),
]


def last_digit(v):
    """One unit in the last printed digit of v (0.0024974 -> 1e-7)."""
    return 10 ** (math.floor(math.log10(v)) - len(str(v).replace(".", "").lstrip("0")) + 1)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_theorem1_paper_reference_values(dtype):
    """The paper's table of Band-KL bounds at delta = 0.05 (to the digits printed there)."""
    ps = torch.tensor([row[0] for row in PAPER_TABLE], dtype=dtype)
    lower, upper = band.band(ps.log(), "bandkl", 0.05)
    for (p, lo, up), got_lo, got_up in zip(PAPER_TABLE, lower.tolist(), upper.tolist()):
        assert abs(got_up - up) <= 0.5 * last_digit(up) * 1.01, (p, got_up, up)
        assert (got_lo < 1e-6) if lo == 0 else abs(got_lo - lo) <= 0.5 * last_digit(lo) * 1.01, (p, got_lo, lo)


@pytest.fixture(scope="module")
def kl_reference():
    """300 (logp, delta) points with their 50-digit KL bounds; logp as float32 so both dtypes see the same input."""
    pts = [(float(torch.tensor(lp, dtype=F32)), d) for lp, d in accuracy_points(285, seed=3)]
    return [(lp, d, *mp_band("bandkl", lp, d)) for lp, d in pts]


@pytest.mark.parametrize("dtype,rtol", [(F64, 1e-10), (F32, 1e-5)])
def test_theorem1_kl_matches_50_digit_reference(kl_reference, dtype, rtol):
    """Band-KL: relative error <= 1e-10 (float64) / 1e-5 (float32) for log p in [-60, -1e-12], delta in [1e-4, 2],
    allowing only the conditioning forced by rounding p = exp(log p): |d log r / d log p| * 4 u (u = unit roundoff).
    Results in the subnormal range get two subnormal spacings more."""
    u = torch.finfo(dtype).eps / 2
    sub = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    for (lp, d, lo, up, k_lo, k_up) in kl_reference:
        got_lo, got_up = band_one("bandkl", lp, d, dtype)
        for got, want, kappa in ((got_lo, lo, k_lo), (got_up, up, k_up)):
            if float(want) == 0:  # below float64's range (e.g. e^-(delta/p) at p = e^-60): must come out 0
                assert got == 0, (lp, d, got)
                continue
            allowed = (rtol + 4 * float(kappa) * u) * float(want) + 2 * sub
            err = float(abs(mp.mpf(got) - want))
            assert err <= allowed, (lp, d, got, float(want), err / float(want), float(kappa))


def test_prop1_exact_limits_at_both_ends():
    """p -> 1: lower = r* = e^-delta, upper = 1 (exactly, in both dtypes, at log p = 0, -1e-30, -1e-12 (float32: p
    rounds to 1)); p -> 0: the true root, not 1/p: p (upper - 1) -> 1 - e^-delta and lower = 0."""
    for dtype in (F32, F64):
        for delta in (1e-4, 0.05, 2.0):
            lower, upper = band.band(torch.tensor([0.0, -1e-30], dtype=dtype), "bandkl", delta)
            assert (lower == torch.tensor(math.exp(-delta), dtype=dtype)).all() and (upper == 1).all()
            lp = -60.0 if dtype == F32 else -700.0
            lower, upper = band.band(torch.tensor([lp], dtype=dtype), "bandkl", delta)
            p = math.exp(lp)
            want = float(mp_band("bandkl", lp, delta)[1])
            assert lower.item() == 0 and math.isclose(upper.item(), want, rel_tol=1e-6 if dtype == F32 else 1e-13)
            assert math.isclose(p * (want - 1), -math.expm1(-delta), rel_tol=1e-9)  # the limit of Prop. 1
            assert upper.item() < 0.9 / p  # far below the authors' override 1/p


@pytest.mark.parametrize("name", sorted(band.DIVERGENCES))
def test_prop2_monotone_in_p_and_in_delta(name):
    """Prop. 2: upper decreases and lower increases in p (strictly where neither saturated nor underflowed);
    both widen with delta."""
    logp = torch.linspace(-25, -1e-9, 4001, dtype=F64)
    for delta in (1e-3, 0.05, 0.5):
        lower, upper = band.band(logp, name, delta)
        dl, du = lower.diff(), upper.diff()
        assert (dl >= 0).all() and (du <= 0).all()
        p = logp.exp()
        free_lo = (lower[:-1] > 1e-300) & (lower[1:] < 1)
        free_up = upper[1:] < 1 / p[1:] * (1 - 1e-12)
        assert (dl[free_lo] > 0).all() and (du[free_up] < 0).all()
    lo_prev, up_prev = band.band(logp, name, 1e-3)
    for delta in (0.01, 0.05, 0.2, 1.0):
        lo, up = band.band(logp, name, delta)
        assert (lo <= lo_prev).all() and (up >= up_prev).all()
        lo_prev, up_prev = lo, up


def test_prop3_saturation_thresholds():
    """Prop. 3: TV upper = 1/p iff p >= 1 - delta, lower = 0 iff p <= delta; chi^2 at 1/(1 + delta) and
    delta/(1 + delta); KL never; checked in float32 and float64 on both sides of each threshold."""
    thresholds = {"bandtv": (lambda d: 1 - d, lambda d: d), "bandchi2": (lambda d: 1 / (1 + d), lambda d: d / (1 + d))}
    for dtype in (F32, F64):
        eps = 1e-3 if dtype == F32 else 1e-7
        for name, (up_at, lo_at) in thresholds.items():
            for delta in (0.05, 0.1, 0.3):
                ps = torch.tensor([up_at(delta) * (1 - eps), up_at(delta) * (1 + eps), lo_at(delta) * (1 - eps),
                                   lo_at(delta) * (1 + eps)], dtype=F64)
                lower, upper = band.band(ps.log().to(dtype), name, delta)
                inv_p = torch.exp(-ps.log().to(dtype))
                assert upper[0] < inv_p[0] and upper[1] == inv_p[1] and lower[2] == 0 and lower[3] > 0, (name, delta)
        ps = torch.tensor([0.01, 0.3, 0.9], dtype=dtype)
        lower, upper = band.band(ps.log(), "bandkl", 1.0)
        assert (lower > 0).all() and (upper < 1 / ps).all()


@pytest.mark.parametrize("name", ["bandtv", "bandchi2", "bandhellinger"])
def test_prop4_closed_forms_and_generic_solver_match_reference(name):
    """Prop. 4: the TV and chi^2 closed forms, and the generic numerical path (Hellinger: f alone), agree with the
    50-digit root of g_f = delta (float64, relative 1e-9 or 1e-15 absolute below the saturation edge)."""
    for lp, d in accuracy_points(40, seed=4):
        lo, up, _, _ = mp_band(name, lp, d)
        got_lo, got_up = band_one(name, lp, d, F64)
        assert abs(got_lo - float(lo)) <= 1e-9 * float(lo) + 1e-15, (lp, d, got_lo, float(lo))
        assert abs(got_up - float(up)) <= 1e-9 * float(up), (lp, d, got_up, float(up))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_mirror_identity(dtype):
    """Mirror identity: lower(p) = [1 - (1 - p) upper(1 - p)] / p, for every divergence, p in [0.05, 0.95]."""
    ps = torch.linspace(0.05, 0.95, 37, dtype=F64)
    tol = 1e-4 if dtype == F32 else 1e-10
    for name in band.DIVERGENCES:
        lower, _ = band.band(ps.log().to(dtype), name, 0.1)
        _, upper_c = band.band(torch.log1p(-ps).to(dtype), name, 0.1)
        mirrored = ((1 - (1 - ps) * upper_c.double()) / ps).clamp_min(0)
        torch.testing.assert_close(lower.double(), mirrored, rtol=tol, atol=tol)


# --- ratio_bounds: every method's interval ----------------------------------------------------------------------
def test_ratio_bounds_methods():
    """Every method of the comparison through the one dict, with its published defaults and the cap at max_ratio."""
    assert set(band.BOUNDS) == {"clip", "clip-higher", "noclip", "dcpo", "bandkl", "bandtv", "bandchi2",
                                "bandhellinger", "bandkl-relax"}
    ps = torch.tensor([1e-4, 0.01, 0.2, 0.9, 1.0], dtype=F64)
    logp = ps.log()
    for method, (lo, hi) in {"clip": (0.8, 1.2), "clip-higher": (0.8, 1.28)}.items():
        lower, upper = band.ratio_bounds(logp, method)
        assert (lower == lo).all() and (upper == hi).all()
    lower, upper = band.ratio_bounds(logp, "clip", eps_low=0.1, eps_high=0.3)
    assert (lower == 0.9).all() and (upper == 1.3).all()
    lower, upper = band.ratio_bounds(logp, "dcpo", max_ratio=math.inf)
    want_lo = [0.5 + 0.5 * math.sqrt(max(1 - 4 * 0.16 / p, 0)) for p in ps.tolist()]
    want_up = [0.5 + 0.5 * math.sqrt(1 + 4 * 0.20 / p) for p in ps.tolist()]
    torch.testing.assert_close(lower, torch.tensor(want_lo, dtype=F64))
    torch.testing.assert_close(upper, torch.tensor(want_up, dtype=F64))
    assert band.ratio_bounds(logp, "dcpo")[1].max() == 10.0
    for name in band.DIVERGENCES:
        lower, upper = band.ratio_bounds(logp, name, delta=0.1)
        b_lo, b_up = band.band(logp, name, 0.1)
        assert torch.equal(lower, b_lo) and torch.equal(upper, b_up.clamp_max(10.0))
    lower, upper = band.ratio_bounds(logp, "bandkl-relax", delta=0.05, max_ratio=5.0)
    b_lo, b_up = band.band(logp, "bandkl", 0.05)
    assert torch.equal(lower, b_lo.clamp_max(0.8)) and torch.equal(upper, b_up.clamp_min(1.28).clamp_max(5.0))
    lower, upper = band.ratio_bounds(logp, "noclip", delta=0.05, eps_low=0.1, eps_high=0.3, max_ratio=7.0)
    assert (lower == 0).all() and (upper == 7.0).all()  # no clip: [0, cap], whatever p, delta or eps
    with pytest.raises(ValueError, match="valid: " + ", ".join(sorted(band.BOUNDS))):
        band.ratio_bounds(logp, "ppo")
    with pytest.raises(ValueError, match="max_ratio"):
        band.ratio_bounds(logp, "bandkl", max_ratio=0.5)


def test_noclip_is_the_unclipped_surrogate_below_the_cap():
    """The no-clip control arm: with band.ratio_bounds(.., "noclip") the surrogate's gradient is the plain policy
    gradient d(-A r)/d log π = -A r for every ratio below the cap (clip zeroes it outside [0.8, 1.2] when the
    advantage pushes further out), and the dual clip still caps A < 0 at r > c, as for every method."""
    import grpo
    r = torch.tensor([[0.5, 0.9, 1.5, 3.0, 12.0]], dtype=F64)
    old = torch.full_like(r, math.log(0.3))
    for adv, want in ((1.0, [-0.5, -0.9, -1.5, -3.0, 0.0]),      # A > 0: r = 12 is above the cap 10: clipped
                      (-1.0, [0.5, 0.9, 1.5, 3.0, 0.0])):        # A < 0: r = 12 > c = 10: the dual clip's constant
        logp = (old + r.log()).requires_grad_()
        lower, upper = band.ratio_bounds(old, "noclip", max_ratio=10.0)
        loss, _ = grpo.policy_loss(logp, old, torch.tensor([adv], dtype=F64), torch.ones_like(r), lower, upper,
                                   clip_c=10.0, agg="token-mean", num_tokens=1.0)
        loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor([want], dtype=F64))  # one token's weight: Z = 1

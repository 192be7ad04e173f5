"""Band: the per-token ratio interval of an f-divergence trust region (BandPO, docs/paper.md §2-3).

PPO clips the ratio r to a fixed [1 - eps, 1 + eps]; BandPO clips it to the exact set of ratios that
a next-token distribution inside the trust region D_f(pi_new || pi_old) <= delta can give the
sampled token. Lemma 1 (rescale the rest of the vocabulary uniformly) and Theorem 1 of arXiv
2603.04918 make it one interval, {r in [0, 1/p] : g(p, r) = p f(r) + (1 - p) f(c) <= delta} (`_g`);
Props. 1-4 give its limits, monotonicity, saturation and closed forms. `BOUNDS` maps each method to
its plain function, `EPS` holds the published epsilons; nothing else branches on the method.

Glossary (the paper's symbols; tensors have the shape of `old_logp`)
    old_logp   log p, the sampled token's log-probability under the old (rollout) policy
    p, q       exp(old_logp) and 1 - p = -expm1(old_logp), both computed accurately from log p
    r, c       pi_new(a) / pi_old(a); c = (1 - p r) / (1 - p), every other token's factor (Lemma 1)
    lower      r_lower, and `upper` r_upper: the band; x = log r, the variable of the root solver
    f, delta   generator (convex, f(1) = 0) and radius of D_f = sum pi_old f(pi_new / pi_old); our
               `delta` is this divergence radius, NOT TRL's `delta` (an upper cap on the ratio)

Departures from the authors' code (OpenMOSS/BandPO, verl/bandpo/band): no overrides near p = 0 or 1
(exact there; theirs sets upper = 1/p for p < 1e-6, 10-100x the true root); their default union with
clip-higher is our method `bandkl-relax`; the cap is `max_ratio=10`, the paper's (their default 100).

    lower, upper = band(old_logp, "bandkl", delta=0.05)          # the exact interval, no cap
    lower, upper = ratio_bounds(old_logp, "bandkl", delta=0.05)  # what the loss clips to (cap 10)
    python band.py                                               # print the interval at a few p
"""

import math
from typing import Callable, NamedTuple, Optional

import torch

X_FLOOR = -1000.0  # log r below which exp(x) = 0 in every float dtype: the bracket never goes lower
# the generic path brackets log r_lower in [-40, 0]: bounds below e^-40 ~ 4e-18 come out ~e^-40
X_GENERIC_MIN = -40.0


# --- the divergence registry ---------------------------------------------------------------------
class Divergence(NamedTuple):
    """One generator f. f and df get r and t = r - 1, both exact, and use whichever keeps the digits
    (t near r = 1, r near r = 0: float64's 1 + t cannot hold r = 1e-20)."""

    f: Callable  # (r, t) -> f(r)
    df: Callable  # (r, t) -> f'(r)
    f0: float  # f(0); math.inf when a token can never be driven to zero (no saturation, Prop. 3)
    r_star: Callable  # delta -> lim_{p -> 1} lower (Prop. 1), a Python float
    closed_form: Optional[Callable] = None  # (old_logp, delta) -> (lower, upper), Prop. 4
    g: Optional[Callable] = None  # (x, p, q, a) -> (g, dg/dx) where p f(r) + q f(c) loses digits
    bracket: Optional[Callable] = None  # (p, q, log_q, delta) -> proven (lo, hi); None: [-40, 0]
    newton: Optional[Callable] = None  # accurate Newton step x -> x_new; None: x - (g - delta) / g'
    newton_steps: Optional[dict] = None  # dtype -> Newton count, when no bisection is needed


def _tv_closed(old_logp, delta):
    """Prop. 4, TV: g = p |r - 1|, so the band is [max(0, 1 - delta/p), min(1/p, 1 + delta/p)]."""
    inv_p = torch.exp(-old_logp)
    return (1 - delta * inv_p).clamp_min(0), torch.minimum(inv_p, 1 + delta * inv_p)


def _chi2_closed(old_logp, delta):
    """Prop. 4, chi^2: g = p (r - 1)^2 / (1 - p), so |r - 1| <= sqrt(delta (1 - p) / p), within
    [0, 1/p]."""
    inv_p = torch.exp(-old_logp)
    half_width = torch.sqrt(delta * -torch.expm1(old_logp) * inv_p)
    return (1 - half_width).clamp_min(0), torch.minimum(inv_p, 1 + half_width)


def _kl_bracket(p, q, log_q, delta):
    """Proven bracket of x = log r_lower for KL (derive_kl_solver.py): with G(x) = g(p, e^x),
        G >= -p x + q log q  (-q log c lies in [q log q, 0])  =>  x >= lo = (q log q - delta) / p
        G <= -p x,  G <= p x^2 / (2 q)  (G(0) = G'(0) = 0, G'' <= p/q)
                                                  =>  x <= hi = -max(delta/p, sqrt(2 delta q/p))"""
    lo = (q * log_q - delta) / p
    hi = -torch.maximum(delta / p, torch.sqrt(2 * delta * q / p))
    return lo.clamp_min(X_FLOOR), hi.clamp(X_FLOOR, -torch.finfo(p.dtype).tiny)


def _kl_g(x, p, q, a):
    """KL: g(p, e^x) = -p x - q log1p(u), u = c - 1 = -(p/q) expm1(x), and dg/dx = -u / (1 + u).
    This is the generic p f(r) + q f(c) with the linear terms p (r - 1) + q (c - 1) = 0 cancelled
    exactly and log r = x used directly."""
    u = -a * torch.expm1(x)
    return -p * x - q * torch.log1p(u), -u / (1 + u)


def _kl_newton(x, p, q, a, delta):
    """One Newton step on h(x) = G(x) - delta, G(x) = -p x - q log1p(u), u = -a expm1(x),
    h' = -u / (1 + u), rearranged (derive_kl_solver.py) so that no large terms cancel when r is tiny
    (there x_new -> -(q l + delta)/p):
        x_new = x - h / h' = -((q l + delta) (1 + u) + p e^x x) / u,  l = log c = log1p(u)."""
    # In place, unlike the rest of this file: this is the solver's hot loop (3-4 steps on the
    # stacked (2, N) tensor), where on CPU fresh temporaries cost more than the arithmetic
    # (docs/benchmarks.md, "band.py: the Newton step in place"). The one-off bracket and setup lines
    # read as formulas instead.
    t = torch.expm1(x)  # r - 1, r = e^x
    u = -a * t  # c - 1 = -(p/q)(r - 1)
    num = torch.log1p(u).mul_(q).add_(delta)  # q l + delta, l = log c = log1p(u)
    num.mul_(1 + u)  # (q l + delta)(1 + u)
    num.addcmul_(t.add_(1).mul_(p), x)  # + p e^x x  (t is now p e^x)
    return num.div_(u).neg_()  # x_new = -num / u


# Newton steps after which the KL root is exact to the dtype's precision, derived (and asserted
# equal) in derivations/derive_kl_solver.py from the first step's error and quadratic convergence.
_KL_NEWTON_STEPS = {torch.float32: 3, torch.float64: 4}

# One entry per generator f; a new convex f with f(1) = 0 is one more entry.
#   bandkl         f(u) = u - 1 - log u   D_f = KL(pi_old || pi_new)  log-space Newton, `_kl_newton`
#   bandtv         f(u) = |u - 1| / 2     total variation             closed form (Prop. 4)
#   bandchi2       f(u) = (u - 1)^2       Pearson chi^2               closed form (Prop. 4)
#   bandhellinger  f(u) = (sqrt u - 1)^2  squared Hellinger (x 2)     generic: bisection + Newton
DIVERGENCES = {
    "bandkl": Divergence(
        f=lambda r, t: t - torch.where(r < 0.5, torch.log(r), torch.log1p(t)),
        df=lambda r, t: t / r,
        f0=math.inf,
        r_star=lambda d: math.exp(-d),
        g=_kl_g,
        bracket=_kl_bracket,
        newton=_kl_newton,
        newton_steps=_KL_NEWTON_STEPS,
    ),
    "bandtv": Divergence(
        f=lambda r, t: 0.5 * t.abs(),
        df=lambda r, t: 0.5 * torch.sign(t),
        f0=0.5,
        r_star=lambda d: max(1.0 - d, 0.0),
        closed_form=_tv_closed,
    ),
    "bandchi2": Divergence(
        f=lambda r, t: t * t,
        df=lambda r, t: 2 * t,
        f0=1.0,
        r_star=lambda d: 1.0,
        closed_form=_chi2_closed,
    ),
    # Generic path: nothing but f. (sqrt u - 1)^2 is twice the squared Hellinger of some texts.
    "bandhellinger": Divergence(
        f=lambda r, t: (t / (torch.sqrt(r) + 1)) ** 2,  # (sqrt r - 1)^2, no cancellation near r = 1
        df=lambda r, t: 1 - torch.rsqrt(r),
        f0=1.0,
        r_star=lambda d: max(1.0 - d / 2, 0.0) ** 2,
    ),
}


# --- the solver ----------------------------------------------------------------------------------
def _g(div, x, p, q, a):
    """g(p, e^x) and its x-derivative e^x dg/dr = p e^x (f'(r) - f'(c)) (Theorem 1), with r = e^x,
    r - 1 = expm1(x) and c - 1 = -(p/q) expm1(x) computed without cancellation (c >= 1 here, so
    1 + (c - 1) keeps its digits)."""
    if div.g is not None:
        return div.g(x, p, q, a)
    r, t = torch.exp(x), torch.expm1(x)
    u = -a * t
    c = 1 + u
    return p * div.f(r, t) + q * div.f(c, u), p * r * (div.df(r, t) - div.df(c, u))


def _log_lower_root(p, q, log_q, delta, div):
    """x = log r_lower: the root of g(p, e^x) = delta in x < 0 (-inf where it saturates: Prop. 3).

    `_solve` calls it once on (p, q) and (q, p) stacked: the lower bound and the mirror problem of
    the upper one. KL has no closed form (Prop. 4); in x, G(x) = g(p, e^x) is convex and decreasing,
    and `_kl_bracket` gives a proven bracket [lo, hi]. Newton from hi lands left of the root and
    then moves monotonically right, so each iterate is a new lower end of the bracket, and each step
    is clamped to [lo, hi] so rounding cannot leave it. The first step's error bound and quadratic
    convergence fix the count: 3 steps in float32, 4 in float64 (derivations/derive_kl_solver.py),
    where bisecting the same bracket takes 24 / 53 halvings. The authors bisect in r, which cannot
    resolve roots near 0 and 1/p (hence their overrides) and reads the bracket width back to the
    host every step; here there is no `.item()` and no data-dependent branch, so it runs under
    torch.compile and CUDA graphs. Divergences without a bracket (the generic path: Hellinger)
    bisect x in [-40, 0] to the dtype's precision (29 / 58 halvings) and polish with one clamped
    Newton step."""
    a = p / q
    if div.bracket is not None:
        lo, hi = div.bracket(p, q, log_q, delta)
        n_bisect = 0
    else:
        lo, hi = torch.full_like(p, X_GENERIC_MIN), torch.full_like(p, -torch.finfo(p.dtype).tiny)
        # halve until the bracket is narrower than the dtype's spacing near 1 (exact by itself)
        n_bisect = math.ceil(math.log2(-X_GENERIC_MIN / torch.finfo(p.dtype).eps))
    # bracketing core: g(e^x) decreases on x < 0, so g > delta means the root lies to the right
    for _ in range(n_bisect):
        mid = 0.5 * (lo + hi)
        right = _g(div, mid, p, q, a)[0] > delta
        lo, hi = torch.where(right, mid, lo), torch.where(right, hi, mid)
    # Newton polish, clamped to the bracket (KL: the whole solve, see the docstring)
    x = hi
    for _ in range(div.newton_steps[p.dtype] if div.newton_steps else 1):
        if div.newton is not None:
            x_new = div.newton(x, p, q, a, delta)
        else:
            g, dg = _g(div, x, p, q, a)
            x_new = x - (g - delta) / dg
        # clamped: keeps [lo, hi] even for +-inf steps (a 0 derivative where p underflows)
        x = x_new.clamp(lo, hi)
    if math.isfinite(div.f0):  # Prop. 3: r_lower = 0 iff g(p, 0) = p f(0) + q f(1/q) <= delta
        saturated = p * div.f0 + q * div.f(1 + a, a) <= delta
        x = torch.where(saturated, -math.inf, x)
    return x


def _solve(logp, div, delta):
    """The numerical path of `band` (every divergence can take it; TV and chi^2 have closed forms).

    Both bounds are one problem (Mirror identity): log r_lower is the lower root for (p, q), and log
    s, the lower root for (q, p), gives r_upper = (1 - q s) / p. They are solved together, stacked,
    which halves the kernel count of the eager path (on a busy CPU the per-kernel cost, not the
    arithmetic, dominates)."""
    tiny = torch.finfo(logp.dtype).tiny  # p, q below the smallest normal: tiny (keeps steps finite)
    p = torch.exp(logp).clamp_min(tiny)  # (...)
    q = (-torch.expm1(logp)).clamp_min(tiny)  # (...) 1 - p without cancellation
    # log q without cancellation: log1p(-p) for p < 1/2 (q = 1 - p rounds there), else log(q)
    log_q = torch.where(logp < -math.log(2), torch.log1p(-p), torch.log(q))
    x = _log_lower_root(torch.stack([p, q]), torch.stack([q, p]), torch.stack([log_q, logp]),
                        delta, div)  # (2, ...)
    lower = x[0].exp()
    inv_p = torch.exp(-logp)  # (...) 1/p, exact even where p underflows (inf for p = 0)
    upper = 1 - torch.expm1(x[1]) * q * inv_p  # (1 - q s)/p = 1 + (1 - s) q/p: no cancellation
    return lower, torch.minimum(upper, inv_p)


def _check_delta(delta):
    if (isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta)
            or delta <= 0):
        raise ValueError(f"delta must be a finite number > 0 (a divergence radius), got {delta!r}")


@torch.no_grad()
def band(old_logp, method="bandkl", delta=0.05):
    """The exact Band interval [lower, upper] in ratio space for every token (Theorem 1), no cap.

    old_logp: tensor of log p (any shape, float dtype, any device); method: a key of DIVERGENCES;
    delta: the radius. Returns (lower, upper) with the shape, dtype and device of old_logp, without
    gradient, and always 0 <= lower <= 1 <= upper <= 1/p (1/p = exp(-old_logp), working dtype).

    Edge cases: old_logp > 0 (rounding noise) is taken as 0 (p = 1: lower = r*, upper = 1);
    old_logp = -inf (p = 0) gives lower = 0, upper = inf; NaN propagates; nothing raises or loops on
    bad tensor values. Where 1/p overflows (float32: old_logp < -88.7) upper is inf, which any cap
    (max_ratio) turns into the cap. float16/bfloat16 are computed in float32 and cast back."""
    if method not in DIVERGENCES:
        raise ValueError(f"unknown divergence {method!r}; valid: {', '.join(sorted(DIVERGENCES))}")
    _check_delta(delta)
    if not isinstance(old_logp, torch.Tensor) or not old_logp.is_floating_point():
        raise TypeError(f"old_logp must be a floating-point tensor, got {type(old_logp).__name__}")
    div = DIVERGENCES[method]
    logp = _working(old_logp)
    lower, upper = (div.closed_form(logp, delta) if div.closed_form is not None
                    else _solve(logp, div, delta))
    return lower.to(old_logp.dtype), upper.to(old_logp.dtype)


def _working(old_logp):
    """log p in the working dtype (float16/bfloat16 -> float32), detached; log p > 0 (rounding
    noise) is 0, p = 1."""
    work = torch.float32 if old_logp.dtype in (torch.float16, torch.bfloat16) else old_logp.dtype
    return old_logp.detach().to(work).clamp_max(0.0)


# --- the interval the loss clips to: every method of the comparison ------------------------------
# Every bounds function takes (old_logp, delta, eps_low, eps_high) and returns (lower, upper); each
# uses what its method has (a divergence radius, two epsilons, or neither).
def clip(old_logp, delta, eps_low, eps_high):
    """PPO/GRPO clip [1 - eps_low, 1 + eps_high] (GRPO: 0.2 / 0.2); delta is unused."""
    if not 0 <= eps_low <= 1 or not eps_high >= 0:
        raise ValueError(f"need 0 <= eps_low <= 1 and eps_high >= 0, got {eps_low!r}, {eps_high!r}")
    return torch.full_like(old_logp, 1 - eps_low), torch.full_like(old_logp, 1 + eps_high)


def noclip(old_logp, delta, eps_low, eps_high):
    """No clip, the control arm: [0, inf), which ratio_bounds caps at max_ratio like every method.
    The dual clip of grpo.policy_loss still applies: the clip is the only difference from `clip`."""
    return torch.zeros_like(old_logp), torch.full_like(old_logp, math.inf)


@torch.no_grad()
def dcpo(old_logp, delta, eps_low, eps_high):
    """DCPO dynamic-adaptive clip with q = p (docs/paper.md §3), not confined to [0, 1/p]
    (U > 1/p as p -> 1):  L = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / p, 0)),
                          U = 1/2 + 1/2 sqrt(1 + 4 eps_high / p)."""
    # inf for p = 0: an eps of 0 (or below the dtype's range) must not meet it
    inv_p = torch.exp(-_working(old_logp))
    tiny = torch.finfo(inv_p.dtype).tiny
    lower = (0.5 + 0.5 * torch.sqrt((1 - 4 * eps_low * inv_p).clamp_min(0)) if eps_low > tiny
             else torch.ones_like(inv_p))
    upper = (0.5 + 0.5 * torch.sqrt(1 + 4 * eps_high * inv_p) if eps_high > tiny
             else torch.ones_like(inv_p))
    return lower.to(old_logp.dtype), upper.to(old_logp.dtype)


def _divergence_bounds(name):
    """The bounds function of one divergence: its exact band at radius delta (epsilons unused)."""
    def bounds(old_logp, delta, eps_low, eps_high):
        return band(old_logp, name, delta)
    bounds.__name__ = bounds.__qualname__ = name
    return bounds


def bandkl_relax(old_logp, delta, eps_low, eps_high):
    """The paper's relax ablation: Band-KL's band united with the clip-higher interval (it hurt)."""
    lower, upper = band(old_logp, "bandkl", delta)
    return lower.clamp_max(1 - eps_low), upper.clamp_min(1 + eps_high)


BOUNDS = {
    "clip": clip,
    "clip-higher": clip,  # DAPO's Clip-Higher: the clip with a larger upper eps (EPS below)
    "noclip": noclip,
    "dcpo": dcpo,
    **{name: _divergence_bounds(name) for name in DIVERGENCES},
    "bandkl-relax": bandkl_relax,
}

# The published (eps_low, eps_high) of each method that has them: the one table of defaults
# (train.resolve_config fills --eps-low/--eps-high from it; ratio_bounds where an eps is None).
EPS = {"clip": (0.2, 0.2), "clip-higher": (0.2, 0.28), "dcpo": (0.16, 0.20),
       "bandkl-relax": (0.2, 0.28)}


def ratio_bounds(old_logp, method, *, delta=0.05, eps_low=None, eps_high=None, max_ratio=10.0):
    """(lower, upper) the surrogate loss clips the ratio to, for any method of BOUNDS; upper capped
    at max_ratio (the authors' `upper_bound_max`). An eps left None is the method's published one
    (EPS); band methods ignore the epsilons (except bandkl-relax), clip methods ignore delta."""
    if method not in BOUNDS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(BOUNDS))}")
    if not max_ratio >= 1:  # also rejects NaN
        raise ValueError(f"max_ratio must be >= 1, got {max_ratio!r}")
    default_low, default_high = EPS.get(method, (None, None))
    lower, upper = BOUNDS[method](old_logp, delta, default_low if eps_low is None else eps_low,
                                  default_high if eps_high is None else eps_high)
    return lower, upper.clamp_max(max_ratio)


def main():
    logp = torch.log(torch.tensor([0.001, 0.01, 0.08, 0.2, 0.5, 0.8, 0.99], dtype=torch.float64))
    print("p        " + "".join(f"{m:>22}" for m in DIVERGENCES))
    bounds = {m: band(logp, m, 0.05) for m in DIVERGENCES}
    for i, p in enumerate(logp.exp().tolist()):
        print(f"{p:<9.3g}" + "".join(f"  [{bounds[m][0][i]:8.5f},{bounds[m][1][i]:9.4f}]"
                                     for m in DIVERGENCES))


if __name__ == "__main__":
    main()

"""The statistics under experiments/verdicts.py's rules: seeds paired, 95% t intervals, windows, a ratio's interval.

A difference is paired by seed and read through its 95% t interval, mean ± t(0.975, n - 1) x s.e. (`t975`,
`paired`, `ci`), against 0 and an equivalence margin (`weigh`); a step metric is read at two windows, each named
as it is averaged (`at_window`, `window_name`, `across`); the fraction of the clip's drift an arm removes is a
ratio of paired means with Fieller's interval (`drift_fraction`, `fraction_label`). verdicts.py re-exports every
name; tests/test_compare.py checks each on hand-built numbers. The drift experiment's intervals are at any level
(Bonferroni): Student's t by quadrature (`t_quantile`, `t_of`), the sign interval of a median (`median_interval`)
and the power of such an interval (`power`, `equivalence_power`); tests/test_drift.py checks them against tables.
"""

import collections
import functools
import math

# --- statistics: paired by seed, 95% t intervals, an equivalence margin, two windows -------------------------------
# the two windows of each step metric a verdict reads: n = the last n steps, "all" steps, their last "half"
WINDOWS = {"entropy": (5, 10), "clip/low_p_upper_rate": ("all", "half")}
RANDOM_WINDOWS = (60, "half")   # under coins a drift builds up over the run; the no-clip arm wanders step to step
SUMMARY_WINDOWS = {**WINDOWS, "entropy": WINDOWS["entropy"] + RANDOM_WINDOWS}
EQUIV = 0.10          # "no difference": the 95% t interval inside ±10% of GRPO's final entropy
SUPPORT_RATIO = math.sqrt(10)   # Band-KL / GRPO entropy for "supports": the geometric midpoint of 1x and 10x
FRACTION_MARGIN = 0.25   # "as GRPO" / "as no-clip": drift_fraction's interval within ±0.25 of 0 / of 1
# Student's t, 0.975 quantile, df = 1..30 (any statistics table); beyond 30 the Cornish-Fisher series in t975
VERDICT_WINDOWS = ("entropy read at the last 5 and the last 10 steps, the upper-clip rate of p < 0.2 tokens over "
                   "all steps and over their last half")
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Diff = collections.namedtuple("Diff", "mean half n")   # a mean, the half-width of its 95% t interval, seeds


def mean_std(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def mean_std_cell(values, scale=1.0, fmt=".3f"):
    """A table cell: 'mean ± std' of the measured values (scaled), '–' where no run measured it (held-out
    accuracy under --eval-every 0)."""
    m, sd = mean_std(values)
    return "–" if math.isnan(m) else f"{scale * m:{fmt}} ± {scale * sd:{fmt}}"


def t975(df):
    """Student's t 0.975 quantile: the table to df 30, then z + (z^3 + z) / 4df + ... (within 1e-3 there)."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def t_interval(xs):
    """Diff of numbers xs: their mean and the half-width of its 95% t interval (nan below two numbers)."""
    xs = [x for x in xs if not math.isnan(x)]
    m, sd = mean_std(xs)
    return Diff(m, t975(len(xs) - 1) * sd / math.sqrt(len(xs)) if len(xs) > 1 else math.nan, len(xs))


def _by_seed(rows, key):
    # rows without a "seed" (the older compare.json files, all of whose seeds finished) pair by position
    return {x.get("seed", i): x[key] for i, x in enumerate(rows)}


def paired(a, b, key, scale=1.0):
    """Diff of the per-seed differences a - b of `key`, over the seeds both arms have.

    The runs of a seed share the initial policy and its first rollout (identical until a bound first binds), so
    pairing removes the seed's own luck from the difference.
    """
    sa, sb = _by_seed(a, key), _by_seed(b, key)
    return t_interval([scale * (sa[k] - sb[k]) for k in sa if k in sb])


def ci(d, fmt=".3f"):
    """'+0.117 ± 0.109 (95% t interval, n = 3)', or '+0.117 (n = 1: no interval)'."""
    if d.n < 2:
        return f"{d.mean:+{fmt}} (n = {d.n}: no interval)"
    return f"{d.mean:+{fmt}} ± {d.half:{fmt}} (95% t interval, n = {d.n})"


def weigh(d, margin):
    """A difference against 0 and ±margin: "n = 1" (no interval), "equivalent" (the 95% t interval inside
    ±margin), "above" / "below" (the interval excludes 0), else "underpowered"."""
    if d.n < 2:
        return f"n = {d.n}"
    lo, hi = d.mean - d.half, d.mean + d.half
    if -margin <= lo and hi <= margin:
        return "equivalent"
    return "above" if lo > 0 else "below" if hi < 0 else "underpowered"


def at_window(values, w):
    """The mean of a run's per-step values over window w (see WINDOWS)."""
    return mean_std(values if w == "all" else values[len(values) // 2:] if w == "half" else values[-w:])[0]


def window_name(w, steps=None):
    """A window named as it is averaged: the last w steps of a run of `steps` are min(w, steps) of them."""
    if w not in ("all", "half") and steps is not None and w >= steps:
        return f"all {steps} steps"
    return {"all": "all steps", "half": "the last half of the steps"}.get(w, f"last {w} steps")


def table_steps(table):
    """The fewest steps any run of the table summarises (None where the rows do not say)."""
    steps = [x.get("steps") for rows in table.values() for x in rows]
    return min(steps) if steps and None not in steps else None


def windows(table, key, ws=None):
    """The windows `ws` (default WINDOWS[key]) at which every row of the table holds `key@w`."""
    return [w for w in ws or WINDOWS[key] if all(f"{key}@{w}" in x for rows in table.values() for x in rows)]


def across(results, key, ws=None, steps=None):
    """(label, text) from per-window (w, label, text) readings of `key`: the label where every window gives it,
    "inconclusive (window-dependent)" where they differ, "inconclusive (one window)" where a window is not in the
    numbers; the text names each window as averaged over runs of `steps` and any window missing."""
    labels = {label for _, label, _ in results}
    ws = ws or WINDOWS[key]
    name = lambda w: window_name(w, steps)  # noqa: E731
    missing = [f"{name(w)}: not in these numbers" for w in ws if w not in {r[0] for r in results}]
    if not labels:
        return "no reading", f"{key} over {' or over '.join(map(name, ws))}: not in these numbers"
    label = ("inconclusive (window-dependent)" if len(labels) > 1 else
             "inconclusive (one window)" if missing else results[0][1])
    return label, "; ".join([f"{name(w)}: {t}" for w, _, t in results] + missing)


def drift_fraction(arm, clip, noclip, key):
    """(f, lo, hi, n): f = mean(arm - clip) / mean(noclip - clip) over the n seeds all three share (0 = as GRPO,
    1 = as no-clip) and Fieller's 95% interval for a ratio of paired means (t on n - 1 df): the f with
    (x̄ - f ȳ)² <= t² (s_xx - 2 f s_xy + f² s_yy) / n. Unbounded, (-inf, inf), where the denominator's own
    interval reaches 0 (ȳ² <= t² s_yy / n): no-clip is then not told apart from GRPO."""
    a, c, o = (_by_seed(rows, key) for rows in (arm, clip, noclip))
    seeds = [s for s in c if s in a and s in o]
    x, y, n = [a[s] - c[s] for s in seeds], [o[s] - c[s] for s in seeds], len(seeds)
    mx, my = (sum(x) / n, sum(y) / n) if n else (math.nan, math.nan)
    f = mx / my if my else math.copysign(math.inf, mx) if n else math.nan
    if n < 2:
        return f, math.nan, math.nan, n
    cov = lambda u, mu, v, mv: sum((p - mu) * (q - mv) for p, q in zip(u, v)) / (n - 1)  # noqa: E731
    t2 = t975(n - 1) ** 2 / n
    qa = my ** 2 - t2 * cov(y, my, y, my)                  # qa f² - 2 qb f + qc <= 0
    qb = mx * my - t2 * cov(x, mx, y, my)
    qc = mx ** 2 - t2 * cov(x, mx, x, mx)
    if qa <= 0:
        return f, -math.inf, math.inf, n
    root = math.sqrt(max(qb ** 2 - qa * qc, 0.0))
    return f, (qb - root) / qa, (qb + root) / qa, n


def fraction_label(f, lo, hi, n, margin=FRACTION_MARGIN):
    """Where an arm sits between GRPO (f = 0) and no-clip (f = 1), from drift_fraction's interval: "as GRPO" /
    "as no-clip" only where the interval lies within ±margin of 0 / of 1 (an equivalence bound, not a failure to
    tell them apart); "beyond" either end or "removes part of it" where it excludes both; else underpowered."""
    if n < 2:
        return f"inconclusive (n = {n})"
    if -margin <= lo and hi <= margin:
        return f"keeps the clip's drift (as GRPO, within ±{margin:g})"
    if 1 - margin <= lo and hi <= 1 + margin:
        return f"removes the clip's drift (as no-clip, within ±{margin:g})"
    if lo > 1 or hi < 0:
        return "beyond no-clip" if lo > 1 else "beyond GRPO"
    return "removes part of it" if 0 < lo and hi < 1 else "inconclusive (underpowered)"


# --- statistics: t quantiles at any level, the sign interval of a median, power ------------------------------------
def t_cdf(x, df):
    """Student's t CDF by Simpson's rule on the density over [0, |x|] (2,000 panels: the integrand is smooth and
    its fourth derivative bounded, error well under 1e-9 for the quantiles used here)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)  # noqa: E731
    n, a = 2000, abs(x)
    h = a / n
    area = h / 3 * (f(0) + f(a) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n)))
    return 0.5 + math.copysign(area, x)


@functools.cache  # ~40 pure-Python integrations each; a report asks for the same few (p, df) dozens of times
def t_quantile(p, df):
    """The p quantile of Student's t on df degrees of freedom (bisection on t_cdf, to 1e-9)."""
    lo, hi = -1e3, 1e3
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def t_of(xs, level=0.95):
    """(mean, half-width of the two-sided t interval at `level`, n, sd) of numbers."""
    m, sd = mean_std(xs)
    n = len(xs)
    return m, (t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n) if n > 1 else math.nan), n, sd


def median_interval(xs, level=0.95):
    """The median of xs and its distribution-free interval [x_(k), x_(n+1-k)] (the sign test's: it covers the true
    median with probability 1 - 2 P(Bin(n, 1/2) < k)), the largest k whose coverage is >= level.
    -> (median, lo, hi, coverage); lo = hi = nan where no k reaches the level."""
    xs = sorted(xs)
    n = len(xs)
    med = (xs[(n - 1) // 2] + xs[n // 2]) / 2
    tail, k = 0.0, 0  # tail = P(Bin(n, 1/2) <= k - 1)
    while 1 - 2 * (tail + math.comb(n, k) / 2 ** n) >= level:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        return med, math.nan, math.nan, math.nan
    return med, xs[k - 1], xs[n - k], 1 - 2 * tail


def power(sd, K, effect, level=0.95):
    """Approximate power of the two-sided t interval at `level` over K seeds to exclude 0 when the true mean is
    `effect` (sd taken as known: P(|x̄ / se| > t) with x̄ normal)."""
    z, t = effect * math.sqrt(K) / sd, t_quantile(1 - (1 - level) / 2, K - 1)
    return _phi(z - t) + _phi(-z - t)


def equivalence_power(sd, K, margin, true=0.0, level=0.95):
    """Approximate probability that the interval at `level` lies within ±margin when the true mean is `true`:
    P(-margin + h < x̄ < margin - h), h the half-width with sd taken as known."""
    se = sd / math.sqrt(K)
    h = t_quantile(1 - (1 - level) / 2, K - 1) * se
    return max(0.0, _phi((margin - h - true) / se) - _phi((-margin + h - true) / se))


def _phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))

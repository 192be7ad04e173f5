"""The report of experiments/drift.py: per-arm readings, arm differences paired by seed, the token anatomy.

Reads pairs.jsonl or pairs.jsonl.gz (one line per seed, branch point and arm) and writes drift.md and the anatomy
figure with the rules of experiments/results/drift-toy/plan.md, fixed before the replication's data: the seeds are
the units (a seed's reading is the mean over its branch points of a contrast paired within each branch point, so
the interval carries the clustering of branch points by seed), a family of FAMILY contrasts on dH_probe read
through Bonferroni t intervals at LEVEL (1 - 0.05 / 8) on K - 1 df, each against 0 and its equivalence margin
(SESOI, the interaction's INTERACTION_MARGIN), the collapse yardstick c fixed (COLLAPSE). `--rules smollm2`
reads by experiments/results/drift-smollm2/plan.md instead: the same family and rules, its own margins, c and K
(Rules), and "cannot test" where the clip bounded under 1% of an update's tokens. Everything else
(dH_probe_is with its effective sample size and a sign interval for the median, dH_train, the other differences,
the anatomy) is labelled exploratory, at 95%.

    python experiments/drift.py --analyse experiments/results/drift-toy/pairs.jsonl.gz   # or drift_report.py PAIRS
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery.jsonl import jsonl_path, open_jsonl, read_jsonl  # noqa: E402
from verdicts import mean_std  # noqa: E402

SESOI = 2.5e-4               # the smallest effect of interest, nats per token per rollout
INTERACTION_MARGIN = 1.25e-4  # "the two sides add": non-additivity under half the SESOI
# the collapse-sized drift c = 0.9 H1 / 300, fixed: H1 = GRPO's mean step-1 entropy over its coin seeds 0-9, the
# runs committed when the rule was written (collapse_drift computes it; later seeds do not move the yardstick)
COLLAPSE_H1, COLLAPSE_RUNS = 0.157, 10
COLLAPSE = 0.9 * COLLAPSE_H1 / 300
CONFIRM_K = 32               # the plan's seeds: below it every reading is interim
KL_MATCH = (0.8, 1.25)       # noclip-matched's KL / clip's (ratio of seed means): outside, brake and step not read


def family(sesoi, interaction):
    """The confirmatory family on dH_probe: (name, weights per arm, equivalence margin)."""
    return (("clip − noclip", {"clip": 1, "noclip": -1}, sesoi),
            ("upper side: clip-upper − noclip", {"clip-upper": 1, "noclip": -1}, sesoi),
            ("lower side: clip-lower − noclip", {"clip-lower": 1, "noclip": -1}, sesoi),
            ("interaction: clip − clip-upper − clip-lower + noclip",
             {"clip": 1, "clip-upper": -1, "clip-lower": -1, "noclip": 1}, interaction),
            ("brake: clip − noclip-matched", {"clip": 1, "noclip-matched": -1}, sesoi),
            ("step: noclip-matched − noclip", {"noclip-matched": 1, "noclip": -1}, sesoi),
            ("bandkl − clip-upper", {"bandkl": 1, "clip-upper": -1}, sesoi),
            ("bandkl − noclip", {"bandkl": 1, "noclip": -1}, sesoi))


FAMILY = family(SESOI, INTERACTION_MARGIN)
LEVEL = 1 - 0.05 / len(FAMILY)  # Bonferroni over the family: 99.375%, two-sided
EXPLORATORY = (("clip-higher − noclip", {"clip-higher": 1, "noclip": -1}, SESOI),
               ("clip-higher − clip", {"clip-higher": 1, "clip": -1}, SESOI),
               ("bandkl − clip", {"bandkl": 1, "clip": -1}, SESOI))


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a plan fixes before its data: the smallest effect of interest (the interaction's margin is half of
    it), the collapse yardstick c, the number of seeds K, and the least share of an update's tokens the clip must
    bound for its readings to test anything (None: no such check). The family and LEVEL are the same for all."""
    plan: str
    sesoi: float
    collapse: float
    collapse_note: tuple  # (its formula, where its entropy comes from)
    k: int
    acted: float | None = None

    @property
    def interaction(self):
        return self.sesoi / 2

    @property
    def family(self):
        return family(self.sesoi, self.interaction)

    @property
    def exploratory(self):
        return tuple((n, w, self.sesoi) for n, w, _ in EXPLORATORY)


# experiments/results/drift-toy/plan.md (the replication; the later-states plan reads by the same rules)
TOY = Rules("experiments/results/drift-toy/plan.md", SESOI, COLLAPSE,
            (f"0.9 x {COLLAPSE_H1:.3f} / 300", f"GRPO's step-1 entropy over {COLLAPSE_RUNS} committed coin runs"),
            CONFIRM_K)
# experiments/results/drift-smollm2/plan.md: the toy's definitions on SmolLM2's probe entropy, H = 2.628 nats per
# token (the pilot's mean at its branch points): SESOI = H / 2 / 300, c = 0.9 H / 300; 48 seeds; the clip must
# bound at least 1% of an update's tokens (the pilot: 2.9-4.5%)
SMOLLM2_H = 2.628
SMOLLM2 = Rules("experiments/results/drift-smollm2/plan.md", round(SMOLLM2_H / 2 / 300, 6), 0.9 * SMOLLM2_H / 300,
                (f"0.9 x {SMOLLM2_H} / 300", "the SmolLM2 pilot's mean probe entropy"), 48, acted=0.01)
RULES = {"toy": TOY, "smollm2": SMOLLM2}
READINGS = (("dH_probe", "entropy change on the probe"), ("dH_probe_is", "the same, importance-weighted"),
            ("dH_train", "entropy change on the rollout's tokens"), ("kl", "KL(old || new) on the probe"))


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


def power(sd, K, effect, level=LEVEL):
    """Approximate power of the two-sided t interval at `level` over K seeds to exclude 0 when the true mean is
    `effect` (sd taken as known: P(|x̄ / se| > t) with x̄ normal)."""
    z, t = effect * math.sqrt(K) / sd, t_quantile(1 - (1 - level) / 2, K - 1)
    return _phi(z - t) + _phi(-z - t)


def equivalence_power(sd, K, margin, true=0.0, level=LEVEL):
    """Approximate probability that the interval at `level` lies within ±margin when the true mean is `true`:
    P(-margin + h < x̄ < margin - h), h the half-width with sd taken as known."""
    se = sd / math.sqrt(K)
    h = t_quantile(1 - (1 - level) / 2, K - 1) * se
    return max(0.0, _phi((margin - h - true) / se) - _phi((-margin + h - true) / se))


def _phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def load(path, below=None):
    """The lines of pairs.jsonl (or pairs.jsonl.gz), or of a run directory (its seeds/*.jsonl, written as the run
    goes, else its pairs.jsonl or .gz), with step < `below` when given (a common prefix of branch points)."""
    files = ([path] if jsonl_path(path) else sorted(glob.glob(os.path.join(path, "seeds", "*.jsonl")))
             or [os.path.join(path, "pairs.jsonl")])
    rows = [r for f in files for r in read_jsonl(f)]
    return [r for r in rows if below is None or r["step"] < below]


def branches(rows):
    """{seed: {step: {arm: row}}}."""
    out = {}
    for r in rows:
        out.setdefault(r["seed"], {}).setdefault(r["step"], {})[r["arm"]] = r
    return {s: dict(sorted(steps.items())) for s, steps in sorted(out.items())}


def with_arms(data, arms):
    """The branch points where every arm in `arms` finished, and the seeds that have one."""
    out = {s: {t: b for t, b in steps.items() if all(a in b for a in arms)} for s, steps in data.items()}
    return {s: steps for s, steps in out.items() if steps}


def per_seed(data, f):
    """Each seed's mean over its branch points of f(branch) (f: {arm: row} -> number)."""
    return [sum(f(b) for b in steps.values()) / len(steps) for steps in data.values()]


def contrast(data, weights, key):
    """The per-seed means of Σ_arm w_arm x_arm (paired within each branch point), over the branch points that
    hold every arm of the contrast; and the per-branch values (for the design effect)."""
    sub = with_arms(data, weights)
    f = lambda b: sum(w * b[a][key] for a, w in weights.items())  # noqa: E731
    return per_seed(sub, f), [f(b) for steps in sub.values() for b in steps.values()]


def label(m, half, margin=SESOI):
    """The reading of a difference's interval: below or above 0 where it excludes 0, within ±margin where it lies
    inside (an equivalence bound, not a failure to reject: with the sign where it also excludes 0), else
    unresolved."""
    if math.isnan(half):
        return "no interval (one seed)"
    lo, hi = m - half, m + half
    if -margin <= lo and hi <= margin:
        side = " (below 0, but smaller)" if hi < 0 else " (above 0, but smaller)" if lo > 0 else ""
        return f"no effect of interest (within ±{margin * 1e4:.3g}e-4){side}"
    return "below 0" if hi < 0 else "above 0" if lo > 0 else "unresolved"


def design_effect(seed_means, branch_values):
    """Variance inflation from clustering by seed: var(seed means) / (var(branch values) / m), m the branch points
    per seed; 1 where a seed's branch points were independent. The seed-mean interval carries it already."""
    m, between = len(branch_values) / len(seed_means), mean_std(branch_values)[1] ** 2
    return mean_std(seed_means)[1] ** 2 / (between / m) if between else math.nan


def collapse_drift(coin_runs, horizon=300):
    """c = 0.9 H1 / horizon: the per-rollout drift that takes GRPO's entropy from its step-1 mean H1 (over the
    committed GRPO coin runs, <coin_runs>/clip-d*/metrics.jsonl or .gz, one per seed) to a tenth in `horizon`
    rollouts. -> (c, H1, n)."""
    h1 = []
    for run in sorted(glob.glob(os.path.join(coin_runs, "clip-d*", ""))):
        if jsonl_path(os.path.join(run, "metrics.jsonl")) is None:
            continue
        with open_jsonl(os.path.join(run, "metrics.jsonl")) as f:
            first = next((json.loads(x) for x in f if '"entropy"' in x), None)
        if first and first.get("step") == 1:
            h1.append(first["entropy"])
    if not h1:
        return math.nan, math.nan, 0
    H1 = sum(h1) / len(h1)
    return 0.9 * H1 / horizon, H1, len(h1)


def fmt(m, half, scale=1e4):
    return f"{m * scale:+.2f} ± {half * scale:.2f}" if not math.isnan(half) else f"{m * scale:+.2f}"


def anatomy(data, arm):
    """Per cell (p bin, sign): per-seed tokens per rollout, Δlog p per token, ΔH per token, up / down clips per
    rollout, each as (mean, half) over seeds (a seed's token-weighted mean over its branch points)."""
    cells = {}
    for steps in with_arms(data, [arm]).values():
        sums = {}
        for b in steps.values():
            for c in b[arm]["cells"]:
                s = sums.setdefault((tuple(c["p"]), c["adv"]), [0, 0.0, 0.0, 0, 0])
                for i, k in enumerate(("tokens", "dlogp_sum", "dH_sum", "up", "down")):
                    s[i] += c[k]
        for key, (n, dl, dh, up, down) in sums.items():
            k = len(steps)
            cells.setdefault(key, []).append((n / k, dl / n if n else math.nan, dh / n if n else math.nan,
                                              up / k, down / k))
    return {key: [t_of([v[i] for v in vals if not math.isnan(v[i])])[:2] for i in range(5)]
            for key, vals in sorted(cells.items())}


def cell_diff(data, arm, ref):
    """Per cell, arm minus ref in Δ log p per token: the cells hold the same tokens in every arm (the same rollout
    and old log-probs), so the difference is paired token by token; (mean, half) over seeds."""
    per = {}
    for steps in with_arms(data, [arm, ref]).values():
        sums = {}
        for b in steps.values():
            for c, r in zip(b[arm]["cells"], b[ref]["cells"]):
                s = sums.setdefault((tuple(c["p"]), c["adv"]), [0, 0.0])
                s[0] += c["tokens"]
                s[1] += c["dlogp_sum"] - r["dlogp_sum"]
        for key, (n, d) in sums.items():
            if n:
                per.setdefault(key, []).append(d / n)
    return {key: t_of(v)[:2] for key, v in sorted(per.items())}


def plot(data, arms, path, ref="noclip"):
    """Top: Δ log p per token by old-probability bin and advantage sign, one line per arm. Bottom: each arm minus
    `ref` (paired token by token): where the bounds brake or push."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = 2 if ref in arms else 1
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.6 * rows), sharex=True, squeeze=False)
    for col, sign, title in ((0, "+", "positive advantage (Â > 0)"), (1, "-", "negative advantage (Â < 0)")):
        for j, arm in enumerate(arms):
            for row, cells in enumerate([anatomy(data, arm)] + ([cell_diff(data, arm, ref)] if rows == 2 else [])):
                keys = [k for k in cells if k[1] == sign]
                xs = [i + 0.06 * (j - len(arms) / 2) for i in range(len(keys))]
                get = (lambda v: v[1]) if row == 0 else (lambda v: v)  # noqa: E731
                axes[row, col].errorbar(xs, [get(cells[k])[0] for k in keys], yerr=[get(cells[k])[1] for k in keys],
                                        marker="o", ms=3, capsize=2, label=arm, color=f"C{j}")
                axes[row, col].set_xticks(range(len(keys)), [f"{k[0][0]:g}–{k[0][1]:g}" for k in keys])
        for row in range(rows):
            axes[row, col].axhline(0, color="grey", lw=0.5)
        axes[0, col].set_title(title)
        axes[-1, col].set_xlabel("old probability of the token")
    axes[0, 0].set_ylabel("Δ log p per token, one rollout")
    if rows == 2:
        axes[1, 0].set_ylabel(f"minus {ref}'s, same tokens")
    axes[0, 1].legend(fontsize=8)
    fig.suptitle(f"One rollout's updates by token kind ({len(data)} seeds; mean ± 95% t over seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def clip_share(data, arm="clip"):
    """The share of an update's tokens the arm's bounds held (upward plus downward clips over tokens, pooled over
    its branch points); nan without the arm."""
    rows = [b[arm] for steps in with_arms(data, [arm]).values() for b in steps.values()]
    tokens = sum(r["tokens"] for r in rows)
    return sum(r["n_upper"] + r["n_lower"] for r in rows) / tokens if tokens else math.nan


def report(rows, subset=None, segment=None, plan=None, rules=TOY):
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    data = branches(rows)
    K = len(data)
    n_branch = [len(s) for s in data.values()]
    steps = sorted({t for s in data.values() for t in s})
    H_probe = mean_std([r["H_probe"] for r in rows if r["arm"] == arms[0]])[0]
    n_label = (f"{n_branch[0]}" if min(n_branch) == max(n_branch) else f"{min(n_branch)}–{max(n_branch)}")
    out = [f"# The clip per update: {K} seeds x {n_label} branch points (rollouts {steps[0]}–{steps[-1]})", "",
           f"Arms: {', '.join(arms)}. Rules: {plan or rules.plan}. Units: seeds (a seed's reading "
           f"is the mean over its branch points of a difference paired within each branch point; the design effect "
           f"is the variance inflation from clustering by seed, which the seed-mean interval carries). The family "
           f"of {len(rules.family)} contrasts on dH_probe is read through {LEVEL:.3%} t intervals (Bonferroni, "
           f"0.05 / {len(rules.family)}) on K - 1 df over the seed means; every other number is exploratory, 95%. "
           f"Values in 1e-4 nats per token per rollout unless said. Probe entropy at the branch points: "
           f"{H_probe:.3f} nats per token (mean). Margins: ±{rules.sesoi * 1e4:.2f}e-4 (the smallest effect of interest), the "
           f"interaction ±{rules.interaction * 1e4:.2f}e-4; collapse-sized drift c = {rules.collapse_note[0]} = "
           f"{rules.collapse * 1e4:.2f}e-4 (fixed: {rules.collapse_note[1]}).", ""]
    if plan:
        out += [f"**Read by {plan}: the family's intervals over all branch points below are computed as "
                f"{rules.plan} computes them, but this data's readings are the ones its own plan names.**", ""]
    elif subset:
        out += [f"**Seeds {subset} only: the subset the plan reads beside the full {rules.k} seeds.**", ""]
    elif K < rules.k:
        out += [f"**Interim: {K} of the plan's {rules.k} seeds. No reading below is the plan's.**", ""]
    # --- per arm ---
    out += ["## Per arm", "", "| arm | seeds | " + " | ".join(name for _, name in READINGS) +
            " | ESS share of the weights: mean (least) | upward / downward clips per rollout |",
            "|---|---|" + "---|" * (len(READINGS) + 2)]
    for arm in arms:
        sub = with_arms(data, [arm])
        cells = [fmt(*t_of(per_seed(sub, lambda b, k=k: b[arm][k]))[:2]) for k, _ in READINGS]
        ess = [b[arm]["ess"] for st in sub.values() for b in st.values() if "ess" in b[arm]]
        up = t_of(per_seed(sub, lambda b: b[arm]["n_upper"]))[0]
        down = t_of(per_seed(sub, lambda b: b[arm]["n_lower"]))[0]
        ess_cell = f"{sum(ess) / len(ess):.3f} ({min(ess):.3f})" if ess else "–"
        out.append(f"| {arm} | {len(sub)} | " + " | ".join(cells) + f" | {ess_cell} | {up:.1f} / {down:.1f} |")
    # --- the family ---
    out += ["", f"## The family (confirmatory): dH_probe, {LEVEL:.3%} t intervals", "",
            "| contrast | seeds | mean ± half | d_z | design effect | margin | label |",
            "|---|---|---|---|---|---|---|"]
    diffs = {}
    for name, weights, margin in rules.family:
        if not all(a in arms for a in weights):
            out.append(f"| {name} | 0 | not run | | | ±{margin * 1e4:.2f} | |")
            continue
        seeds, values = contrast(data, weights, "dH_probe")
        m, half, n, sd = t_of(seeds, LEVEL)
        diffs[name] = (m, half)
        dz = m / sd if sd else math.nan
        deff = design_effect(seeds, values) if n > 1 else math.nan
        out.append(f"| {name} | {n} | {fmt(m, half)} | {dz:+.2f} | {deff:.1f} | ±{margin * 1e4:.2f} | "
                   f"{label(m, half, margin)} |")
    kl_ratio = None
    if "clip" in arms and "noclip-matched" in arms:
        sub = with_arms(data, ["clip", "noclip-matched"])
        kl_ratio = (sum(per_seed(sub, lambda b: b["noclip-matched"]["kl"])) /
                    sum(per_seed(sub, lambda b: b["clip"]["kl"])))
    acted = clip_share(data) if rules.acted is not None else None
    out += ["", "## Readings (the plan's rules)", ""]
    if acted is not None and math.isnan(acted):
        out += ["- **cannot test: no clip arm ran**, so whether the clip acted is unknown; no contrast is read"]
    elif acted is not None and acted < rules.acted:
        out += [f"- **cannot test: the clip did not act** (it bounded {acted:.2%} of an update's tokens, under the "
                f"plan's {rules.acted:.0%}); no contrast is read"]
    else:
        out += ([f"- the clip acted: it bounded {acted:.2%} of an update's tokens (the plan asks for "
                 f"{rules.acted:.0%})"] if acted is not None else []) + verdict_lines(diffs, kl_ratio, rules)
    if segment:
        out += ["", f"## By segment of the trajectory ({segment} rollouts each; 95% t, exploratory)", "",
                "Each contrast on dH_probe within the segment's branch points, read as the family is (seed means of "
                "within-branch differences), at 95% and labelled by the same rule; in 1e-4 nats per token per "
                "rollout.", ""] + segment_lines(data, arms, segment, rules=rules)
    # --- exploratory ---
    out += ["", "## Exploratory (95% t; not in the family)", "",
            "dH_probe_is beside its robust companion: the median of the per-seed differences with its sign-test "
            "interval (distribution-free, coverage named); the weights' effective sample share is in the per-arm "
            "table.", "",
            "| contrast | reading | seeds | mean ± 95% t | median [sign interval] (coverage) | label |",
            "|---|---|---|---|---|---|"]
    for name, weights, margin in rules.family + rules.exploratory:
        if not all(a in arms for a in weights):
            continue
        own = ("dH_probe",) if (name, weights, margin) in rules.exploratory else ()
        for key in own + ("dH_probe_is", "dH_train"):
            seeds, _ = contrast(data, weights, key)
            m, half, n, _ = t_of(seeds)
            med, lo, hi, cov = median_interval(seeds)
            robust = (f"{med * 1e4:+.2f} [{lo * 1e4:+.2f}, {hi * 1e4:+.2f}] ({cov:.1%})" if not math.isnan(lo)
                      else f"{med * 1e4:+.2f}")
            out.append(f"| {name} | {key} | {n} | {fmt(m, half)} | {robust} | {label(m, half, margin)} |")
    # --- anatomy ---
    out += ["", "## Token anatomy (exploratory)", "", "Per cell of old probability x advantage sign (0: a group "
            "whose coins all fell alike; those tokens get no policy-gradient of their own, but move with the shared "
            "weights), mean over seeds ± 95% t: tokens per rollout, Δ log p per token after the rollout's updates, "
            "entropy change at those positions per token, upward / downward clips per rollout.", ""]
    ref = "noclip" if "noclip" in arms else arms[0]
    for arm in arms:
        diff = cell_diff(data, arm, ref)
        cells = anatomy(data, arm)
        zero = sum(v[0][0] for (p, sign), v in cells.items() if sign == "0")
        total = sum(v[0][0] for v in cells.values())
        out += [f"**{arm}** (zero-advantage tokens: {zero:.1f} of {total:.1f} per rollout, {zero / total:.1%})", "",
                f"| p | Â | tokens | Δ log p | minus {ref}'s | ΔH (1e-3) | up / down clips |",
                "|---|---|---|---|---|---|---|"]
        for (p, sign), v in cells.items():
            d = diff.get((p, sign), (math.nan, math.nan))
            out.append(f"| {p[0]:g}–{p[1]:g} | {sign} | {v[0][0]:.1f} | {v[1][0]:+.4f} ± {v[1][1]:.4f} | "
                       f"{d[0]:+.4f} ± {d[1]:.4f} | {v[2][0] * 1e3:+.2f} ± {v[2][1] * 1e3:.2f} | "
                       f"{v[3][0]:.2f} / {v[4][0]:.2f} |")
        out.append("")
    return "\n".join(out) + "\n", data, arms


def segment_lines(data, arms, size, level=0.95, rules=TOY):
    """Each FAMILY contrast within each segment of the trajectory (branch points at rollouts [0, size),
    [size, 2 size), ...), read as the family is (seed means of within-branch differences, t intervals, the same
    label rule) but at `level` and exploratory unless a plan says otherwise: later states have their own noise
    (the per-branch sd, printed, sizes a later run)."""
    cuts = sorted({t // size for steps in data.values() for t in steps})
    seg = {c: {s: {t: b for t, b in steps.items() if t // size == c} for s, steps in data.items()} for c in cuts}
    seg = {c: {s: st for s, st in d.items() if st} for c, d in seg.items()}
    head = [f"rollouts {c * size}–{c * size + size - 1}" for c in cuts] + ["last − first segment, per seed"]
    out = [f"| | {' | '.join(head)} |", "|---|" + "---|" * len(head)]
    first = arms[0]
    out.append("| probe entropy (nats per token) | " + " | ".join(
        f"{mean_std([b[first]['H_probe'] for st in seg[c].values() for b in st.values()])[0]:.4f}"
        for c in cuts) + " | |")
    out.append("| seeds x branch points | " + " | ".join(
        f"{len(seg[c])} x {min(map(len, seg[c].values()))}" + (
            f"–{max(map(len, seg[c].values()))}" if len(set(map(len, seg[c].values()))) > 1 else "")
        for c in cuts) + " | |")
    for name, weights, margin in rules.family:
        if not all(a in arms for a in weights):
            continue
        cells, sds = [], []
        for c in cuts:
            seeds, values = contrast(seg[c], weights, "dH_probe")
            m, half, n, _ = t_of(seeds, level)
            cells.append(f"{fmt(m, half)}: {label(m, half, margin)}")
            sds.append(f"{mean_std(values)[1] * 1e4:.1f}" if len(values) > 1 else "–")
        ends = [with_arms(seg[c], weights) for c in (cuts[0], cuts[-1])]  # seeds with the contrast in both
        both = sorted(set(ends[0]) & set(ends[1]))
        early, late = (contrast({s: end[s] for s in both}, weights, "dH_probe")[0] for end in ends)
        m, half, _, _ = t_of([b - a for a, b in zip(early, late)], level)  # a seed's last minus its first
        cells.append(f"{fmt(m, half)}: {label(m, half, margin)}" if len(cuts) > 1 else "–")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("| per-branch sd of it (1e-4) | " + " | ".join(sds) + " | |")
    return out


def _interval(m, half):
    return f"{fmt(m, half)}e-4, [{(m - half) * 1e4:+.2f}, {(m + half) * 1e4:+.2f}]"


def verdict_lines(diffs, kl_ratio=None, rules=TOY):
    """The plan's readings from the family {name: (mean, half at LEVEL)} on dH_probe, and noclip-matched's KL over
    the clip's (None: not run). A side "drains" where its interval lies below 0 (by less than the margin where it
    lies within it too); "Band removes the upper side's drain" needs the upper side to drain, Band-KL − clip-upper
    above 0 and Band-KL − no-clip within ±SESOI (the rules' margins and c)."""
    out, c, sesoi, inter = [], rules.collapse, rules.sesoi, rules.interaction

    def get(name):
        full = next(n for n, _, _ in rules.family if n.startswith(name))
        return (full, *diffs[full]) if full in diffs else (full, math.nan, math.nan)

    def sided(m, half, margin, below, above, none):
        lab = label(m, half, margin)
        if math.isnan(half):
            return lab
        small = f", by less than ±{margin * 1e4:.2f}e-4" if -margin <= m - half and m + half <= margin else ""
        return (below + small if m + half < 0 else above + small if m - half > 0 else none if small
                else "unresolved: neither excludes 0 nor lies within the margin")

    name, m, half = get("clip − noclip")
    if not math.isnan(half):
        what = sided(m, half, sesoi, "the clip drains the entropy", "the clip raises the entropy",
                     "no effect of interest")
        collapse = (f"; no collapse-sized drain (lower end {(m - half) * 1e4:+.2f}e-4 > -c = {-c * 1e4:.2f}e-4)"
                    if m - half > -c else f"; a collapse-sized drain is not excluded (lower end "
                    f"{(m - half) * 1e4:+.2f}e-4 <= -c = {-c * 1e4:.2f}e-4)")
        out.append(f"- {name}: {_interval(m, half)}: **{what}**{collapse}")
    up = get("upper side")
    for side in ("upper side", "lower side"):
        name, m, half = get(side)
        if not math.isnan(half):
            out.append(f"- {name}: {_interval(m, half)}: **" + sided(
                m, half, sesoi, f"the {side} drains", f"the {side} raises the entropy",
                f"the {side}: no effect of interest") + "**")
    name, m, half = get("interaction")
    if not math.isnan(half):  # additivity is the question: within the margin reads "add", whatever the sign
        lab = label(m, half, inter)
        what = (f"the two sides add (within ±{inter * 1e4:.2f}e-4)" if lab.startswith("no effect") else
                f"the sides interact ({lab})" if lab in ("below 0", "above 0") else
                "unresolved: neither excludes 0 nor lies within the margin")
        out.append(f"- {name}: {_interval(m, half)}: **{what}**")
    brake, step = get("brake"), get("step")
    if not math.isnan(brake[2]) or not math.isnan(step[2]):
        if kl_ratio is None or not KL_MATCH[0] <= kl_ratio <= KL_MATCH[1]:
            out.append(f"- brake and step: **not read: noclip-matched's KL is {kl_ratio:.2f}x the clip's, outside "
                       f"[{KL_MATCH[0]}, {KL_MATCH[1]}]: the steps were not matched**" if kl_ratio is not None
                       else "- brake and step: not read (noclip-matched's KL unknown)")
        else:
            out.append(f"- step match: noclip-matched's KL is {kl_ratio:.2f}x the clip's (within "
                       f"[{KL_MATCH[0]}, {KL_MATCH[1]}])")
            readings = [(brake, "the clip drains beyond a no-clip step of the same size (its per-token shape)",
                         "the clip raises the entropy against a no-clip step of the same size",
                         "the clip acts as a smaller step: no effect of interest beyond it"),
                        (step, "a smaller step alone lowers the entropy change",
                         "a smaller step alone raises the entropy change",
                         "a smaller step alone: no effect of interest")]
            for (name, m, half), *labels in readings:
                if not math.isnan(half):
                    out.append(f"- {name}: {_interval(m, half)}: **" + sided(m, half, sesoi, *labels) + "**")
    name, m, half = get("bandkl − noclip")
    bu = get("bandkl − clip-upper")
    if not math.isnan(half) and not math.isnan(up[2]) and not math.isnan(bu[2]):
        drains, above = up[1] + up[2] < 0, bu[1] - bu[2] > 0
        equiv = -sesoi <= m - half and m + half <= sesoi
        verdict = ("Band removes the upper side's drain" if drains and above and equiv else
                   "not read: the upper side's drain is not shown" if not drains else
                   "not shown: Band-KL − clip-upper does not lie above 0" if not above else
                   f"not shown: Band-KL − noclip does not lie within ±{sesoi * 1e4:.2f}e-4")
        out.append(f"- {bu[0]}: {_interval(*bu[1:])}; {name}: {_interval(m, half)}: **{verdict}**")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", help="pairs.jsonl, or a drift.py run directory")
    ap.add_argument("--results", default=os.path.join(ROOT, "experiments", "results", "drift-toy"),
                    help="directory of drift.md")
    ap.add_argument("--figure", default=os.path.join(ROOT, "figures", "drift-toy_anatomy.png"))
    ap.add_argument("--below", type=int, help="read only the branch points at rollouts < N (a common prefix)")
    ap.add_argument("--seeds", metavar="A-B", help="read only seeds A to B (the plan's fresh half: 16-31)")
    ap.add_argument("--plan", help="the analysis plan these lines are read by, where not the replication's")
    ap.add_argument("--rules", choices=sorted(RULES), default="toy",
                    help="the plan's fixed numbers: toy (drift-toy/plan.md) or smollm2 (drift-smollm2/plan.md)")
    ap.add_argument("--segment", type=int, metavar="N", help="also read each contrast per segment of N rollouts "
                    "(branch points spread over a long trajectory)")
    args = ap.parse_args(argv)
    rows = load(args.pairs, args.below)
    if args.seeds:
        a, b = map(int, args.seeds.split("-"))
        rows = [r for r in rows if a <= r["seed"] <= b]
    md, data, arms = report(rows, subset=args.seeds, segment=args.segment, plan=args.plan, rules=RULES[args.rules])
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "drift.md"), "w") as f:
        f.write(md)
    plot(data, arms, args.figure)
    print(md)


if __name__ == "__main__":
    main()

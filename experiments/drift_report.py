"""The report of experiments/drift.py: per-arm readings, arm differences paired by seed, the token anatomy.

Reads pairs.jsonl or pairs.jsonl.gz (one line per seed, branch point and arm; an antithetic run's two halves
averaged per arm first, drift_antithetic.py) and writes drift.md and the anatomy figure under the rules of
experiments/results/drift-toy/plan.md, fixed before the replication's data (drift_rules.py holds them): the seeds
are the units (a seed's reading is the mean over its branch points of a contrast paired within each branch point,
so the interval carries the clustering of branch points by seed), a family of contrasts on dH_probe read through
Bonferroni t intervals (paired_stats.t_of) on K - 1 df, each against 0 and its equivalence margin, the collapse
yardstick c fixed. `--rules smollm2` reads by experiments/results/drift-smollm2/plan.md instead: its two primary contrasts under
Holm (drift_rules.holm_lines), its c and K, and "cannot test" where the clip bounded under 1% of an update's tokens.
Everything else (dH_probe_is with its effective sample size and a sign interval for the median, dH_train, the
other differences, the anatomy) is labelled exploratory, at 95%.

    python experiments/drift.py --analyse experiments/results/drift-toy/pairs.jsonl.gz   # or drift_report.py PAIRS
"""

import argparse
import glob
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery.jsonl import jsonl_path, read_jsonl  # noqa: E402
from paired_stats import equivalence_power, mean_std, median_interval, power, t_of, t_quantile  # noqa: E402,F401
from drift_antithetic import pair_means  # noqa: E402
from drift_rules import (LEVEL, RULES, SMOLLM2, TOY, collapse_drift, fmt, label,  # noqa: E402,F401
                         verdict_lines)

READINGS = (("dH_probe", "entropy change on the probe"), ("dH_probe_is", "the same, importance-weighted"),
            ("dH_train", "entropy change on the rollout's tokens"), ("kl", "KL(old || new) on the probe"))


def load(path, below=None, pair=True):
    """The lines of pairs.jsonl (or pairs.jsonl.gz), or of a run directory (its seeds/*.jsonl, written as the run
    goes, else its pairs.jsonl or .gz), with step < `below` when given (a common prefix of branch points); an
    antithetic run's halves averaged per arm (drift_antithetic.pair_means) unless `pair` is False."""
    files = ([path] if jsonl_path(path) else sorted(glob.glob(os.path.join(path, "seeds", "*.jsonl")))
             or [os.path.join(path, "pairs.jsonl")])
    rows = [r for f in files for r in read_jsonl(f) if below is None or r["step"] < below]
    return pair_means(rows) if pair else rows


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


def design_effect(seed_means, branch_values):
    """Variance inflation from clustering by seed: var(seed means) / (var(branch values) / m), m the branch points
    per seed; 1 where a seed's branch points were independent. The seed-mean interval carries it already."""
    m, between = len(branch_values) / len(seed_means), mean_std(branch_values)[1] ** 2
    return mean_std(seed_means)[1] ** 2 / (between / m) if between else math.nan


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
           f"of {len(rules.family)} contrasts on dH_probe is read through {rules.level:.3%} t intervals "
           + (f"(Holm's first step, 0.05 / {len(rules.family)}; the next at 95%)" if rules.primary else
              f"(Bonferroni, 0.05 / {len(rules.family)})") +
           " on K - 1 df over the seed means; every other number is exploratory, 95%. "
           f"Values in 1e-4 nats per token per rollout unless said. Probe entropy at the branch points: "
           f"{H_probe:.3f} nats per token (mean). Margins: ±{rules.sesoi * 1e4:.2f}e-4 (the smallest effect of "
           f"interest)" + ("" if rules.primary else f", the interaction ±{rules.interaction * 1e4:.2f}e-4") +
           f"; collapse-sized drift c = {rules.collapse_note[0]} = "
           f"{rules.collapse * 1e4:.2f}e-4 (fixed: {rules.collapse_note[1]}).", ""]
    if any(r.get("flip") == "pair" for r in rows):
        out += ["Antithetic coins: every line is the mean of an arm's readings on the drawn coins and on the same "
                "rollout's flipped coins (1 - r), averaged before any contrast.", ""]
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
    out += ["", f"## The family (confirmatory): dH_probe, {rules.level:.3%} t intervals", "",
            "| contrast | seeds | mean ± half | d_z | design effect | margin | label |",
            "|---|---|---|---|---|---|---|"]
    diffs = {}
    for name, weights, margin in rules.family:
        if not all(a in arms for a in weights):
            out.append(f"| {name} | 0 | not run | | | ±{margin * 1e4:.2f} | |")
            continue
        seeds, values = contrast(data, weights, "dH_probe")
        m, half, n, sd = t_of(seeds, rules.level)
        diffs[name] = (m, half) + ((t_of(seeds)[1],) if rules.primary else ())   # Holm's later steps: 95%
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
            "Each reading beside its robust companion: the median of the per-seed differences with its sign-test "
            "interval (distribution-free, coverage named); a family contrast's dH_probe row is that robust secondary "
            "(its reading is the family's, above). The weights' effective sample share is in the per-arm table.", "",
            "| contrast | reading | seeds | mean ± 95% t | median [sign interval] (coverage) | label |",
            "|---|---|---|---|---|---|"]
    family = {name for name, _, _ in rules.family}   # a family contrast is not listed again as exploratory
    for name, weights, margin in rules.family + tuple(e for e in rules.exploratory if e[0] not in family):
        if not all(a in arms for a in weights):
            continue
        for key in ("dH_probe", "dH_probe_is", "dH_train"):
            seeds, _ = contrast(data, weights, key)
            m, half, n, _ = t_of(seeds)
            med, lo, hi, cov = median_interval(seeds)
            robust = (f"{med * 1e4:+.2f} [{lo * 1e4:+.2f}, {hi * 1e4:+.2f}] ({cov:.1%})" if not math.isnan(lo)
                      else f"{med * 1e4:+.2f}")
            out.append(f"| {name} | {key} | {n} | {fmt(m, half)} | {robust} | {label(m, half, margin)} |")
    # --- anatomy ---
    out += ["", "## Token anatomy (exploratory)", "", "Per cell of old probability x advantage sign (0: a group "
            "whose rewards were all equal, as coins that all fell alike; those tokens get no policy-gradient of their "
            "own, but move with the shared weights), mean over seeds ± 95% t: tokens per rollout, Δ log p per token "
            "after the rollout's updates, entropy change at those positions per token, upward / downward clips per "
            "rollout; – where a cell held no token.", ""]
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
            out.append(f"| {p[0]:g}–{p[1]:g} | {sign} | {v[0][0]:.1f} | {_pm(*v[1])} | {_pm(*d)} | "
                       f"{_pm(*v[2], 1e3, '.2f')} | {v[3][0]:.2f} / {v[4][0]:.2f} |")
        out.append("")
    return "\n".join(out) + "\n", data, arms


def _pm(mean, half, scale=1, fmt=".4f"):
    """"mean ± half" scaled, or – for an empty cell (nan)."""
    return "–" if math.isnan(mean) else f"{mean * scale:+{fmt}} ± {half * scale:{fmt}}"


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

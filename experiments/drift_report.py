"""The report of experiments/drift.py: per-arm readings, arm differences paired by seed, the token anatomy.

Reads pairs.jsonl (one line per seed, branch point and arm) and writes drift.md and the anatomy figure, with
the rules written in docs/results.md before the readings were seen: the seeds are the units (a seed's reading
is the mean over its branch points; an arm difference is paired within each branch point first), intervals are
95% t on K - 1 df over the K seed means (block means of BLOCK consecutive branch points as a check), the
smallest effect of interest is ±SESOI nats per rollout, and "no collapse-sized drain" compares the interval's
lower end with the per-rollout drift that takes GRPO's entropy to a tenth in 300 rollouts (`collapse_drift`).

    python experiments/drift.py --analyse runs/drift-toy        # or: python experiments/drift_report.py PAIRS
"""

import argparse
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery.jsonl import jsonl_path, open_jsonl, read_jsonl  # noqa: E402
from verdicts import mean_std, t975  # noqa: E402

SESOI = 2.5e-4      # the smallest effect of interest, nats per token per rollout
BLOCK = 10          # branch points per block in the block-means check
# the collapse-sized drift c = 0.9 H1 / 300, fixed: H1 = GRPO's mean step-1 entropy over its coin seeds 0-9, the
# runs committed when the rule was written (collapse_drift computes it; later seeds do not move the yardstick)
COLLAPSE_H1, COLLAPSE_RUNS = 0.157, 10
COLLAPSE = 0.9 * COLLAPSE_H1 / 300
READINGS = (("dH_probe", "entropy change on the probe"), ("dH_probe_is", "the same, importance-weighted"),
            ("dH_train", "entropy change on the rollout's tokens"), ("kl", "KL(old || new) on the probe"))
CONTRASTS = (("clip", "noclip"), ("clip-upper", "noclip"), ("bandkl", "noclip"), ("clip-higher", "noclip"),
             ("bandkl", "clip-upper"), ("bandkl", "clip"), ("clip-higher", "clip"))


def load(path, below=None):
    """The lines of pairs.jsonl (or pairs.jsonl.gz), or of a run directory (its seeds/*.jsonl, written as the run
    goes, else its pairs.jsonl or .gz), with step < `below` when given (a common prefix of branch points)."""
    files = ([path] if jsonl_path(path) else sorted(glob.glob(os.path.join(path, "seeds", "*.jsonl")))
             or [os.path.join(path, "pairs.jsonl")])
    rows = [r for f in files for r in read_jsonl(f)]
    return [r for r in rows if below is None or r["step"] < below]


def branches(rows, arms):
    """{seed: {step: {arm: row}}}, keeping only the branch points where every arm in `arms` finished."""
    out = {}
    for r in rows:
        out.setdefault(r["seed"], {}).setdefault(r["step"], {})[r["arm"]] = r
    return {s: {t: b for t, b in sorted(steps.items()) if all(a in b for a in arms)}
            for s, steps in sorted(out.items()) if any(all(a in b for a in arms) for b in steps.values())}


def t_of(xs):
    """(mean, half-width of the 95% t interval, n, sd) of numbers."""
    m, sd = mean_std(xs)
    n = len(xs)
    return m, (t975(n - 1) * sd / math.sqrt(n) if n > 1 else math.nan), n, sd


def per_seed(data, f):
    """Each seed's mean over its branch points of f(branch) (f: {arm: row} -> number)."""
    return [sum(f(b) for b in steps.values()) / len(steps) for steps in data.values()]


def blocks(data, f):
    """Block means: BLOCK consecutive branch points of a seed (a shorter last block dropped)."""
    out = []
    for steps in data.values():
        vals = [f(b) for b in steps.values()]
        out += [sum(vals[i:i + BLOCK]) / BLOCK for i in range(0, len(vals) - BLOCK + 1, BLOCK)]
    return out


def label(m, half, sesoi=SESOI):
    """The pre-registered reading of a difference's 95% interval."""
    if math.isnan(half):
        return "no interval (one seed)"
    lo, hi = m - half, m + half
    if -sesoi <= lo and hi <= sesoi:
        side = " (below 0, but smaller)" if hi < 0 else " (above 0, but smaller)" if lo > 0 else ""
        return f"no effect of interest (within ±2.5e-4){side}"
    return "below 0" if hi < 0 else "above 0" if lo > 0 else "unresolved"


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
    for steps in data.values():
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
    for steps in data.values():
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


def report(rows):
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    data = branches(rows, arms)
    K = len(data)
    n_branch = [len(s) for s in data.values()]
    c, H1, n_h1 = COLLAPSE, COLLAPSE_H1, COLLAPSE_RUNS
    all_rows = [b for s in data.values() for b in s.values()]
    H_probe = mean_std([b[arms[0]]["H_probe"] for b in all_rows])[0]
    steps = sorted({t for s in data.values() for t in s})
    n_label = (f"{n_branch[0]}" if min(n_branch) == max(n_branch) else f"{min(n_branch)}–{max(n_branch)}")
    out = [f"# The clip per update: {K} seeds x {n_label} branch points (rollouts "
           f"{steps[0]}–{steps[-1]})", "",
           f"Arms: {', '.join(arms)}. Units: seeds (a seed's reading is the mean over its branch points; a "
           f"difference is paired within each branch point first); intervals are 95% t on K - 1 = {K - 1} df "
           f"over the seed means; the check beside it is the t interval over block means ({BLOCK} consecutive "
           f"branch points per block). Values in 1e-4 nats per token per rollout unless said. Probe entropy at "
           f"the branch points: {H_probe:.3f} nats per token (mean). Smallest effect of interest ±2.5e-4; "
           f"collapse-sized drift c = 0.9 x {H1:.3f} / 300 = {c * 1e4:.2f}e-4 (GRPO's step-1 entropy over "
           f"{n_h1} committed coin runs).", "", "## Per arm", "",
           "| arm | " + " | ".join(name for _, name in READINGS) + " | upward / downward clips per rollout |",
           "|---|" + "---|" * (len(READINGS) + 1)]
    for arm in arms:
        cells = [fmt(*t_of(per_seed(data, lambda b, k=k: b[arm][k]))[:2]) for k, _ in READINGS]
        up = t_of(per_seed(data, lambda b: b[arm]["n_upper"]))[0]
        down = t_of(per_seed(data, lambda b: b[arm]["n_lower"]))[0]
        out.append(f"| {arm} | " + " | ".join(cells) + f" | {up:.1f} / {down:.1f} |")
    out += ["", "## Differences, paired (arm minus arm)", "",
            "| difference | reading | mean ± 95% t (seeds) | d_z | check: block means | label |",
            "|---|---|---|---|---|---|"]
    diffs = {}
    for a, b in CONTRASTS:
        if a not in arms or b not in arms:
            continue
        for key, name in READINGS[:3]:
            f = lambda br, a=a, b=b, key=key: br[a][key] - br[b][key]  # noqa: E731
            m, half, n, sd = t_of(per_seed(data, f))
            bl = blocks(data, f)
            check = f"{fmt(*t_of(bl)[:2])} (n = {len(bl)})" if len(bl) > 1 else "–"
            diffs[(a, b, key)] = (m, half)
            dz = m / sd if sd else math.nan
            out.append(f"| {a} − {b} | {key} | {fmt(m, half)} | {dz:+.2f} | {check} | {label(m, half)} |")
    out += ["", "## Readings (the rules of docs/results.md)", ""] + verdict_lines(diffs, c)
    out += ["", "## Token anatomy", "", "Per cell of old probability x advantage sign, mean over seeds ± 95% t: "
            "tokens per rollout, Δ log p per token after the rollout's updates, entropy change at those "
            "positions per token, upward / downward clips per rollout.", ""]
    ref = "noclip" if "noclip" in arms else arms[0]
    for arm in arms:
        diff = cell_diff(data, arm, ref)
        out += [f"**{arm}**", "", f"| p | Â | tokens | Δ log p | minus {ref}'s | ΔH (1e-3) | up / down clips |",
                "|---|---|---|---|---|---|---|"]
        for (p, sign), v in anatomy(data, arm).items():
            if sign == "0":
                continue
            d = diff.get((p, sign), (math.nan, math.nan))
            out.append(f"| {p[0]:g}–{p[1]:g} | {sign} | {v[0][0]:.1f} | {v[1][0]:+.4f} ± {v[1][1]:.4f} | "
                       f"{d[0]:+.4f} ± {d[1]:.4f} | {v[2][0] * 1e3:+.2f} ± {v[2][1] * 1e3:.2f} | "
                       f"{v[3][0]:.2f} / {v[4][0]:.2f} |")
        out.append("")
    return "\n".join(out) + "\n", data, arms


def verdict_lines(diffs, c):
    """The pre-registered readings, from the paired differences {(a, b, key): (mean, half)}."""
    out = []
    for key in ("dH_probe", "dH_probe_is", "dH_train"):
        if ("clip", "noclip", key) not in diffs:
            continue
        m, half = diffs[("clip", "noclip", key)]
        lab = label(m, half)
        what = {"below 0": "the clip drains the entropy", "above 0": "the clip raises the entropy",
                "unresolved": "unresolved: neither a drain nor no effect of interest"}.get(lab, lab)
        collapse = ("" if math.isnan(c) or math.isnan(half) else
                    f"; no collapse-sized drain (lower end {(m - half) * 1e4:+.2f}e-4 > -c = {-c * 1e4:.2f}e-4)"
                    if m - half > -c else f"; a collapse-sized drain is not excluded (lower end "
                    f"{(m - half) * 1e4:+.2f}e-4 <= -c = {-c * 1e4:.2f}e-4)")
        role = "primary" if key == "dH_probe" else "secondary"
        out.append(f"- ({role}, {key}) clip − no-clip {fmt(m, half)}e-4: **{what}**{collapse}")
    if ("clip-upper", "noclip", "dH_probe") in diffs:
        m, half = diffs[("clip-upper", "noclip", "dH_probe")]
        drains = label(m, half) == "below 0"
        out.append(f"- (dH_probe) the clip's upper side alone − no-clip {fmt(m, half)}e-4: **"
                   f"{'the upper side drains' if drains else 'no drain by the upper side shown'}** "
                   f"({label(m, half)})")
        if ("bandkl", "noclip", "dH_probe") in diffs:
            bm, bhalf = diffs[("bandkl", "noclip", "dH_probe")]
            equiv = label(bm, bhalf).startswith("no effect")
            verdict = ("Band removes the upper side's drain" if drains and equiv else
                       "not read: the upper side's drain is not shown" if not drains else
                       "Band's removal of it is not shown (Band-KL − no-clip not within ±2.5e-4)")
            out.append(f"- (dH_probe) Band-KL − no-clip {fmt(bm, bhalf)}e-4 ({label(bm, bhalf)}): **{verdict}**")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", help="pairs.jsonl, or a drift.py run directory")
    ap.add_argument("--results", default=os.path.join(ROOT, "experiments", "results", "drift-toy"),
                    help="directory of drift.md")
    ap.add_argument("--figure", default=os.path.join(ROOT, "figures", "drift-toy_anatomy.png"))
    ap.add_argument("--below", type=int, help="read only the branch points at rollouts < N (a common prefix)")
    args = ap.parse_args(argv)
    md, data, arms = report(load(args.pairs, args.below))
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "drift.md"), "w") as f:
        f.write(md)
    plot(data, arms, args.figure)
    print(md)


if __name__ == "__main__":
    main()

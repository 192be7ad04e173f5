"""Antithetic coins: each branch point's arms also run on the rollout's flipped coins, and the pair is averaged.

Under fair coins a rollout rewarded 1 - r is as likely as the one rewarded r, and its group advantages are exactly
-Â (experiments/drift_branch.py; `drift.py --antithetic`). An arm's reading x(Â) = even(Â) + odd(Â): the pair mean
(x(Â) + x(-Â)) / 2 is the even part alone, which holds the bounds' asymmetric effect (the clip caps r above for
Â > 0 and below for Â < 0: flipping the coins turns one side's work into the other's), while the odd part, first
order in the update and zero in expectation over the coins, cancels exactly. `pair_means` does that before any
contrast (drift_report.load calls it); `compare` measures what it buys: the per-branch sd of each contrast on the
drawn halves alone (what a plain run reads: the same lines bit for bit) and on the pair means, over the same seeds
and branch points. Its variance ratio is per branch point; a pair costs two runs of every arm, so the pair pays
where the ratio is below 1/2.

    python experiments/drift_antithetic.py PAIRS --results DIR   # -> DIR/antithetic.md
"""

import argparse
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired_stats import mean_std  # noqa: E402

MEAN = ("dH_probe", "dH_probe_is", "kl", "dH_train", "dlogp_train", "ess", "n_upper", "n_lower", "first_abs_dev")
SAME = ("H_probe", "H_train", "tokens", "probe_tokens", "method", "eps_low", "eps_high", "delta", "lr")
CELL_MEAN = ("dlogp_sum", "dH_sum", "up", "down")
BOOT = 2000   # bootstrap resamples of the branch points for the ratio's interval


def _average(a, b):
    """One line from a drawn half `a` (flip 0) and its flipped half `b` (flip 1): MEAN keys and the cells' sums
    averaged, SAME keys checked equal (the same state, rollout and probe), times summed, flip = "pair"."""
    for k in SAME:
        if a.get(k) != b.get(k):
            raise ValueError(f"seed {a['seed']} step {a['step']} arm {a['arm']}: the halves differ in {k} "
                             f"({a.get(k)!r} against {b.get(k)!r})")
    out = dict(a, flip="pair", **{k: (a[k] + b[k]) / 2 for k in MEAN if k in a})
    out.update({k: a[k] + b[k] for k in ("time_s", "cpu_s") if k in a and k in b})
    if "cells" in a:
        out["cells"] = [dict(c, **{k: (c[k] + d[k]) / 2 for k in CELL_MEAN}) for c, d in zip(a["cells"], b["cells"])]
    return out


def pair_means(rows):
    """Lines with a `flip` key averaged per (seed, step, arm) into one line, in the drawn half's place; lines
    without one pass unchanged. A half without its twin is a ValueError naming it (a pair is written whole)."""
    halves = {}
    for r in rows:
        if "flip" in r:
            halves.setdefault((r["seed"], r["step"], r["arm"]), {})[r["flip"]] = r
    for key, h in halves.items():
        if set(h) != {0, 1}:
            raise ValueError(f"seed {key[0]} step {key[1]} arm {key[2]}: an antithetic half without its twin")
    return [_average(r, halves[(r["seed"], r["step"], r["arm"])][1]) if "flip" in r else r
            for r in rows if r.get("flip") != 1]


def drawn(rows):
    """The drawn halves alone, as a plain run writes them (flip 1 lines dropped, the flip key removed)."""
    return [{k: v for k, v in r.items() if k != "flip"} for r in rows if r.get("flip") != 1]


def branch_values(rows, weights, key="dH_probe"):
    """{(seed, step): Σ_arm w_arm x_arm} over the branch points holding every arm of `weights`."""
    at = {}
    for r in rows:
        at.setdefault((r["seed"], r["step"]), {})[r["arm"]] = r[key]
    return {b: sum(w * x[a] for a, w in weights.items()) for b, x in sorted(at.items()) if all(a in x for a in weights)}


def compare(rows, contrasts, key="dH_probe", seed=0):
    """Per contrast (name, weights, _): (branch points, sd on the drawn halves, sd on the pair means, their
    variance ratio, its 95% bootstrap interval over branch points resampled alike for both). -> [tuples]."""
    out, rng = [], random.Random(seed)
    plain, paired = drawn(rows), pair_means(rows)
    for name, weights, _ in contrasts:
        x, y = branch_values(plain, weights, key), branch_values(paired, weights, key)
        keys = [b for b in x if b in y]
        if len(keys) < 3:
            continue
        xs, ys = [x[b] for b in keys], [y[b] for b in keys]
        ratio = (mean_std(ys)[1] / mean_std(xs)[1]) ** 2
        boot = []
        for _ in range(BOOT):
            idx = [rng.randrange(len(keys)) for _ in keys]
            sx, sy = mean_std([xs[i] for i in idx])[1], mean_std([ys[i] for i in idx])[1]
            boot.append((sy / sx) ** 2 if sx else math.nan)
        boot = sorted(b for b in boot if not math.isnan(b))
        lo, hi = boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]
        out.append((name, len(keys), mean_std(xs)[1], mean_std(ys)[1], ratio, lo, hi))
    return out


def main(argv=None):
    import drift_report
    from drift_rules import EXPLORATORY, FAMILY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", help="an antithetic run's pairs.jsonl(.gz) or run directory")
    ap.add_argument("--results", required=True, help="directory of antithetic.md")
    args = ap.parse_args(argv)
    rows = drift_report.load(args.pairs, pair=False)
    if not any("flip" in r for r in rows):
        sys.exit(f"drift_antithetic.py: error: no antithetic lines (flip) in {args.pairs!r}")
    arms = sorted({r["arm"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    n_branch = len({(r["seed"], r["step"]) for r in rows})
    out = [f"# Antithetic coins: per-branch sd with and without ({len(seeds)} seeds, {n_branch} branch points)", "",
           f"Arms: {', '.join(arms)}. Each contrast on dH_probe per branch point, in 1e-4 nats per token per "
           f"rollout: its sd over the branch points on the drawn coins alone (what a plain run writes: the same "
           f"lines) and on the pair means (drawn and flipped coins averaged per arm), the same branch points; "
           f"the variance ratio (pair / drawn) with a 95% bootstrap interval ({BOOT} resamples of the branch "
           f"points). A pair costs twice a plain branch point: it pays where the ratio is below 0.5.", "",
           "| contrast | branch points | sd drawn | sd pair mean | variance ratio [95% bootstrap] |",
           "|---|---|---|---|---|"]
    for name, n, sx, sy, ratio, lo, hi in compare(rows, FAMILY + EXPLORATORY):
        out.append(f"| {name} | {n} | {sx * 1e4:.2f} | {sy * 1e4:.2f} | {ratio:.3f} [{lo:.3f}, {hi:.3f}] |")
    md = "\n".join(out) + "\n"
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "antithetic.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()

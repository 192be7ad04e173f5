"""The long-horizon view of a comparison: does GRPO's entropy collapse, and does the band prevent it?

The paper's central dynamic claim (docs/paper.md §5) is that the fixed clip collapses the policy entropy over
training (~0.02 for GRPO vs ~0.2 for BandPO) and starves low-probability tokens. Entropy collapse is a
long-horizon effect, so this script reads the runs of a long `experiments/compare.py` comparison and reports the
whole horizon, not only its end:

    python experiments/compare.py --methods clip,clip-higher,bandkl --bandkl-deltas "" --max-steps 300 \\
        --nproc 1 --jobs 2 --runs-dir runs/compare-long-lr1e-4 --results experiments/results/long-lr1e-4 \\
        --figure figures/long-lr1e-4_compare.png -- --lr 1e-4 --mini-batch-prompts 2 --eval-every 25 --save-every 50
    python experiments/horizon.py runs/compare-long-lr1e-4 --results experiments/results/long-lr1e-4 \\
        --figure figures/long-lr1e-4_horizon.png

It writes <results>/horizon.{md,json}, <figure> (six curves over steps) and <figure>_bins.png (where the band acts:
the out-of-band token fractions per old-probability bin); without --results / --figure, into the runs directory.
The committed experiments keep theirs in experiments/results/<experiment>/ and figures/<experiment>_horizon*.png,
shown in docs/results.md. With a no-clip arm (`--methods clip,noclip,bandkl`) the entropy verdicts are read
against it (compare.entropy_control). Definitions, used by the table and the verdicts:
- start entropy: the entropy at step 1 (the initial policy on its first rollout; every method of a seed shares it);
- half-entropy step: the first step at which the trailing WINDOW-step mean of the entropy is <= half the start;
- "final" step metrics: the mean over the last WINDOW steps; final accuracy: the mean of the last LAST_EVALS
  evaluations (one evaluation of 128 prompts x 4 samples has a standard error of ~2-3 points on its own).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import (ONE_SEED, clip_counts, entropy_control, mean_std, one_seed_check,  # noqa: E402
                     plot_seeds, verdicts)

WINDOW = 10      # steps in a trailing mean (per-step metrics come from 256 completions: noisy one by one)
LAST_EVALS = 3   # evaluations averaged into the final accuracy
BINS = ["0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0"]
PANELS = [("entropy", "policy entropy (nats/token)"), ("mean@n", "held-out mean@n"), ("pass@n", "held-out pass@n"),
          ("clip/frac", "clipped token fraction"), ("clip/low_p_upper_rate", "upper-clip rate of p < 0.2 tokens"),
          ("band/width", "mean band width (upper - lower ratio bound)")]


def label(config):
    method, delta = config
    return f"{method} δ={delta:g}" if method.startswith("band") else method


def read_run(run_dir):
    """Per-step series of one run: {key: [(step, value)]}, with eval keys renamed to mean@n / pass@n."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    series = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("eval/") and "/mean@" in k:
                series.setdefault("mean@n", []).append((r["step"], v))
            elif k.startswith("eval/") and "/pass@" in k:
                n = int(k.rsplit("@", 1)[1])
                series.setdefault(f"pass@{n}", []).append((r["step"], v))
            elif isinstance(v, (int, float)) and k != "step":
                series.setdefault(k, []).append((r["step"], v))
    pass_keys = sorted((k for k in series if k.startswith("pass@")), key=lambda k: int(k[5:]))
    if pass_keys:
        series["pass@n"] = series[pass_keys[-1]]
    if "band/upper_mean" in series:
        series["band/width"] = [(s, u - lo) for (s, u), (_, lo) in zip(series["band/upper_mean"],
                                                                          series["band/lower_mean"])]
    return series


def trailing_mean(points, window=WINDOW):
    """[(step, mean of the values of the last `window` points up to and including this one)]."""
    out = []
    for i, (step, _) in enumerate(points):
        chunk = [v for _, v in points[max(0, i - window + 1):i + 1]]
        out.append((step, sum(chunk) / len(chunk)))
    return out


def half_entropy_step(entropy, window=WINDOW):
    """First step whose trailing-mean entropy is <= half the step-1 entropy; None when it never gets there."""
    if not entropy:
        return None
    start = entropy[0][1]
    return next((step for step, v in trailing_mean(entropy, window) if v <= 0.5 * start), None)


def summarize(series, window=WINDOW):
    """The numbers of one run that the table and the verdicts use."""
    last = lambda key: mean_std([v for _, v in series.get(key, [])[-window:]])[0]  # noqa: E731
    whole = lambda key: mean_std([v for _, v in series.get(key, [])])[0]  # noqa: E731
    evals = series.get("mean@n", [])
    smooth = dict(trailing_mean(series["entropy"], window))
    return {"entropy_start": series["entropy"][0][1], "entropy": last("entropy"),
            "entropy_at": {str(t): smooth[t] for t in milestones(max(smooth)) if t in smooth},
            "mean@n_at": {str(t): v for t, v in evals if t in milestones(max(smooth)) or t == 0},
            "half_entropy_step": half_entropy_step(series["entropy"], window),
            "mean@n": mean_std([v for _, v in evals[-LAST_EVALS:]])[0],
            "mean@n_start": evals[0][1] if evals else math.nan,
            "pass@n": mean_std([v for _, v in series.get("pass@n", [])[-LAST_EVALS:]])[0],
            "clip/frac": whole("clip/frac"), "clip/low_p_upper_rate": whole("clip/low_p_upper_rate"),
            "band/width": whole("band/width"), "band/out_upper_frac": whole("band/out_upper_frac"),
            "band/out_lower_frac": whole("band/out_lower_frac"),
            **{f"band/out_{side}_frac_p{b}": whole(f"band/out_{side}_frac_p{b}")
               for side in ("upper", "lower") for b in BINS}}


def milestones(horizon, parts=6):
    """The steps the trajectory table shows: `parts` evenly spaced steps ending at the horizon (50, ..., 300)."""
    return [round(horizon * k / parts) for k in range(1, parts + 1)]


def half_step_cell(steps, horizon):
    """'142 ± 17 (3/3)': mean ± std of the half-entropy step over the seeds that reached it, and how many did."""
    reached = [s for s in steps if s is not None]
    if not reached:
        return f"not reached by {horizon} (0/{len(steps)})"
    m, sd = mean_std(reached)
    return f"{m:.0f} ± {sd:.0f} ({len(reached)}/{len(steps)})"


def entropy_collapse_verdicts(table, horizon, reading=None):
    """Plain verdicts for the dynamic claim: GRPO's entropy collapses; BandPO's does not (or later).

    `reading` is compare.entropy_control's: unless it is "supports" or "does not reproduce" (the regime can test the
    claim), it replaces the delay rule's label of (2b), whose numbers stay. None: the delay rule alone.
    """
    out = []
    clip, band = table.get(("clip", 0.05)), table.get(("bandkl", 0.05))
    if not clip or not band:
        return out
    c_steps, b_steps = [x["half_entropy_step"] for x in clip], [x["half_entropy_step"] for x in band]
    c_reached = sum(s is not None for s in c_steps)
    if c_reached == len(c_steps):
        v = "reproduced"
    elif c_reached == 0:
        v = "not reproduced at this scale"
    else:
        v = "not distinguishable at this scale"
    out.append(f"(2a) GRPO's entropy collapses (falls below half its start within {horizon} steps): **{v}** "
               f"(half-entropy step {half_step_cell(c_steps, horizon)})")
    # BandPO delays or prevents it. Paired by seed (a seed's runs share the initial policy and first rollout); a
    # run that never crosses counts as crossing at horizon + 1. The paper's effect is prevention (entropy ~10x
    # higher), so a "material" delay is at least a quarter of GRPO's own half-entropy step.
    late = lambda s: horizon + 1 if s is None else s  # noqa: E731
    by_seed = lambda rows: {x.get("seed", i): x["half_entropy_step"] for i, x in enumerate(rows)}  # noqa: E731
    c_seed, b_seed = by_seed(clip), by_seed(band)
    delays = [late(b_seed[k]) - late(c_seed[k]) for k in sorted(set(c_seed) & set(b_seed))]
    d, sd = mean_std(delays)
    se = sd / math.sqrt(len(delays))
    material = 0.25 * mean_std([late(c) for c in c_steps])[0]
    if c_reached == 0:
        v = "not distinguishable at this scale (GRPO itself does not collapse)"
    elif d >= material and d > 2 * se:
        v = "reproduced"
    elif d + 2 * se < material:
        v = "not reproduced"
    else:
        v = "not distinguishable at this scale"
    if reading is not None and reading not in ("supports", "does not reproduce"):
        v = f"{reading} (see (2))"
    out.append(f"(2b) BandPO delays or prevents it (by >= a quarter of GRPO's half-entropy step): **{v}** "
               f"(Band-KL half-entropy step {half_step_cell(b_steps, horizon)}; delay {d:+.0f} ± {se:.0f} steps, "
               "mean ± s.e. of the per-seed differences)")
    return out


def markdown(table, lines, horizon, n_seeds):
    cell = lambda runs, key, scale=1.0, fmt=".3f": "{:{f}} ± {:{f}}".format(  # noqa: E731
        *(scale * v for v in mean_std([x[key] for x in runs])), f=fmt)
    out = [f"{n_seeds} seeds x {horizon} steps; mean ± std over seeds. Entropy: step 1 and the mean of the last "
           f"{WINDOW} steps; accuracy: the first evaluation and the mean of the last {LAST_EVALS}; clip and band "
           "columns: means over the whole horizon.", "",
           "| method | entropy, step 1 | entropy, final | half-entropy step | mean@n start (%) | mean@n final (%) "
           "| pass@n final (%) | clip frac | upper-clip rate, p < 0.2 | band width | out above / below band |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for config, runs in table.items():
        out.append(f"| {label(config)} | {cell(runs, 'entropy_start')} | {cell(runs, 'entropy')} "
                   f"| {half_step_cell([x['half_entropy_step'] for x in runs], horizon)} "
                   f"| {cell(runs, 'mean@n_start', 100, '.1f')} | {cell(runs, 'mean@n', 100, '.1f')} "
                   f"| {cell(runs, 'pass@n', 100, '.1f')} | {cell(runs, 'clip/frac', 1, '.4f')} "
                   f"| {cell(runs, 'clip/low_p_upper_rate', 1, '.4f')} | {cell(runs, 'band/width')} "
                   f"| {mean_std([x['band/out_upper_frac'] for x in runs])[0]:.4f} / "
                   f"{mean_std([x['band/out_lower_frac'] for x in runs])[0]:.4f} |")
    steps = milestones(horizon)
    out += ["", f"Over the horizon: entropy ({WINDOW}-step trailing mean) / held-out mean@n (%) at the step, mean over "
            "seeds:", "", "| method | " + " | ".join(f"step {t}" for t in [0] + steps) + " |",
            "|---|" + "---|" * (len(steps) + 1)]

    def at(runs, key, t, scale, spec):  # mean over seeds at step t; "–" where no run has a value (no evaluation)
        values = [x[key][str(t)] * scale for x in runs if str(t) in x[key]]
        return format(mean_std(values)[0], spec) if values else "–"

    for config, runs in table.items():
        out.append(f"| {label(config)} | – / {at(runs, 'mean@n_at', 0, 100, '.1f')} | " + " | ".join(
            f"{at(runs, 'entropy_at', t, 1, '.3f')} / {at(runs, 'mean@n_at', t, 100, '.1f')}" for t in steps) + " |")
    out += ["", "Out-of-band token fraction per old-probability bin (whole horizon, mean over seeds; above / below):",
            "", "| method | " + " | ".join(f"p {b}" for b in BINS) + " |", "|---|" + "---|" * len(BINS)]
    for config, runs in table.items():
        out.append(f"| {label(config)} | " + " | ".join(
            f"{mean_std([x[f'band/out_upper_frac_p{b}'] for x in runs])[0]:.4f} / "
            f"{mean_std([x[f'band/out_lower_frac_p{b}'] for x in runs])[0]:.4f}" for b in BINS) + " |")
    return "\n".join(out + [""] + [f"- {v}" for v in lines]) + "\n"


def plot(series_by_config, path, horizon):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, (key, name) in zip(axes.flat, PANELS):
        for config, runs in series_by_config.items():
            plot_seeds(ax, [dict(trailing_mean(s[key]) if key not in ("mean@n", "pass@n") else s[key])
                            for s in runs if s.get(key)], label(config))
        ax.set_title(name + ("" if key in ("mean@n", "pass@n") else f" ({WINDOW}-step mean)"), fontsize=10)
        ax.set_xlabel("step")
        ax.set_xlim(0, horizon)
        ax.grid(alpha=0.3)
    starts = [s["entropy"][0][1] for runs in series_by_config.values() for s in runs]
    axes[0, 0].axhline(0.5 * sum(starts) / len(starts), color="gray", ls=":", lw=1, label="half the start")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"Long horizon: {horizon} steps (mean over seeds; band = min..max over seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bins(table, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    width = 0.8 / max(len(table), 1)
    for ax, side in zip(axes, ("upper", "lower")):
        for i, (config, runs) in enumerate(table.items()):
            vals = [mean_std([x[f"band/out_{side}_frac_p{b}"] for x in runs])[0] for b in BINS]
            ax.bar([j + i * width for j in range(len(BINS))], vals, width, label=label(config))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(BINS))], [f"p {b}" for b in BINS])
        ax.set_title(f"tokens with r {'above' if side == 'upper' else 'below'} the band (any advantage sign)")
        ax.set_xlabel("old token probability")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("fraction of the bin's tokens (whole horizon)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs_dir", help="a compare.py --runs-dir (one <method>-d<delta>-s<seed> directory per run)")
    p.add_argument("--results", default=None, help="directory of horizon.{md,json} (default: runs_dir)")
    p.add_argument("--figure", default=None, help="PNG path (default: <runs_dir>/horizon.png)")
    p.add_argument("--seeds", default="", help="only these seeds, comma separated (default: every run)")
    args = p.parse_args()
    seeds = {f"-s{s}" for s in args.seeds.split(",") if s}
    order = ["clip", "noclip", "clip-higher", "dcpo", "bandkl", "bandtv", "bandchi2"]   # baselines first
    runs = sorted((d for d in os.listdir(args.runs_dir)
                   if os.path.isfile(os.path.join(args.runs_dir, d, "metrics.jsonl"))
                   and (not seeds or "-s" + d.rsplit("-s", 1)[1] in seeds)),
                  key=lambda d: (order.index(d.rsplit("-d", 1)[0]) if d.rsplit("-d", 1)[0] in order else len(order), d))
    if not runs:
        sys.exit(f"horizon.py: error: no run with a metrics.jsonl under {args.runs_dir!r}")
    series_by_config, seeds_by_config, counts_by_config = {}, {}, {}
    for name in runs:                                                 # compare.run_name: <method>-d<delta>-s<seed>
        head, seed = name.rsplit("-s", 1)
        method, delta = head.rsplit("-d", 1)
        series_by_config.setdefault((method, float(delta)), []).append(read_run(os.path.join(args.runs_dir, name)))
        seeds_by_config.setdefault((method, float(delta)), []).append(seed)
        counts_by_config.setdefault((method, float(delta)), []).append(clip_counts(os.path.join(args.runs_dir, name)))
    horizons = {s["entropy"][-1][0] for runs_ in series_by_config.values() for s in runs_}
    if len(horizons) != 1:
        sys.exit(f"horizon.py: error: the runs end at different steps {sorted(horizons)}; finish them first")
    horizon = horizons.pop()
    table = {config: [dict(summarize(s), seed=seed, **counts) for s, seed, counts
                      in zip(runs_, seeds_by_config[config], counts_by_config[config])]
             for config, runs_ in series_by_config.items()}
    n_seeds = max(len(r) for r in table.values())
    if n_seeds < 2:
        lines = [ONE_SEED] + one_seed_check(table)
    else:
        lines = entropy_collapse_verdicts(table, horizon, entropy_control(table)[0]) + verdicts(table)
    md = markdown(table, lines, horizon, n_seeds)
    results = args.results or args.runs_dir
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "horizon.md"), "w") as f:
        f.write(md)
    with open(os.path.join(results, "horizon.json"), "w") as f:
        json.dump({f"{m}|{d}": rows for (m, d), rows in table.items()}, f, indent=1)
    figure = args.figure or os.path.join(args.runs_dir, "horizon.png")
    plot(series_by_config, figure, horizon)
    plot_bins(table, figure.replace(".png", "_bins.png"))
    print(md)


if __name__ == "__main__":
    main()

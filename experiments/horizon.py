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

It writes <results>/horizon.{md,json}, <figure> (six curves over steps), <figure>_bins.png (where each arm clips:
per old-probability bin, the tokens above the band, below it, and clipped) and, with a no-clip arm,
<figure>_noclip.png (entropy per arm, and each arm minus no-clip per step, paired by seed, with its 95% t band:
under --reward random that difference is the arm's clip's own drift); without --results / --figure, into the runs
directory. `--from-json --results <dir>` re-issues horizon.md from the summaries alone (horizon.json, with
compare.json's last-5-step entropy); docs/results.md shows the committed ones. The statistics and the readings are
experiments/verdicts.py's (entropy_control against a no-clip arm, random_control under --reward random). Definitions:
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
from compare import clip_counts, load_tables, plot_seeds, run_reward  # noqa: E402  (puts the root on sys.path)
from machinery.jsonl import jsonl_path, read_jsonl  # noqa: E402
from verdicts import (ONE_SEED, SUMMARY_WINDOWS, TESTABLE, arm_name, at_window, ci,  # noqa: E402
                      entropy_control, is_random, mean_std, mean_std_cell, one_seed_check, regime, t_interval,
                      verdict_windows, verdicts, NI_MARGIN, noninferiority)

WINDOW = 10      # steps in a trailing mean (per-step metrics come from 256 completions: noisy one by one)
LAST_EVALS = 3   # evaluations averaged into the final accuracy
BINS = ["0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0"]
PANELS = [("entropy", "policy entropy (nats/token)"), ("mean@n", "held-out mean@n"), ("pass@n", "held-out pass@n"),
          ("clip/frac", "clipped token fraction"), ("clip/low_p_upper_rate", "upper-clip rate of p < 0.2 tokens"),
          ("band/width", "mean band width (upper - lower ratio bound)")]


def read_run(run_dir):
    """Per-step series of one run: {key: [(step, value)]}, with eval keys renamed to mean@n / pass@n."""
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))   # plain, or gzipped as committed
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
               for side in ("upper", "lower") for b in BINS},
            **{f"clip/frac_p{b}": whole(f"clip/frac_p{b}") for b in BINS},
            **{f"{k}@{w}": at_window([v for _, v in series.get(k, [])], w)
               for k, ws in SUMMARY_WINDOWS.items() for w in ws}}


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

    (2a) "reproduced" where every GRPO seed (n >= 2) halves its entropy. (2b) paired delays of Band-KL's
    half-entropy step: "reproduced" needs a mean delay of at least a quarter of GRPO's half-entropy step with a
    95% t interval above 0, "not reproduced" an interval wholly below that quarter. `reading` is
    verdicts.entropy_control's: unless it is one of TESTABLE (the regime can test the claim), it replaces (2b)'s
    label, whose numbers stay. None: the delay rule alone.
    """
    out = []
    clip, band = table.get(("clip", 0.05)), table.get(("bandkl", 0.05))
    if not clip or not band:
        return out
    c_steps, b_steps = [x["half_entropy_step"] for x in clip], [x["half_entropy_step"] for x in band]
    c_reached = sum(s is not None for s in c_steps)
    if len(c_steps) < 2:
        v = f"inconclusive (n = {len(c_steps)})"
    else:
        v = ("reproduced" if c_reached == len(c_steps) else "not reproduced at this scale" if c_reached == 0
             else "not distinguishable at this scale")
    share = (mean_std([x.get("entropy", math.nan) for x in clip])[0]
             / mean_std([x.get("entropy_start", math.nan) for x in clip])[0])
    share = "" if math.isnan(share) else f"; final entropy (last {WINDOW} steps) {share:.2f} of the start"
    out.append(f"(2a) GRPO's entropy collapses (falls below half its start within {horizon} steps): **{v}** "
               f"(half-entropy step {half_step_cell(c_steps, horizon)}{share}; the paper's GRPO ends near 0.02 "
               "nats, a tenth of BandPO's)")
    # Paired by seed (a seed's runs share the initial policy and first rollout); a run that never crosses counts
    # as crossing at horizon + 1. The paper's effect is prevention (entropy ~10x higher), so a "material" delay is
    # at least a quarter of GRPO's own half-entropy step.
    late = lambda s: horizon + 1 if s is None else s  # noqa: E731
    by_seed = lambda rows: {x.get("seed", i): x["half_entropy_step"] for i, x in enumerate(rows)}  # noqa: E731
    c_seed, b_seed = by_seed(clip), by_seed(band)
    d = t_interval([late(b_seed[k]) - late(c_seed[k]) for k in sorted(set(c_seed) & set(b_seed))])
    material = 0.25 * mean_std([late(c) for c in c_steps])[0]
    if d.n < 2:
        v = f"inconclusive (n = {d.n})"
    elif c_reached == 0:
        v = "not distinguishable at this scale (GRPO itself does not collapse)"
    elif d.mean >= material and d.mean - d.half > 0:
        v = "reproduced"
    elif d.mean + d.half < material:
        v = "not reproduced"
    else:
        v = "not distinguishable at this scale"
    if reading is not None and reading not in TESTABLE:
        v = f"{reading} (see (2))"
    out.append(f"(2b) BandPO delays or prevents it (by >= a quarter of GRPO's half-entropy step, {material:.0f} "
               f"steps): **{v}** (Band-KL half-entropy step {half_step_cell(b_steps, horizon)}; delay "
               f"{ci(d, '.0f')} steps, paired by seed)")
    return out


def markdown(table, lines, horizon, n_seeds):
    cell = lambda runs, key, scale=1.0, fmt=".3f": mean_std_cell([x[key] for x in runs], scale, fmt)  # noqa: E731
    reward = regime(table)
    coins = f" Training rewards: coins (--reward {reward})." if is_random(reward) else ""
    out = [f"{n_seeds} seeds x {horizon} steps; mean ± std over seeds. Entropy: step 1 and the mean of the last "
           f"{WINDOW} steps; accuracy: the first evaluation and the mean of the last {LAST_EVALS}; clip and band "
           f"columns: means over the whole horizon.{coins} Verdicts: differences paired by seed, mean ± half-width "
           f"of the 95% t interval; {verdict_windows(table)}.",
           "",
           "| method | entropy, step 1 | entropy, final | half-entropy step | mean@n start (%) | mean@n final (%) "
           "| pass@n final (%) | clip frac | upper-clip rate, p < 0.2 | band width | out above / below band |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for config, runs in table.items():
        out.append(f"| {arm_name(config)} | {cell(runs, 'entropy_start')} | {cell(runs, 'entropy')} "
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
        out.append(f"| {arm_name(config)} | – / {at(runs, 'mean@n_at', 0, 100, '.1f')} | " + " | ".join(
            f"{at(runs, 'entropy_at', t, 1, '.3f')} / {at(runs, 'mean@n_at', t, 100, '.1f')}" for t in steps) + " |")
    out += ["", "Token fraction per old-probability bin (whole horizon, mean over seeds): above the band / below "
            "the band / clipped:", "", "| method | " + " | ".join(f"p {b}" for b in BINS) + " |",
            "|---|" + "---|" * len(BINS)]
    frac = lambda runs, key: mean_std([x.get(key, math.nan) for x in runs])[0]  # noqa: E731
    shown = lambda v: "–" if math.isnan(v) else f"{v:.4f}"  # noqa: E731   (older summaries lack clip/frac_p*)
    for config, runs in table.items():
        out.append(f"| {arm_name(config)} | " + " | ".join(
            " / ".join(shown(frac(runs, k)) for k in (f"band/out_upper_frac_p{b}", f"band/out_lower_frac_p{b}",
                                                       f"clip/frac_p{b}")) for b in BINS) + " |")
    return "\n".join(out + [""] + [f"- {v}" for v in lines]) + "\n"


def plot(series_by_config, path, horizon):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, (key, name) in zip(axes.flat, PANELS):
        for config, runs in series_by_config.items():
            plot_seeds(ax, [dict(trailing_mean(s[key]) if key not in ("mean@n", "pass@n") else s[key])
                            for s in runs if s.get(key)], arm_name(config))
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
    """Where each arm clips: per old-probability bin, the fraction of the bin's tokens above the band, below it (any
    advantage sign), and clipped (the bound binds: Â > 0 above or Â < 0 below), mean over seeds and the horizon."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4), sharey=True)
    width = 0.8 / max(len(table), 1)
    panels = (("band/out_upper_frac_p", "r above the band (any advantage sign)"),
              ("band/out_lower_frac_p", "r below the band (any advantage sign)"),
              ("clip/frac_p", "clipped (the bound binds), either side"))
    for ax, (key, title) in zip(axes, panels):
        for i, (config, runs) in enumerate(table.items()):
            vals = [mean_std([x.get(f"{key}{b}", math.nan) for x in runs])[0] for b in BINS]
            ax.bar([j + i * width for j in range(len(BINS))], vals, width, label=arm_name(config))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(BINS))], [f"p {b}" for b in BINS])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("old token probability")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("fraction of the bin's tokens (whole horizon)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_noclip(series_by_config, seeds_by_config, path, title):
    """Entropy per arm (the WINDOW-step trailing mean, mean over seeds), and each arm minus no-clip per step, paired
    by seed: the mean and its 95% t band (no band from one seed). Under --reward random that difference is the
    arm's clip's own drift."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smooth = {config: {seed: dict(trailing_mean(s["entropy"])) for s, seed in zip(runs, seeds_by_config[config])}
              for config, runs in series_by_config.items()}
    noclip = next(v for (m, _), v in smooth.items() if m == "noclip")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for config, runs in smooth.items():
        plot_seeds(axes[0], list(runs.values()), arm_name(config))
        color = axes[0].lines[-1].get_color()   # the arm's colour in both panels
        if config[0] == "noclip":
            continue
        steps = sorted(set.intersection(*(set(runs[k]) & set(noclip[k]) for k in runs if k in noclip)))
        diffs = [t_interval([runs[k][t] - noclip[k][t] for k in runs if k in noclip]) for t in steps]
        axes[1].plot(steps, [d.mean for d in diffs], lw=1.6, color=color, label=f"{arm_name(config)} - noclip")
        if all(d.n > 1 for d in diffs):
            axes[1].fill_between(steps, [d.mean - d.half for d in diffs], [d.mean + d.half for d in diffs],
                                 color=color, alpha=0.2)
    axes[1].axhline(0, color="gray", lw=1)
    axes[0].set_title(f"policy entropy ({WINDOW}-step mean; band = min..max over seeds)", fontsize=10)
    axes[1].set_title("arm minus no-clip, paired by seed (band = 95% t interval)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs_dir", nargs="?", help="a compare.py --runs-dir (one <method>-d<delta>-s<seed> per run)")
    p.add_argument("--results", default=None, help="directory of horizon.{md,json} (default: runs_dir)")
    p.add_argument("--figure", default=None, help="PNG path (default: <runs_dir>/horizon.png)")
    p.add_argument("--seeds", default="", help="only these seeds, comma separated (default: every run)")
    p.add_argument("--from-json", action="store_true",
                   help="re-issue horizon.md from <results>/horizon.json (and compare.json); no figures")
    p.add_argument("--noninferiority", action="store_true",
                   help="add the long coin runs' reading (verdicts.noninferiority; random-toy/plan.md)")
    args = p.parse_args()
    if args.from_json:
        table = load_tables(args.results or p.error("--from-json needs --results")).get("horizon")
        if table is None:
            sys.exit(f"horizon.py: error: no horizon.json in {args.results!r}")
        horizon = max(int(t) for rows in table.values() for x in rows for t in x["entropy_at"])
    else:
        if not args.runs_dir:
            p.error("a runs_dir, or --from-json")
        table, series_by_config, seeds_by_config, horizon = read_runs(args.runs_dir, args.seeds)
    n_seeds = max(len(r) for r in table.values())
    evals = f"the mean of the last {LAST_EVALS} evaluations"
    try:
        regime(table)   # every run on one --reward, also with one seed
        if n_seeds < 2:
            lines = [ONE_SEED] + one_seed_check(table)
        elif is_random(regime(table)):
            lines = verdicts(table, evals)
        else:
            lines = entropy_collapse_verdicts(table, horizon, entropy_control(table)[0]) + verdicts(table, evals)
    except ValueError as e:
        sys.exit(f"horizon.py: error: {e}")
    if args.noninferiority:
        label, text = noninferiority(table)
        lines.append(f"(NI) GRPO's entropy is at least no-clip's minus {NI_MARGIN:g} nats (experiments/results/"
                     f"random-toy/plan.md): **{label}** ({text})")
    md = markdown(table, lines, horizon, n_seeds)
    results = args.results or args.runs_dir
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "horizon.md"), "w") as f:
        f.write(md)
    print(md)
    if args.from_json:
        return
    with open(os.path.join(results, "horizon.json"), "w") as f:
        json.dump({f"{m}|{d}": rows for (m, d), rows in table.items()}, f, indent=1)
    figure = args.figure or os.path.join(args.runs_dir, "horizon.png")
    plot(series_by_config, figure, horizon)
    plot_bins(table, figure.replace(".png", "_bins.png"))
    if any(m == "noclip" for m, _ in table):
        reward = regime(table)
        plot_noclip(series_by_config, seeds_by_config, figure.replace(".png", "_noclip.png"),
                    f"Against the no-clip arm: {horizon} steps, training rewards {reward}")


def read_runs(runs_dir, seeds=""):
    """(table, series_by_config, seeds_by_config, horizon) of every finished run under runs_dir (or of `seeds`)."""
    seeds = {f"-s{s}" for s in seeds.split(",") if s}
    order = ["clip", "noclip", "clip-higher", "dcpo", "bandkl", "bandtv", "bandchi2"]   # baselines first
    method_of = lambda d: d.rsplit("-d", 1)[0]  # noqa: E731   compare.run_name: <method>-d<delta>-s<seed>
    runs = sorted((d for d in os.listdir(runs_dir) if jsonl_path(os.path.join(runs_dir, d, "metrics.jsonl"))
                   and (not seeds or "-s" + d.rsplit("-s", 1)[1] in seeds)),
                  key=lambda d: (order.index(method_of(d)) if method_of(d) in order else len(order), d))
    if not runs:
        sys.exit(f"horizon.py: error: no run with a metrics.jsonl(.gz) under {runs_dir!r}")
    series_by_config, seeds_by_config, rows_by_config = {}, {}, {}
    for name in runs:
        head, seed = name.rsplit("-s", 1)
        method, delta = head.rsplit("-d", 1)
        config, run_dir = (method, float(delta)), os.path.join(runs_dir, name)
        series_by_config.setdefault(config, []).append(read_run(run_dir))
        seeds_by_config.setdefault(config, []).append(seed)
        rows_by_config.setdefault(config, []).append(
            dict(seed=seed, reward=run_reward(run_dir), **clip_counts(run_dir)))
    horizons = {s["entropy"][-1][0] for runs_ in series_by_config.values() for s in runs_}
    if len(horizons) != 1:
        sys.exit(f"horizon.py: error: the runs end at different steps {sorted(horizons)}; finish them first")
    table = {config: [dict(summarize(s), **extra) for s, extra in zip(runs_, rows_by_config[config])]
             for config, runs_ in series_by_config.items()}
    return table, series_by_config, seeds_by_config, horizons.pop()


if __name__ == "__main__":
    main()

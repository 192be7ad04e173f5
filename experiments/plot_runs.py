"""Plot one or more training runs (their metrics.jsonl): what to watch while BandPO trains.

Six panels: held-out accuracy (mean@n), training reward, policy entropy, clipped token fraction (solid) with its
upper-bound part (dashed), the upper-clip rate of tokens with old probability p < 0.2 (the tokens fixed clipping
starves, docs/paper.md §2), and the clip rate by old-probability bin averaged over the run (bars, one per run).

    python experiments/plot_runs.py runs/20261121-133000-bandkl                  # -> <run>/curves.png
    python experiments/plot_runs.py runs/a runs/b --out figures/demo.png
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from horizon import BINS, read_run  # noqa: E402  (reads metrics.jsonl or metrics.jsonl.gz)
from machinery.jsonl import jsonl_path  # noqa: E402

CURVES = [("mean@n", "held-out accuracy (mean@n)"), ("reward/mean", "training reward"),
          ("entropy", "policy entropy (nats/token)"), ("clip/frac", "clipped token fraction (dashed: upper)"),
          ("clip/low_p_upper_rate", "upper-clip rate of p < 0.2 tokens")]


def plot(series_by_run, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, name) in zip(axes.flat, CURVES):
        for label, series in series_by_run.items():
            if series.get(key):
                line, = ax.plot(*zip(*series[key]), label=label, lw=1.4, marker="o" if key == "mean@n" else None,
                                ms=3)
                if key == "clip/frac" and series.get("clip/frac_upper"):
                    ax.plot(*zip(*series["clip/frac_upper"]), ls="--", lw=1.0, color=line.get_color())
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax = axes.flat[-1]
    width = 0.8 / max(len(series_by_run), 1)
    for i, (label, series) in enumerate(series_by_run.items()):
        means = [_mean(series.get(f"clip/frac_p{b}", [])) for b in BINS]
        ax.bar([j + i * width for j in range(len(BINS))], means, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(BINS))], [f"p {b}" for b in BINS])
    ax.set_title("clip rate by old-probability bin (run mean)")
    ax.set_xlabel("old token probability")
    ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(points):
    return sum(v for _, v in points) / len(points) if points else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl or .gz)")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/curves.png)")
    p.add_argument("--title", default=None, help="figure title (default: the runs' names)")
    args = p.parse_args()
    for run in args.runs:
        if jsonl_path(os.path.join(run, "metrics.jsonl")) is None:
            sys.exit(f"plot_runs.py: error: {run!r} has no metrics.jsonl (nor metrics.jsonl.gz)")
    series = {os.path.basename(os.path.normpath(run)): read_run(run) for run in args.runs}
    out = args.out or os.path.join(args.runs[0], "curves.png")
    plot(series, out, args.title or ", ".join(series))
    print(out)


if __name__ == "__main__":
    main()

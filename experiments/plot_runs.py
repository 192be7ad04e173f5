"""Plot one or more training runs (their metrics.jsonl): held-out accuracy, entropy, clip rates over steps.

    python experiments/plot_runs.py runs/20261121-133000-bandkl                  # -> <run>/curves.png
    python experiments/plot_runs.py runs/a runs/b --out figures/demo.png
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import load_run, plot  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/curves.png)")
    args = p.parse_args()
    for run in args.runs:
        if not os.path.isfile(os.path.join(run, "metrics.jsonl")):
            sys.exit(f"plot_runs.py: error: {run!r} has no metrics.jsonl")
    curves = {os.path.basename(os.path.normpath(run)): [load_run(run)[2]] for run in args.runs}
    out = args.out or os.path.join(args.runs[0], "curves.png")
    plot(curves, out, title="Training run" + ("s" if len(args.runs) > 1 else ""))
    print(out)


if __name__ == "__main__":
    main()

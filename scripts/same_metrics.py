"""Are two runs the same? Compares two metrics.jsonl files (or .jsonl.gz) line by line, timings aside.

A change that should not change what a run computes (a refactor, a reflow) is checked by running the
same command at both commits with the same seed and comparing the runs' metrics here: every value
must be equal, bit for bit (compared by its JSON text, so a NaN equals a NaN and 0.0 is not -0.0),
except the timings (time/*, memory/*, tokens_per_s, mfu), which no two runs share. Exit 0 if they are,
1 if not, printing the first 20 differences. On CPU in float32 a run is deterministic; GPU kernels
need not be.

    python scripts/same_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl
    python scripts/same_metrics.py runs/a runs/b          # run directories: their metrics.jsonl
    python scripts/same_metrics.py runs/a experiments/results/demo-real   # a committed run, gzipped
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machinery.jsonl import read_jsonl  # noqa: E402

TIMINGS = ("time/", "memory/", "tokens_per_s", "mfu")
MISSING = "<missing>"


def load(path):
    """The lines of a metrics file or of a run directory's, plain or gzipped (NAME.jsonl.gz)."""
    if os.path.isdir(path):  # a run directory
        path = os.path.join(path, "metrics.jsonl")
    return read_jsonl(path)


def compare(a, b):
    """-> (number of equal values, [(line, key, value in a, value in b)] of every difference), line
    counted from 1. A key in one run's line and not in the other's is a difference (MISSING there)."""
    equal, diffs = 0, []
    if len(a) != len(b):
        diffs.append((None, "lines", len(a), len(b)))
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted(set(x) | set(y)):
            if k.startswith(TIMINGS):
                continue
            if k in x and k in y and json.dumps(x[k]) == json.dumps(y[k]):
                equal += 1
            else:
                diffs.append((i + 1, k, x.get(k, MISSING), y.get(k, MISSING)))
    return equal, diffs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args()
    equal, diffs = compare(load(args.a), load(args.b))
    print(f"{equal} values equal, {len(diffs)} different (timings aside)")
    for line, key, x, y in diffs[:20]:
        print(f"  line {line}: {key}: {x!r} vs {y!r}")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()

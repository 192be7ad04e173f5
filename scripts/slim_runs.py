"""Commit finished runs light: config.json and the few per-step metrics an entropy reading needs.

A run's metrics.jsonl holds ~56 keys per step, ~100 KB gzipped over 300 steps. The long coin runs add 42 such runs,
more than the tracked tree has room for (it stays under 20 MiB, tests/test_tree_size.py). This copies each
finished run of SRC to DEST/<run>/: config.json byte for byte, and metrics.jsonl.gz with `step`, KEYS (the
entropy readings' and the manipulation check's) and every `eval/` key of each line (~21 KB), as `gzip -n -9` writes
it (compress_results.gzip_bytes), read back and compared with the slim lines before it is moved into place.

- A run short of its config's max_steps is left out and named (compress_results.unfinished).
- A run already in DEST is left as it is: said "already there" where its lines equal SRC's slim lines, named
  otherwise.
- SRC is never changed.

horizon.py reads a slim run (a key it lacks is an empty series); its per-bin table needs a run's full keys.

    python scripts/slim_runs.py runs/random-toy experiments/results/random-toy/runs
"""
import argparse
import gzip
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compress_results import gzip_bytes, unfinished  # noqa: E402

# the manipulation check counts the clip's p < 0.2 upward clips (compare.clip_counts): frac_upper x response tokens
# x low_p_share_of_upper, so those keys stay
KEYS = ("entropy", "reward/mean", "clip/frac", "clip/frac_upper", "clip/frac_lower", "clip/low_p_upper_rate",
        "kl/old_new_k3", "response_length/mean", "clip/low_p_share_of_upper")


def slim(row):
    """One metrics line cut to `step`, KEYS and the evaluation keys, in the line's own order."""
    return {k: v for k, v in row.items() if k == "step" or k in KEYS or k.startswith("eval/")}


def slim_lines(path):
    """The slim form of a plain metrics.jsonl, as bytes (one JSON object per line)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return "".join(json.dumps(slim(r)) + "\n" for r in rows).encode()


def copy_run(src, dest):
    """Copy one finished run slim into dest (a directory that does not exist yet). -> a line to print."""
    metrics = os.path.join(src, "metrics.jsonl")
    why = unfinished(metrics)
    if why:
        return f"left {src}: an unfinished run, {why}"
    data = slim_lines(metrics)
    if os.path.exists(dest):
        with gzip.open(os.path.join(dest, "metrics.jsonl.gz"), "rb") as f:
            same = f.read() == data
        return f"already there: {dest}" if same else f"left {src}: {dest} holds other lines"
    tmp = f"{dest}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(tmp, "config.json"))
    with open(os.path.join(tmp, "metrics.jsonl.gz"), "wb") as f:
        f.write(gzip_bytes(data))
    with gzip.open(os.path.join(tmp, "metrics.jsonl.gz"), "rb") as f:
        if f.read() != data:
            shutil.rmtree(tmp)
            raise RuntimeError(f"{dest}/metrics.jsonl.gz did not read back as written; nothing copied")
    os.replace(tmp, dest)
    return f"copied {src} -> {dest} ({len(data)} -> {os.path.getsize(os.path.join(dest, 'metrics.jsonl.gz'))} bytes)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="a runs directory (compare.py's --runs-dir)")
    ap.add_argument("dest", help="the committed runs directory")
    args = ap.parse_args(argv)
    names = sorted(d for d in os.listdir(args.src) if os.path.isfile(os.path.join(args.src, d, "metrics.jsonl")))
    if not names:
        sys.exit(f"slim_runs.py: error: no run with a plain metrics.jsonl under {args.src!r}")
    os.makedirs(args.dest, exist_ok=True)
    for name in names:
        print(copy_run(os.path.join(args.src, name), os.path.join(args.dest, name)))


if __name__ == "__main__":
    main()

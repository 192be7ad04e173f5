"""Make finished results travel light: gzip the run outputs under experiments/results, palette the figures.

A run writes plain NAME.jsonl (metrics.jsonl, drift.py's pairs.jsonl) line by line, so it can resume; what is
committed is NAME.jsonl.gz, which every reader opens as well (machinery/jsonl.py). The .gz is written as `gzip -n
-9` writes it: no file name and no time stamp in the header, so the same lines always give the same bytes and a
re-run changes nothing in git. Each .gz is read back and compared with the plain file line by line before the plain
file is removed. A metrics.jsonl whose config.json asks for more steps than it holds belongs to an unfinished run
(train.py still appends to it) and is left alone. A plain file beside an older .gz (a committed run extended by
compare.py) replaces that .gz.

Figures: a PNG of figures/ still in RGB(A), as matplotlib writes it, is re-saved as a 128-colour palette image
(the same size in pixels, about a third of the bytes: a plot's few flat colours and their anti-aliasing read the
same). `.gitignore` keeps plain run files and checkpoints out of git.

    python scripts/compress_results.py                 # every finished *.jsonl under experiments/results + figures
    python scripts/compress_results.py --dry-run       # say what it would do
    python scripts/compress_results.py experiments/results/toy-stress
"""
import argparse
import gzip
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = 128   # 64 already merged the grey of a dotted line into a neighbouring green


def gzip_bytes(data):
    """`gzip -n -9` of `data`, byte-stable: mtime 0 and an empty file name in the header."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def unfinished(path):
    """Why the run that writes `path` is not finished, or None: its config.json's max_steps is beyond its last step."""
    if os.path.basename(path) != "metrics.jsonl":
        return None
    config = os.path.join(os.path.dirname(path), "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        max_steps = json.load(f).get("max_steps")
    with open(path) as f:
        steps = [json.loads(line).get("step", 0) for line in f if line.strip()]
    if max_steps is not None and (not steps or max(steps) < max_steps):
        return f"at step {max(steps, default=None)} of {max_steps}"
    return None


def compress(path, dry_run=False):
    """Gzip one plain .jsonl beside it, check it line by line, remove the plain file. Returns a line to print."""
    with open(path, "rb") as f:
        data = f.read()
    packed = gzip_bytes(data)
    if dry_run:
        return f"would gzip {path} ({len(data)} -> {len(packed)} bytes)"
    with open(path + ".gz.tmp", "wb") as f:
        f.write(packed)
    with gzip.open(path + ".gz.tmp", "rb") as f:
        back = f.read().splitlines(keepends=True)
    lines = data.splitlines(keepends=True)
    if back != lines:
        os.remove(path + ".gz.tmp")
        first = next((i for i, (a, b) in enumerate(zip(lines, back)) if a != b), min(len(lines), len(back)))
        raise RuntimeError(f"{path}.gz differs from {path} at line {first + 1}; {path} kept")
    os.replace(path + ".gz.tmp", path + ".gz")
    os.remove(path)
    return f"gzipped {path} ({len(lines)} lines, {len(data)} -> {len(packed)} bytes)"


def palette(path, dry_run=False):
    """Re-save an RGB(A) PNG as a COLOURS palette image; None where it is one already or is see-through."""
    from PIL import Image
    with Image.open(path) as im:
        im.load()
    if im.mode not in ("RGB", "RGBA"):
        return None
    if im.mode == "RGBA" and im.getchannel("A").getextrema()[0] < 255:
        return f"kept {path}: it has transparent pixels"
    if dry_run:
        return f"would palette {path}"
    before = os.path.getsize(path)
    im.convert("RGB").quantize(COLOURS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path + ".tmp.png", optimize=True, dpi=im.info.get("dpi", (72, 72)))
    os.replace(path + ".tmp.png", path)
    return f"paletted {path} ({before} -> {os.path.getsize(path)} bytes)"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", help="folders (or .jsonl / .png files); default experiments/results and figures",
                   default=[os.path.join(ROOT, "experiments", "results"), os.path.join(ROOT, "figures")])
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    files = []
    for top in args.paths:
        if os.path.isfile(top):
            files.append(top)
        for d, _, names in sorted(os.walk(top)):
            files += [os.path.join(d, n) for n in sorted(names)]
    for path in files:
        if path.endswith(".jsonl"):
            why = unfinished(path)
            print(f"left {path}: an unfinished run, {why}" if why else compress(path, args.dry_run))
        elif path.endswith(".png"):
            line = palette(path, args.dry_run)
            if line:
                print(line)


if __name__ == "__main__":
    sys.exit(main())

"""Make finished results travel light: gzip the run outputs under experiments/results, palette the figures.

A run writes plain NAME.jsonl (metrics.jsonl, drift.py's pairs.jsonl) line by line, so it can resume; what is
committed is NAME.jsonl.gz, which every reader opens as well (machinery/jsonl.py). Each .gz is read back and compared
with the plain file line by line before the plain file is removed. Its header holds no file name and no time (mtime
0, as `gzip -n`), so neither reaches the bytes. A .gz that already holds exactly the plain file's lines is kept as it
is, whatever compressor wrote it, so a re-run changes nothing in git; a plain file that continues its .gz (a
committed run resumed) replaces it; any other plain file beside a .gz (fewer lines, or other earlier ones) is
refused, naming it, with exit code 2 and nothing written. A metrics.jsonl whose config.json asks for more steps than
it holds belongs to an unfinished run (train.py still appends to it) and is left alone.

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
sys.path.insert(0, ROOT)
from machinery.jsonl import first_difference  # noqa: E402

COLOURS = 128   # 64 already merged the grey of a dotted line into a neighbouring green


def gzip_bytes(data):
    """`data` gzipped by zlib at level 9, with no file name and mtime 0 in the header (as `gzip -n`). The deflate
    stream is zlib's, not GNU gzip's own: the same lines give the same bytes under the same zlib."""
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


def refusal(path):
    """Why the plain `path` may not replace the .gz beside it (it does not begin with every line of it), or None."""
    differs = os.path.isfile(path + ".gz") and first_difference(path + ".gz", path)
    return f"{path} does not continue {path}.gz ({differs}); both kept" if differs else None


def compress(path, dry_run=False):
    """Gzip one plain .jsonl beside it, check it line by line, remove the plain file; keep a .gz that holds the same
    lines. Returns a line to print; ValueError (refusal's line) where the plain file does not continue its .gz."""
    why = refusal(path)
    if why:
        raise ValueError(why)
    with open(path, "rb") as f:
        data = f.read()
    if os.path.isfile(path + ".gz"):
        with gzip.open(path + ".gz", "rb") as f:
            if f.read().splitlines() == data.splitlines():
                if not dry_run:
                    os.remove(path)
                return f"{'would keep' if dry_run else 'kept'} {path}.gz: it holds the same lines as {path}"
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
    # every refusal before anything is written: a .gz never loses the lines its run had
    why = next((refusal(p) for p in files if p.endswith(".jsonl") and not unfinished(p) and refusal(p)), None)
    if why:
        print(f"compress_results.py: error: {why}", file=sys.stderr)
        return 2
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

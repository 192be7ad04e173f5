"""Committed run outputs travel compressed: a reader opens `NAME.jsonl` or, where only that exists, `NAME.jsonl.gz`.

A run writes plain `metrics.jsonl` / `pairs.jsonl` (appended line by line, resumable); what is committed under
experiments/results/ is the same lines gzipped (scripts/compress_results.py), so the tree stays small enough to
travel to a GPU machine. Every reader of a run that may be committed goes through `jsonl_path` / `read_jsonl`; a
benchmark or test that reads the run it has just written opens the plain file.
"""
import gzip
import json
import os


def jsonl_path(path):
    """The file that holds `path`'s lines: `path` itself, else `path + '.gz'`; None where neither exists.

    `path` may name either form. Where both exist the plain file wins only if it continues the .gz (begins with
    every one of its lines: a committed run resumed, steps appended); otherwise ValueError naming both, since
    either choice would drop lines the other holds."""
    plain = path[:-3] if path.endswith(".gz") else path
    if os.path.isfile(plain):
        if os.path.isfile(plain + ".gz"):
            differs = first_difference(plain + ".gz", plain)
            if differs is not None:
                raise ValueError(f"{plain} does not continue {plain}.gz ({differs}): delete the one that is "
                                 f"not the run's")
        return plain
    return plain + ".gz" if os.path.isfile(plain + ".gz") else None


def _lines(path):
    """The non-blank lines of a plain or gzipped file, without their line ends (bytes)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def first_difference(old, new):
    """Where file `new` stops continuing file `old` (plain or gzipped): None where `new` begins with every line of
    `old`, else a few words naming the first line of `old` that `new` lacks or holds otherwise."""
    a, b = _lines(old), _lines(new)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == len(a):
        return None
    return f"line {i + 1} differs" if i < len(b) else f"it holds {len(b)} of {len(a)} lines"


def resumed_lines(path, step):
    """The lines (text, each with its newline) a run resumed from its checkpoint at `step` keeps of its metrics file
    `path`: those of the plain file, else of the committed .gz, with a step <= `step` (none at step 0: the run starts
    over and writes its own step 0); None where neither file exists. A last line cut short (read_appended) is not
    kept. Raises ValueError where a .gz holds a line the run would not keep: continuing would rewrite those steps."""
    found = jsonl_path(path)
    if found is None:
        return None
    with open_jsonl(found) as f:
        lines = [line for line in f if line.strip() and line.endswith("\n")]
    kept = [line for line in lines if step > 0 and json.loads(line)["step"] <= step]
    gz = (path[:-3] if path.endswith(".gz") else path) + ".gz"
    if os.path.isfile(gz) and len(kept) < len(_lines(gz)):
        last = json.loads(_lines(gz)[-1])["step"]
        raise ValueError(f"{gz} holds steps to {last}, and the run continues from step {step} (its last "
                         f"checkpoint; 0: none): it would write steps {step + 1}..{last} again; delete {gz} to "
                         f"train them again")
    return kept


def open_jsonl(path):
    """A text file object over `path`'s lines, plain or gzipped (FileNotFoundError naming `path` where neither)."""
    found = jsonl_path(path)
    if found is None:
        raise FileNotFoundError(f"no {path} (nor {path}.gz)")
    return gzip.open(found, "rt") if found.endswith(".gz") else open(found)


def read_appended(path):
    """The whole lines of a plain file that a process appends to, as dicts: a last line cut short (its writer was
    stopped mid-write, so no newline ends it) is not a line yet. A broken line before the last is an error."""
    with open(path) as f:
        text = f.read()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def read_jsonl(path):
    """Every non-blank line of `path` (plain or gzipped) as a dict."""
    with open_jsonl(path) as f:
        return [json.loads(line) for line in f if line.strip()]

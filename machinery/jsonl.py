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

    `path` may name either form; the plain file wins where both exist (a run resumed over a committed one appends
    to the plain file)."""
    plain = path[:-3] if path.endswith(".gz") else path
    for p in (plain, plain + ".gz"):
        if os.path.isfile(p):
            return p
    return None


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

"""The tracked tree travels light: it is copied, with the wheels it needs, in at most 64 MiB to a GPU machine, so the
files git tracks sum to at most 20 MiB; run outputs are committed gzipped and no checkpoint is committed."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 20 * 2**20   # bytes: the tree's share of a 64 MiB copy to a GPU machine; the wheels take the rest
SHOWN = 10           # the largest files named when it is over


def tracked():
    """The paths git tracks (relative to the root), or a skip where this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"no git here: {e}")
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p]


def test_tracked_tree_is_within_20_mib():
    """Sum of the tracked files' sizes as they are in the work tree (`git ls-files -z | xargs -0 du -cb`); a file
    deleted but not yet committed counts nothing."""
    sizes = {p: os.lstat(os.path.join(ROOT, p)).st_size for p in tracked() if os.path.lexists(os.path.join(ROOT, p))
             and not os.path.isdir(os.path.join(ROOT, p))}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:SHOWN]
    assert total <= LIMIT, (f"the tracked tree is {total / 2**20:.2f} MiB, over {LIMIT / 2**20:.0f} MiB; the largest:\n"
                            + "\n".join(f"  {n / 2**20:7.2f} MiB  {p}" for p, n in largest)
                            + "\n(gzip run outputs with scripts/compress_results.py; commit only the figures a doc "
                              "shows)")


def test_run_outputs_are_committed_compressed_and_checkpoints_never():
    """Under experiments/results every NAME.jsonl is committed as NAME.jsonl.gz (machinery/jsonl.py reads both),
    and no checkpoint (a run's checkpoints/ folder, a .pt or .distcp shard) is tracked anywhere."""
    paths = tracked()
    plain = [p for p in paths if p.startswith("experiments/results/") and p.endswith(".jsonl")]
    checkpoints = [p for p in paths if "/checkpoints/" in "/" + p or p.endswith((".pt", ".distcp"))]
    assert not plain, f"plain run outputs tracked (scripts/compress_results.py gzips them): {plain[:SHOWN]}"
    assert not checkpoints, f"checkpoints tracked: {checkpoints[:SHOWN]}"

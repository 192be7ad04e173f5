"""scripts/slim_runs.py: a finished run is copied with config.json unchanged and only the listed metrics (checked
against lines written out by hand), byte-stable, readable by horizon.py; an unfinished run, or a destination holding
other lines, is left alone and named; the source is never changed."""
import filecmp
import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "experiments"), os.path.join(ROOT, "scripts")]
import horizon  # noqa: E402
import slim_runs  # noqa: E402

FULL = [
    {"step": 0, "eval/t/mean@4": 0.25, "eval/t/pass@4": 0.5},
    {"step": 1, "entropy": 0.2, "reward/mean": 0.5, "clip/frac": 0.01, "clip/frac_p0.0-0.2": 0.03,
     "band/upper_mean": 1.2, "time/step": 1.0, "kl/old_new_k3": 0.002, "kl/old_new_k1": 0.001,
     "response_length/mean": 12.5, "clip/low_p_share_of_upper": 0.25, "clip/low_p_share_of_clipped": 0.5},
    {"step": 2, "entropy": 0.19, "reward/mean": 0.25, "clip/frac_upper": 0.004, "clip/low_p_upper_rate": 0.02,
     "eval/t/mean@4": 0.5, "eval/t/pass@4": 0.75, "loss": 0.1},
]
SLIM = [   # by hand: step, the listed keys and the eval/ keys, nothing else
    {"step": 0, "eval/t/mean@4": 0.25, "eval/t/pass@4": 0.5},
    {"step": 1, "entropy": 0.2, "reward/mean": 0.5, "clip/frac": 0.01, "kl/old_new_k3": 0.002,
     "response_length/mean": 12.5, "clip/low_p_share_of_upper": 0.25},   # the manipulation check's keys
    {"step": 2, "entropy": 0.19, "reward/mean": 0.25, "clip/frac_upper": 0.004, "clip/low_p_upper_rate": 0.02,
     "eval/t/mean@4": 0.5, "eval/t/pass@4": 0.75},
]


def _run(run_dir, rows, max_steps):
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"method": "clip", "seed": 0, "max_steps": max_steps}, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_finished_run_copied_slim_and_unfinished_left(tmp_path, capsys):
    src, dest = tmp_path / "runs", tmp_path / "committed"
    _run(src / "clip-s0", FULL, max_steps=2)
    _run(src / "clip-s1", FULL[:2], max_steps=2)
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    slim_runs.main([str(src), str(dest)])
    out = capsys.readouterr().out
    assert "left" in out and "clip-s1" in out and "at step 1 of 2" in out
    assert sorted(os.listdir(dest)) == ["clip-s0"]
    assert sorted(os.listdir(dest / "clip-s0")) == ["config.json", "metrics.jsonl.gz"]
    assert filecmp.cmp(src / "clip-s0" / "config.json", dest / "clip-s0" / "config.json", shallow=False)
    with gzip.open(dest / "clip-s0" / "metrics.jsonl.gz", "rt") as f:
        assert [json.loads(line) for line in f] == SLIM
    header = (dest / "clip-s0" / "metrics.jsonl.gz").read_bytes()[:10]
    assert header[3] == 0 and header[4:8] == b"\0\0\0\0"   # no file name, mtime 0: the same lines, the same bytes
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before

    series = horizon.read_run(str(dest / "clip-s0"))   # what the readings use
    assert series["entropy"] == [(1, 0.2), (2, 0.19)] and series["mean@n"] == [(0, 0.25), (2, 0.5)]
    assert "band/width" not in series and "clip/frac_p0.0-0.2" not in series

    first = (dest / "clip-s0" / "metrics.jsonl.gz").read_bytes()
    slim_runs.main([str(src), str(dest)])   # again: nothing changes
    assert "already there" in capsys.readouterr().out
    assert (dest / "clip-s0" / "metrics.jsonl.gz").read_bytes() == first


def test_destination_with_other_lines_left_alone(tmp_path, capsys):
    src, dest = tmp_path / "runs", tmp_path / "committed"
    _run(src / "clip-s0", FULL, max_steps=2)
    other = [dict(r, entropy=0.5) if "entropy" in r else r for r in FULL]
    _run(tmp_path / "other" / "clip-s0", other, max_steps=2)
    slim_runs.main([str(tmp_path / "other"), str(dest)])
    kept = (dest / "clip-s0" / "metrics.jsonl.gz").read_bytes()
    capsys.readouterr()
    slim_runs.main([str(src), str(dest)])
    assert "holds other lines" in capsys.readouterr().out
    assert (dest / "clip-s0" / "metrics.jsonl.gz").read_bytes() == kept
    assert not [p for p in dest.iterdir() if p.name.endswith(".tmp")]

"""Committed run outputs travel gzipped (machinery/jsonl.py, scripts/compress_results.py): every reader of a run gives
the same answer from NAME.jsonl.gz as from NAME.jsonl; the compressor keeps every line, writes the same bytes for the
same lines and leaves unfinished runs alone; a committed run that compare.py extends keeps its steps; and a
committed verdict table re-issues unchanged from the committed compressed runs."""
import filecmp
import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "experiments"), os.path.join(ROOT, "scripts")]
import compare  # noqa: E402
import compress_results  # noqa: E402
import horizon  # noqa: E402
import plot_runs  # noqa: E402
import same_metrics  # noqa: E402
from machinery.jsonl import jsonl_path, read_jsonl  # noqa: E402


def _rows(n_steps):
    """A run's lines: step 0's evaluation, then steps 1..n with the keys the readers use."""
    rows = [{"step": 0, "eval/t/mean@4": 0.25, "eval/t/pass@4": 0.5}]
    for t in range(1, n_steps + 1):
        row = {"step": t, "entropy": 0.2 - 0.01 * t, "reward/mean": 0.5, "clip/frac": 0.01 * (t % 3),
               "clip/frac_upper": 0.005 * (t % 3), "clip/low_p_upper_rate": 0.02, "response_length/mean": 8.0,
               "clip/low_p_share_of_upper": 0.5, "band/lower_mean": 0.8, "band/upper_mean": 1.2, "time/step": 1.0}
        row.update({f"clip/frac_p{b}": 0.01 for b in horizon.BINS})
        rows.append(row)
    return rows


def _run(run_dir, n_steps, max_steps=None, gz=False):
    """A run directory with config.json and metrics.jsonl, or (gz) only its committed form metrics.jsonl.gz."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"prompts_per_step": 4, "group_size": 8, "max_steps": max_steps or n_steps}, f)
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows(n_steps))
    if gz:
        compress_results.compress(path)
    return path


def test_every_reader_gives_the_same_answer_from_the_gzipped_run(tmp_path, monkeypatch):
    plain = os.path.dirname(_run(tmp_path / "plain" / "clip-d0.05-s0", 12))
    packed = os.path.dirname(_run(tmp_path / "packed" / "clip-d0.05-s0", 12, gz=True))
    assert sorted(os.listdir(packed)) == ["config.json", "metrics.jsonl.gz"]
    assert read_jsonl(os.path.join(packed, "metrics.jsonl")) == _rows(12)
    for max_steps in (12, 13):
        assert compare.finished(packed, max_steps) == compare.finished(plain, max_steps) == (max_steps == 12)
    assert compare.load_run(packed) == compare.load_run(plain)
    assert compare.clip_counts(packed) == compare.clip_counts(plain)
    assert horizon.read_run(packed) == horizon.read_run(plain)
    assert horizon.read_runs(os.path.dirname(packed))[0] == horizon.read_runs(os.path.dirname(plain))[0]
    assert same_metrics.load(packed) == same_metrics.load(os.path.join(packed, "metrics.jsonl.gz")) == _rows(12)
    drawn = []
    monkeypatch.setattr(plot_runs, "plot", lambda series, out, title: drawn.append(series))
    monkeypatch.setattr(sys, "argv", ["plot_runs.py", packed, "--out", str(tmp_path / "c.png")])
    plot_runs.main()
    assert drawn == [{"clip-d0.05-s0": horizon.read_run(plain)}]


def test_compress_keeps_every_line_and_writes_the_same_bytes(tmp_path):
    lines = "".join(json.dumps(r) + "\n" for r in _rows(30))
    gz = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "pairs.jsonl"
        path.write_text(lines)
        os.utime(path, (1e9, 1e9) if name == "a" else (2e9, 2e9))   # the file's time does not reach the header
        compress_results.compress(str(path))
        assert not path.exists()
        gz.append((tmp_path / name / "pairs.jsonl.gz").read_bytes())
    assert gz[0] == gz[1]
    # RFC 1952 header: magic 1f 8b, method 8 (deflate), no flags (so no file name), mtime 0 (as `gzip -n`)
    assert gz[0][:8] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00"
    assert gzip.decompress(gz[0]).decode() == lines


def test_compress_refuses_a_gz_that_lost_a_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    monkeypatch.setattr(compress_results, "gzip_bytes", lambda data: gzip.compress(data[:-len(b'{"step": 3}\n')]))
    with pytest.raises(RuntimeError, match="differs from .* at line 3"):
        compress_results.compress(str(path))
    assert path.read_text().count("\n") == 3 and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_compress_cli_leaves_an_unfinished_run(tmp_path, monkeypatch, capsys):
    running = _run(tmp_path / "res" / "clip-d0.05-s0", 4, max_steps=10)
    done = _run(tmp_path / "res" / "clip-d0.05-s1", 10)
    loose = tmp_path / "res" / "demo-real-abc1234.metrics.jsonl"   # a copied metrics file: no config.json beside it
    loose.write_text('{"step": 1}\n')
    monkeypatch.setattr(sys, "argv", ["compress_results.py", str(tmp_path / "res")])
    compress_results.main()
    out = capsys.readouterr().out
    assert f"left {running}: an unfinished run, at step 4 of 10" in out
    assert os.path.isfile(running) and jsonl_path(done) == done + ".gz" and jsonl_path(str(loose)) == f"{loose}.gz"


def test_extending_a_committed_run_keeps_its_steps(tmp_path, capsys):
    """compare.py extends a run whose lines were gzipped with train.py --resume. train.py keeps the lines up to its
    checkpoint and appends to a plain metrics.jsonl, which hides the .gz: compare.py first gives the run its plain
    file back, so steps 0..4 stay beside the new 5..6. Without that (the control) only 5..6 would be left."""
    import train
    from config import Config

    class A:
        runs_dir, max_steps, nproc, reward = str(tmp_path), 6, 1, None

    for name in ("clip-d0.05-s0", "control"):
        _run(tmp_path / name, 4, gz=True)
        (tmp_path / name / "checkpoints" / "step_000004").mkdir(parents=True)   # a checkpoint kept beside it
    run, plain = str(tmp_path / "clip-d0.05-s0"), str(tmp_path / "clip-d0.05-s0" / "metrics.jsonl")
    assert compare.train_cmd(A, "clip", 0.05, 0, [], port=29601)[-4:] == ["--resume", run, "--max-steps", "6"]
    assert os.path.isfile(plain) and read_jsonl(plain) == _rows(4)   # the plain file, back line for line
    assert "has no checkpoint" not in capsys.readouterr().out
    for d in (run, str(tmp_path / "control")):   # train.py at its checkpoint's step 4, writing steps 5 and 6
        log, _ = train.open_run(Config(out_dir=d), 4)
        with log:
            log.writelines(json.dumps(r) + "\n" for r in _rows(6)[5:])
    assert read_jsonl(plain) == _rows(6) and compare.finished(run, 6)
    assert [r["step"] for r in read_jsonl(str(tmp_path / "control" / "metrics.jsonl"))] == [5, 6]
    compress_results.compress(plain)   # the longer run replaces the committed .gz
    assert jsonl_path(plain) == plain + ".gz" and read_jsonl(plain) == _rows(6)


def test_a_committed_run_without_a_checkpoint_is_said_to_train_again(tmp_path, capsys):
    class A:
        runs_dir, max_steps, nproc, reward = str(tmp_path), 6, 1, None

    run = tmp_path / "clip-d0.05-s0"
    _run(run, 4, gz=True)
    assert compare.train_cmd(A, "clip", 0.05, 0, [], port=29601)[-3] == str(run)
    assert "has no checkpoint; train.py trains it again from step 0" in capsys.readouterr().out
    # no plain file: train.py writes a new one from step 0 (keeping none of the old lines), the .gz stays until then
    assert sorted(os.listdir(run)) == ["config.json", "metrics.jsonl.gz"]


def test_committed_table_reissues_from_the_compressed_runs(tmp_path):
    """horizon.md of the coin-reward run at real scale (2 seeds x 3 arms x 10 steps), from its committed
    metrics.jsonl.gz files, is the committed horizon.md byte for byte."""
    results = os.path.join(ROOT, "experiments", "results", "real-scale-random")
    if not os.path.isdir(os.path.join(results, "runs")):
        pytest.skip("experiments/results/real-scale-random/runs is not in this tree")
    runs = tmp_path / "runs"
    shutil.copytree(os.path.join(results, "runs"), runs)   # the readers must not need write access
    assert not list(runs.glob("*/metrics.jsonl")) and len(list(runs.glob("*/metrics.jsonl.gz"))) == 6
    out = subprocess.run([sys.executable, "experiments/horizon.py", str(runs), "--results", str(tmp_path / "res"),
                          "--figure", str(tmp_path / "h.png")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert filecmp.cmp(tmp_path / "res" / "horizon.md", os.path.join(results, "horizon.md"), shallow=False)


def test_read_appended_leaves_out_a_line_cut_short(tmp_path):
    """A file whose writer was stopped mid-line: two whole lines, then 12 characters of a third without its newline.
    The reader gives the two; a broken line before the last is an error, not skipped."""
    from machinery.jsonl import read_appended
    f = tmp_path / "s0.jsonl"
    f.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    assert read_appended(str(f)) == [{"a": 1}, {"a": 2}]
    f.write_text('{"a": 1}\n{"a": 2}\n')
    assert read_appended(str(f)) == [{"a": 1}, {"a": 2}]
    f.write_text('{"a": 1\n{"a": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_appended(str(f))
    f.write_text("")
    assert read_appended(str(f)) == []

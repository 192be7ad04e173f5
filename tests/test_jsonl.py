"""Committed run outputs travel gzipped (machinery/jsonl.py, scripts/compress_results.py): every reader of a run gives
the same answer from NAME.jsonl.gz as from NAME.jsonl, and refuses a plain file beside a .gz that does not continue
it; the compressor keeps every line, keeps a .gz that holds the same lines, refuses to replace one with fewer or
other lines and leaves unfinished runs alone; a committed run that train.py resumes keeps its steps, and one it
would rewrite is refused; and a committed verdict table re-issues unchanged from the committed compressed runs."""
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
        json.dump({"prompts_per_step": 4, "mini_batch_prompts": 4, "group_size": 8, "max_steps": max_steps or n_steps},
                  f)
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


def test_compress_keeps_every_line_in_a_header_without_name_or_time(tmp_path):
    """The .gz reads back, through the real `gzip` program, as the plain file's bytes; its header holds no file name
    and mtime 0, so the file's name and time never reach the bytes."""
    lines = "".join(json.dumps(r) + "\n" for r in _rows(30))
    path = tmp_path / "pairs.jsonl"
    path.write_text(lines)
    os.utime(path, (2e9, 2e9))
    compress_results.compress(str(path))
    assert not path.exists()
    gz = (tmp_path / "pairs.jsonl.gz").read_bytes()
    # RFC 1952 header: magic 1f 8b, method 8 (deflate), no flags (so no file name), mtime 0, XFL 2 (level 9)
    assert gz[:9] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02"
    if shutil.which("gzip"):
        assert subprocess.run(["gzip", "-dc"], input=gz, capture_output=True, check=True).stdout == lines.encode()
    assert gzip.decompress(gz).decode() == lines


@pytest.mark.skipif(shutil.which("gzip") is None, reason="needs the gzip program")
def test_a_rerun_keeps_a_gz_with_the_same_lines_byte_for_byte(tmp_path):
    """Most committed .gz files were written by GNU `gzip -n -9`, whose header (OS byte) and deflate stream differ
    from zlib's: compressing the same lines again leaves such a .gz as it is (a re-run changes nothing in git) and
    removes the plain file."""
    lines = "".join(json.dumps(r) + "\n" for r in _rows(30)).encode()
    path = tmp_path / "metrics.jsonl"
    committed = subprocess.run(["gzip", "-n", "-9", "-c"], input=lines, capture_output=True, check=True).stdout
    assert committed != compress_results.gzip_bytes(lines)   # else this test could not tell
    (tmp_path / "metrics.jsonl.gz").write_bytes(committed)
    path.write_bytes(lines)
    assert "kept" in compress_results.compress(str(path))
    assert (tmp_path / "metrics.jsonl.gz").read_bytes() == committed and not path.exists()


@pytest.mark.parametrize("plain, why", [(_rows(3), "it holds 4 of 5 lines"),
                                        ([*_rows(1), {"step": 2, "reward/mean": 0.0}, *_rows(5)[3:]],
                                         "line 3 differs")], ids=["fewer", "other"])
def test_compress_refuses_to_replace_a_gz_with_fewer_or_other_lines(tmp_path, monkeypatch, capsys, plain, why):
    """A plain metrics.jsonl beside a .gz of steps 0..4: with steps 0..3 only, or with another step 2, it would lose
    lines of the .gz. The command refuses with one line naming it and exit code 2, before writing anything (another
    finished run in the same folder stays plain); the function raises the same line. The readers refuse the pair."""
    gz_run = tmp_path / "res" / "clip-d0.05-s0"
    _run(gz_run, 4, gz=True)
    (gz_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    (gz_run / "config.json").write_text(json.dumps({"max_steps": len(plain) - 1}))   # finished, as it says
    other = _run(tmp_path / "res" / "clip-d0.05-s1", 4)
    before = {p: p.read_bytes() for p in (tmp_path / "res").rglob("*") if p.is_file()}
    monkeypatch.setattr(sys, "argv", ["compress_results.py", str(tmp_path / "res")])
    assert compress_results.main() == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"{gz_run / 'metrics.jsonl'} does not continue" in err[0] and why in err[0], err
    assert {p: p.read_bytes() for p in (tmp_path / "res").rglob("*") if p.is_file()} == before
    assert os.path.isfile(other)
    with pytest.raises(ValueError, match=why):
        compress_results.compress(str(gz_run / "metrics.jsonl"))
    with pytest.raises(ValueError, match="does not continue"):
        read_jsonl(str(gz_run / "metrics.jsonl"))


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


def test_resuming_a_committed_run_keeps_its_steps(tmp_path, capsys):
    """A run whose lines were gzipped (its plain file gone) resumed by train.py from its checkpoint at step 4: the
    plain metrics.jsonl it appends to begins with the .gz's steps 0..4, so every reader sees 0..6, and compressing
    it replaces the .gz with the longer run. The same through compare.py, which also hands train.py the run."""
    import train
    from config import Config

    class A:
        runs_dir, max_steps, nproc, reward = str(tmp_path), 6, 1, None

    for name in ("clip-d0.05-s0", "clip-d0.05-s1"):
        _run(tmp_path / name, 4, gz=True)
        (tmp_path / name / "checkpoints" / "step_000004").mkdir(parents=True)   # a checkpoint kept beside it
    run = str(tmp_path / "clip-d0.05-s0")
    assert compare.train_cmd(A, "clip", 0.05, 0, [], port=29601)[-4:] == ["--resume", run, "--max-steps", "6"]
    for d in (run, str(tmp_path / "clip-d0.05-s1")):   # train.py at its checkpoint's step 4, writing steps 5 and 6
        plain = os.path.join(d, "metrics.jsonl")
        log, _ = train.open_run(Config(out_dir=d), 4)
        with log:
            log.writelines(json.dumps(r) + "\n" for r in _rows(6)[5:])
        assert read_jsonl(plain) == _rows(6) and compare.finished(d, 6)
        compress_results.compress(plain)   # the longer run replaces the committed .gz
        assert jsonl_path(plain) == plain + ".gz" and read_jsonl(plain) == _rows(6)


def test_a_resume_that_would_rewrite_committed_steps_is_refused(tmp_path, capsys):
    """A committed run of steps 0..4 with no checkpoint (or one at step 2) would start over (or at step 3) and write
    steps its .gz holds again, with other numbers: train.py refuses with one line naming the .gz and exit code 2
    before anything is loaded or written, and so does compare.py, which would hand it the run."""
    import train
    from machinery.jsonl import resumed_lines

    class A:
        runs_dir, max_steps, nproc, reward = str(tmp_path), 6, 1, None

    run = tmp_path / "clip-d0.05-s0"
    _run(run, 4, gz=True)
    with pytest.raises(SystemExit, match="has no checkpoint to continue its metrics.jsonl.gz from"):
        compare.train_cmd(A, "clip", 0.05, 0, [], port=29601)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(run), "--max-steps", "6"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and "metrics.jsonl.gz holds steps to 4" in err[0], err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="would write steps 3..4 again"):
        resumed_lines(str(run / "metrics.jsonl"), 2)
    assert [json.loads(x)["step"] for x in resumed_lines(str(run / "metrics.jsonl"), 4)] == [0, 1, 2, 3, 4]


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

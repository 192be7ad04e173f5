"""experiments/horizon.py and compare.py's run bookkeeping on hand-built metrics.jsonl files (hand-computed answers).

A delay's interval is the 95% t interval, mean ± t(0.975, n - 1) x sd / sqrt(n), t(0.975, 2) = 4.303 (a table)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import compare  # noqa: E402
import horizon  # noqa: E402


def test_trailing_mean_by_hand():
    pts = [(1, 4.0), (2, 2.0), (3, 0.0), (4, 6.0)]
    assert horizon.trailing_mean(pts, window=2) == [(1, 4.0), (2, 3.0), (3, 1.0), (4, 3.0)]
    assert horizon.trailing_mean(pts, window=3) == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 8.0 / 3.0)]


def test_half_entropy_step_uses_the_trailing_mean_not_one_noisy_step():
    # start 0.2: half is 0.1. Step 3 dips to 0.09 alone, but the 2-step mean there is (0.15 + 0.09) / 2 = 0.12;
    # then (0.09 + 0.15) / 2 = 0.12 at step 4; the first 2-step mean <= 0.1 is at step 5: (0.15 + 0.04) / 2.
    ent = [(1, 0.2), (2, 0.15), (3, 0.09), (4, 0.15), (5, 0.04), (6, 0.05)]
    assert horizon.half_entropy_step(ent, window=2) == 5
    assert horizon.half_entropy_step(ent, window=1) == 3
    assert horizon.half_entropy_step([(1, 0.2), (2, 0.11), (3, 0.101)], window=1) is None
    assert horizon.half_entropy_step([], window=1) is None


def test_half_step_cell():
    assert horizon.half_step_cell([100, 140, None], 300) == "120 ± 28 (2/3)"   # std of {100, 140} = 28.28
    assert horizon.half_step_cell([None, None], 300) == "not reached by 300 (0/2)"


def test_delay_is_paired_by_seed_not_by_position():
    # Band-KL's seed 1 is missing: pairing by position would compare its seed 2 (step 90) with GRPO's seed 1 (60)
    table = {("clip", 0.05): [{"seed": "0", "half_entropy_step": 50}, {"seed": "1", "half_entropy_step": 60},
                              {"seed": "2", "half_entropy_step": 90}],
             ("bandkl", 0.05): [{"seed": "0", "half_entropy_step": 50}, {"seed": "2", "half_entropy_step": 90}]}
    assert "delay +0 ± 0 (95% t interval, n = 2) steps" in horizon.entropy_collapse_verdicts(table, 300)[1]


@pytest.mark.parametrize("clip_steps, band_steps, a, b", [
    # delays 251, 241, 231: mean 241, sd 10, half 4.303 x 10 / sqrt(3) = 24.8: >= 15 (a quarter of 60), above 0
    ([50, 60, 70], [None, None, None], "reproduced", "reproduced"),
    # delays 0, 2, -1: mean 0.33, sd 1.53, half 3.8: the interval ends at 4.1 < 15
    ([50, 60, 70], [50, 62, 69], "reproduced", "not reproduced"),
    # delays -10, 0, -40: mean -16.7, sd 20.8, half 51.7: ends at 35 > 15 (two s.e., 24, said "not reproduced")
    ([50, 60, 70], [40, 60, 30], "reproduced", "not distinguishable"),
    # delays 30, -10, 231: mean 83.7, half 321
    ([50, 60, 70], [80, 50, None], "reproduced", "not distinguishable"),
    # one seed: no interval
    ([77], [86], "inconclusive (n = 1)", "inconclusive (n = 1)"),
    ([None, None, None], [None, None, None], "not reproduced", "not distinguishable"),
    # delays 251, 0, 0: mean 83.7, half 360
    ([50, None, None], [None, None, None], "not distinguishable", "not distinguishable"),
])
def test_entropy_collapse_verdict_rules(clip_steps, band_steps, a, b):
    table = {("clip", 0.05): [{"half_entropy_step": s} for s in clip_steps],
             ("bandkl", 0.05): [{"half_entropy_step": s} for s in band_steps]}
    va, vb = horizon.entropy_collapse_verdicts(table, 300)
    assert va.startswith("(2a)") and f"**{a}" in va
    assert vb.startswith("(2b)") and f"**{b}" in vb


def test_collapse_verdict_states_its_sizes():
    # GRPO's final entropy 0.05 of a 0.20 start (0.25); the material delay a quarter of mean(50, 60, 70) = 15 steps
    table = {("clip", 0.05): [{"half_entropy_step": s, "entropy": 0.05, "entropy_start": 0.2} for s in (50, 60, 70)],
             ("bandkl", 0.05): [{"half_entropy_step": s} for s in (50, 62, 69)]}
    va, vb = horizon.entropy_collapse_verdicts(table, 300)
    assert "final entropy (last 10 steps) 0.25 of the start" in va
    assert "(by >= a quarter of GRPO's half-entropy step, 15 steps): **not reproduced**" in vb
    assert "delay +0 ± 4 (95% t interval, n = 3) steps" in vb   # 0.33 ± 3.79


def _write_run(path, n_steps, entropy, eval_every, method_bounds, reward=None):
    os.makedirs(path)
    if reward:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"prompts_per_step": 4, "group_size": 8, "reward": reward}, f)
    lo, hi = method_bounds
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step in range(1, n_steps + 1):
            row = {"step": step, "entropy": entropy(step), "clip/frac": 0.01, "clip/frac_upper": 0.005,
                   "clip/low_p_upper_rate": 0.02, "band/lower_mean": lo, "band/upper_mean": hi,
                   "band/out_upper_frac": 0.03, "band/out_lower_frac": 0.04, "reward/mean": 0.5}
            for b in horizon.BINS:
                row[f"band/out_upper_frac_p{b}"], row[f"band/out_lower_frac_p{b}"] = 0.1, 0.2
                row[f"clip/frac_p{b}"] = 0.05 if lo > 0 else 0.0
            if step % eval_every == 0:
                row.update({"eval/t/mean@4": step / 100, "eval/t/pass@1": step / 100, "eval/t/pass@4": step / 50})
            f.write(json.dumps(row) + "\n")


def test_horizon_cli_on_hand_built_runs(tmp_path):
    runs = tmp_path / "runs"
    for seed in range(2):
        # clip: entropy 0.2 halves linearly by step 11 (0.2 - 0.01 (t - 1)); band stays at 0.2
        _write_run(runs / f"clip-d0.05-s{seed}", 20, lambda t: 0.2 - 0.01 * (t - 1), 5, (0.8, 1.2))
        _write_run(runs / f"bandkl-d0.05-s{seed}", 20, lambda t: 0.2, 5, (0.7, 2.0))
    out = subprocess.run([sys.executable, "experiments/horizon.py", str(runs), "--results", str(tmp_path / "res"),
                          "--figure", str(tmp_path / "h.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = json.load(open(tmp_path / "res" / "horizon.json"))
    clip, band = table["clip|0.05"][0], table["bandkl|0.05"][0]
    # trailing 10-step mean of 0.2 - 0.01 (t - 1) at step t >= 10 is 0.2 - 0.01 (t - 5.5); <= 0.1 first at t = 16
    assert clip["half_entropy_step"] == 16 and band["half_entropy_step"] is None
    assert clip["band/width"] == pytest.approx(0.4) and band["band/width"] == pytest.approx(1.3)
    assert clip["mean@n"] == pytest.approx((0.10 + 0.15 + 0.20) / 3)            # the last 3 evaluations
    assert clip["pass@n"] == pytest.approx((0.2 + 0.3 + 0.4) / 3)               # pass@4, the largest k
    assert clip["mean@n_start"] == pytest.approx(0.05)
    # the trajectory table: milestones 3, 7, 10, 13, 17, 20 of 20; the evaluations at 10 and 20 fall on two of them
    assert clip["entropy_at"]["20"] == pytest.approx(0.2 - 0.01 * (20 - 5.5)) and set(clip["mean@n_at"]) == {"10", "20"}
    md = (tmp_path / "res" / "horizon.md").read_text()
    assert "16 ± 0 (2/2)" in md and "not reached by 20 (0/2)" in md and "(2a)" in md
    # the bins table: above / below the band / clipped, per bin
    assert "| clip | 0.1000 / 0.2000 / 0.0500 |" in md
    # the verdicts' windows: the last 5 steps of 0.2 - 0.01 (t - 1) are 0.05 .. 0.01, mean 0.03; the last 10, 0.055
    assert clip["entropy@5"] == pytest.approx(0.03) and clip["entropy@10"] == pytest.approx(0.055)
    assert (tmp_path / "h.png").stat().st_size > 0 and (tmp_path / "h_bins.png").stat().st_size > 0


def test_horizon_one_seed_gives_no_verdict_and_seeds_filter(tmp_path):
    for seed, end in ((0, 20), (1, 12)):   # seed 1 unfinished: --seeds 0 leaves it out
        _write_run(tmp_path / f"clip-d0.05-s{seed}", end, lambda t: 0.2 - 0.01 * t, 5, (0.8, 1.2))
        _write_run(tmp_path / f"bandkl-d0.05-s{seed}", end, lambda t: 0.2, 5, (0.7, 2.0))
    out = subprocess.run([sys.executable, "experiments/horizon.py", str(tmp_path), "--seeds", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 seeds x 20 steps" in out.stdout and "no verdicts" in out.stdout and "**" not in out.stdout


def test_compare_one_seed_gives_no_verdict_two_seeds_do(tmp_path):
    """compare.py files no verdict from one seed (as horizon.py): with one there is no spread to weigh against."""
    for seed in range(2):
        _write_run(tmp_path / f"clip-d0.05-s{seed}", 20, lambda t: 0.2 - 0.01 * t, 5, (0.8, 1.2))
        _write_run(tmp_path / f"bandkl-d0.05-s{seed}", 20, lambda t: 0.2, 5, (0.7, 2.0))
    for seeds, verdict in (("0", False), ("0,1", True)):
        out = subprocess.run([sys.executable, "experiments/compare.py", "--plot-only", "--methods", "clip,bandkl",
                              "--bandkl-deltas", "", "--seeds", seeds, "--max-steps", "20", "--runs-dir",
                              str(tmp_path), "--results", str(tmp_path / "res"), "--figure", str(tmp_path / "c.png")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        md = (tmp_path / "res" / "compare.md").read_text()
        assert ("no verdicts" not in md and "**" in md) if verdict else ("no verdicts" in md and "**" not in md)


def test_horizon_refuses_unfinished_runs(tmp_path):
    _write_run(tmp_path / "clip-d0.05-s0", 20, lambda t: 0.2, 5, (0.8, 1.2))
    _write_run(tmp_path / "clip-d0.05-s1", 12, lambda t: 0.2, 5, (0.8, 1.2))
    out = subprocess.run([sys.executable, "experiments/horizon.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "different steps [12, 20]" in out.stderr


def test_compare_train_cmd_starts_resumes_and_skips(tmp_path):
    class A:
        runs_dir, max_steps, nproc, reward = str(tmp_path), 10, 1, None
    cmd = compare.train_cmd(A, "clip", 0.05, 3, ["--lr", "3e-4"], port=29601)
    assert cmd[-5:] == ["--out-dir", str(tmp_path / "clip-d0.05-s3"), "--no-export-hf", "--lr", "3e-4"]
    A.reward = "random"   # --reward goes before the flags after `--`, which win where they repeat it
    cmd = compare.train_cmd(A, "clip", 0.05, 3, ["--reward", "random:0.3"], port=29601)
    assert cmd[-5:] == ["--no-export-hf", "--reward", "random", "--reward", "random:0.3"]
    assert " --method clip --delta 0.05 --seed 3 --max-steps 10 " in " ".join(cmd) and "29601" in cmd
    run = tmp_path / "clip-d0.05-s3"
    run.mkdir()
    (run / "config.json").write_text('{"reward": "random"}')
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    assert compare.train_cmd(A, "clip", 0.05, 3, [], port=29601)[-4:] == ["--resume", str(run), "--max-steps", "10"]
    A.reward = "math-verify"   # a resume keeps the run's own reward: another is refused, naming both
    with pytest.raises(SystemExit, match="was trained with --reward 'random', not 'math-verify'"):
        compare.train_cmd(A, "clip", 0.05, 3, [], port=29601)
    A.reward = None
    (run / "metrics.jsonl").write_text('{"step": 4}\n{"step": 10}\n')
    assert compare.train_cmd(A, "clip", 0.05, 3, [], port=29601) is None


@pytest.mark.parametrize("reading, label", [
    (None, "not distinguishable"),               # the delay rule alone: delays -10, 0, -40 (see above)
    ("supports", "not distinguishable"),         # the regime can test the claim: the delay rule's label stays
    ("supports the direction, not the size", "not distinguishable"),
    ("does not reproduce", "not distinguishable"),
    ("not testable in this regime", "not testable in this regime (see (2))"),
    ("no no-clip arm", "no no-clip arm (see (2))"),
    ("inconclusive (window-dependent)", "inconclusive (window-dependent) (see (2))"),
])
def test_delay_verdict_defers_to_the_control(reading, label):
    table = {("clip", 0.05): [{"half_entropy_step": s} for s in (50, 60, 70)],
             ("bandkl", 0.05): [{"half_entropy_step": s} for s in (40, 60, 30)]}
    vb = horizon.entropy_collapse_verdicts(table, 300, reading)[1]
    # delays -10, 0, -40: mean -16.7, sd 20.8, half 4.303 x 20.8 / sqrt(3) = 51.7
    assert f"**{label}" in vb and "delay -17 ± 52 (95% t interval, n = 3) steps" in vb


def _horizon(tmp_path, *extra):
    return subprocess.run([sys.executable, "experiments/horizon.py", str(tmp_path), "--results",
                           str(tmp_path / "res"), "--figure", str(tmp_path / "h.png"), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_horizon_cli_with_a_noclip_arm(tmp_path):
    # no-clip's entropy equals GRPO's in both seeds: paired difference 0 ± 0, below the margin -> "not testable in
    # this regime"; the hand-built runs carry no batch shape, so GRPO's clips are not counted and the rate (0.02) is
    # named instead
    for seed in range(2):
        for method, lo_hi in (("bandkl", (0.7, 2.0)), ("noclip", (0.0, 10.0)), ("clip", (0.8, 1.2))):
            ent = (lambda t: 0.2) if method == "bandkl" else (lambda t: 0.2 - 0.01 * (t - 1))
            _write_run(tmp_path / f"{method}-d0.05-s{seed}", 20, ent, 5, lo_hi)
    out = _horizon(tmp_path)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "res" / "horizon.md").read_text()
    rows = [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ") and "entropy" not in line]
    assert rows[:3] == ["| clip", "| noclip", "| bandkl δ=0.05"]   # the control beside GRPO
    # margins: 10% of GRPO's last-5-step entropy 0.03 and of its last-10-step entropy 0.055
    assert ("is 0.0200): **not counted**; no-clip minus GRPO final entropy, last 5 steps: +0.000 ± 0.000 (95% t "
            "interval, n = 2) against +0.003: **not above GRPO by more than the margin**") in md
    assert "**not testable in this regime (see (2))**" in md and "(2) BandPO keeps entropy" in md
    assert (tmp_path / "h_noclip.png").stat().st_size > 0 and (tmp_path / "h_bins.png").stat().st_size > 0


def test_horizon_cli_random_regime(tmp_path):
    # coins: GRPO's entropy 0.1 at every step, no-clip's 0.2, Band-KL's 0.15 (f = 0.5), in both seeds: the clip
    # lowers the entropy by 0.1 (sd 0: the interval is the point); (2a) and (2b) do not apply
    for seed in range(2):
        for method, ent in (("clip", 0.1), ("noclip", 0.2), ("bandkl", 0.15)):
            _write_run(tmp_path / f"{method}-d0.05-s{seed}", 20, lambda t, e=ent: e, 5, (0.8, 1.2), reward="random")
    out = _horizon(tmp_path)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "res" / "horizon.md").read_text()
    assert "Training rewards: coins (--reward random)." in md and "(2a)" not in md.split("- (1), (2a)")[1]
    assert "**the clip lowers the entropy** (all 20 steps: -0.100 ± 0.000 (95% t interval, n = 2)" in md
    assert "(R) bandkl δ=0.05: the fraction of the clip's drift it removes" in md
    assert "f = 0.50, 95% Fieller interval [0.50, 0.50] (n = 2), margin ±0.25" in md
    assert (tmp_path / "h_noclip.png").stat().st_size > 0
    # one run on another reward: refused, naming both
    _write_run(tmp_path / "clip-d0.05-s2", 20, lambda t: 0.1, 5, (0.8, 1.2), reward="random:0.3")
    out = _horizon(tmp_path)
    assert out.returncode == 1 and out.stderr.strip() == (
        "horizon.py: error: the runs mix training rewards ['random', 'random:0.3']; a comparison needs one --reward")


def test_horizon_from_json(tmp_path):
    """--from-json re-issues horizon.md from the committed summaries: horizon.json's last-10-step entropy and
    compare.json's last-5-step one, paired by position."""
    runs = tmp_path / "runs"
    for seed in range(3):
        _write_run(runs / f"clip-d0.05-s{seed}", 20, lambda t, s=seed: 0.1 + 0.01 * s, 5, (0.8, 1.2))
        _write_run(runs / f"bandkl-d0.05-s{seed}", 20, lambda t, s=seed: 0.1 + 0.01 * s, 5, (0.7, 2.0))
    assert _horizon(runs).returncode == 0
    res = runs / "res"
    h = json.load(open(res / "horizon.json"))
    for rows in h.values():   # an older summary: no windowed keys
        for x in rows:
            for k in [k for k in x if "@" in k and k.split("@")[0] in ("entropy", "clip/low_p_upper_rate")]:
                del x[k]
    (res / "horizon.json").write_text(json.dumps(h))
    # compare.json's last-5-step entropy: Band-KL 0.02 above GRPO in every seed
    c = {k: [{"entropy": x["entropy"] + (0.02 if k.startswith("bandkl") else 0), "clip/low_p_upper_rate": 0.02}
             for x in rows] for k, rows in h.items()}
    (res / "compare.json").write_text(json.dumps(c))
    before = (res / "horizon.md").read_text()
    out = subprocess.run([sys.executable, "experiments/horizon.py", "--from-json", "--results", str(res)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    md = (res / "horizon.md").read_text()
    assert md.split("\n- ")[0] == before.split("\n- ")[0]   # the same tables
    # no no-clip arm; Band-KL minus GRPO: +0.020 at 5 steps, +0.000 at 10
    assert "last 5 steps: final entropy GRPO 0.110, Band-KL minus GRPO +0.020 ± 0.000" in md
    assert "last 10 steps: final entropy GRPO 0.110, Band-KL minus GRPO +0.000 ± 0.000" in md
    assert "(2a) GRPO's entropy collapses" in md

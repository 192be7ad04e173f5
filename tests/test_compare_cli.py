"""experiments/compare.py's command line on hand-built runs (metrics.jsonl and config.json written here): the clip
counts rebuilt from the logged rates, the verdicts of a comparison with a no-clip arm and of coin rewards, mixed
reward regimes refused, compare.md re-issued from compare.json with both windows, one seed's manipulation check,
and a dash for what no run measured. The verdict rules themselves are checked in test_compare.py.
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import compare  # noqa: E402
import verdicts  # noqa: E402
from test_compare import CLIP, arm, plus, table  # noqa: E402


def _write(run_dir, steps, eval_rows=(), cfg=True, reward=None):
    os.makedirs(run_dir)
    if cfg:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump({"prompts_per_step": 4, "group_size": 8, **({"reward": reward} if reward else {})}, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for row in list(eval_rows) + steps:
            f.write(json.dumps(row) + "\n")


def _step(step, frac, upper, length, share, entropy=0.2, rate=0.01):
    return {"step": step, "clip/frac": frac, "clip/frac_upper": upper, "response_length/mean": length,
            "clip/low_p_share_of_upper": share, "entropy": entropy, "clip/low_p_upper_rate": rate,
            "reward/mean": 0.5}


def test_clip_counts_rebuilt_from_rates(tmp_path):
    # 4 x 8 = 32 completions per step. Step 2: 10 tokens each -> 320 tokens, 2.5% clipped upward -> 8, half of
    # them p < 0.2 -> 4. Step 3: 5 tokens -> 160, 1.25% -> 2, all p < 0.2 -> 2. Totals 10 and 6; first clip at 2.
    steps = [_step(1, 0.0, 0.0, 12, 0.0), _step(2, 0.03, 0.025, 10, 0.5), _step(3, 0.02, 0.0125, 5, 1.0)]
    _write(str(tmp_path / "a"), steps, eval_rows=[{"step": 0, "eval/t/mean@4": 0.3}])
    assert compare.clip_counts(str(tmp_path / "a")) == {"steps": 3, "clip/n_upper": 10, "clip/n_low_p_upper": 6,
                                                        "clip/first_step": 2}
    _write(str(tmp_path / "b"), steps, cfg=False)   # no batch shape: no counts
    assert compare.clip_counts(str(tmp_path / "b")) == {"steps": 3, "clip/n_upper": None, "clip/n_low_p_upper": None,
                                                        "clip/first_step": 2}


def _write_arm(root, method, seed, entropy, clips_per_step, reward=None):
    # 20 steps of 32 x 10 = 320 tokens; `clips_per_step` p < 0.2 upward clips a step (all upward clips are p < 0.2)
    steps = [_step(t, clips_per_step / 320, clips_per_step / 320, 10, 1.0, entropy=entropy) for t in range(1, 21)]
    evals = [{"step": t, "eval/t/mean@4": 0.3 + t / 100, "eval/t/pass@4": 0.5} for t in (0, 10, 20)]
    _write(str(root / f"{method}-d0.05-s{seed}"), steps[:10] + [evals[1]] + steps[10:] + [evals[2]], [evals[0]],
           reward=reward)


def _compare(tmp_path, seeds, *extra):
    return subprocess.run([sys.executable, "experiments/compare.py", "--plot-only", "--methods", "clip,noclip,bandkl",
                           "--bandkl-deltas", "", "--seeds", seeds, "--max-steps", "20", "--runs-dir", str(tmp_path),
                           "--results", str(tmp_path / "res"), "--figure", str(tmp_path / "c.png"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("seeds", ["0", "0,1,2"])
def test_compare_cli_with_a_noclip_arm(tmp_path, seeds):
    # GRPO's entropy 0.10 + 0.01 seed, no-clip 0.40 + 0.02 seed, Band-KL 0.40 + 0.02 seed + 0.001 (seed 1: -0.001);
    # GRPO clips 2 p < 0.2 tokens a step (40 per run). No-clip minus GRPO 0.30, 0.31, 0.32: mean 0.31, half 0.0248:
    # above. Band-KL minus no-clip +0.001, -0.001, +0.001: mean 0.00033, half 4.303 x 0.00067 = 0.0029, inside
    # ±0.011 (10% of 0.11); Band-KL / GRPO 0.42033 / 0.11 = 3.82: supports, at both windows (constant entropy)
    for seed in (0, 1, 2):
        _write_arm(tmp_path, "clip", seed, 0.10 + 0.01 * seed, 2)
        _write_arm(tmp_path, "noclip", seed, 0.40 + 0.02 * seed, 0)
        _write_arm(tmp_path, "bandkl", seed, 0.40 + 0.02 * seed + (0.001 if seed != 1 else -0.001), 0)
    out = _compare(tmp_path, seeds)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "res" / "compare.md").read_text()
    assert "| noclip | – |" in md
    runs = json.load(open(tmp_path / "res" / "compare.json"))
    assert [x["clip/n_low_p_upper"] for x in runs["clip|0.05"]] == [40] * len(seeds.split(","))
    assert runs["noclip|0.05"][0]["clip/n_low_p_upper"] == 0 and runs["clip|0.05"][0]["clip/first_step"] == 1
    assert runs["clip|0.05"][0]["mean@n_start"] == pytest.approx(0.30) and runs["clip|0.05"][0]["seed"] == "0"
    assert runs["clip|0.05"][0]["entropy@10"] == pytest.approx(0.10) and runs["clip|0.05"][0]["reward"] == "math-verify"
    if seeds == "0":
        assert "no verdicts" in md and "**" not in md
    else:
        assert "40.0 p < 0.2 tokens upward per run (40–40 over 3 seeds, 2.00 per step" in md
        assert "last 5 steps: +0.310 ± 0.025 (95% t interval, n = 3) against +0.011: **above GRPO**" in md
        assert "**supports** (last 5 steps: no-clip above GRPO, Band-KL within the margin" in md
        assert "Band-KL / GRPO 3.82" in md


def test_compare_cli_random_regime_and_mixed_rewards(tmp_path):
    # coins: GRPO 0.10 + 0.01 seed, no-clip 0.15 + 0.01 seed (the clip lowers the entropy by 0.05 in every seed),
    # Band-KL 0.14 + 0.01 seed: f = 0.04 / 0.05 = 0.8 in every seed, a zero-width interval within 1 ± 0.25
    for seed in (0, 1):
        _write_arm(tmp_path, "clip", seed, 0.10 + 0.01 * seed, 2, reward="random")
        _write_arm(tmp_path, "noclip", seed, 0.15 + 0.01 * seed, 0, reward="random")
        _write_arm(tmp_path, "bandkl", seed, 0.14 + 0.01 * seed, 0, reward="random")
    out = _compare(tmp_path, "0,1")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "res" / "compare.md").read_text()
    assert "Training rewards: coins (--reward random)." in md and "(1) BandPO beats" not in md
    # 20-step runs: the "last 60 steps" window is every step, and named so
    assert "**the clip lowers the entropy** (all 20 steps: -0.050 ± 0.000 (95% t interval, n = 2)" in md
    assert ("**removes the clip's drift (as no-clip, within ±0.25)** (all 20 steps: f = 0.80, 95% Fieller interval "
            "[0.80, 0.80] (n = 2)") in md
    assert "Change from the start entropy (step 1) to all 20 steps, per arm" in md
    assert "entropy read over two windows (all 20 steps; the last half of the steps)" in md.splitlines()[0]
    _write_arm(tmp_path, "clip", 2, 0.1, 2, reward="math-verify")
    _write_arm(tmp_path, "noclip", 2, 0.1, 0, reward="random")
    _write_arm(tmp_path, "bandkl", 2, 0.1, 0, reward="random")
    out = _compare(tmp_path, "0,1,2")
    assert out.returncode == 1
    assert out.stderr.strip() == ("compare.py: error: the runs mix training rewards ['math-verify', 'random']; "
                                  "a comparison needs one --reward")


def test_compare_from_json_reads_both_windows(tmp_path):
    # compare.json holds the last-5-step numbers, horizon.json the last-10-step ones (same seeds, in order): the
    # re-issue reads no-clip minus GRPO at both. 5 steps: +0.004, -0.002, +0.001 (not testable); 10 steps: +0.04,
    # -0.01, +0.02 (underpowered): window-dependent. The upper-clip rate: horizon.json's, over all steps
    rows = lambda ent: [{"entropy": e, "mean@n": 0.4, "pass@n": 0.5, "pass_k": "pass@4", "clip/frac": 0.01,  # noqa
                         "clip/low_p_upper_rate": 0.02, "reward/mean": 0.5} for e in ent]
    res = tmp_path / "res"
    res.mkdir()
    (res / "compare.json").write_text(json.dumps({"clip|0.05": rows(CLIP), "noclip|0.05": rows(
        plus(CLIP, [0.004, -0.002, 0.001])), "bandkl|0.05": rows(CLIP)}))
    (res / "horizon.json").write_text(json.dumps({"clip|0.05": rows(CLIP), "noclip|0.05": rows(
        plus(CLIP, [0.04, -0.01, 0.02])), "bandkl|0.05": rows(CLIP)}))
    out = subprocess.run([sys.executable, "experiments/compare.py", "--from-json", "--results", str(res),
                          "--max-steps", "40"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    md = (res / "compare.md").read_text()
    assert md.startswith("3 seeds x 40 steps") and "**inconclusive (window-dependent)**" in md
    assert "(3) BandPO clips" in md and "all steps: rate 0.0200 vs 0.0200" in md
    assert "the last half of the steps: not in these numbers" in md
    assert json.load(open(res / "compare.json"))["clip|0.05"] == rows(CLIP)          # the summary is left as it was


def test_one_seed_reports_the_manipulation_check_without_a_reading():
    # GRPO: 30 upward clips of p < 0.2 tokens in 100 steps = 0.30 per step, at or above the 0.25
    # floor; no-clip 0.10 + 0.05 = 0.15 and Band-KL 0.10 - 0.02 = 0.08 final entropy vs GRPO's 0.10
    t = table(noclip=arm([0.15], clips=[0]), band=arm([0.08], clips=[0]), clip=arm([0.10], clips=[30]))
    (line,) = verdicts.one_seed_check(t)
    assert "GRPO clipped 30 p < 0.2 tokens upward in 100 steps (0.300 per step, at or above" in line
    assert "no-clip minus GRPO final entropy +0.050" in line
    assert "Band-KL δ=0.05 minus GRPO final entropy -0.020" in line
    assert "**" not in line and "no no-clip arm" not in line  # no verdict label from one seed
    one = lambda clips: verdicts.one_seed_check(table(clip=arm([0.1], clips=[clips])))  # noqa: E731
    assert "(0.250 per step, at or above the 0.25 floor)" in one(25)[0]  # the floor itself
    assert "(0.240 per step, below the 0.25 floor)" in one(24)[0]
    assert "; no no-clip arm;" in one(5)[0]
    assert one(None) == []  # without the counts (older runs) there is nothing to report
    other = arm([0.15], clips=[0])
    other[0]["seed"] = "1"
    assert "no-clip ran another seed" in verdicts.one_seed_check(table(noclip=other, clip=arm([0.1])))[0]


def test_table_shows_a_dash_for_what_no_run_measured():
    """A protocol run without held-out evaluation (--eval-every 0) has no accuracy: its cells read "–", not
    "nan ± nan"; the measured columns keep their mean ± std."""
    run = {"mean@n": math.nan, "pass@n": math.nan, "entropy": 2.5, "clip/frac": 0.01, "clip/low_p_upper_rate": 0.02,
           "reward/mean": 0.5, "reward": "random"}
    table = {("clip", 0.05): [run, dict(run, entropy=3.5)]}
    row = next(line for line in compare.markdown(table, [], 2, 12).splitlines() if line.startswith("| clip"))
    assert row.split(" | ")[2:4] == ["–", "–"]
    assert "3.000 ± 0.707" in row  # entropy: mean and sample std of 2.5 and 3.5, by hand

"""experiments/compare.py's verdicts on hand-built runs: the entropy claim read against the no-clip control arm.

Every expected label and number below is worked out by hand in the comment beside it. The rules (compare.py,
`entropy_control`): the manipulation check first (did GRPO's clip act, and does the no-clip arm's final entropy
differ from GRPO's beyond two paired s.e.), then the reading, with the guard that an arm whose held-out accuracy ends
below its start is "degenerate"; all paired by seed.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import compare  # noqa: E402

CLIP = [0.10, 0.12, 0.14]   # GRPO's final entropy in seeds 0, 1, 2


def arm(entropy, start=(0.30, 0.30, 0.30), final=(0.40, 0.40, 0.40), clips=(300, 300, 300), steps=100):
    """One method's per-seed summaries, as compare.py and horizon.py build them."""
    return [{"seed": str(i), "entropy": e, "mean@n_start": s, "mean@n": f, "clip/n_low_p_upper": c, "steps": steps,
             "clip/low_p_upper_rate": 0.02} for i, (e, s, f, c) in enumerate(zip(entropy, start, final, clips))]


def plus(base, offsets):
    return [b + o for b, o in zip(base, offsets)]


def table(noclip=None, band=None, clip=None):
    out = {("clip", 0.05): clip or arm(CLIP)}
    if noclip is not None:
        out[("noclip", 0.05)] = noclip
    out[("bandkl", 0.05)] = band or arm(CLIP)
    return out


# no-clip above GRPO: differences 0.10, 0.12, 0.11 (mean 0.11, sd 0.01, s.e. 0.0058; beyond two s.e.)
NOCLIP_ABOVE = plus(CLIP, [0.10, 0.12, 0.11])
# Band-KL near no-clip: Band-KL minus GRPO 0.12, 0.115, 0.125 (mean 0.12, s.e. 0.0029: above); minus no-clip +0.02,
# -0.005, +0.015 (mean 0.01, sd 0.0132, s.e. 0.0076: 1.3 s.e., within two)
BAND_NEAR_NOCLIP = plus(CLIP, [0.12, 0.115, 0.125])


def test_not_testable_when_noclip_matches_clip():
    # no-clip minus GRPO: +0.04, -0.01, +0.02: mean 0.0167, sd 0.0252, s.e. 0.0145; 1.1 s.e., within two
    reading, (check, line) = compare.entropy_control(table(noclip=arm(plus(CLIP, [0.04, -0.01, 0.02])),
                                                           band=arm(plus(CLIP, [0.11, 0.11, 0.11]))))
    assert reading == "not testable in this regime"
    assert "+0.017 ± 0.015 (n = 3): **does not differ beyond two s.e.**" in check
    assert "**acted**" in check
    assert "300.0 p < 0.2 tokens upward per run (300–300 over 3 seeds, 3.00 per step" in check
    assert "**not testable in this regime** (no-clip ≈ GRPO" in line


def test_supports_when_band_matches_noclip_above_clip():
    reading, (check, line) = compare.entropy_control(table(noclip=arm(NOCLIP_ABOVE), band=arm(BAND_NEAR_NOCLIP)))
    assert reading == "supports"
    assert "+0.110 ± 0.006 (n = 3): **differs beyond two s.e.**" in check
    # finals: GRPO 0.12, no-clip 0.23, Band-KL 0.24; ratio 0.24 / 0.12 = 2.00; accuracy +10 points everywhere
    assert "**supports**" in line
    assert "final entropy GRPO 0.120, no-clip 0.230, Band-KL 0.240, Band-KL / GRPO 2.00" in line
    assert "Band-KL minus GRPO +0.120 ± 0.003" in line and "Band-KL minus no-clip +0.010 ± 0.008" in line
    assert "GRPO +10.0 ± 0.0, no-clip +10.0 ± 0.0, Band-KL +10.0 ± 0.0 points" in line


def test_does_not_reproduce_when_band_matches_clip():
    # Band-KL minus GRPO: +0.02, -0.005, +0.015 (mean 0.01, s.e. 0.0076: 1.3 s.e., within two); minus no-clip:
    # -0.08, -0.125, -0.095 (mean -0.1, sd 0.0229, s.e. 0.0132: below)
    reading, (_, line) = compare.entropy_control(table(noclip=arm(NOCLIP_ABOVE),
                                                       band=arm(plus(CLIP, [0.02, -0.005, 0.015]))))
    assert reading == "does not reproduce" and "**does not reproduce** (no-clip above GRPO, Band-KL ≈ GRPO" in line
    assert "Band-KL minus GRPO +0.010 ± 0.008" in line and "Band-KL minus no-clip -0.100 ± 0.013" in line


@pytest.mark.parametrize("band_offsets, why", [
    ([0.05, 0.07, 0.06], "between GRPO and no-clip"),   # minus GRPO 0.06 ± 0.006, minus no-clip -0.05 ± 0
    ([0.0, 0.1, 0.2], "within two s.e. of both"),       # minus GRPO 0.1 ± 0.058, minus no-clip -0.01 ± 0.055
    ([0.11, 0.17, 0.14], "above no-clip"),              # minus no-clip +0.01, +0.05, +0.03: 0.03 ± 0.012
    ([-0.10, -0.12, -0.11], "Band-KL below GRPO"),      # minus GRPO -0.11 ± 0.006: "does not reproduce"
])
def test_other_combinations_get_an_honest_label(band_offsets, why):
    reading, (_, line) = compare.entropy_control(table(noclip=arm(NOCLIP_ABOVE), band=arm(plus(CLIP, band_offsets))))
    assert reading == ("does not reproduce" if why == "Band-KL below GRPO" else "inconclusive") and why in line


def test_noclip_below_clip_is_inconclusive():
    reading, (check, line) = compare.entropy_control(table(noclip=arm(plus(CLIP, [-0.05, -0.06, -0.04]))))
    assert reading == "inconclusive" and "no-clip below GRPO" in line and "-0.050 ± 0.006" in check


@pytest.mark.parametrize("band_final, reading", [
    # Band-KL's accuracy: start 30%; final 25, 28, 31% -> change -5, -2, +1: mean -2 < 0 -> degenerate
    ((0.25, 0.28, 0.31), "degenerate"),
    # final 29, 31, 33% -> -1, +1, +3: mean +1 -> not degenerate
    ((0.29, 0.31, 0.33), "supports"),
])
def test_degenerate_guard_on_band(band_final, reading):
    got, (_, line) = compare.entropy_control(table(noclip=arm(NOCLIP_ABOVE),
                                                   band=arm(BAND_NEAR_NOCLIP, final=band_final)))
    assert got == reading
    if reading == "degenerate":
        assert "Band-KL's extra entropy comes with accuracy below its start" in line
        assert "Band-KL -2.0 ± 1.7 points (below the start: Band-KL)" in line
    else:
        assert "below the start" not in line


def test_degenerate_guard_on_noclip():
    # no-clip's accuracy 30% -> 20% in every seed: -10 points; its higher entropy is not read as "more entropy"
    reading, (_, line) = compare.entropy_control(table(noclip=arm(NOCLIP_ABOVE, final=(0.2, 0.2, 0.2)),
                                                       band=arm(BAND_NEAR_NOCLIP)))
    assert reading == "degenerate" and "no-clip's extra entropy" in line
    assert "no-clip -10.0 ± 0.0, Band-KL +10.0 ± 0.0 points (below the start: no-clip)" in line


def test_no_noclip_arm():
    reading, (check, line) = compare.entropy_control(table(band=arm(BAND_NEAR_NOCLIP)))
    assert reading == "no no-clip arm" and check.endswith("**acted**; no no-clip arm")
    assert ("**no no-clip arm: cannot tell 'Band does not help' from 'the clip does not drive the entropy here'** "
            "(final entropy GRPO 0.120, Band-KL 0.240") in line
    # an older json without counts: the rate is named instead, and the reading is the same
    no_counts = table(clip=arm(CLIP, clips=(None, None, None)))
    reading, (check, _) = compare.entropy_control(no_counts)
    assert reading == "no no-clip arm" and "clip/low_p_upper_rate, is 0.0200): **not counted**" in check
    # one run without its batch shape: the runs are not counted at all, rather than counted in part
    _, (check, _) = compare.entropy_control(table(clip=arm(CLIP, clips=(300, None, 300))))
    assert "**not counted**" in check


@pytest.mark.parametrize("clips, acted", [
    ((20, 30, 10), False),     # 0.2, 0.3, 0.1 per step: mean 0.2 < 0.25
    ((25, 25, 25), True),      # exactly 0.25 per step: acted
    ((20, 25, 29), False),     # mean 0.2467
])
def test_manipulation_check_clip_did_not_act(clips, acted):
    # the supports configuration: only the clip counts decide
    reading, (check, line) = compare.entropy_control(table(clip=arm(CLIP, clips=clips), noclip=arm(NOCLIP_ABOVE),
                                                           band=arm(BAND_NEAR_NOCLIP)))
    assert reading == ("supports" if acted else "not testable in this regime")
    assert ("**acted**" in check) == acted and ("**barely acted (< 0.25 per step)**" in check) == (not acted)
    if not acted:
        assert "**not testable in this regime** (the clip barely acted" in line


def test_noclip_pairs_by_seed_and_needs_two():
    # no-clip ran seed 2 only: one pair, no spread -> inconclusive, not "differs"
    noclip = [arm(NOCLIP_ABOVE)[2]]
    reading, (check, line) = compare.entropy_control(table(noclip=noclip))
    assert reading == "inconclusive" and "fewer than two seeds" in line
    assert "+0.110 ± 0.000 (n = 1)" in check   # seed 2: 0.25 - 0.14, not seed 0's 0.20 - 0.10


def test_accuracy_verdict_uses_the_paired_standard_error():
    # Band-KL 40, 45, 50%; GRPO 38, 41, 49%: differences 2, 4, 1 -> mean 2.33, sd 1.53, paired s.e. 0.88:
    # >= 2 and > 2 s.e. -> reproduced (the unpaired s.e., sqrt(5^2/3 + 5.69^2/3) = 4.37, would not be)
    band = arm(CLIP, final=(0.40, 0.45, 0.50))
    clip = arm(CLIP, final=(0.38, 0.41, 0.49))
    line = compare.verdicts(table(band=band, clip=clip))[0]
    assert line.startswith("(1) BandPO beats clip") and "**reproduced** (difference +2.3 ± 0.9 points" in line


def _write(run_dir, steps, eval_rows=(), cfg=True):
    os.makedirs(run_dir)
    if cfg:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump({"prompts_per_step": 4, "group_size": 8}, f)
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


def _write_arm(root, method, seed, entropy, clips_per_step):
    # 20 steps of 32 x 10 = 320 tokens; `clips_per_step` p < 0.2 upward clips a step (all upward clips are p < 0.2)
    steps = [_step(t, clips_per_step / 320, clips_per_step / 320, 10, 1.0, entropy=entropy) for t in range(1, 21)]
    evals = [{"step": t, "eval/t/mean@4": 0.3 + t / 100, "eval/t/pass@4": 0.5} for t in (0, 10, 20)]
    _write(str(root / f"{method}-d0.05-s{seed}"), steps[:10] + [evals[1]] + steps[10:] + [evals[2]], [evals[0]])


@pytest.mark.parametrize("seeds", ["0", "0,1"])
def test_compare_cli_with_a_noclip_arm(tmp_path, seeds):
    # GRPO's entropy 0.10 + 0.01 seed, no-clip 0.30 + 0.02 seed, Band-KL 0.29 + 0.03 seed; GRPO clips 2 p < 0.2
    # tokens a step (40 per run). Paired: no-clip minus GRPO 0.20, 0.21 (mean 0.205, s.e. 0.005); Band-KL minus
    # GRPO 0.19, 0.21 (s.e. 0.01); Band-KL minus no-clip -0.01, 0.0 (mean -0.005, s.e. 0.005): supports.
    for seed in (0, 1):
        _write_arm(tmp_path, "clip", seed, 0.10 + 0.01 * seed, 2)
        _write_arm(tmp_path, "noclip", seed, 0.30 + 0.02 * seed, 0)
        _write_arm(tmp_path, "bandkl", seed, 0.29 + 0.03 * seed, 0)
    out = subprocess.run([sys.executable, "experiments/compare.py", "--plot-only", "--methods", "clip,noclip,bandkl",
                          "--bandkl-deltas", "", "--seeds", seeds, "--max-steps", "20", "--runs-dir", str(tmp_path),
                          "--results", str(tmp_path / "res"), "--figure", str(tmp_path / "c.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "res" / "compare.md").read_text()
    assert "| noclip | – |" in md
    runs = json.load(open(tmp_path / "res" / "compare.json"))
    assert [x["clip/n_low_p_upper"] for x in runs["clip|0.05"]] == [40] * len(seeds.split(","))
    assert runs["noclip|0.05"][0]["clip/n_low_p_upper"] == 0 and runs["clip|0.05"][0]["clip/first_step"] == 1
    assert runs["clip|0.05"][0]["mean@n_start"] == pytest.approx(0.30) and runs["clip|0.05"][0]["seed"] == "0"
    if seeds == "0":
        assert "no verdicts" in md and "**" not in md
    else:
        assert "40.0 p < 0.2 tokens upward per run (40–40 over 2 seeds, 2.00 per step" in md
        assert "+0.205 ± 0.005 (n = 2): **differs beyond two s.e.**" in md
        assert "**supports** (no-clip above GRPO, Band-KL ≈ no-clip" in md


@pytest.mark.parametrize("clips, label", [
    ((20, 30, 10), "not testable in this regime (the clip barely acted)"),   # 0.2 per step
    ((25, 25, 25), "reproduced"),                                            # 0.25 per step: the rule's label
    ((None, None, None), "reproduced"),                                      # not counted: the rule's label
])
def test_accuracy_verdict_needs_the_clip_to_act(clips, label):
    band = arm(CLIP, final=(0.40, 0.45, 0.50))
    clip = arm(CLIP, final=(0.38, 0.41, 0.49), clips=clips)
    assert f"**{label}** (difference +2.3 ± 0.9 points" in compare.verdicts(table(band=band, clip=clip))[0]


def test_one_seed_reports_the_manipulation_check_without_a_reading():
    # GRPO: 30 upward clips of p < 0.2 tokens in 100 steps = 0.30 per step, at or above the 0.25
    # floor; no-clip 0.10 + 0.05 = 0.15 and Band-KL 0.10 - 0.02 = 0.08 final entropy vs GRPO's 0.10
    t = table(noclip=arm([0.15], clips=[0]), band=arm([0.08], clips=[0]), clip=arm([0.10], clips=[30]))
    (line,) = compare.one_seed_check(t)
    assert "GRPO clipped 30 p < 0.2 tokens upward in 100 steps (0.300 per step, at or above" in line
    assert "no-clip minus GRPO final entropy +0.050" in line
    assert "Band-KL δ=0.05 minus GRPO final entropy -0.020" in line
    assert "**" not in line and "no no-clip arm" not in line  # no verdict label from one seed
    one = lambda clips: compare.one_seed_check(table(clip=arm([0.1], clips=[clips])))  # noqa: E731
    assert "(0.250 per step, at or above the 0.25 floor)" in one(25)[0]  # the floor itself
    assert "(0.240 per step, below the 0.25 floor)" in one(24)[0]
    assert "; no no-clip arm;" in one(5)[0]
    assert one(None) == []  # without the counts (older runs) there is nothing to report
    # runs of different seeds are not differenced
    other = arm([0.15], clips=[0])
    other[0]["seed"] = "1"
    assert "no-clip ran another seed" in compare.one_seed_check(table(noclip=other, clip=arm([0.1])))[0]

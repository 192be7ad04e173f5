"""experiments/verdicts.py's statistics and verdicts on hand-built arms (compare.py's command line:
test_compare_cli.py).

Every expected label and number below is worked out by hand in the comment beside it: a paired difference is read
through its 95% t interval, mean ± t(0.975, n - 1) x sd / sqrt(n), with t(0.975, 2) = 4.303 for three seeds (any
statistics table); "no difference" needs that interval inside ±10% of GRPO's final entropy; the entropy is read
at the last 5 and the last 10 steps, the upper-clip rate over all steps and over their last half.
"""

import math
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import verdicts  # noqa: E402

T2 = 4.303                  # t(0.975, df = 2), from a table
CLIP = [0.10, 0.12, 0.14]   # GRPO's final entropy in seeds 0, 1, 2: mean 0.12, so the margin is ±0.012


def arm(entropy, start=(0.30, 0.30, 0.30), final=(0.40, 0.40, 0.40), clips=(300, 300, 300), steps=100,
        entropy10=None, rate=(0.02, 0.02, 0.02), reward=None):
    """One method's per-seed summaries, as compare.py and horizon.py build them; the last-10-step entropy is
    the last-5-step one unless given (the random regime's last 60 steps and last half: the same two values), the
    upper-clip rate the same over all steps and over their last half."""
    rows = []
    for i, (e, e10, s, f, c, r) in enumerate(zip(entropy, entropy10 or entropy, start, final, clips, rate)):
        rows.append({"seed": str(i), "entropy": e, "entropy@5": e, "entropy@10": e10, "entropy@60": e,
                     "entropy@half": e10, "mean@n_start": s,
                     "mean@n": f, "clip/n_low_p_upper": c, "steps": steps, "clip/low_p_upper_rate": r,
                     "clip/low_p_upper_rate@all": r, "clip/low_p_upper_rate@half": r})
        if reward:
            rows[-1]["reward"] = reward
    return rows


def plus(base, offsets):
    return [b + o for b, o in zip(base, offsets)]


def table(noclip=None, band=None, clip=None, **others):
    out = {("clip", 0.05): clip or arm(CLIP)}
    if noclip is not None:
        out[("noclip", 0.05)] = noclip
    out[("bandkl", 0.05)] = band or arm(CLIP)
    out.update(others)
    return out


# --- the statistics ------------------------------------------------------------------------------------------------

def test_t_quantiles_match_a_table():
    # t(0.975): df 1 12.706, df 2 4.303, df 4 2.776, df 30 2.042, df 40 2.021, df 60 2.000, df 120 1.980
    for df, t in ((1, 12.706), (2, 4.303), (4, 2.776), (30, 2.042), (40, 2.021), (60, 2.000), (120, 1.980)):
        assert verdicts.t975(df) == pytest.approx(t, abs=1e-3)


def test_paired_t_interval_by_hand():
    # differences 0.10, 0.12, 0.11: mean 0.11, sd 0.01, half-width 4.303 x 0.01 / sqrt(3) = 0.024843
    a, b = arm([0.20, 0.30, 0.25]), arm([0.10, 0.18, 0.14])
    d = verdicts.paired(a, b, "entropy")
    assert d.n == 3 and d.mean == pytest.approx(0.11, abs=1e-12)
    assert d.half == pytest.approx(T2 * 0.01 / math.sqrt(3), rel=1e-9)
    assert verdicts.ci(d) == "+0.110 ± 0.025 (95% t interval, n = 3)"
    # pairs by seed: b lacks seed 1, so the differences are seed 0's 0.10 and seed 2's 0.11 (not 0.12 by position):
    # mean 0.105, sd 0.00707, half-width 12.706 x 0.00707 / sqrt(2) = 0.0635
    d = verdicts.paired(a, [b[0], b[2]], "entropy")
    assert d.n == 2 and d.mean == pytest.approx(0.105) and d.half == pytest.approx(12.706 * 0.005, rel=1e-6)
    one = verdicts.paired(a, [b[2]], "entropy")
    assert one.n == 1 and math.isnan(one.half) and verdicts.ci(one) == "+0.110 (n = 1: no interval)"


def test_windows_by_hand():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert verdicts.at_window(values, 2) == 4.5           # the last 2 steps
    assert verdicts.at_window(values, "all") == 3.0
    assert verdicts.at_window(values, "half") == 4.0      # steps 3..5: the later half, the middle step with it


@pytest.mark.parametrize("mean, half, n, side", [
    (0.0, 0.004, 3, "equivalent"),       # [-0.004, 0.004] inside ±0.005
    (0.003, 0.001, 5, "equivalent"),     # [0.002, 0.004]: apart from 0, yet inside the margin
    (0.010, 0.004, 3, "above"),          # [0.006, 0.014]
    (-0.010, 0.004, 3, "below"),
    (0.0, 0.010, 3, "underpowered"),     # [-0.01, 0.01]: neither inside ±0.005 nor apart from 0
    (0.02, math.nan, 1, "n = 1"),
])
def test_weigh(mean, half, n, side):
    assert verdicts.weigh(verdicts.Diff(mean, half, n), 0.005) == side


# --- claim (2) against the no-clip arm -----------------------------------------------------------------------------

def test_not_testable_needs_the_noclip_interval_below_the_margin():
    # no-clip minus GRPO +0.004, -0.002, +0.001: mean 0.001, sd 0.003, half 4.303 x 0.003 / sqrt(3) = 0.00745:
    # [-0.0065, +0.0085], below +0.012 -> not testable
    reading, (check, line) = verdicts.entropy_control(table(noclip=arm(plus(CLIP, [0.004, -0.002, 0.001]))))
    assert reading == "not testable in this regime"
    assert "last 5 steps: +0.001 ± 0.007 (95% t interval, n = 3) against +0.012: **not above GRPO by more" in check
    assert "**acted**" in check
    assert "300.0 p < 0.2 tokens upward per run (300–300 over 3 seeds, 3.00 per step" in check
    assert "**not testable in this regime** (last 5 steps: no-clip not above GRPO by more than the margin" in line
    assert "(no-clip within ±margin of GRPO)" in line and "margin ±0.012" in line


def test_a_merely_insignificant_difference_is_underpowered():
    # no-clip minus GRPO +0.04, -0.01, +0.02: mean 0.0167, sd 0.0252, half 4.303 x 0.0145 = 0.0625: [-0.046, +0.079]
    # reaches past +0.012 and below 0 -> underpowered (two s.e., 0.029, would have called it "does not differ")
    reading, (check, line) = verdicts.entropy_control(table(noclip=arm(plus(CLIP, [0.04, -0.01, 0.02]))))
    assert reading == "inconclusive (underpowered)"
    assert "+0.017 ± 0.063 (95% t interval, n = 3) against +0.012: **underpowered**" in check


def test_noclip_below_clip_is_not_testable():
    # -0.05, -0.06, -0.04: mean -0.05, half 4.303 x 0.01 / sqrt(3) = 0.0248: [-0.075, -0.025], below +0.012
    reading, (_, line) = verdicts.entropy_control(table(noclip=arm(plus(CLIP, [-0.05, -0.06, -0.04]))))
    assert reading == "not testable in this regime" and "(no-clip below GRPO)" in line
    assert "no-clip minus GRPO -0.050 ± 0.025 (95% t interval, n = 3)" in line


def test_one_paired_seed_is_inconclusive():
    # no-clip ran seed 2 only: one pair (0.25 - 0.14 = +0.11), no interval
    reading, (check, line) = verdicts.entropy_control(table(noclip=[arm(plus(CLIP, [0.10, 0.12, 0.11]))[2]]))
    assert reading == "inconclusive (n = 1)" and "+0.110 (n = 1: no interval)" in check


NOCLIP_UP = plus(CLIP, [0.30, 0.32, 0.31])   # minus GRPO: mean 0.31, half 0.0248: above
NOCLIP_ABOVE = plus(CLIP, [0.10, 0.12, 0.11])   # minus GRPO: mean 0.11, half 0.0248: above


def test_supports_needs_the_claimed_size():
    # Band-KL = no-clip + 0.002, -0.001, +0.002: minus no-clip mean 0.001, sd 0.001732, half 4.303 x 0.001 = 0.0043:
    # inside ±0.012. Band-KL mean 0.12 + 0.311 = 0.431, / GRPO 0.12 = 3.59 >= sqrt(10) = 3.16 -> supports
    reading, (_, line) = verdicts.entropy_control(table(noclip=arm(NOCLIP_UP), band=arm(plus(NOCLIP_UP,
                                                                                          [0.002, -0.001, 0.002]))))
    assert reading == "supports" and "Band-KL / GRPO 3.59" in line and "Band-KL / GRPO >= 3.16" in line
    assert "Band-KL minus no-clip +0.001 ± 0.004 (95% t interval, n = 3)" in line
    # no-clip only 0.11 above, Band-KL = no-clip + 0.002, -0.001, +0.005 (0.002 ± 4.303 x 0.003 / sqrt(3) =
    # 0.0075, inside ±0.012): Band-KL 0.232 / 0.12 = 1.93 < 3.16: the direction only
    reading, (_, line) = verdicts.entropy_control(table(noclip=arm(NOCLIP_ABOVE), band=arm(plus(NOCLIP_ABOVE,
                                                                                             [0.002, -0.001, 0.005]))))
    assert reading == "supports the direction, not the size" and "Band-KL / GRPO 1.93 < 3.16" in line
    # a 5% effect, Band-KL / GRPO 1.05: no-clip +0.005, +0.007, +0.006 ends at 0.006 + 0.0025 < +0.012: the clip
    # does not hold the entropy down by more than the margin, so no reading of Band-KL at all
    small = plus(CLIP, [0.005, 0.007, 0.006])
    assert verdicts.entropy_control(table(noclip=arm(small), band=arm(small)))[0] == "not testable in this regime"


@pytest.mark.parametrize("band_offsets, reading, why", [
    # minus GRPO +0.002, -0.001, +0.002 (inside ±0.012); minus no-clip -0.098, -0.121, -0.108: below
    ([0.002, -0.001, 0.002], "does not reproduce", "Band-KL below no-clip and not above GRPO"),
    # minus GRPO 0.06 ± 0.025: above; minus no-clip -0.05 three times (sd 0): below
    ([0.05, 0.07, 0.06], "inconclusive", "between GRPO and no-clip"),
    # minus no-clip +0.05 three times: above
    ([0.15, 0.17, 0.16], "inconclusive", "above no-clip"),
    # minus GRPO 0.1 ± 0.248, minus no-clip -0.01 ± 0.237: neither resolved
    ([0.0, 0.1, 0.2], "inconclusive (underpowered)", "resolved against neither"),
    # minus GRPO -0.11 ± 0.025: below
    ([-0.10, -0.12, -0.11], "does not reproduce", "Band-KL below no-clip and not above GRPO"),
])
def test_other_combinations_get_an_honest_label(band_offsets, reading, why):
    got, (_, line) = verdicts.entropy_control(table(noclip=arm(NOCLIP_ABOVE), band=arm(plus(CLIP, band_offsets))))
    assert got == reading and why in line


def test_band_within_the_margin_of_both():
    # no-clip minus GRPO +0.015, +0.016, +0.014: mean 0.015, half 4.303 x 0.001 / sqrt(3) = 0.0025: [0.0125, 0.0175]
    # is above 0 and past +0.012. Band-KL = GRPO + 0.007, 0.008, 0.006: minus GRPO [0.0045, 0.0095], minus no-clip
    # -0.008, -0.008, -0.008 (sd 0): both inside ±0.012
    reading, (_, line) = verdicts.entropy_control(table(noclip=arm(plus(CLIP, [0.015, 0.016, 0.014])),
                                                       band=arm(plus(CLIP, [0.007, 0.008, 0.006]))))
    assert reading == "inconclusive" and "Band-KL within the margin of both GRPO and no-clip" in line


SUPPORTS = dict(noclip=arm(NOCLIP_UP), band=arm(plus(NOCLIP_UP, [0.002, -0.001, 0.002])))


@pytest.mark.parametrize("band_final, reading", [
    ((0.24, 0.25, 0.26), "degenerate"),   # accuracy 30% -> 24, 25, 26%: -6, -5, -4: sd 1, half 4.303 / sqrt(3) = 2.48
    ((0.25, 0.28, 0.31), "supports"),     # -5, -2, +1: mean -2 < 0, but the interval -2 ± 7.45 reaches above 0
    ((0.29, 0.31, 0.33), "supports"),     # -1, +1, +3: mean +1
])
def test_degenerate_guard_on_band(band_final, reading):
    """'degenerate' needs the fall in accuracy resolved: its 95% t interval below 0, not a negative mean."""
    t = dict(SUPPORTS, band=arm(plus(NOCLIP_UP, [0.002, -0.001, 0.002]), final=band_final))
    got, (_, line) = verdicts.entropy_control(table(**t))
    assert got == reading
    shown = {"degenerate": "Band-KL -5.0 ± 2.5 (95% t interval, n = 3) (below the start, 95% t interval below 0: "
                           "Band-KL)", "supports": "(below the start"}[reading]
    assert (shown in line) == (reading == "degenerate")


def test_the_reading_must_hold_at_both_windows():
    # last 5 steps: no-clip +0.004, -0.002, +0.001 (not testable, as above); last 10 steps: +0.04, -0.01, +0.02
    # (underpowered, as above): the windows disagree
    noclip = arm(plus(CLIP, [0.004, -0.002, 0.001]), entropy10=plus(CLIP, [0.04, -0.01, 0.02]))
    reading, (check, line) = verdicts.entropy_control(table(noclip=noclip))
    assert reading == "inconclusive (window-dependent)"
    assert "last 5 steps: no-clip not above GRPO" in line and "last 10 steps: no-clip's interval reaches both" in line
    assert "last 10 steps: +0.017 ± 0.063 (95% t interval, n = 3) against +0.012: **underpowered**" in check
    # rows holding one window only (an older summary): that window, and the other named as missing
    t = table(noclip=arm(plus(CLIP, [0.004, -0.002, 0.001])))
    for x in (x for runs in t.values() for x in runs):
        del x["entropy@10"]
    reading, (_, line) = verdicts.entropy_control(t)
    assert reading == "inconclusive (one window)" and "last 10 steps: not in these numbers" in line
    assert "last 5 steps: no-clip not above GRPO" in line  # the window read is still shown


@pytest.mark.parametrize("clips, acted", [
    ((20, 30, 10), False),     # 0.2, 0.3, 0.1 per step: mean 0.2 < 0.25
    ((25, 25, 25), True),      # exactly 0.25 per step: acted
    ((20, 25, 29), False),     # mean 0.2467
])
def test_manipulation_check_clip_did_not_act(clips, acted):
    reading, (check, line) = verdicts.entropy_control(table(clip=arm(CLIP, clips=clips), **SUPPORTS))
    assert reading == ("supports" if acted else "not testable in this regime")
    assert ("**acted**" in check) == acted and ("**barely acted (< 0.25 per step)**" in check) == (not acted)
    if not acted:
        assert "**not testable in this regime** (the clip barely acted" in line


def test_no_noclip_arm():
    reading, (check, line) = verdicts.entropy_control(table(band=SUPPORTS["band"]))
    assert reading == "no no-clip arm" and check.endswith("**acted**; no no-clip arm")
    assert ("**no no-clip arm: cannot tell 'Band does not help' from 'the clip does not drive the entropy "
            "here'**") in line
    # Band-KL minus GRPO 0.302, 0.319, 0.312: mean 0.311, sd 0.00854, half 4.303 x 0.00493 = 0.0212
    assert "last 5 steps: final entropy GRPO 0.120, Band-KL minus GRPO +0.311 ± 0.021 (95% t interval, n = 3)" in line
    reading, (check, _) = verdicts.entropy_control(table(clip=arm(CLIP, clips=(None, None, None))))
    assert reading == "no no-clip arm" and "clip/low_p_upper_rate, is 0.0200): **not counted**" in check
    _, (check, _) = verdicts.entropy_control(table(clip=arm(CLIP, clips=(300, None, 300))))
    assert "**not counted**" in check


# --- claims (1) and (3) ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("band_final, label, shown", [
    # differences 3, 4, 3.5 points: mean 3.5, sd 0.5, half 4.303 x 0.2887 = 1.24: >= 2 and above 0
    ((0.43, 0.44, 0.435), "reproduced", "+3.5 ± 1.2"),
    # 2, 4, 1: mean 2.33, half 4.303 x 0.882 = 3.80: [-1.5, 6.1] (two s.e., 1.76, would have said "reproduced")
    ((0.42, 0.44, 0.41), "not distinguishable at this scale", "+2.3 ± 3.8"),
    # 1.0, 1.2, 1.1: mean 1.1, half 0.25: apart from 0 but the whole interval below the claim's 2 points
    ((0.41, 0.412, 0.411), "not reproduced", "+1.1 ± 0.2"),
])
def test_accuracy_verdict(band_final, label, shown):
    t = table(band=arm(CLIP, final=band_final), clip=arm(CLIP, final=(0.40, 0.40, 0.40)))
    line = verdicts.verdicts(t)[0]
    assert line.startswith("(1) BandPO beats clip by >= 2 points")
    assert f"**{label}** (Band-KL minus clip {shown} (95% t interval, n = 3) points, the last evaluation)" in line


def test_accuracy_verdict_needs_two_seeds_and_the_clip_to_act():
    # one Band-KL seed (+3 points): no interval, no reading
    t = table(band=arm([0.1], final=[0.43]), clip=arm(CLIP, final=(0.40, 0.40, 0.40)))
    assert "**inconclusive (n = 1)** (Band-KL minus clip +3.0 (n = 1: no interval) points" in verdicts.verdicts(t)[0]
    t = table(band=arm(CLIP, final=(0.43, 0.44, 0.435)), clip=arm(CLIP, final=(0.4,) * 3, clips=(20, 20, 20)))
    assert "**not testable in this regime (the clip barely acted)**" in verdicts.verdicts(t)[0]


@pytest.mark.parametrize("band_rate, label", [
    # minus GRPO (0.02) -0.012, -0.013, -0.011: mean -0.012, half 4.303 x 0.000577 = 0.0025: below; 0.008 / 0.02 = 0.40
    ((0.008, 0.007, 0.009), "reproduced"),
    # -0.004, -0.005, -0.003: below; 0.016 / 0.02 = 0.80 > 0.5
    ((0.016, 0.015, 0.017), "partly reproduced: fewer, but not far fewer"),
    ((0.024, 0.025, 0.023), "not reproduced (more)"),
    # -0.01, +0.01, 0: mean 0, half 0.0248
    ((0.010, 0.030, 0.020), "not distinguishable at this scale"),
])
def test_claim3(band_rate, label):
    line = verdicts.claim3(table(band=arm(CLIP, rate=band_rate)))[0]
    assert f"**{label}**" in line and "at most half GRPO's rate" in line
    if label == "reproduced":
        assert "all steps: rate 0.0080 vs 0.0200, Band-KL / GRPO 0.40; difference -0.0120 ± 0.0025" in line


def test_claim3_window_dependent_and_one_seed():
    band = arm(CLIP, rate=(0.008, 0.007, 0.009))
    for x, r in zip(band, (0.010, 0.030, 0.020)):   # reproduced over all steps, not distinguishable over the half
        x["clip/low_p_upper_rate@half"] = r
    assert "**inconclusive (window-dependent)**" in verdicts.claim3(table(band=band))[0]
    assert "**inconclusive (n = 1)**" in verdicts.claim3(table(band=arm([0.1], rate=[0.008])))[0]


# --- the random-reward regime --------------------------------------------------------------------------------------

def coins(noclip_offsets, band_fraction=None, n=3, reward="random"):
    """A coin-reward table: GRPO at CLIP, no-clip at CLIP + offsets, Band-KL `band_fraction` of the way from GRPO
    to no-clip in every seed."""
    clip = CLIP[:n]
    noclip = plus(clip, noclip_offsets)
    band = plus(clip, [band_fraction * o for o in noclip_offsets]) if band_fraction is not None else clip
    return table(clip=arm(clip, reward=reward), noclip=arm(noclip, reward=reward), band=arm(band, reward=reward))


@pytest.mark.parametrize("offsets, reading", [
    ([0.05, 0.06, 0.04], "the clip lowers the entropy"),    # GRPO minus no-clip -0.05 ± 0.025
    ([-0.05, -0.06, -0.04], "the clip raises the entropy"),
    ([0.001, -0.001, 0.0], "no effect within the margin"),  # 0 ± 4.303 x 0.001 / sqrt(3) = 0.0025, inside ±0.012
    ([0.1, -0.1, 0.05], "inconclusive (underpowered)"),     # -0.0167 ± 0.259
])
def test_random_regime_asks_whether_the_clip_moves_the_entropy(offsets, reading):
    lines = verdicts.verdicts(coins(offsets, band_fraction=0.5))
    assert lines[0].startswith("(1), (2a), (2b) and the held-out-accuracy guard do not apply") and "random" in lines[0]
    assert lines[1].startswith("(control) Did the clip act?") and "**acted**" in lines[1]
    assert lines[2].startswith("(R) Does the clip by itself move the entropy") and f"**{reading}**" in lines[2]
    fraction = [x for x in lines if x.startswith("(R) bandkl δ=0.05")]
    moved = reading.startswith("the clip")
    assert len(fraction) == int(moved) and lines[-1].startswith("(3)")
    if moved:
        # f = 0.5 in every seed: the numerator is half the denominator, so Fieller's quadratic has one root, 0.5
        assert ("**removes part of it** (last 60 steps: f = 0.50, 95% Fieller interval [0.50, 0.50] (n = 3), "
                "margin ±0.25") in fraction[0]
    if reading == "the clip lowers the entropy":
        assert "-0.050 ± 0.025 (95% t interval, n = 3), margin ±0.012" in lines[2]


def test_random_regime_one_seed_window_dependence_and_a_weak_clip():
    t = coins([0.05, 0.06, 0.04])
    t[("noclip", 0.05)] = t[("noclip", 0.05)][:1]   # no-clip finished seed 0 only
    assert "**inconclusive (n = 1)** (last 60 steps: -0.050 (n = 1: no interval)" in verdicts.random_control(t)[1][2]
    # last 60 steps: lowers; last half: GRPO and no-clip equal -> no effect: window-dependent, and no f
    t = coins([0.05, 0.06, 0.04], band_fraction=0.5)
    for x, c in zip(t[("noclip", 0.05)], CLIP):
        x["entropy@half"] = c
    reading, lines = verdicts.random_control(t)
    assert reading == "inconclusive (window-dependent)" and not any(x.startswith("(R) bandkl") for x in lines)
    t = coins([0.05, 0.06, 0.04], band_fraction=0.5)
    for x in t[("clip", 0.05)]:
        x["clip/n_low_p_upper"] = 10   # 0.1 per step
    assert verdicts.random_control(t)[0] == "not testable in this regime"


def test_random_regime_reads_each_arm_against_grpo_and_its_start():
    # Band-KL halfway to no-clip: minus GRPO 0.025, 0.03, 0.02 -> mean 0.025, sd 0.005, half 4.303 x 0.005 /
    # sqrt(3) = 0.0124: the interval [0.013, 0.037] excludes 0 and reaches past the margin 0.012: above GRPO.
    # Start entropy 0.1 in every run: GRPO's change 0, 0.02, 0.04 -> +0.020, sd 0.02, half 4.303 x 0.02 / sqrt(3)
    t = coins([0.05, 0.06, 0.04], band_fraction=0.5)
    lines = verdicts.random_control(t)[1]
    against = [x for x in lines if x.startswith("(R) Against GRPO")]
    assert against == ["(R) Against GRPO: bandkl δ=0.05 minus GRPO entropy, paired: **above GRPO** (last 60 steps: "
                       "+0.025 ± 0.012 (95% t interval, n = 3), margin ±0.012; the last half of the steps: +0.025 ± "
                       "0.012 (95% t interval, n = 3), margin ±0.012)"]
    assert not any(x.startswith("(R) Change from the start") for x in lines)   # no start entropy in these rows
    for rows in t.values():
        for x in rows:
            x["entropy_start"] = 0.1
    change = [x for x in verdicts.random_control(t)[1] if x.startswith("(R) Change from the start")]
    assert change and "clip +0.020 ± 0.050 (95% t interval, n = 3)" in change[0]


def test_drift_fraction_fieller_interval_by_hand():
    # three seeds, no-clip minus GRPO 0.1 in each (no spread): Fieller's interval is the numerator's t interval over
    # 0.1. Band-KL minus GRPO 0.02, 0.05, 0.08: mean 0.05, sd 0.03, half 4.303 x 0.03 / sqrt(3) = 0.074530, so
    # f = 0.5 in [(0.05 - 0.07453) / 0.1, (0.05 + 0.07453) / 0.1] = [-0.2453, 1.2453]: it holds both 0 and 1
    clip, noclip, band = arm([0.1] * 3), arm([0.2] * 3), arm([0.12, 0.15, 0.18])
    f, lo, hi, n = verdicts.drift_fraction(band, clip, noclip, "entropy")
    assert (n, f, lo, hi) == (3, pytest.approx(0.5), pytest.approx(-0.2453, abs=1e-4), pytest.approx(1.2453, abs=1e-4))
    assert verdicts.fraction_label(f, lo, hi, n) == "inconclusive (underpowered)"
    # no-clip minus GRPO 0.1, -0.1, 0.3: mean 0.1, sd 0.2; t² s² / n = 18.516 x 0.04 / 3 = 0.247 > 0.1² = 0.01: the
    # denominator's own interval holds 0, and so the ratio's is unbounded
    f, lo, hi, n = verdicts.drift_fraction(band, clip, arm([0.2, 0.0, 0.4]), "entropy")
    assert (lo, hi) == (-math.inf, math.inf) and verdicts.fraction_label(f, lo, hi, n) == "inconclusive (underpowered)"
    assert verdicts.drift_fraction(band[:1], clip, noclip, "entropy")[1:] == (pytest.approx(math.nan, nan_ok=True),
                                                                             pytest.approx(math.nan, nan_ok=True), 1)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_drift_fraction_covers_the_true_ratio(n):
    """Brute force: seeds whose arm - GRPO and no-clip - GRPO differences are normal (means 0.4 and 1, sd 0.3,
    correlation 0.5), so the true fraction is 0.4. Over 2000 draws of n seeds the interval must hold 0.4 at least
    95% of the time less 4 binomial sd (0.93; the unbounded intervals returned where Fieller's set is two rays
    only add coverage), and at n = 8, where those are rare, at most 0.97. (The percentile bootstrap it replaces
    covered 49-89% at n = 2-8.)"""
    rng, hits = random.Random(n), 0
    for _ in range(2000):
        zs = [(rng.gauss(0, 1), rng.gauss(0, 1)) for _ in range(n)]
        den = [1 + 0.3 * a for a, _ in zs]
        num = [0.4 + 0.3 * (0.5 * a + math.sqrt(0.75) * b) for a, b in zs]
        clip = arm([0.0] * n, start=(0.3,) * n, final=(0.4,) * n, clips=(300,) * n, rate=(0.02,) * n)
        f, lo, hi, _ = verdicts.drift_fraction(arm(num, start=(0.3,) * n, final=(0.4,) * n, clips=(300,) * n,
                                                   rate=(0.02,) * n), clip,
                                               arm(den, start=(0.3,) * n, final=(0.4,) * n, clips=(300,) * n,
                                                   rate=(0.02,) * n), "entropy")
        hits += lo <= 0.4 <= hi
    assert hits / 2000 >= 0.93
    if n == 8:
        assert hits / 2000 <= 0.97


@pytest.mark.parametrize("lo, hi, label", [
    (0.9, 1.1, "removes the clip's drift (as no-clip, within ±0.25)"),
    (-0.1, 0.1, "keeps the clip's drift (as GRPO, within ±0.25)"),
    (-0.1, 0.4, "inconclusive (underpowered)"),   # holds 0, but reaches past the margin: not "as GRPO"
    (0.7, 1.3, "inconclusive (underpowered)"),    # holds 1, but wider than ±0.25 around it
    (-0.5, 1.5, "inconclusive (underpowered)"),
    (1.2, 1.4, "beyond no-clip"),
    (-0.4, -0.2, "beyond GRPO"),
    (0.2, 0.8, "removes part of it"),
    (-math.inf, math.inf, "inconclusive (underpowered)"),
])
def test_fraction_labels(lo, hi, label):
    assert verdicts.fraction_label((lo + hi) / 2, lo, hi, 3) == label
    assert verdicts.fraction_label(0.5, math.nan, math.nan, 1) == "inconclusive (n = 1)"


def test_windows_are_named_as_averaged():
    """The last 60 steps of a 10-step run are all 10 of them; of a 300-step run, the last 60."""
    assert verdicts.window_name(60, 10) == "all 10 steps" and verdicts.window_name(60, 300) == "last 60 steps"
    assert verdicts.window_name(60, 60) == "all 60 steps" and verdicts.window_name("half", 10).startswith("the last")
    assert verdicts.window_name(5) == "last 5 steps"


def test_mixed_reward_regimes_are_refused():
    t = coins([0.05, 0.06, 0.04])
    t[("noclip", 0.05)] = arm(CLIP, reward="math-verify")
    with pytest.raises(ValueError, match=r"mix training rewards \['math-verify', 'random'\]"):
        verdicts.verdicts(t)
    assert verdicts.regime(table()) == "math-verify"   # rows without a reward: train.py's default

"""verdicts.noninferiority, the long coin runs' reading (experiments/results/random-toy/plan.md), on hand-built
seeds: each of its labels, and the order in which the rule's preconditions apply.

Every case pairs 33 seeds whose GRPO minus no-clip differences are mu + a x s_i, s_i = +1 for 16 seeds, -1 for 16
and 0 for one: mean mu, sample sd a x sqrt(32 / 32) = a, so the 95% t interval is mu ± t(0.975, 32) x a / sqrt(33)
with t(0.975, 32) = 2.037 (any statistics table): at a = 0.1 the half-width is 0.03546, at a = 0.2 0.07092.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import verdicts  # noqa: E402

T32 = 2.037   # t(0.975, df = 32), from a table


def table(mu, a=0.1, seeds=range(33), clips=600, uncounted=()):
    """{(method, delta): rows} as horizon.py builds it: no-clip's entropy@60 0.2 on every seed, GRPO's 0.2 + the
    seed's difference; GRPO's `clips` upward clips of p < 0.2 tokens in 300 steps (None on `uncounted` seeds, as
    on a run committed without the keys that count them)."""
    signs = [+1] * 16 + [-1] * 16 + [0]
    clip = [{"seed": str(s), "steps": 300, "entropy@60": 0.2 + mu + a * (signs[s] if s < 33 else 0),
             "clip/n_low_p_upper": None if s in uncounted else clips} for s in seeds]
    noclip = [{"seed": str(s), "steps": 300, "entropy@60": 0.2, "clip/n_low_p_upper": None} for s in seeds]
    return {("clip", 0.05): clip, ("noclip", 0.05): noclip}


@pytest.mark.parametrize("mu, a, label", [
    (+0.05, 0.1, "non-inferior; the clip raises the entropy"),                           # [+0.0145, +0.0855]
    (-0.01, 0.1, "non-inferior"),                                                        # [-0.0455, +0.0255]
    (-0.04, 0.1, "non-inferior; the clip lowers the entropy by less than the margin"),   # [-0.0755, -0.0045]
    (-0.06, 0.1, "inconclusive; the clip lowers the entropy"),                           # [-0.0955, -0.0245]
    (-0.03, 0.2, "inconclusive"),                                                        # [-0.1009, +0.0409]
    (-0.13, 0.1, "inferior: the clip drains by more than the margin"),                   # [-0.1655, -0.0945]
])
def test_each_label_off_the_interval(mu, a, label):
    got, text = verdicts.noninferiority(table(mu, a))
    assert got == label
    half = T32 * a / 33 ** 0.5
    assert f"= [{mu - half:+.3f}, {mu + half:+.3f}]" in text   # t975's series is within 1e-3 of the table at df 32
    assert "margin -0.08" in text and "seeds not counted: none" in text


def test_margin_is_fixed_to_the_digit():
    assert verdicts.NI_MARGIN == 0.08 and verdicts.NI_SEEDS == tuple(range(33)) and verdicts.NI_WINDOW == 60
    # mu = -0.045: lower end -0.0805, below -0.08; mu = -0.044: lower end -0.0795, above -0.08 but below -0.0785,
    # so the two readings of the margin disagree there, and the committed one is 0.08
    assert verdicts.noninferiority(table(-0.045))[0] == "inconclusive; the clip lowers the entropy"
    assert verdicts.noninferiority(table(-0.044))[0] == "non-inferior; the clip lowers the entropy by less than " \
                                                        "the margin"
    assert verdicts.noninferiority(table(-0.044), margin=0.0785)[0] == "inconclusive; the clip lowers the entropy"


def test_not_read_before_every_seed():
    label, _ = verdicts.noninferiority(table(+0.05, seeds=range(32)))   # seed 32 missing
    assert label == "not read (32 of 33 seeds)"
    t = table(+0.05)
    t[("noclip", 0.05)] = t[("noclip", 0.05)][1:]                     # seed 0's no-clip run missing
    assert verdicts.noninferiority(t)[0] == "not read (32 of 33 seeds)"
    extra = table(+0.05, seeds=range(40))   # seeds beyond the plan's are ignored, not read
    assert verdicts.noninferiority(extra)[0] == "non-inferior; the clip raises the entropy"


def test_manipulation_check_first():
    # 60 clips in 300 steps = 0.2 per step, below the 0.25 floor: no reading, whatever the interval
    assert verdicts.noninferiority(table(+0.05, clips=60))[0] == "not testable in this regime"
    label, text = verdicts.noninferiority(table(+0.05, clips=600, uncounted=(12, 13, 14)))
    assert label == "non-inferior; the clip raises the entropy"
    assert "2.00 p < 0.2 tokens upward per step" in text and "the 30 seeds" in text
    assert "seeds not counted: 12, 13, 14" in text
    label, _ = verdicts.noninferiority(table(+0.05, uncounted=range(33)))
    assert label == "not read (the clip's work not counted)"

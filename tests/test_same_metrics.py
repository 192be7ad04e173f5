"""scripts/same_metrics.py: what counts as the same run (hand-built metrics lines)."""
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from same_metrics import MISSING, compare  # noqa: E402


def test_timings_are_ignored_and_every_other_value_must_be_equal():
    a = [{"step": 1, "loss": 0.25, "time/step": 2.0, "memory/peak_rss_gb": 1.0,
          "tokens_per_s": 9.0}]
    b = [{"step": 1, "loss": 0.25, "time/step": 3.0, "memory/peak_rss_gb": 1.5,
          "tokens_per_s": 7.0}]
    assert compare(a, b) == (2, [])


def test_a_changed_value_a_missing_key_and_a_missing_line_are_differences():
    a = [{"step": 1, "loss": 0.25, "entropy": 0.5}, {"step": 2, "loss": 0.5}]
    b = [{"step": 1, "loss": 0.25000000000000006, "clip/frac": 0.0}]
    equal, diffs = compare(a, b)
    assert equal == 1  # the step
    assert (None, "lines", 2, 1) in diffs
    assert (1, "loss", 0.25, 0.25000000000000006) in diffs  # one ulp is a difference
    assert (1, "entropy", 0.5, MISSING) in diffs and (1, "clip/frac", MISSING, 0.0) in diffs


def test_bit_for_bit_means_the_same_json_text():
    # NaN is the same run (float NaN != NaN); -0.0 and 0.0, 1 and 1.0 are not bit for bit equal
    a = [{"loss": math.nan, "x": 0.0, "n": 1, "none": None}]
    b = [{"loss": math.nan, "x": -0.0, "n": 1.0, "none": None}]
    equal, diffs = compare(a, b)
    assert equal == 2 and {d[1] for d in diffs} == {"x", "n"}

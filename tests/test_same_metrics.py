"""scripts/same_metrics.py: what counts as the same run (hand-built metrics lines)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from same_metrics import compare  # noqa: E402


def test_timings_are_ignored_and_every_other_value_must_be_equal():
    a = [{"step": 1, "loss": 0.25, "time/step": 2.0, "memory/peak_rss_gb": 1.0, "tokens_per_s": 9.0}]
    b = [{"step": 1, "loss": 0.25, "time/step": 3.0, "memory/peak_rss_gb": 1.5, "tokens_per_s": 7.0}]
    assert compare(a, b) == (2, [])


def test_a_changed_value_a_missing_key_and_a_missing_line_are_differences():
    a = [{"step": 1, "loss": 0.25, "entropy": 0.5}, {"step": 2, "loss": 0.5}]
    b = [{"step": 1, "loss": 0.25000000000000006, "clip/frac": 0.0}]
    equal, diffs = compare(a, b)
    assert equal == 1  # the step
    assert (None, "lines", 2, 1) in diffs
    assert (0, "loss", 0.25, 0.25000000000000006) in diffs  # one ulp is a difference
    assert (0, "entropy", 0.5, None) in diffs and (0, "clip/frac", None, 0.0) in diffs

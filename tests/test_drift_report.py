"""experiments/drift_report.py and drift_rules.py on hand-built lines: seed means, the family's intervals, each
reading rule of the plans, segments, the anatomy's sections, and the statistics against printed tables.

Every expected number is worked out by hand in the test's docstring (t quantiles from a table, the sign interval
from the binomial, the design effect from its definition)."""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

F64 = 2.0 ** -52  # float64 sums of at most a few hundred terms: 1e-12 relative is ample


def test_report_reads_seed_means_by_hand(tmp_path):
    """drift_report on hand-built lines: 3 seeds x 2 branch points; clip - no-clip dH_probe per branch point
    (-1, -3), (-2, -2), (-4, -2) e-4 -> seed means -2, -2, -3: mean -2.333e-4, sd 0.577e-4, half 4.303 x 0.577 /
    sqrt(3) = 1.434e-4: [-3.77, -0.90] e-4 lies below 0 and reaches past -2.5: "below 0". The collapse drift
    from two GRPO runs whose step-1 entropies are 0.1 and 0.2 (one plain, one gzipped): 0.9 x 0.15 / 300 = 4.5e-4;
    the report's yardstick is the fixed c = 0.9 x 0.157 / 300 = 4.71e-4. The lines read back from pairs.jsonl.gz
    are the lines written."""
    import gzip

    import drift_report
    cells = [{"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0, "up": 0, "down": 0}]
    rows = []
    for seed, diffs in enumerate([(-1, -3), (-2, -2), (-4, -2)]):
        for step, d in enumerate(diffs):
            for arm, v in (("clip", d * 1e-4), ("noclip", 0.0)):
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": v, "dH_probe_is": v, "dH_train": v,
                             "kl": 0.0, "H_probe": 0.1, "n_upper": 0, "n_lower": 0, "cells": cells})
    for i, h in enumerate((0.1, 0.2)):  # GRPO's runs, and a clip-higher run of the same seed that must not count
        for name, entropy in ((f"clip-d0.05-s{i}", h), (f"clip-higher-d0.05-s{i}", 9.0)):
            os.makedirs(tmp_path / name)
            line = json.dumps({"step": 1, "entropy": entropy}) + "\n"
            if i:
                with gzip.open(tmp_path / name / "metrics.jsonl.gz", "wt") as f:
                    f.write(line)
            else:
                (tmp_path / name / "metrics.jsonl").write_text(line)
    c, H1, n = drift_report.collapse_drift(str(tmp_path))
    assert n == 2 and H1 == pytest.approx(0.15, rel=4 * F64) and c == pytest.approx(4.5e-4, rel=8 * F64)
    with gzip.open(tmp_path / "pairs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert drift_report.load(str(tmp_path / "pairs.jsonl.gz")) == rows
    md, data, arms = drift_report.report(rows)
    # exploratory, 95% t on 2 df: the interval above
    # 3 seeds: no sign interval reaches 95%, the median stands alone
    assert "| clip − noclip | dH_probe_is | 3 | -2.33 ± 1.43 | -2.00 |" in md
    assert "c = 0.9 x 0.157 / 300 = 4.71e-4" in md
    # the family at 1 - 0.05 / 8: t(0.996875, 2) = u sqrt(2 / (1 - u^2)), u = 0.99375 (t's CDF on 2 df is
    # 1/2 + t / (2 sqrt(2 + t^2))): 12.590, half 12.590 x 0.577 / sqrt(3) = 4.197 -> [-6.53, +1.86]
    assert "| clip − noclip | 3 | -2.33 ± 4.20 |" in md
    assert ("**unresolved: neither excludes 0 nor lies within the margin**; a collapse-sized drain is not excluded "
            "(lower end -6.53e-4 <= -c = -4.71e-4)") in md
    assert "**Interim: 3 of the plan's 32 seeds. No reading below is the plan's.**" in md
    assert drift_report.label(0.5e-4, 1e-4) == "no effect of interest (within ±2.5e-4)"
    assert drift_report.label(2e-4, 3e-4) == "unresolved" and drift_report.label(2e-4, 1e-4) == "above 0"
    assert drift_report.label(-2e-4, 0.3e-4) == "no effect of interest (within ±2.5e-4) (below 0, but smaller)"


def _rows(values, seeds=3, steps=2, kl=None, cells=None, clipped=0):
    """Hand-built lines: arm a's reading at (seed, step) is values[a] + a noise shared by every arm (it cancels in
    each contrast, whose weights sum to 0), so every contrast is constant over seeds: its interval is the point.
    Each update has 1,000 tokens, `clipped` of them held by the bounds (upward) in the arms that clip."""
    cells = cells or [{"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0, "up": 0, "down": 0}]
    rows = []
    for seed in range(seeds):
        for step in range(steps):
            noise = 1e-4 * ((seed * 7 + step * 3) % 5)
            for arm, v in values.items():
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": v * 1e-4 + noise,
                             "dH_probe_is": v * 1e-4 + noise, "dH_train": v * 1e-4 + noise,
                             "kl": (kl or {}).get(arm, 50e-4), "H_probe": 0.1, "ess": 0.5, "tokens": 1000,
                             "n_upper": clipped if arm.startswith("clip") else 0, "n_lower": 0, "cells": cells})
    return rows


def _readings(values, rules=None, **kw):
    import drift_report
    md = drift_report.report(_rows(values, **kw), rules=rules or drift_report.TOY)[0]
    return md[md.index("## Readings"):md.index("## Exploratory")]


def test_band_that_drains_like_clip_upper_does_not_pass():
    """A Band arm whose lines equal clip-upper's: the upper side drains (-1e-4, below 0 by less than the margin), and
    Band-KL − no-clip (-1e-4) lies within ±2.5e-4 — the one condition the rule checked before — but Band-KL −
    clip-upper is exactly 0, not above it: the verdict is not "Band removes the upper side's drain"."""
    r = _readings({"noclip": 0.0, "clip-upper": -1.0, "bandkl": -1.0})
    assert "**the upper side drains, by less than ±2.50e-4**" in r
    assert "**not shown: Band-KL − clip-upper does not lie above 0**" in r
    assert "Band removes" not in r


def test_band_removes_the_upper_sides_drain_by_hand():
    """Upper side -3e-4 (drains), Band-KL − clip-upper +2.5e-4 (above 0), Band-KL − no-clip -0.5e-4 (within ±2.5):
    all three conditions hold. With Band-KL − no-clip at -2.6e-4 (outside the margin) the third fails."""
    assert "**Band removes the upper side's drain**" in _readings({"noclip": 0.0, "clip-upper": -3.0, "bandkl": -0.5})
    r = _readings({"noclip": 0.0, "clip-upper": -3.0, "bandkl": -2.6})
    assert "**not shown: Band-KL − noclip does not lie within ±2.50e-4**" in r
    r = _readings({"noclip": 0.0, "clip-upper": 1.0, "bandkl": 0.0})
    assert "**not read: the upper side's drain is not shown**" in r


def test_two_by_two_sides_and_interaction_by_hand():
    """no-clip 0, clip-upper -3, clip-lower +1 (e-4). clip -2.5: interaction -2.5 + 3 - 1 + 0 = -0.5, within its
    ±1.25 margin: the sides add. clip -4: interaction -2, outside it and below 0: they interact."""
    r = _readings({"noclip": 0.0, "clip-upper": -3.0, "clip-lower": 1.0, "clip": -2.5})
    assert "**the upper side drains**" in r and "**the lower side raises the entropy, by less than ±2.50e-4**" in r
    assert "interaction: clip − clip-upper − clip-lower + noclip: -0.50 ± 0.00e-4" in r
    assert "**the two sides add (within ±1.25e-4)**" in r
    r = _readings({"noclip": 0.0, "clip-upper": -3.0, "clip-lower": 1.0, "clip": -4.0})
    assert "**the sides interact (below 0)**" in r
    assert "a collapse-sized drain is not excluded" not in r  # clip − noclip -4 > -c = -4.71
    r = _readings({"noclip": 0.0, "clip": -5.0})
    assert "**the clip drains the entropy**; a collapse-sized drain is not excluded" in r


def test_brake_and_step_by_hand():
    """KL of noclip-matched equal to the clip's (ratio 1): clip -4, noclip-matched -0.5, no-clip 0 -> brake -3.5
    (below 0, past the margin: the clip's per-token shape), step -0.5 (below 0, within the margin). With
    noclip-matched's KL twice the clip's the steps were not matched and neither is read."""
    r = _readings({"noclip": 0.0, "noclip-matched": -0.5, "clip": -4.0})
    assert "noclip-matched's KL is 1.00x the clip's" in r
    assert "**the clip drains beyond a no-clip step of the same size (its per-token shape)**" in r
    assert "**a smaller step alone lowers the entropy change, by less than ±2.50e-4**" in r
    r = _readings({"noclip": 0.0, "noclip-matched": -0.5, "clip": -4.0}, kl={"noclip-matched": 100e-4})
    assert "**not read: noclip-matched's KL is 2.00x the clip's, outside [0.8, 1.25]: the steps were not matched**" in r
    assert "per-token shape" not in r


def _lean_rows(clip_noclip, bandkl_clip, clipped=20):
    """3 seeds x 2 branch points: per seed s, clip − noclip is clip_noclip[s] and bandkl − clip bandkl_clip[s] (e-4) at
    both branch points (a noise shared by every arm cancels), each update 1,000 tokens, `clipped` held by the clip."""
    rows = []
    for seed in range(3):
        for step in range(2):
            noise = 1e-4 * ((seed * 7 + step * 3) % 5)
            clip = clip_noclip[seed] * 1e-4
            for arm, v in (("noclip", 0.0), ("clip", clip), ("bandkl", clip + bandkl_clip[seed] * 1e-4)):
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": v + noise, "dH_probe_is": v + noise,
                             "dH_train": v, "kl": 50e-4, "H_probe": 2.6, "ess": 0.5, "tokens": 1000,
                             "n_upper": clipped if arm == "clip" else 0, "n_lower": 0,
                             "cells": [{"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0,
                                        "up": 0, "down": 0}]})
    return rows


def test_smollm2_lean_rules_by_hand():
    """The lean SmolLM2 plan: SESOI = H / 2 / 300 = 0.00438 and c = 0.9 H / 300 = 0.007884 from the pilot's H = 2.628;
    12 seeds; Holm over bandkl − clip and clip − noclip. 3 seeds: t(0.9875, 2) = u sqrt(2 / (1 - u^2)) at u = 0.975,
    6.2053, and t(0.975, 2) = 4.3027; seed values with sd 1 give half-widths 3.583 (97.5%) and 2.484 (95%).
    bandkl − clip (-5, -6, -7): mean -6, |-6| / 3.583 = 1.67 first, excludes 0 at 97.5%: below 0. clip − noclip
    (2, 3, 4): mean 3, not past 3.583 but past 2.484: Holm's second step reads it above 0 at 95%. With bandkl − clip
    (-1, -2, -3) (mean -2, ratio 0.56) clip − noclip (ratio 0.84) is read first, does not exclude 0: both
    unresolved. A clip that bounded 0.5% of the tokens (under 1%): "cannot test" and no contrast."""
    import drift_report as d
    assert (d.SMOLLM2.sesoi, d.SMOLLM2.k, d.SMOLLM2.level) == (0.00438, 12, 0.975)
    assert d.SMOLLM2.collapse == pytest.approx(0.007884, rel=F64 * 8)
    md = d.report(_lean_rows((2, 3, 4), (-5, -6, -7)), rules=d.SMOLLM2)[0]
    r = md[md.index("## Readings"):md.index("## Exploratory")]
    rows = [x.split(" | ")[:2] for x in md[md.index("## Exploratory"):md.index("## Token anatomy")].splitlines()
            if x.startswith("| ") and "−" in x]   # each reading with its median, the primary's the plan's secondary
    assert sorted(map(tuple, rows)) == [("| bandkl − clip", key) for key in ("dH_probe", "dH_probe_is", "dH_train")] + [
        ("| clip − noclip", key) for key in ("dH_probe", "dH_probe_is", "dH_train")], rows
    # the median of (2, 3, 4) and of (-5, -6, -7); 3 seeds reach no 95% sign interval: the median alone; 95% t on
    # 2 df: 4.3027 x 1 / sqrt(3) = 2.48
    assert "| clip − noclip | dH_probe | 3 | +3.00 ± 2.48 | +3.00 |" in md
    assert "| bandkl − clip | dH_probe | 3 | -6.00 ± 2.48 | -6.00 |" in md
    assert "- the clip acted: it bounded 2.00% of an update's tokens (the plan asks for 1%)" in r
    assert ("- bandkl − clip: -6.00 ± 3.58e-4, [-9.58, -2.42] (97.5%): **Band-KL lowers the entropy change against the "
            "clip (against the paper's direction)** (Holm step 1, at 97.5%); the interval excludes a collapse-sized "
            "effect (±c = ±78.84e-4)") in r
    assert ("- clip − noclip: +3.00 ± 3.58e-4, [-0.58, +6.58] (97.5%): **the clip raises the entropy against no "
            "clip** (Holm step 2, at 95.0%)") in r
    assert r.index("bandkl − clip:") < r.index("clip − noclip:")
    assert "**Interim: 3 of the plan's 12 seeds." in md and "97.500% t intervals (Holm's first step, 0.05 / 2" in md
    r = d.report(_lean_rows((2, 3, 4), (-1, -2, -3)), rules=d.SMOLLM2)[0]
    assert "- clip − noclip: +3.00 ± 3.58e-4, [-0.58, +6.58] (97.5%): **unresolved** (Holm step 1" in r
    assert "- bandkl − clip: -2.00 ± 3.58e-4, [-5.58, +1.58] (97.5%): **unresolved** (Holm step 2" in r
    r = d.report(_lean_rows((2, 3, 4), (-5, -6, -7), clipped=5), rules=d.SMOLLM2)[0]
    assert "- **cannot test: the clip did not act** (it bounded 0.50% of an update's tokens" in r and "Holm step" not in r


def test_segments_by_hand():
    """Branch points at rollouts 0, 50 (segment 0–99) and 100, 150 (segment 100–199), 3 seeds. clip − no-clip is
    -1e-4 at every early branch point (interval the point: within ±2.5, below 0 but smaller) and -4 + (seed - 1)
    (e-4) late: seed means -5, -4, -3, sd 1, half-width t(0.975, 2) / sqrt(3) = 4.303 / 1.732 = 2.48: below 0.
    The per-branch sd late is that of (-5, -5, -4, -4, -3, -3): sqrt(4 / 5) = 0.894 -> 0.9. Last minus first segment
    per seed: -4, -3, -2, half-width 2.48 again: below 0."""
    import drift_report
    rows = []
    for seed in range(3):
        for step in (0, 50, 100, 150):
            d = -1.0 if step < 100 else -4.0 + (seed - 1)
            for arm, v in (("noclip", 0.0), ("clip", d)):
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": (v + 0.3 * seed) * 1e-4,
                             "dH_probe_is": 0.0, "dH_train": 0.0, "kl": 50e-4, "H_probe": 0.1 + step * 1e-4,
                             "ess": 0.5, "n_upper": 0, "n_lower": 0, "cells": [
                                 {"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0,
                                  "up": 0, "down": 0}]})
    md = drift_report.report(rows, segment=100, plan="later/plan.md")[0]
    assert "**Read by later/plan.md:" in md and "Interim" not in md
    seg = md[md.index("## By segment"):]
    assert "| | rollouts 0–99 | rollouts 100–199 | last − first segment, per seed |" in seg
    assert "| probe entropy (nats per token) | 0.1025 | 0.1125 | |" in seg
    assert "| seeds x branch points | 3 x 2 | 3 x 2 | |" in seg
    assert ("| clip − noclip | -1.00 ± 0.00: no effect of interest (within ±2.5e-4) (below 0, but smaller) | "
            "-4.00 ± 2.48: below 0 | -3.00 ± 2.48: below 0 |") in seg
    assert "| per-branch sd of it (1e-4) | 0.0 | 0.9 | |" in seg


def test_report_sections_labels_and_zero_advantage_tokens():
    """The family table is labelled confirmatory at 99.375%, everything else exploratory; the ESS share appears per
    arm; a cell of zero-advantage tokens (2 per branch point of 5 in all) is counted: 2.0 of 5.0, 40.0%."""
    import drift_report
    cells = [{"p": [0.0, 1.0], "adv": "+", "tokens": 3, "dlogp_sum": 0.3, "dH_sum": 0.0, "up": 0, "down": 0},
             {"p": [0.0, 1.0], "adv": "0", "tokens": 2, "dlogp_sum": 0.1, "dH_sum": 0.0, "up": 0, "down": 0}]
    md = drift_report.report(_rows({"noclip": 0.0, "clip": -1.0}, cells=cells))[0]
    assert "## The family (confirmatory): dH_probe, 99.375% t intervals" in md
    assert "## Exploratory (95% t; not in the family)" in md and "## Token anatomy (exploratory)" in md
    assert "(zero-advantage tokens: 2.0 of 5.0 per rollout, 40.0%)" in md
    assert "| 0–1 | 0 | 2.0 | +0.0500 ± 0.0000 |" in md  # 0.1 / 2 per token
    assert "| clip | 3 |" in md and "| 0.500 (0.500) |" in md


def test_statistics_by_hand():
    """t quantiles against a printed table (3 decimals: ±5e-4): t(0.975, 1) = 12.706, t(0.975, 15) = 2.131,
    t(0.995, 15) = 2.947, t(0.9975, 30) = 3.030. The sign interval of 16 numbers 1..16: the largest k with
    1 - 2 P(Bin(16, 1/2) <= k - 1) >= 0.95 is 4 (P(<= 3) = 697 / 65536), so [x_(4), x_(13)] = [4, 13], coverage
    1 - 1394 / 65536; 5 numbers reach no 95% interval (1 - 2 / 32 = 0.9375). The design effect of seed means (1, 3)
    from branch values (1, 1, 3, 3): var 2 / ((4 / 3) / 2) = 3. Power of a 95% t interval over 4 seeds (sd 1) to
    exclude 0 at a true 2: Φ(2 x 2 - 3.182) = Φ(0.818) = 0.793 (normal table, ±1e-3)."""
    import drift_report as d
    for p, df, t in ((0.975, 1, 12.706), (0.975, 15, 2.131), (0.995, 15, 2.947), (0.9975, 30, 3.030)):
        assert d.t_quantile(p, df) == pytest.approx(t, abs=5e-4)
    med, lo, hi, cov = d.median_interval([float(x) for x in range(16, 0, -1)])
    assert (med, lo, hi) == (8.5, 4.0, 13.0) and cov == pytest.approx(1 - 1394 / 65536, rel=F64 * 16)
    assert math.isnan(d.median_interval([1.0, 2, 3, 4, 5])[1])
    assert d.design_effect([1.0, 3.0], [1.0, 1.0, 3.0, 3.0]) == pytest.approx(3.0, rel=F64 * 16)
    assert d.power(1.0, 4, 2.0, level=0.95) == pytest.approx(0.793, abs=1e-3)
    assert d.equivalence_power(1.0, 4, 0.5, level=0.95) == 0.0  # the half-width 1.59 exceeds the margin
    assert d.label(-1e-4, 0.5e-4) == "no effect of interest (within ±2.5e-4) (below 0, but smaller)"
    assert d.label(-1e-4, 0.5e-4, margin=1.25e-4) == "below 0"

"""What a drift plan fixes before its data, and its readings: margins, the family of contrasts, the rules' labels.

experiments/results/drift-toy/plan.md (the replication; the later states read by the same rules) and
experiments/results/drift-smollm2/plan.md fix, before any line: the smallest effect of interest (SESOI; the
interaction's margin is half of it), the collapse-sized drift c (COLLAPSE, from `collapse_drift`), the number of
seeds K, the family of FAMILY contrasts on dH_probe read at LEVEL (Bonferroni, 1 - 0.05 / 8), and the least share of
an update's tokens the clip must bound for a reading to test anything (`Rules`). `label` reads one interval against
0 and its margin; `verdict_lines` turns the family's intervals into the plan's sentences. drift_report.py computes
the intervals and writes the report; tests/test_drift.py checks every rule on hand-built lines.
"""

import dataclasses
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery.jsonl import jsonl_path, open_jsonl  # noqa: E402

SESOI = 2.5e-4               # the smallest effect of interest, nats per token per rollout
INTERACTION_MARGIN = 1.25e-4  # "the two sides add": non-additivity under half the SESOI
# the collapse-sized drift c = 0.9 H1 / 300, fixed: H1 = GRPO's mean step-1 entropy over its coin seeds 0-9, the
# runs committed when the rule was written (collapse_drift computes it; later seeds do not move the yardstick)
COLLAPSE_H1, COLLAPSE_RUNS = 0.157, 10
COLLAPSE = 0.9 * COLLAPSE_H1 / 300
CONFIRM_K = 32               # the plan's seeds: below it every reading is interim
KL_MATCH = (0.8, 1.25)       # noclip-matched's KL / clip's (ratio of seed means): outside, brake and step not read


def family(sesoi, interaction):
    """The confirmatory family on dH_probe: (name, weights per arm, equivalence margin)."""
    return (("clip − noclip", {"clip": 1, "noclip": -1}, sesoi),
            ("upper side: clip-upper − noclip", {"clip-upper": 1, "noclip": -1}, sesoi),
            ("lower side: clip-lower − noclip", {"clip-lower": 1, "noclip": -1}, sesoi),
            ("interaction: clip − clip-upper − clip-lower + noclip",
             {"clip": 1, "clip-upper": -1, "clip-lower": -1, "noclip": 1}, interaction),
            ("brake: clip − noclip-matched", {"clip": 1, "noclip-matched": -1}, sesoi),
            ("step: noclip-matched − noclip", {"noclip-matched": 1, "noclip": -1}, sesoi),
            ("bandkl − clip-upper", {"bandkl": 1, "clip-upper": -1}, sesoi),
            ("bandkl − noclip", {"bandkl": 1, "noclip": -1}, sesoi))


FAMILY = family(SESOI, INTERACTION_MARGIN)
LEVEL = 1 - 0.05 / len(FAMILY)  # Bonferroni over the family: 99.375%, two-sided
EXPLORATORY = (("clip-higher − noclip", {"clip-higher": 1, "noclip": -1}, SESOI),
               ("clip-higher − clip", {"clip-higher": 1, "clip": -1}, SESOI),
               ("bandkl − clip", {"bandkl": 1, "clip": -1}, SESOI))


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a plan fixes before its data: the smallest effect of interest (the interaction's margin is half of
    it), the collapse yardstick c, the number of seeds K, and the least share of an update's tokens the clip must
    bound for its readings to test anything (None: no such check). The family and LEVEL are the same for all."""
    plan: str
    sesoi: float
    collapse: float
    collapse_note: tuple  # (its formula, where its entropy comes from)
    k: int
    acted: float | None = None
    primary: tuple | None = None  # ((name, weights), ...): a plan's own family, read by Holm (holm_lines)

    @property
    def interaction(self):
        return self.sesoi / 2

    @property
    def family(self):
        if self.primary:
            return tuple((name, weights, self.sesoi) for name, weights in self.primary)
        return family(self.sesoi, self.interaction)

    @property
    def level(self):
        """The family's intervals: 1 - 0.05 / its size (Bonferroni; under Holm, the first step's level)."""
        return 1 - 0.05 / len(self.family)

    @property
    def exploratory(self):
        return tuple((n, w, self.sesoi) for n, w, _ in EXPLORATORY)


# experiments/results/drift-toy/plan.md (the replication; the later-states plan reads by the same rules)
TOY = Rules("experiments/results/drift-toy/plan.md", SESOI, COLLAPSE,
            (f"0.9 x {COLLAPSE_H1:.3f} / 300", f"GRPO's step-1 entropy over {COLLAPSE_RUNS} committed coin runs"),
            CONFIRM_K)
# experiments/results/drift-smollm2/plan.md (lean): the toy's definitions on SmolLM2's probe entropy, H = 2.628 nats
# per token (the pilot's mean at its branch points): SESOI = H / 2 / 300 (named, too small to decide here), c = 0.9 H
# / 300; 12 seeds; two primary contrasts under Holm; the clip must bound at least 1% of an update's tokens
SMOLLM2_H = 2.628
SMOLLM2 = Rules("experiments/results/drift-smollm2/plan.md", round(SMOLLM2_H / 2 / 300, 6), 0.9 * SMOLLM2_H / 300,
                (f"0.9 x {SMOLLM2_H} / 300", "the SmolLM2 pilot's mean probe entropy"), 12, acted=0.01,
                primary=(("bandkl − clip", {"bandkl": 1, "clip": -1}), ("clip − noclip", {"clip": 1, "noclip": -1})))
# what each primary contrast's sign says, in the plan's words
HOLM_WORDS = {"bandkl − clip": ("Band-KL lowers the entropy change against the clip (against the paper's direction)",
                                "Band-KL raises the entropy change against the clip (the paper's direction)"),
              "clip − noclip": ("the clip drains the entropy against no clip",
                                "the clip raises the entropy against no clip")}
RULES = {"toy": TOY, "smollm2": SMOLLM2}


def label(m, half, margin=SESOI):
    """The reading of a difference's interval: below or above 0 where it excludes 0, within ±margin where it lies
    inside (an equivalence bound, not a failure to reject: with the sign where it also excludes 0), else
    unresolved."""
    if math.isnan(half):
        return "no interval (one seed)"
    lo, hi = m - half, m + half
    if -margin <= lo and hi <= margin:
        side = " (below 0, but smaller)" if hi < 0 else " (above 0, but smaller)" if lo > 0 else ""
        return f"no effect of interest (within ±{margin * 1e4:.3g}e-4){side}"
    return "below 0" if hi < 0 else "above 0" if lo > 0 else "unresolved"


def collapse_drift(coin_runs, horizon=300):
    """c = 0.9 H1 / horizon: the per-rollout drift that takes GRPO's entropy from its step-1 mean H1 (over the
    committed GRPO coin runs, <coin_runs>/clip-d*/metrics.jsonl or .gz, one per seed) to a tenth in `horizon`
    rollouts. -> (c, H1, n)."""
    h1 = []
    for run in sorted(glob.glob(os.path.join(coin_runs, "clip-d*", ""))):
        if jsonl_path(os.path.join(run, "metrics.jsonl")) is None:
            continue
        with open_jsonl(os.path.join(run, "metrics.jsonl")) as f:
            first = next((json.loads(x) for x in f if '"entropy"' in x), None)
        if first and first.get("step") == 1:
            h1.append(first["entropy"])
    if not h1:
        return math.nan, math.nan, 0
    H1 = sum(h1) / len(h1)
    return 0.9 * H1 / horizon, H1, len(h1)


def fmt(m, half, scale=1e4):
    return f"{m * scale:+.2f} ± {half * scale:.2f}" if not math.isnan(half) else f"{m * scale:+.2f}"


def _interval(m, half):
    return f"{fmt(m, half)}e-4, [{(m - half) * 1e4:+.2f}, {(m + half) * 1e4:+.2f}]"


def holm_lines(diffs, rules):
    """A lean plan's readings: Holm over its primary contrasts at familywise 0.05, from {name: (mean, half-width at
    rules.level, half-width at 95%)}. The contrast furthest from 0 in half-widths is read first, at rules.level; where
    its interval excludes 0 the next is read at 95% (two contrasts), else it and every later one are unresolved.
    Each line gives the rules.level interval and whether it excludes a collapse-sized effect ±c."""
    if len(rules.family) != 2:
        raise ValueError(f"holm_lines reads two primary contrasts, not {len(rules.family)}")
    named = [(n, *diffs[n]) for n, _, _ in rules.family if n in diffs and not math.isnan(diffs[n][1])]
    named.sort(key=lambda x: -abs(x[1]) / x[2] if x[2] else -math.inf)
    out, open_, c = [], True, rules.collapse
    for step, (name, m, half, half95) in enumerate(named):
        at, h = (rules.level, half) if step == 0 else (0.95, half95)
        excluded = open_ and abs(m) > h
        open_ = excluded
        what = HOLM_WORDS.get(name, ("below 0", "above 0"))[m > 0] if excluded else "unresolved"
        reach = ("excludes a collapse-sized effect" if m - half > -c and m + half < c else
                 "does not exclude a collapse-sized effect")
        out.append(f"- {name}: {_interval(m, half)} ({rules.level:.1%}): **{what}** (Holm step {step + 1}, at "
                   f"{at:.1%}); the interval {reach} (±c = ±{c * 1e4:.2f}e-4)")
    return out


def verdict_lines(diffs, kl_ratio=None, rules=TOY):
    """The plan's readings from the family {name: (mean, half at LEVEL)} on dH_probe, and noclip-matched's KL over
    the clip's (None: not run). A side "drains" where its interval lies below 0 (by less than the margin where it
    lies within it too); "Band removes the upper side's drain" needs the upper side to drain, Band-KL − clip-upper
    above 0 and Band-KL − no-clip within ±SESOI (the rules' margins and c). A lean plan's: `holm_lines`."""
    if rules.primary:
        return holm_lines(diffs, rules)
    out, c, sesoi, inter = [], rules.collapse, rules.sesoi, rules.interaction

    def get(name):
        full = next(n for n, _, _ in rules.family if n.startswith(name))
        return (full, *diffs[full]) if full in diffs else (full, math.nan, math.nan)

    def sided(m, half, margin, below, above, none):
        lab = label(m, half, margin)
        if math.isnan(half):
            return lab
        small = f", by less than ±{margin * 1e4:.2f}e-4" if -margin <= m - half and m + half <= margin else ""
        return (below + small if m + half < 0 else above + small if m - half > 0 else none if small
                else "unresolved: neither excludes 0 nor lies within the margin")

    name, m, half = get("clip − noclip")
    if not math.isnan(half):
        what = sided(m, half, sesoi, "the clip drains the entropy", "the clip raises the entropy",
                     "no effect of interest")
        collapse = (f"; no collapse-sized drain (lower end {(m - half) * 1e4:+.2f}e-4 > -c = {-c * 1e4:.2f}e-4)"
                    if m - half > -c else f"; a collapse-sized drain is not excluded (lower end "
                    f"{(m - half) * 1e4:+.2f}e-4 <= -c = {-c * 1e4:.2f}e-4)")
        out.append(f"- {name}: {_interval(m, half)}: **{what}**{collapse}")
    up = get("upper side")
    for side in ("upper side", "lower side"):
        name, m, half = get(side)
        if not math.isnan(half):
            out.append(f"- {name}: {_interval(m, half)}: **" + sided(
                m, half, sesoi, f"the {side} drains", f"the {side} raises the entropy",
                f"the {side}: no effect of interest") + "**")
    name, m, half = get("interaction")
    if not math.isnan(half):  # additivity is the question: within the margin reads "add", whatever the sign
        lab = label(m, half, inter)
        what = (f"the two sides add (within ±{inter * 1e4:.2f}e-4)" if lab.startswith("no effect") else
                f"the sides interact ({lab})" if lab in ("below 0", "above 0") else
                "unresolved: neither excludes 0 nor lies within the margin")
        out.append(f"- {name}: {_interval(m, half)}: **{what}**")
    brake, step = get("brake"), get("step")
    if not math.isnan(brake[2]) or not math.isnan(step[2]):
        if kl_ratio is None or not KL_MATCH[0] <= kl_ratio <= KL_MATCH[1]:
            out.append(f"- brake and step: **not read: noclip-matched's KL is {kl_ratio:.2f}x the clip's, outside "
                       f"[{KL_MATCH[0]}, {KL_MATCH[1]}]: the steps were not matched**" if kl_ratio is not None
                       else "- brake and step: not read (noclip-matched's KL unknown)")
        else:
            out.append(f"- step match: noclip-matched's KL is {kl_ratio:.2f}x the clip's (within "
                       f"[{KL_MATCH[0]}, {KL_MATCH[1]}])")
            readings = [(brake, "the clip drains beyond a no-clip step of the same size (its per-token shape)",
                         "the clip raises the entropy against a no-clip step of the same size",
                         "the clip acts as a smaller step: no effect of interest beyond it"),
                        (step, "a smaller step alone lowers the entropy change",
                         "a smaller step alone raises the entropy change",
                         "a smaller step alone: no effect of interest")]
            for (name, m, half), *labels in readings:
                if not math.isnan(half):
                    out.append(f"- {name}: {_interval(m, half)}: **" + sided(m, half, sesoi, *labels) + "**")
    name, m, half = get("bandkl − noclip")
    bu = get("bandkl − clip-upper")
    if not math.isnan(half) and not math.isnan(up[2]) and not math.isnan(bu[2]):
        drains, above = up[1] + up[2] < 0, bu[1] - bu[2] > 0
        equiv = -sesoi <= m - half and m + half <= sesoi
        verdict = ("Band removes the upper side's drain" if drains and above and equiv else
                   "not read: the upper side's drain is not shown" if not drains else
                   "not shown: Band-KL − clip-upper does not lie above 0" if not above else
                   f"not shown: Band-KL − noclip does not lie within ±{sesoi * 1e4:.2f}e-4")
        out.append(f"- {bu[0]}: {_interval(*bu[1:])}; {name}: {_interval(m, half)}: **{verdict}**")
    return out

"""How a comparison's numbers become a verdict: the statistics and rules of compare.py and horizon.py.

The paper's claims (docs/paper.md §5: (1) >= 2 points of mean@32, (2) ~10x the entropy, (3) far fewer
p < 0.2 tokens clipped upward), read from per-seed summaries (the rows of compare.json / horizon.json):
- a difference is paired by seed and read through its 95% t interval, mean ± t(0.975, n - 1) x s.e.
  (`t975`, `paired`); a rule that weighs one needs n >= 2 paired seeds, else "inconclusive (n = 1)";
- "no difference" needs that interval inside ±EQUIV (10%) of GRPO's final entropy (`weigh`), else
  "underpowered"; "the clip does not hold the entropy down" needs no-clip minus GRPO's interval to
  end below +EQUIV (`control_side`);
- "supports" / "reproduced" need the claim's size (SUPPORT_RATIO, 2 points, half the clips);
- a step metric is read at two WINDOWS (RANDOM_WINDOWS under coins), each named as averaged (the "last 60
  steps" of a 10-step run are all 10); where they disagree, "inconclusive (window-dependent)", where one is
  missing, "inconclusive (one window)";
- claim (2) is read against a no-clip arm once the clip acted (`clip_acted`, `entropy_control`);
  under `--reward random` `random_control` reads the clip's own drift and each arm's share of it (a Fieller
  interval for the ratio of paired means, read against ±FRACTION_MARGIN of GRPO and of no-clip).
The statistics live in paired_stats.py (re-exported here). Called by compare.py and horizon.py;
tests/test_compare.py states each rule on hand-built runs.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from paired_stats import (EQUIV, FRACTION_MARGIN, RANDOM_WINDOWS, SUMMARY_WINDOWS,  # noqa: E402,F401
                          SUPPORT_RATIO, T975, VERDICT_WINDOWS, WINDOWS, Diff, across, at_window, ci, drift_fraction,
                          fraction_label, mean_std, mean_std_cell, paired, t975, t_interval, table_steps, weigh,
                          window_name, windows)

DEFAULT_REWARD = "math-verify"   # train.py's --reward, for runs whose config.json predates the field


# --- verdicts ---------------------------------------------------------------------------------------------------
ONE_SEED = "one seed per method: no verdicts (the rules weigh each difference against its spread over seeds)"
# The clip "acted" when GRPO cut at least one p < 0.2 token upward per four steps on average: a floor (below it a
# clip / no-clip difference can come from runs drifting apart after one early clip), not a test of whether it matters
MIN_CLIPS_PER_STEP = 0.25
NO_CONTROL = "cannot tell 'Band does not help' from 'the clip does not drive the entropy here'"
TESTABLE = ("supports", "supports the direction, not the size", "does not reproduce")   # (2b) keeps its own label
RANDOM_NA = ("(1), (2a), (2b) and the held-out-accuracy guard do not apply: the training rewards are coins "
             "independent of the text (--reward {}), so nothing is learned from them; (R) reads the entropy over "
             "the last 60 steps and over the last half (RANDOM_WINDOWS)")


def verdict_windows(table):
    """The windows the verdicts of this table read, for a generated header: VERDICT_WINDOWS, or under coins the
    entropy's RANDOM_WINDOWS, each named as averaged over the table's runs."""
    if not is_random(regime(table)):
        return VERDICT_WINDOWS
    steps = table_steps(table)
    return (f"entropy read over two windows ({'; '.join(window_name(w, steps) for w in RANDOM_WINDOWS)}), the "
            f"upper-clip rate of p < 0.2 tokens over all steps and over their last half")


def is_random(reward):
    return reward == "random" or reward.startswith("random:")


def regime(table):
    """The --reward every run of the table shares (rows without one: DEFAULT_REWARD); a ValueError naming the
    values where they differ (a coin-reward run has no twin among learning runs)."""
    rewards = sorted({x.get("reward", DEFAULT_REWARD) for rows in table.values() for x in rows})
    if len(rewards) > 1:
        raise ValueError(f"the runs mix training rewards {rewards}; a comparison needs one --reward")
    return rewards[0] if rewards else DEFAULT_REWARD


def arm_name(config):
    method, delta = config
    return f"{method} δ={delta:g}" if method.startswith("band") else method


def accuracy_change(runs):
    """Diff over runs of final minus step-0 held-out accuracy, in points (n = 0 without a step 0)."""
    return t_interval([100 * (x["mean@n"] - x.get("mean@n_start", math.nan)) for x in runs])


def fell(d):
    """An accuracy change that is a fall: its 95% t interval lies below 0 (n >= 2), not merely its mean."""
    return d.n > 1 and d.mean + d.half < 0


def _arm(table, method):
    return next((runs for (m, _), runs in table.items() if m == method), None)


def clip_acted(clip):
    """The manipulation check on GRPO's runs: (acted, text). acted is True / False when the runs carry clip_counts'
    counts (at least MIN_CLIPS_PER_STEP upward clips of p < 0.2 tokens per step, mean over seeds), else None."""
    counts = [x.get("clip/n_low_p_upper") for x in clip]
    if any(c is None for c in counts):
        rate = mean_std([x["clip/low_p_upper_rate"] for x in clip])[0]
        return None, (f"GRPO's per-run clip counts are not in these numbers (its upper-clip rate of p < 0.2 tokens, "
                      f"clip/low_p_upper_rate, is {rate:.4f}): **not counted**")
    per_step = mean_std([c / x["steps"] for c, x in zip(counts, clip)])[0]
    acted = per_step >= MIN_CLIPS_PER_STEP
    return acted, (f"GRPO clipped {mean_std(counts)[0]:.1f} p < 0.2 tokens upward per run ({min(counts)}–"
                   f"{max(counts)} over {len(counts)} seeds, {per_step:.2f} per step; counted as clip/frac_upper x "
                   f"clip/low_p_share_of_upper x response tokens, summed over steps): "
                   f"**{'acted' if acted else f'barely acted (< {MIN_CLIPS_PER_STEP:g} per step)'}**")


def _entropy_reading(clip, noclip, band, key):
    """Claim (2) at one window (`key` = "entropy@w"): (label, text). See entropy_control."""
    degenerate = lambda runs: fell(accuracy_change(runs))  # noqa: E731
    mean = lambda runs: mean_std([x[key] for x in runs])[0]  # noqa: E731
    margin = EQUIV * mean(clip)
    dn, db, dbn = paired(noclip, clip, key), paired(band, clip, key), paired(band, noclip, key)
    wn, wb, wbn = weigh(dn, margin), weigh(db, margin), weigh(dbn, margin)
    ratio = mean(band) / mean(clip) if mean(clip) > 0 else math.inf
    text = (f"final entropy GRPO {mean(clip):.3f}, no-clip {mean(noclip):.3f}, Band-KL {mean(band):.3f}, "
            f"Band-KL / GRPO {ratio:.2f}; no-clip minus GRPO {ci(dn)}, Band-KL minus GRPO {ci(db)}, Band-KL minus "
            f"no-clip {ci(dbn)}; margin ±{margin:.3f}")
    side = control_side(dn, margin)
    if dn.n < 2:
        return f"inconclusive (n = {dn.n})", f"one seed paired with the no-clip arm; {text}"
    if side != "above":
        label, why = {"not above": ("not testable in this regime", "no-clip not above GRPO by more than the margin: "
                                    "the clip does not drive the entropy here" + {
                                        "equivalent": " (no-clip within ±margin of GRPO)",
                                        "below": " (no-clip below GRPO)"}.get(wn, "")),
                      "underpowered": ("inconclusive (underpowered)", "no-clip's interval reaches both above "
                                       "+margin and below 0")}[side]
    elif degenerate(noclip):
        label, why = "degenerate", "no-clip's extra entropy comes with accuracy below its start"
    elif wb == "above" and wbn == "equivalent":
        label, why = (("degenerate", "Band-KL's extra entropy comes with accuracy below its start") if degenerate(band)
                      else ("supports", "no-clip above GRPO, Band-KL within the margin of no-clip")
                      if ratio >= SUPPORT_RATIO else
                      ("supports the direction, not the size", f"no-clip above GRPO, Band-KL within the margin of "
                       f"no-clip, but Band-KL / GRPO {ratio:.2f} < {SUPPORT_RATIO:.2f}"))
    elif wbn == "below" and wb != "above":
        label, why = "does not reproduce", "no-clip above GRPO, Band-KL below no-clip and not above GRPO"
    elif wb == "above" and wbn == "below":
        label, why = "inconclusive", "Band-KL lies between GRPO and no-clip"
    elif wbn == "above":
        label, why = "inconclusive", "Band-KL above no-clip: more than removing the clip does"
    elif wb == wbn == "equivalent":
        label, why = "inconclusive", "Band-KL within the margin of both GRPO and no-clip"
    else:
        label, why = "inconclusive (underpowered)", "Band-KL resolved against neither GRPO nor no-clip"
    return label, f"{why}; {text}"


SIDES = {"above": "above GRPO", "not above": "not above GRPO by more than the margin", "underpowered": "underpowered"}


def control_side(dn, margin):
    """No-clip minus GRPO final entropy (dn) for claim (2), which needs the clip to hold the entropy down: "above"
    (the 95% t interval above 0 and reaching past +margin), "not above" (the interval ends at or below +margin:
    removing the clip does not raise the entropy by more than the margin), "underpowered" (neither), "n = 1"."""
    if dn.n < 2:
        return f"n = {dn.n}"
    return "not above" if dn.mean + dn.half <= margin else "above" if dn.mean - dn.half > 0 else "underpowered"


def entropy_control(table):
    """Claim (2), the entropy, read against the no-clip control arm: returns (reading, [lines]), each difference
    paired by seed through its 95% t interval against ±EQUIV of GRPO's final entropy. The clip barely acted
    (clip_acted) -> "not testable in this regime"; no no-clip arm -> "no no-clip arm"; at each window
    (control_side, _entropy_reading): n = 1 -> "inconclusive (n = 1)"; no-clip not above GRPO by more than the
    margin -> "not testable in this regime"; no-clip above GRPO: Band-KL within the margin of no-clip ->
    "supports" (Band-KL / GRPO >= SUPPORT_RATIO, else "the direction, not the size"), Band-KL below no-clip and
    not above GRPO -> "does not reproduce", an arm with more entropy and accuracy below its start "degenerate",
    anything else "inconclusive" naming why; windows that disagree -> "inconclusive (window-dependent)"."""
    clip, noclip, band = _arm(table, "clip"), _arm(table, "noclip"), table.get(("bandkl", 0.05))
    if not clip or not band:
        return None, []
    acted, check = clip_acted(clip)
    ws, steps = windows(table, "entropy"), table_steps(table)
    if noclip:
        margin = lambda w: EQUIV * mean_std([x[f"entropy@{w}"] for x in clip])[0]  # noqa: E731
        dn = {w: paired(noclip, clip, f"entropy@{w}") for w in ws}
        side = lambda w: SIDES.get(control_side(dn[w], margin(w)), "inconclusive")  # noqa: E731
        check += "; no-clip minus GRPO final entropy, " + "; ".join(
            f"{window_name(w, steps)}: {ci(dn[w])} against +{margin(w):.3f}: **{side(w)}**" for w in ws)
    else:
        check += "; no no-clip arm"
    arms = (("GRPO", clip), ("no-clip", noclip), ("Band-KL", band))
    changes = [(name, accuracy_change(runs)) for name, runs in arms if runs]
    below = ", ".join(name for name, d in changes if fell(d))
    acc = ", ".join(f"{name} {ci(d, '.1f')}" for name, d in changes if d.n)
    acc = f"held-out accuracy, final minus step 0, points: {acc}" if acc else "no step-0 accuracy in these numbers"
    acc += f" (below the start, 95% t interval below 0: {below})" if below else ""
    if acted is False or not noclip:
        reading = "not testable in this regime" if acted is False else "no no-clip arm"
        why = "the clip barely acted" if acted is False else NO_CONTROL
        why += f"; and no no-clip arm: {NO_CONTROL}" if acted is False and not noclip else ""
        grpo = lambda w: mean_std([x[f"entropy@{w}"] for x in clip])[0]  # noqa: E731
        text = "; ".join(f"{window_name(w, steps)}: final entropy GRPO {grpo(w):.3f}, "
                         f"Band-KL minus GRPO {ci(paired(band, clip, f'entropy@{w}'))}" for w in ws)
        label = f"no no-clip arm: {why}" if reading == "no no-clip arm" else reading
        text = text if reading == "no no-clip arm" else f"{why}; {text}"
    else:
        reading, text = across([(w, *_entropy_reading(clip, noclip, band, f"entropy@{w}")) for w in ws], "entropy",
                               steps=steps)
        label = reading
    return reading, [
        f"(control) Did the clip act? {check}",
        f"(2) BandPO keeps entropy ~10x higher than GRPO (\"supports\" needs Band-KL / GRPO >= "
        f"{SUPPORT_RATIO:.2f}, the geometric midpoint of 1x and 10x): **{label}** ({text}; {acc})"]


def random_control(table):
    """The random-reward regime (every run --reward random[:P]): coin rewards independent of the text make the
    expected policy gradient zero, so an arm's entropy drift against the no-clip arm is its clip's own. Returns
    (reading, [lines]).

    1. Manipulation check (clip_acted); "not testable in this regime" where the clip barely acted; "no no-clip
       arm" without one.
    2. Does the clip by itself move the entropy? GRPO minus no-clip entropy, paired by seed, at RANDOM_WINDOWS:
       "the clip lowers the entropy" / "raises" (the 95% t interval excludes 0), "no effect within the margin" (the
       interval inside ±EQUIV of GRPO's final entropy), "inconclusive (underpowered)", "inconclusive (n = 1)".
    3. Every other arm against GRPO directly, and each arm's change from its start (_against_clip_and_start).
    4. Only where the clip lowers or raises it: for every other arm, drift_fraction's f and its interval, read by
       fraction_label at each window.
    """
    clip, noclip = _arm(table, "clip"), _arm(table, "noclip")
    out = [RANDOM_NA.format(regime(table))]
    if not clip:
        return None, out
    acted, check = clip_acted(clip)
    out.append(f"(control) Did the clip act? {check}")
    head = "(R) Does the clip by itself move the entropy (GRPO minus no-clip final entropy, paired by seed)?"
    if not noclip:
        return "no no-clip arm", out + [f"{head} **no no-clip arm**: under coin rewards every arm is read against it"]
    ws, steps = windows(table, "entropy", RANDOM_WINDOWS), table_steps(table)

    moved = {"above": "the clip raises the entropy", "below": "the clip lowers the entropy",
             "equivalent": "no effect within the margin", "underpowered": "inconclusive (underpowered)"}
    reading, text = across([_side(clip, noclip, clip, w, moved) for w in ws], "entropy", RANDOM_WINDOWS, steps)
    if acted is False:
        reading, text = "not testable in this regime", f"the clip barely acted; {text}"
    out.append(f"{head} **{reading}** ({text})")
    out += _against_clip_and_start(table, clip, ws)
    if reading not in ("the clip lowers the entropy", "the clip raises the entropy"):
        return reading, out
    for config, runs in table.items():
        if config[0] in ("clip", "noclip"):
            continue
        per_w = []
        for w in ws:
            f, lo, hi, n = drift_fraction(runs, clip, noclip, f"entropy@{w}")
            per_w.append((w, fraction_label(f, lo, hi, n), f"f = {f:.2f}, 95% Fieller interval "
                          f"[{lo:.2f}, {hi:.2f}] (n = {n}), margin ±{FRACTION_MARGIN:g}"))
        label, text = across(per_w, "entropy", RANDOM_WINDOWS, steps)
        out.append(f"(R) {arm_name(config)}: the fraction of the clip's drift it removes, f = (arm - GRPO) / "
                   f"(no-clip - GRPO), a ratio of paired means: **{label}** ({text})")
    return reading, out


SIDES_GRPO = {"above": "above GRPO", "below": "below GRPO", "equivalent": "within the margin of GRPO",
              "underpowered": "inconclusive (underpowered)"}


def _side(a, b, clip, w, labels):
    """(w, label, text): a minus b entropy at window w, paired, weighed against ±EQUIV of GRPO's (`labels`)."""
    d, margin = paired(a, b, f"entropy@{w}"), EQUIV * mean_std([x[f"entropy@{w}"] for x in clip])[0]
    return w, labels.get(weigh(d, margin), f"inconclusive (n = {d.n})"), f"{ci(d)}, margin ±{margin:.3f}"


def _against_clip_and_start(table, clip, ws):
    """Under coins, without the no-clip arm's wander: each arm minus GRPO (paired, against the margin), and each
    arm's change from its start entropy (step 1, shared by the seed's runs), where the summaries hold it."""
    out, steps = [], table_steps(table)
    for config, runs in ((c, r) for c, r in table.items() if c[0] not in ("clip", "noclip")):
        label, text = across([_side(runs, clip, clip, w, SIDES_GRPO) for w in ws], "entropy", RANDOM_WINDOWS, steps)
        out.append(f"(R) Against GRPO: {arm_name(config)} minus GRPO entropy, paired: **{label}** ({text})")
    if all("entropy_start" in x for runs in table.values() for x in runs) and ws:
        name = window_name(ws[0], steps)
        name = name if name.startswith(("all", "the")) else f"the {name}"
        out.append(f"(R) Change from the start entropy (step 1) to {name}, per arm: " + "; ".join(
            f"{arm_name(c)} {ci(t_interval([x[f'entropy@{ws[0]}'] - x['entropy_start'] for x in r]))}"
            for c, r in table.items()))
    return out


def claim3(table):
    """(3) Band-KL clips far fewer p < 0.2 tokens upward than GRPO, at each window: "reproduced" needs the paired
    difference's 95% t interval below 0 and Band-KL's rate at most half GRPO's (the claim's "far fewer")."""
    band, base = table.get(("bandkl", 0.05)), table.get(("clip", 0.05))
    if not band or not base:
        return []

    def read(w):
        key = f"clip/low_p_upper_rate@{w}"
        lb, lg = (mean_std([x[key] for x in t])[0] for t in (band, base))
        d = paired(band, base, key)
        side = weigh(d, 0.0)
        v = (f"inconclusive (n = {d.n})" if d.n < 2 else "reproduced" if side == "below" and lb <= 0.5 * lg
             else "partly reproduced: fewer, but not far fewer" if side == "below"
             else "not reproduced (more)" if side == "above" else "not distinguishable at this scale")
        ratio = f"{lb / lg:.2f}" if lg > 0 else "–"
        return w, v, f"rate {lb:.4f} vs {lg:.4f}, Band-KL / GRPO {ratio}; difference {ci(d, '.4f')}"

    label, text = across([read(w) for w in windows(table, "clip/low_p_upper_rate")], "clip/low_p_upper_rate",
                         steps=table_steps(table))
    return [f"(3) BandPO clips far fewer p < 0.2 tokens at the upper bound (\"reproduced\": at most half GRPO's "
            f"rate): **{label}** ({text})"]


def verdicts(table, evals="the last evaluation"):
    """Plain verdicts for the paper's three claims, Band-KL (delta 0.05) against GRPO (clip) and clip-higher.

    (1): "reproduced" needs a paired difference of >= 2 points whose 95% t interval excludes 0; "not reproduced"
    an interval wholly below 2 points; else "not distinguishable at this scale"; "inconclusive (n = 1)" below two
    paired seeds; "not testable in this regime" where GRPO's clip barely acted (clip_acted). `evals` names the
    accuracy read. (2): entropy_control, or random_control under coin rewards (where (1) does not apply). (3): claim3.
    """
    if is_random(regime(table)):
        return random_control(table)[1] + claim3(table)
    band = table.get(("bandkl", 0.05))
    acted = clip_acted(_arm(table, "clip"))[0] if _arm(table, "clip") else None
    out = []
    for base_name in ("clip", "clip-higher"):
        base = table.get((base_name, 0.05))
        if not band or not base:
            continue
        d = paired(band, base, "mean@n", scale=100)
        v = (f"inconclusive (n = {d.n})" if d.n < 2 else "reproduced" if d.mean >= 2 and d.mean - d.half > 0
             else "not reproduced" if d.mean + d.half < 2 else "not distinguishable at this scale")
        if acted is False:
            v = "not testable in this regime (the clip barely acted)"
        out.append(f"(1) BandPO beats {base_name} by >= 2 points of mean@n: **{v}** (Band-KL minus {base_name} "
                   f"{ci(d, '.1f')} points, {evals})")
    return out + entropy_control(table)[1] + claim3(table)


def one_seed_check(table):
    """With one seed per arm no verdict is filed, but the manipulation check's numbers still say
    whether the regime could test anything: GRPO's upward clips of p < 0.2 tokens (against the
    MIN_CLIPS_PER_STEP floor) and the final-entropy differences to GRPO (the table's final entropy),
    each a single difference with no spread, and only between runs of the same seed. Plain text, no
    verdict label. -> [lines]."""
    clip = _arm(table, "clip")
    if not clip or clip[0].get("clip/n_low_p_upper") is None or not clip[0]["steps"]:
        return []
    n, steps, seed = clip[0]["clip/n_low_p_upper"], clip[0]["steps"], clip[0].get("seed")
    side = "at or above" if n / steps >= MIN_CLIPS_PER_STEP else "below"
    line = (f"(control, one seed) GRPO clipped {n} p < 0.2 tokens upward in {steps} steps "
            f"({n / steps:.3f} per step, {side} the {MIN_CLIPS_PER_STEP:g} floor)")
    for name, runs in (("no-clip", _arm(table, "noclip")), ("Band-KL δ=0.05", table.get(("bandkl", 0.05)))):
        if not runs:
            line += f"; no {name} arm"
        elif runs[0].get("seed") != seed:
            line += f"; {name} ran another seed"
        else:
            line += f"; {name} minus GRPO final entropy {runs[0]['entropy'] - clip[0]['entropy']:+.3f}"
    return [line + " (one seed: no s.e., so no reading)"]


# --- the long coin runs: GRPO non-inferior to no-clip (experiments/results/random-toy/plan.md) ----------------------
NI_MARGIN = 0.08               # nats per token, as first written (plan.md says why not a recomputed 0.0785)
NI_SEEDS = tuple(range(33))    # seeds 0-32 of clip and noclip; the reading waits for all of them
NI_WINDOW = 60                 # the last 60 steps of 300


def noninferiority(table, seeds=NI_SEEDS, margin=NI_MARGIN):
    """The long coin runs' reading (plan.md): GRPO minus no-clip entropy over the last NI_WINDOW steps, paired by
    seed, 95% t interval [lo, hi], against -margin. -> (label, text). In order, the first that applies:
    "not read (k of 33 seeds)" where a seed lacks its clip or noclip run; "not read (the clip's work not counted)"
    where no clip run carries clip/n_low_p_upper; "not testable in this regime" where the counted runs clipped
    fewer than MIN_CLIPS_PER_STEP p < 0.2 tokens upward per step; then, read off the interval (strict inequalities):
    lo > 0 "non-inferior; the clip raises the entropy"; lo > -margin and hi < 0 "non-inferior; the clip lowers the
    entropy by less than the margin"; lo > -margin "non-inferior"; hi < -margin "inferior: the clip drains by more
    than the margin"; hi < 0 "inconclusive; the clip lowers the entropy"; else "inconclusive"."""
    key, want = f"entropy@{NI_WINDOW}", {str(s) for s in seeds}
    arms = [{str(x.get("seed")): x for x in (_arm(table, m) or []) if str(x.get("seed")) in want}
            for m in ("clip", "noclip")]
    both = sorted(want & set(arms[0]) & set(arms[1]), key=int)
    if len(both) < len(want):
        return f"not read ({len(both)} of {len(want)} seeds)", "the reading waits for every seed of the plan"
    clip, noclip = [arms[0][s] for s in both], [arms[1][s] for s in both]
    counted = [s for s, x in zip(both, clip) if x.get("clip/n_low_p_upper") is not None and x.get("steps")]
    if not counted:
        return "not read (the clip's work not counted)", "no clip run carries response_length/mean and clip/low_p_*"
    per_step = mean_std([arms[0][s]["clip/n_low_p_upper"] / arms[0][s]["steps"] for s in counted])[0]
    check = (f"GRPO clipped {per_step:.2f} p < 0.2 tokens upward per step (mean over the {len(counted)} seeds whose "
             f"lines count it; seeds not counted: {', '.join(s for s in both if s not in counted) or 'none'})")
    if per_step < MIN_CLIPS_PER_STEP:
        return "not testable in this regime", f"{check}, below the {MIN_CLIPS_PER_STEP:g} floor"
    d = paired(clip, noclip, key)
    lo, hi = d.mean - d.half, d.mean + d.half
    text = f"{check}; GRPO minus no-clip entropy, last {NI_WINDOW} steps: {ci(d)} = [{lo:+.3f}, {hi:+.3f}], " \
           f"margin -{margin:g}"
    if lo > 0:
        return "non-inferior; the clip raises the entropy", text
    if lo > -margin:
        return ("non-inferior; the clip lowers the entropy by less than the margin" if hi < 0 else "non-inferior"), text
    if hi < -margin:
        return "inferior: the clip drains by more than the margin", text
    return ("inconclusive; the clip lowers the entropy" if hi < 0 else "inconclusive"), text

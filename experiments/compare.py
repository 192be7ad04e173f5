"""Compare the clipping methods at toy scale: train each for the same steps and seeds, plot, tabulate, give verdicts.

The paper (docs/paper.md §5) claims, on 3B-8B models: (1) BandPO beats GRPO and clip-higher on mean@32 by >= 2
points; (2) it keeps the policy entropy about ten times higher (~0.2 vs ~0.02); (3) it clips far fewer low-probability
tokens at the upper bound. This script runs `train.py` for every (method, delta, seed), one run after another, then
writes experiments/results/toy/compare.{json,md} and figures/toy_compare.png (by default; --results and --figure
name another experiment's, as experiments/results/<experiment>/ and figures/<experiment>_compare.png), with a plain
verdict per claim computed from the numbers (rules in `verdicts`, and `entropy_control` for the entropy claim,
which it reads against a no-clip arm, `--methods clip,noclip,bandkl`, and a check that the clip acted at all).
docs/results.md shows and discusses them.

    python experiments/compare.py                        # the toy comparison on the embedded tiny model (CPU)
    python experiments/compare.py --plot-only            # redraw and re-tabulate from the finished runs
    python experiments/compare.py --methods clip,bandkl --seeds 0,1,2 --nproc 8 --max-steps 300 \\
        --runs-dir runs/qwen2.5-3b --results experiments/results/qwen2.5-3b --figure figures/qwen2.5-3b_compare.png \\
        -- --model Qwen/Qwen2.5-3B-Instruct --data dapo-math-17k,math-l3to5 --eval-data aime24,amc23 \\
        --prompts-per-step 256 --group-size 16 --mini-batch-prompts 64 --lr 1e-6 --max-new-tokens 4096 ...

Everything after `--` goes to train.py unchanged, so the same script runs the real comparison on GPUs. Runs are
resumable: a finished run is skipped, an interrupted one continues from its last checkpoint (train.py --resume),
and a finished one is extended by a larger --max-steps. `--jobs 2 --nproc 1` trains two runs at once, each pinned
to its own cores (how the long-horizon comparison ran on a 2-core machine; experiments/horizon.py reports it). On a
GPU the jobs share it: the real-model comparison of docs/results.md ran `--jobs 9` on one H100, ~3 s per step each.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CURVES = [("eval", "held-out accuracy (mean@n)"), ("entropy", "policy entropy (nats/token)"),
          ("clip/frac", "clipped token fraction"), ("clip/low_p_upper_rate", "upper-clip rate of p < 0.2 tokens")]


def run_name(method, delta, seed):
    return f"{method}-d{delta:g}-s{seed}"


def configs(args):
    out = [(m, args.delta) for m in args.methods.split(",")]
    out += [("bandkl", float(d)) for d in args.bandkl_deltas.split(",") if d and float(d) != args.delta]
    return out


def finished(run_dir, max_steps):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        steps = [json.loads(line).get("step", 0) for line in f if line.strip()]
    return bool(steps) and max(steps) >= max_steps


def train_cmd(args, method, delta, seed, extra, port):
    """The torchrun command of one run: a fresh start, a resume from its last checkpoint, or None when finished."""
    run_dir = os.path.join(args.runs_dir, run_name(method, delta, seed))
    if finished(run_dir, args.max_steps):
        return None
    # torchrun as a module of this interpreter: a Python without a `torchrun` script beside it (a system or user
    # install) runs the same command
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_port", str(port), "train.py"]
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        return cmd + ["--resume", run_dir, "--max-steps", str(args.max_steps)]
    return cmd + ["--method", method, "--delta", str(delta), "--seed", str(seed), "--max-steps", str(args.max_steps),
                  "--out-dir", run_dir, "--no-export-hf", *extra]


def train_all(args, runs, extra):
    """Train every (method, delta, seed) in `runs`, `args.jobs` at a time; returns the wall time of each run.

    With several jobs each run gets its own cores (OMP_NUM_THREADS and vLLM's CPU binding), so concurrent runs do
    not compete for one core; the results do not depend on the jobs count beyond float summation order.
    """
    cores = os.cpu_count() or 1
    threads = max(1, cores // (args.jobs * args.nproc))
    pin = args.jobs > 1 and args.nproc == 1 and args.jobs <= cores   # one core set per slot, if there are enough
    pending, running, seconds = list(runs), {}, {}
    while pending or running:
        while pending and len(running) < args.jobs:
            slot = min(set(range(args.jobs)) - {s for s, _, _ in running.values()})
            run = pending.pop(0)
            cmd = train_cmd(args, *run, extra, port=29600 + slot)
            if cmd is None:
                continue
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            if pin:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(
                    str(c) for c in range(slot * threads, (slot + 1) * threads))
            print(" ".join(cmd), flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=None if args.verbose else subprocess.DEVNULL)
            running[proc] = (slot, run, time.time())
        time.sleep(1.0)
        for proc in [p for p in running if p.poll() is not None]:
            slot, run, t0 = running.pop(proc)
            if proc.returncode != 0:
                for other in running:   # stop the others too; every run resumes from its last checkpoint
                    other.terminate()
                sys.exit(f"compare.py: {run_name(*run)} failed (exit {proc.returncode}); rerun to resume it")
            seconds[run] = time.time() - t0
            print(f"{run_name(*run)}: {seconds[run]:.0f} s", flush=True)
    return seconds


def load_run(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    eval_key = next((k for r in rows for k in r if k.startswith("eval/") and "/mean@" in k), None)
    curves = {}
    for key, _ in CURVES:
        k = eval_key if key == "eval" else key
        curves[key] = [(r["step"], r[k]) for r in rows if k in r]
    return rows, eval_key, curves


def mean_std(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def clip_counts(run_dir):
    """The clip's work in one run, in tokens: upward clips, those of p < 0.2 tokens, and the first step that clipped.

    metrics.jsonl holds rates, so the counts are rebuilt per step: response tokens = response_length/mean x
    prompts_per_step x group_size (config.json), upward clips = clip/frac_upper x tokens (Â > 0 tokens above the
    upper bound, grpo._clip_metrics), of which p < 0.2 = clip/low_p_share_of_upper x upward clips; summed over
    steps and rounded to whole tokens. A count is None where config.json or a key is missing.
    """
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, filter(str.strip, f)) if "clip/frac" in r]
    completions = None
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = json.load(f)
        completions = cfg.get("prompts_per_step", 0) * cfg.get("group_size", 0) or None
    keys = ("response_length/mean", "clip/frac_upper", "clip/low_p_share_of_upper")
    n_upper = n_low_p_upper = None
    if completions and steps and all(k in r for r in steps for k in keys):
        upper = [r["clip/frac_upper"] * r["response_length/mean"] * completions for r in steps]
        n_upper = round(sum(upper))
        n_low_p_upper = round(sum(u * r["clip/low_p_share_of_upper"] for u, r in zip(upper, steps)))
    return {"steps": len(steps), "clip/n_upper": n_upper, "clip/n_low_p_upper": n_low_p_upper,
            "clip/first_step": next((r["step"] for r in steps if r["clip/frac"] > 0), None)}


def summarize_run(rows, eval_key, last=5):
    """Final numbers of one run: the last (and first) evaluation, step metrics averaged over the last `last` steps."""
    evals = [r for r in rows if eval_key and eval_key in r]
    final_eval = evals[-1] if evals else {}
    prefix = eval_key.rsplit("/", 1)[0] if eval_key else ""
    pass_keys = sorted((k for k in final_eval if k.startswith(prefix + "/pass@")), key=lambda k: int(k.split("@")[1]))
    steps = [r for r in rows if "entropy" in r][-last:]
    avg = lambda key: sum(r[key] for r in steps) / len(steps) if steps else math.nan  # noqa: E731
    return {"mean@n": final_eval.get(eval_key, math.nan),
            "pass@n": final_eval[pass_keys[-1]] if pass_keys else math.nan,
            "pass_k": pass_keys[-1].split("/")[-1] if pass_keys else "",
            "entropy": avg("entropy"), "clip/frac": avg("clip/frac"),
            "clip/frac_upper": avg("clip/frac_upper"), "clip/low_p_upper_rate": avg("clip/low_p_upper_rate"),
            "reward/mean": avg("reward/mean"), "mean@n_start": evals[0][eval_key] if evals else math.nan}


# --- verdicts: every difference weighed against its spread over seeds, paired by seed ---------------------------
# the verdict rules weigh each difference against its spread over seeds: one seed has none
ONE_SEED = "one seed per method: no verdicts (the rules weigh each difference against its spread over seeds)"
# The clip "acted" when GRPO cut at least one p < 0.2 token upward per four steps, on average. A floor, not a test
# of whether that matters (the no-clip arm tests that): below it nearly every step leaves the rare tokens alone, and
# a clip / no-clip difference can come from the runs drifting apart after one early clip. For scale: the toy
# long-horizon regime (lr 1e-4, 16 optimizer steps per rollout) clips ~0.8 such tokens per step, in ~45% of its
# steps; the SmolLM2 runs of docs/results.md 0.05-0.13.
MIN_CLIPS_PER_STEP = 0.25
NO_CONTROL = "cannot tell 'Band does not help' from 'the clip does not drive the entropy here'"


def paired(a, b, key, scale=1.0):
    """(mean, s.e., n) of the per-seed differences a - b of `key`, over the seeds both arms have.

    The runs of a seed share the initial policy and its first rollout (they are identical until a bound first
    binds), so pairing removes the seed's own luck from the difference. Rows without a "seed" (the older
    compare.json files, all of whose seeds finished) pair by position.
    """
    by_seed = lambda rows: {x.get("seed", i): x[key] for i, x in enumerate(rows)}  # noqa: E731
    sa, sb = by_seed(a), by_seed(b)
    diffs = [scale * (sa[k] - sb[k]) for k in sa if k in sb and not math.isnan(sa[k] - sb[k])]
    m, sd = mean_std(diffs)
    return m, sd / math.sqrt(len(diffs)) if diffs else math.nan, len(diffs)


def accuracy_change(runs):
    """(mean, s.e., n) over runs of final minus step-0 held-out accuracy, in points (n = 0 without a step 0)."""
    diffs = [100 * (x["mean@n"] - x.get("mean@n_start", math.nan)) for x in runs]
    diffs = [d for d in diffs if not math.isnan(d)]
    m, sd = mean_std(diffs)
    return m, sd / math.sqrt(len(diffs)) if diffs else math.nan, len(diffs)


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


def entropy_control(table):
    """Claim (2), the entropy, read against the no-clip control arm: returns (reading, [lines]). Paired by seed;
    "≈" means a paired difference within two standard errors; entropy is each run's final entropy.

    1. Manipulation check (clip_acted): GRPO clipped fewer than MIN_CLIPS_PER_STEP p < 0.2 tokens upward per step
       -> "not testable in this regime" (the clip barely acted).
    2. No no-clip arm -> "no no-clip arm": nothing tells "Band does not help" from "the clip does not drive the
       entropy here".
    3. No-clip ≈ GRPO -> "not testable in this regime"; no-clip below GRPO -> "inconclusive".
    4. The guard: an arm credited with more entropy whose mean final held-out accuracy is below its step-0
       accuracy is "degenerate" (entropy without learning), not "more entropy".
    5. No-clip above GRPO: Band-KL ≈ no-clip and above GRPO -> "supports"; Band-KL ≈ GRPO and below no-clip ->
       "does not reproduce"; anything else -> "inconclusive", naming why.
    """
    clip, noclip, band = _arm(table, "clip"), _arm(table, "noclip"), table.get(("bandkl", 0.05))
    if not clip or not band:
        return None, []
    arms = {name: runs for name, runs in (("GRPO", clip), ("no-clip", noclip), ("Band-KL", band)) if runs}
    # --- 1. the manipulation check: did the clip act, and does removing it change the entropy? ---
    acted, check = clip_acted(clip)
    if noclip:
        dn, sn, nn = paired(noclip, clip, "entropy")
        differs = abs(dn) > 2 * sn
        check += (f"; no-clip minus GRPO final entropy {dn:+.3f} ± {sn:.3f} (n = {nn}): "
                  f"**{'differs' if differs else 'does not differ'} beyond two s.e.**")
    else:
        check += "; no no-clip arm"
    # --- 2.-5. the reading ---
    entropy = lambda runs: mean_std([x["entropy"] for x in runs])[0]  # noqa: E731
    degenerate = lambda runs: accuracy_change(runs)[2] > 0 and accuracy_change(runs)[0] < 0  # noqa: E731
    db, sb, nb = paired(band, clip, "entropy")
    if acted is False:
        reading, why = "not testable in this regime", "the clip barely acted"
        why += "" if noclip else f"; and no no-clip arm: {NO_CONTROL}"
    elif not noclip:
        reading, why = "no no-clip arm", NO_CONTROL
    elif nn < 2:
        reading, why = "inconclusive", "fewer than two seeds paired with the no-clip arm"
    elif not differs:
        reading, why = "not testable in this regime", "no-clip ≈ GRPO: the clip does not drive the entropy here"
    elif dn < 0:
        reading, why = "inconclusive", "no-clip below GRPO: removing the clip lowers the entropy"
    elif degenerate(noclip):
        reading, why = "degenerate", "no-clip's extra entropy comes with accuracy below its start"
    else:
        dbn, sbn, _ = paired(band, noclip, "entropy")
        near_noclip, near_clip = abs(dbn) <= 2 * sbn, abs(db) <= 2 * sb
        if near_noclip and db > 2 * sb:
            reading, why = ("degenerate", "Band-KL's extra entropy comes with accuracy below its start") \
                if degenerate(band) else ("supports", "no-clip above GRPO, Band-KL ≈ no-clip")
        elif near_clip and dbn < -2 * sbn:
            reading, why = "does not reproduce", "no-clip above GRPO, Band-KL ≈ GRPO"
        elif near_clip and near_noclip:
            reading, why = "inconclusive", "Band-KL is within two s.e. of both GRPO and no-clip"
        elif db > 2 * sb and dbn < -2 * sbn:
            reading, why = "inconclusive", "Band-KL lies between GRPO and no-clip"
        elif dbn > 2 * sbn:
            reading, why = "inconclusive", "Band-KL above no-clip: more than removing the clip does"
        else:
            reading, why = "does not reproduce", "Band-KL below GRPO"
    finals = ", ".join(f"{name} {entropy(runs):.3f}" for name, runs in arms.items())
    diffs = [("no-clip minus GRPO", noclip, clip), ("Band-KL minus GRPO", band, clip),
             ("Band-KL minus no-clip", band, noclip)]
    diffs = ", ".join("{} {:+.3f} ± {:.3f}".format(name, *paired(a, b, "entropy")[:2]) for name, a, b in diffs
                      if a and b)
    acc = [(name, accuracy_change(runs)) for name, runs in arms.items()]
    below = ", ".join(name for name, runs in arms.items() if degenerate(runs))
    acc = ", ".join(f"{name} {m:+.1f} ± {se:.1f}" for name, (m, se, n) in acc if n)
    acc = f"held-out accuracy, final minus step 0: {acc} points" if acc else "no step-0 accuracy in these numbers"
    acc += f" (below the start: {below})" if below else ""
    ratio = entropy(band) / entropy(clip) if entropy(clip) > 0 else math.inf
    label = f"no no-clip arm: {why}" if reading == "no no-clip arm" else reading
    why = "" if reading == "no no-clip arm" else why + "; "
    return reading, [
        f"(control) Did the clip act? {check}",
        f"(2) BandPO keeps entropy ~10x higher than GRPO: **{label}** ({why}final entropy {finals}, Band-KL / GRPO "
        f"{ratio:.2f}; paired differences, mean ± s.e. over {nb} seeds: {diffs}; {acc})"]


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


def verdicts(table):
    """Plain verdicts for the paper's three claims, Band-KL (delta 0.05) against GRPO (clip) and clip-higher.

    (1) and (3): "reproduced" needs the paper's effect size and a difference larger than two standard errors of
    the per-seed differences; "not reproduced" needs the opposite, or a smaller effect, beyond two standard
    errors; anything else is "not distinguishable at this scale". Where GRPO's clip barely acted (clip_acted),
    Band-KL and GRPO run nearly the same updates, so (1) is "not testable in this regime". (3) measures the clip
    itself and needs no control. (2), the entropy, is read against the no-clip arm by `entropy_control`.
    """
    band = table.get(("bandkl", 0.05))
    acted = clip_acted(_arm(table, "clip"))[0] if _arm(table, "clip") else None
    out = []
    for base_name in ("clip", "clip-higher"):
        base = table.get((base_name, 0.05))
        if not band or not base:
            continue
        d, se, n = paired(band, base, "mean@n", scale=100)
        if d >= 2 and d > 2 * se:
            v = "reproduced"
        elif d + 2 * se < 2:
            v = "not reproduced"
        else:
            v = "not distinguishable at this scale"
        if acted is False:
            v = "not testable in this regime (the clip barely acted)"
        out.append(f"(1) BandPO beats {base_name} by >= 2 points of mean@n: **{v}** "
                   f"(difference {d:+.1f} ± {se:.1f} points, mean ± s.e. of the per-seed differences, n = {n})")
    out += entropy_control(table)[1]
    base = table.get(("clip", 0.05))
    if band and base:
        lb, lg = (mean_std([x["clip/low_p_upper_rate"] for x in t])[0] for t in (band, base))
        d, se, n = paired(band, base, "clip/low_p_upper_rate")
        if lb <= 0.5 * lg and -d > 2 * se:
            v = "reproduced"
        elif -d > 2 * se:
            v = "partly reproduced: fewer, but not far fewer"
        elif d > 2 * se:
            v = "not reproduced (more)"
        else:
            v = "not distinguishable at this scale"
        out.append(f"(3) BandPO clips far fewer p < 0.2 tokens at the upper bound: **{v}** "
                   f"(rate {lb:.4f} vs {lg:.4f}; difference {d:+.4f} ± {se:.4f}, n = {n})")
    return out


def markdown(table, verdict_lines, n_seeds, max_steps):
    pk = next((x["pass_k"] for runs in table.values() for x in runs if x["pass_k"]), "pass@n")
    lines = [f"{n_seeds} seeds x {max_steps} steps; mean ± std over seeds; step metrics averaged over the last 5 steps.",
             "", f"| method | δ | mean@n (%) | {pk} (%) | entropy | clip frac | upper-clip rate, p < 0.2 | train reward |",
             "|---|---|---|---|---|---|---|---|"]
    for (method, delta), runs in table.items():
        cell = lambda key, scale=1.0, fmt=".3f": "{:{f}} ± {:{f}}".format(  # noqa: E731
            *(scale * v for v in mean_std([x[key] for x in runs])), f=fmt)
        shown_delta = f"{delta:g}" if method.startswith("band") else "–"
        lines.append(f"| {method} | {shown_delta} | {cell('mean@n', 100, '.1f')} | {cell('pass@n', 100, '.1f')} | "
                     f"{cell('entropy')} | {cell('clip/frac', 1, '.4f')} | {cell('clip/low_p_upper_rate', 1, '.4f')} "
                     f"| {cell('reward/mean')} |")
    return "\n".join(lines + [""] + [f"- {v}" for v in verdict_lines]) + "\n"


def plot_seeds(ax, per_seed, label):
    """One method on `ax`: the mean over seeds ({step: value} each) as a line, min..max over seeds as a band."""
    if not per_seed:
        return
    steps = sorted(set.intersection(*(set(s) for s in per_seed)))
    line, = ax.plot(steps, [sum(s[t] for s in per_seed) / len(per_seed) for t in steps], label=label, lw=1.6)
    ax.fill_between(steps, [min(s[t] for s in per_seed) for t in steps], [max(s[t] for s in per_seed) for t in steps],
                    color=line.get_color(), alpha=0.15)


def plot(curves_by_config, path, title="Toy-scale comparison (mean over seeds; band = min..max)"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, name) in zip(axes.flat, CURVES):
        for label, runs in curves_by_config.items():
            plot_seeds(ax, [dict(c[key]) for c in runs if c[key]], label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="clip,clip-higher,dcpo,bandkl,bandtv,bandchi2",
                   help="train.py --method names, comma separated (noclip: the control arm without the clip)")
    p.add_argument("--delta", type=float, default=0.05, help="delta of every band method")
    p.add_argument("--bandkl-deltas", default="0.01,0.2", help="extra deltas for bandkl (the sweep)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (torchrun --nproc_per_node)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each on its own cores (CPU)")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "compare"))
    p.add_argument("--results", default=os.path.join(ROOT, "experiments", "results", "toy"),
                   help="directory of compare.{md,json} (default: the toy comparison's)")
    p.add_argument("--figure", default=os.path.join(ROOT, "figures", "toy_compare.png"), help="PNG path")
    p.add_argument("--title", default="Toy-scale comparison (mean over seeds; band = min..max)", help="figure title")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show train.py's output")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]

    runs = [(method, delta, seed) for seed in seeds for method, delta in configs(args)]   # seed-major: early
    seconds = {} if args.plot_only else train_all(args, runs, extra)                        # seeds cover all methods
    t_total = sum(seconds.values())
    table, curves = {}, {}
    for method, delta in configs(args):
        for seed in seeds:
            run_dir = os.path.join(args.runs_dir, run_name(method, delta, seed))
            if not finished(run_dir, args.max_steps):
                continue
            rows, eval_key, c = load_run(run_dir)
            table.setdefault((method, delta), []).append(
                {**summarize_run(rows, eval_key), "seed": str(seed), **clip_counts(run_dir)})
            label = f"{method} δ={delta:g}" if method.startswith("band") else method
            curves.setdefault(label, []).append(c)
    lines = (verdicts(table) if max(map(len, table.values()), default=0) > 1
             else [ONE_SEED] + one_seed_check(table))
    md = markdown(table, lines, len(seeds), args.max_steps)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "compare.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.results, "compare.json"), "w") as f:
        json.dump({f"{m}|{d}": runs for (m, d), runs in table.items()}, f, indent=1)
    plot(curves, args.figure, args.title)
    print(md)
    if t_total:
        print(f"total training wall time {t_total / 60:.1f} min")


if __name__ == "__main__":
    main()

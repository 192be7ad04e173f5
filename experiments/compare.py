"""Compare the clipping methods: train each for the same steps and seeds, plot, tabulate, give verdicts.

The paper (docs/paper.md §5) claims, on 3B-8B models: (1) BandPO beats GRPO and clip-higher on mean@32 by >= 2
points; (2) it keeps the policy entropy about ten times higher (~0.2 vs ~0.02); (3) it clips far fewer
low-probability tokens at the upper bound. This script runs `train.py` for every (method, delta, seed), then writes
<results>/compare.{json,md} and <figure> (by default experiments/results/toy/ and figures/toy_compare.png) with a
verdict per claim computed from the numbers by experiments/verdicts.py (paired by seed, 95% t intervals, an
equivalence margin, two windows, a no-clip control arm; horizon.py reads the same rules), shown in docs/results.md.

    python experiments/compare.py                        # the toy comparison on the embedded tiny model (CPU)
    python experiments/compare.py --plot-only            # redraw and re-tabulate from the finished runs
    python experiments/compare.py --from-json --max-steps 40   # re-issue compare.md from <results>/compare.json
    python experiments/compare.py --methods clip,noclip,bandkl --reward random   # every run on coin rewards
    python experiments/compare.py --methods clip,bandkl --seeds 0,1,2 --nproc 8 --max-steps 300 \\
        --runs-dir runs/qwen2.5-3b --results experiments/results/qwen2.5-3b --figure figures/qwen2.5-3b_compare.png \\
        -- --model Qwen/Qwen2.5-3B-Instruct --data dapo-math-17k,math-l3to5 --eval-data aime24,amc23 \\
        --prompts-per-step 256 --group-size 16 --mini-batch-prompts 64 --lr 1e-6 --max-new-tokens 4096 ...

Everything after `--` goes to train.py unchanged (after `--reward`, so it wins), so the same script runs the real
comparison on GPUs. Runs are resumable: a finished run is skipped, an interrupted one continues from its last
checkpoint (train.py --resume), and a finished one is extended by a larger --max-steps (a run whose lines were
gzipped first gets its plain metrics.jsonl back; a committed run keeps no checkpoint: delete its .gz to train it again).
`--jobs 2 --nproc 1` trains two runs at once, each pinned to its own cores. On a GPU the jobs share it (`--jobs 9` on
one H100).
"""

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]
from machinery.jsonl import jsonl_path, read_jsonl  # noqa: E402
from verdicts import (DEFAULT_REWARD, ONE_SEED, SUMMARY_WINDOWS, WINDOWS, arm_name,  # noqa: E402
                      at_window, is_random, mean_std, mean_std_cell, one_seed_check, regime, verdict_windows, verdicts)
from verdicts import entropy_control, random_control  # noqa: E402,F401 (re-exported)

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
    if jsonl_path(path) is None:
        return False
    steps = [r.get("step", 0) for r in read_jsonl(path)]
    return bool(steps) and max(steps) >= max_steps


def unpack_for_resume(run_dir):
    """Give a run whose lines were gzipped (scripts/compress_results.py) its plain metrics.jsonl back before
    train.py resumes it from a checkpoint: train.py keeps the lines up to the checkpoint and appends to the plain
    file, which hides the .gz from every reader, so without this the steps before the checkpoint would be lost. The
    .gz stays (the committed copy) until compress_results.py replaces it with the longer run."""
    plain = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(plain) or not os.path.isfile(plain + ".gz"):
        return
    with gzip.open(plain + ".gz", "rb") as src, open(plain + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(plain + ".tmp", plain)


def has_checkpoint(run_dir):
    """machinery/checkpoint.latest_checkpoint's rule (a finished step_* folder), without importing torch here."""
    root = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(root) and any(d.startswith("step_") and not d.endswith(".tmp") for d in os.listdir(root))


def train_cmd(args, method, delta, seed, extra, port):
    """The torchrun command of one run: a fresh start, a resume from its last checkpoint, or None when finished."""
    run_dir = os.path.join(args.runs_dir, run_name(method, delta, seed))
    if finished(run_dir, args.max_steps):
        return None
    # torchrun as a module of this interpreter: a Python without a `torchrun` script beside it (a system or user
    # install) runs the same command
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_port", str(port), "train.py"]
    reward = ["--reward", args.reward] if args.reward else []
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        if args.reward and run_reward(run_dir) != args.reward:   # a resume keeps the run's own --reward
            sys.exit(f"compare.py: error: {run_dir} was trained with --reward {run_reward(run_dir)!r}, "
                     f"not {args.reward!r}; give it another --runs-dir")
        if has_checkpoint(run_dir):
            unpack_for_resume(run_dir)
        elif os.path.isfile(os.path.join(run_dir, "metrics.jsonl.gz")):   # train.py would rewrite its steps: refused
            sys.exit(f"compare.py: error: {run_dir} has no checkpoint to continue its metrics.jsonl.gz from; delete "
                     f"that file to train the run again from step 0")
        else:   # stopped before its first checkpoint: train.py starts at step 0
            print(f"compare.py: {run_dir} has no checkpoint; train.py trains it again from step 0", flush=True)
        return cmd + ["--resume", run_dir, "--max-steps", str(args.max_steps)]
    return cmd + ["--method", method, "--delta", str(delta), "--seed", str(seed), "--max-steps", str(args.max_steps),
                  "--out-dir", run_dir, "--no-export-hf", *reward, *extra]


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
            cmd = train_cmd(args, *run, extra, port=args.master_port + slot)
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
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    eval_key = next((k for r in rows for k in r if k.startswith("eval/") and "/mean@" in k), None)
    curves = {}
    for key, _ in CURVES:
        k = eval_key if key == "eval" else key
        curves[key] = [(r["step"], r[k]) for r in rows if k in r]
    return rows, eval_key, curves


def run_reward(run_dir):
    """The run's --reward from its config.json (DEFAULT_REWARD where it has none)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return DEFAULT_REWARD
    with open(path) as f:
        return json.load(f).get("reward", DEFAULT_REWARD)


def clip_counts(run_dir):
    """The clip's work in one run, in tokens: upward clips, those of p < 0.2 tokens, and the first step that clipped.

    metrics.jsonl holds rates, so the counts are rebuilt per step: response tokens = response_length/mean x
    prompts_per_step x group_size (config.json), upward clips = clip/frac_upper x tokens (Â > 0 tokens above the
    upper bound, grpo._clip_metrics), of which p < 0.2 = clip/low_p_share_of_upper x upward clips; summed over
    steps and rounded to whole tokens. A count is None where config.json or a key is missing.
    """
    steps = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "clip/frac" in r]
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
    """Final numbers of one run: the last (and first) evaluation, step metrics averaged over the last `last` steps,
    and the verdicts' step metrics at their WINDOWS (`entropy@5`, `clip/low_p_upper_rate@all`, ...)."""
    evals = [r for r in rows if eval_key and eval_key in r]
    final_eval = evals[-1] if evals else {}
    prefix = eval_key.rsplit("/", 1)[0] if eval_key else ""
    pass_keys = sorted((k for k in final_eval if k.startswith(prefix + "/pass@")), key=lambda k: int(k.split("@")[1]))
    steps = [r for r in rows if "entropy" in r]
    avg = lambda key, n=last: mean_std([r[key] for r in steps[-n:]])[0]  # noqa: E731
    return {"mean@n": final_eval.get(eval_key, math.nan),
            "pass@n": final_eval[pass_keys[-1]] if pass_keys else math.nan,
            "pass_k": pass_keys[-1].split("/")[-1] if pass_keys else "",
            "entropy": avg("entropy"), "clip/frac": avg("clip/frac"),
            "clip/frac_upper": avg("clip/frac_upper"), "clip/low_p_upper_rate": avg("clip/low_p_upper_rate"),
            "reward/mean": avg("reward/mean"), "mean@n_start": evals[0][eval_key] if evals else math.nan,
            "entropy_start": steps[0]["entropy"] if steps else math.nan,
            **{f"{k}@{w}": at_window([r[k] for r in steps], w) for k, ws in SUMMARY_WINDOWS.items() for w in ws}}


def markdown(table, verdict_lines, n_seeds, max_steps):
    pk = next((x["pass_k"] for runs in table.values() for x in runs if x.get("pass_k")), "pass@n")
    reward = regime(table)
    coins = f" Training rewards: coins (--reward {reward})." if is_random(reward) else ""
    lines = [f"{n_seeds} seeds x {max_steps} steps; mean ± std over seeds; step metrics averaged over the last 5 "
             f"steps.{coins} Verdicts: differences paired by seed, mean ± half-width of the 95% t interval; "
             f"{verdict_windows(table)}.",
             "", f"| method | δ | mean@n (%) | {pk} (%) | entropy | clip frac | upper-clip rate, p < 0.2 "
             "| train reward |",
             "|---|---|---|---|---|---|---|---|"]
    for (method, delta), runs in table.items():
        cell = lambda key, scale=1.0, fmt=".3f": mean_std_cell([x[key] for x in runs], scale, fmt)  # noqa: E731
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
    # the legend on the first panel with curves (held-out accuracy has none under --eval-every 0)
    first = next((a for a in axes.flat if a.get_legend_handles_labels()[0]), None)
    if first is not None:
        first.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def load_tables(results):
    """{name: table} of the summaries in `results`, for a re-issue without the runs: compare.json (its entropy
    over the last 5 steps, summarize_run's default) and horizon.json (its entropy over the last 10, horizon.WINDOW;
    its upper-clip rate over all steps), each given the other's windows where both hold the same configs and seed
    counts (rows pair by position: both files list seeds in order). Older rows gain `entropy@5`, `entropy@10`,
    `clip/low_p_upper_rate@all` from these; nothing is recomputed."""
    tables = {}
    for name, own in (("compare", {"entropy@5": "entropy"}),
                      ("horizon", {"entropy@10": "entropy", "clip/low_p_upper_rate@all": "clip/low_p_upper_rate"})):
        path = os.path.join(results, f"{name}.json")
        if os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
            tables[name] = {(k.rsplit("|", 1)[0], float(k.rsplit("|", 1)[1])): rows for k, rows in raw.items()}
            for x in (x for rows in tables[name].values() for x in rows):
                for new, old in own.items():
                    x.setdefault(new, x[old])
    if not tables:
        sys.exit(f"compare.py: error: neither compare.json nor horizon.json in {results!r}")
    if len(tables) == 2:
        for a, b in (("compare", "horizon"), ("horizon", "compare")):
            for config, rows in tables[a].items():
                other = tables[b].get(config, [])
                for x, y in zip(rows, other) if len(rows) == len(other) else ():
                    for k in (k for k in y if "@" in k and k.split("@")[0] in WINDOWS):
                        x.setdefault(k, y[k])
    return tables


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
    p.add_argument("--master-port", type=int, default=29600,
                   help="torchrun port of the first job (job k: +k); another comparison at once needs another")
    p.add_argument("--reward", default=None, help="train.py --reward of every new run (random[:P]: coin rewards)")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "compare"))
    p.add_argument("--results", default=os.path.join(ROOT, "experiments", "results", "toy"),
                   help="directory of compare.{md,json} (default: the toy comparison's)")
    p.add_argument("--figure", default=os.path.join(ROOT, "figures", "toy_compare.png"), help="PNG path")
    p.add_argument("--title", default="Toy-scale comparison (mean over seeds; band = min..max)", help="figure title")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--from-json", action="store_true",
                   help="re-issue compare.md from <results>/compare.json (and horizon.json); no training, no figure")
    p.add_argument("--verbose", action="store_true", help="show train.py's output")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]

    if args.from_json:
        table = load_tables(args.results).get("compare")
        if table is None:
            sys.exit(f"compare.py: error: no compare.json in {args.results!r}")
        seeds = range(max(map(len, table.values())))
    else:
        runs = [(method, delta, seed) for seed in seeds for method, delta in configs(args)]   # seed-major: early
        seconds = {} if args.plot_only else train_all(args, runs, extra)                        # seeds cover all
        table, curves = {}, {}
        for method, delta in configs(args):
            for seed in seeds:
                run_dir = os.path.join(args.runs_dir, run_name(method, delta, seed))
                if not finished(run_dir, args.max_steps):
                    continue
                rows, eval_key, c = load_run(run_dir)
                table.setdefault((method, delta), []).append({**summarize_run(rows, eval_key), "seed": str(seed),
                                                              "reward": run_reward(run_dir), **clip_counts(run_dir)})
                curves.setdefault(arm_name((method, delta)), []).append(c)
    try:
        regime(table)   # every run on one --reward, also with one seed
        lines = (verdicts(table) if max(map(len, table.values()), default=0) > 1
                 else [ONE_SEED] + one_seed_check(table))
    except ValueError as e:
        sys.exit(f"compare.py: error: {e}")
    md = markdown(table, lines, len(seeds), args.max_steps)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "compare.md"), "w") as f:
        f.write(md)
    if not args.from_json:
        with open(os.path.join(args.results, "compare.json"), "w") as f:
            json.dump({f"{m}|{d}": runs for (m, d), runs in table.items()}, f, indent=1)
        plot(curves, args.figure, args.title)
    print(md)
    if not args.from_json and sum(seconds.values()):
        print(f"total training wall time {sum(seconds.values()) / 60:.1f} min")


if __name__ == "__main__":
    main()

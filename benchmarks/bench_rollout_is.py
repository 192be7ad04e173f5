"""The engine is not the trainer: what each --rollout-is mode touches, what --old-logp engine saves.

Runs the real command, `python train.py` (one process), for a few steps per setting: each
--rollout-is mode with --old-logp trainer, then --old-logp engine, all with the same seed, so step 1
samples the same rollouts and scores the same ρ in every setting. From each run's metrics.jsonl:
  tok out, seq out   rollout_is/tokens_out_frac, seqs_out_frac: share truncated or masked;
  ρ mean, ρ max      rollout_is/rho_mean, rho_max: ρ = π_old / π_engine per token (per sequence);
  Δlogp, out0.1      rollout/logprob_diff, ratio_out_0.1_frac: mean |Δ log p| of engine and
                     trainer, share of ρ_t outside [0.9, 1.1], before any optimizer step: the
                     old-log-prob pass, or with --old-logp engine the first mini-batch's forward;
  first r-1          ratio/first_abs_dev: mean |r − 1| on the first mini-batch, before any step;
  logprobs, update, step   time/* in seconds, the mean over steps 2.. (step 1 warms up).
Shares, ρ and the spread are means over all steps (ρ max: the maximum); `@1` columns are step 1.

    python benchmarks/bench_rollout_is.py -- --train-dtype float32 --rollout-dtype bfloat16
    python benchmarks/bench_rollout_is.py --steps 3 --modes none,token-mask,sequence-mask -- \\
        --model models/smollm2-135m-instruct --data arithmetic-instruct:1,3 ...   # after `--`
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"]
TIMES = ["time/logprobs", "time/update", "time/step"]


def run(label, flags, args):
    """One train.py run -> (its per-step metrics, its config.json)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "train.py", "--max-steps", str(args.steps), "--seed", str(args.seed),
               "--eval-every", "0", "--save-every", "0", "--no-export-hf",
               "--out-dir", os.path.join(d, "r"), *flags, *args.train_flags]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # one process: train.py starts its own single-rank group
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{label} failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
        with open(os.path.join(d, "r", "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f if '"reward/mean"' in line]
        with open(os.path.join(d, "r", "config.json")) as f:
            cfg = json.load(f)
    print(f"  {label}: {len(steps)} steps in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return steps, cfg


def row(steps):
    """The table's cells of one run: shares and ρ over all steps, timings over steps 2.."""
    def mean(key, ms=steps):
        return statistics.mean(m[key] for m in ms) if key in ms[0] else None
    first = steps[0].get
    return {
        "tok out@1": first("rollout_is/tokens_out_frac"),
        "tok out": mean("rollout_is/tokens_out_frac"),
        "seq out@1": first("rollout_is/seqs_out_frac"), "seq out": mean("rollout_is/seqs_out_frac"),
        "ρ mean": mean("rollout_is/rho_mean"),
        "ρ max": max(m["rollout_is/rho_max"] for m in steps) if "rollout_is/rho_max" in steps[0]
        else None,
        "Δlogp@1": first("rollout/logprob_diff"), "Δlogp": mean("rollout/logprob_diff"),
        "out0.1@1": first("rollout/ratio_out_0.1_frac"),
        "out0.1": mean("rollout/ratio_out_0.1_frac"),
        "first r-1": mean("ratio/first_abs_dev"), "reward": mean("reward/mean"),
        **{k.removeprefix("time/") + " s": mean(k, steps[1:] or steps) for k in TIMES},
    }


def cell(v):
    if v is None:
        return "–"
    return f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"


def commit():
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def cpu_model():
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor())
    return platform.processor()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="--rollout-is modes, comma separated")
    p.add_argument("--no-engine", action="store_true", help="skip the --old-logp engine run")
    p.add_argument("train_flags", nargs="*", help="train.py flags, after `--`")
    args = p.parse_args()
    start = commit()  # the commit the runs start from (others may commit while they run)
    settings = [(f"--rollout-is {m}", ["--rollout-is", m]) for m in args.modes.split(",")]
    if not args.no_engine:
        settings.append(("--old-logp engine", ["--old-logp", "engine"]))
    rows, cfg = {}, None
    for label, flags in settings:
        steps, cfg = run(label, flags, args)
        rows[label] = row(steps)
    end = commit()
    lines = [f"commit {start}{'' if end == start else f' (HEAD at {end} when the runs ended)'}, "
             f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}",
             "command: python benchmarks/bench_rollout_is.py " + " ".join(sys.argv[1:]),
             f"{os.path.relpath(cfg['model'], ROOT)} on {cfg['data']}: {cfg['train_dtype']} trainer, "
             f"{cfg['rollout_dtype']} engine, method {cfg['method']} δ {cfg['delta']}, "
             f"{cfg['prompts_per_step']} prompts x {cfg['group_size']}, mini-batches of "
             f"{cfg['mini_batch_prompts']} prompts, ≤ {cfg['max_new_tokens']} new tokens, "
             f"ρ in [{cfg['rollout_is_min']}, {cfg['rollout_is_max']}], seed {args.seed}, "
             f"{args.steps} steps; @1 = step 1 (the same rollouts in every setting), else the mean "
             f"over steps (timings: steps 2..{args.steps})",
             ""]
    keys = list(next(iter(rows.values())))
    lines.append("| setting | " + " | ".join(keys) + " |")
    lines.append("|---|" + "---:|" * len(keys))
    for label, r in rows.items():
        lines.append(f"| {label} | " + " | ".join(cell(r[k]) for k in keys) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

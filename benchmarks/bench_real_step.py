"""Training step of a real pretrained model on CPU: SmolLM2-135M-Instruct on GSM8K, this code against a revision.

Runs the real command, `torchrun --nproc_per_node N train.py --model models/smollm2-135m-instruct --data
data/gsm8k/train.jsonl ...`, for a few steps, and reads the time split from metrics.jsonl (the first step dropped:
warm-up) and the peak resident memory of the training process from /usr/bin/time (%M = max RSS of the largest
process of the run, in KiB; nan where /usr/bin/time is missing). `--before REV` first runs the same command in a
git worktree of revision REV (same .venv, same model and data files, absolute paths), so the two rows come from one
run on one machine: compare them as ratios, the machine is shared and noisy.

Shape: 1 rank, 8 prompts x 4 samples, 64 new tokens, micro-batch 8, prompts up to 512
tokens, one mini-batch per rollout (on-policy), vLLM rollout.

    make smollm2 && python benchmarks/bench_real_step.py --before 1b1bd1a      # ~10 min on 2 CPU cores
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
DATA = os.path.join(ROOT, "data", "gsm8k", "train.jsonl")
SPLIT = ["time/rollout", "time/logprobs", "time/update", "time/sync", "time/step"]
SHAPE = ["--prompts-per-step", "8", "--group-size", "4", "--mini-batch-prompts", "8", "--micro-batch-size", "8",
         "--max-new-tokens", "64", "--max-prompt-len", "512", "--lr", "1e-6"]


def run(repo, steps, nproc, rollout, extra):
    with tempfile.TemporaryDirectory() as d:
        timer = ["/usr/bin/time", "-f", "%M", "-o", os.path.join(d, "rss")] if os.path.exists("/usr/bin/time") else []
        cmd = [*timer, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "train.py", "--method", "bandkl", "--delta", "0.05", "--model", MODEL, "--data", DATA,
               "--max-steps", str(steps), "--eval-every", "0", "--save-every", "0", "--no-export-hf",
               "--rollout", rollout, "--out-dir", os.path.join(d, "run"), *SHAPE, *extra]
        r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True,
                           env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false"))
        if r.returncode:
            sys.exit(f"run in {repo} failed:\n{r.stderr[-3000:]}")
        with open(os.path.join(d, "run", "metrics.jsonl")) as f:
            ms = [json.loads(line) for line in f if line.strip() and "time/step" in line][1:]
        rss_gb = int(open(os.path.join(d, "rss")).read().split()[-1]) / 2**20 if timer else float("nan")
    row = {k: statistics.mean(m[k] for m in ms) for k in SPLIT}
    row["tokens/s"] = statistics.mean(m["tokens_per_s"] for m in ms)
    # sampled tokens per second of the rollout alone (tokens_per_s is per whole step)
    row["rollout tok/s"] = statistics.mean(m["tokens_per_s"] * m["time/step"] / m["time/rollout"] for m in ms)
    row["peak RSS GB"] = rss_gb
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--rollout", default="vllm")
    p.add_argument("--before", default="", help="git revision to measure first, in a temporary worktree")
    p.add_argument("--extra", default="", help="extra train.py flags for the current checkout only")
    args = p.parse_args()
    if not os.path.isfile(os.path.join(MODEL, "bandpo.json")):
        sys.exit(f"{MODEL} is missing: run `make smollm2` first")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
          f"{args.nproc} rank(s), rollout {args.rollout}, mean over steps 2..{args.steps}")
    rows = {}
    if args.before:
        with tempfile.TemporaryDirectory() as wt:
            subprocess.run(["git", "worktree", "add", "--detach", wt, args.before], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                rows[f"before ({args.before})"] = run(wt, args.steps, args.nproc, args.rollout, [])
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", wt], cwd=ROOT, capture_output=True)
    rows["now"] = run(ROOT, args.steps, args.nproc, args.rollout, args.extra.split())
    keys = [*SPLIT, "tokens/s", "rollout tok/s", "peak RSS GB"]
    print(f"{'':<20}" + "".join(f"{k.removeprefix('time/'):>14}" for k in keys))
    for name, r in rows.items():
        print(f"{name:<20}" + "".join(f"{r[k]:>14.2f}" for k in keys))
    if len(rows) == 2:
        (b, a) = rows.values()
        print(f"speed-up per step: {b['time/step'] / a['time/step']:.2f}x; peak RSS {b['peak RSS GB']:.1f} -> "
              f"{a['peak RSS GB']:.1f} GB")


if __name__ == "__main__":
    main()

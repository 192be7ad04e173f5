"""What bf16 does to the method: engine-vs-trainer log-probs, the first ratio, and the band near p = 1.

Runs the real command, `python train.py` (one process), for a few steps with the trainer and the engine in float32
and in bfloat16, two mini-batches per rollout (so the second's π_old comes from the no-grad pass), and reads from
metrics.jsonl:
  ratio/first_abs_dev          mean |r − 1| over the first mini-batch, before any optimizer step: 0 by construction,
                               train.py takes that mini-batch's π_old from its update forward (that the no-grad pass
                               runs the same kernels is tests/test_policy.py's);
  rollout/logprob_diff         mean |engine log-prob − trainer log-prob| of the sampled tokens;
  rollout/ratio_out_0.1_frac   share of tokens whose engine-vs-trainer ratio leaves [0.9, 1.1]: what a trainer that
                               took the engine's log-probs as π_old would see before any update;
  rollout/ratio_out_band_frac  share of those ratios outside the band of the engine's log-prob (Band-KL, δ = 0.05):
                               tokens such a trainer would clip for rounding alone.
Then, by arithmetic: near p = 1 the band is tight (r̄ → 1); a log-prob error e moves r by a factor e^e, so the band
only tolerates errors below log r̄(p). The table sets that room beside the measured bf16 error.

    python benchmarks/bench_bf16.py                                  # the tiny model, ~1 min
    python benchmarks/bench_bf16.py --model models/smollm2-135m-instruct --data data/gsm8k --max-new-tokens 32
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import band  # noqa: E402

KEYS = ["ratio/first_abs_dev", "rollout/logprob_diff", "rollout/ratio_out_0.1_frac", "rollout/ratio_out_band_frac",
        "entropy", "time/step"]
PHASES = ["time/rollout", "rollout tokens/s", "time/logprobs", "time/update"]


def run(args, dtype, engine_dtype=None):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "train.py", "--max-steps", str(args.steps), "--eval-every", "0", "--save-every", "0",
               "--no-export-hf", "--train-dtype", dtype, "--rollout-dtype", engine_dtype or dtype, "--out-dir", os.path.join(d, "r"),
               "--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--micro-batch-size", "8",
               "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-len", "512", "--lr", str(args.lr)]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--data", args.data] if args.data else []
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{dtype} run failed:\n{r.stderr[-3000:]}")
        with open(os.path.join(d, "r", "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f if '"reward/mean"' in line][args.skip:]
    for m in steps:  # sampled tokens over the rollout's seconds
        m["rollout tokens/s"] = m["tokens_per_s"] * m["time/step"] / m["time/rollout"]
    return {k: sum(m[k] for m in steps) / len(steps) for k in KEYS + PHASES}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--data", default="")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--skip", type=int, default=0, help="first steps left out of the means (warm-up)")
    p.add_argument("--combos", action="store_true", help="also the mixed runs (bf16 trainer + fp32 engine and the "
                   "reverse), and each phase's time: what --train-dtype / --rollout-dtype auto choose from")
    args = p.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{args.model or 'models/tiny-arith'}; {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"Python {platform.python_version()}; 4 prompts x 4, 2 mini-batches, mean over steps {args.skip + 1}-"
          f"{args.steps}")
    combos = [("float32", "float32"), ("bfloat16", "bfloat16")]
    combos += [("bfloat16", "float32"), ("float32", "bfloat16")] if args.combos else []
    short = {"float32": "fp32", "bfloat16": "bf16"}
    rows = {f"{short[t]} + {short[e]}": run(args, t, e) for t, e in combos}
    print(f"{'trainer + engine':<18}" + "".join(f"{k:>29}" for k in KEYS))
    for name, r in rows.items():
        print(f"{name:<18}" + "".join(f"{r[k]:>29.3g}" for k in KEYS))
    if args.combos:  # each phase depends on one of the two dtypes only
        print(f"\n{'trainer + engine':<18}" + "".join(f"{k:>18}" for k in PHASES))
        for name, r in rows.items():
            print(f"{name:<18}" + "".join(f"{r[k]:>18.3g}" for k in PHASES))
    rows = {"float32": rows["fp32 + fp32"], "bfloat16": rows["bf16 + bf16"]}

    e = rows["bfloat16"]["rollout/logprob_diff"]
    print(f"\nthe band near p = 1 (Band-KL, delta 0.05) against a log-prob error of e = {e:.3g} (bf16, measured):")
    print(f"{'p':>8}{'log r_upper':>14}{'log(1/r_lower)':>16}{'e / log r_upper':>18}")
    for prob in (0.5, 0.9, 0.99, 0.999, 0.9999):
        lower, upper = band.band(torch.tensor([math.log(prob)], dtype=torch.float64), "bandkl", 0.05)
        room = math.log(float(upper))
        print(f"{prob:>8}{room:>14.3g}{-math.log(float(lower)):>16.3g}{e / room:>18.3g}")


if __name__ == "__main__":
    main()

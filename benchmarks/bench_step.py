"""Training-step benchmark on the embedded tiny model: time split, tokens/s, and the Band overhead.

Table 1 runs the real command (`torchrun --nproc_per_node 2 train.py ...`) for a few steps per method and reads the
time split from metrics.jsonl (first step dropped: warm-up). Table 2 isolates the Band overhead on one fixed batch
in one process: the trainer-side work of a step (old log-probs, ratio_bounds, the mini-batch updates) for `clip` and
for `bandkl`, interleaved A/B/A/B on identical inputs, medians compared; the rollout and weight sync do not depend on
the method, so the whole-step ratio adds their measured time to both. Target: BandPO / clip <= 1.02.

    python benchmarks/bench_step.py                   # both tables (about 2-3 min on 2 CPU cores)
    python benchmarks/bench_step.py --skip-runs       # table 2 only
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SPLIT = ["time/rollout", "time/logprobs", "time/update", "time/sync", "time/step", "tokens_per_s"]


def real_runs(methods, steps, nproc, rollout):
    rows = {}
    for method in methods:
        with tempfile.TemporaryDirectory() as d:
            cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(nproc),
                   "train.py", "--method", method, "--max-steps", str(steps), "--eval-every", "0", "--save-every", "0",
                   "--no-export-hf", "--rollout", rollout, "--out-dir", d]
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
            with open(os.path.join(d, "metrics.jsonl")) as f:
                ms = [json.loads(line) for line in f if line.strip()][1:]
        rows[method] = {k: statistics.mean(m[k] for m in ms) for k in SPLIT}
    return rows


def band_overhead(reps):
    import torch

    import band
    import grpo
    import logprobs
    import rollout
    import train

    os.environ.setdefault("MASTER_PORT", "29731")
    cfg = train.Config(model=rollout.DEFAULT_MODEL, max_new_tokens=16)
    device = train.init_distributed()
    model = train.build_model(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    # one fixed batch with the default shape: 32 prompts x 8 samples of response length <= 16
    g = torch.Generator().manual_seed(0)
    B, P, T = cfg.prompts_per_step * cfg.group_size, 12, cfg.max_new_tokens
    input_ids = torch.randint(4, model.config.vocab_size, (B, P + T), generator=g)  # (B, P+T)
    lengths = torch.randint(4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (B, T)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], 1)  # (B, P+T)
    rewards = (torch.rand(B, generator=g) < 0.4).float()
    advantages = grpo.group_advantages(rewards, cfg.group_size)

    def trainer_side(method):
        t0 = time.perf_counter()
        with torch.no_grad():
            old_logp, _ = logprobs.sequence_logprobs(model, input_ids, attn, P, cfg.micro_batch_size)
        t1 = time.perf_counter()
        band.ratio_bounds(old_logp, method, delta=0.05)  # timed alone; update_policy computes it per micro-batch
        t2 = time.perf_counter()
        train.update_policy(model, optimizer, dataclasses.replace(cfg, method=method),
                            logprobs.RolloutBatch(input_ids, attn, mask, P), advantages, old_logp)
        return time.perf_counter() - t0, t2 - t1

    trainer_side("clip")  # warm-up
    times = {"clip": [], "bandkl": []}
    bounds = {"clip": [], "bandkl": []}
    for _ in range(reps):
        for method in times:
            total, b = trainer_side(method)
            times[method].append(total)
            bounds[method].append(b)
    torch.distributed.destroy_process_group()
    return {m: (statistics.median(times[m]), statistics.median(bounds[m])) for m in times}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rollout", default="auto")
    p.add_argument("--skip-runs", action="store_true")
    args = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}")
    rollout_sync = None
    if not args.skip_runs:
        rows = real_runs(["clip", "bandkl"], args.steps, args.nproc, args.rollout)
        print(f"\nTable 1: real runs, {args.nproc} ranks, mean over steps 2..{args.steps} (seconds)")
        print(f"{'method':<8}" + "".join(f"{k.split('/')[-1]:>14}" for k in SPLIT))
        for m, r in rows.items():
            print(f"{m:<8}" + "".join(f"{r[k]:>14.3f}" for k in SPLIT))
        rollout_sync = statistics.mean(r["time/rollout"] + r["time/sync"] for r in rows.values())
    res = band_overhead(args.reps)
    (tc, _), (tb, bb) = res["clip"], res["bandkl"]
    print(f"\nTable 2: Band overhead on one fixed batch (1 process, median of {args.reps} interleaved reps)")
    print(f"{'method':<8}{'trainer-side s':>16}{'bounds ms':>12}")
    for m, (t, b) in res.items():
        print(f"{m:<8}{t:>16.3f}{1e3 * b:>12.2f}")
    print(f"trainer-side ratio bandkl/clip: {tb / tc:.3f}")
    print(f"bounds share of the bandkl trainer-side time: {100 * bb / tb:.2f}%")
    if rollout_sync is not None:
        print(f"whole-step ratio (adding rollout + sync {rollout_sync:.2f} s to both): "
              f"{(tb + rollout_sync) / (tc + rollout_sync):.3f}  (target <= 1.02)")


if __name__ == "__main__":
    main()

"""The shared-prompt forward (--share-prompt) against the packed forward of every row: time of one micro-batch's
forward + backward through logprobs.sequence_logprobs, on a real model, at GRPO shapes.

A micro-batch holds k groups of G completions of one prompt each (prompt P tokens, responses T tokens). The packed
forward runs k·G·(P + T) tokens; the shared one k·P + k·G·T, plus a second model call and a repeated KV cache. The
two are timed alternately in one process (the machine is shared and noisy: read the ratio), median of --reps.

    python benchmarks/bench_shared_prompt.py                     # SmolLM2-135M-Instruct (make smollm2), ~2 min
    python benchmarks/bench_shared_prompt.py --model models/tiny-arith --prompt 8 --response 8
"""
import argparse
import os
import platform
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import logprobs  # noqa: E402


def batch(k, G, P, T, vocab, seed=0):
    """k prompts of P tokens, each with G responses of T tokens (no padding: the cost model above, exactly)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, vocab, (k, P), generator=g).repeat_interleave(G, 0)     # (k·G, P)
    ids = torch.cat([prompts, torch.randint(10, vocab, (k * G, T), generator=g)], 1)    # (k·G, P + T)
    return ids, torch.ones_like(ids)


def step(model, ids, attn, P, group_size):
    t0 = time.perf_counter()
    logp, _ = logprobs.sequence_logprobs(model, ids, attn, P, ids.shape[0], group_size=group_size)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--groups", type=int, default=2, help="k prompts per micro-batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=48, help="prompt tokens (SmolLM2's chat template + instruction)")
    p.add_argument("--response", type=int, nargs="+", default=[24, 8], help="response tokens (one row each)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if not os.path.isdir(args.model):
        sys.exit(f"bench_shared_prompt.py: error: no model at {args.model!r} (make smollm2)")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    print(f"{args.model}: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {args.groups} prompts x G = {args.group_size} per micro-batch, median of "
          f"{args.reps}\n")
    print("| prompt | response | packed tokens | shared tokens | packed s | shared s | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in args.response:
        ids, attn = batch(args.groups, args.group_size, args.prompt, T, model.config.vocab_size)
        times = {0: [], args.group_size: []}
        step(model, ids, attn, args.prompt, 0)  # warm-up
        for _ in range(args.reps):
            for gs in times:
                times[gs].append(step(model, ids, attn, args.prompt, gs))
        packed, shared = statistics.median(times[0]), statistics.median(times[args.group_size])
        k, G = args.groups, args.group_size
        print(f"| {args.prompt} | {T} | {k * G * (args.prompt + T)} | {k * args.prompt + k * G * T} | {packed:.2f} | "
              f"{shared:.2f} | {packed / shared:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

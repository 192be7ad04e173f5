"""Rollout throughput of vLLM vs HF generate on the embedded tiny model, and the cost of a weight sync.

The setting of one GRPO step on the default task: 64 held-out arithmetic prompts, n = 8 samples each at T = 1,
top-p 1 (512 completions, each stops at EOS after ~10 tokens). Tokens/s counts generated tokens only; each number
is the median of --repeats runs after one warm-up. Weight sync: sync_weights from a separate HF module (vLLM:
collective_rpc("reload_weights"); HF: parameter copy into the engine's own module; an HF engine that shares the
trainer's module needs none).

    python benchmarks/bench_rollout.py [--prompts 64 --n 8 --repeats 3]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import data  # noqa: E402
import rollout  # noqa: E402


def median_time(fn, repeats):
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=rollout.DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with open(os.path.join(args.model, "bandpo.json")) as f:
        levels = tuple(json.load(f)["levels"])  # the default task the model was built for
    trainer_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    kinds = ["hf"] + (["vllm"] if rollout.vllm_available() else [])
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        engine = rollout.make_engine(kind, args.model)
        startup = time.perf_counter() - t0
        records = data.arithmetic(args.prompts, split="test", levels=levels, seed=0)
        texts = [engine.tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                 for r in records]
        prompts = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        gen_s, out = median_time(lambda: engine.generate(prompts, args.n, sampling), args.repeats)
        tokens = sum(len(c.token_ids) for c in out)
        sync_s, _ = median_time(lambda: rollout.sync_weights(engine, trainer_model), max(args.repeats, 5))
        rows.append((kind, startup, gen_s, tokens, tokens / gen_s, sync_s))
        engine.close()

    print(f"\n{args.prompts} prompts x n={args.n}, T=1, top-p 1, max {args.max_new_tokens} new tokens; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs\n")
    print("| engine | startup (s) | generate (s) | generated tokens | tokens/s | weight sync (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, startup, gen_s, tokens, tps, sync_s in rows:
        print(f"| {kind} | {startup:.1f} | {gen_s:.2f} | {tokens} | {tps:,.0f} | {sync_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()

"""Rollout throughput of vLLM vs HF generate on the embedded tiny model, and the cost of a weight sync.

The setting of one GRPO step on the default task: 64 held-out arithmetic prompts, n = 8 samples each at T = 1,
top-p 1 (512 completions, each stops at EOS after ~10 tokens). Tokens/s counts generated tokens only; each number
is the median of --repeats rounds after one warm-up round, the engines taking turns (so that load from other
processes hits both alike); both live in this one process, as in training (vLLM pins its threads to a core).
Weight sync: sync_weights from a separate HF module (vLLM: collective_rpc("reload_weights"); HF: a parameter copy
into the engine's own module -- an HF engine that shares the trainer's module needs none).
On a 2-core machine shared with other jobs the numbers move by 2-4x between runs: compare engines within a run.

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


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


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
    engines, startup = {}, {}
    for kind in kinds:
        startup[kind], engines[kind] = timed(lambda: rollout.make_engine(kind, args.model))
    tok = engines["hf"].tokenizer
    records = data.arithmetic(args.prompts, split="test", levels=levels, seed=0)
    prompts = [tok(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in records]
    sampling = rollout.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    gen, tokens, sync = {k: [] for k in kinds}, {}, {k: [] for k in kinds}
    load_before = os.getloadavg()[0]
    for round_ in range(args.repeats + 1):
        for kind, engine in engines.items():
            seconds, out = timed(lambda: engine.generate(prompts, args.n, sampling))
            sync_s, _ = timed(lambda: rollout.sync_weights(engine, trainer_model))
            if round_:
                gen[kind].append(seconds)
                sync[kind].append(sync_s)
                tokens[kind] = sum(len(c.token_ids) for c in out)
    load_after = os.getloadavg()[0]
    for engine in engines.values():
        engine.close()

    print(f"\n{args.prompts} prompts x n={args.n}, T=1, top-p 1, max {args.max_new_tokens} new tokens; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, load average {load_before:.1f} -> "
          f"{load_after:.1f}; medians of {args.repeats} rounds\n")
    print("| engine | startup (s) | generate (s) | generated tokens | tokens/s | weight sync (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in kinds:
        gen_s, sync_s = statistics.median(gen[kind]), statistics.median(sync[kind])
        print(f"| {kind} | {startup[kind]:.1f} | {gen_s:.2f} | {tokens[kind]} | {tokens[kind] / gen_s:,.0f} "
              f"| {sync_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()

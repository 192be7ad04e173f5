"""How far the rollout is from this CPU's limits: decode is bound by memory bandwidth, prefill by matmul throughput.

Measures the machine (copy bandwidth of a 1 GB tensor; fp32/bf16 matmul GFLOP/s at a decoder layer's shape, all
threads) and prints the time a rollout cannot beat, from the model's config and the shape:
  decode, per step: every weight is read once for the whole batch, plus each sequence's KV cache so far:
      bytes = params x bytes/param + B x (P + t) x layers x 2 x kv_heads x head_dim x bytes/value
  prefill: 2 x params FLOPs per prompt token (G samples of a prompt share its prefill: vLLM's prefix cache).
Compare the bound with `rollout tok/s` of benchmarks/bench_real_step.py (the same default shape).

    python benchmarks/bench_roofline.py                          # SmolLM2-135M, 8 prompts x 4, ~200 + 64 tokens
"""
import argparse
import os
import time

import torch
from transformers import AutoConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def best_of(fn, n=5):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=200)  # GSM8K through SmolLM2's chat template: ~150-250
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    c = AutoConfig.from_pretrained(a.model)
    dtype = getattr(torch, a.dtype)
    size = torch.finfo(dtype).bits // 8
    head_dim = c.hidden_size // c.num_attention_heads
    n_params = (c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
                + c.num_hidden_layers * (c.hidden_size * head_dim * (2 * c.num_attention_heads
                                                                      + 2 * c.num_key_value_heads)
                                         + 3 * c.hidden_size * c.intermediate_size))

    x = torch.empty(2**28, dtype=torch.float32).fill_(1.0)  # 1 GiB
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / best_of(lambda: y.copy_(x)) / 1e9  # read + write, GB/s
    a_ = torch.randn(2048, c.hidden_size, dtype=dtype)
    w = torch.randn(c.intermediate_size, c.hidden_size, dtype=dtype)
    flops = 2 * 2048 * c.hidden_size * c.intermediate_size / best_of(lambda: a_ @ w.T) / 1e9  # GFLOP/s

    B, T = a.prompts * a.group_size, a.new_tokens
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * size
    decode_bytes = sum(n_params * size + B * (a.prompt_len + t) * kv_per_token for t in range(T))
    t_decode = decode_bytes / (bandwidth * 1e9)
    t_prefill = 2 * n_params * a.prompts * a.prompt_len / (flops * 1e9)
    print(f"{os.path.basename(a.model)}: {n_params / 1e6:.1f} M params, {a.dtype}; {torch.get_num_threads()} threads")
    print(f"machine: copy bandwidth {bandwidth:.1f} GB/s, matmul {flops:.0f} GFLOP/s ({a.dtype}, a layer's MLP shape)")
    print(f"shape: {a.prompts} prompts x {a.group_size}, {a.prompt_len} prompt + {T} new tokens")
    print(f"decode  {decode_bytes / 1e9:7.1f} GB read  -> >= {t_decode:6.2f} s")
    print(f"prefill {2 * n_params * a.prompts * a.prompt_len / 1e12:7.2f} TFLOP    -> >= {t_prefill:6.2f} s")
    print(f"rollout >= {t_decode + t_prefill:.2f} s, i.e. <= {B * T / (t_decode + t_prefill):.0f} sampled tokens/s")


if __name__ == "__main__":
    main()

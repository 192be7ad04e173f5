"""The fused head's forward + backward on a CPU: eager chunk functions against compiled ones (--compile-head).

    python benchmarks/bench_fused_head.py [--tokens 1024 4096] [--dtype bfloat16] [--reps 3] [--threads N]

machinery/fused_head.HeadLogprob at SmolLM2-135M's head (hidden 576, vocabulary 49,152), the chunk rows a run
uses (logprobs.head_chunk_rows), random hidden states and targets, temperature 0.7, with the entropy. Per row: the
seconds of one forward + backward (median of --reps after a warm-up, which is also when the compiled functions
compile: its seconds are printed as `compile s`), the head's matmuls alone (the same four products per chunk:
forward, the backward's recomputed block, dX, dW; no elementwise pass), and the matmul FLOPs (4 x 2 n h V) per
second of each. What the matmuls leave is the chunk functions' elementwise work over (chunk, V) in float32, which
--compile-head fuses. Numbers are one run's on one machine: compare the rows, not machines.
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from logprobs import head_chunk_rows  # noqa: E402
from machinery import fused_head  # noqa: E402

HIDDEN, VOCAB = 576, 49152


def timed(fn, reps):
    t = time.perf_counter()
    fn()  # warm-up (and the compilation, for the compiled functions)
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def head_step(h, w, y, chunk, compiled):
    def run():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        logp, _ = fused_head.HeadLogprob.apply(hh, ww, y, chunk, True, 0.7, compiled)
        logp.sum().backward()
    return run


def matmuls_only(h, w, chunk):
    def run():
        gw = torch.zeros(w.shape, dtype=torch.float32)
        for s in range(0, h.shape[0], chunk):
            z = h[s:s + chunk] @ w.T              # forward block
            d = h[s:s + chunk] @ w.T              # the backward's recomputed block
            _ = d @ w                             # dX
            fused_head._add_matmul(gw, d.T, h[s:s + chunk])  # dW, into float32
            del z
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    chunk = head_chunk_rows(VOCAB)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"# bench_fused_head.py | commit {commit or '?'} | {cpu} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__} | {args.dtype} | chunk {chunk} rows | median of {args.reps}")
    print("| tokens | head | compile s | s | matmuls alone s | GFLOP/s | matmul GFLOP/s | elementwise share |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(dtype)
    for n in args.tokens:
        h = torch.randn(n, HIDDEN, generator=g).to(dtype)
        y = torch.randint(0, VOCAB, (n,), generator=g)
        flops = 4 * 2 * n * HIDDEN * VOCAB
        _, mm = timed(matmuls_only(h, w, chunk), args.reps)
        for name, compiled in (("eager", False), ("compiled", True)):
            first, s = timed(head_step(h, w, y, chunk, compiled), args.reps)
            print(f"| {n:,} | {name} | {first - s if compiled else 0:.1f} | {s:.3f} | {mm:.3f} | "
                  f"{flops / s / 1e9:.1f} | {flops / mm / 1e9:.1f} | {1 - mm / s:.0%} |", flush=True)


if __name__ == "__main__":
    main()

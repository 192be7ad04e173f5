"""The CPU's packed attention: one SDPA call per row (sdpa-rows) against one call over the packed sequence with a
block-diagonal causal mask (sdpa-block), forward + backward of one layer's attention, at SmolLM2-135M's heads.

A packed micro-batch of `rows` rows of lengths drawn uniform in [L/2, L] (seeded) is N tokens; sdpa-rows runs
sum n_i^2 of attention in `rows` calls, sdpa-block N^2 in one (the mask built once per forward and shared by the
layers: its time is divided by --layers). Prints one table: per setting N, the two kernels' ms (median of --reps
after a warm-up), their ratio, and what `packed_attention.sdpa_kernel` picks there (its constant ROW_CALL_PAIRS
comes from this table: a row call's cost from the many-short-rows settings, a masked pair's from the long ones).
For bf16 also sdpa-rows with the attention computed in float32 (`packed_attention.float32_attention`: q, k, v cast
up, the output back) and bf16's time over it.

    python benchmarks/bench_packed_attention.py                        # bf16 and float32, ~1 min on 2 cores
    python benchmarks/bench_packed_attention.py --threads 1            # a busy machine: one thread's CPU time
    python benchmarks/bench_packed_attention.py --dtypes float32 --rows 8,16 --lengths 64,256
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery import packed_attention  # noqa: E402


def timed(fn, reps, clock):
    fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="4,8,16", help="rows per packed micro-batch, comma separated")
    p.add_argument("--lengths", default="32,64,128,256,512", help="longest row L (rows drawn in [L/2, L])")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--heads", type=int, default=9)      # SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="layers sharing one mask (SmolLM2-135M: 30)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default). With 1, every time "
                   "is this thread's CPU time, which other processes on a busy machine do not inflate")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    print(f"commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu}, "
          f"{'amx' if 'amx_bf16' in flags else 'no amx'}, {'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16'}, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} thread(s), "
          f"{'CPU' if clock is time.thread_time else 'wall'} time, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"\n| dtype | rows | L | N | sum n_i^2 / N^2 | sdpa-rows ms | sdpa-block ms (mask ms / {a.layers}) | "
          f"rows / block | rule picks | sdpa-rows in float32 ms | rows / in float32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for dtype in a.dtypes.split(","):
        dt = getattr(torch, dtype)
        for rows in map(int, a.rows.split(",")):
            for L in map(int, a.lengths.split(",")):
                lengths = torch.randint(L // 2, L + 1, (rows,), generator=g).tolist()
                N = sum(lengths)
                q = torch.randn(1, a.heads, N, a.head_dim, dtype=dt, requires_grad=True)        # (1, H, N, D)
                k, v = (torch.randn(1, a.kv_heads, N, a.head_dim, dtype=dt, requires_grad=True)
                        for _ in range(2))                                                     # (1, Hkv, N, D)
                grad = torch.randn(1, N, a.heads, a.head_dim, dtype=dt)                        # (1, N, H, D)
                ms = {}
                for kernel in ("sdpa-rows", "sdpa-block"):
                    packing = packed_attention.make_packing(lengths, "cpu", kernel)
                    fn = packed_attention.KERNELS[kernel]
                    ms[kernel] = 1e3 * timed(lambda: fn(q, k, v, packing, None).backward(grad), a.reps, clock)
                mask_ms = 1e3 * timed(lambda: packed_attention.make_packing(lengths, "cpu", "sdpa-block"), a.reps, clock)
                ms["sdpa-block"] += mask_ms / a.layers
                up = "– | –"
                if dt in (torch.bfloat16, torch.float16):
                    packing = packed_attention.make_packing(lengths, "cpu", "sdpa-rows", upcast=True)
                    f32 = 1e3 * timed(lambda: packed_attention.KERNELS["sdpa-rows"](q, k, v, packing, None)
                                      .backward(grad), a.reps, clock)
                    up = f"{f32:.2f} | {ms['sdpa-rows'] / f32:.2f}"
                print(f"| {dtype} | {rows} | {L} | {N} | {sum(n * n for n in lengths) / N ** 2:.3f} | "
                      f"{ms['sdpa-rows']:.2f} | {ms['sdpa-block']:.2f} ({mask_ms / a.layers:.3f}) | "
                      f"{ms['sdpa-rows'] / ms['sdpa-block']:.2f} | {packed_attention.sdpa_kernel(lengths)} | {up} |",
                      flush=True)


if __name__ == "__main__":
    main()

"""Peak memory of logprobs.token_logprobs (chunked) vs the naive log_softmax + gather, on CPU, bf16 logits.

Each case runs in a fresh subprocess: the logits (B, T, V) bf16 are allocated first, then the peak resident set is
reset (Linux /proc/self/clear_refs "5") and the op runs (forward only, as when computing old/ref log-probs under
no_grad, or forward + backward of logp.sum(), as in the actor update). "extra" = peak RSS minus the RSS with the logits
already resident, so it is what each method adds on top of the logits that the model produces anyway. Bytes per
logit element are then extrapolated linearly in V to Qwen2.5's vocabulary, (8, 1024, 151936) (for the chunked method the
chunk term is B·chunk·V·4 bytes, also linear in V).

    .venv/bin/python benchmarks/bench_logprob_memory.py [--B 8] [--T 1024] [--vocabs 8192,16384,32768] [--chunk 64]
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_V = 151936                                  # Qwen2.5 vocabulary


def _rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def child(method, mode, B, T, V, chunk):
    import torch

    sys.path.insert(0, ROOT)
    import logprobs

    torch.manual_seed(0)
    logits = torch.empty(B, T, V, dtype=torch.bfloat16).normal_()           # (B, T, V) resident before the reset
    targets = torch.randint(0, V, (B, T))
    logits.requires_grad_(mode == "fwd+bwd")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                                         # reset VmHWM to the current RSS
    base = _rss_kb("VmRSS")
    with torch.set_grad_enabled(mode == "fwd+bwd"):
        if method == "naive":
            logp = logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        else:
            logp = logprobs.token_logprobs(logits, targets, chunk_size=chunk)
        if mode == "fwd+bwd":
            logp.sum().backward()
    print((_rss_kb("VmHWM") - base) * 1024)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--vocabs", default="8192,16384,32768")
    ap.add_argument("--chunk", type=int, default=None)                      # default: token_logprobs' own
    ap.add_argument("--child", nargs=2)                                      # internal: method mode
    ap.add_argument("--V", type=int)
    a = ap.parse_args()
    if a.chunk is None:
        sys.path.insert(0, ROOT)
        import inspect

        import logprobs

        a.chunk = inspect.signature(logprobs.token_logprobs).parameters["chunk_size"].default
    if a.child:
        return child(*a.child, a.B, a.T, a.V, a.chunk)

    real = a.B * a.T * REAL_V
    # a fixed mmap threshold: glibc otherwise raises it (up to 32 MB) and keeps freed chunks resident, inflating RSS
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    print(f"token log-prob peak memory on CPU, logits ({a.B}, {a.T}, V) bf16, chunk_size={a.chunk}; "
          "extra = peak − logits")
    print(f"{'method':8} {'mode':8} {'V':>6} {'logits GB':>9} {'extra GB':>9} {'B/logit':>8} {'@151936 GB':>10}")
    for mode in ("fwd", "fwd+bwd"):
        for method in ("naive", "chunked"):
            for V in map(int, a.vocabs.split(",")):
                out = subprocess.run([sys.executable, __file__, "--child", method, mode, "--B", str(a.B),
                                      "--T", str(a.T), "--V", str(V), "--chunk", str(a.chunk)],
                                     check=True, capture_output=True, text=True, env=env).stdout
                extra = int(out.split()[-1])
                per = extra / (a.B * a.T * V)
                print(f"{method:8} {mode:8} {V:6d} {a.B * a.T * V * 2 / 1e9:9.3f} {extra / 1e9:9.3f} {per:8.2f} "
                      f"{per * real / 1e9:10.2f}")
    print(f"(at V={REAL_V} the bf16 logits alone are {real * 2 / 1e9:.2f} GB; one fp32 chunk is "
          f"{a.B * a.chunk * REAL_V * 4 / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()

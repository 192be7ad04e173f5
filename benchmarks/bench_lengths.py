"""The update at real response lengths: row micro-batches, token budgets and packed rows, in one run.

A reasoning run's responses are long-tailed: the paper's recipe allows 4,096 tokens (docs/paper.md §4), and most
responses use a fraction of that. This benchmark draws response lengths from a seeded exponential with mean ~1/4
of the maximum (clipped to [1, max]), prompt lengths uniform in [P/2, P], and times policy.update_policy (one
process, gloo) on the same batch with row micro-batches (--micro-batch-size rows in rollout order, each padded to
its own longest row), with token budgets (--micro-batch-tokens: rows sorted by length, <= N padded tokens each) and
packed (--pack: each micro-batch's rows end to end without padding, <= N real tokens), interleaved A/B/A/B, the
first repetition of each dropped. Per setting: padded vs real tokens (prompt + response), real tokens per second, peak memory (RSS
growth of this process on CPU, max allocated on CUDA), and the activation-checkpointing decision the update ran
with. On a GPU it also prints MFU on real tokens (machinery/flops.model_flops, printed with the table, over the GPU's peak
bf16 FLOP/s, recomputation not counted). The loss is the same in every setting (the normalisers are global):
the benchmark checks the summed loss agrees to float32 rounding.

    python benchmarks/bench_lengths.py                                   # SmolLM2 on CPU, fp32 (make smollm2)
    python benchmarks/bench_lengths.py --budgets 2048,4096 --rows 32 --max-new-tokens 512
    python benchmarks/bench_lengths.py --model models/tiny-arith --max-new-tokens 64 --reps 2   # a quick look
    python benchmarks/bench_lengths.py --rows 16 --budgets 1024 --packed 1024,2048 --dtype bfloat16
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def lengths(n, mean, max_len, generator):
    """n response lengths ~ Exponential(mean), rounded up and clipped to [1, max_len]."""
    import torch
    draws = torch.empty(n).exponential_(1 / mean, generator=generator).ceil().clamp(1, max_len)
    return [int(x) for x in draws]


def make_batch(rows, prompt_len, max_new, mean, vocab, seed):
    import torch

    from logprobs import RolloutBatch
    g = torch.Generator().manual_seed(seed)
    resp = lengths(rows, mean, max_new, g)
    prompt = torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g).tolist()
    width = prompt_len + max(resp)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    for b in range(rows):
        ids[b, prompt_len - prompt[b]:prompt_len + resp[b]] = torch.randint(4, vocab, (prompt[b] + resp[b],),
                                                                            generator=g)
        attn[b, prompt_len - prompt[b]:prompt_len + resp[b]] = 1
    return RolloutBatch(ids, attn, attn[:, prompt_len:].float(), prompt_len), resp


def padded_tokens(batch, cfg):
    """Tokens the forward passes see: each micro-batch's (longest prompt + longest response) x its rows; packed, the
    real tokens."""
    import policy
    if cfg.pack:
        return int(batch.attn.sum())
    total = 0
    for rows in policy.mini_batches(len(batch), cfg):
        for mb in policy.micro_batches(rows, cfg, batch.spans):
            spans = [batch.spans[i] for i in (range(mb.start, mb.stop) if isinstance(mb, slice) else mb)]
            total += (max(s[0] for s in spans) + max(max(s[1] for s in spans), 1)) * len(spans)
    return total


class PeakRSS:
    """Peak resident memory above the start, sampled every 5 ms in a thread while the block runs (ru_maxrss is the
    process's high-water mark, which a later, smaller setting would never move)."""

    def __enter__(self):
        self.start, self.peak, self.running = self.now(), 0, True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.now() - self.start)
            time.sleep(0.005)

    @staticmethod
    def now():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--rows", type=int, default=32, help="responses in the batch (one mini-batch)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--mean-frac", type=float, default=0.25, help="mean response length / max")
    p.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch of the row setting")
    p.add_argument("--budgets", default="1024,2048,4096", help="token budgets to compare, comma separated")
    p.add_argument("--packed", default="", help="packed budgets (real tokens) to compare, comma separated")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="force it; unset: train.py's decision by memory")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per setting (plus one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch
    import torch.distributed as dist

    from machinery import memory
    from machinery.flops import device_peak_tflops, model_flops
    import policy
    import train
    from transformers import AutoConfig

    os.environ.setdefault("MASTER_PORT", "29741")
    device = train.init_distributed()
    mcfg = AutoConfig.from_pretrained(a.model)
    batch, resp = make_batch(a.rows, a.prompt_len, a.max_new_tokens, a.mean_frac * a.max_new_tokens,
                             mcfg.vocab_size, a.seed)
    batch = type(batch)(*(x.to(device) if torch.is_tensor(x) else x for x in
                          (batch.input_ids, batch.attn, batch.mask, batch.n_prompt)))
    adv = torch.randn(a.rows, generator=torch.Generator().manual_seed(a.seed + 1)).to(device)  # (B,) a loss != 0
    settings = ([("rows", 0)] + [(f"budget {b}", int(b)) for b in a.budgets.split(",") if b]
                + [(f"packed {b}", int(b)) for b in a.packed.split(",") if b])
    base = train.Config(model=a.model, prompts_per_step=1, group_size=a.rows, mini_batch_prompts=1,
                        micro_batch_size=a.micro_batch_size, max_prompt_len=a.prompt_len,
                        max_new_tokens=a.max_new_tokens, train_dtype=a.dtype, lr=1e-7)
    cfgs = {}
    for name, budget in settings:
        cfg = train.Config(**{**base.__dict__, "micro_batch_tokens": budget, "pack": name.startswith("packed")})
        ckpt = a.grad_checkpointing
        if ckpt is None:
            ckpt = memory.grad_checkpointing_default(mcfg, train.micro_batch_tokens(cfg),
                                                     2 if a.dtype == "bfloat16" else 4, memory.free_memory(device)[0])
        cfgs[name] = train.Config(**{**cfg.__dict__, "grad_checkpointing": ckpt})
    models = {}  # one model per checkpointing choice
    times = {name: [] for name, _ in settings}
    losses, peaks = {}, {}
    for rep in range(a.reps + 1):
        for name, _ in settings:
            cfg = cfgs[name]
            key = (cfg.grad_checkpointing, cfg.pack)
            if key not in models:
                torch.manual_seed(0)
                model = policy.build_model(cfg, device)
                models[key] = (model, torch.optim.SGD(model.parameters(), lr=0.0))
            model, opt = models[key]
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                sums, _, _ = policy.update_policy(model, opt, cfg, batch, adv, old_logp=None)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
            losses[name] = float(sums["sum_loss"])
            if rep:  # the warm-up's time and memory (first allocations of the process) are dropped
                times[name].append(elapsed)
                peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30
                                  if device.type == "cuda" else rss.peak / 2**30)
    real = int(batch.attn.sum())  # prompt + response tokens: what the forward and backward really process
    prompt_lens = torch.tensor([s[0] for s in batch.spans])
    n_params = sum(p.numel() for p in next(iter(models.values()))[0].parameters())
    peak_flops = (device_peak_tflops(device) or 0) * 1e12  # machinery/flops.py's table; 0: no MFU column
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    flops, formula = model_flops(mcfg, n_params, prompt_lens, torch.tensor(resp))
    print(f"{os.path.basename(a.model)} ({n_params / 1e6:.0f} M), {a.dtype}, {a.rows} responses, prompts "
          f"{a.prompt_len // 2}-{a.prompt_len} tokens, responses ~Exp(mean {a.mean_frac * a.max_new_tokens:.0f}) "
          f"clipped to [1, {a.max_new_tokens}] (drawn mean {statistics.mean(resp):.0f}, max {max(resp)}), one "
          f"on-policy mini-batch, median of {a.reps} reps; {device.type} ({cpu if device.type == 'cpu' else torch.cuda.get_device_name()}), "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; commit {commit}, {time.strftime('%Y-%m-%d')}")
    print(f"model FLOPs per update {flops / 1e12:.3f} T = {formula}; packed attention: "
          f"{__import__('machinery.packed_attention', fromlist=['x']).kernel_for(device)}")
    head = "| micro-batches | grad ckpt | padded tokens | real tokens | padded/real | update s | real tok/s |"
    head += " peak GB |" + (" MFU (real) |" if peak_flops else "")
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    ref = losses["rows"]
    for name, _ in settings:
        cfg = cfgs[name]
        pad = padded_tokens(batch, cfg)
        t = statistics.median(times[name])
        row = (f"| {name} | {'on' if cfg.grad_checkpointing else 'off'} | {pad} | {real} | {pad / real:.2f} | "
               f"{t:.2f} | {real / t:.0f} | {peaks[name]:.2f} |")
        if peak_flops:
            row += f" {100 * flops / t / peak_flops:.1f}% |"
        print(row)
        # the same loss: global normalisers; float32 sums in another order differ by <~ rows x u x |loss terms| (bf16
        # rounds other shapes differently: printed, not asserted)
        if a.dtype == "float32":
            assert abs(losses[name] - ref) <= 1e-4 * max(1.0, abs(ref)), (name, losses[name], ref)
    print(f"\nsummed loss in every setting: {', '.join(f'{losses[n]:.6f}' for n, _ in settings)}; peak GB: on CPU the resident memory added during the update (sampled), on CUDA the max allocated")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The SmolLM2 update on a CPU against this CPU's GEMM rate at the model's own shapes, split by phase.

Prints one table. First the GEMM rate (torch.mm, median of --reps, on the threads the run uses) in bf16 and
float32 at SmolLM2-135M's layer shapes for a micro-batch of --tokens tokens: each linear (q/o 576x576, k/v
576x192, gate/up 576x1536, down 1536x576) forward Y = X W^T and the two backward GEMMs dX = dY W and
dW = dY^T X, and the head's (576 x 49,152). Then one update of the SmolLM2 job (bench_vs_trl.py's: GSM8K, 8
prompts x 8 samples from the HF engine, --max-new-tokens, 2 optimizer steps, micro-batches of 8 rows, the
dtype `--train-dtype auto` picks) timed packed and padded (--no-pack), interleaved, median of --updates after
a warm-up (in bf16 on a CPU without AMX also packed with the attention in bf16, `packed-bf16-attn`, against the
default's float32 attention: packed_attention.float32_attention), and one packed update under torch.profiler, its
time split by phase from each op's own time:
layer matmuls (mm/addmm/bmm without the vocabulary in their shapes), attention (SDPA and what it calls), head
(any op with the vocabulary in its shapes: the fused head's matmuls and its log-softmax), optimizer (under
AdamW's step and zero_grad), elementwise (every other aten op) and other (the rest of the wall time: Python,
autograd, FSDP2's hooks). Matmul phases show their FLOP/s (the profiler's count) as a fraction of the GEMM rate
at the same shapes.

    python benchmarks/bench_cpu_roofline.py                # ~5 min on 2 idle cores (make smollm2 first)
    python benchmarks/bench_cpu_roofline.py --threads 1    # a busy machine: one thread's CPU time
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# SmolLM2-135M's linears (in, out) per layer; the head is (576 -> vocab)
LINEARS = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
           "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def gemm_rates(tokens, dtype, reps, vocab, clock):
    """{kind: FLOP/s} over the layer's linears for forward, dX and dW, and the head's forward: total FLOPs over
    total median time of torch.mm at each shape (bench_cpu_peak.gemm_rate)."""
    from bench_cpu_peak import gemm_rate
    shapes = {"forward": [], "backward dX": [], "backward dW": []}
    for k, n in LINEARS.values():
        shapes["forward"].append((tokens, k, n))       # X (t, k) @ W^T (k, n)
        shapes["backward dX"].append((tokens, n, k))   # dY (t, n) @ W (n, k)
        shapes["backward dW"].append((n, tokens, k))   # dY^T (n, t) @ X (t, k)
    shapes["head forward"] = [(min(tokens, 2048), 576, vocab)]
    out = {}
    for kind, dims in shapes.items():
        flops = [2 * m * k * n for m, k, n in dims]
        secs = [f / gemm_rate(m, k, n, dtype, reps, clock) for f, (m, k, n) in zip(flops, dims)]   # median times
        out[kind] = sum(flops) / sum(secs)
    return out


def phase_of(ev, vocab):
    """The phase of a profiler event, from its name, its shapes and its ancestors."""
    names, e = [], ev
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any("scaleddotproduct" in n.lower().replace("_", "") for n in names):  # forward and autograd's backward
        return "attention"
    if any(vocab in s for s in (ev.input_shapes or []) if isinstance(s, (list, tuple))):
        return "head"
    if ev.name in MATMUL:
        return "layer matmuls"
    return "elementwise" if ev.name.startswith("aten::") else "other"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the GEMM shapes (a packed micro-batch)")
    p.add_argument("--reps", type=int, default=5, help="GEMM repetitions per shape")
    p.add_argument("--updates", type=int, default=2, help="timed updates per setting (+1 warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--extra", default="", help="more train.py flags (a quick look: '--model models/tiny-arith "
                   "--data arithmetic:1,3')")
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import config
    import logprobs
    import policy
    import train
    from bench_cpu_peak import cpu_facts, sampled_batch
    from machinery import packed_attention

    load0 = os.getloadavg()
    cpu = cpu_facts()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    # one thread: its own CPU time, which other processes on a busy machine do not inflate (the profiler's split
    # stays in wall time: its shares, not its seconds, are read)
    clock = time.thread_time if threads == 1 else time.perf_counter
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    os.environ.setdefault("MASTER_PORT", "29745")
    device = train.init_distributed()
    flags = ["--model", os.path.join(ROOT, "models", "smollm2-135m-instruct"), "--data",
             os.path.join(ROOT, "data", "gsm8k", "train.jsonl"), "--prompts-per-step", "8", "--group-size", "8",
             "--mini-batch-prompts", "4", "--micro-batch-size", "8", "--max-new-tokens", str(a.max_new_tokens),
             "--max-prompt-len", "512", "--lr", "1e-6", "--method", "clip", "--no-grad-checkpointing",
             "--no-share-prompt", *shlex.split(a.extra)]
    base = config.resolve_config(config.parse_config(flags))
    vocab = __import__("transformers").AutoConfig.from_pretrained(base.model).vocab_size
    dtype = base.train_dtype

    # --- the GEMM rate at the model's shapes ---
    rates = {dt: gemm_rates(a.tokens, getattr(torch, dt), a.reps, vocab, clock) for dt in ("bfloat16", "float32")}
    print(f"[{time.strftime('%H:%M:%S')}] GEMM rates measured", file=sys.stderr, flush=True)

    # --- a batch of the job: step 0's prompts, sampled by the HF engine ---
    prompt_ids, batch = sampled_batch(base, device)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))           # (B,) loss != 0
    real = int(batch.attn.sum())
    print(f"[{time.strftime('%H:%M:%S')}] rollout: {len(batch)} rows, {real} real tokens", file=sys.stderr, flush=True)

    settings, models = {}, {}
    kinds = [("packed", True), ("padded", False)]
    if packed_attention.float32_attention(device, getattr(torch, dtype)):
        kinds.append(("packed-bf16-attn", True))
    for name, pk in kinds:
        cfg, free, _ = config.decide_grad_checkpointing(config.dataclasses.replace(base, pack=pk), device,
                                                        [len(x) for x in prompt_ids])
        settings[name] = cfg
        torch.manual_seed(cfg.seed)
        model = policy.build_model(cfg, device)
        if name == "packed-bf16-attn":
            setattr(model, logprobs.PACKED_UPCAST, False)
        models[name] = (model, policy.make_optimizer(model, cfg))
    padded_tokens = {name: sum(policy._cost(list(range(r.start, r.stop)) if isinstance(r, slice) else r,
                                            batch.spans, cfg.pack)
                               for _, mbs in policy.plan_micro_batches(len(batch), cfg, batch.spans, device)
                               for r in mbs) for name, cfg in settings.items()}

    def update(name):
        model, opt = models[name]
        cfg = settings[name]
        old_logp, old_ent = policy.batch_logprobs(model, cfg, batch, with_entropy=True, skip_first=True)
        t = clock()
        policy.update_policy(model, opt, cfg, batch, adv, old_logp, None, old_ent)
        return clock() - t

    times = {name: [] for name in settings}
    for rep in range(a.updates + 1):
        for name in settings:
            s = update(name)
            print(f"[{time.strftime('%H:%M:%S')}] {name} update {s:.2f} s{'' if rep else ' (warm-up)'}",
                  file=sys.stderr, flush=True)
            if rep:
                times[name].append(s)

    # --- one packed update under the profiler, split by phase (the other settings' models freed first: the profile's
    # events beside three models and their AdamW states passed 13 GB) ---
    model, opt = models.pop("packed")
    models.clear()
    old_logp, old_ent = policy.batch_logprobs(model, settings["packed"], batch, with_entropy=True, skip_first=True)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        t = time.perf_counter()
        policy.update_policy(model, opt, settings["packed"], batch, adv, old_logp, None, old_ent)
        wall = time.perf_counter() - t
    phases = {k: [0.0, 0.0] for k in ("layer matmuls", "attention", "head", "elementwise", "optimizer", "other")}
    for ev in prof.events():
        ph = phase_of(ev, vocab)
        phases[ph][0] += ev.self_cpu_time_total / 1e6
        phases[ph][1] += ev.flops or 0
    phases["other"][0] = max(0.0, wall - sum(s for k, (s, _) in phases.items() if k != "other"))
    load1 = os.getloadavg()

    # --- the table ---
    flags_seen = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu["flags"]]
    print(f"commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu['name']} "
          f"(family {cpu['family']}), {cpu['cores']} cores, flags {', '.join(flags_seen)}; torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), {threads} thread(s); load average {load0[0]:.1f} at the "
          f"start, {load1[0]:.1f} at the end; {'CPU time of the one thread' if threads == 1 else 'wall time'} "
          f"(the profile: wall time)")
    print(f"\n| GEMM at SmolLM2's shapes, {a.tokens} tokens | bfloat16 GFLOP/s | float32 GFLOP/s |\n|---|---:|---:|")
    for kind in rates["float32"]:
        print(f"| {kind} | {rates['bfloat16'][kind] / 1e9:.1f} | {rates['float32'][kind] / 1e9:.1f} |")
    layer_rate = sum(rates[dtype][k] for k in ("forward", "backward dX", "backward dW")) / 3
    print(f"\nThe job's update: {len(batch)} rows, {real} real tokens, {dtype}; padded / real tokens "
          + ", ".join(f"{n} {padded_tokens[n] / real:.2f}" for n in settings) + "; update s (median of "
          f"{a.updates}): " + ", ".join(f"{n} {statistics.median(times[n]):.2f}" for n in settings)
          + f"; packed / padded {statistics.median(times['packed']) / statistics.median(times['padded']):.2f}"
          + (f"; packed / packed-bf16-attn "
             f"{statistics.median(times['packed']) / statistics.median(times['packed-bf16-attn']):.2f}"
             if "packed-bf16-attn" in times else ""))
    print(f"\n| phase (packed update, profiled: {wall:.2f} s) | s | share | GFLOP/s | of the GEMM rate ({dtype}) |")
    print("|---|---:|---:|---:|---:|")
    for ph, (s, fl) in phases.items():
        ref = {"layer matmuls": layer_rate, "head": rates[dtype]["head forward"]}.get(ph)
        rate = f"{fl / s / 1e9:.1f}" if fl and s else "–"
        frac = f"{100 * fl / s / ref:.0f}%" if ref and fl and s else "–"
        print(f"| {ph} | {s:.2f} | {100 * s / wall:.0f}% | {rate} | {frac} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

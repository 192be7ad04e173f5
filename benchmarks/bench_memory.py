"""Where a training process's memory goes: resident memory after each phase of train.py's set-up and step.

Builds what `train.py` builds, in its order, in one process (1 rank, gloo): the FSDP2 model, AdamW, the vLLM engine
(or none with --rollout hf), then one rollout of the real shape, the engine's sleep, two updates on it and the
weight sync with the engine's wake-up, and prints the resident set
(RSS, /proc/self/statm) and the peak so far (ru_maxrss) after each phase, with what the phase should cost by
arithmetic (parameters x bytes). Defaults: SmolLM2-135M-Instruct, the shape of benchmarks/bench_real_step.py
(8 GSM8K prompts x 4 samples, 64 new tokens, micro-batch 8, one mini-batch), train.py's default flags.

    python benchmarks/bench_memory.py                               # SmolLM2, train.py's defaults
    python benchmarks/bench_memory.py --no-grad-checkpointing       # any train.py flag
    python benchmarks/bench_memory.py --kl-coef 0.001               # with the reference model
    python benchmarks/bench_memory.py --mmap-threshold 1048576      # first: glibc returns large blocks on free
"""
import ctypes
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import data  # noqa: E402
import grpo  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from logprobs import pack  # noqa: E402

MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
SHAPE = ["--model", MODEL, "--data", os.path.join(ROOT, "data", "gsm8k"), "--prompts-per-step", "8",
         "--group-size", "4", "--mini-batch-prompts", "8", "--micro-batch-size", "8", "--max-new-tokens", "64",
         "--max-prompt-len", "512", "--lr", "1e-6", "--out-dir", "/tmp/bench-memory"]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**30


def peak_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main():
    argv, threshold = sys.argv[1:], None
    if argv[:1] == ["--mmap-threshold"]:  # glibc: blocks above this size are mmapped and go back to the system on
        threshold, argv = int(argv[1]), argv[2:]  # free (a fixed M_MMAP_THRESHOLD, not glibc's growing one)
        assert ctypes.CDLL("libc.so.6").mallopt(-3, threshold) == 1, "mallopt(M_MMAP_THRESHOLD) failed"
        print(f"glibc M_MMAP_THRESHOLD = {threshold} bytes")
    cfg = train.load_run_config([*SHAPE, *argv])
    rows = []

    def row(phase, expected=""):
        rows.append((phase, rss_gb(), peak_gb(), expected))
        print(f"{phase:<34}{rows[-1][1]:>8.2f}{rows[-1][2]:>8.2f}   {expected}", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    records = data.load(cfg.data, split="train")
    ids, records, _ = data.tokenize_prompts(records, tokenizer, cfg.max_prompt_len)
    device = train.init_distributed()
    # as train.py decides them, once the device is set, from the training prompts' lengths
    cfg, free, source = train.decide_grad_checkpointing(cfg, device, [len(x) for x in ids])
    heap = threshold is None and train.keep_freed_memory(cfg, device, free, max(map(len, ids)))  # as train.py
    ids = ids[:cfg.prompts_per_step]
    print(f"{os.path.relpath(cfg.model, ROOT)}: {cfg.train_dtype} trainer, {cfg.rollout_dtype} engine "
          f"({cfg.rollout}), grad checkpointing {cfg.grad_checkpointing}, shared prompt {cfg.share_prompt}, heap "
          f"kept {heap}; {cfg.prompts_per_step} prompts x {cfg.group_size}, {cfg.max_new_tokens} new tokens, "
          f"micro-batch {cfg.micro_batch_size}; decided from {free / 2**30:.2f} GiB free ({source})")
    print(f"{'phase':<34}{'RSS GB':>8}{'peak GB':>8}   by arithmetic")
    row("python + torch + transformers")  # and the process group (a few MB)
    model = train.build_model(cfg, device)
    n = sum(p.numel() for p in model.parameters())
    gb = n * 4 / 2**30
    row("FSDP2 model (fp32 master weights)", f"{n / 1e6:.1f} M params x 4 B = {gb:.2f} GB")
    ref_model = train.build_model(cfg, device, trainable=False) if cfg.kl_coef > 0 else None
    if ref_model is not None:  # as train.py, with --kl-coef
        row("+ reference model (fp32 weights)", f"{gb:.2f} GB")
    optimizer = train.make_optimizer(model, cfg)
    engine = rollout.make_engine(cfg.rollout, cfg.model, tokenizer=tokenizer, seed=0, dtype=cfg.rollout_dtype,
                                 max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    rollout.sync_weights(engine, model)
    eb = 2 if cfg.rollout_dtype == "bfloat16" else 4
    row(f"+ {type(engine).__name__} ({cfg.rollout_dtype})",
        f"weights {n * eb / 2**30:.2f} GB + KV cache 0.25 GB" if isinstance(engine, rollout.VLLMEngine) else "a second model")
    t = time.time()
    completions = engine.generate(ids, cfg.group_size, rollout.Sampling(max_new_tokens=cfg.max_new_tokens, seed=0,
                                                                        logprobs=True))
    row(f"+ rollout ({time.time() - t:.0f} s)")
    engine.sleep()  # as train.py: the engine's weights and KV cache freed for the update (rollout.VLLMEngine.sleep)
    row("+ engine asleep")
    batch = pack(ids, completions, device)
    rewards = torch.rand(len(completions))
    adv = grpo.group_advantages(rewards, cfg.group_size)
    old = None if train.on_policy(cfg) else train.batch_logprobs(model, cfg, batch)[0]
    ref = None
    if ref_model is not None:
        ref = train.batch_logprobs(ref_model, cfg, batch)[0]
        row("+ reference pass", "its gathered weights freed after it")
    t = time.time()
    train.update_policy(model, optimizer, cfg, batch, adv, old, ref)
    row(f"+ update 1 ({time.time() - t:.0f} s, {tuple(batch.input_ids.shape)})",
        f"grads {gb:.2f} + AdamW 2 x {gb:.2f} GB + activations")
    t = time.time()
    train.update_policy(model, optimizer, cfg, batch, adv, old, ref)
    row(f"+ update 2 ({time.time() - t:.0f} s)")
    engine.wake_up(["weights"])
    rollout.sync_weights(engine, model)
    engine.wake_up(["kv_cache"])
    row("+ weight sync")
    engine.close()


if __name__ == "__main__":
    main()

"""The machinery a reader of the paper may skip: what makes the concept files at the root run well on real machines,
none of it BandPO's mathematics.

    memory.py          the memory a rank has (host RAM under its cgroup limit, or the GPU) and what an update needs
    fused_head.py      the LM head fused with the log-prob of packed micro-batches, its chunk passes compiled on CUDA
    flops.py           the update's model FLOPs, the GPUs' dense bf16 peaks, MFU (train.py's console, the GPU check)
    precision.py       the compute dtype (bf16 where the hardware has it); a guard on oneMKL's first-call race
    checkpoint.py      distributed checkpoints, exact resume, Hugging Face export
    verify_pool.py     the worker processes that run math-verify for reward.py, each check bounded in time
    hf_sampling.py     transformers' generate sampling as the paper does, with each sampled token's log-prob
    vllm_cpu_sleep.py  vLLM's sleep on a CPU (free the KV cache and the weights between rollouts)
    vllm_logging.py    a quiet vLLM console
    jsonl.py           run outputs read plain or gzipped (committed results travel compressed)

The concept files import what they need from here (`from machinery import verify_pool`); nothing here imports them.
"""

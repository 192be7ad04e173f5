"""The compute dtype of the trainer (--train-dtype) and of the rollout engine (--rollout-dtype).

"auto" is bfloat16 where the hardware computes it natively (CUDA, or a CPU with AVX512-BF16 or
AMX-BF16) and float32 elsewhere: on a CPU without them bf16 matmuls are emulated and slower than
float32 (docs/benchmarks.md). train.resolve_config decides it once for a run; rollout.make_engine
resolves "auto" the same way when it is used on its own (eval.py, rollout.py).
"""
import torch

DTYPES = ("float32", "bfloat16", "float16")


def cpu_has_native_bf16():
    """True where the CPU computes bf16 natively: avx512_bf16 or amx_bf16 in /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")),
                         [])
    except OSError:  # not Linux: no cheap way to ask, take the safe choice
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype):
    """"auto" -> "bfloat16" on CUDA or a CPU with native bf16, else "float32"; a name -> itself."""
    if dtype == "auto":
        return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {dtype!r}")
    return dtype

"""The compute dtype of the trainer (--train-dtype) and of the rollout engine (--rollout-dtype),
and a guard on the CPU's float math.

"auto" is bfloat16 where the hardware computes it natively (CUDA, or a CPU with AVX512-BF16 or
AMX-BF16) and float32 elsewhere: on a CPU without them bf16 matmuls are emulated and slower than
float32 (docs/benchmarks.md). train.resolve_config decides it once for a run; rollout.make_engine
resolves "auto" the same way when it is used on its own (eval.py, rollout.py).

Importing this file runs `warm_up_vml` once: PyTorch's CPU wheels (2.10-2.13) bundle oneMKL 2024.2,
whose vector math library picks each function's kernel on its first call, and when that first call
runs on several threads at once one of them can run a low-accuracy kernel for its share
(pytorch/pytorch#188792). A fresh process's first cos (the rotary embedding's; vLLM computes its
cos/sin cache once, at start) can then be off by 1.5e-4 on part of the tensor (docs/design.md).
"""
import torch

DTYPES = ("float32", "bfloat16", "float16")


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (an empty set where it cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:  # not Linux: no cheap way to ask, take the safe choice
        return set()


def cpu_has_native_bf16():
    """True where the CPU computes bf16 natively: avx512_bf16 or amx_bf16 in /proc/cpuinfo."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_amx():
    """True where the CPU has AMX's bf16 tiles (amx_bf16 in /proc/cpuinfo)."""
    return "amx_bf16" in cpu_flags()


def resolve_dtype(dtype):
    """"auto" -> "bfloat16" on CUDA or a CPU with native bf16, else "float32"; a name -> itself."""
    if dtype == "auto":
        return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


# ATen's float unary ops that call oneMKL's VML (ATen/cpu/vml.h, torch 2.13)
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
           "sin", "sqrt", "tan", "tanh", "trunc")


def warm_up_vml():
    """Call each VML-backed op once per float dtype on one element: below ATen's parallel grain
    (2048) the call runs on this thread alone, so oneMKL settles its kernel choice before any
    multithreaded call (the fix proposed upstream, pytorch/pytorch#188791, does the same)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")
        for op in VML_OPS:
            getattr(torch, op)(x)


warm_up_vml()

"""Attention confined to each row of a packed micro-batch, with the kernel chosen per device.

A packed micro-batch (logprobs.packed_logprobs) is its rows' real tokens concatenated into one
sequence (1, N), positions restarting at each row. Attention must stay causal *within* each row and
never cross into the next. Transformers reaches the attention through a named implementation
(`AttentionInterface`), and passes any extra keyword of the model call down to it: this file
registers one, `bandpo_packed`, that reads the rows' boundaries from the `packing` keyword, so
Llama and Qwen2 models run packed without a fork of their code. A call without `packing` (the
padded path, the shared-prompt forward, a rollout check) gets transformers' own SDPA, mask
included: one model serves both paths.

The kernels (`KERNELS`; `choose_kernel` picks what can run, the start-up line names it):
- `varlen` (CUDA sm80+ in bf16/fp16, where the pinned torch has `torch.nn.attention.varlen`):
  flash attention over cumulative sequence lengths, causal, GQA without copies of k and v;
- `flex` (CUDA otherwise: float32, or before sm80; also runs on a CPU, where the tests check it):
  compiled FlexAttention with a document mask built once per forward;
- `sdpa` (CPU): per micro-batch (`sdpa_kernel`) `sdpa-rows`, causal SDPA on each row's slice, or `sdpa-block`, one
  SDPA call with the (N, N) block-diagonal causal mask, where rows are so short that the calls cost more than the
  pairs the mask adds (docs/benchmarks.md); bf16 in float32 on a CPU without AMX (`float32_attention`), rows <= 512.
Each keeps a layer's sliding window (transformers' q - k < w) by a band in its mask, varlen's
window_size or flex's mask_mod; `check_supported` refuses what none implements (soft-capping, sinks, dropout).

    packing = make_packing([row lengths], device)      # boundaries, on the host and the device
    model(input_ids=ids, position_ids=pos, packing=packing)   # model built with NAME
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from machinery.precision import cpu_has_amx

NAME = "bandpo_packed"  # the attention implementation a packed model is built with

# --pack unset: packing on where it measured faster than token budgets (docs/benchmarks.md, the
# packed update; on CUDA `make gpu-check`'s section pack, docs/gpu.md).
PACK_DEFAULT = {"cpu": True, "cuda": True}


def pack_default(device):
    """--pack unset: this device's measured default (off where none was measured)."""
    return PACK_DEFAULT.get(torch.device(device).type, False)


@dataclass
class Packing:
    """Where each row of a packed sequence starts and ends, in the forms the kernels want."""
    kernel: str                 # a KERNELS key
    bounds: list                # [(start, end)] of each row, on the host
    cu_seqlens: torch.Tensor    # (rows + 1,) int32 cumulative lengths, on the device
    max_len: int                # the longest row
    block_masks: Optional[dict] = None  # flex only: {window: document mask}, built once per forward
    dense_masks: Optional[dict] = None  # sdpa-block only: {window: (N, N) bool}, built once per forward
    upcast: bool = False        # sdpa only: bf16/fp16 attention computed in float32 (`float32_attention`)


def choose_kernel(device_type, capability=None, dtype=torch.bfloat16, has_varlen=None):
    """The packed kernel that can run here, from what decides it: the device type, its compute
    capability ((major, minor), CUDA only) and the attention's dtype. torch's varlen attention is
    FlashAttention-2, which takes only fp16/bf16 on sm80 or newer; elsewhere on CUDA FlexAttention
    (Triton: fp16/bf16/fp32, sm70 or newer); anything else, a CPU included, runs SDPA ("sdpa": per
    micro-batch sdpa-rows or sdpa-block, `sdpa_kernel`).
    has_varlen: whether this torch has torch.nn.attention.varlen (None: look)."""
    if device_type != "cuda":
        return "sdpa"
    if has_varlen is None:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
            has_varlen = True
        except ImportError:
            has_varlen = False
    cap = tuple(capability or (0, 0))
    if has_varlen and dtype in (torch.float16, torch.bfloat16) and cap >= (8, 0):
        return "varlen"
    if dtype in (torch.float16, torch.bfloat16, torch.float32) and cap >= (7, 0):
        return "flex"
    return "sdpa"


# The SDPA kernel "sdpa" (a CPU; CUDA where neither varlen nor flex runs) picks per micro-batch: one masked call
# (sdpa-block) computes N^2 query-key pairs where the rows need sum n_i^2, and saves rows - 1 calls. It is picked
# where the pairs it adds cost less than the calls it saves: N^2 - sum n_i^2 <= ROW_CALL_PAIRS (rows - 1).
# ROW_CALL_PAIRS is one call's fixed cost in masked pairs, from `python benchmarks/bench_packed_attention.py
# --threads 1` (2026-12-02, a 2-core AMD EPYC, Zen 4, avx512_bf16, no AMX; docs/benchmarks.md names the commit):
# a row's call (forward + backward, 9 heads x 64) costs 0.073 ms in float32 and 0.098 in bf16 (64 rows of 1-2
# tokens), a masked pair 1.2e-4 and 1.3e-4 ms (N = 770-1500): 600 and 730 pairs; the smaller is taken. So only
# micro-batches of very short rows run masked: 8 rows of 32 tokens would add 57k pairs to save 4.2k.
ROW_CALL_PAIRS = 600


# bf16 (or fp16) packed attention on a CPU without AMX computes in float32: q, k and v cast up, the output back
# (`_upcast`), in micro-batches whose rows are at most UPCAST_MAX_ROW tokens. `python
# benchmarks/bench_packed_attention.py --threads 1` (ccef58a, 2026-12-03, a 2-core AMD EPYC, Zen 4, avx512_bf16, no
# AMX; docs/benchmarks.md), forward + backward at SmolLM2's heads, the same bf16 inputs: rows of at most 128 tokens
# 1.16-3.5x faster in float32, 256 1.02-1.28x, 512 0.95-1.08x (parity); longer rows unmeasured, and there bf16 keeps its
# smaller saved tensors. The SmolLM2 job's packed update took 0.89x the time of the same update with bf16 attention
# (bench_cpu_roofline.py, 94a8840). The float32 copies of q, k, v and the output are what the backward keeps instead
# of bf16 ones (machinery/memory.layer_bytes' attention bytes, counted for every micro-batch: an upper bound where
# rows are longer). With AMX, bf16 tiles are that CPU's fast path, and bf16 attention is kept there (unmeasured).
UPCAST_MAX_ROW = 512


def float32_attention(device, dtype):
    """Whether a packed model on `device` computing in `dtype` runs its attention in float32: bf16 or fp16 on a CPU
    without AMX."""
    return (dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu"
            and not cpu_has_amx())


def sdpa_kernel(lengths):
    """The SDPA kernel of a packed micro-batch of rows of `lengths` tokens (ROW_CALL_PAIRS' rule):
    sdpa-block where N^2 - sum n_i^2 <= ROW_CALL_PAIRS (rows - 1), else sdpa-rows."""
    n = sum(lengths)
    return "sdpa-block" if n * n - sum(x * x for x in lengths) <= ROW_CALL_PAIRS * (len(lengths) - 1) else "sdpa-rows"


def kernel_for(device, dtype=torch.bfloat16):
    """The packed kernel of this device for attention in `dtype` (the training compute dtype):
    `choose_kernel` with the device's own capability."""
    device = torch.device(device)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_kernel(device.type, cap, dtype)


def make_packing(lengths, device, kernel=None, windows=(None,), device_lengths=None, upcast=False):
    """Packing of rows of `lengths` tokens (each >= 1) laid end to end on `device`. windows: the
    sliding windows the model's layers use (`model_windows`; None: full causal attention), for
    which flex and sdpa-block build their masks here, once per forward ("sdpa" resolved here by
    `sdpa_kernel`). device_lengths: the same lengths already on the device (int64), so that nothing
    more is copied from the host. upcast: the SDPA kernels compute bf16/fp16 attention in float32
    (`float32_attention`)."""
    kernel = kernel or kernel_for(device)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    if device_lengths is None:
        device_lengths = torch.tensor(lengths, device=device)
    cu = F.pad(device_lengths.cumsum(0), (1, 0)).to(torch.int32)                 # (rows + 1,)
    if kernel == "sdpa":
        kernel = sdpa_kernel(lengths)
    block_masks = dense_masks = None
    if kernel == "sdpa-block":
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), device_lengths,
                                      output_size=ends[-1])                   # (N,) row of a token
        q = torch.arange(ends[-1], device=device)                             # (N,)
        same = (doc[:, None] == doc[None]) & (q[:, None] >= q[None])          # (N, N) causal in a row
        dense_masks = {w: same if w is None else same & (q[:, None] - q[None] < w) for w in windows}
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), device_lengths,
                                      output_size=ends[-1])                   # (N,) row of a token
        block_masks = {w: create_block_mask(document_mask(doc, w), None, None, ends[-1], ends[-1],
                                            device=device) for w in windows}
    return Packing(kernel, bounds, cu, max(lengths), block_masks, dense_masks, upcast)


def document_mask(doc, window=None):
    """FlexAttention's mask_mod: query q sees key k of its own row, k <= q, and, under a sliding
    window w, q - k < w (transformers' `sliding_window_overlay`: the last w keys, q's own among
    them; None: w = N, no limit). doc (N,): the row of each packed token. The window is a tensor on
    the device, not a constant of the graph: every layer's mask then runs one compiled kernel
    (a constant recompiled per window, which Inductor's CPU template also failed to compile)."""
    w = torch.full((), window or doc.numel(), dtype=doc.dtype, device=doc.device)   # () no copy
    return lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k) & (q - k < w)


def model_windows(config):
    """The sliding windows a transformers model's layers attend with, as the set its attention
    modules pass (`sliding_window`): per layer type where the config lists them (Qwen2, Gemma 3:
    None for "full_attention" layers), else the config's one window (Mistral; None without)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return {window}
    other = set(types) - {"full_attention", "sliding_attention"}
    if other:
        raise ValueError(f"packed attention implements full and sliding-window layers, not "
                         f"layer_types {sorted(other)}")
    return {window if t == "sliding_attention" else None for t in types}


def check_supported(model, kernel):
    """Refuse (ValueError, one line naming it) any attention feature of `model` that the packed
    kernels do not implement: the packed path would run without it and be silently wrong (a model
    on the meta device will do: logprobs.check_packable). Returns its sliding windows (model_windows)."""
    config = model.config
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"packed attention does not implement {name}={getattr(config, name)} "
                             f"({config.model_type}): run with --no-pack")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"packed attention is causal; {config.model_type} has "
                         f"use_bidirectional_attention=True: run with --no-pack")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"packed attention has no dropout; attention_dropout="
                         f"{config.attention_dropout}: set it to 0 or run with --no-pack")
    sinks = next((n for n, m in model.named_modules() if hasattr(m, "sinks")), None)
    if sinks is not None:
        raise ValueError(f"packed attention does not implement attention sinks ({sinks}.sinks): "
                         f"run with --no-pack")
    windows = model_windows(config)
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding window {sorted(w for w in windows if w is not None)} < 1")
    if kernel == "varlen" and windows != {None} and not _varlen_has_window():
        raise ValueError(f"this torch's varlen_attn has no window_size, and the model slides "
                         f"(windows {sorted(w for w in windows if w is not None)}): run with --no-pack")
    return windows


def _varlen_has_window():
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    return "window_size" in inspect.signature(varlen_attn).parameters


# --- the kernels: q (1, H, N, D), k and v (1, Hkv, N, D) -> (1, N, H, D) -------------------------
def _upcast(q, k, v, packing):
    """q, k, v in float32 where the packing asks for it (`float32_attention`) and its rows are at most UPCAST_MAX_ROW
    tokens, and the dtype to return in."""
    dtype = q.dtype
    if packing.upcast and dtype in (torch.bfloat16, torch.float16) and packing.max_len <= UPCAST_MAX_ROW:
        q, k, v = q.float(), k.float(), v.float()
    return q, k, v, dtype


@torch.compiler.disable  # a loop over the rows' host-side bounds: left out of a compiled layer
def _sdpa_rows(q, k, v, packing, scale, window=None):
    q, k, v, dtype = _upcast(q, k, v, packing)
    gqa = q.shape[1] != k.shape[1]
    out = []
    for s, e in packing.bounds:
        band = None
        if window is not None and e - s > window:
            d = torch.arange(e - s, device=q.device)
            d = d[:, None] - d[None]                                            # (n, n) q - k
            band = (d >= 0) & (d < window)                                      # causal, in the window
        out.append(F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], attn_mask=band, is_causal=band is None,
            scale=scale, enable_gqa=gqa))                                       # (1, H, n_i, D)
    return torch.cat(out, 2).transpose(1, 2).to(dtype)


def _sdpa_block(q, k, v, packing, scale, window=None):
    # one SDPA call over the whole packed sequence, its (N, N) block-diagonal causal mask built once per forward
    # (make_packing): N^2 work where the rows need sum n_i^2, against one call instead of one per row
    q, k, v, dtype = _upcast(q, k, v, packing)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=packing.dense_masks[window], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])          # (1, H, N, D)
    return out.transpose(1, 2).to(dtype)


def _varlen(q, k, v, packing, scale, window=None):
    # varlen_attn's keywords changed between torch releases (2.10: is_causal; later: window_size,
    # then scale and enable_gqa): pass what this torch's signature has, and repeat k and v for GQA
    # where it cannot share them
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))                     # (N, H, D)
    slides = window is not None and window < packing.max_len
    if "window_size" in params:
        # FlashAttention's window (left, right) keeps keys in [q - left, q + right]: transformers'
        # q - k < w is left = w - 1 (as its own flash path passes); (-1, 0) is plain causal
        kw = {"window_size": (window - 1, 0) if slides else (-1, 0)}
    elif slides:
        raise ValueError(f"this torch's varlen_attn has no window_size for sliding window {window}")
    else:
        kw = {"is_causal": True}
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale argument, and the model's is {scale}")
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))  # (N, H, D)
    out = varlen_attn(q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_len,
                      packing.max_len, **kw)                                # (N, H, D)
    return out[None]


_flex = None  # compiled once per process


def _flex_attention(q, k, v, packing, scale, window=None):
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex = torch.compile(flex_attention, dynamic=True)
    if window not in packing.block_masks:
        raise ValueError(f"no flex mask was built for sliding window {window} (built: "
                         f"{sorted(packing.block_masks, key=str)}): make_packing's windows")
    out = _flex(q, k, v, block_mask=packing.block_masks[window], scale=scale,
                enable_gqa=q.shape[1] != k.shape[1])                        # (1, H, N, D)
    return out.transpose(1, 2)


# "sdpa" is no entry: make_packing resolves it to one of SDPA_KERNELS per micro-batch
SDPA_KERNELS = ("sdpa-rows", "sdpa-block")
KERNELS = {"sdpa-rows": _sdpa_rows, "sdpa-block": _sdpa_block, "varlen": _varlen, "flex": _flex_attention}
# keywords transformers' decoder layers pass down that do not change a packed call's attention
_IGNORED = {"position_ids", "use_cache", "cache_position", "past_key_values", "past_key_value"}


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, packing=None, **kwargs):
    """The `bandpo_packed` implementation: a packed call (`packing` given) runs its kernel, within
    the layer's sliding window where it has one; any other call is transformers' SDPA with its mask
    (which holds the window), unchanged. A packed call refuses any keyword it does not implement."""
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    unknown = sorted(f"{k}={v}" for k, v in dict(kwargs, dropout=dropout or None).items()
                     if k not in _IGNORED and v is not None and v is not False)
    if unknown:
        raise ValueError(f"packed attention does not implement {', '.join(unknown)}")
    return KERNELS[packing.kernel](query, key, value, packing, scaling,
                                   sliding_window).contiguous(), None


def _mask(*args, attention_mask=None, **kwargs):
    """No mask for a packed call (no attention mask given: the kernel confines each row), SDPA's
    mask otherwise. Transformers would build a (N, N) block-diagonal mask from the restarting
    positions, which no packed kernel reads."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask,
                                                         **kwargs)


def register():
    """Make NAME an attention implementation transformers knows (idempotent)."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)

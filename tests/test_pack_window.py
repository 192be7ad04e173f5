"""Packed micro-batches under sliding-window attention, and the attention features the packed kernels refuse.

Mistral (one window on every layer), Qwen2 with use_sliding_window (full layers below max_window_layers, sliding
above) and Gemma 3 (layer_types alternating sliding and full, another RoPE base on each) with a window of 8 tokens,
shorter than the longest rows (47, 25, 11 tokens): the packed log-probs, entropy and every gradient against the padded
path (logprobs.sequence_logprobs: transformers' own mask, `sliding_window_overlay`), float64. A control shows the
window acts: without it the padded log-probs move by far more than the tolerance. FlexAttention's mask is checked
against transformers' mask function, and its kernel (eager: FlexAttention has no backward on a CPU) forward against
the padded path. Random weights at std 0.1 (tests/test_pack_gqa.py: attention far from uniform).
"""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config
from transformers.masking_utils import sliding_window_causal_mask_function

from logprobs import enable_packing, packed_logprobs, sequence_logprobs
from machinery import packed_attention
from test_pack import SPANS, rows

U64 = torch.finfo(torch.float64).eps / 2
W = 8  # the window: shorter than three of SPANS' rows
SMALL = dict(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=128, tie_word_embeddings=True, rope_theta=1e4, initializer_range=0.1)
CONFIGS = {
    "mistral": lambda w: MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=w),
    # layers 0: full, 1 and 2: sliding (Qwen2Config's layer_types from max_window_layers)
    "qwen2": lambda w: Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=w is not None,
                                   sliding_window=w, max_window_layers=1),
    "gemma3": lambda w: Gemma3TextConfig(**SMALL, num_hidden_layers=3, head_dim=16, sliding_window=w or 4096,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def build(name, window=W, dtype=torch.float64):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[name](window), dtype=dtype)


def logprobs_and_grads(model, ids, attn, P, w, packed, kernel=None):
    """(log-probs (B, T), entropy, {name: gradient of Σ w·logp}) on the packed or the padded path."""
    model.zero_grad()
    logp, ent = (packed_logprobs(model, ids, P, SPANS, with_entropy=True, kernel=kernel) if packed else
                 sequence_logprobs(model, ids, attn, P, 4, with_entropy=True, spans=SPANS))   # (B, T) each
    (w * logp).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def gemma_norm_in_float64(self, x):
    # Gemma3RMSNorm upcasts to float32 whatever the model's dtype, so its backward rounds at float32 where the two
    # paths sum in other orders; computed in the input's dtype, both paths are float64 throughout
    return self._norm(x) * (1.0 + self.weight)


@pytest.mark.parametrize("kernel", packed_attention.SDPA_KERNELS)
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3"])
def test_packed_equals_padded_under_sliding_window_float64(name, kernel, monkeypatch):
    """float64, each SDPA kernel (a band mask per row; the band within the block-diagonal mask): log-probs, entropy
    and every gradient, packed against padded. Both compute the same sums in other orders: a logit errs by <~
    n_layers sqrt(d_ff) u max|z|, a log-prob by twice that, both sides: 4 n_layers sqrt(d_ff) u max|z| (max|z| of
    the padded logits); gradients the same relative to their largest entry. Control: the same weights without the
    window (Gemma 3: a window longer than every row) give log-probs that differ by more than 1000x the tolerance."""
    from transformers.models.gemma3 import modeling_gemma3
    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", gemma_norm_in_float64)
    model = enable_packing(build(name))
    conf = model.config
    types = set(getattr(conf, "layer_types", None) or ["sliding_attention"])
    assert types == ({"sliding_attention"} if name == "mistral" else {"sliding_attention", "full_attention"})
    ids, attn, P = rows()
    mask = attn[:, P:].bool()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        z_max = model(input_ids=ids, attention_mask=attn).logits.abs().max().item()
    tol = 4 * conf.num_hidden_layers * math.sqrt(conf.intermediate_size) * U64 * z_max
    padded, packed = (logprobs_and_grads(model, ids, attn, P, w, p, kernel) for p in (False, True))
    assert torch.allclose(packed[0], padded[0], rtol=0, atol=tol)
    assert torch.allclose(packed[1], padded[1], rtol=0, atol=tol)
    for param, g in padded[2].items():
        assert torch.allclose(packed[2][param], g, rtol=0, atol=tol * g.abs().max()), param

    full = enable_packing(build(name, None if name != "gemma3" else 64))
    with torch.no_grad():
        unwindowed, _ = sequence_logprobs(full, ids, attn, P, 4, spans=SPANS)
    assert (unwindowed - padded[0])[mask].abs().max() > 1000 * tol


def test_each_layer_keeps_its_own_window():
    """Qwen2's mixed layers: packed = padded (the test above) only if the full layer attends over the whole row and
    the sliding ones over the window. Controls: the padded log-probs of the same weights with every layer sliding
    (max_window_layers 0) and with every layer full (3) both differ from the mixed model's by more than 1e-6, 1000x
    above that test's bound (4 * 3 sqrt(128) u max|z| < 1e-12 at max|z| < 100), so a kernel that gave every layer
    the same window could not pass it."""
    ids, attn, P = rows()
    mask = attn[:, P:].bool()
    out = {}
    for below in (1, 0, 3):  # layers below max_window_layers attend fully
        torch.manual_seed(0)
        conf = Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=W,
                           max_window_layers=below)
        assert len(set(conf.layer_types)) == (2 if below == 1 else 1)
        with torch.no_grad():
            out[below], _ = sequence_logprobs(AutoModelForCausalLM.from_config(conf, dtype=torch.float64),
                                              ids, attn, P, 4, spans=SPANS)
    assert packed_attention.model_windows(build("qwen2").config) == {None, W}
    for below in (0, 3):
        assert (out[below] - out[1])[mask].abs().max() > 1e-6, below


def test_flex_mask_is_transformers_sliding_window_per_row():
    """The flex kernel's mask_mod over packed rows = transformers' sliding_window_causal_mask_function on each row
    alone (block diagonal, nothing across rows), for windows 1, 3, 8 and None (plain causal)."""
    from torch.nn.attention.flex_attention import create_mask
    lengths = [sum(s) for s in SPANS]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))          # (N,)
    N = doc.numel()
    for window in (1, 3, W, None):
        got = create_mask(packed_attention.document_mask(doc, window), None, None, N, N, device="cpu")[0, 0]
        want = torch.zeros(N, N, dtype=torch.bool)
        start = 0
        for n in lengths:
            hf = sliding_window_causal_mask_function(window or N)
            q, k = torch.arange(n)[:, None], torch.arange(n)[None]
            want[start:start + n, start:start + n] = hf(0, 0, q, k)
            start += n
        assert torch.equal(got, want), window


@pytest.mark.parametrize("name,compiled", [("qwen2", False), ("mistral", False),
                                           pytest.param("qwen2", True, marks=pytest.mark.slow)])
def test_flex_kernel_forward_equals_padded_under_sliding_window(name, compiled, monkeypatch):
    """The flex kernel (the CUDA float32 kernel; on a CPU forward only) with one mask per window: packed = padded
    log-probs within test_packed_equals_padded_under_sliding_window_float64's bound 4 n_layers sqrt(d_ff) u max|z|.
    Run eagerly in float64 (the same mask_mod, ~1 min less) and, slow, compiled as it runs on CUDA (in float32, the
    compiled CPU kernel's widest dtype)."""
    from torch.nn.attention.flex_attention import flex_attention
    dtype = torch.float32 if compiled else torch.float64
    if not compiled:
        monkeypatch.setattr(packed_attention, "_flex", flex_attention)
    model = enable_packing(build(name, dtype=dtype), kernel="flex")
    ids, attn, P = rows(seed=4)
    with torch.no_grad():
        z_max = model(input_ids=ids, attention_mask=attn).logits.abs().max().item()
        ref, _ = sequence_logprobs(model, ids, attn, P, 6, spans=SPANS)
        flex, _ = packed_logprobs(model, ids, P, SPANS, kernel="flex")
    conf, u = model.config, torch.finfo(dtype).eps / 2
    tol = 4 * conf.num_hidden_layers * math.sqrt(conf.intermediate_size) * u * z_max
    assert torch.allclose(flex, ref, rtol=0, atol=tol)


def test_unimplemented_attention_is_refused_at_start_up(monkeypatch):
    """enable_packing refuses, one line naming the value, what no packed kernel implements: logit soft-capping inside
    attention (Gemma 2 style), attention dropout, attention sinks (GPT-OSS), and a sliding window under a varlen_attn
    without window_size, and leaves the model as it was; a packed call with a keyword the kernels do not implement
    is refused too."""
    from transformers import GptOssConfig
    soft = AutoModelForCausalLM.from_config(Gemma3TextConfig(**SMALL, num_hidden_layers=1, head_dim=16,
                                                             attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match=r"^packed attention does not implement attn_logit_softcapping=50.0 \(gemma3_"):
        enable_packing(soft)
    drop = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL, num_hidden_layers=1, attention_dropout=0.1))
    with pytest.raises(ValueError, match=r"attention_dropout=0.1"):
        enable_packing(drop)
    sinks = AutoModelForCausalLM.from_config(GptOssConfig(**SMALL, num_hidden_layers=1, head_dim=16, sliding_window=W,
                                                          num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(ValueError, match=r"attention sinks \(model.layers.0.self_attn.sinks\)"):
        enable_packing(sinks)
    for refused in (soft, drop, sinks):
        assert refused.config._attn_implementation != packed_attention.NAME
    monkeypatch.setattr(packed_attention, "_varlen_has_window", lambda: False)  # a torch before window_size
    with pytest.raises(ValueError, match=r"varlen_attn has no window_size.*windows \[8\]"):
        enable_packing(build("mistral"), kernel="varlen")
    q = torch.zeros(1, 2, 3, 4)
    packing = packed_attention.make_packing([3], "cpu", "sdpa-rows")
    with pytest.raises(ValueError, match=r"packed attention does not implement softcap=30.0"):
        packed_attention.attention(None, q, q, q, None, packing=packing, softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_cuda_kernels_under_sliding_window_as_close_to_float64_as_padded(kernel):
    """bf16 on CUDA, Qwen2's mixed layers at window 8: each packed kernel's log-probs and gradient against the float64
    model on the CPU, next to the padded path's (transformers' SDPA with its sliding mask). Both round to bf16 at the
    same depth, so the packed error is at most twice the padded one (tests/test_pack.py's protocol); a kernel that
    ignored the window would err by the whole effect of the window (the control of the float64 test above)."""
    if kernel == "varlen" and packed_attention.kernel_for("cuda", torch.bfloat16) != "varlen":
        pytest.skip("varlen does not run here (torch.nn.attention.varlen, sm80+): packed_attention.choose_kernel")
    model = enable_packing(build("qwen2"), kernel=kernel)
    ids, attn, P = rows(seed=5)
    mask = attn[:, P:].bool()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref_logp, _, ref_grad = logprobs_and_grads(model, ids, attn, P, w, False)
    model.to("cuda", torch.bfloat16)
    err = {}
    for name in ("padded", "packed"):
        logp, _, grad = logprobs_and_grads(model, ids.cuda(), attn.cuda(), P, w.cuda(), name == "packed")
        num = sum(float((g.double().cpu() - ref_grad[n]).square().sum()) for n, g in grad.items())
        err[name] = ((logp.double().cpu() - ref_logp)[mask].abs().max().item(),
                     math.sqrt(num / sum(float(g.square().sum()) for g in ref_grad.values())))
    assert err["padded"][0] > 0  # bf16 really rounded
    assert err["packed"][0] <= 2 * err["padded"][0] and err["packed"][1] <= 2 * err["padded"][1], err


# `python train.py --pack` on a model whose attention has dropout: exit code 2 and one line naming
# attention_dropout=0.1, before any weight loads and before the run directory is made: a case of
# tests/test_train.py's BAD_FLAGS (one interpreter for every refusal).

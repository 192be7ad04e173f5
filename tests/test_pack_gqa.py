"""Packed micro-batches on the shape that Qwen2.5 has and the tiny model lacks: grouped-query attention (4 query
heads sharing 2 key/value heads, so each kernel must map query head j to kv head j // 2 as transformers' repeat_kv
does) and biases on q, k and v. A Qwen2 model with random weights and random biases (transformers initialises
biases to 0, which would hide a bias dropped on the packed path), its packed log-probs and gradient against the
padded path (logprobs.sequence_logprobs, the reference): in float64 on the CPU, and in bf16 on CUDA for each packed
kernel against a float64 reference (tests/test_pack.py's protocol for the tiny model).
"""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from logprobs import enable_packing, packed_logprobs, sequence_logprobs
from machinery import packed_attention
from test_pack import SPANS, rows

U64 = torch.finfo(torch.float64).eps / 2
# Qwen2.5's head layout at toy size: head_dim 16, 2 query heads per kv head; weights at std 0.1 (not 0.02) so that
# attention is far from uniform and a row attending to the wrong keys changes its output
CONF = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=True, rope_theta=1e4,
            initializer_range=0.1)


def gqa_model(dtype=torch.float64):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**CONF), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features == attn.q_proj.out_features // 2 and attn.k_proj.bias is not None
    return enable_packing(model)


def logprobs_and_grads(model, ids, attn, P, w, packed, kernel=None):
    """(log-probs (B, T), entropy, {name: gradient of Σ w·logp}) on the packed or the padded path."""
    model.zero_grad()
    logp, ent = (packed_logprobs(model, ids, P, SPANS, with_entropy=True, kernel=kernel) if packed else
                 sequence_logprobs(model, ids, attn, P, 4, with_entropy=True, spans=SPANS))   # (B, T) each
    (w.to(logp.device) * logp.double()).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernel", packed_attention.SDPA_KERNELS)
def test_packed_equals_padded_gqa_float64(kernel):
    """float64 on the CPU, each SDPA kernel (per row; one block-diagonal mask): log-probs, entropy and every
    parameter's gradient, packed against padded, rows of 1 to 47 tokens. Both paths compute the same sums in other
    orders: a logit errs by <~ n_layers sqrt(d_ff) u max|z| (2 sqrt(128) = 23 u max|z| here), a log-prob by twice
    that (the log-sum-exp), on both sides: 4 * 23 u max|z|, max|z| measured on the padded logits; gradients the same
    relative to their largest entry."""
    model = gqa_model()
    ids, attn, P = rows()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        z_max = model(input_ids=ids, attention_mask=attn).logits.abs().max().item()
    tol = 4 * CONF["num_hidden_layers"] * math.sqrt(CONF["intermediate_size"]) * U64 * z_max
    padded, packed = (logprobs_and_grads(model, ids, attn, P, w, p, kernel) for p in (False, True))
    assert torch.allclose(packed[0], padded[0], rtol=0, atol=tol)
    assert torch.allclose(packed[1], padded[1], rtol=0, atol=tol)
    for name, g in padded[2].items():
        assert g.abs().max() > 0, name  # every weight and bias takes part
        assert torch.allclose(packed[2][name], g, rtol=0, atol=tol * g.abs().max()), name


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_cuda_kernels_gqa_as_close_to_float64_as_padded(kernel):
    """bf16 on CUDA: each packed kernel's log-probs and gradients against the float64 model on the CPU, next to the
    padded path's (transformers' SDPA with a mask). Both round weights and activations to bf16 at the same depth, so
    their errors have the same scale: the packed error is at most twice the padded one, for the log-probs (largest
    and mean error), for the whole gradient (|g - g64| / |g64| over all parameters) and for the k and v projections
    alone (where the query heads' gradients are summed into their shared kv head)."""
    if kernel == "varlen" and packed_attention.kernel_for("cuda", torch.bfloat16) != "varlen":
        pytest.skip("varlen does not run here (torch.nn.attention.varlen, sm80+): packed_attention.choose_kernel")
    model = gqa_model()
    ids, attn, P = rows(seed=5)
    mask = attn[:, P:].bool()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref_logp, _, ref_grad = logprobs_and_grads(model, ids, attn, P, w, False)
    model.to("cuda", torch.bfloat16)
    err = {}
    for name in ("padded", "packed"):
        logp, _, grad = logprobs_and_grads(model, ids.cuda(), attn.cuda(), P, w, name == "packed", kernel)
        e = (logp.double().cpu() - ref_logp)[mask].abs()

        def rel(names):
            return math.sqrt(sum(float((grad[n] - ref_grad[n]).square().sum()) for n in names)
                             / sum(float(ref_grad[n].square().sum()) for n in names))

        kv = [n for n in ref_grad if ".k_proj." in n or ".v_proj." in n]
        err[name] = {"logp max": e.max().item(), "logp mean": e.mean().item(), "grad": rel(list(ref_grad)),
                     "grad k, v": rel(kv)}
    assert err["padded"]["logp max"] > 0  # bf16 really rounded
    for key, e in err["packed"].items():
        assert e <= 2 * err["padded"][key], (key, err)

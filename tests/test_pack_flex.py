"""FlexAttention where it runs: the packed kernel of every float32 CUDA run with --pack (and of bf16 before sm80).
Float32 on CUDA, on the grouped-query model of tests/test_pack_gqa.py (4 query heads over 2 kv heads, q/k/v biases),
forward and backward: the packed log-probs and every parameter's gradient against the float64 padded model. The
GPU check's tests section runs this file wherever it runs (FlexAttention has no backward on a CPU: torch raises).

The bound, derived (tests/test_pack_gqa.py's float64 argument in float32): a logit errs by <~ n_layers sqrt(d_ff)
u max|z|, a log-prob by twice that (the log-sum-exp), so 4 n_layers sqrt(d_ff) u max|z| holds each path against
float64 with a factor 2 to spare; a gradient the same relative to the largest entry of its parameter. TF32 (u =
2^-11 instead of 2^-24) would break it by three orders of magnitude. The CPU case runs the same protocol on the CPU's
packed kernel, so that the bound is checked where a machine without CUDA can check it.
"""
import math

import pytest
import torch

from test_pack import SPANS, rows
from test_pack_gqa import CONF, gqa_model, logprobs_and_grads

U32 = torch.finfo(torch.float32).eps / 2  # float32 unit roundoff, 2^-24


def float32_against_float64(device, kernel):
    """(tolerance, {path: (max |logp - logp64|, {parameter: max |g - g64| / max |g64|})}) of the padded and the
    packed path in float32 on `device`, against the padded path in float64 on the CPU."""
    model = gqa_model()  # float64
    ids, attn, P = rows(seed=5)
    mask = attn[:, P:].bool()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with torch.no_grad():
        z_max = model(input_ids=ids, attention_mask=attn).logits.abs().max().item()
    tol = 4 * CONF["num_hidden_layers"] * math.sqrt(CONF["intermediate_size"]) * U32 * z_max
    ref_logp, _, ref_grad = logprobs_and_grads(model, ids, attn, P, w, False)
    model.to(device, torch.float32)
    err = {}
    for path in ("padded", "packed"):
        logp, _, grad = logprobs_and_grads(model, ids.to(device), attn.to(device), P, w, path == "packed",
                                           kernel)
        err[path] = ((logp.double().cpu() - ref_logp)[mask].abs().max().item(),
                     {n: ((grad[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grad.items()})
    return tol, err


def check(tol, err):
    assert err["padded"][0] > 0  # float32 really rounded
    for path, (logp_err, grad_err) in err.items():
        assert logp_err <= tol, (path, logp_err, tol)
        over = {n: e for n, e in grad_err.items() if e > tol}
        assert not over, (path, over, tol)


@pytest.mark.gpu
def test_flex_float32_gqa_forward_and_backward_cuda():
    """Float32 on CUDA: FlexAttention (the kernel packed_attention chooses for float32 there) within float32's
    rounding of the float64 model, log-probs and every parameter's gradient, as the padded path is."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (7, 0):
        pytest.skip("FlexAttention needs sm70 or newer")
    from machinery import packed_attention
    assert packed_attention.kernel_for("cuda", torch.float32) == "flex"  # the kernel under test is the one runs use
    check(*float32_against_float64("cuda", "flex"))


def test_cpu_packed_float32_gqa_forward_and_backward():
    """The same protocol on the CPU's packed kernel (sdpa-rows): the bound holds where it can be run here."""
    check(*float32_against_float64("cpu", "sdpa-rows"))

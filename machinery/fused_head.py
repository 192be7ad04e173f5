"""The LM head fused with the log-prob of the sampled token, for packed micro-batches (logprobs.packed_logprobs).

The same number as token_logprobs of the head's logits, log softmax(h W^T / T)[y] (docs/paper.md §3, the ratio's
log-probs), without the (N, V) logits: a (chunk, V) block at a time, forward and backward, the backward recomputing
its block (one more head matmul, ~1/3 of the head's FLOPs). A block's float32 passes (the cast, max and
log-sum-exp, exp, gather, entropy; the backward's softmax rebuild) are two chunk functions, `chunk_forward` and
`chunk_grad`, run eagerly or, with `compiled` (--compile-head, on on CUDA), through torch.compile: Inductor fuses a
block's ~8 elementwise passes over (chunk, V) float32 into a few over the weights' dtype. The matmuls stay outside
them, so both run the same cuBLAS calls.

    logp, ent = HeadLogprob.apply(hidden, weight, targets, chunk, with_entropy, temperature, compiled)

Tests: tests/test_pack.py (packed = padded in float64, gradcheck), tests/test_recompute.py (float32 against float64
autograd through the unfused head; compiled against eager within the arithmetic's bound).
"""
import functools

import torch


def chunk_forward(z, targets, temperature, with_entropy):
    """A block of logits z (c, V) in the weights' dtype -> (lse, logp, entropy or None), each (c,), in float32
    (float64 for float64 logits): upcast first, then / temperature; one exp gives both the normaliser and the
    entropy, H = lse − Σ p z with p = e / norm."""
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)         # (c, V)
    if temperature != 1.0:
        z = z / temperature
    top = z.amax(-1, keepdim=True)                                                  # (c, 1)
    e = torch.exp(z - top)                                                          # (c, V)
    norm = e.sum(-1)                                                                # (c,)
    lse = top[:, 0] + norm.log()                                                    # (c,)
    logp = z.gather(-1, targets[:, None])[:, 0] - lse                               # (c,)
    return lse, logp, (lse - (e * z).sum(-1) / norm) if with_entropy else None


def chunk_grad(z, lse, g, targets, temperature):
    """The logits' gradient of a block, g (onehot(y) − softmax(z / T)) with g (c, 1) already / T, rebuilt from the
    block z (c, V) and its lse (c,), in lse's dtype, in place on one copy, then rounded to z's dtype (the weights'), as autograd
    through the unfused head would round it before its two matmuls."""
    d = z.to(lse.dtype, copy=True)                                                  # (c, V) the float32 block
    if temperature != 1.0:
        d.div_(temperature)
    d.sub_(lse[:, None]).exp_().mul_(-g)                                            # −g·softmax, in place
    d.scatter_add_(-1, targets[:, None], g)                                         # + g at y
    return d.to(z.dtype)                                                            # (c, V)


@functools.cache
def compiled(fn):
    """torch.compile of a chunk function, made once per process, with dynamic shapes: one graph per function and
    with_entropy value serves every chunk length (the last chunk of each micro-batch differs), three in a run; a
    1-row chunk compiles once more (torch specialises sizes 0 and 1). The temperature is a constant of its graph."""
    return torch.compile(fn, fullgraph=True, dynamic=True)


class HeadLogprob(torch.autograd.Function):
    """log softmax(h W^T / T)[target] (and the entropy, no gradient) over chunks of positions: only a (chunk, V)
    block of logits exists at a time, forward and backward. The backward's logit gradient is rounded to the weights'
    dtype before its two matmuls, and the weight's gradient is accumulated in float32 by one matmul-add per chunk
    (`_add_matmul`). `use_compiled`: the chunk functions through torch.compile."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, with_entropy, temperature, use_compiled=False):
        # hidden (n, h), weight (V, h), targets (n,)
        cdtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        step = compiled(chunk_forward) if use_compiled else chunk_forward
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=cdtype, device=hidden.device)                    # (n,)
        lse = torch.empty_like(logp)                                                 # (n,)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s in range(0, n, chunk):
            lse_c, logp_c, ent_c = step(hidden[s:s + chunk] @ weight.T, targets[s:s + chunk], temperature,
                                        with_entropy)                                # (c,) each
            lse[s:s + chunk], logp[s:s + chunk] = lse_c, logp_c
            if with_entropy:
                ent[s:s + chunk] = ent_c
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.temperature, ctx.use_compiled = chunk, temperature, use_compiled
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):                                         # (n,)
        hidden, weight, targets, lse = ctx.saved_tensors
        c, temp = ctx.chunk, ctx.temperature
        step = compiled(chunk_grad) if ctx.use_compiled else chunk_grad
        grad_h = torch.empty_like(hidden)                                            # (n, h)
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)   # (V, h)
        for s in range(0, hidden.shape[0], c):
            g = grad_logp[s:s + c, None].to(lse.dtype) / temp                        # (c, 1) d(z/T)/dz = 1/T
            d = step(hidden[s:s + c] @ weight.T, lse[s:s + c], g, targets[s:s + c], temp)  # (c, V)
            grad_h[s:s + c] = d @ weight                                             # (c, h)
            _add_matmul(grad_w, d.T, hidden[s:s + c])                                # (V, h)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def _add_matmul(acc, a, b):
    """acc += a @ b, in acc's dtype, without an (m, n) temporary: addmm_ where the dtypes agree; for
    bf16/fp16 operands into a float32 acc, cuBLAS's float32 output (`out_dtype`, CUDA, torch >= 2.8;
    the product is accumulated in float32 either way); elsewhere (a CPU) the product rounded to
    a's dtype is upcast and added, as autograd through the unfused head would."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _HAS_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


_HAS_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)

"""logprobs.py's token log-probs against plain float64 log_softmax, torch's gradcheck, and the naive float32 form.

The ratio r_t of docs/paper.md §3 is exp(log π_θ − log π_old); both log-probs come from `token_logprobs`, which
upcasts one chunk of positions at a time. These tests hold it to what the naive full-vocabulary computation gives.
"""
import pytest
import torch

import logprobs

F64 = torch.float64
# float64 on a few dozen O(1) numbers (|x| <= 20, sums of <= 50 terms): rounding <= n u sum|x| ~ 50 * 1.1e-16 * 20
# ~ 1e-13, so 1e-12 is 10x above what float64 can err and ~1e9 below any modelling error these tests look for.
TOL64 = 1e-12


def test_token_logprobs_float64_exact_and_gradcheck():
    g = torch.Generator().manual_seed(4)
    full = torch.randn(2, 8, 11, generator=g, dtype=F64)
    logits = full[:, :-1]                                                    # non-contiguous, like a shifted slice
    targets = torch.randint(0, 11, (2, 7), generator=g)
    logp, ent = logprobs.token_logprobs(logits, targets, chunk_size=3, with_entropy=True)
    ls = torch.log_softmax(logits, -1)
    assert torch.allclose(logp, ls.gather(-1, targets[..., None]).squeeze(-1), atol=TOL64, rtol=0)
    assert torch.allclose(ent, -(ls.exp() * ls).sum(-1), atol=TOL64, rtol=0)
    assert torch.allclose(logprobs.entropy_from_logits(logits), ent, atol=TOL64, rtol=0)
    x = logits.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: logprobs.token_logprobs(z, targets, chunk_size=3), (x,))
    _, ent = logprobs.token_logprobs(x, targets, with_entropy=True)
    assert not ent.requires_grad                                             # a diagnostic, no gradient


def test_token_logprobs_bf16_matches_naive():
    """bf16 logits: float32 log-probs equal the naive float32 log_softmax; the bf16 gradient equals the naive one."""
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(3, 10, 50, generator=g)).to(torch.bfloat16)
    targets = torch.randint(0, 50, (3, 10), generator=g)
    w = torch.randn(3, 10, generator=g)
    a = logits.clone().requires_grad_()
    logp = logprobs.token_logprobs(a, targets, chunk_size=4)
    assert logp.dtype == torch.float32
    (logp * w).sum().backward()
    b = logits.clone().requires_grad_()
    naive = b.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (naive * w).sum().backward()
    # two float32 log_softmax orders (chunked vs whole): each rounds l_y - max l (<= 2L), the result (|log p|) and the
    # V-term sum of exp (<= V u); both err, so tol = 2 u (2L + |log p| + V) ~= 1.1e-5 (measured 9.5e-7). A bf16
    # log_softmax would err by 2^-8 |log p| ~= 0.05: 5000x the tolerance.
    u32, L, V = torch.finfo(torch.float32).eps / 2, logits.float().abs().max(), logits.shape[-1]
    assert torch.allclose(logp, naive, atol=float(2 * u32 * (2 * L + naive.abs().max() + V)), rtol=0)
    assert a.grad.dtype == torch.bfloat16
    # each side rounds its float32 gradient to bf16 once (2^-8 relative) after float32 sums of V terms of size |w|
    u16 = torch.finfo(torch.bfloat16).eps / 2
    atol = float(2 * V * u32 * w.abs().max())
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=atol, rtol=float(2 * u16)), (a.grad - b.grad).abs().max()


def test_token_logprobs_temperature_divides_after_the_upcast():
    """log softmax(z / T): float64 gradcheck, and on bf16 logits the float64 reference on the same (exact) bf16
    values to float32 accuracy; dividing the bf16 logits first misses it by ~2^-9 |z/T|."""
    g = torch.Generator().manual_seed(6)
    T, V = 0.6, 40
    targets = torch.randint(0, V, (2, 9), generator=g)
    x = torch.randn(2, 9, V, generator=g, dtype=F64).requires_grad_()
    ref = lambda z: torch.log_softmax(z / T, -1).gather(-1, targets[..., None]).squeeze(-1)  # noqa: E731
    logp, ent = logprobs.token_logprobs(x, targets, chunk_size=4, with_entropy=True, temperature=T)
    assert torch.allclose(logp, ref(x), atol=TOL64, rtol=0)
    ls = torch.log_softmax(x / T, -1)
    assert torch.allclose(ent, -(ls.exp() * ls).sum(-1), atol=TOL64, rtol=0)   # the tempered distribution's entropy
    assert torch.autograd.gradcheck(lambda z: logprobs.token_logprobs(z, targets, chunk_size=4, temperature=T), (x,))

    logits = (15 * torch.randn(2, 9, V, generator=g)).to(torch.bfloat16)        # |z/T| up to ~90
    exact = ref(logits.double())
    got = logprobs.token_logprobs(logits, targets, chunk_size=4, temperature=T)
    # float32 on z/T (|z/T| <= M) and a V-term sum: each step rounds at u32, tol = 2 u32 (2M + |log p| + V)
    u32, M = torch.finfo(torch.float32).eps / 2, float(logits.double().abs().max() / T)
    tol = 2 * u32 * (2 * M + float(exact.abs().max()) + V)
    assert (got.double() - exact).abs().max() < tol
    bf16_first = logprobs.token_logprobs(logits / T, targets, chunk_size=4)          # z/T rounded to bf16
    assert (bf16_first.double() - exact).abs().max() > 100 * tol


def test_shared_prompt_forward_equals_packed_forward_values_and_gradients(monkeypatch):
    """group_size=G (each prompt run once, its KV cache repeated for its G responses) = the packed forward of every
    row, in float64, in the log-probs, the entropies and the gradient of every parameter: prompts of different
    lengths (left padding inside the shared prompt) and responses of different lengths (right padding)."""
    import rollout
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    def rms_norm_in_float64(self, h):
        # HF's LlamaRMSNorm computes in float32 whatever the model's dtype: its backward would round the G rows'
        # summed prompt gradients to float32 (1e-7 relative) where the packed forward rounds each row's. A float64
        # norm makes both paths float64 throughout, so they must agree to float64 rounding.
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_float64)
    model = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    k, G, P, T = 3, 4, 7, 9
    ids, attn = torch.zeros(k * G, P + T, dtype=torch.long), torch.zeros(k * G, P + T, dtype=torch.long)
    for j, plen in enumerate((P, 3, 5)):
        prompt = torch.randint(4, 60, (plen,), generator=g)
        for b in range(j * G, (j + 1) * G):
            rlen = T if b == 1 else int(torch.randint(1, T + 1, (1,), generator=g))
            ids[b, P - plen:P] = prompt
            ids[b, P:P + rlen] = torch.randint(4, 60, (rlen,), generator=g)
            attn[b, P - plen:P + rlen] = 1
    outs = []
    for group_size in (0, G):
        model.zero_grad()
        logp, ent = logprobs.sequence_logprobs(model, ids, attn, P, 2 * G, 0.7, with_entropy=True,
                                               group_size=group_size)
        (logp * torch.linspace(-1, 1, T)).sum().backward()
        outs.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    (lp0, h0, g0), (lp1, h1, g1) = outs
    # float64 through 4 layers: the two paths sum the same products in other orders (attention over p + t keys at
    # once or over the cache and the new keys; a prompt's gradient summed over G rows before or after each layer's
    # backward), O(1e3) operations on values up to ~500 (the embedding gradient): <= 1e3 * 500 * 1.1e-16 ~ 6e-11
    tol = 1e-10
    assert torch.allclose(lp1, lp0, rtol=0, atol=tol) and torch.allclose(h1, h0, rtol=0, atol=tol)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=0, atol=tol)
    with pytest.raises(ValueError, match="share a prompt"):
        bad = ids.clone()
        bad[1, P - 1] += 1
        logprobs.sequence_logprobs(model, bad, attn, P, 2 * G, group_size=G)
    with pytest.raises(ValueError, match="whole groups"):
        logprobs.sequence_logprobs(model, ids, attn, P, 3, group_size=G)

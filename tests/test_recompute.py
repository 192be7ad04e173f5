"""What the packed update's speed levers may change and what they must not: the packed kernel chosen
by what can run (device, capability, dtype), activation recomputation (--recompute none, selective,
full), compiled decoder layers (--compile-layers), the fused head's float32 weight gradient and its
compiled chunk functions (--compile-head), and a
run saved before these settings existed (the memory model that picks a recomputation: tests/test_memory.py). Every
check compares against the padded path, a float64 computation, an op count or a hand computation.
Two ranks: tests/test_two_ranks.py (pack-selective; pack-compiled in `make test-slow`).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

import config
import logprobs
import policy
import rollout
import train
from logprobs import enable_packing, packed_logprobs, sequence_logprobs
from machinery import fused_head, packed_attention
from test_pack import SPANS, U32, U64, rows

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the packed kernel: what can run ---------------------------------------------------------------
@pytest.mark.parametrize("device,cap,dtype,has_varlen,want", [
    ("cpu", None, BF16, True, "sdpa"),                # varlen and Triton are CUDA-only
    ("cuda", (9, 0), BF16, True, "varlen"),           # H100/H200
    ("cuda", (8, 0), FP16, True, "varlen"),           # A100
    ("cuda", (9, 0), FP32, True, "flex"),             # FlashAttention-2 takes no float32
    ("cuda", (9, 0), BF16, False, "flex"),            # a torch without torch.nn.attention.varlen
    ("cuda", (7, 5), FP16, True, "flex"),             # T4: FlashAttention-2 needs sm80
    ("cuda", (7, 0), BF16, True, "flex"),             # V100
    ("cuda", (6, 1), FP16, True, "sdpa"),             # Pascal: below Triton's sm70
    ("cuda", (9, 0), FP64, True, "sdpa"),             # float64: neither kernel
])
def test_kernel_chosen_by_what_can_run(device, cap, dtype, has_varlen, want):
    """FlashAttention-2 (torch's varlen attention) runs fp16/bf16 on sm80+; FlexAttention (Triton)
    fp16/bf16/fp32 on sm70+; SDPA (per row, or one masked call for short rows) anything else."""
    assert packed_attention.choose_kernel(device, cap, dtype, has_varlen) == want


# --- recomputation ---------------------------------------------------------------------------------
def tiny(tied=False, gqa=False, dtype=FP64):
    """The embedded tiny model, or a Qwen2-shaped one with grouped-query heads and q/k/v biases (4
    query heads, 2 key/value heads), random init, with packing enabled."""
    torch.manual_seed(0)
    if gqa:
        conf = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                           tie_word_embeddings=tied, max_position_embeddings=128)
    else:
        conf = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    model.tie_weights()
    return enable_packing(model, "sdpa-rows")


MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
# the attention ops a forward runs: the CPU's SDPA (the packed CPU kernel, sdpa-rows) and the other kernels' ops
ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default", "torch_attn._varlen_attn.default"}


class CountOps(TorchDispatchMode):
    """Counts the ops really dispatched while active (each op's str, as torch's dispatcher names it)."""

    def __init__(self):
        super().__init__()
        self.n = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func)] = self.n.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))

    def count(self, names):
        return sum(v for k, v in self.n.items() if k in names)


def backward_counts(mode, names):
    """(ops of `names` dispatched in the backward, in the forward) of the packed tiny model under `mode`, in float32
    (where the CPU's SDPA is its flash kernel; float64 takes the math path, matmuls)."""
    model = policy.set_recompute(tiny(dtype=FP32), mode)
    model.train()
    ids, _, P = rows()
    with CountOps() as fwd:
        logp, _ = packed_logprobs(model, ids, P, SPANS)
    with CountOps() as bwd:
        logp.sum().backward()
    return bwd.count(names), fwd.count(names)


def test_selective_recomputes_no_matmul_and_full_recomputes_every_layer():
    """A backward without recomputation runs its matmuls' gradients only; full recomputation reruns
    every decoder layer's forward matmuls as well: q, k, v, o, gate, up — not down, whose output no
    gradient needs (torch's non-reentrant checkpoint stops the rerun once the last tensor the
    backward needs exists), 6 per layer; selective keeps their outputs, so its backward runs
    exactly as many matmuls as without."""
    none, fwd = backward_counts("none", MATMULS)
    selective, _ = backward_counts("selective", MATMULS)
    full, _ = backward_counts("full", MATMULS)
    layers = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL).num_hidden_layers
    assert selective == none
    assert full == none + 6 * layers
    assert fwd >= 7 * layers


def test_selective_recomputes_no_attention():
    """The attention calls a backward dispatches, on the CPU's packed kernel (SDPA per row): none without
    recomputation and none under selective, which keeps the attention's output; full reruns every one the forward
    made (a row's call in each layer), which shows the count sees them."""
    layers = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL).num_hidden_layers
    full, fwd = backward_counts("full", ATTENTION)
    assert fwd == layers * sum(1 for p, r in SPANS if p + r) and full == fwd
    assert backward_counts("selective", ATTENTION)[0] == 0
    assert backward_counts("none", ATTENTION)[0] == 0


# A fresh process: the model is set to recompute before torch.nn.attention.varlen is imported, as in train.py (the
# first packed forward imports it); varlen's fake kernel runs on the meta device, so the CUDA op's dispatches are
# counted on a CPU. Prints {mode: (varlen calls in the backward, in the forward)}.
VARLEN_LATE = """
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config
import policy
from logprobs import enable_packing
from machinery import packed_attention
assert "torch.nn.attention.varlen" not in sys.modules
conf = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
models = {m: policy.set_recompute(enable_packing(AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16),
                                                 "varlen"), m).train() for m in ("none", "selective", "full")}
import torch.nn.attention.varlen  # noqa: E402  after set_recompute, as a run imports it
class Count(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func) == "torch_attn._varlen_attn.default"
        return func(*args, **(kwargs or {}))
pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
out = {}
for mode, model in models.items():
    cos, sin = model.model.rotary_emb(torch.zeros(1, 12, 32, dtype=torch.bfloat16), pos)
    model.to("meta")
    h = torch.zeros(1, 12, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    packing = packed_attention.Packing("varlen", [(0, 5), (5, 12)],
                                       torch.tensor([0, 5, 12], dtype=torch.int32, device="meta"), 7)
    with Count() as fwd:
        x = h
        for layer in model.model.layers:
            x = layer(x, attention_mask=None, position_ids=pos.to("meta"),
                      position_embeddings=(cos.to("meta"), sin.to("meta")), packing=packing)
    with Count() as bwd:
        x.sum().backward()
    out[mode] = (bwd.n, fwd.n)
print(json.dumps(out))
"""


def _varlen_late(tmp):
    from test_train import env  # as from a shell
    return subprocess.run([sys.executable, "-c", VARLEN_LATE], cwd=ROOT, capture_output=True, text=True,
                          env=dict(env(), PYTHONPATH=ROOT), timeout=600)  # a hang guard: one fresh interpreter


@pytest.mark.ahead.with_args(_varlen_late, cpu_s=5)
def test_selective_keeps_the_varlen_attention_loaded_after_it(ahead):
    """CUDA's packed kernel, torch's varlen attention, is a custom op whose library loads with its first use, after
    the model was set to recompute. Selective recomputation still keeps its output (0 calls in the backward), as it
    keeps the CPU's; full reruns each layer's call (2 layers: 2), the count's control."""
    res = ahead.result(_varlen_late)
    assert res.returncode == 0, res.stderr[-3000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert counts == {"none": [0, 2], "selective": [0, 2], "full": [2, 2]}


def assert_packed_equals_padded(make, tol):
    """Log-probs and gradients of Σ w·logp at T = 0.7: `make(True)` run packed against `make(False)`
    run padded (fresh models, the same weights), to `tol` (gradients relative to their scale)."""
    ids, attn, P = rows()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(1))
    out = []
    for packed in (False, True):
        model = make(packed).train()
        logp, _ = (packed_logprobs(model, ids, P, SPANS, 0.7) if packed else
                   sequence_logprobs(model, ids, attn, P, 4, 0.7, False, SPANS))    # (B, T)
        (w * logp).sum().backward()
        out.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.allclose(out[1][0], out[0][0], rtol=0, atol=tol)
    for name, g in out[0][1].items():
        assert torch.allclose(out[1][1][name], g, rtol=0, atol=tol * g.abs().max()), name


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("tied,gqa", [(False, False), (True, False), (False, True)])
def test_packed_recomputed_equals_padded_float64(mode, tied, gqa):
    """Packed under `mode` against padded without recomputation, float64, tied and untied, and a
    grouped-query model with biases: the same sums in other orders, tests/test_pack.py's bound
    4 * 64 * 40 u."""
    assert_packed_equals_padded(
        lambda packed: policy.set_recompute(tiny(tied, gqa), mode if packed else "none"),
        4 * 64 * 40 * U64)


# The Qwen2-shaped grouped-query model runs in `make test`: its layers run the ops of the Llama-shaped tiny model's
# (the same attention with one query head per key head, without q/k/v biases; tied embeddings sit outside the
# compiled layers). The other two are `slow`: each compiles cold, ~12-16 s on the 2-core Zen 4 VM.
@pytest.mark.parametrize("tied,gqa", [pytest.param(False, False, marks=pytest.mark.slow),
                                      pytest.param(True, False, marks=pytest.mark.slow), (False, True)])
def test_compiled_layers_packed_equal_padded_float32(tied, gqa):
    """--compile-layers: each decoder layer compiled by Inductor, packed, against the eager padded
    path, float32. Fused kernels sum in other orders: the same bound as two eager orders, 4 * 64 *
    40 u, gradients relative to their scale."""
    assert_packed_equals_padded(
        lambda packed: policy.compile_layers(tiny(tied, gqa, FP32)) if packed else tiny(tied, gqa, FP32),
        4 * 64 * 40 * U32)


def test_recompute_flags_resolve_and_refuse_contradictions():
    """--grad-checkpointing is an alias of --recompute full, --no-grad-checkpointing of none; a
    contradiction, an unknown mode and selective under compiled layers are refused by name."""
    def resolved(**kw):
        return train.resolve_config(train.Config(**kw))
    assert resolved(grad_checkpointing=True).recompute == "full"
    assert resolved(grad_checkpointing=False).recompute == "none"
    assert resolved(recompute="selective", grad_checkpointing=True).recompute == "selective"
    assert resolved().recompute == "auto"
    with pytest.raises(ValueError, match="--recompute none contradicts --grad-checkpointing"):
        resolved(recompute="none", grad_checkpointing=True)
    with pytest.raises(ValueError, match="unknown --recompute 'some'"):
        resolved(recompute="some")
    with pytest.raises(ValueError, match="--compile-layers with --recompute selective"):
        resolved(recompute="selective", compile_layers=True)
    with pytest.raises(ValueError, match="--share-prompt needs --recompute none"):
        resolved(recompute="full", share_prompt=True)
    assert train.parse_config(["--recompute", "selective", "--compile-layers"]).compile_layers


# --- the fused head -------------------------------------------------------------------------------
def head_grads(h, wt, y, chunk, temperature=0.7, with_entropy=False, compiled=False):
    hh, ww = h.clone().requires_grad_(), wt.clone().requires_grad_()
    logp, ent = fused_head.HeadLogprob.apply(hh, ww, y, chunk, with_entropy, temperature, compiled)
    logp.sum().backward()
    return logp.detach(), hh.grad, ww.grad, ent


def reference_grads(h, wt, y, temperature=0.7):
    """float64 autograd through the unfused head: log_softmax(h W^T / T)[y]."""
    hh, ww = h.double().requires_grad_(), wt.double().requires_grad_()
    logp = torch.log_softmax(hh @ ww.T / temperature, -1).gather(-1, y[:, None])[:, 0]
    logp.sum().backward()
    return logp.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_fused_head_float32_against_float64(chunk):
    """The fused head in float32 (chunks of 1, 5, 64 rows; the weight gradient accumulated over
    chunks) against float64 autograd through the unfused head. A logit z = h·w/T of length-d dot
    products errs by <= d u |h||w|/T; a log-prob by twice the largest logit error; a gradient entry
    sums n rows of products of softmax-weighted terms, each exact to ~(d + 2) u relative: bound
    4 (d + n) u times the gradient's scale."""
    g = torch.Generator().manual_seed(3)
    n, d, V = 40, 16, 50
    h, wt = torch.randn(n, d, generator=g), torch.randn(V, d, generator=g) / 4
    y = torch.randint(0, V, (n,), generator=g)
    got, want = head_grads(h, wt, y, chunk)[:3], reference_grads(h, wt, y)
    zerr = d * U32 * (h.abs() @ wt.abs().T).max().item() / 0.7
    assert torch.allclose(got[0].double(), want[0], rtol=0, atol=4 * zerr)
    for a, b in zip(got[1:], want[1:]):
        assert torch.allclose(a.double(), b, rtol=0, atol=4 * (d + n) * U32 * b.abs().max()
                              + 4 * zerr * b.abs().max())


# slow on a CPU: Inductor's cold C++ compile of the two chunk functions, 17-24 s on 2 shared cores; the CUDA case runs
# in `make gpu-check`'s tests section (`-m gpu`), where train.py compiles them
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_head_compiled_chunks_equal_eager(device):
    """--compile-head: the fused head's chunk functions through torch.compile (Inductor's C++ on a CPU, Triton on
    CUDA, where train.py compiles them) against the same functions eager: log-probs, entropy and both gradients,
    float32, T = 0.7, two chunks of 8 rows. Both sides sum the same float32 terms in other orders with other exp
    kernels. A block's normaliser sums V terms <= 1: each side errs by <= (V + 2) u relative, so lse by as much
    absolute plus u |lse|; the entropy's Σ p z adds (V + 2) u max|z|; a softmax entry exp(z − lse) errs by eps_p = (max|z| + 2 max|lse| + V + 4) u relative. The gradients: Σ_v |Δd_v|
    <= 2 eps_p |g| (Σ p = 1) through the same matmuls, each side's matmul erring by <= k u Σ|d||x| over its k terms
    (V for hidden's, n for the weight's, Σ_v |d_v| <= 2|g|, Σ_rows <= n |g|). Every bound doubled: two sides."""
    gen = torch.Generator().manual_seed(5)
    n, d, V, T = 16, 8, 97, 0.7
    h, wt = torch.randn(n, d, generator=gen).to(device), (torch.randn(V, d, generator=gen) / 2).to(device)
    y = torch.randint(0, V, (n,), generator=gen).to(device)
    eager = head_grads(h, wt, y, 8, T, with_entropy=True)
    got = head_grads(h, wt, y, 8, T, with_entropy=True, compiled=True)
    assert fused_head.compiled.cache_info().currsize == 2  # the forward's and the backward's, compiled
    z = (h @ wt.T / T).abs().max().item()
    lse = torch.logsumexp(h @ wt.T / T, -1).abs().max().item()
    eps_p, g = (z + 2 * lse + V + 4) * U32, 1 / T
    assert torch.allclose(got[0], eager[0], rtol=0, atol=2 * ((V + 2) * U32 + U32 * max(1, lse)) * 2)
    assert torch.allclose(got[3], eager[3], rtol=0, atol=2 * ((V + 2) * U32 * (1 + z) + U32 * max(1, lse)) * 2)
    assert torch.allclose(got[1], eager[1], rtol=0, atol=2 * (2 * eps_p + 2 * V * U32) * g * wt.abs().max())
    assert torch.allclose(got[2], eager[2], rtol=0, atol=2 * (2 * eps_p + (n + 2) * U32) * n * g * h.abs().max())


@pytest.mark.gpu
def test_fused_head_bf16_cuda_weight_gradient_in_float32():
    """bf16 on CUDA, where the weight gradient is accumulated by cuBLAS with a float32 output: its
    error against float64 is at most twice that of autograd through the unfused bf16 head (whose
    gradient is one bf16 matmul, rounded once to bf16 — ours is rounded once at the end)."""
    g = torch.Generator().manual_seed(4)
    n, d, V = 3000, 64, 5000
    h = torch.randn(n, d, generator=g).cuda().to(BF16)
    wt = (torch.randn(V, d, generator=g) / 8).cuda().to(BF16)
    y = torch.randint(0, V, (n,), generator=g).cuda()
    _, _, gw, _ = head_grads(h, wt, y, 1024)
    ww = wt.clone().requires_grad_()
    torch.log_softmax((h @ ww.T).float() / 0.7, -1).gather(-1, y[:, None]).sum().backward()
    _, _, ref = reference_grads(h, wt, y)
    assert (gw.double() - ref).abs().max() <= 2 * (ww.grad.double() - ref).abs().max()


# --- defects of the packed path -------------------------------------------------------------------
def test_packed_micro_batch_of_empty_responses_equals_padded():
    """A micro-batch whose responses are all empty (rows of a batch whose other rows have some) has
    no response position: log-probs 0 and a backward that carries nothing, as the padded path (an
    empty index list once became float32: IndexError)."""
    spans = [(3, 0), (5, 0), (2, 4)]
    ids, attn, P = rows(spans)
    model = tiny()
    logp, _ = packed_logprobs(model, ids[:2], P, spans[:2])                          # (2, T)
    padded, _ = sequence_logprobs(model, ids[:2], attn[:2], P, 2, 1.0, False, spans[:2])
    assert logp.shape == padded.shape == (2, 4) and (logp == 0).all() and (padded == 0).all()
    logp.sum().backward()


def test_run_saved_before_packing_resumes_padded(tmp_path):
    """A run saved before --pack, --recompute and --compile-layers existed (a committed coin run's
    config.json, without those keys) resumes as it ran: padded, its grad checkpointing as
    recomputation, eager layers — not today's defaults (packing is on by default where it pays)."""
    saved = json.load(open("experiments/results/random-toy/runs/clip-d0.05-s8/config.json"))
    assert not {"pack", "recompute", "compile_layers"} & set(saved)
    run = tmp_path / "run"
    run.mkdir()
    saved["model"] = rollout.DEFAULT_MODEL
    (run / "config.json").write_text(json.dumps(saved))
    cfg = train.load_run_config(["--resume", str(run), "--max-steps", "301"])
    assert cfg.pack is False and cfg.compile_layers is False and cfg.compile_head is False
    assert policy.resolve_recompute(cfg) == ("full" if saved["grad_checkpointing"] else "none")
    with pytest.raises(ValueError, match="unknown settings bogus"):
        config.saved_config({**saved, "bogus": 1})

"""Packed micro-batches (--pack): the rows' real tokens end to end, attention confined to each row
(machinery/packed_attention.py), the LM head fused with the log-prob (machinery/fused_head.py).
Every check compares against the padded path (logprobs.sequence_logprobs, the reference), a
float64 model, finite differences or a brute-force plan, never the packed code against itself.
Two ranks: tests/test_two_ranks.py (scenarios pack-budget, pack-kl-is, bf16-pack).
"""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import logprobs
import policy
import rollout
import train
from logprobs import RolloutBatch, enable_packing, packed_logprobs, sequence_logprobs
from machinery import fused_head, packed_attention
from machinery.precision import cpu_has_native_bf16

U32, U64 = torch.finfo(torch.float32).eps / 2, torch.finfo(torch.float64).eps / 2
# rows of very different lengths: (prompt, response) tokens, an empty response among them
SPANS = [(7, 40), (1, 1), (3, 0), (2, 23), (6, 5), (4, 2)]


def rows(spans=SPANS, vocab=100, seed=0):
    """Left-padded prompts and right-padded responses (as logprobs.pack) of the given spans."""
    g = torch.Generator().manual_seed(seed)
    P, T = max(p for p, _ in spans), max(r for _, r in spans)
    ids = torch.zeros(len(spans), P + T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate(spans):
        ids[i, P - p:P + r] = torch.randint(4, vocab, (p + r,), generator=g)
        attn[i, P - p:P + r] = 1
    return ids, attn, P


def model64(tied):
    """The tiny model in float64, its embedding untied (as built) or tied to the LM head."""
    conf = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return enable_packing(AutoModelForCausalLM.from_config(conf, dtype=torch.float64))


@pytest.mark.parametrize("tied,kernel", [(False, "sdpa-rows"), (True, "sdpa-rows"), (True, "sdpa-block")])
def test_packed_equals_padded_float64(tied, kernel):
    """Log-probs, entropy and the gradient of Σ w·logp of rows from 1 to 47 tokens, at T = 0.7,
    packed against padded, float64. Both paths compute the same sums in other orders: a logit errs
    by <~ n_layers sqrt(d_ff) u max|z| (tiny model: 64 u, |z| <~ 40, tests/test_two_ranks.py), a
    log-prob by twice that, both sides: 4 * 64 * 40 u; gradients the same relative to their scale."""
    model = model64(tied)
    ids, attn, P = rows()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(1))
    out = []
    for packed in (False, True):
        model.zero_grad()
        logp, ent = (packed_logprobs(model, ids, P, SPANS, 0.7, True, kernel) if packed else
                     sequence_logprobs(model, ids, attn, P, 4, 0.7, True, SPANS))   # (B, T)
        (w * logp).sum().backward()
        out.append((logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    tol = 4 * 64 * 40 * U64
    assert torch.allclose(out[1][0], out[0][0], rtol=0, atol=tol)
    assert torch.allclose(out[1][1], out[0][1], rtol=0, atol=tol)
    for name, g in out[0][2].items():
        assert torch.allclose(out[1][2][name], g, rtol=0, atol=tol * g.abs().max()), name
    assert (out[1][0][2] == 0).all()  # the empty response: nothing, as padded


def test_fused_head_gradcheck():
    """HeadLogprob's backward (chunks of 3 rows, T = 0.7) against finite differences, float64."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    wt = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=g)
    assert torch.autograd.gradcheck(
        lambda h, wt: fused_head.HeadLogprob.apply(h, wt, y, 3, False, 0.7)[0], (h, wt))


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16 (avx512_bf16, amx_bf16)")
@pytest.mark.parametrize("upcast", [False, True])
def test_packed_bf16_as_close_to_float64_as_padded(upcast):
    """bf16: packed and padded log-probs against the float64 model, the packed attention in bf16 and in float32
    (packed_attention.float32_attention). Both round weights and activations to bf16 with the same depth, so their
    errors have the same scale (the premise of scripts/gpu_check.py's vLLM tolerance): the packed error is at most
    twice the padded one."""
    model = model64(tied=True)
    setattr(model, logprobs.PACKED_UPCAST, upcast)
    ids, attn, P = rows(seed=3)
    mask = attn[:, P:].bool()
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, ids, attn, P, 4, spans=SPANS)
        model.to(torch.bfloat16)
        padded, _ = sequence_logprobs(model, ids, attn, P, 4, spans=SPANS)
        packed, _ = packed_logprobs(model, ids, P, SPANS)
    err = {k: (x.double() - ref)[mask].abs() for k, x in (("padded", padded), ("packed", packed))}
    assert err["padded"].max() > 0  # bf16 really rounded
    assert err["packed"].max() <= 2 * err["padded"].max()
    assert err["packed"].mean() <= 2 * err["padded"].mean()


@pytest.mark.parametrize("kernel", packed_attention.SDPA_KERNELS)
def test_float32_attention_rounds_bf16_once(kernel):
    """bf16 q, k, v (4 heads, 2 key/value heads, D 16, scale 1/4) with the packing's upcast, as a CPU without AMX runs
    them: each output element is the float64 attention of the same inputs rounded once to bf16, |out - ref| <= 2^-8
    |ref| (bf16's unit roundoff) + float32's own error: the scores' dot products (D u32 |s|, |s| = |q.k| / 4 <= 16 x
    4.5^2 / 4 = 81 for normal draws within 4.5 sd) through exp to the weights, and the sum over <= 81 keys: <= (81 +
    16 x 81) u32 max|v| = 1377 u32 max|v| (~3e-4 here). The bf16 kernel breaks that bound (it rounds inside)."""
    g = torch.Generator().manual_seed(0)
    lengths = [47, 2, 30, 81]
    n = sum(lengths)
    q, k, v = (torch.randn(1, h, n, 16, generator=g).clamp(-4.5, 4.5).bfloat16() for h in (4, 2, 2))
    ref = packed_attention.KERNELS[kernel](q.double(), k.double(), v.double(),
                                           packed_attention.make_packing(lengths, "cpu", kernel), 0.25)
    bound = 1377 * U32 * v.abs().max().item()
    err = {}
    for upcast in (False, True):
        packing = packed_attention.make_packing(lengths, "cpu", kernel, upcast=upcast)
        out = packed_attention.KERNELS[kernel](q, k, v, packing, 0.25)                   # (1, N, H, D)
        assert out.dtype == torch.bfloat16
        err[upcast] = ((out.double() - ref).abs() - 2 ** -8 * ref.abs()).max()
    assert err[True] <= bound < err[False]


def test_float32_attention_leaves_rows_past_its_limit_in_bf16():
    """UPCAST_MAX_ROW (512): a micro-batch whose longest row passes it runs bf16 attention even with the upcast asked
    for (bit for bit the bf16 kernel's output), one at the limit runs float32 (another output)."""
    g = torch.Generator().manual_seed(1)
    limit = packed_attention.UPCAST_MAX_ROW
    for lengths, same in (([3, limit + 1], True), ([3, limit], False)):
        n = sum(lengths)
        q, k, v = (torch.randn(1, h, n, 16, generator=g).bfloat16() for h in (4, 2, 2))
        packings = [packed_attention.make_packing(lengths, "cpu", "sdpa-rows", upcast=up) for up in (False, True)]
        out = [packed_attention.KERNELS["sdpa-rows"](q, k, v, p, 0.25) for p in packings]
        assert torch.equal(out[0], out[1]) == same, lengths


def test_float32_attention_is_decided_once_and_reaches_the_kernel(monkeypatch):
    """packed_attention.float32_attention: bf16 (or fp16) on a CPU without AMX, nothing else; enable_packing stores
    it from the weights' device and dtype, and packed_logprobs passes it on: the same bf16 model's log-probs move
    with the flag alone (float32 attention against bf16's)."""
    from machinery import precision
    monkeypatch.setattr(packed_attention, "cpu_has_amx", lambda: False)
    assert packed_attention.float32_attention("cpu", torch.bfloat16)
    assert not packed_attention.float32_attention("cpu", torch.float32)
    assert not packed_attention.float32_attention("cuda", torch.bfloat16)
    monkeypatch.setattr(packed_attention, "cpu_has_amx", lambda: True)
    assert not packed_attention.float32_attention("cpu", torch.bfloat16)
    assert precision.cpu_has_amx() == ("amx_bf16" in precision.cpu_flags())
    monkeypatch.setattr(packed_attention, "cpu_has_amx", lambda: False)
    model = model64(tied=True).to(torch.bfloat16)
    assert getattr(enable_packing(model), logprobs.PACKED_UPCAST) is True
    ids, attn, P = rows(seed=3)
    with torch.no_grad():
        logp = {}
        for upcast in (True, False):
            setattr(model, logprobs.PACKED_UPCAST, upcast)
            logp[upcast] = packed_logprobs(model, ids, P, SPANS)[0]
    moved = (logp[True] - logp[False]).abs().max().item()
    # bf16's rounding of the attention shows (a bf16 log-prob's last bit); a dropped flag runs the same kernels on the
    # same inputs: exactly 0. Below 1: both are the same model within bf16 rounding
    assert 0 < moved < 1


@pytest.mark.slow
def test_flex_kernel_equals_sdpa_rows_forward():
    """The CUDA fallback kernel (compiled FlexAttention, document mask) in its CPU form: float32
    forward only (no backward on a CPU), equal to the padded path within float32's 4 * 64 * 40 u."""
    conf = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL)
    model = enable_packing(AutoModelForCausalLM.from_config(conf, dtype=torch.float32))
    ids, attn, P = rows(seed=4)
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, ids, attn, P, 6, spans=SPANS)
        flex, _ = packed_logprobs(model, ids, P, SPANS, kernel="flex")
    assert torch.allclose(flex, ref, rtol=0, atol=4 * 64 * 40 * U32)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_cuda_kernels_as_close_to_float64_as_padded(kernel):
    """On CUDA in bf16, each packed kernel's log-probs and gradient against the float64 model (CPU),
    next to the padded path's (transformers' SDPA with a mask): both round to bf16 at the same depth,
    so the packed error is at most twice the padded one (as in the CPU bf16 test above)."""
    if kernel == "varlen" and packed_attention.kernel_for("cuda") != "varlen":
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model = model64(tied=True)
    ids, attn, P = rows(seed=5)
    mask = attn[:, P:].bool()
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref, _ = sequence_logprobs(model, ids, attn, P, 4, spans=SPANS)
    (w * ref).sum().backward()
    ref_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    model.to("cuda", torch.bfloat16)
    err = {}
    for name in ("padded", "packed"):
        model.zero_grad()
        logp, _ = (packed_logprobs(model, ids.cuda(), P, SPANS, kernel=kernel) if name == "packed" else
                   sequence_logprobs(model, ids.cuda(), attn.cuda(), P, 4, spans=SPANS))   # (B, T)
        (w.cuda() * logp.double()).sum().backward()
        grad = model.model.embed_tokens.weight.grad.double().cpu()
        err[name] = ((logp.double().cpu() - ref)[mask].abs().max(), (grad - ref_grad).abs().max())
    assert err["padded"][0] > 0  # bf16 really rounded
    assert err["packed"][0] <= 2 * err["padded"][0]
    assert err["packed"][1] <= 2 * err["padded"][1]


def test_sdpa_kernel_rule_hand_cases():
    """The CPU's "sdpa" picks one masked call where the pairs it adds, N^2 - sum n_i^2, are at most ROW_CALL_PAIRS
    (600) per row call it saves: 8 rows of 2 tokens add 256 - 32 = 224 <= 4200 (block); 2 rows of 20 add 800 > 600
    (rows); 2 rows of 17 add 578 <= 600 (block); 1 row adds nothing and saves nothing (block: one call either way);
    SPANS' rows (47, 2, 3, 25, 11, 6) add 8836 - 3004 = 5832 > 3000 (rows)."""
    pick = packed_attention.sdpa_kernel
    assert [pick([2] * 8), pick([20, 20]), pick([17, 17]), pick([300])] == ["sdpa-block", "sdpa-rows",
                                                                           "sdpa-block", "sdpa-block"]
    assert pick([p + r for p, r in SPANS]) == "sdpa-rows"
    assert packed_attention.make_packing([17, 17], "cpu", "sdpa").kernel == "sdpa-block"
    assert packed_attention.make_packing([20, 20], "cpu", "sdpa").kernel == "sdpa-rows"


def test_packed_budget_counts_real_tokens():
    """--pack --micro-batch-tokens N: every row once, each micro-batch at most N real tokens unless
    it is one row; the same rows then fill fewer micro-batches than padded budgets."""
    g = torch.Generator().manual_seed(5)
    spans = [(int(p), int(r)) for p, r in zip(torch.randint(2, 30, (40,), generator=g),
                                              torch.randint(0, 200, (40,), generator=g))]
    packed = policy.micro_batches(slice(0, 40), train.Config(micro_batch_tokens=400, pack=True), spans)
    padded = policy.micro_batches(slice(0, 40), train.Config(micro_batch_tokens=400), spans)
    assert sorted(i for mb in packed for i in mb) == list(range(40))
    for mb in packed:
        assert len(mb) == 1 or sum(sum(spans[i]) for i in mb) <= 400
    assert len(packed) < len(padded)


def test_pack_and_share_prompt_refused():
    """The two cannot combine (a shared prompt is attended by G rows): one line naming both."""
    with pytest.raises(ValueError, match="--pack and --share-prompt do not combine"):
        train.resolve_config(train.Config(pack=True, share_prompt=True))


def test_pack_auto_by_the_padding_it_removes(group, monkeypatch):
    """--pack unset on a CPU: on where the padded path's padded / real tokens at start-up (responses taken as
    --max-new-tokens) reach policy.PACK_MIN_PADDING. Hand-counted with the defaults (G 8, 16 new tokens, mini-batches
    of 8 prompts = one micro-batch of 64 rows): prompts of 8 tokens pad nothing, 1.00; seven prompts of 4 and one of
    20 run 64 x (20 + 16) = 2304 padded tokens for 8 x (7 x 20 + 36) = 1408 real ones, 1.64; on 2 ranks a rank's
    mini-batch is 4 prompts: (4 x 8 x 20 + 4 x 8 x 36) / 1408 = 1.27. CUDA packs; --pack and --no-pack decide;
    off where --share-prompt is on."""
    cpu, lens, mixed = torch.device("cpu"), [8] * 8, [4] * 7 + [20]
    cfg = train.resolve_config(train.Config(grad_checkpointing=False))
    monkeypatch.setattr(policy, "PACK_MIN_PADDING", {"cpu": 1.5, "cpu-amx": 1.5})
    assert policy.start_up_padding(cfg, 1, lens) == 1.0
    assert policy.start_up_padding(cfg, 1, mixed) == 2304 / 1408
    assert policy.start_up_padding(cfg, 2, mixed) == (4 * 8 * 20 + 4 * 8 * 36) / 1408
    assert policy.pack_pays(cfg, cpu, 1, mixed) == (True, "auto: padded / real tokens 1.64 >= 1.5, prompts' "
                                                          "padding with responses of --max-new-tokens")
    assert policy.pack_pays(cfg, cpu, 2, mixed)[0] is False
    assert policy.pack_pays(cfg, torch.device("cuda"), 1, lens)[0] is True
    assert train.decide_grad_checkpointing(cfg, cpu, lens)[0].pack is False
    assert train.decide_grad_checkpointing(cfg, cpu, mixed)[0].pack is True
    for given in (True, False):
        decided = train.decide_grad_checkpointing(train.resolve_config(train.Config(grad_checkpointing=False,
                                                                                    pack=given)), cpu, mixed)[0]
        assert decided.pack is given and policy.pack_reason(dataclasses.replace(cfg, pack=given), decided, cpu, 1,
                                                            mixed) == "as given"
    shared = train.resolve_config(train.Config(grad_checkpointing=False, share_prompt=True))
    assert train.decide_grad_checkpointing(shared, cpu, mixed)[0].pack is False


def test_start_up_padding_is_the_planners_padding():
    """start_up_padding's one pass over every prompt = the padded path's own plan (policy.micro_batches, mini-batch
    by mini-batch, `_cost` of each micro-batch), exact integers, for shapes whose micro-batches straddle nothing,
    end short of a mini-batch, or hold one row, and a last mini-batch short of the others. Under token budgets the
    planner itself runs: its padded tokens are never fewer than the real ones."""
    import random
    rng = random.Random(0)
    lens = [rng.randint(1, 60) for _ in range(203)]
    for G, mini, world, mb, T in [(8, 8, 1, 64, 16), (4, 6, 2, 5, 12), (3, 2, 2, 1, 0), (16, 4, 1, 7, 64)]:
        cfg = dataclasses.replace(train.Config(), group_size=G, mini_batch_prompts=mini, micro_batch_size=mb,
                                  max_new_tokens=T, micro_batch_tokens=0, pack=False)
        rows, padded, real = max(1, mini // world), 0, 0
        for i in range(0, len(lens), rows):
            spans = [(p, T) for p in lens[i:i + rows] for _ in range(G)]
            for s in policy.micro_batches(slice(0, len(spans)), cfg, spans):
                padded += policy._cost(range(s.start, s.stop), spans, False)
            real += sum(p + T for p, _ in spans)
        assert policy.start_up_padding(cfg, world, lens) == padded / real, (G, mini, world, mb, T)
    budget = dataclasses.replace(cfg, micro_batch_tokens=300)
    assert policy.start_up_padding(budget, 1, lens) >= 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_update_equals_padded_with_kl_and_rollout_correction(group, dtype):
    """FSDP2 update (2 mini-batches, the clip binding, the KL term, a token-level rollout
    correction) packed with a token budget against padded row micro-batches. float32: the weights
    agree to summation-order rounding (tests/test_policy.py's bound, 8 u relative + 128 u of the
    largest move); bf16 (native only): the same bound in bf16's u. The first mini-batch's ratio is
    exactly 1 where π_old comes from the packed pass itself."""
    if dtype == "bfloat16" and not cpu_has_native_bf16():
        pytest.skip("no native bf16")
    u = U32 if dtype == "float32" else torch.finfo(torch.bfloat16).eps / 2
    ids, attn, P = rows(seed=6)
    B, T = ids.shape[0], ids.shape[1] - P
    mask = attn[:, P:].float()
    adv = torch.linspace(-1.0, 1.2, B)
    g = torch.Generator().manual_seed(7)
    noise, engine_noise = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    weights, first = [], []
    for pack in (False, True):
        cfg = train.Config(method="clip", model=rollout.DEFAULT_MODEL, prompts_per_step=2,
                           mini_batch_prompts=1, group_size=3, micro_batch_size=2,
                           micro_batch_tokens=40 if pack else 0, pack=pack, max_new_tokens=T,
                           lr=1e-2, grad_clip=1e6, train_dtype=dtype, kl_coef=0.5,
                           rollout_is="token-truncate", rollout_is_max=1.5)
        model = policy.build_model(cfg, torch.device("cpu"))
        ref_model = policy.build_model(cfg, torch.device("cpu"), trainable=False)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        b = RolloutBatch(ids, attn, mask, P)
        old, _ = policy.batch_logprobs(model, cfg, b)
        ref, _ = policy.batch_logprobs(ref_model, cfg, b)
        b.engine_logp = old + 0.3 * engine_noise
        exact = policy.update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, b,
                                     adv, old, ref - 0.3 * noise)[0]
        first.append(float(exact["sum_first_abs_dev"]))
        sums, skipped, _ = policy.update_policy(model, opt, cfg, b, adv, old + 0.5 * noise,
                                                ref - 0.3 * noise)
        assert skipped == 0 and sums["n_upper"] + sums["n_lower"] > 0 and sums["sum_kl_ref"] > 0
        weights.append({k: v.full_tensor().clone() for k, v in model.state_dict().items()})
    assert first[1] == 0.0  # π_old from the packed pass: the ratio is exactly 1
    before = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL,
                                                  dtype=torch.float32).state_dict()
    moved = max((weights[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3
    for k in weights[0]:
        assert torch.allclose(weights[1][k], weights[0][k], rtol=8 * u, atol=128 * u * moved), k


def test_same_config_same_bits_whatever_the_free_memory(group, monkeypatch):
    """A run is a function of its config: two builds of the same packed float32 model (policy.build_model) on a machine
    with 7·12·16·V and 11·12·16·V bytes free (the memory reading that sized the fused head's chunk: 7 and 11 rows)
    give bit-identical log-probs and gradients of Σ w·logp over 71 response tokens. The chunk sets the order of the
    weight gradient's float32 sum and the shape of the head's matmul, so chunks sized by the free memory gave other
    bits (here already in the log-probs)."""
    from machinery import memory
    ids, attn, P = rows(seed=8)
    w = torch.randn(len(SPANS), ids.shape[1] - P, generator=torch.Generator().manual_seed(9))
    cfg = train.Config(model=rollout.DEFAULT_MODEL, pack=True, train_dtype="float32")
    vocab = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL).vocab_size
    out = []
    for rows_free in (7, 11):
        monkeypatch.setattr(memory, "free_memory", lambda device, n=rows_free: (n * 12 * 16 * vocab, "test"))
        model = policy.build_model(cfg, torch.device("cpu"))
        logp, _ = packed_logprobs(model, ids, P, SPANS)                                   # (B, T)
        (w * logp).sum().backward()
        out.append((logp.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    assert torch.equal(out[0][0], out[1][0])
    for name, g in out[0][1].items():
        assert torch.equal(out[1][1][name], g), name


def brute_force_indices(spans, n_prompt):
    """packed_indices' lists, one token at a time in plain Python."""
    out = {k: [] for k in ("row", "col", "pos", "src", "dst_row", "dst_col")}
    start = 0
    for i, (p, r) in enumerate(spans):
        for j in range(p + r):
            out["row"].append(i)
            out["col"].append(n_prompt - p + j)
            out["pos"].append(j)
        for j in range(r):  # response token j sits at packed position start + p + j, predicted by the one before
            out["src"].append(start + p + j - 1)
            out["dst_row"].append(i)
            out["dst_col"].append(j)
        start += p + r
    return out


def test_packed_indices_built_on_the_device_equal_brute_force():
    """logprobs.packed_indices (cumulative sums and repeat_interleave on the device) against the indices written out
    token by token, for SPANS (an empty response among them), one row, and rows with empty responses only."""
    for spans in (SPANS, [(5, 3)], [(2, 0), (3, 0)]):
        P = max(p for p, _ in spans)
        got = logprobs.packed_indices(spans, P, "cpu")
        for key, want in brute_force_indices(spans, P).items():
            assert got[key].dtype == torch.long and got[key].tolist() == want, (spans, key)
        assert got["lengths"].tolist() == [p + r for p, r in spans]


@pytest.mark.gpu
def test_packed_indices_do_not_synchronise_on_cuda():
    """The packed path's index building does no blocking host-device transfer: under
    torch.cuda.set_sync_debug_mode("error") (which raises on any synchronising CUDA call) packed_indices runs, and
    its indices equal the brute-force ones."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = logprobs.packed_indices(SPANS, 7, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for key, want in brute_force_indices(SPANS, 7).items():
        assert got[key].tolist() == want, key

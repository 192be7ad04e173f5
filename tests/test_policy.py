"""policy.py in one process (gloo, world size 1) on the embedded tiny model, each piece against a reference that does
not use it: the log-probs of padded, trimmed, micro-batched rows with response-only logits against one
unpadded full forward per row; the on-policy update (old log-probs = its own forward) against the off-policy update
given separately computed old log-probs; the load-once FSDP2 build against from_pretrained; the batch-shape check
against the rows each rank would train on.
"""
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
import logprobs
import policy
import rollout
import train
from logprobs import RolloutBatch

U32 = torch.finfo(torch.float32).eps / 2  # float32 unit roundoff


@pytest.fixture(scope="module")
def reference():
    return AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float64).eval()


def batch(seed=0, B=6, P=7, T=9, vocab=60):
    """Rows with prompts of 2..P tokens (left-padded) and responses of 1..T tokens (right-padded), as logprobs.pack."""
    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.randint(2, P + 1, (B,), generator=g), torch.randint(1, T + 1, (B,), generator=g)
    plen[0], rlen[1] = P, T  # the longest prompt and response set the width, as in a real step
    ids = torch.zeros(B, P + T, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    for b in range(B):
        ids[b, P - plen[b]:P + rlen[b]] = torch.randint(4, vocab, (int(plen[b] + rlen[b]),), generator=g)
        attn[b, P - plen[b]:P + rlen[b]] = 1
    return ids, attn, attn[:, P:].float(), P


def test_build_model_loads_once_and_matches_from_pretrained(group, reference):
    """Meta-device build + rank-0 load + broadcast: every parameter and buffer equals from_pretrained's, bit for bit
    (a shard left uninitialised by to_empty, or rotary frequencies lost with the meta buffers, would not)."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, train_dtype="float32")
    model = policy.build_model(cfg, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32)
    for name, p in ref.state_dict().items():
        got = model.state_dict()[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(got, p), name
    bufs = dict(model.named_buffers())
    for name, b in ref.named_buffers():
        assert torch.equal(bufs[name], b), name


def test_bf16_train_dtype_computes_in_bf16_on_fp32_master_weights(group):
    """--train-dtype bfloat16 (FSDP2 MixedPrecisionPolicy): the forward computes in bf16 (bf16 logits), while the
    parameters the optimizer updates and their gradients stay float32. Under float32 the logits are float32."""
    ids, attn, mask, P = batch(seed=2)
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        cfg = train.Config(model=rollout.DEFAULT_MODEL, train_dtype=dtype)
        model = policy.build_model(cfg, torch.device("cpu"))
        logits = model(input_ids=ids, attention_mask=attn).logits                   # (B, P+T, V)
        assert logits.dtype == want, dtype
        (logits.float().logsumexp(-1) * attn).sum().backward()
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (dtype, name)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sequence_logprobs_equal_unpadded_forward(group, reference, temperature):
    """Padded + trimmed micro-batches with logits for response positions only = log_softmax(logits / T) of one
    unpadded float64 forward per row, at every response token; 0 past each response."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, train_dtype="float32")
    model = policy.build_model(cfg, torch.device("cpu"), trainable=False)
    ids, attn, mask, P = batch()
    with torch.no_grad():
        logp, ent = logprobs.sequence_logprobs(model, ids, attn, P, 4, temperature, with_entropy=True)
    for b in range(ids.shape[0]):
        row = ids[b][attn[b].bool()]
        n_resp = int(mask[b].sum())
        with torch.no_grad():
            z = reference(row[None]).logits[0] / temperature                      # (L, V) float64
        lp = torch.log_softmax(z, -1)[:-1].gather(-1, row[1:, None])[:, 0][-n_resp:]  # (n_resp,)
        p = torch.softmax(z, -1)[:-1][-n_resp:]
        h = -(p * torch.log_softmax(z, -1)[:-1][-n_resp:]).sum(-1)
        # float32 forward vs float64 (test_rollout's bound, one side erring): each logit/T errs by <~ n_layers
        # sqrt(d_ff) u max|z| (tiny model: 4 * 16 = 64), a log-prob by <= 2x that (sum_v |d logp / d z_v| <= 2), the
        # entropy by <= 2 max|z| x that (sum_v |dH / dz_v| = sum_v p_v |z_v - E z| <= 2 max|z|). An off-by-one
        # position or a missing 1/T moves them by O(0.1).
        zmax = z.abs().max().item()
        dz = 64 * U32 * zmax
        assert torch.allclose(logp[b, :n_resp].double(), lp, atol=2 * dz), b
        assert torch.allclose(ent[b, :n_resp].double(), h, atol=2 * zmax * dz), b
        assert (logp[b, n_resp:] == 0).all()


def test_on_policy_update_equals_off_policy_with_fresh_old_logprobs(group):
    """One mini-batch: update_policy(old_logp=None), which takes π_old from its own forward, moves the weights exactly
    as update_policy given old log-probs from a separate no-grad pass (the path it skips)."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=2, mini_batch_prompts=2, group_size=3,
                       micro_batch_size=4, max_new_tokens=9, lr=1e-2, grad_clip=1e6, train_dtype="float32")
    ids, attn, mask, P = batch(seed=1)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.4])
    weights = []
    for on_policy in (True, False):
        torch.manual_seed(0)
        model = policy.build_model(cfg, torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        old = None
        if not on_policy:
            with torch.no_grad():
                old, _ = logprobs.sequence_logprobs(model, ids, attn, P, cfg.micro_batch_size, cfg.temperature)
        sums, skipped, _ = policy.update_policy(model, opt, cfg, RolloutBatch(ids, attn, mask, P), adv, old)
        assert skipped == 0
        weights.append({k: v.full_tensor().clone() for k, v in model.state_dict().items()})
    before = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).state_dict()
    moved = max((weights[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3  # the step moved the weights
    for k in weights[0]:
        # the same float32 computation in both runs, except old_logp's forward (no-grad vs grad mode: same
        # kernels on CPU), so the ratio is 1 up to rounding either way: the weights agree to a few ulps of |w|
        assert torch.allclose(weights[0][k], weights[1][k], rtol=8 * U32, atol=8 * U32 * moved), k


@pytest.mark.parametrize("prompts,group_size,mini,world,ok", [
    (4, 3, 1, 2, False),   # 6 rows per rank, 4 mini-batches -> 4 of 6 rows trained on
    (4, 3, 2, 2, True),    # 6 rows per rank in 2 mini-batches of 3
    (4, 4, 1, 2, True),
    (6, 2, 4, 1, False),   # 6 prompts are not a multiple of 4 per mini-batch
    (5, 4, 5, 2, False),   # 5 prompts cannot split over 2 ranks
    (32, 8, 8, 2, True),   # the default
])
def test_batch_shape_check(prompts, group_size, mini, world, ok):
    """check_batch_shape accepts exactly the shapes where every rank's rows split into whole mini-batches that, over
    all ranks, hold the whole step: counted here by laying out the rows."""
    cfg = train.Config(prompts_per_step=prompts, group_size=group_size, mini_batch_prompts=mini)
    per_rank = prompts // world * group_size if prompts % world == 0 else None
    n_mini = prompts // mini if prompts % mini == 0 else None
    covered = (per_rank is not None and n_mini is not None
               and per_rank // n_mini * n_mini * world == prompts * group_size)
    assert covered == ok
    if ok:
        policy.check_batch_shape(cfg, world)
    else:
        with pytest.raises(ValueError, match="--prompts-per-step"):
            policy.check_batch_shape(cfg, world)



@pytest.mark.parametrize("prompts,group_size,mini,world", [
    (4, 4, 1, 2),    # 8 rows per rank in 4 mini-batches of 2: half a group each
    (4, 4, 2, 2),    # 8 rows per rank in 2 mini-batches of 4
    (8, 2, 2, 4),    # 4 rows per rank in 4 mini-batches of 1
    (8, 2, 4, 4),
    (6, 3, 3, 1),    # one rank: a mini-batch is always whole prompts
    (32, 8, 8, 2),   # the default
])
def test_batch_shape_check_shared_prompt_needs_whole_groups(prompts, group_size, mini, world):
    """--share-prompt runs each prompt once for its G rows, so it takes exactly the shapes (each valid without it)
    where every mini-batch of every rank is whole groups: counted here by laying out the rows, G per prompt, the
    prompts split evenly over the ranks and each rank's rows over the mini-batches."""
    cfg = train.Config(prompts_per_step=prompts, group_size=group_size, mini_batch_prompts=mini)
    policy.check_batch_shape(cfg, world)
    prompt_of_row = [p for p in range(prompts) for _ in range(group_size)]
    per_rank = len(prompt_of_row) // world
    n_mini = prompts // mini
    whole = True
    for r in range(world):
        rows = prompt_of_row[r * per_rank:(r + 1) * per_rank]
        for m in range(n_mini):
            part = rows[m * per_rank // n_mini:(m + 1) * per_rank // n_mini]
            whole &= all(part.count(p) == group_size for p in set(part))
    shared = dataclasses.replace(cfg, share_prompt=True, micro_batch_size=group_size)
    if whole:
        policy.check_batch_shape(shared, world)
    else:
        with pytest.raises(ValueError, match="--share-prompt .* needs whole groups"):
            policy.check_batch_shape(shared, world)

def test_shared_prompt_update_equals_packed_update_under_fsdp(group):
    """--share-prompt (two forwards per micro-batch, the prompts' and the responses' on its KV cache, one backward)
    moves the FSDP2-wrapped weights as the packed forward of every row does: two mini-batches of 2 prompts x G = 3,
    the band binding (old log-probs perturbed), micro-batches of 2 groups."""
    G, P, T = 3, 7, 9
    ids, attn, mask, _ = batch(seed=3, B=4 * G, P=P, T=T)
    for j in range(4):  # every group of G rows shares its first row's prompt (left-padded to P)
        ids[j * G:(j + 1) * G, :P], attn[j * G:(j + 1) * G, :P] = ids[j * G, :P], attn[j * G, :P]
    adv = torch.linspace(-1.2, 1.0, 4 * G)
    old = None
    weights = []
    for share in (False, True):
        cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=4, mini_batch_prompts=2, group_size=G,
                           micro_batch_size=2 * G, max_new_tokens=T, lr=1e-2, grad_clip=1e6, train_dtype="float32",
                           share_prompt=share)
        torch.manual_seed(0)
        model = policy.build_model(cfg, torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        if old is None:
            with torch.no_grad():
                old, _ = logprobs.sequence_logprobs(model, ids, attn, P, cfg.micro_batch_size)
            old = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
        sums, skipped, _ = policy.update_policy(model, opt, cfg, RolloutBatch(ids, attn, mask, P), adv, old)
        assert skipped == 0 and sums["n_upper"] + sums["n_lower"] > 0  # the band binds somewhere
        weights.append({k: v.full_tensor().clone() for k, v in model.state_dict().items()})
    before = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).state_dict()
    moved = max((weights[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3
    for k in weights[0]:
        # float32, two mini-batches: the same products summed in other orders (attention over the cache, a prompt's
        # gradient summed over G rows before each layer's backward instead of after): the gradient errs by
        # <~ n_layers sqrt(d_ff) u = 64 u relative (test_sequence_logprobs' bound), the second mini-batch sees the
        # first's rounding too, so the moved weights agree to 2 x 64 u of the largest move
        assert torch.allclose(weights[0][k], weights[1][k], rtol=8 * U32, atol=128 * U32 * moved), k


@pytest.mark.parametrize("budget", [1, 40, 64, 10_000])
def test_token_budget_micro_batches_cover_each_row_once_within_budget(budget):
    """--micro-batch-tokens N: every row of the mini-batch in exactly one micro-batch, rows longest first, and each
    micro-batch's padded size (its longest prompt + its longest response) x rows at most N unless it is one row —
    checked by laying the micro-batches out from the spans."""
    cfg = train.Config(micro_batch_tokens=budget)
    g = torch.Generator().manual_seed(budget)
    spans = [(int(p), int(r)) for p, r in zip(torch.randint(2, 30, (40,), generator=g),
                                              torch.randint(0, 60, (40,), generator=g))]
    rows = slice(8, 32)
    mbs = policy.micro_batches(rows, cfg, spans)
    flat = [i for mb in mbs for i in mb]
    assert sorted(flat) == list(range(8, 32))
    lengths = [sum(spans[i]) for i in flat]
    assert lengths == sorted(lengths, reverse=True)
    for mb in mbs:
        padded = (max(spans[i][0] for i in mb) + max(max(spans[i][1] for i in mb), 1)) * len(mb)
        assert len(mb) == 1 or padded <= budget
    if budget == 10_000:
        assert len(mbs) == 1
    if budget == 1:
        assert len(mbs) == 24


def test_token_budget_update_equals_row_micro_batches(group):
    """Two mini-batches, the clip binding: micro-batches of <= 40 padded tokens in sorted order move the weights as
    micro-batches of 4 rows in rollout order (the normalisers are global, so only summation order differs)."""
    ids, attn, mask, P = batch(seed=4, B=8, P=7, T=9)
    adv = torch.linspace(-1.0, 1.2, 8)
    old = None
    weights = []
    for budget in (0, 40):
        cfg = train.Config(method="clip", model=rollout.DEFAULT_MODEL, prompts_per_step=4, mini_batch_prompts=2,
                           group_size=2, micro_batch_size=4, micro_batch_tokens=budget, max_new_tokens=9, lr=1e-2,
                           grad_clip=1e6, train_dtype="float32")
        torch.manual_seed(0)
        model = policy.build_model(cfg, torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        b = RolloutBatch(ids, attn, mask, P)
        if old is None:
            with torch.no_grad():
                old, _ = policy.batch_logprobs(model, cfg, b)
            old = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1))  # ratios e^±1: binds
        if budget:
            assert len(policy.micro_batches(slice(0, 4), cfg, b.spans)) > 1  # really split, by tokens
        sums, skipped, _ = policy.update_policy(model, opt, cfg, b, adv, old)
        assert skipped == 0 and sums["n_upper"] + sums["n_lower"] > 0
        weights.append({k: v.full_tensor().clone() for k, v in model.state_dict().items()})
    before = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).state_dict()
    moved = max((weights[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3
    for k in weights[0]:
        # float32, the same products summed in another order: as test_shared_prompt_update's bound
        assert torch.allclose(weights[0][k], weights[1][k], rtol=8 * U32, atol=128 * U32 * moved), k


def test_token_budget_old_logprobs_equal_row_micro_batches(group):
    """batch_logprobs through sorted token-budget micro-batches returns every row's log-probs in the batch's order,
    equal to the row micro-batches' (float32; each row's own forward, other widths: <= 64 u max|logit| apart)."""
    ids, attn, mask, P = batch(seed=5, B=8, P=7, T=9)
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=4, mini_batch_prompts=2, group_size=2,
                       micro_batch_size=4, train_dtype="float32")
    model = policy.build_model(cfg, torch.device("cpu"), trainable=False)
    rows, _ = policy.batch_logprobs(model, cfg, RolloutBatch(ids, attn, mask, P), with_entropy=False)
    tokens, ent = policy.batch_logprobs(model, train.Config(**{**cfg.__dict__, "micro_batch_tokens": 30}),
                                        RolloutBatch(ids, attn, mask, P), with_entropy=True)
    assert ent is not None and ent.shape == rows.shape
    assert torch.allclose(rows, tokens, atol=1e-4, rtol=0)  # |logp| < 10, 64 u x 10 x a few ~ 1e-4


def padded(mb, spans):
    """A micro-batch's padded size: (longest prompt + longest response, >= 1) x rows."""
    return (max(spans[i][0] for i in mb) + max(max(spans[i][1] for i in mb), 1)) * len(mb)


def test_split_reaches_any_agreed_count_within_the_budget():
    """A rank short of the agreed micro-batch count (policy._split): for every count from its own
    plan's up to one row each, that many micro-batches, the same rows in the same order, each a
    contiguous piece of one of the plan's (so within the budget); the first split is the plan's
    largest of two rows or more."""
    cfg = train.Config(micro_batch_tokens=64)
    g = torch.Generator().manual_seed(7)
    spans = [(int(p), int(r)) for p, r in zip(torch.randint(2, 20, (16,), generator=g),
                                              torch.randint(0, 30, (16,), generator=g))]
    rows = slice(2, 14)
    plan = policy.micro_batches(rows, cfg, spans)
    assert 1 < len(plan) < 12  # some micro-batch has several rows: there is something to split
    for n in range(len(plan), 13):
        out = policy._split(plan, n, spans)
        assert len(out) == n
        assert [i for mb in out for i in mb] == [i for mb in plan for i in mb]
        for mb in out:
            whole = next(p for p in plan if mb[0] in p)
            assert whole[whole.index(mb[0]):whole.index(mb[0]) + len(mb)] == mb
            assert len(mb) == 1 or padded(mb, spans) <= cfg.micro_batch_tokens
    once = policy._split(plan, len(plan) + 1, spans)
    split = [p for p in plan if p not in once]
    assert split == [max((p for p in plan if len(p) > 1), key=lambda p: padded(p, spans))]


def test_engine_gap_measured_before_any_optimizer_step(group):
    """--old-logp engine, two mini-batches: rollout/logprob_diff is mean |engine − π_old| over the
    first mini-batch's tokens, π_old the policy before any optimizer step (the second mini-batch's
    forward follows one, and would add the update's own drift)."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=4, mini_batch_prompts=2,
                       group_size=2, micro_batch_size=4, max_new_tokens=9, lr=1e-2, grad_clip=1e6,
                       train_dtype="float32", old_logp="engine")
    ids, attn, mask, P = batch(seed=6, B=8, P=7, T=9)
    model = policy.build_model(cfg, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    b = RolloutBatch(ids, attn, mask, P)
    before, _ = policy.batch_logprobs(model, cfg, b)  # the update's own micro-batches and shapes
    noise = 1e-3 * torch.randn(before.shape, generator=torch.Generator().manual_seed(2))
    b.engine_logp = before + noise
    sums, skipped, _ = policy.update_policy(model, opt, cfg, b, torch.linspace(-1.0, 1.2, 8),
                                            b.engine_logp)
    assert skipped == 0
    m = grpo.finalize_metrics(sums)
    first, second = slice(0, 4), slice(4, 8)
    want = ((b.engine_logp - before).abs() * mask)[first].sum() / mask[first].sum()
    # the update's first forward is batch_logprobs' (same shapes, same kernels): only the engine's
    # values were rounded, once each in float32, u |log p|
    tol = 2 * U32 * before.abs().max().item()
    assert m["rollout/logprob_diff"] == pytest.approx(want.item(), abs=tol)
    after, _ = policy.batch_logprobs(model, cfg, b)
    drift = ((after - before).abs() * mask)[second].sum() / mask[second].sum()
    assert drift > 100 * tol  # measured after a step, the gap would be off by far more than tol


@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_first_mini_batch_old_logprobs_from_its_update_forward(group, train_dtype):
    """Two mini-batches: the old-log-prob pass that skips the first mini-batch (batch_logprobs(skip_first=True)),
    which update_policy then fills from its own forward before any optimizer step, gives the π_old, entropy,
    diagnostics and weights of the full pass (the path it replaces), bit for bit: the same kernels on the same shapes
    (grad and no-grad forwards run the same CPU kernels), in float32 and in bf16 compute."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=4, mini_batch_prompts=2, group_size=2,
                       micro_batch_size=2, max_new_tokens=9, lr=1e-2, grad_clip=1e6, train_dtype=train_dtype)
    ids, attn, mask, P = batch(seed=3, B=8, P=7, T=9)
    adv = torch.linspace(-1.0, 1.2, 8)
    out = []
    for skip in (False, True):
        torch.manual_seed(0)
        model = policy.build_model(cfg, torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        b = RolloutBatch(ids, attn, mask, P)
        old, ent = policy.batch_logprobs(model, cfg, b, with_entropy=True, skip_first=skip)
        if skip:  # the first mini-batch's 4 rows are left to the update
            assert torch.isnan(old[:4]).all() and not torch.isnan(old[4:]).any()
        sums, skipped, _ = policy.update_policy(model, opt, cfg, b, adv, old, old_entropy=ent if skip else None)
        assert skipped == 0
        out.append((old, ent, {k: float(v) for k, v in sums.items()},
                    {k: v.full_tensor().clone() for k, v in model.state_dict().items()}))
    (old0, ent0, sums0, w0), (old1, ent1, sums1, w1) = out
    assert torch.equal(old0 * mask, old1 * mask) and torch.equal(ent0 * mask, ent1 * mask)
    assert sums0 == sums1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_reduced_once_after_the_last_micro_batch(group, dtype):
    from torch.distributed.tensor import DTensor

    """policy._reduce_on_last: before a mini-batch's last backward FSDP2 neither reduces nor reshards (the module
    still holds its gathered, plain-tensor parameters; the gradient accumulates on them, in float32 under bf16 compute), and the last backward
    reduces the sum into the sharded DTensor parameters: on one rank the same gradients, bit for bit, as FSDP2's reduce after
    every backward (the same float32 sums in the same order; bf16 compute's gradients are summed in the float32
    reduce dtype either way)."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, train_dtype=dtype)
    ids, attn, mask, P = batch(seed=2)
    grads = []
    for once in (True, False):
        model = policy.build_model(cfg, torch.device("cpu"))
        for j, rows in enumerate([slice(0, 2), slice(2, 4), slice(4, 6)]):
            if once:
                policy._reduce_on_last(model, last=j == 2)
            logp, _ = logprobs.sequence_logprobs(model, ids[rows], attn[rows], P, 2)       # (2, T)
            (logp * mask[rows]).sum().backward()
            assert all(isinstance(p, DTensor) != (once and j < 2) for p in model.parameters())
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[1].items():
        assert torch.equal(grads[0][n], g), n

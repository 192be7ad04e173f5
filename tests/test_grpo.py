"""grpo.py against hand-computed numbers and plain reference formulas written here (never against itself).

The objective is docs/paper.md §3; the band [r̲(p), r̄(p)] of Theorem 1 is solved here by plain bisection on
g(p, r) = p f(r) + (1 − p) f((1 − p r)/(1 − p)) = δ, f(u) = u − 1 − log u (Band-KL), independent of band.py.
"""
import math

import pytest
import torch

import grpo

F64 = torch.float64
# float64 on a few dozen O(1) numbers (|x| <= 20, sums of <= 100 terms): rounding <= n u sum|x| ~ 100 * 1.1e-16 * 20
# ~ 2e-13, so 1e-12 is 5x above what float64 can err and ~1e9 below any modelling error these tests look for (>= 1e-3).
TOL64 = 1e-12


def t(x):
    return torch.tensor(x, dtype=F64)


# --- independent references ---

def band_kl(p, delta=0.05):
    """(r̲, r̄) of Band-KL by bisection on the scalarised constraint of Theorem 1."""
    f = lambda u: u - 1 - math.log(u)                                        # noqa: E731
    g = lambda r: p * f(r) + (1 - p) * f((1 - p * r) / (1 - p)) - delta      # noqa: E731

    def bisect(a, b):                                                        # g(a), g(b) of opposite signs
        for _ in range(200):
            m = 0.5 * (a + b)
            a, b = (m, b) if (g(m) > 0) == (g(a) > 0) else (a, m)
        return 0.5 * (a + b)

    return bisect(1e-300, 1.0), bisect(1.0, (1 - 1e-15) / p)


def ref_token_loss(r, A, lo, hi, c):
    """The surrogate of §3 unrolled by cases: Â > 0: −Â·min(r, r̄); Â < 0: −Â·min(max(r, r̲), c); Â = 0: 0."""
    c = math.inf if c is None else c
    pos = -A * torch.minimum(r, hi)
    neg = -A * torch.clamp(torch.maximum(r, lo), max=c)
    return torch.where(A > 0, pos, torch.where(A < 0, neg, torch.zeros_like(r)))


def ref_aggregate(loss, mask, agg, max_len):
    """Python-loop aggregation: token-mean over all tokens; the seq-* modes average a per-sequence value."""
    rows = [loss[i][mask[i].bool()] for i in range(loss.shape[0])]
    rows = [x for x in rows if len(x)]
    if agg == "token-mean":
        return torch.cat(rows).sum() / sum(len(x) for x in rows)
    per = {"seq-mean-token-mean": lambda x: x.mean(), "seq-mean-token-sum": lambda x: x.sum(),
           "seq-mean-token-sum-norm": lambda x: x.sum() / max_len}[agg]
    return sum(per(x) for x in rows) / len(rows)


def test_band_kl_reference_solver_matches_paper_values():
    """The test's own solver reproduces docs/paper.md §2's KL δ = 0.05 reference values (the bandit test uses it)."""
    # the paper prints 5 decimals: agree to half a unit of the last one, rounded up (5e-6 -> 1e-5)
    assert band_kl(0.8) == pytest.approx((0.82058, 1.13101), abs=1e-5)
    assert band_kl(0.08) == pytest.approx((0.26170, 2.41055), abs=1e-5)


# --- group advantages ---

def test_group_advantages_unbiased_std_and_zero_groups():
    """Â = (R − mean)/(unbiased std + 1e-6); all-equal groups get exactly 0 and are counted."""
    R = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1]
    adv = grpo.group_advantages(t(R), 4)
    a = 0.5 / (math.sqrt(4 * 0.25 / 3) + 1e-6)                               # unbiased std of [1, 0, 0, 1]
    assert adv[:4].tolist() == pytest.approx([a, -a, -a, a], abs=TOL64)
    assert (adv[4:] == 0).all()                                              # exact, even for 0.1 (mean rounds)
    plain = grpo.group_advantages(t([3.0, 1.0, 2.0, 2.0]), 2, norm_by_std=False)
    assert plain.tolist() == [1.0, -1.0, 0.0, 0.0]
    stats = grpo.group_stats(t(R), 4)
    assert stats["n_groups"].dtype == F64 and float(stats["n_groups"]) == 3 and float(stats["n_zero_groups"]) == 2
    assert grpo.finalize_metrics(stats) == {"adv/zero_group_frac": pytest.approx(2 / 3)}


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError):
        grpo.group_advantages(t([1.0, 0.0]), 1)
    with pytest.raises(ValueError):
        grpo.group_advantages(t([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]), 4)
    with pytest.raises(ValueError):
        grpo.group_stats(t([1.0, 0.0, 1.0]), 2)


# --- the surrogate: hand-computed cases ---

# Two responses, old probabilities p and ratios r chosen by hand; band [0.8, 1.2]; Â = (+1, −2); token (1, 2) masked
# (with junk bounds, to check they are ignored).  Per-token losses:
#   row 0 (Â = +1): r = 1.0 → −1;  r = 1.5 → max(−1.5, −1.2) = −1.2 (upper clipped);  r = 0.5 → max(−0.5, −0.8) = −0.5
#   row 1 (Â = −2): r = 2.0 → max(4, 2.4) = 4 (< c·2 = 20);  r = 0.7 → max(1.4, 1.6) = 1.6 (lower clipped)
P = [[0.5, 0.1, 0.7], [0.45, 0.9, 0.3]]
R = [[1.0, 1.5, 0.5], [2.0, 0.7, 0.5]]
MASK = [[1, 1, 1], [1, 1, 0]]


def hand_case(**kw):
    old = torch.log(t(P))
    logp = old + torch.log(t(R))
    lower = t([[0.8, 0.8, 0.8], [0.8, 0.8, 0.0]])
    upper = t([[1.2, 1.2, 1.2], [1.2, 1.2, 100.0]])
    return grpo.policy_loss(logp, old, t([1.0, -2.0]), torch.tensor(MASK), lower, upper, **kw)


@pytest.mark.parametrize("agg,kw,expected", [
    ("token-mean", {}, (-2.7 + 5.6) / 5),
    ("seq-mean-token-mean", {}, (-2.7 / 3 + 5.6 / 2) / 2),
    ("seq-mean-token-sum", {}, (-2.7 + 5.6) / 2),
    ("seq-mean-token-sum-norm", {}, (-2.7 / 3 + 5.6 / 3) / 2),               # default max_len = T = 3
    ("seq-mean-token-sum-norm", {"max_len": 4}, (-2.7 / 4 + 5.6 / 4) / 2),
    ("token-mean", {"num_tokens": 10}, 2.9 / 10),                            # global normalisers
    ("seq-mean-token-mean", {"num_seqs": 4}, (-0.9 + 2.8) / 4),
])
def test_aggregation_modes_by_hand(agg, kw, expected):
    loss, _ = hand_case(agg=agg, **kw)
    assert float(loss) == pytest.approx(expected, abs=TOL64)


def test_unknown_agg_raises():
    with pytest.raises(ValueError):
        hand_case(agg="mean")


def test_dual_clip_by_hand():
    """Â = −2: r = 15 → max(30, 24) = 30, capped at −c·Â = 20 with c = 10; uncapped with clip_c=None.
    c = 3: r = 2 → min(4, 6) = 4 (below the cap), r = 4 → min(8, 6) = 6."""
    old = torch.zeros(1, 1, dtype=F64)
    one = torch.ones(1, 1, dtype=F64)
    run = lambda r, c: float(grpo.policy_loss(torch.log(t([[r]])), old, t([-2.0]), one, 0.8, 1.2, clip_c=c)[0])  # noqa
    assert run(15.0, 10.0) == pytest.approx(20.0) and run(15.0, None) == pytest.approx(30.0)
    assert run(2.0, 3.0) == pytest.approx(4.0) and run(4.0, 3.0) == pytest.approx(6.0)
    _, m = grpo.policy_loss(torch.log(t([[15.0, 4.0]])), torch.zeros(1, 2, dtype=F64), t([-2.0]),
                            torch.ones(1, 2), 0.8, 1.2, clip_c=10.0)
    assert float(m["n_dual"]) == 1 and float(m["n_lower"]) == 0


def test_dual_clip_then_rollout_weight_by_hand():
    """The rollout weight multiplies the loss after the dual clip. Â = −2, c = 10, band [0.8, 1.2],
    summed over tokens: r = 15, w = 0.5 → min(max(30, 24), 20)·0.5 = 10; r = 15, w = 2 → 20·2 =
    40; r = 2, w = 2 → min(max(4, 2.4), 20)·2 = 8: 58 in all, and ∂/∂log π = (0, 0, −Â·r·w = 8).
    Weighting before the dual clip would give min(15, 20) + min(60, 20) + min(8, 20) = 43, and a
    gradient 15 on the first token."""
    r, w = t([[15.0, 15.0, 2.0]]), t([[0.5, 2.0, 2.0]])
    x = r.log().requires_grad_()
    loss, m = grpo.policy_loss(x, torch.zeros(1, 3, dtype=F64), t([-2.0]), torch.ones(1, 3), 0.8,
                               1.2, clip_c=10.0, agg="seq-mean-token-sum", weights=w)
    assert float(loss) == pytest.approx(58.0, abs=TOL64)
    (g,) = torch.autograd.grad(loss, x)
    assert torch.allclose(g, t([[0.0, 0.0, 8.0]]), rtol=0, atol=TOL64)
    assert float(m["n_dual"]) == 2


def test_log_ratio_clamped_to_20():
    loss, _ = grpo.policy_loss(t([[100.0]]), t([[0.0]]), t([-1.0]), torch.ones(1, 1), 0.8, 1.2, clip_c=None)
    assert float(loss) == pytest.approx(math.exp(20.0))


def test_metrics_by_hand():
    """Clipped = the clip zeroes the gradient: r > upper with Â > 0, r < lower with Â < 0 (masked tokens excluded).
    Here token (0, 1) (p = 0.1, Â > 0, r = 1.5) is upper clipped and token (1, 1) (p = 0.9, Â < 0, r = 0.7) lower
    clipped; (1, 0) has r = 2 > upper but Â < 0, so its gradient flows: not clipped."""
    _, sums = hand_case()
    assert all(v.dtype == F64 and v.dim() == 0 for v in sums.values())
    m = grpo.finalize_metrics(sums)
    expect = {
        "clip/frac": 2 / 5, "clip/frac_upper": 1 / 5, "clip/frac_lower": 1 / 5, "clip/frac_dual": 0.0,
        "clip/frac_pos_adv": 1 / 3, "clip/frac_neg_adv": 1 / 2,
        "clip/low_p_upper_rate": 1.0, "clip/low_p_share_of_clipped": 1 / 2, "clip/low_p_share_of_upper": 1.0,
        "clip/frac_p0.0-0.2": 1.0, "clip/frac_p0.2-0.4": 0.0, "clip/frac_p0.4-0.6": 0.0,
        "clip/frac_p0.6-0.8": 0.0, "clip/frac_p0.8-1.0": 1.0,
        "band/lower_mean": 0.8, "band/upper_mean": 1.2,
        "ratio/mean": (1.0 + 1.5 + 0.5 + 2.0 + 0.7) / 5,
        "kl/old_new_k1": -sum(math.log(r) for r in (1.0, 1.5, 0.5, 2.0, 0.7)) / 5,
        "kl/old_new_k3": sum(r - 1 - math.log(r) for r in (1.0, 1.5, 0.5, 2.0, 0.7)) / 5,
    }
    assert set(expect) <= set(m)
    for k, v in expect.items():
        assert m[k] == pytest.approx(v, abs=TOL64), k


def test_metrics_edge_cases():
    """p = 1 falls in the closed last bin; an empty denominator reports 0.0; missing inputs give no key."""
    _, sums = grpo.policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), torch.ones(1, 1), 0.8, 1.2)
    m = grpo.finalize_metrics(sums)
    assert sums["n_bin4"] == 1 and m["clip/low_p_share_of_clipped"] == 0.0 and "adv/zero_group_frac" not in m


# --- gradients ---

def random_batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g, dtype=F64)                      # p in (0.05, 1)
    logp = old + 1.2 * (2 * torch.rand(B, T, generator=g, dtype=F64) - 1)    # r in (0.3, 3.3)
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[0] = 0.0
    lower = 0.5 + 0.45 * torch.rand(B, T, generator=g, dtype=F64)
    upper = 1.05 + torch.rand(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logp, old, adv, mask, lower, upper


@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_gradient_matches_reference_and_analytic_form(agg):
    """Inside the band ∂ℓ/∂log π = −Â·r; on the clipped side (and past the dual clip) it is exactly 0."""
    logp, old, adv, mask, lower, upper = random_batch(1)
    c, max_len = 2.5, 9
    x = logp.clone().requires_grad_()
    loss, _ = grpo.policy_loss(x, old, adv, mask, lower, upper, clip_c=c, agg=agg, max_len=max_len)
    (grad,) = torch.autograd.grad(loss, x)

    y = logp.clone().requires_grad_()
    r = torch.exp(y - old)
    A = adv[:, None].expand_as(r)
    ref = ref_aggregate(ref_token_loss(r, A, lower, upper, c), mask, agg, max_len)
    (ref_grad,) = torch.autograd.grad(ref, y)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), abs=TOL64)
    assert torch.allclose(grad, ref_grad, atol=TOL64, rtol=0)

    r = r.detach()
    n = mask.sum(-1, keepdim=True).to(F64)
    w = {"token-mean": 1 / n.sum() * torch.ones_like(n), "seq-mean-token-mean": 1 / (n * len(n)),
         "seq-mean-token-sum": torch.full_like(n, 1 / len(n)),
         "seq-mean-token-sum-norm": torch.full_like(n, 1 / (len(n) * max_len))}[agg]
    active = ((A > 0) & (r < upper)) | ((A < 0) & (r > lower) & (r < c))
    analytic = torch.where(active & mask, w * (-A * r), torch.zeros_like(r))
    assert torch.allclose(grad, analytic, atol=TOL64, rtol=0)
    assert (~active & mask).any() and (active & mask).any()                  # both sides exercised


@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_micro_batches_and_ranks_equal_one_batch(agg):
    """2 ranks × 2 micro-batches of unequal sizes, global normalisers: Σ losses and grads = one batch to 1e-12; so do
    uneven micro-batches of a shuffled order with rollout importance weights. The naive per-micro-batch normaliser,
    averaged, differs (the gradient-accumulation bug)."""
    logp, old, adv, mask, lower, upper = random_batch(2, B=8, T=9)
    full_kw = dict(clip_c=2.5, agg=agg, max_len=12)
    x = logp.clone().requires_grad_()
    full, full_sums = grpo.policy_loss(x, old, adv, mask, lower, upper, **full_kw)
    (full_grad,) = torch.autograd.grad(full, x)

    splits = [slice(0, 1), slice(1, 4), slice(4, 7), slice(7, 8)]            # rank 0: mb 0, 1; rank 1: mb 2, 3
    glob = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())
    y = logp.clone().requires_grad_()
    parts = [grpo.policy_loss(y[s], old[s], adv[s], mask[s], lower[s], upper[s], **glob, **full_kw) for s in splits]
    per_rank = [parts[0][0] + parts[1][0], parts[2][0] + parts[3][0]]        # gradient accumulation on each rank
    total = per_rank[0] + per_rank[1]                                        # the all-reduce (sum) over ranks
    (grad,) = torch.autograd.grad(total, y)
    assert abs(float(total.detach() - full.detach())) < TOL64
    assert torch.allclose(grad, full_grad, atol=TOL64, rtol=0)
    for k, v in full_sums.items():
        assert abs(float(sum(p[1][k] for p in parts)) - float(v)) < TOL64, k

    # the same with token-budget micro-batches: rows in a shuffled order, uneven sizes, and a rollout importance
    # weight on every token (it multiplies the per-token loss, so the normalisers are untouched)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(5))
    uneven = [order[:3], order[3:4], order[4:8]]                            # rank 0: mb 0, 1; rank 1: mb 2
    engine = old + 0.7 * torch.randn(old.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    w, _ = grpo.rollout_is_weights(old, engine, mask, "token-truncate", clip_max=2.0)
    xw = logp.clone().requires_grad_()
    full_w, _ = grpo.policy_loss(xw, old, adv, mask, lower, upper, weights=w, **full_kw)
    (full_w_grad,) = torch.autograd.grad(full_w, xw)
    z = logp.clone().requires_grad_()
    total_w = sum(grpo.policy_loss(z[i], old[i], adv[i], mask[i], lower[i], upper[i], weights=w[i], **glob,
                                   **full_kw)[0] for i in uneven)
    (grad_w,) = torch.autograd.grad(total_w, z)
    assert abs(float(total_w.detach() - full_w.detach())) < TOL64
    assert torch.allclose(grad_w, full_w_grad, atol=TOL64, rtol=0)

    naive = sum(grpo.policy_loss(logp[s], old[s], adv[s], mask[s], lower[s], upper[s], **full_kw)[0]
                for s in splits) / len(splits)
    if agg in ("token-mean", "seq-mean-token-mean"):
        assert abs(float(naive - full.detach())) > 1e-3


# --- the paper's mechanism on an exact softmax bandit ---

def bandit(p, adv, lower, upper, lr, V=8, max_steps=20000):
    """Descend the surrogate for one sampled token (index 0, old probability p) of a softmax over V logits until the
    gradient is exactly zero; return the token's final probability."""
    theta = torch.zeros(V, dtype=F64)
    theta[0] = math.log(p * (V - 1) / (1 - p))
    old = torch.log_softmax(theta, 0)[0].reshape(1, 1)
    one = torch.ones(1, 1, dtype=torch.bool)
    for _ in range(max_steps):
        theta.requires_grad_()
        logp = torch.log_softmax(theta, 0)[0].reshape(1, 1)
        loss, _ = grpo.policy_loss(logp, old, t([adv]), one, t([[lower]]), t([[upper]]))
        (g,) = torch.autograd.grad(loss, theta)
        if not g.any():
            return float(torch.softmax(theta.detach(), 0)[0])
        theta = (theta - lr * g).detach()
    raise AssertionError("the surrogate never stopped moving")


def test_bandit_tail_token_clip_stalls_band_kl_lets_it_rise():
    """§1/§2: under the clip [0.8, 1.2] a positive-advantage tail token (p = 0.02) stops at p·(1 + ε₊) = 0.024 (up
    to one step's overshoot); under Band-KL (δ = 0.05) it reaches p·r̄(p) ≈ 0.0986, r̄(0.02) ≈ 4.93: 4× more."""
    p = 0.02
    lo, hi = band_kl(p)
    clip = bandit(p, 1.0, 0.8, 1.2, lr=1e-3)
    band = bandit(p, 1.0, lo, hi, lr=2e-4)
    assert p * 1.2 <= clip <= p * 1.2 * (1 + 2e-3)
    assert band == pytest.approx(p * hi, rel=2e-3)
    assert band / clip > 4.0


def test_bandit_head_token_negative_advantage_stops_at_lower_bound():
    """A negative-advantage head token (p = 0.8) is pushed down only to p·r̲(p) = 0.6565 under Band-KL (δ = 0.05),
    and to p·(1 − ε₋) = 0.64 under the clip."""
    p = 0.8
    lo, hi = band_kl(p)
    band = bandit(p, -1.0, lo, hi, lr=0.02)
    clip = bandit(p, -1.0, 0.8, 1.2, lr=0.02)
    assert p * lo * (1 - 2e-3) <= band <= p * lo
    assert p * 0.8 * (1 - 2e-3) <= clip <= p * 0.8


# --- KL to the reference ---

def test_kl_penalty_by_hand():
    logp, ref = torch.log(t([[0.5]])), torch.log(t([[0.25]]))
    L = math.log(2)
    assert float(grpo.kl_penalty(logp, ref, "k1")) == pytest.approx(L)
    assert float(grpo.kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * L * L)
    assert float(grpo.kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 - 1 + L)
    assert float(grpo.kl_penalty(logp, ref, "low_var_kl")) == pytest.approx(0.5 - 1 + L)
    far = grpo.kl_penalty(t([[-30.0]]), t([[0.0]]), "low_var_kl")           # k3 = e^20 − 21 → clamped
    assert float(far) == 10.0
    with pytest.raises(ValueError):
        grpo.kl_penalty(logp, ref, "k4")


def test_k1_k3_are_unbiased_for_kl():
    """E_{x~π}[k1] = E_{x~π}[k3] = KL(π‖π_ref), by exact enumeration of a small vocabulary; k3 ≥ 0 pointwise."""
    g = torch.Generator().manual_seed(3)
    logpi = torch.log_softmax(torch.randn(1, 11, generator=g, dtype=F64), -1)
    logref = torch.log_softmax(torch.randn(1, 11, generator=g, dtype=F64), -1)
    kl = float((logpi.exp() * (logpi - logref)).sum())
    for kind in ("k1", "k3", "low_var_kl"):
        assert float((logpi.exp() * grpo.kl_penalty(logpi, logref, kind)).sum()) == pytest.approx(kl, abs=TOL64)
    assert (grpo.kl_penalty(logpi, logref, "k3") >= 0).all()


def test_out_of_band_metrics_count_every_sign_and_bin():
    """band/out_*_frac: tokens with r > upper (r < lower) whatever the sign of Â, overall and per old-probability
    bin, counted here token by token in plain Python."""
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    old_logp = torch.log(torch.rand(B, T, generator=g).clamp(1e-3, 1.0))
    logp = old_logp + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5])
    mask = (torch.rand(B, T, generator=g) < 0.8).float()
    lower, upper = torch.full((B, T), 0.8), torch.full((B, T), 1.25)
    _, sums = grpo.policy_loss(logp, old_logp, adv, mask, lower, upper)
    out = grpo.finalize_metrics(sums)
    rows = [(math.exp(old_logp[b, t]), math.exp(logp[b, t] - old_logp[b, t]))
            for b in range(B) for t in range(T) if mask[b, t]]
    assert out["band/out_upper_frac"] == pytest.approx(sum(r > 1.25 for _, r in rows) / len(rows), abs=1e-12)
    assert out["band/out_lower_frac"] == pytest.approx(sum(r < 0.8 for _, r in rows) / len(rows), abs=1e-12)
    edges = grpo.P_BINS
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        in_bin = [r for p, r in rows if lo <= p < hi or (k == len(edges) - 2 and p == hi)]
        want = sum(r > 1.25 for r in in_bin) / len(in_bin) if in_bin else 0.0
        assert out[f"band/out_upper_frac_p{lo:.1f}-{hi:.1f}"] == pytest.approx(want, abs=1e-12), k

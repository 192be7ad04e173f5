"""experiments/bandit.py: the softmax bandit's surrogate and its multi-rollout dynamics, against theory written here.

tests/test_grpo.py already checks one sampled token descended to a standstill; these tests check the expected
surrogate over the whole vocabulary and what it does over one and several rollouts. References are independent of
the code under test: the surrogate by cases, the policy-gradient theorem by autograd, the softmax rate of change of
log π by hand, and r̄(p) of Band-KL by bisection on Theorem 1's g(p, r) = p f(r) + (1 − p) f((1 − p r)/(1 − p)).
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import bandit  # noqa: E402

F64 = torch.float64
HEAD, RARE = bandit.HEAD, bandit.RARE


def upper_kl(p, delta=0.05):
    """r̄ of Band-KL (Theorem 1): the root of g(p, r) = δ in r ∈ (1, 1/p), by bisection."""
    f = lambda u: u - 1 - math.log(u)                                        # noqa: E731
    g = lambda r: p * f(r) + (1 - p) * f((1 - p * r) / (1 - p)) - delta      # noqa: E731
    a, b = 1.0, (1 - 1e-15) / p                                              # g(a) < 0 < g(b)
    for _ in range(200):
        m = 0.5 * (a + b)
        a, b = (m, b) if g(m) < 0 else (a, m)
    return 0.5 * (a + b)


def softmax_rate(pi, grad_logits, token):
    """d log π(token)/dt under gradient flow θ' = −∇L: −(e_token − π)·∇L (the softmax Jacobian of log π)."""
    e = torch.zeros_like(pi)
    e[token] = 1.0
    return float(-(e - pi) @ grad_logits)


def test_expected_surrogate_is_the_expectation_and_its_gradient_the_policy_gradient():
    """grpo.policy_loss with advantage π_old(a)·Â(a), summed, equals E_{a~π_old}[ℓ(r_a, Â_a)], ℓ the §3 surrogate
    written by cases (Â > 0: −Â·min(r, upper); Â < 0: −Â·min(max(r, lower), c), c = 10), dual clip included.
    On-policy its gradient is −∇_θ E_π[R] / (std + 1e-6) (policy-gradient theorem with the exact baseline)."""
    g = torch.Generator().manual_seed(0)
    V = 9
    old = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), 0)
    theta = old + 1.5 * torch.randn(V, generator=g, dtype=F64)
    adv = torch.randn(V, generator=g, dtype=F64)
    adv[2], theta[2] = -1.0, old[2] + 4.0                                    # r ≈ e^4 > c with Â < 0: dual clip
    lower = 0.5 + 0.4 * torch.rand(V, generator=g, dtype=F64)
    upper = 1.1 + torch.rand(V, generator=g, dtype=F64)
    r = torch.exp(torch.log_softmax(theta, 0) - old)
    assert r[2] > 10
    by_case = torch.where(adv > 0, -adv * torch.minimum(r, upper),
                          -adv * torch.clamp(torch.maximum(r, lower), max=10.0))
    expected = float((old.exp() * by_case).sum())
    # float64 sum of V = 8 terms of size <= 10 |adv|: rounding ~ 8 u * 10 ~ 1e-14 << 1e-12
    assert float(bandit.expected_surrogate(theta, old, adv, lower, upper)) == pytest.approx(expected, abs=1e-12)

    R = bandit.rewards(V, good=(1, 4))
    pi_old = old.exp()
    a = bandit.exact_advantages(pi_old, R)
    std = math.sqrt(float((pi_old * (R - (pi_old * R).sum()) ** 2).sum()))
    x = old.clone().requires_grad_()
    (grad,) = torch.autograd.grad(bandit.expected_surrogate(x, old, a, lower, upper), x)
    y = old.clone().requires_grad_()
    (pg,) = torch.autograd.grad((torch.softmax(y, 0) * R).sum(), y)          # ∇ E_π[R]
    assert torch.allclose(grad, -pg / (std + 1e-6), atol=1e-12, rtol=0)  # float64, O(1) gradients: as above


@pytest.mark.parametrize("rare_ratio", [1.1, 1.5])
def test_clip_removes_only_the_rare_tokens_own_push(rare_ratio):
    """One good token (the rare one), clip [0.8, 1.2], every other token still inside its band (r > 0.8). Writing
    θ' = −∇L through the softmax Jacobian, all other tokens share one advantage −β, β = E R / std, and
    π_old(a) r_a = π_a, so
        d log π_rare/dt = [π_r Â_r (1 − 2π_r + ‖π‖²)  while r_rare ≤ 1.2]  +  β π_r (1 + ‖π‖² − 2π_r).
    The first term is the token's own push, which the clip removes; the second is the mass the negative-advantage
    tokens release, of which the softmax hands the rare token its share: it survives the clip (so the clip bounds
    the own push, not the final ratio), and it is small, ∝ π_r."""
    old = bandit.initial_logits(50, 0.6, 0.02)
    theta = old.clone()
    theta[RARE] += math.log(rare_ratio)                                      # r_rare ≈ rare_ratio (× 0.996)
    pi = torch.softmax(theta, 0)
    r = pi / old.exp()
    assert (r[torch.arange(50) != RARE] > 0.8).all() and ((r[RARE] > 1.2) == (rare_ratio > 1.2))
    R = bandit.rewards(50, good=(RARE,))
    adv = bandit.exact_advantages(old.exp(), R)
    x = theta.clone().requires_grad_()
    loss = bandit.expected_surrogate(x, old, adv, torch.full((50,), 0.8, dtype=F64), torch.full((50,), 1.2, dtype=F64))
    (grad,) = torch.autograd.grad(loss, x)

    p_r, sq = float(pi[RARE]), float(pi.square().sum())
    beta = -float(adv[HEAD])
    leak = beta * p_r * (1 + sq - 2 * p_r)
    own = float(adv[RARE]) * p_r * (1 - 2 * p_r + sq) if rare_ratio <= 1.2 else 0.0
    # float64 sums over V = 50 logits, the rate a difference of O(1) terms: rounding ~ 50 u / rate << 1e-10
    assert softmax_rate(pi, grad, RARE) == pytest.approx(own + leak, rel=1e-10)
    assert leak > 0 and (own == 0 or leak < 0.03 * own)


def test_one_rollout_clip_stops_near_1_2_band_kl_reaches_its_upper_bound():
    """§1 vs Theorem 1, one rollout from p0 = 0.02 in small steps (lr 0.1, T = 16 units of gradient flow):
    - clip: the own push stops at r = 1.2; afterwards only the release term of the test above acts, at a rate
      ≤ 2β·π_r, β = √(p0/(1−p0)); one step can cross 1.2 by at most lr·(own rate ≤ 0.3). So
      1.2 ≤ p1/p0 ≤ 1.2·exp(0.3·lr + 2β·T·π_max), self-consistent with π_r ≤ π_max = 0.029.
    - bandkl: both terms are ≥ 0 and the own push, ≥ p0·Â_r·(1−π_r)² ≈ 0.11, stays on until r ≥ r̄(p0) ≈ 4.93,
      which T = 16 suffices for: p1 ≥ p0·r̄(p0), more than 3.5× the clip's."""
    p0, lr, T = 0.02, 0.1, 16.0
    steps = int(T / lr)
    runs = bandit.train_all(("clip", "bandkl"), p0=p0, rollouts=1, steps=steps, lr=lr)
    clip, kl = float(runs["clip"][1, RARE]), float(runs["bandkl"][1, RARE])
    beta, pi_max = math.sqrt(p0 / (1 - p0)), 0.029
    cap = 1.2 * math.exp(0.3 * lr + 2 * beta * T * pi_max)
    assert p0 * cap < pi_max                                                 # the bound is self-consistent
    assert 1.2 <= clip / p0 <= cap
    rbar = upper_kl(p0)
    assert rbar == pytest.approx(4.9286, abs=1e-3)  # the value the docstring quotes (bisection: ~1e-15)
    assert kl >= p0 * rbar * (1 - 1e-6)
    assert kl / clip > 3.5


def test_over_rollouts_band_kl_finds_the_rare_good_token_sooner():
    """Over several rollouts (the script's defaults) the wider band compounds: after every rollout Band-KL's rare
    token is above the clip's, and it passes 0.5 in fewer rollouts."""
    runs = bandit.train_all(("clip", "bandkl"), rollouts=14)
    clip, kl = runs["clip"][:, RARE], runs["bandkl"][:, RARE]
    assert (kl[1:] > clip[1:]).all()
    t_clip, t_kl = bandit.first_reach(clip, 0.5), bandit.first_reach(kl, 0.5)
    assert t_kl is not None and t_clip is not None and t_kl < t_clip


def test_two_good_tokens_the_softmax_starves_the_rare_one_under_every_method():
    """Head (0.6) and rare (0.02) both rewarded. On-policy every ratio is 1, inside every band, so the first step is
    the same for all methods, with d log π_r/dt = π_r Â_r − Σ_a π_a² Â_a (softmax Jacobian applied to π⊙Â): the head
    has the same advantage and 30× the probability, so this is negative. The bands only cap how fast the head takes
    over; none lets the rare good token grow, because its own ratio never reaches an upper bound (it falls)."""
    pi = bandit.initial_logits(50, 0.6, 0.02).exp()
    adv = bandit.exact_advantages(pi, bandit.rewards(50, good=(HEAD, RARE)))
    assert float(pi[RARE] * adv[RARE] - (pi.square() * adv).sum()) < 0
    for method, P in bandit.train_all(bandit.METHODS + (bandit.NO_CLIP,), good=(HEAD, RARE), rollouts=8).items():
        pr = P[:, RARE]
        assert (pr[1:] < pr[:-1]).all(), method

"""grpo.rollout_is_weights and its metrics against hand-computed numbers, with TRL's definitions of
vllm_importance_sampling_* (token / sequence, truncate / mask): the correction for an engine that is not the trainer
(docs/design.md, "The engine is not the trainer"); never against grpo.py itself.
"""
import pytest
import torch

import grpo
from test_grpo import t  # a float64 tensor

F64 = torch.float64


def is_case():
    """Three responses, log ρ_t = old − engine chosen so every ρ is a round number (worked out by hand below);
    row 1's last position is off the mask and holds a huge mismatch that must be ignored."""
    rho = t([[2.0, 0.5, 4.0], [0.2, 5.0, 1e30], [2.5, 1.0, 7.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    engine = -2.0 * torch.ones(3, 3, dtype=F64)
    return engine + rho.log(), engine, mask


@pytest.mark.parametrize("mode,clip_min,want", [
    ("token-truncate", None, [[2.0, 0.5, 3.0], [0.2, 3.0, 0], [2.5, 1.0, 0]]),
    ("token-truncate", 0.4, [[2.0, 0.5, 3.0], [0.4, 3.0, 0], [2.5, 1.0, 0]]),
    ("token-mask", None, [[2.0, 0.5, 0.0], [0.2, 0.0, 0], [2.5, 1.0, 0]]),
    ("token-mask", 0.4, [[2.0, 0.5, 0.0], [0.0, 0.0, 0], [2.5, 1.0, 0]]),
    ("token-mask", 1.0, [[2.0, 0.0, 0.0], [0.0, 0.0, 0], [2.5, 1.0, 0]]),      # ρ = exp(0) = 1 = min is kept (≤)
    # sequences: ρ = 2·0.5·4 = 4, 0.2·5 = 1 (the masked 1e30 ignored), 2.5·1 = 2.5
    ("sequence-truncate", None, [[3.0, 3.0, 3.0], [1.0, 1.0, 0], [2.5, 2.5, 0]]),
    ("sequence-mask", None, [[0.0, 0.0, 0.0], [1.0, 1.0, 0], [2.5, 2.5, 0]]),
    ("sequence-mask", 1.5, [[0.0, 0.0, 0.0], [0.0, 0.0, 0], [2.5, 2.5, 0]]),
])
def test_rollout_is_weights_hand_cases(mode, clip_min, want):
    """Each mode on a batch worked out by hand (cap 3): w = clamp(ρ, min, 3) or ρ·[min ≤ ρ ≤ 3], token ρ_t or the
    response's product, broadcast; positions off the mask are not looked at (compared on the mask only)."""
    old, engine, mask = is_case()
    w, sums = grpo.rollout_is_weights(old, engine, mask, mode, clip_max=3.0, clip_min=clip_min)
    want = t(want)
    assert torch.allclose(w * mask, want * mask, rtol=1e-12, atol=0)


def test_rollout_is_metrics_hand_case():
    """token-mask, cap 3: 7 tokens, ρ = 2, .5, 4, .2, 5, 2.5, 1 -> 2 masked (4 and 5), mean 15.2 / 7, max 5;
    sequence-truncate: sequence ρ = 4, 1, 2.5 -> 1 of 3 responses (3 of 7 tokens) truncated, mean 7.5 / 3, max 4."""
    old, engine, mask = is_case()
    _, clip_sums = grpo.policy_loss(old, old, t([0.0, 0.0, 0.0]), mask, 0.8, 1.2)  # the step's other sums (7 tokens)
    _, s = grpo.rollout_is_weights(old, engine, mask, "token-mask", clip_max=3.0)
    m = grpo.finalize_metrics({**clip_sums, **s})
    assert m["rollout_is/tokens_out_frac"] == pytest.approx(2 / 7)
    assert m["rollout_is/rho_mean"] == pytest.approx(15.2 / 7) and m["rollout_is/rho_max"] == pytest.approx(5.0)
    assert "rollout_is/seqs_out_frac" not in m
    _, s = grpo.rollout_is_weights(old, engine, mask, "sequence-truncate", clip_max=3.0)
    m = grpo.finalize_metrics({**clip_sums, **s})
    assert m["rollout_is/seqs_out_frac"] == pytest.approx(1 / 3) and m["rollout_is/tokens_out_frac"] == pytest.approx(3 / 7)
    assert m["rollout_is/rho_mean"] == pytest.approx(7.5 / 3) and m["rollout_is/rho_max"] == pytest.approx(4.0)
    assert grpo.rollout_is_weights(old, engine, mask, "none") == (None, {})
    with pytest.raises(ValueError, match="token-mask"):
        grpo.rollout_is_weights(old, engine, mask, "token_mask")


@pytest.mark.parametrize("mode, want", [
    # row 0: ρ = 2, [NaN -> 1], 4; row 1: 0.2, 5 (its third position is off the mask)
    ("token-truncate", [[2.0, 1.0, 3.0], [0.2, 3.0, 0]]),
    ("token-mask", [[2.0, 1.0, 0.0], [0.2, 0.0, 0]]),
    # sequences: 2 · 1 · 4 = 8 -> 3 (truncated) or 0 (masked); 0.2 · 5 = 1
    ("sequence-truncate", [[3.0, 3.0, 3.0], [1.0, 1.0, 0]]),
    ("sequence-mask", [[0.0, 0.0, 0.0], [1.0, 1.0, 0]]),
])
def test_rollout_is_nan_engine_logprob_is_no_correction(mode, want):
    """A NaN engine log-prob contributes log ρ_t = 0 (TRL 1.16's nan_to_num): that token's ρ is 1 and a sequence's ρ
    is the product of the others' (hand-computed); the weights stay finite and the NaN is counted."""
    old, engine, mask = is_case()
    old, engine, mask = old[:2], engine[:2].clone(), mask[:2]
    engine[0, 1] = float("nan")
    w, sums = grpo.rollout_is_weights(old, engine, mask, mode, clip_max=3.0)
    assert torch.isfinite(w).all()
    assert torch.allclose(w * mask, t(want) * mask, rtol=1e-12, atol=0)
    _, clip_sums = grpo.policy_loss(old, old, t([0.0, 0.0]), mask, 0.8, 1.2)  # 5 tokens
    m = grpo.finalize_metrics({**clip_sums, **sums})
    assert m["rollout_is/engine_nan_frac"] == pytest.approx(1 / 5)


def test_rollout_is_weight_carries_no_gradient():
    """The weight multiplies the clipped surrogate and carries no gradient, even when π_old is a tensor with one:
    inside the band ∂ℓ/∂log π = −Â·r·w (token-mean over 3 tokens), and the truncated token gets w = cap."""
    old, engine, mask = is_case()
    old = old[:1].clone().requires_grad_()                                    # ρ = 2, 0.5, 4
    w, _ = grpo.rollout_is_weights(old, engine[:1], mask[:1], "token-truncate", clip_max=3.0)
    r = t([[1.1, 0.95, 1.05]])
    x = (old.detach() + r.log()).requires_grad_()
    loss, _ = grpo.policy_loss(x, old.detach(), t([1.0]), mask[:1], 0.8, 1.2, agg="token-mean", weights=w)
    (g, g_old) = torch.autograd.grad(loss, (x, old), allow_unused=True)
    assert torch.allclose(g, -r * t([[2.0, 0.5, 3.0]]) / 3, rtol=1e-12, atol=0)
    # through w the loss would depend on old (∂w/∂old = w inside the cap): no path, or 0
    assert g_old is None or not g_old.any()
    assert not w.requires_grad

"""integrations/verl_bandpo.py against verl 0.9.1's own loss code, and Band-KL against verl's DPPO-Binary-KL.

Runs in .venv-verl only: tests/test_verl_bandpo.py starts `.venv-verl/bin/python -m pytest tests/verl_bandpo_checks.py`
(the file name keeps the main environment's pytest from collecting it). Claims:
- importing the module registers `bandpo` and `bandpo_<method>` for every band.BOUNDS method, also when verl itself
  imports it (VERL_USE_EXTERNAL_MODULES) in a fresh interpreter;
- bandpo_clip is verl's `vanilla` loss bit for bit (loss, gradient, metrics) for every loss_agg_mode, with local
  and with global-batch normalisers (dp_size 2), with and without rollout-correction weights;
- bandpo equals grpo.policy_loss with Band-KL bounds (float64; an empty row, p ~ 1 tokens, dual-clip ratios);
- verl's dppo_kl (dppo_tv) zeroes the gradient of exactly the tokens Band-KL (Band-TV) clips (derivations/
  derive_dppo.py proves the KL identity), its gradient equals Band's on every other token, and with the paper's
  cap and dual clip the two differ only on the tokens those act on.
`.venv-verl/bin/python tests/verl_bandpo_checks.py` prints the DPPO comparison quoted in docs/design.md.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "integrations")]
import band  # noqa: E402
import grpo  # noqa: E402
import verl_bandpo  # noqa: E402,F401  (registers the losses)

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GLOBAL = [{}, dict(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=24)]  # local; 2 ranks
EPS64 = torch.finfo(torch.float64).eps
DELTA, C = 0.05, 10.0  # the paper's radius and dual-clip constant


def _config(clip_ratio, clip_ratio_c, low=None, high=None, **global_batch_info):
    """verl's real actor config (FSDP flavour) with the global-batch info its trainer sets before each loss call
    (verl/workers/utils/losses.py lines 65-68). low/high: clip_ratio_low/_high (verl's default: 0.2 each)."""
    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio=clip_ratio,
                          clip_ratio_c=clip_ratio_c, **{k: v for k, v in (("clip_ratio_low", low),
                                                                          ("clip_ratio_high", high)) if v is not None})
    cfg.global_batch_info.update(global_batch_info)
    return cfg


def _run(name, old, new, adv, mask, agg, cfg, weights=None):
    """verl's registered loss `name`, called as verl's trainer calls it (verl/workers/utils/losses.py lines
    103-112); returns (loss, d loss / d log_prob, metrics)."""
    new = new.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg,
        rollout_is_weights=weights)
    grad, = torch.autograd.grad(loss, new)
    return loss.detach(), grad, metrics


def _tokens(dtype, B=8, T=16):
    """A micro-batch with the hard cases: an empty row, tokens with p = 1 and p ~ 1 (old_logp 0, -1e-12, -1e-9) and
    tiny p (e^-20), on-policy tokens (r = 1), r = 30 > c with A < 0 (the dual clip acts)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6  # (B, T) p in [e^-6, 1]
    old[1, :4] = torch.tensor([0.0, -1e-12, -1e-9, -20.0], dtype=torch.float64)
    new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # (B, T)
    old[2, :3] = math.log(0.01)
    new[2, :3] = math.log(0.3)  # r = 30 > c
    new[3, :2] = old[3, :2]  # r = 1
    new = new.clamp_max(0.0)  # a probability is <= 1
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()  # (B, T) one A per response
    adv[2] = -1.5  # A < 0 where r = 30
    mask = torch.rand(B, T, generator=g) < 0.8  # (B, T)
    mask[0] = False  # an empty row
    mask[1:4, :4] = True
    return old.to(dtype), new.to(dtype), adv.to(dtype), mask


def test_registered_under_every_name():
    """`bandpo` and `bandpo_<method>` for every method of band.BOUNDS, found by verl's get_policy_loss_fn, also
    when verl itself imports the module (VERL_USE_EXTERNAL_MODULES, verl/__init__.py line 49) in a fresh process."""
    for name in ["bandpo"] + [f"bandpo_{m}" for m in band.BOUNDS]:
        assert core_algos.get_policy_loss_fn(name).__name__.startswith("bandpo_"), name
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="verl_bandpo", PYTHONPATH=os.path.join(ROOT, "integrations"))
    code = "from verl.trainer.ppo.core_algos import get_policy_loss_fn as g; print(g('bandpo').__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[-1] == "bandpo_bandkl", out.stderr[-3000:]


@pytest.mark.parametrize("agg", AGG_MODES)
def test_bandpo_clip_is_vanilla_bit_for_bit(agg):
    """bandpo_clip reproduces verl's `vanilla` exactly: the same float32 operations in the same order, the constant
    band [1 - eps_low, 1 + eps_high] given as tensors (eps 0.2 / 0.28, c = 3: verl's default c)."""
    old, new, adv, mask = _tokens(torch.float32)
    for info in GLOBAL:
        for weights in (None, torch.rand(old.shape, generator=torch.Generator().manual_seed(1))):
            cfg = _config(0.2, 3.0, high=0.28, **info)
            want = _run("vanilla", old, new, adv, mask, agg, cfg, weights)
            got = _run("bandpo_clip", old, new, adv, mask, agg, cfg, weights)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (agg, info)
            assert {k: got[2][k] for k in want[2]} == want[2]
            assert want[2]["actor/pg_clipfrac"] > 0 and want[2]["actor/pg_clipfrac_lower"] > 0  # both clips act


@pytest.mark.parametrize("agg", AGG_MODES)
def test_bandpo_equals_grpo_policy_loss(agg):
    """bandpo = grpo.policy_loss(bounds = band.ratio_bounds(old, "bandkl", delta)) with verl's normalisers mapped to
    ours (times dp_size, as verl's agg_loss), and the same gradient, in float64."""
    old, new, adv, mask = _tokens(torch.float64)
    B, T = old.shape
    lower, upper = band.ratio_bounds(old, "bandkl", delta=DELTA)  # (B, T)
    for info in GLOBAL:
        dp = info.get("dp_size", 1)
        loss, grad, _ = _run("bandpo", old, new, adv, mask, agg, _config(DELTA, C, **info))
        # verl's agg_loss (core_algos.py lines 1140-1195) in grpo.policy_loss's terms
        kw = dict(agg=agg, num_seqs=info.get("global_batch_size"))
        if agg in ("token-mean", "token-sum"):
            kw = dict(agg="token-mean", num_tokens=info.get("batch_num_tokens") if agg == "token-mean" else 1)
        if agg == "seq-mean-token-sum-norm":
            kw["max_len"] = info.get("loss_scale_factor", T)
        new_ = new.clone().requires_grad_(True)
        ref = grpo.policy_loss(new_, old, adv, mask, lower, upper, clip_c=C, **kw)[0] * dp
        ref_grad, = torch.autograd.grad(ref, new_)
        # Rounding: a few float64 operations per token, then sums of <= B*T terms: (B*T + 8) eps64 relative to the
        # same aggregate of |terms|. seq-mean-token-mean: verl divides a row by |o_i| + 1e-8 (agg_loss), a relative
        # change of <= 1e-8 per row, so the bound adds 1e-8 of that aggregate.
        abs_ref = grpo.policy_loss(new, old, -adv.abs(), mask, 0.0, math.inf, clip_c=None, **kw)[0] * dp  # |A| r
        smooth = 1e-8 if agg == "seq-mean-token-mean" else 0.0
        assert abs(loss - ref) <= ((B * T + 8) * EPS64 + smooth) * abs_ref, (agg, info, loss.item(), ref.item())
        # per token -A r w_i / Z or 0: a few roundings of the same product. Ties r == bound (on-policy p = 1
        # tokens: upper = 1/p = 1 = r) sit on a kink where torch.clamp and grpo's max/min pick different
        # subgradients: left out (the gradient through log p of a p = 1 token vanishes anyway).
        r = torch.exp(new - old)  # (B, T)
        off_tie = mask & (r != lower) & (r != upper)
        assert ((grad - ref_grad).abs() <= (16 * EPS64 + smooth) * ref_grad.abs())[off_tie].all(), (agg, info)
        assert (grad[~mask] == 0).all() and (ref_grad[~mask] == 0).all()
        assert (ref_grad[2, :3] == 0).all()  # the dual clip acted (A < 0, r = 30 > c): no gradient


# --- DPPO-Binary-KL (verl's dppo_kl, arXiv 2602.04879) against Band-KL ------------------------------------------
def _random_tokens(n, seed=0):
    """n tokens in one row: old p log-uniform in [1e-4, 0.999], new logit = old logit + N(0, 1) (so 0 < p r < 1),
    A = +-1 with equal odds."""
    g = torch.Generator().manual_seed(seed)
    old = torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-4), math.log(0.999), generator=g)
    logit = old - torch.log1p(-old.exp()) + torch.randn(n, generator=g, dtype=torch.float64)
    new = torch.nn.functional.logsigmoid(logit)
    adv = torch.where(torch.rand(n, generator=g) < 0.5, 1.0, -1.0).to(torch.float64)
    return old[None], new[None], adv[None], torch.ones(1, n, dtype=torch.bool)  # (1, n) each


def compare_dppo(n=200_000, max_ratio=math.inf, clip_c=None, dppo_c=1e300, divergence="kl"):
    """Per token: d loss / d log p of verl's dppo_<divergence> (threshold DELTA, its ratio truncation dppo_c) and of
    grpo.policy_loss with Band-<divergence> bounds (cap max_ratio, dual clip clip_c), token-mean; and g(p, r)."""
    old, new, adv, mask = _random_tokens(n)
    # dppo_* read their thresholds from clip_ratio_low/_high and their truncation from clip_ratio_c
    cfg = _config(DELTA, dppo_c, low=DELTA, high=DELTA)
    _, g_dppo, _ = _run(f"dppo_{divergence}", old, new, adv, mask, "token-mean", cfg)
    lower, upper = band.ratio_bounds(old, f"band{divergence}", delta=DELTA, max_ratio=max_ratio)  # (1, n)
    new_ = new.clone().requires_grad_(True)
    loss, _ = grpo.policy_loss(new_, old, adv, mask, lower, upper, clip_c=clip_c, agg="token-mean")
    g_band, = torch.autograd.grad(loss, new_)
    p, r = old.exp(), torch.exp(new - old)
    c = (1 - p * r) / (1 - p)  # Lemma 1's factor on the rest of the vocabulary
    if divergence == "kl":
        g = p * (r - 1 - torch.log(r)) + (1 - p) * (c - 1 - torch.log(c))  # Theorem 1, f(u) = u - 1 - log u
        # the smoothing verl adds, (1 - p + 1e-8)/(1 - p r + 1e-8), moves its KL by <= 1e-8 (1 + 1/c); float64
        # rounding of g and of the band's root (~1e-15 in log r) moves g by ~1e-15 (1 + 1/c): 1e-12 (1 + 1/c) covers it
        near = (g - DELTA).abs() <= (1e-8 + 1e-12) * (1 + 1 / c)
    else:  # TV: g = p |r - 1| = |b - p| (Prop. 4), which dppo_tv thresholds (core_algos.py lines 1434-1435)
        g = p * (r - 1).abs()
        near = (g - DELTA).abs() <= 1e-12  # float64 rounding of b - p and of 1 + delta/p: a few eps64 (|b|, |p| <= 1)
    return dict(r=r[0], adv=adv[0], g=g[0], near=near[0], g_dppo=g_dppo[0], g_band=g_band[0], n=n)


@pytest.mark.parametrize("divergence", ["kl", "tv"])
def test_dppo_masks_exactly_the_band_clip(divergence):
    """Without the cap and the dual clip (and without DPPO's truncation), verl's dppo_kl (dppo_tv) and Band-KL
    (Band-TV) give the same gradient on every token: zero on the same tokens (the mask = the band's clip), -A r / n
    elsewhere."""
    d = compare_dppo(divergence=divergence)
    masked_dppo, masked_band = d["g_dppo"] == 0, d["g_band"] == 0
    assert masked_band.float().mean() > 0.05  # the band did clip a share of the tokens
    assert (masked_dppo == masked_band)[~d["near"]].all()  # every disagreement sits on the boundary g = delta
    both = ~masked_dppo & ~masked_band
    assert ((d["g_dppo"] - d["g_band"]).abs() <= 4 * EPS64 * d["g_band"].abs())[both].all()  # the same -A r / n


def test_dppo_kl_differs_only_by_the_cap_and_the_dual_clip():
    """With the paper's cap (upper <= 10) and dual clip (c = 10), and DPPO truncating r at the same 10, the gradients
    differ exactly where r > 10 and DPPO's mask lets the token through: A < 0 (Band: dual clip) and A > 0 inside the
    KL band (Band: cap). There Band gives 0 and DPPO -A min(r, 10) / n = -10 A / n; everywhere else as above."""
    d = compare_dppo(max_ratio=C, clip_c=C, dppo_c=C)
    same = (d["g_dppo"] - d["g_band"]).abs() <= 4 * EPS64 * d["g_band"].abs()
    differ = (d["r"] > C) & ((d["adv"] < 0) | (d["g"] <= DELTA)) & ~d["near"]  # dual clip | cap
    assert (differ & (d["adv"] < 0)).any() and (differ & (d["adv"] > 0)).any()
    assert (same | differ | d["near"]).all() and not (same & differ).any()
    assert (d["g_band"][differ] == 0).all()
    want = -C * d["adv"][differ] / d["n"]  # DPPO's truncated weight: a product and a division, one rounding each
    assert ((d["g_dppo"][differ] - want).abs() <= 2 * EPS64 * want.abs()).all()


def main():
    """The numbers docs/design.md quotes: shares of random tokens (see _random_tokens) by how the gradients compare."""
    n = 1_000_000
    print(f"verl dppo_kl / dppo_tv vs Band-KL / Band-TV (grpo.policy_loss), delta = {DELTA}, {n:,} tokens: "
          "p log-uniform in [1e-4, 0.999], new logit = old + N(0, 1), A = +-1")
    print(f"{'divergence, setting (Band / DPPO)':<44}{'same grad':>11}{'both 0':>10}{'Band 0 only: cap':>18}"
          f"{'dual':>9}{'DPPO 0 only':>13}{'|g-delta| tiny':>16}")
    for div in ("kl", "tv"):
        for label, kw in (("no cap, no dual clip / no truncation", {}),
                          ("cap 10, dual clip 10 / truncation 10", dict(max_ratio=C, clip_c=C, dppo_c=C))):
            d = compare_dppo(n=n, divergence=div, **kw)
            zd, zb = d["g_dppo"] == 0, d["g_band"] == 0
            same = (d["g_dppo"] - d["g_band"]).abs() <= 4 * EPS64 * d["g_band"].abs()
            pct = lambda x: f"{100 * x.double().mean().item():.3f}%"  # noqa: E731
            only_b = zb & ~zd
            print(f"{div + ', ' + label:<44}{pct(same):>11}{pct(zd & zb):>10}{pct(only_b & (d['adv'] > 0)):>18}"
                  f"{pct(only_b & (d['adv'] < 0)):>9}{pct(zd & ~zb):>13}{pct(d['near']):>16}")


if __name__ == "__main__":
    main()

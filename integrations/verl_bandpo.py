"""BandPO in verl: importing this file registers the Band surrogate (docs/paper.md §3) as verl policy losses.

Registered with verl's own `register_policy_loss` (verl 0.9.1):
    bandpo             Band-KL, the paper's method
    bandpo_<method>    every method of band.BOUNDS: bandpo_clip, bandpo_clip-higher, bandpo_dcpo, bandpo_bandkl,
                       bandpo_bandtv, bandpo_bandchi2, bandpo_bandhellinger, bandpo_bandkl-relax

Select one and carry the hyperparameters in verl's existing keys (its config takes no new keys; verl's own `dppo_kl`
puts its KL threshold in clip_ratio the same way):
    actor_rollout_ref.actor.policy_loss.loss_mode=bandpo
    actor_rollout_ref.actor.clip_ratio=0.05            # delta, the divergence radius (clip methods: eps)
    actor_rollout_ref.actor.clip_ratio_c=10            # c of the dual clip (the paper: 10; verl's default: 3)
    actor_rollout_ref.actor.clip_ratio_low / _high     # eps of the clip methods and of bandkl-relax
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean   # the paper's normaliser (verl's default: token-mean)
The cap of the upper bound is `max_ratio=10` (the paper's upper_bound_max); `make_policy_loss(method, max_ratio=)`
builds a loss with another one, to register under a name of your own.

verl must import this module in every worker: `actor_rollout_ref.model.external_lib=verl_bandpo` or
`VERL_USE_EXTERNAL_MODULES=verl_bandpo`, with this folder (or a copy of it with band.py, torch only) on PYTHONPATH.
The loss mirrors verl's `compute_policy_loss_vanilla` line by line with the constant clip replaced by the band, and
aggregates with verl's own `agg_loss(..., **config.global_batch_info)`, so its global-batch normalisers hold across
micro-batches and ranks. bandpo_clip is verl's vanilla loss bit for bit; bandpo equals grpo.policy_loss with Band-KL
bounds (tests/test_verl_bandpo.py, run in .venv-verl). The contract, the lines of verl's source this relies on, and
what differs from train.py: docs/integrations.md.
"""
import os
import sys

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

try:
    import band  # band.py beside this file (copied), or on sys.path
except ImportError:  # inside the BandPO repository, band.py sits one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import band


def make_policy_loss(method="bandkl", max_ratio=10.0):
    """A verl policy loss that clips the ratio to band.ratio_bounds(old_log_prob, method, ...) per token."""
    if method not in band.BOUNDS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(band.BOUNDS))}")

    def policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None):
        eps = config.clip_ratio  # as vanilla: the low/high eps default to clip_ratio
        eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
        eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
        clip_ratio_c = config.get("clip_ratio_c", 3.0)  # vanilla's default
        assert clip_ratio_c > 1.0, f"clip_ratio_c (the dual clip c) must be > 1, got {clip_ratio_c}"
        lower, upper = band.ratio_bounds(old_log_prob, method, delta=config.clip_ratio, eps_low=eps_low,
                                         eps_high=eps_high, max_ratio=max_ratio)  # (B, T) each, no gradient

        negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # (B, T) log r
        ratio = torch.exp(negative_approx_kl)  # (B, T) r
        pg_losses1 = -advantages * ratio  # (B, T)
        pg_losses2 = -advantages * torch.clamp(ratio, lower, upper)  # (B, T) the band instead of [1-eps, 1+eps]
        clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)  # (B, T) pessimistic bound
        pg_losses3 = -advantages * clip_ratio_c  # (B, T) dual clip: the loss of A < 0 is at most -c A
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)  # (B, T)
        if rollout_is_weights is not None:
            pg_losses = pg_losses * rollout_is_weights
        pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                           **config.global_batch_info)

        # vanilla's metrics (pg_clipfrac: the band clipped; pg_clipfrac_lower: the dual clip acted) plus the band
        metrics = {
            "actor/pg_clipfrac": verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
            "actor/ppo_kl": verl_F.masked_mean(-negative_approx_kl, response_mask),
            "actor/pg_clipfrac_lower": verl_F.masked_mean(
                torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask),
            "actor/band_lower_mean": verl_F.masked_mean(lower, response_mask),
            "actor/band_upper_mean": verl_F.masked_mean(upper, response_mask),
        }
        return pg_loss, {k: v.detach().item() for k, v in metrics.items()}

    policy_loss.__name__ = policy_loss.__qualname__ = f"bandpo_{method}"
    return policy_loss


for _method in band.BOUNDS:
    register_policy_loss(f"bandpo_{_method}")(make_policy_loss(_method))
register_policy_loss("bandpo")(make_policy_loss("bandkl"))

"""GRPO advantages, the BandPO surrogate loss and its diagnostics: docs/paper.md §3 as tensor code.

The BandPO objective of arXiv 2603.04918, per response token t with group-normalised advantage Â:

    r_t = π_θ(a_t|s_t) / π_old(a_t|s_t)                 (log-ratio clamped to ±20 before exp)
    ℓ_t = max(−Â·r_t, −Â·clip(r_t, lower_t, upper_t))     (the band [r̲(p_t), r̄(p_t)], Theorem 1)
    ℓ_t = min(ℓ_t, −c·Â)        if Â < 0                 (dual clip, c = 10)

`lower`/`upper` are whatever band.ratio_bounds returned (the canonical clip is the constant band
[1−ε₋, 1+ε₊]); this file never imports band.py, so the surrogate is written once for every method.
The loss is aggregated "seq-mean-token-mean" as in the paper (`policy_loss` explains the normaliser
and the gradient-accumulation bug it avoids). Also here: the GRPO advantage (unbiased group std, as
in the authors' recipe), the KL-to-reference estimators, the rollout importance weights, and the
diagnostics as sums, which only `finalize_metrics` turns into rates: the clip rates of the paper's
Figure 3 and, as the authors log them, where the band acts whatever Â's sign (`band/out_*`).

Deliberate departures from the authors' verl fork:
- "clipped" counts only the band's clip (r > upper with Â > 0, r < lower with Â < 0: verl's
  `pg_clipfrac` for Â ≠ 0); dual-clip activations are counted apart (`clip/frac_dual`). verl's
  `pg_clipfrac_lower` is the dual-clip rate, not our `clip/frac_lower` (the lower band bound).
- "seq-mean-token-sum-norm" divides by num_seqs·max_len (Dr. GRPO's 1/G · 1/MAX_TOKENS); verl's mode
  of that name divides by the response length only (a constant factor away at a fixed batch size).

    .venv/bin/python -m pytest tests/test_grpo.py
"""
import math

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOW_P = 0.2  # "low-probability token" threshold of the paper's Figure 3b
P_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # old-probability bins of the clip rates; last one closed


# --- advantages ---

def _grouped(rewards, group_size):
    rewards = torch.as_tensor(rewards)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), "
                         f"got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must have shape (N*G,) with G={group_size}, "
                         f"got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.double()
    return rewards.view(-1, group_size)                                      # (N, G)


def group_advantages(rewards, group_size, *, norm_by_std=True, eps=1e-6):
    """Â_i = (R_i − mean_group) / (std_group + eps), groups of `group_size` consecutive responses.

    The std is the unbiased one (torch.std, /(G−1)) as in the authors' verl recipe;
    `norm_by_std=False` is Dr. GRPO's plain mean-centring. A group whose rewards are all equal
    carries no learning signal and gets exactly zero advantage (R − mean can round to ±1e-17
    otherwise); `group_stats` counts those groups. Returns (N*G,).
    """
    r = _grouped(rewards, group_size)                                        # (N, G)
    adv = r - r.mean(dim=1, keepdim=True)                                    # (N, G)
    if norm_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)                       # unbiased std
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)                      # (N, 1)
    return adv.masked_fill(constant, 0.0).reshape(-1)                        # (N*G,)


def group_stats(rewards, group_size):
    """Counts for `adv/zero_group_frac`: {"n_groups", "n_zero_groups"}, float64 0-dim tensors that
    add over ranks."""
    r = _grouped(rewards, group_size)                                        # (N, G)
    zero = (r == r[:, :1]).all(dim=1)                                        # (N,)
    return {"n_groups": torch.tensor(float(r.shape[0]), dtype=torch.float64, device=r.device),
            "n_zero_groups": zero.sum(dtype=torch.float64)}


def reward_sums(rewards, correct):
    """Sums for `reward/mean` and `reward/accuracy` (correct: the reward equals `correct`)."""
    rewards = torch.as_tensor(rewards)                                       # (B,)
    return {"sum_reward": rewards.sum().double(), "n_correct": (rewards == correct).sum().double(),
            "n_responses": torch.tensor(float(rewards.numel()), dtype=torch.float64)}


# --- the surrogate loss ---

def policy_loss(logp, old_logp, advantages, mask, lower, upper, *, clip_c=10.0,
                agg="seq-mean-token-mean", num_tokens=None, num_seqs=None, max_len=None,
                weights=None):
    """The clipped (banded) surrogate of §3, aggregated; returns (loss, metrics).

    logp, old_logp, mask: (B, T); advantages: (B,) or (B, T); lower, upper: (B, T) or anything
    broadcastable, no gradient through them. Masked-out positions must hold finite values (0 is
    fine). clip_c: the dual-clip c (None: off). weights: (B, T) per-token weights of the clipped
    surrogate, no gradient (rollout_is_weights), or None.

    Normalisers. Every mode is  loss = Σ_{i,t} w_i · m_it · ℓ_it / Z  with
        token-mean               w_i = 1          Z = num_tokens (response tokens; DAPO)
        seq-mean-token-mean      w_i = 1/|o_i|    Z = num_seqs   (responses ≥ 1 token; GRPO, paper)
        seq-mean-token-sum       w_i = 1          Z = num_seqs
        seq-mean-token-sum-norm  w_i = 1/max_len  Z = num_seqs   (Dr. GRPO: a constant for |o_i|)
    The paper uses seq-mean-token-mean: every response weighs the same whatever its length, every
    token 1/|o_i| of its response. A response is never split across micro-batches, so w_i is local;
    Z is not. Pass the count of the WHOLE mini-batch (all micro-batches, all ranks) as num_tokens /
    num_seqs, and max_len = the configured maximum response length (a constant; the default, this
    batch's T, changes with padding). Then the micro-batch losses summed over gradient accumulation
    and ranks are exactly the mini-batch loss, and so is its gradient. The naive way (each
    micro-batch divides by its own count, the trainer averages over micro-batches and DDP/FSDP over
    ranks) weighs a token by 1/(tokens in ITS micro-batch): a silent bias whenever micro-batches
    differ in size (token-budget packing, an uneven last micro-batch), the gradient-accumulation bug
    HF fixed for SFT in transformers 4.46. FSDP/DDP average gradients over ranks, so the trainer
    multiplies this loss by the world size (or reduces with a sum). None = this micro-batch's count.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    m = mask.bool()                                                        # (B, T)
    mf = m.to(logp.dtype)                                                  # (B, T)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv    # (B, T)
    lower = torch.as_tensor(lower, dtype=logp.dtype, device=logp.device).detach()
    upper = torch.as_tensor(upper, dtype=logp.dtype, device=logp.device).detach()

    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)                       # (B, T) no exp overflow
    ratio = torch.exp(log_ratio)                                           # (B, T) r
    pg_unclipped = -adv * ratio                                            # (B, T)
    pg_clipped = -adv * torch.minimum(torch.maximum(ratio, lower), upper)  # (B, T) the band's clip
    pg = torch.maximum(pg_unclipped, pg_clipped)                           # (B, T) pessimistic
    if clip_c is not None:  # dual clip: cap the loss of Â < 0
        pg = torch.where(adv < 0, torch.minimum(pg, -clip_c * adv), pg)    # (B, T)
    if weights is not None:  # rollout importance correction
        pg = pg * weights.detach().to(pg.dtype)                            # (B, T)

    loss = aggregate(pg, mf, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    with torch.no_grad():
        metrics = _clip_metrics(ratio, log_ratio, old_logp, adv, m, lower, upper, clip_c)
    return loss, metrics


def aggregate(values, mask, agg, *, num_tokens=None, num_seqs=None, max_len=None):
    """Σ_{i,t} w_i · m_it · x_it / Z of per-token values (B, T) -> 0-dim, with the weights and
    normalisers of `policy_loss`: for the surrogate, and for the KL to the reference as the authors
    do (policy.micro_batch_loss)."""
    mf = mask.to(values.dtype)                                               # (B, T)
    seq_tokens = mf.sum(-1)                                                  # (B,) |o_i|
    seq_sum = (values * mf).sum(-1)                                          # (B,)
    if agg == "token-mean":
        Z = seq_tokens.sum().clamp(min=1) if num_tokens is None else num_tokens
        return seq_sum.sum() / Z
    Z = (seq_tokens > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    if agg == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1)                          # (B,) empty rows add 0
    elif agg == "seq-mean-token-sum":
        per_seq = seq_sum
    elif agg == "seq-mean-token-sum-norm":
        per_seq = seq_sum / (values.shape[-1] if max_len is None else max_len)
    else:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    return per_seq.sum() / Z


def _clip_metrics(ratio, log_ratio, old_logp, adv, m, lower, upper, clip_c):
    """Sums and counts (float64, 0-dim) for finalize_metrics.

    "Clipped" = the band's clip zeroes the token's gradient: r > upper with Â > 0 ("upper"),
    r < lower with Â < 0 ("lower"); strict inequalities, so on-policy tokens (r = 1 inside the band)
    are never clipped and tokens with Â = 0 never are. Dual-clip activations (Â < 0, r > c) are
    counted apart, in n_dual.
    """
    f64 = torch.float64
    count = lambda c: (c & m).sum(dtype=f64)                                # noqa: E731
    masked_sum = lambda x: torch.where(m, x, 0).sum(dtype=f64)              # noqa: E731
    upper_clip = (adv > 0) & (ratio > upper)                                # (B, T)
    lower_clip = (adv < 0) & (ratio < lower)                                # (B, T)
    clipped = upper_clip | lower_clip                                       # (B, T)
    p = old_logp.exp()                                                      # (B, T) old probability
    low_p = p < LOW_P                                                       # (B, T)
    s = {
        "n_tokens": count(torch.ones_like(m)),
        "n_pos_adv": count(adv > 0), "n_neg_adv": count(adv < 0),
        "n_upper": count(upper_clip), "n_lower": count(lower_clip),
        "n_dual": (count((adv < 0) & (ratio > clip_c)) if clip_c is not None
                   else count(torch.zeros_like(m))),
        "n_low_p": count(low_p), "n_low_p_upper": count(low_p & upper_clip),
        "sum_lower": masked_sum(lower.expand_as(ratio)),
        "sum_upper": masked_sum(upper.expand_as(ratio)),
        "sum_ratio": masked_sum(ratio),
        "sum_k1": masked_sum(-log_ratio),                        # KL(old‖new) estimators, x ~ π_old
        "sum_k3": masked_sum(ratio - 1 - log_ratio),             # = f_KL(r) of Band-KL
    }
    above, below = ratio > upper, ratio < lower                  # (B, T) out of the band, any Â
    for k, (lo, hi) in enumerate(zip(P_BINS[:-1], P_BINS[1:])):
        in_bin = (p >= lo) & ((p < hi) if k < len(P_BINS) - 2 else (p <= hi))
        s[f"n_bin{k}"], s[f"n_bin{k}_clipped"] = count(in_bin), count(in_bin & clipped)
        s[f"n_bin{k}_above"], s[f"n_bin{k}_below"] = count(in_bin & above), count(in_bin & below)
    return s


def finalize_metrics(sums):
    """The one place where sums become rates: the step's sums and counts, summed over
    micro-batches and all-reduced over ranks (`n_*` count, `sum_*` add up, `max_*` take the
    maximum) -> {metric key: float}.

    Only the keys whose inputs are present are produced (group stats and loss sums may come
    separately). A rate with an empty denominator (e.g. no clipped token yet) is reported as 0.0.
    """
    v = {k: float(x) for k, x in sums.items()}
    rate = lambda a, b: v[a] / v[b] if v[b] else 0.0                         # noqa: E731
    out = {}
    if "n_groups" in v:
        out["adv/zero_group_frac"] = rate("n_zero_groups", "n_groups")
    if "n_responses" in v:
        out["reward/mean"], out["reward/accuracy"] = (rate("sum_reward", "n_responses"),
                                                      rate("n_correct", "n_responses"))
    if "n_tokens" not in v:
        return out
    v["n_clipped"] = v["n_upper"] + v["n_lower"]
    out.update({
        "clip/frac": rate("n_clipped", "n_tokens"),
        "clip/frac_upper": rate("n_upper", "n_tokens"),
        "clip/frac_lower": rate("n_lower", "n_tokens"),
        "clip/frac_dual": rate("n_dual", "n_tokens"),
        "clip/frac_pos_adv": rate("n_upper", "n_pos_adv"),  # Â > 0 tokens can only clip above
        "clip/frac_neg_adv": rate("n_lower", "n_neg_adv"),
        "clip/low_p_upper_rate": rate("n_low_p_upper", "n_low_p"),  # Fig. 3b: p < 0.2 clipped high
        "clip/low_p_share_of_clipped": rate("n_low_p_upper", "n_clipped"),
        "clip/low_p_share_of_upper": rate("n_low_p_upper", "n_upper"),
    })
    # where the band acts, whatever the advantage's sign (the authors log these): the share of
    # tokens with r above the upper / below the lower bound, overall and per old-probability bin
    n_bins = len(P_BINS) - 1
    v["n_above"] = sum(v.get(f"n_bin{k}_above", 0.0) for k in range(n_bins))
    v["n_below"] = sum(v.get(f"n_bin{k}_below", 0.0) for k in range(n_bins))
    out["band/out_upper_frac"], out["band/out_lower_frac"] = (rate("n_above", "n_tokens"),
                                                              rate("n_below", "n_tokens"))
    for k, (lo, hi) in enumerate(zip(P_BINS[:-1], P_BINS[1:])):
        out[f"clip/frac_p{lo:.1f}-{hi:.1f}"] = rate(f"n_bin{k}_clipped", f"n_bin{k}")
        if f"n_bin{k}_above" in v:
            out[f"band/out_upper_frac_p{lo:.1f}-{hi:.1f}"] = rate(f"n_bin{k}_above", f"n_bin{k}")
            out[f"band/out_lower_frac_p{lo:.1f}-{hi:.1f}"] = rate(f"n_bin{k}_below", f"n_bin{k}")
    out.update({
        "band/lower_mean": rate("sum_lower", "n_tokens"),
        "band/upper_mean": rate("sum_upper", "n_tokens"),
        "ratio/mean": rate("sum_ratio", "n_tokens"),
        "kl/old_new_k1": rate("sum_k1", "n_tokens"), "kl/old_new_k3": rate("sum_k3", "n_tokens"),
    })
    # the policy's diagnostics (policy.old_policy_sums, policy.update_policy), per token or update
    per_token = {"entropy": "sum_entropy", "kl/ref": "sum_kl_ref"}
    out.update({key: rate(s, "n_tokens") for key, s in per_token.items() if s in v})
    # the engine-vs-trainer gap, over the tokens it was measured on (policy.engine_gap_sums: all
    # of them in the trainer's pass, the first mini-batch's where no pass ran)
    gap = {"rollout/logprob_diff": "sum_logprob_diff",
           "rollout/ratio_out_0.1_frac": "n_ratio_out_0.1",
           "rollout/ratio_out_band_frac": "n_ratio_out_band"}
    out.update({key: rate(s, "n_gap_tokens") for key, s in gap.items() if s in v})
    if "n_first_tokens" in v:
        out["ratio/first_abs_dev"] = rate("sum_first_abs_dev", "n_first_tokens")
    if "n_responses" in v:
        out["response_length/mean"] = rate("n_tokens", "n_responses")
    # rollout_is_weights: the share of tokens (sequences) truncated or masked, ρ before truncation
    # (TRL's sampling/importance_sampling_ratio/* are after it), NaN engine log-probs
    if "n_is_rho" in v:
        out.update({"rollout_is/tokens_out_frac": rate("n_is_tokens_out", "n_tokens"),
                    "rollout_is/rho_mean": rate("sum_is_rho", "n_is_rho"),
                    "rollout_is/rho_max": v["max_is_rho"]})
        if "n_is_nan" in v:
            out["rollout_is/engine_nan_frac"] = rate("n_is_nan", "n_tokens")
        if "n_is_seqs" in v:
            out["rollout_is/seqs_out_frac"] = rate("n_is_seqs_out", "n_is_seqs")
    if "n_minibatches" in v:
        out["update/skipped"], out["loss"] = v["n_skipped"], rate("sum_loss", "n_minibatches")
    return out


# --- the engine is not the trainer: rollout importance correction ---

IS_MODES = ("none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask")


def rollout_is_weights(old_logp, engine_logp, mask, mode, clip_max=3.0, clip_min=None):
    """Per-token weights w (B, T) of the surrogate that correct for sampling from the engine's
    π_engine instead of the trainer's π_old, with TRL's definitions (GRPOConfig's
    vllm_importance_sampling_mode / _clip_max / _clip_min):

        token-*      ρ_t = π_old(a_t) / π_engine(a_t) = exp(old_logp_t − engine_logp_t)
        sequence-*   ρ = exp(Σ_t (old_logp_t − engine_logp_t)), one for all the response's tokens
        *-truncate   w = clamp(ρ, clip_min, clip_max)              (truncated IS: TIS)
        *-mask       w = ρ where clip_min ≤ ρ ≤ clip_max, else 0    (masked IS: MIS)

    clip_min None = no lower bound. w carries no gradient. "none" -> (None, {}). Returns (w, sums)
    with sums for finalize_metrics: tokens (and sequences) truncated or masked, Σρ and max ρ over
    tokens (sequences) before truncation or masking (TRL logs them after), NaN engine log-probs.

    A NaN engine log-prob (vLLM's "unavailable") contributes log ρ_t = 0, as in TRL 1.16
    (GRPOTrainer: nan_to_num(..., nan=0.0)): no correction for that token, instead of a NaN loss
    that would skip the whole mini-batch and every other token's signal with it."""
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if mode == "none":
        return None, {}
    with torch.no_grad():
        m = mask.bool()                                                        # (B, T)
        nan = m & torch.isnan(engine_logp)                                     # (B, T)
        diff = torch.where(m & ~nan, old_logp - engine_logp, 0.0).double()  # (B, T) log ρ_t
        seq = mode.startswith("sequence")
        log_rho = diff.sum(-1, keepdim=True).expand_as(diff) if seq else diff  # (B, T)
        rho = log_rho.exp()                                                    # (B, T)
        lo = -math.inf if clip_min is None else clip_min
        outside = (rho < lo) | (rho > clip_max)                                # (B, T)
        w = (rho.clamp(min=clip_min, max=clip_max) if mode.endswith("truncate")
             else rho.masked_fill(outside, 0.0))                               # (B, T)
        units = m.any(-1) if seq else m                      # (B,) sequences or (B, T) tokens
        unit_rho = torch.where(units, rho[:, 0] if seq else rho, 0.0)  # one ρ per sequence or token
        f64 = torch.float64
        sums = {"n_is_rho": units.sum(dtype=f64), "sum_is_rho": unit_rho.sum(),
                "max_is_rho": unit_rho.max(), "n_is_tokens_out": (m & outside).sum(dtype=f64),
                "n_is_nan": nan.sum(dtype=f64)}
        if seq:
            sums.update(n_is_seqs=units.sum(dtype=f64),
                        n_is_seqs_out=(units & outside[:, 0]).sum(dtype=f64))
    return w.to(old_logp.dtype), sums


# --- KL to the reference policy ---

def kl_penalty(logp, ref_logp, kind):
    """Per-token estimate (B, T) of KL(π_θ ‖ π_ref) on tokens sampled by the policy (Schulman).

    k1 = log π/π_ref (unbiased, high variance); k2 = ½(log π/π_ref)² (biased, low variance);
    k3 = π_ref/π − 1 − log(π_ref/π) (unbiased, ≥ 0); low_var_kl = k3 with the log-ratio clamped to
    ±20 and the result to ±10, as verl's `kl_penalty(..., "low_var_kl")`, which the paper uses
    (coefficient 0.001).
    """
    log_ratio = logp - ref_logp                                              # (B, T) log π/π_ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    if kind == "low_var_kl":
        kl = (-log_ratio).clamp(-20.0, 20.0)                                 # log π_ref/π
        return (kl.exp() - kl - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kind must be one of k1, k2, k3, low_var_kl, got {kind!r}")

"""BandPO in TRL: `BandGRPOTrainer`, a `trl.GRPOTrainer` whose ratio clip is the Band (docs/paper.md §3).

GRPO clips the ratio r = pi_theta / pi_old of every token to the fixed [1 - eps, 1 + eps]; BandPO clips it to the
per-token interval [lower, upper] = band.ratio_bounds(old_logp, ...) implied by the f-divergence trust region of
radius delta (Theorem 1). This subclass takes every GRPOTrainer argument plus three:

    from trl import GRPOConfig
    from trl_bandpo import BandGRPOTrainer                  # with band.py beside this file

    args = GRPOConfig(output_dir="out", loss_type="grpo",   # "grpo" = the paper's seq-mean-token-mean
                      steps_per_generation=4,               # 4 optimizer steps per generation: without this, no clip
                      delta=10.0)                           # TRL's two-sided clip = our dual clip c = 10
    trainer = BandGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...,
                              band_method="bandkl", band_delta=0.05, band_max_ratio=10.0)   # any band.BOUNDS key

How it hooks in (trl 1.16.0, pinned): `GRPOTrainer._compute_loss` clips with `torch.clamp(coef_1, 1 - epsilon_low,
1 + epsilon_high)`, and `torch.clamp` takes tensor bounds, so for one call the two epsilons become per-token tensors
(B, T): the band reaches the loss and TRL's clip metrics (`clip_ratio/high_mean` = r > upper with A > 0) without
copying TRL's 270-line method. TRL's `delta` caps r inside the pessimistic min, our dual clip c; our `band_delta` is
the divergence radius. The band acts only where one generation feeds several optimizer steps (else pi_old = pi_theta
and no clip binds). docs/integrations.md has the rest: the lines of TRL's source this relies on (read them before
changing the pin), where this is not the paper's recipe, and on CPU `use_cpu=True, bf16=False,
gradient_checkpointing=False`. Outside this repository copy this file and band.py (torch only) into your project.
Tested by tests/test_trl_bandpo.py: real trainer steps on the tiny model, loss and gradient = grpo.policy_loss.
"""
import os
import sys

import trl

try:
    import band  # band.py beside this file (copied), or on sys.path
except ImportError:  # inside the BandPO repository, band.py sits one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import band

CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types that use TRL's ratio clip (l. 3112)


class BandGRPOTrainer(trl.GRPOTrainer):
    """`trl.GRPOTrainer` with the per-token Band as its ratio clip; see the module docstring."""

    def __init__(self, *args, band_method="bandkl", band_delta=0.05, band_max_ratio=10.0, **kwargs):
        if band_method not in band.BOUNDS:
            raise ValueError(f"unknown band_method {band_method!r}; valid: {', '.join(sorted(band.BOUNDS))}")
        super().__init__(*args, **kwargs)
        if self.loss_type not in CLIP_LOSS_TYPES:  # cispo, sapo, vespo do not clip the ratio to an interval
            raise ValueError(f"BandGRPOTrainer needs a clipped loss_type {CLIP_LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level != "token":  # the band is per token; a sequence ratio has no one p
            raise ValueError("BandGRPOTrainer needs importance_sampling_level='token'")
        if self.args.delta is not None and self.args.delta < band_max_ratio:
            raise ValueError(f"GRPOConfig.delta={self.args.delta} (TRL's ratio cap) would cut the band below "
                             f"band_max_ratio={band_max_ratio}; use delta >= band_max_ratio (the paper: both 10)")
        self.band_method, self.band_delta, self.band_max_ratio = band_method, band_delta, band_max_ratio

    def _compute_loss(self, model, inputs):
        old_logp = inputs.get("old_per_token_logps")  # (B, T); None: pi_old = pi_theta, no clip can act
        if old_logp is None:
            return super()._compute_loss(model, inputs)
        # TRL's epsilons feed the clip methods of band.BOUNDS (band_method="clip" is plain TRL); band methods use delta
        lower, upper = band.ratio_bounds(old_logp, self.band_method, delta=self.band_delta, eps_low=self.epsilon_low,
                                         eps_high=self.epsilon_high, max_ratio=self.band_max_ratio)  # (B, T) each
        eps = self.epsilon_low, self.epsilon_high
        # TRL clips to [1 - epsilon_low, 1 + epsilon_high]: exactly upper (upper - 1 is exact in floating point for
        # upper >= 1), and lower up to one rounding of 1 - lower (<= 2^-25 in float32, only where lower < 1/2)
        self.epsilon_low, self.epsilon_high = 1 - lower, upper - 1  # (B, T)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.epsilon_low, self.epsilon_high = eps

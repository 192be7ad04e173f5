"""integrations/trl_bandpo.py against the real trl 1.16.0: a few BandGRPOTrainer steps on the tiny model.

Claims: with several optimizer steps per generation, (1) at every step the loss TRL computes, and its
gradient with respect to the per-token log-probs, equal grpo.policy_loss with band.ratio_bounds of the old log-probs
(our surrogate, seq-mean-token-mean = TRL's loss_type="grpo", dual clip c = TRL's delta = 10); (2) TRL's own
clip_ratio/* metrics count the band's clipped tokens; (3) the band clips other tokens than TRL's plain clip on the
same seed, and band_method="clip" is TRL's run bit for bit. Nothing is mocked: the tensors are captured from inside
TRL's _compute_loss.
"""
import os
import sys

import pytest
import torch

trl = pytest.importorskip("trl")  # in requirements.txt; skipping only where someone runs without it
datasets = pytest.importorskip("datasets")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import band  # noqa: E402
import data  # noqa: E402
import grpo  # noqa: E402
import rollout  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations"))
from trl_bandpo import BandGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow  # a few real training steps, ~25 s of CPU
EPS32 = torch.finfo(torch.float32).eps
STEPS = 4  # one generation of 32 completions, 4 optimizer steps of 8: the policy moves after step 1


def _reward(completions, answer, **unused):
    """Dense reward (the tiny model rarely gets an answer right): matching prefix of "Answer: N", minus a length
    penalty, so that groups have distinct rewards and tokens get nonzero advantages."""
    out = []
    for c, a in zip(completions, answer):
        text, target = c[0]["content"], f"Answer: {a}"
        n = next((i for i, (x, y) in enumerate(zip(text, target)) if x != y), min(len(text), len(target)))
        out.append(n - 0.1 * abs(len(text) - len(target)))
    return out


def _trainer(cls, tmp_path, config=None, **band_kw):
    """A trainer for STEPS real GRPO steps (TRL's own generate, rewards, advantages, optimizer) on CPU."""
    ds = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in data.arithmetic(8)])
    args = trl.GRPOConfig(**dict(dict(
        output_dir=str(tmp_path), seed=0, max_steps=STEPS, learning_rate=3e-3, logging_steps=1,
        temperature=1.5,  # samples more low-p tokens, where the band and the clip differ (the paper's diagnostics)
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
        gradient_accumulation_steps=1, steps_per_generation=STEPS,  # several optimizer steps per generation
        loss_type="grpo", delta=10.0,  # the paper's seq-mean-token-mean and dual clip c = 10
        use_cpu=True, bf16=False, gradient_checkpointing=False,  # GRPOConfig's GPU defaults
        report_to="none", save_strategy="no", disable_tqdm=True), **(config or {})))
    return cls(model=AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL), reward_funcs=_reward, args=args,
               train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL), **band_kw)


def _train(cls, tmp_path, **band_kw):
    trainer = _trainer(cls, tmp_path, **band_kw)
    trainer.train()
    return trainer


class _Recording(BandGRPOTrainer):
    """Captures, at every loss call, TRL's per-token log-probs (the tensor its loss is built from) and compares TRL's
    loss, its gradient and TRL's clip metrics with grpo.policy_loss on the same tensors."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records, self._logp = [], None

    def _get_per_token_logps_and_entropies(self, *a, **kw):
        out = super()._get_per_token_logps_and_entropies(*a, **kw)
        if kw.get("compute_entropy"):  # the call inside _compute_loss (the old log-probs are computed without)
            self._logp = out[0]  # (B, T) with its autograd graph
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        logp, old, mask = self._logp, inputs.get("old_per_token_logps"), inputs["completion_mask"]  # (B, T)
        old = logp.detach() if old is None else old  # TRL's own convention when it skips them (on-policy)
        lower, upper = band.ratio_bounds(old, "bandkl", delta=0.05, max_ratio=10.0)  # (B, T), as _train sets
        ref, sums = grpo.policy_loss(logp, old, inputs["advantages"], mask, lower, upper, clip_c=10.0,
                                     agg="seq-mean-token-mean")
        ref = ref / self.current_gradient_accumulation_steps  # TRL divides each micro-batch's loss by it
        g_trl, = torch.autograd.grad(loss, logp, retain_graph=True)  # (B, T) dL/dlog p per token
        g_ref, = torch.autograd.grad(ref, logp, retain_graph=True)  # (B, T)
        ratio = torch.exp(logp - old).detach()  # (B, T)
        adv = inputs["advantages"][:, None].expand_as(ratio)  # (B, T)
        m = self._metrics["train"]
        self.records.append(dict(
            has_old=inputs.get("old_per_token_logps") is not None, loss=loss.item(), ref=ref.item(),
            # the same aggregation of |per-token term|: the scale the roundings are relative to
            abs_scale=((adv.abs() * ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean().item(),
            g_trl=g_trl, g_ref=g_ref, ratio=ratio, lower=lower, upper=upper, adv=adv, mask=mask.bool(),
            B=mask.shape[0], T=mask.shape[1],
            trl_low=m["clip_ratio/low_mean"][-1], trl_high=m["clip_ratio/high_mean"][-1],
            our_low=(sums["n_lower"] / sums["n_tokens"]).item(), our_high=(sums["n_upper"] / sums["n_tokens"]).item()))
        return loss


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and leaves the other core to the other tests
    band_run = _train(_Recording, tmp_path_factory.mktemp("band"), band_method="bandkl", band_delta=0.05)
    plain_run = _train(trl.GRPOTrainer, tmp_path_factory.mktemp("plain"))
    clip_run = _train(BandGRPOTrainer, tmp_path_factory.mktemp("clip"), band_method="clip")
    torch.set_num_threads(threads)
    return band_run, plain_run, clip_run


def test_loss_and_gradient_equal_our_surrogate(runs):
    """'At each step the loss and its gradient equal grpo.policy_loss with the same bounds.'"""
    recs = runs[0].records
    assert len(recs) == STEPS and all(r["has_old"] for r in recs)  # TRL computed old log-probs for the batch
    assert any(((r["ratio"] - 1).abs() > 1e-3).any() for r in recs)  # the policy did move between the steps
    n_ties = 0
    for r in recs:
        # float32: per token ~4 roundings (exp, products, clip), then sums of T then B terms: worst case
        # (T + B + 4) eps32 times the sum of |terms| through the same normalisers
        assert abs(r["loss"] - r["ref"]) <= (r["T"] + r["B"] + 4) * EPS32 * r["abs_scale"], r
        # dL/dlog p = -A r / (|o_i| B) or 0 (clipped): a few roundings of the same product, elementwise. Not at a
        # tie r == bound (p = 1 in float32 gives upper = 1/p = 1 = r): the loss has a kink there and the two
        # implementations pick different subgradients (TRL's clamp passes the whole gradient, grpo.policy_loss's
        # maximum/minimum split it 1/2 + 1/4); such tokens have p = 1, so d log p / d logits ~ 1 - p ~ 0 anyway.
        off_tie = r["mask"] & (r["ratio"] != r["lower"]) & (r["ratio"] != r["upper"])  # (B, T)
        g_trl, g_ref = r["g_trl"][off_tie], r["g_ref"][off_tie]
        assert torch.equal(g_trl == 0, g_ref == 0)  # the same tokens clipped (no gradient) in both
        assert ((g_trl - g_ref).abs() <= 8 * EPS32 * g_ref.abs()).all()
        n_ties += (r["mask"] & ~off_tie).sum().item()
    assert n_ties < sum(r["mask"].sum().item() for r in recs) / 2  # most tokens are compared


def test_trl_clip_metrics_count_the_band(runs):
    """'TRL's own clip_ratio/* metrics then describe the band': clip_ratio/low_mean (high_mean) = our share of tokens
    with r < lower, A < 0 (r > upper, A > 0)."""
    recs = runs[0].records
    for r in recs:
        # TRL divides two float32 sums (exact integers here) once: one float32 rounding of the share
        assert r["trl_low"] == pytest.approx(r["our_low"], rel=EPS32, abs=0)
        assert r["trl_high"] == pytest.approx(r["our_high"], rel=EPS32, abs=0)
    assert sum(r["our_low"] + r["our_high"] for r in recs) > 0  # the band did clip something


def test_band_changes_the_clip_statistics(runs):
    """Same seed, same data: BandGRPOTrainer (Band-KL, delta 0.05) and plain GRPOTrainer (eps 0.2) clip different
    tokens. The first step is on-policy (r = 1) and identical in both runs."""
    band_run, plain_run, _ = runs
    stats = lambda t: [(h["clip_ratio/low_mean"], h["clip_ratio/high_mean"]) for h in t.state.log_history  # noqa: E731
                       if "clip_ratio/low_mean" in h]
    band_stats, plain_stats = stats(band_run), stats(plain_run)
    assert len(band_stats) == len(plain_stats) == STEPS
    assert band_stats[0] == plain_stats[0] == (0.0, 0.0)
    assert band_stats[1:] != plain_stats[1:]


def test_band_method_clip_is_plain_trl(runs):
    """band_method="clip" takes TRL's epsilons: [1 - (1 - 0.8), 1 + (1.2 - 1)] rounds to TRL's own float32 bounds, so
    the whole run (rewards, losses, gradient norms, clip metrics) is bit-identical to GRPOTrainer's."""
    _, plain_run, clip_run = runs
    drop = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")  # wall-clock
    strip = lambda t: [{k: v for k, v in h.items() if k not in drop} for h in t.state.log_history]  # noqa: E731
    assert strip(clip_run) == strip(plain_run)


@pytest.mark.parametrize("config", [dict(loss_type="cispo"), dict(importance_sampling_level="sequence"),
                                    dict(delta=2.0)])
def test_rejects_settings_the_band_cannot_describe(config, tmp_path):
    """cispo/sapo/vespo do not clip to an interval, a sequence-level ratio has no one p, and TRL's delta below the
    cap would cut the band: each raises instead of silently training something else."""
    with pytest.raises(ValueError, match="BandGRPOTrainer needs|band_max_ratio"):
        _trainer(BandGRPOTrainer, tmp_path, config)

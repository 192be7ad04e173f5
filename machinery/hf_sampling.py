"""What transformers' `generate` needs to sample as the paper does and to report, for each sampled
token, its log-prob under the distribution it was sampled from (rollout.HFEngine, the fallback
engine; vLLM returns these itself).

transformers 5 runs the caller's logits processors *before* its own warpers (generation/utils.py,
_get_logits_processor), so temperature and top-p are applied here (`warpers`), and the recorder
goes last: it then sees the distribution that is sampled from, the model's own at T = 1, top-p = 1.
Tests: tests/test_rollout.py (the HF engine's log-probs against teacher forcing at T = 1 and 0.7).
"""
import torch
from transformers import (LogitsProcessor, StoppingCriteria, TemperatureLogitsWarper,
                          TopPLogitsWarper)


def warpers(sampling):
    """Temperature, then top-p, as transformers would add them (none for greedy or at their neutral
    values)."""
    if sampling.temperature == 0:
        return []
    out = [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
    return out + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1.0 else [])


class LogprobRecorder(LogitsProcessor):
    """Keeps log p(sampled token) per step during HF generate, holding one step's (B, V) log-softmax
    at a time (output_logits=True would keep every step's logits). As the last logits processor
    (after `warpers`) it sees the distribution that is sampled from; its companion stopping
    criterion `gather`, called right after sampling, keeps the sampled token's entry in `steps`."""

    def __init__(self):
        self.logp, self.steps = None, []
        self.gather = _GatherSampled(self)

    def __call__(self, input_ids, scores):
        self.logp = torch.log_softmax(scores.float(), dim=-1)  # (B, V)
        return scores


class _GatherSampled(StoppingCriteria):
    def __init__(self, recorder):
        self.recorder = recorder

    def __call__(self, input_ids, scores, **kwargs):
        self.recorder.steps.append(self.recorder.logp.gather(-1, input_ids[:, -1:])[:, 0])  # (B,)
        # never stops anything
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

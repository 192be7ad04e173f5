"""One optimizer step of train.update_policy on a fixed global batch; run under torchrun with 1 or 2 ranks.

    torchrun --nproc_per_node N tests/fsdp_step.py OUT.pt [ROLLOUT_IS_MODE]

Every rank builds the same global batch (16 sequences = 4 prompts x 4 samples, 2 mini-batches of 8); rank r takes
part r of each mini-batch, which is how train.py lays a step's rows out. Rank 0 writes the full weights after the
step to OUT.pt. tests/test_train.py compares the 1-rank and 2-rank results.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

import rollout  # noqa: E402
import logprobs  # noqa: E402
import train  # noqa: E402


def main():
    out, mode = sys.argv[1], (sys.argv[2:] or ["none"])[0]
    torch.use_deterministic_algorithms(True)
    cfg = train.Config(method="bandkl", delta=0.05, model=rollout.DEFAULT_MODEL, prompts_per_step=4,
                       mini_batch_prompts=2, group_size=4, micro_batch_size=3, max_new_tokens=10, lr=0.01,
                       grad_clip=1e6, train_dtype="float32", rollout_is=mode,
                       rollout_is_max=1.5)  # no grad clipping: a wrong gradient scale shows
    device = train.init_distributed()
    torch.manual_seed(0)
    model = train.build_model(cfg, device)
    # SGD, not Adam: Adam's first step is ~lr·sign(g), which turns float rounding in near-zero gradients into
    # lr-sized differences; SGD keeps the comparison a comparison of gradients.
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    B, P, T = 16, 6, 10
    input_ids = torch.randint(4, vocab, (B, P + T), generator=g)  # (B, P+T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # (B, T)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], dim=1)  # (B, P+T)
    advantages = torch.randn(B, generator=g)  # (B,)
    with torch.no_grad():
        old_logp, _ = logprobs.sequence_logprobs(model, input_ids, attn, P, 8)
    old_logp = old_logp + 0.5 * torch.randn(old_logp.shape, generator=g)  # ratios away from 1: the band binds
    engine_logp = old_logp + 0.5 * torch.randn(old_logp.shape, generator=g)  # a mismatch the correction weighs
    rows = torch.cat([torch.arange(m * 8, (m + 1) * 8).chunk(train.WORLD)[train.RANK] for m in range(2)])
    batch = logprobs.RolloutBatch(input_ids[rows], attn[rows], mask[rows], P, engine_logp[rows])
    sums, skipped, _ = train.update_policy(model, optimizer, cfg, batch, advantages[rows], old_logp[rows])
    assert skipped == 0
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if train.RANK == 0:
        torch.save({k: v.double() for k, v in full.items()}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

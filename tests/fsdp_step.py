"""One rollout's updates (policy.update_policy) on a fixed global batch; torchrun, 1 or 2 ranks.

    torchrun --nproc_per_node N tests/fsdp_step.py OUT.pt [ROLLOUT_IS_MODE]  # weights after a step
    torchrun --nproc_per_node N tests/fsdp_step.py OUT.pt SCENARIO ...       # {scenario: results}

Every rank builds the same global batch (16 rows = 4 prompts x 4 samples, 2 mini-batches of 8);
rank r takes part r of each mini-batch, as train.py lays a step's rows out. Rank 0 writes OUT.pt.
With a --rollout-is mode (tests/test_train.py): the full weights after the step. With SCENARIOs
(tests/test_two_ranks.py), per scenario: the weights, the step's metrics (sums reduced over ranks,
then grpo.finalize_metrics), the old- and reference-log-prob passes, each rank's micro-batch counts
before and after the ranks agree, and π_θ's log-probs before any step, all of the global batch.
There each group of 4 rows has one prompt, and rank 0's responses are short, rank 1's long, so that
a token budget plans different counts on the two ranks.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: E402
                                                     get_model_state_dict)

from machinery import checkpoint  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402

B, P, T = 16, 6, 10
BUDGET = 24  # padded tokens: rank 0's rows (<= 6 + 2) go 3-4 to a micro-batch, rank 1's (>= 11) 1-2
# each scenario's Config overrides
SCENARIOS = {
    "budget": dict(micro_batch_tokens=BUDGET),
    "share-prompt": dict(share_prompt=True, micro_batch_size=4),
    "sequence-truncate": dict(micro_batch_tokens=BUDGET, rollout_is="sequence-truncate"),
    "sequence-mask": dict(micro_batch_tokens=BUDGET, rollout_is="sequence-mask"),
    "engine": dict(micro_batch_tokens=BUDGET, old_logp="engine"),
    "kl": dict(micro_batch_tokens=BUDGET, kl_coef=0.5),
    # micro-batches of 4 rows: a rank's 4, or the same 4 of 1 rank's 8: the same shapes on 1 and 2
    "bf16": dict(train_dtype="bfloat16", micro_batch_size=4),
    "bf16-budget": dict(train_dtype="bfloat16", micro_batch_tokens=BUDGET),
    "resume": dict(micro_batch_tokens=BUDGET),
    # packed micro-batches, the budget in real tokens: rank 0's rows (<= 8 tokens) go 3 or more to a
    # micro-batch, rank 1's (>= 11) 1-2; with the KL term and a sequence-level correction
    "pack-budget": dict(pack=True, micro_batch_tokens=BUDGET),
    "pack-kl-is": dict(pack=True, micro_batch_tokens=BUDGET, kl_coef=0.5,
                       rollout_is="sequence-truncate"),
    "bf16-pack": dict(train_dtype="bfloat16", pack=True, micro_batch_tokens=BUDGET),
    # recomputation and compiled layers change what the backward runs, never what it computes
    "pack-selective": dict(pack=True, micro_batch_tokens=BUDGET, recompute="selective"),
    "pack-full": dict(pack=True, micro_batch_tokens=BUDGET, recompute="full"),
    "pack-compiled": dict(pack=True, micro_batch_tokens=BUDGET, compile_layers=True),
    # FSDP2's default accumulation, a reduce and a reshard after every micro-batch's backward: the reference of the
    # update's one reduce per mini-batch (policy._reduce_on_last)
    "budget-reduce-each": dict(micro_batch_tokens=BUDGET),
    "bf16-budget-reduce-each": dict(train_dtype="bfloat16", micro_batch_tokens=BUDGET),
}
REDUCE_EACH = {"budget-reduce-each", "bf16-budget-reduce-each"}
# π_old straight from the trainer's pass: the first mini-batch's ratio must then be exactly 1
EXACT_OLD = {"bf16-budget", "bf16-pack", "bf16-budget-reduce-each"}


def base_config(**kw):
    """The step's Config, `kw` overriding; no grad clipping: a wrong gradient scale shows."""
    return train.Config(**{**dict(method="bandkl", delta=0.05, model=rollout.DEFAULT_MODEL,
                                  prompts_per_step=4, mini_batch_prompts=2, group_size=4,
                                  micro_batch_size=3, max_new_tokens=T, lr=0.01, grad_clip=1e6,
                                  train_dtype="float32", rollout_is_max=1.5), **kw})


def my_rows():
    """This rank's global rows: part RANK of each mini-batch of 8."""
    return torch.cat([torch.arange(m * 8, (m + 1) * 8).chunk(train.WORLD)[train.RANK]
                      for m in range(2)])


def full_weights(model):
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    return {k: v.double() for k, v in full.items()}


def gather_rows(x, rows):
    """Every rank's rows of x (b, T), put back in global order on every rank -> (B, T)."""
    parts = [None] * train.WORLD
    dist.all_gather_object(parts, (rows, x.detach().cpu()))
    out = torch.zeros(B, x.shape[1], dtype=x.dtype)
    for r, v in parts:
        out[r] = v
    return out


def legacy(mode):
    """tests/test_train.py's step: random prompts of full length, responses of 1..T tokens."""
    cfg = base_config(rollout_is=mode)
    model = policy.build_model(cfg, torch.device("cpu"))
    # SGD, not Adam: Adam's first step is ~lr·sign(g), which turns float rounding in near-zero
    # gradients into lr-sized differences; SGD keeps the comparison a comparison of gradients.
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab, (B, P + T), generator=g)                  # (B, P+T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()                  # (B, T)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], dim=1)    # (B, P+T)
    advantages = torch.randn(B, generator=g)                                      # (B,)
    with torch.no_grad():
        old_logp, _ = logprobs.sequence_logprobs(model, input_ids, attn, P, 8)
    # ratios away from 1 (the band binds), and a mismatch the correction weighs
    old_logp = old_logp + 0.5 * torch.randn(old_logp.shape, generator=g)
    engine_logp = old_logp + 0.5 * torch.randn(old_logp.shape, generator=g)
    rows = my_rows()
    batch = logprobs.RolloutBatch(input_ids[rows], attn[rows], mask[rows], P, engine_logp[rows])
    _, skipped, _ = policy.update_policy(model, optimizer, cfg, batch, advantages[rows],
                                         old_logp[rows])
    assert skipped == 0
    return full_weights(model)


def global_batch(vocab):
    """4 groups of 4 rows, each group one prompt of 3..P tokens; rank 0's groups (0 and 2) answer
    in 1..2 tokens, rank 1's (1 and 3) in 8..10. -> ids, attn, mask, advantages."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    for j in range(4):
        p = int(torch.randint(3, P + 1, (), generator=g))
        prompt = torch.randint(4, vocab, (p,), generator=g)
        lo, hi = (1, 3) if j % 2 == 0 else (8, T + 1)
        for b in range(4 * j, 4 * j + 4):
            r = int(torch.randint(lo, hi, (), generator=g))
            ids[b, P - p:P] = prompt
            ids[b, P:P + r] = torch.randint(4, vocab, (r,), generator=g)
            attn[b, P - p:P + r] = 1
    return ids, attn, attn[:, P:].float(), torch.randn(B, generator=g)


def scenario(name, out):
    """One scenario's update of this rank's rows -> its results (the same on every rank)."""
    cfg = base_config(**SCENARIOS[name])
    device = torch.device("cpu")
    model = policy.build_model(cfg, device)
    optimizer = (policy.make_optimizer(model, cfg) if name == "resume"
                 else torch.optim.SGD(model.parameters(), lr=cfg.lr))  # SGD: see legacy()
    ids, attn, mask, adv = global_batch(model.config.vocab_size)
    rows = my_rows()
    batch = logprobs.RolloutBatch(ids[rows], attn[rows], mask[rows], P)
    res = {"counts": [None] * train.WORLD, "mask": mask}
    raw = [len(policy.micro_batches(r, cfg, batch.spans))
           for r in policy.mini_batches(len(batch), cfg)]
    agreed = [len(mbs) for _, mbs in policy.plan_micro_batches(len(batch), cfg, batch.spans,
                                                                 device)]
    dist.all_gather_object(res["counts"], (raw, agreed))
    with torch.no_grad():  # π_θ before any step: all 16 rows in one forward, on every rank
        res["before"], _ = logprobs.sequence_logprobs(model, ids, attn, P, B)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(B, T, generator=g)[rows]  # the same global noise, this rank's rows
    old, _ = policy.batch_logprobs(model, cfg, batch)  # the old-log-prob pass
    res["old_pass"] = gather_rows(old, rows)
    if name not in EXACT_OLD:
        old = old + 0.5 * noise  # ratios away from 1: the band binds
    batch.engine_logp = old + 0.3 * torch.randn(B, T, generator=g)[rows]  # an engine's mismatch
    if cfg.old_logp == "engine":
        old = batch.engine_logp
    res["engine"] = gather_rows(batch.engine_logp, rows)
    ref = None
    if cfg.kl_coef:
        ref_model = policy.build_model(cfg, device, trainable=False)
        ref, _ = policy.batch_logprobs(ref_model, cfg, batch)  # the reference pass
        res["ref_pass"] = gather_rows(ref, rows)
        ref = ref - 0.3 * noise  # π_θ away from π_ref: the KL term has a gradient
    sums, skipped, _ = policy.update_policy(model, optimizer, cfg, batch, adv[rows], old, ref,
                                            reduce_each_micro_batch=name in REDUCE_EACH)
    assert skipped == 0
    if name == "resume":  # checkpoint, second update; a fresh model from the checkpoint, the same
        run_dir = os.path.join(os.path.dirname(os.path.abspath(out)), f"run{train.WORLD}")
        checkpoint.save_checkpoint(run_dir, 1, model, optimizer, cfg)
        policy.update_policy(model, optimizer, cfg, batch, adv[rows], old, ref)
        res["uninterrupted"] = full_weights(model)
        model = policy.build_model(cfg, device)
        optimizer = policy.make_optimizer(model, cfg)
        step = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run_dir), model, optimizer)
        assert step == 1
        policy.update_policy(model, optimizer, cfg, batch, adv[rows], old, ref)
    res["metrics"] = grpo.finalize_metrics(train.all_reduce_sums(sums, device))
    res["weights"] = full_weights(model)
    return res


def main():
    out, names = sys.argv[1], sys.argv[2:] or ["none"]
    torch.use_deterministic_algorithms(True)
    train.init_distributed()
    torch.manual_seed(0)
    if len(names) == 1 and names[0] in grpo.IS_MODES:
        result = legacy(names[0])
    else:
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            sys.exit(f"fsdp_step.py: unknown scenario {unknown[0]!r}; "
                     f"valid: {', '.join(SCENARIOS)}")
        result = {name: scenario(name, out) for name in names}
    if train.RANK == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

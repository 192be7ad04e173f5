"""The policy being trained: loaded once and sharded with FSDP2, and the optimizer steps of one rollout.

`build_model` is the FSDP2 recipe of the pytorch/examples FSDP2 example and torchtitan: `fully_shard` each decoder
layer, then the root; parameters on the meta device until rank 0's checkpoint is broadcast. `update_policy` is the
objective of docs/paper.md §3 applied to one rollout: this rank's rows split into mini-batches (one optimizer step
each) and micro-batches (gradient accumulation), the band [lower, upper] = band.ratio_bounds(old log-probs), the
surrogate grpo.policy_loss normalised by the whole mini-batch's count, so that accumulation and ranks add up to
exactly the mini-batch's loss. Mixed precision (--train-dtype bfloat16): bf16 compute, fp32 master weights, AdamW
state and gradient reduction, on CPU as on GPU.

    model = build_model(cfg, device)                        # under an initialised process group (train.py)
    sums, skipped, grad_norm = update_policy(model, optimizer, cfg, device, input_ids, attn, mask, P, adv, old_logp)

Tests: tests/test_train_steps.py (on-policy = off-policy with fresh π_old, load-once = from_pretrained) and
tests/fsdp_step.py via tests/test_train.py (2 ranks = 1 rank on the same global batch).
"""
import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

import band
import grpo
import rollout
from logprobs import row_spans, sequence_logprobs


# --- the model ---------------------------------------------------------------------------------------------------
def checkpoints(model_config):
    """The default of --grad-checkpointing: on for any real LLM (layers x hidden >= 8192: SmolLM2-135M has 30 x 576),
    off for the embedded tiny model (4 x 128). A real model's activations dominate the step's memory (SmolLM2, 32
    sequences of 265 tokens in micro-batches of 8: ~3 GB of activations beside 1.5 GB of weights, gradients and
    AdamW state, benchmarks/bench_memory.py); recomputing them costs one more forward per micro-batch (~+15% of the
    update there). The tiny model's activations are a few MB: there it would only cost time."""
    return model_config.num_hidden_layers * model_config.hidden_size >= 8192


def make_optimizer(model, cfg):
    """AdamW on the fp32 master weights. fused=True: one kernel per parameter group instead of foreach's lists of
    full-size temporaries (another copy of the weights, transiently, on top of the two moment buffers)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)


def build_model(cfg, device, trainable=True):
    """Load a causal LM once and shard it with FSDP2: fully_shard each decoder layer, then the root.

    Every rank builds the model with its parameters on the meta device (no memory), shards it, and allocates only
    its own shards; rank 0 alone reads the checkpoint and set_model_state_dict(broadcast_from_rank0=True) sends
    each tensor to the others, which keep their shard (the FSDP2 recipe of torchtitan and the pytorch/examples FSDP2
    example). Loading the full fp32 model on every rank first would cost a 7B model 28 GB per GPU. Buffers are not
    parameters: non-persistent ones (the rotary inverse frequencies) are in no checkpoint, so they are built for
    real (accelerate's init_empty_weights(include_buffers=False)) and put back after to_empty.
    """
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model), dtype=torch.float32)
    model.tie_weights()  # from_config does not tie (from_pretrained would): lm_head = embed_tokens when configured
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    if trainable and (cfg.grad_checkpointing if cfg.grad_checkpointing is not None else checkpoints(model.config)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # --train-dtype bfloat16: bf16 compute (parameters cast when FSDP gathers them, bf16 activations and logits)
    # with fp32 master weights, AdamW state and gradient reduction, on GPU and on CPU alike
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if rollout.resolve_dtype(cfg.train_dtype) == "bfloat16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)  # this rank's shards, uninitialised: the broadcast below fills them
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    full = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).state_dict() \
        if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    if model.config.tie_word_embeddings:  # to_empty swaps DTensor parameters in place: the tie must survive it
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "lm_head lost its tie"
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def on_policy(cfg):
    """One optimizer step per rollout: π_old is π_θ before the step, so the old log-probs are the update's own
    forward, detached (ratio exactly 1), and the separate no-grad pass over the batch is skipped (as TRL and verl)."""
    return cfg.prompts_per_step == cfg.mini_batch_prompts


def old_policy_sums(old_logp, entropy, engine_logp, mask, cfg):
    """Diagnostics of π_old on the sampled tokens, as sums for all_reduce_sums: the entropy, and the engine's view of
    the same distribution. |engine log-prob − trainer log-prob| is rollout/logprob_diff (TRL: sampling/
    sampling_logp_difference): a gap means mismatched temperature, stale weights or rounding (bf16). The ratio a
    trainer would see if it took the engine's log-probs as π_old, r = exp(trainer − engine), is counted where it
    leaves [0.9, 1.1] and where it leaves the band of the engine's log-prob: the share of tokens that rounding alone
    would clip (this trainer recomputes π_old, so these are diagnostics, not clips)."""
    r = torch.exp(old_logp - engine_logp)                                               # (B, T)
    lower, upper = band.ratio_bounds(engine_logp.clamp(max=0.0), cfg.method, delta=cfg.delta,
                                     max_ratio=cfg.max_ratio, **_eps(cfg))
    return {"entropy/sum": (entropy * mask).sum(),
            "rollout/logprob_diff_sum": ((engine_logp - old_logp).abs() * mask).sum(),
            "rollout/ratio_out_0.1_sum": (((r - 1).abs() > 0.1) * mask).sum(),
            "rollout/ratio_out_band_sum": (((r > upper) | (r < lower)) * mask).sum()}


def shared_group(cfg):
    """The group size for sequence_logprobs' shared-prompt forward (each prompt run once for its G completions), or 0
    for the packed forward of every row (--no-share-prompt)."""
    return cfg.group_size if cfg.share_prompt else 0


def _eps(cfg):
    return {"eps_low": cfg.eps_low if cfg.eps_low >= 0 else None,
            "eps_high": cfg.eps_high if cfg.eps_high >= 0 else None}


def check_batch_shape(cfg, world):
    """Every rank gets the same whole number of prompts, and its rows split exactly into the mini-batches: a shape
    that does not would silently train on part of the batch (4 prompts x G=3 over 2 ranks in 4 mini-batches:
    6 rows per rank, 4 mini-batches of 1 row = 4 of 6 rows trained on)."""
    P, M = cfg.prompts_per_step, cfg.mini_batch_prompts
    if P % M:
        raise ValueError(f"--prompts-per-step {P} is not a multiple of --mini-batch-prompts {M}")
    if P % world:
        raise ValueError(f"--prompts-per-step {P} is not divisible by the {world} ranks")
    rows, n_mini = P // world * cfg.group_size, P // M
    if rows % n_mini:
        raise ValueError(f"each rank's {rows} rows (--prompts-per-step {P} / {world} ranks x --group-size "
                         f"{cfg.group_size}) do not split into {n_mini} mini-batches (--prompts-per-step / "
                         f"--mini-batch-prompts); choose --mini-batch-prompts so that they do")


def mini_batches(n_rows, cfg):
    """This rank's rows of each optimizer step: cfg.prompts_per_step / cfg.mini_batch_prompts equal slices (exact:
    check_batch_shape). The old-log-prob pass uses the same slices and micro-batches as the update, so both run the
    same shapes: with bf16 kernels, other shapes would round differently and the first step's ratio would not be 1."""
    n_mini = cfg.prompts_per_step // cfg.mini_batch_prompts
    per_mini = n_rows // n_mini
    return [slice(m * per_mini, (m + 1) * per_mini) for m in range(n_mini)]


@torch.no_grad()
def batch_logprobs(model, cfg, input_ids, attn, n_prompt, with_entropy=False):
    """π_old (or π_ref) of all this rank's rows, without gradient, through the update's own mini-batch and
    micro-batch slices: the same shapes as the update's forward, so with bf16 kernels the first ratio is exactly 1."""
    minis, spans = mini_batches(input_ids.shape[0], cfg), row_spans(attn, n_prompt)
    outs = [sequence_logprobs(model, input_ids[r], attn[r], n_prompt, cfg.micro_batch_size, cfg.temperature,
                              with_entropy, spans[r], shared_group(cfg)) for r in minis]
    return tuple(map(torch.cat, zip(*outs))) if with_entropy else torch.cat(outs)


def update_policy(model, optimizer, cfg, device, input_ids, attn, mask, n_prompt, advantages, old_logp,
                  ref_logp=None, engine_logp=None):
    """The optimizer steps of one rollout: this rank's rows (B, ...) split into mini-batches, each into micro-batches.

    Mini-batch m is rows [m·B/M, (m+1)·B/M) of every rank, together cfg.mini_batch_prompts prompts of the world
    (check_batch_shape makes the split exact). The loss of a micro-batch is divided by the mini-batch's *global*
    sequence (or token) count, so summing over micro-batches and ranks gives exactly the loss of the whole
    mini-batch (dividing by each micro-batch's own count weights short micro-batches wrongly: the known accumulation
    bug). FSDP2 averages gradients over ranks, hence the factor world size on the loss. The band [lower, upper] is
    ratio_bounds of the old log-probs, per micro-batch.
    old_logp: π_old of every row, or None when on_policy(cfg): then π_old is this forward's own log-probs, detached,
    and the entropy and rollout/logprob_diff are measured here instead of in a separate pass.
    The first mini-batch runs before any optimizer step of this rollout, so its ratio must be exactly 1: the sum of
    |r − 1| over its tokens is logged (ratio/first_abs_dev); it is 0 only if the old-log-prob pass and the update
    ran the same shapes through the same kernels.
    Host syncs: one per update (the rows' lengths) and one per mini-batch (the skip decision); diagnostics stay on
    the device until the step's single all_reduce_sums.
    Returns (summed diagnostics as 0-dim tensors, skipped updates, last grad norm).
    """
    clip_c = cfg.clip_c if cfg.clip_c > 0 else None
    minis = mini_batches(input_ids.shape[0], cfg)
    if old_logp is None and not on_policy(cfg):
        raise ValueError("old_logp is required when a rollout feeds several mini-batches (off-policy)")
    world = dist.get_world_size()
    sums, skipped, grad_norm = {}, 0, torch.tensor(0.0)
    spans = row_spans(attn, n_prompt)  # the micro-batches' trimmed widths: one host sync for the whole update
    for m, rows in enumerate(minis):
        per_mini = rows.stop - rows.start
        n_tokens = mask[rows].sum()  # (), summed over ranks below: the global normaliser Z
        dist.all_reduce(n_tokens)
        n_seqs = float(per_mini * world)
        norm = dict(num_tokens=n_tokens, num_seqs=n_seqs, max_len=cfg.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(rows.start, rows.stop, cfg.micro_batch_size):
            mb = slice(i, min(i + cfg.micro_batch_size, rows.stop))
            out = sequence_logprobs(model, input_ids[mb], attn[mb], n_prompt, cfg.micro_batch_size,
                                    cfg.temperature, with_entropy=old_logp is None, spans=spans[mb],
                                    group_size=shared_group(cfg))
            logp = out[0] if old_logp is None else out                              # (b, T)
            old = logp.detach() if old_logp is None else old_logp[mb]               # (b, T)
            lower, upper = band.ratio_bounds(old, cfg.method, delta=cfg.delta, max_ratio=cfg.max_ratio, **_eps(cfg))
            loss, mets = grpo.policy_loss(logp, old, advantages[mb], mask[mb], lower, upper, clip_c=clip_c,
                                          agg=cfg.agg, **norm)
            if ref_logp is not None:  # aggregated like the policy loss (the authors' recipe), not a token mean
                kl = grpo.kl_penalty(logp, ref_logp[mb], cfg.kl_kind)              # (b, T)
                loss = loss + cfg.kl_coef * grpo.aggregate(kl, mask[mb], cfg.agg, **norm)
                mets["kl/ref_sum"] = (kl.detach() * mask[mb]).sum().double()
            if old_logp is None:
                mets.update(old_policy_sums(old, out[1], engine_logp[mb] if engine_logp is not None else old,
                                            mask[mb], cfg))
            if m == 0:  # before any optimizer step of this rollout: r = 1 exactly, or the two passes differ
                mets["ratio/first_abs_dev_sum"] = ((logp.detach() - old).exp().sub(1).abs() * mask[mb]).sum().double()
                mets["ratio/first_tokens"] = mask[mb].sum().double()
            (loss * world).backward()
            total += loss.detach()
            mets["loss/sum"] = loss.detach().double()  # summed over micro-batches and ranks = the mini-batch loss
            for k, v in mets.items():
                sums[k] = sums.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # A NaN loss can still have finite gradients (clamp passes none through a NaN), so both are checked; the
        # verdict is summed over ranks and the norm is global, so every rank takes the same branch.
        bad = (~torch.isfinite(total)).double() + (~torch.isfinite(grad_norm)).double()
        dist.all_reduce(bad)
        if bad.item() == 0:  # the one host sync of the mini-batch
            optimizer.step()
        else:  # a non-finite loss or gradient never reaches the weights
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            if dist.get_rank() == 0:
                print(f"non-finite loss/gradient in mini-batch {m} (loss {total.item()}): update skipped", flush=True)
    return sums, skipped, float(grad_norm)

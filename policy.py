"""The optimizer steps of a rollout: the objective on each micro-batch and the accumulation around it.

`micro_batch_loss` is the objective of docs/paper.md §3 (the BandPO objective of arXiv 2603.04918,
with the band of Theorem 1) on one micro-batch; `update_policy` is the accumulation loop around it:
mini-batches (one optimizer step each), micro-batches (gradient accumulation), normalisers counted
over the whole mini-batch and all ranks so that the accumulated loss is exactly the mini-batch's,
gradient clipping, and the skip of a non-finite step. Mixed precision (--train-dtype bfloat16): bf16
compute; fp32 master weights, AdamW state and reductions. The model it trains is built, sharded
(FSDP2), recomputed and compiled by machinery/model.py, whose names this file re-exports.

    model = build_model(cfg, device)  # cfg from train.resolve_config, under a process group
    sums, skipped, grad_norm = update_policy(model, optimizer, cfg, batch, advantages, old_logp)

Tests: tests/test_policy.py (packed log-probs against an unpadded forward per row, on-policy =
off-policy with a fresh π_old, the batch-shape check, token-budget and shared-prompt updates against
plain ones, the split of a plan); tests/test_two_ranks.py (2 ranks = 1 rank on one global batch for
every option that changes micro-batches, collectives or normalisers, token budgets of unequal counts
included); tests/test_train.py (the skip of a non-finite mini-batch); tests/test_grpo.py (the
accumulation identity of the loss).
"""
import dataclasses

import torch
import torch.distributed as dist

import band
import grpo
from logprobs import packed_logprobs, sequence_logprobs
from machinery.packed_attention import pack_default
from machinery.precision import cpu_has_amx
# the model's build, sharding, recomputation and compiled layers (machinery a reader may skip), importable from here
from machinery.model import (RECOMPUTE, SAVE_OPS, build_model, compile_layers, make_optimizer,  # noqa: F401
                             packed_kernel, packed_attention_label, reshard, resolve_recompute, selective_policy,
                             set_recompute)


# --- the batch's shape ---------------------------------------------------------------------------
def on_policy(cfg):
    """One optimizer step per rollout: π_old is π_θ before the step, so the old log-probs are the
    update's own forward, detached (ratio exactly 1), and the separate no-grad pass is skipped (as
    TRL and verl do)."""
    return cfg.prompts_per_step == cfg.mini_batch_prompts


def check_batch_shape(cfg, world):
    """Every rank gets the same whole number of prompts, and its rows split exactly into the
    mini-batches: a shape that does not would silently train on part of the batch (4 prompts x G=3
    over 2 ranks in 4 mini-batches: 6 rows per rank, 4 mini-batches of 1 row, 4 of 6 rows). With
    --share-prompt each mini-batch of a rank is whole groups. Run on the flags and on a resumed
    run's saved settings (train.load_run_config), before any process group."""
    n_prompts, per_mini = cfg.prompts_per_step, cfg.mini_batch_prompts
    if n_prompts % per_mini:
        raise ValueError(f"--prompts-per-step {n_prompts} is not a multiple of "
                         f"--mini-batch-prompts {per_mini}")
    if n_prompts % world:
        raise ValueError(f"--prompts-per-step {n_prompts} is not divisible by the {world} ranks")
    rows, n_mini = n_prompts // world * cfg.group_size, n_prompts // per_mini
    if rows % n_mini:
        raise ValueError(f"each rank's {rows} rows (--prompts-per-step {n_prompts} / {world} "
                         f"ranks x --group-size {cfg.group_size}) do not split into {n_mini} "
                         f"mini-batches (--prompts-per-step / --mini-batch-prompts); choose "
                         f"--mini-batch-prompts so that they do")
    # the shared-prompt forward runs each prompt once for its G rows: a mini-batch of a rank that
    # holds part of a group would fail in the first update, after the engine and a rollout
    if cfg.share_prompt and rows // n_mini % cfg.group_size:
        raise ValueError(f"--share-prompt (given, or saved by the run resumed) needs whole groups "
                         f"in each rank's mini-batch, and {world} ranks get {rows // n_mini} rows "
                         f"of --group-size {cfg.group_size} each; choose --mini-batch-prompts a "
                         f"multiple of the ranks or --no-share-prompt, or resume on fewer ranks")


def mini_batches(n_rows, cfg):
    """This rank's rows of each optimizer step: prompts_per_step / mini_batch_prompts equal slices
    (exact, by check_batch_shape)."""
    n_mini = cfg.prompts_per_step // cfg.mini_batch_prompts
    per_mini = n_rows // n_mini
    return [slice(m * per_mini, (m + 1) * per_mini) for m in range(n_mini)]


def micro_batches(rows, cfg, spans):
    """The micro-batches (gradient accumulation) of one mini-batch `rows` (a slice of this rank's
    rows): slices of micro_batch_size rows in rollout order, or, with --micro-batch-tokens N, lists
    of row indices sorted by length (longest first) and cut so that each micro-batch's size is at
    most N (a row longer than N alone is a micro-batch of one): its padded size, (its longest
    prompt + its longest response) x its rows, or with --pack its real tokens (`_cost`). Sorting
    puts rows of like length together, so a long response no longer makes its neighbours pay its
    length. The old-log-prob pass runs the same micro-batches as
    the update, so both run the same shapes: with bf16 kernels, other shapes would round differently
    and the first mini-batch's ratio would not be exactly 1. This rank's own plan: under a process
    group `plan_micro_batches` makes every rank's count the same."""
    if not cfg.micro_batch_tokens:
        return [slice(i, min(i + cfg.micro_batch_size, rows.stop))
                for i in range(rows.start, rows.stop, cfg.micro_batch_size)]
    order = sorted(range(rows.start, rows.stop), key=lambda i: (-sum(spans[i]), i))
    out = []
    for i in order:
        if out and _cost(out[-1] + [i], spans, cfg.pack) <= cfg.micro_batch_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _cost(rows, spans, packed):
    """The tokens a forward of these rows runs: their real tokens packed, else (the longest prompt
    + the longest response, at least 1) x the rows."""
    if packed:
        return sum(spans[i][0] + spans[i][1] for i in rows)
    return (max(spans[i][0] for i in rows) + max(max(spans[i][1] for i in rows), 1)) * len(rows)


# --pack unset on a CPU: packing removes the padding of the padded path's micro-batches, but a packed update may cost
# more per real token than a padded one per padded token. The SmolLM2 job (bench_cpu_roofline.py: GSM8K, 8 prompts
# x 8, 48 new tokens, micro-batches of 8 rows, bf16, padded / real 1.01; docs/benchmarks.md), one thread's CPU s:
# - a 2-core AMD EPYC, Zen 4, avx512_bf16, no AMX (2026-12-03), the packed attention in float32
#   (packed_attention.float32_attention): packed 79.5 and 78.3 s against padded 81.7 and 88.7 (0.93x; with the
#   attention in bf16 88.7 and 88.1); the tiny model's `make demo` update (2 ranks) 0.875 s packed, 0.877 padded:
#   pack at any padding (1.0). Unmeasured, and taken the same: float32 runs and CPUs without avx512_bf16;
# - a 2-core Intel Xeon with AMX (2026-11, before sdpa-block): 10.2-10.4 s packed against 8.0-8.5 padded on 2
#   threads, 1.25x: pack there only where padded / real tokens reach 1.25.
# CUDA: always (packed_attention.PACK_DEFAULT, measured faster there).
PACK_MIN_PADDING = {"cpu": 1.0, "cpu-amx": 1.25}


def _kind(device):
    """PACK_MIN_PADDING's key of `device`: its type, "cpu-amx" for a CPU with AMX tiles."""
    kind = torch.device(device).type
    return kind + "-amx" if kind == "cpu" and cpu_has_amx() else kind


def start_up_padding(cfg, world, prompt_lens):
    """Padded / real tokens of the padded path's micro-batches over the training prompts (`prompt_lens`, in data
    order, each prompt G times, mini-batches of this rank's rows, policy.micro_batches' plan), from what start-up
    knows: responses are taken as --max-new-tokens long. Responses that stop early add padding that packing would
    remove too, so this is the least padding the run will see: GSM8K's chat prompts within a group are one length,
    and there the estimate is 1."""
    G, T = cfg.group_size, cfg.max_new_tokens
    rows = max(1, cfg.mini_batch_prompts // world)           # prompts per mini-batch of one rank
    if not cfg.micro_batch_tokens:
        # rows of --micro-batch-size: consecutive slices of each mini-batch's rows x G, in one pass over all
        # 100k prompts of the synthetic task (the planner, called per mini-batch, took ~0.7 s of every start-up)
        lens = torch.tensor(prompt_lens, dtype=torch.int64).repeat_interleave(G)
        at = torch.arange(len(lens)) % (rows * G)
        seg = torch.cumsum(at % cfg.micro_batch_size == 0, 0) - 1      # each row's micro-batch
        longest = torch.zeros(int(seg[-1]) + 1, dtype=torch.int64).scatter_reduce(0, seg, lens, "amax")
        padded = int(((longest + max(T, 1)) * torch.bincount(seg)).sum())
        return padded / (int(lens.sum()) + T * len(lens))
    plan = dataclasses.replace(cfg, pack=False)
    padded = real = 0
    for i in range(0, len(prompt_lens), rows):
        spans = [(p, T) for p in prompt_lens[i:i + rows] for _ in range(G)]
        for mb in micro_batches(slice(0, len(spans)), plan, spans):
            padded += _cost(mb, spans, False)
        real += sum(p + T for p, _ in spans)
    return padded / real


def pack_pays(cfg, device, world, prompt_lens):
    """--pack unset: (pack?, why in words, the start-up line's). Where PACK_MIN_PADDING has a threshold, on where
    start_up_padding reaches it; elsewhere packed_attention.pack_default. Decided once, at start-up: the fused head
    is installed with the model, so a run does not switch between the packed and padded paths per batch."""
    least = PACK_MIN_PADDING.get(_kind(device))
    if least is None or not prompt_lens:
        return pack_default(device), f"measured faster on {torch.device(device).type}"
    ratio = start_up_padding(cfg, world, prompt_lens)
    return ratio >= least, (f"auto: padded / real tokens {ratio:.2f} {'>=' if ratio >= least else '<'} {least}, "
                            f"prompts' padding with responses of --max-new-tokens")


def pack_reason(given, decided, device, world, prompt_lens):
    """The start-up line's reason for packed rows on or off: `given` the Config before decide_grad_checkpointing,
    `decided` after it."""
    if given.pack is not None:
        return "as given"
    if decided.share_prompt:
        return "off under the shared prompt"
    return pack_pays(given, device, world, prompt_lens)[1]


def plan_micro_batches(n_rows, cfg, spans, device):
    """Every mini-batch of this rank with its micro-batches, as many micro-batches as on every other
    rank: -> [(rows, [micro-batch, ...]), ...]. Each FSDP2 forward and backward is a collective, so
    two ranks that run different counts hang. Row micro-batches agree by construction (every rank
    has as many rows); token budgets plan from this rank's lengths, so the counts are all-reduced
    with MAX, one collective for all mini-batches (verl's dynamic batch size does the same:
    `rearrange_micro_batches` in verl/utils/seqlen_balancing.py all-reduces its count with MAX),
    and a rank short of the count splits its largest micro-batches (`_split`). The loss does not
    change: its normalisers are the whole mini-batch's. Used by the update and by the old- and
    reference-log-prob passes alike, so all three run the same shapes."""
    plan = [(rows, micro_batches(rows, cfg, spans)) for rows in mini_batches(n_rows, cfg)]
    if not (cfg.micro_batch_tokens and dist.is_initialized()):
        return plan
    counts = torch.tensor([len(mbs) for _, mbs in plan], device=device)  # (M,)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return [(rows, _split(mbs, n, spans, cfg.pack))
            for (rows, mbs), n in zip(plan, counts.tolist())]


def _split(mbs, n, spans, packed=False):
    """Split the micro-batch of most tokens (`_cost`; of those with two rows or more) into its
    longer and its shorter half until there are n: always possible while n <= the rows, and each
    half is within the budget its whole was."""
    mbs = list(mbs)
    while len(mbs) < n:
        k = max((j for j, mb in enumerate(mbs) if len(mb) > 1),
                key=lambda j: _cost(mbs[j], spans, packed))
        half = (len(mbs[k]) + 1) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def _forward(model, mb, cfg, with_entropy=False):
    """log π (and the entropy) of one micro-batch's response tokens: (b, T) each, packed with
    --pack, else padded (the reference: tests/test_pack.py)."""
    if cfg.pack:
        return packed_logprobs(model, mb.input_ids, mb.n_prompt, mb.spans, cfg.temperature,
                               with_entropy)
    return sequence_logprobs(model, mb.input_ids, mb.attn, mb.n_prompt, len(mb), cfg.temperature,
                             with_entropy, mb.spans, cfg.group_size if cfg.share_prompt else 0)


@torch.no_grad()
def batch_logprobs(model, cfg, batch, with_entropy=False, skip_first=False):
    """π_old (or π_ref) of all this rank's rows, without gradient, through the update's own
    micro-batches. skip_first: leave the first mini-batch's rows at NaN for update_policy to fill
    from its own forward (the first mini-batch runs before any optimizer step, so that forward *is*
    π_old: one forward saved per rollout). A model without trainable parameters (the reference) is
    resharded after the pass: no backward will do it. -> (logp (B, T), entropy (B, T) or None), in
    the batch's row order."""
    logp = torch.zeros_like(batch.mask)                              # (B, T)
    entropy = torch.zeros_like(batch.mask) if with_entropy else None
    plan = plan_micro_batches(len(batch), cfg, batch.spans, batch.input_ids.device)
    if skip_first:
        logp[plan[0][0]] = float("nan")
        plan = plan[1:]
    for _, mbs in plan:
        for mb in mbs:
            lp, ent = _forward(model, batch[mb], cfg, with_entropy)   # (b, T)
            logp[mb] = lp
            if with_entropy:
                entropy[mb] = ent
    if not any(p.requires_grad for p in model.parameters()):
        reshard(model)
    return logp, entropy


def old_policy_sums(old_logp, entropy, engine_logp, mask, cfg):
    """Diagnostics of π_old on the sampled tokens, as sums (grpo.finalize_metrics makes the rates):
    its entropy and `engine_gap_sums`."""
    return {"sum_entropy": (entropy * mask).sum(),
            **engine_gap_sums(old_logp, engine_logp, mask, cfg)}


def engine_gap_sums(trainer_logp, engine_logp, mask, cfg):
    """The engine's view of the trainer's π_old on the sampled tokens, as sums over n_gap_tokens:
    |engine log-prob − trainer log-prob| is rollout/logprob_diff (TRL:
    sampling/sampling_logp_difference): a gap means mismatched temperature, stale weights or
    rounding (bf16). The ratio r = exp(trainer − engine) that a trainer taking the engine's
    log-probs as π_old would see is counted where it leaves [0.9, 1.1] and where it leaves the band
    of the engine's log-prob (what rounding alone clips). Meaningful only before any optimizer step
    of the rollout: after one, the update's own drift adds to the gap."""
    r = torch.exp(trainer_logp - engine_logp)                        # (B, T)
    lower, upper = _bounds(engine_logp.clamp(max=0.0), cfg)
    return {"sum_logprob_diff": ((engine_logp - trainer_logp).abs() * mask).sum(),
            "n_ratio_out_0.1": (((r - 1).abs() > 0.1) * mask).sum(),
            "n_ratio_out_band": (((r > upper) | (r < lower)) * mask).sum(),
            "n_gap_tokens": mask.sum()}


def _bounds(old_logp, cfg):
    return band.ratio_bounds(old_logp, cfg.method, delta=cfg.delta, eps_low=cfg.eps_low,
                             eps_high=cfg.eps_high, max_ratio=cfg.max_ratio)


# --- the objective -------------------------------------------------------------------------------
def micro_batch_loss(model, mb, cfg, advantages, old_logp, ref_logp, norm, with_entropy=False):
    """The objective of docs/paper.md §3 on one micro-batch: log π_θ, the band [lower, upper]
    around π_old, the clipped surrogate (weighted by the rollout importance correction, if on) and
    the KL to the reference, each aggregated by the whole mini-batch's normaliser `norm`.
    old_logp None: π_old is this forward's own log-probs, detached (on-policy: the ratio is exactly
    1). -> (loss, diagnostics' sums, logp (b, T), entropy or None)."""
    logp, entropy = _forward(model, mb, cfg, with_entropy)              # (b, T)
    old = logp.detach() if old_logp is None else old_logp                # (b, T) π_old
    lower, upper = _bounds(old, cfg)                                     # (b, T) the band
    weights, is_sums = grpo.rollout_is_weights(old, mb.engine_logp, mb.mask, cfg.rollout_is,
                                               cfg.rollout_is_max,
                                               cfg.rollout_is_min)     # (b, T) or None
    loss, sums = grpo.policy_loss(logp, old, advantages, mb.mask, lower, upper, clip_c=cfg.clip_c,
                                  agg=cfg.agg, weights=weights, **norm)
    if ref_logp is not None:  # aggregated like the policy loss, as the authors do: no token mean
        kl = grpo.kl_penalty(logp, ref_logp, cfg.kl_kind)                # (b, T)
        loss = loss + cfg.kl_coef * grpo.aggregate(kl, mb.mask, cfg.agg, **norm)
        sums["sum_kl_ref"] = (kl.detach() * mb.mask).sum().double()
    return loss, {**sums, **is_sums}, logp, entropy


def update_policy(model, optimizer, cfg, batch, advantages, old_logp, ref_logp=None,
                  old_entropy=None, reduce_each_micro_batch=False):
    """The optimizer steps of one rollout: this rank's rows in mini-batches, each in micro-batches.

    Mini-batch m is rows [m·B/M, (m+1)·B/M) of every rank. Each micro-batch's loss is divided by the
    mini-batch's *global* sequence (or token) count, so the sum over micro-batches and ranks is
    exactly the mini-batch's loss (grpo.policy_loss says why). FSDP2 averages gradients over ranks,
    hence the factor world size on the loss.

    old_logp: π_old of every row (B, T), the trainer's recomputation or the engine's log-probs
    (--old-logp engine); None when on_policy(cfg) with --old-logp trainer. Without a separate
    trainer pass (None, or the engine's) the diagnostics come from this forward (`_probe_sums`).
    old_entropy: given where the trainer's pass left the first mini-batch out
    (batch_logprobs(skip_first=True)): that mini-batch's own forward is π_old (no optimizer step
    has run yet), so its log-probs and entropy are written into old_logp and old_entropy here, the
    same values the pass would have computed with the same kernels and shapes.
    The first mini-batch runs before any optimizer step, so its ratio must be exactly 1: Σ|r − 1|
    over its tokens is logged (ratio/first_abs_dev): 0 by construction where π_old is this forward
    (on-policy, or filled in here); with a given π_old, 0 only if both passes ran the same kernels.
    Gradients accumulate whole (unsharded) over a mini-batch's micro-batches and are reduced across
    ranks, and the weights resharded, once, after its last backward (`_reduce_on_last`); every rank
    runs the same micro-batch count (plan_micro_batches), so all agree on which is last.
    reduce_each_micro_batch: FSDP2's default instead, a reduce and a reshard after every backward (the
    reference tests/test_two_ranks.py compares with). Host syncs: one per mini-batch (the skip
    decision), one more with --micro-batch-tokens (the agreed counts). -> (sums, skipped updates,
    last grad norm).
    """
    if old_logp is None and not on_policy(cfg):
        raise ValueError("old_logp is required when a rollout feeds several mini-batches "
                         "(off-policy)")
    world, device = dist.get_world_size(), batch.input_ids.device
    sums, skipped, grad_norm = {}, 0, torch.tensor(0.0)

    def add(new):  # sums add up, max_* keys keep the largest
        for k, v in new.items():
            sums[k] = (v if k not in sums else torch.maximum(sums[k], v) if k.startswith("max_")
                       else sums[k] + v)

    # no trainer pass before: the diagnostics come from here
    measured_here = old_logp is None or cfg.old_logp == "engine"
    fill_first = old_entropy is not None
    if fill_first and (old_logp is None or cfg.old_logp == "engine"):
        raise ValueError("old_entropy is filled with the trainer's π_old: it needs the trainer's "
                         "old_logp (--old-logp trainer, off-policy)")
    for m, (rows, mbs) in enumerate(plan_micro_batches(len(batch), cfg, batch.spans, device)):
        n_tokens = batch.mask[rows].sum()  # (), summed over ranks below: the global normaliser Z
        dist.all_reduce(n_tokens)
        norm = dict(num_tokens=n_tokens, num_seqs=float((rows.stop - rows.start) * world),
                    max_len=cfg.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j, rows_mb in enumerate(mbs):
            if not reduce_each_micro_batch:
                _reduce_on_last(model, last=j == len(mbs) - 1)
            mb = batch[rows_mb]
            fill = fill_first and m == 0  # π_old is this forward, detached
            old = None if old_logp is None or fill else old_logp[rows_mb]
            ref = None if ref_logp is None else ref_logp[rows_mb]
            loss, mets, logp, entropy = micro_batch_loss(model, mb, cfg, advantages[rows_mb], old,
                                                         ref, norm,
                                                         with_entropy=measured_here or fill)
            if fill:
                old_logp[rows_mb] = logp.detach()
                old_entropy[rows_mb] = entropy.detach()
            (loss * world).backward()
            total += loss.detach()
            mets["sum_loss"] = loss.detach().double()  # over micro-batches and ranks: the loss
            add(mets)
            add(_probe_sums(logp.detach(), old, entropy, mb, cfg, measured_here, first=m == 0))
        grad_norm, ok = _step(model, optimizer, cfg, total, m)
        skipped += not ok
    # rank-wide decisions, counted on rank 0 only so that the sum over ranks counts each once
    lead = float(dist.get_rank() == 0)
    add({"n_minibatches": lead * (m + 1), "n_skipped": lead * skipped})
    return sums, skipped, float(grad_norm)


def _reduce_on_last(model, last):
    """Gradient accumulation without a reduce per micro-batch (as verl and torchtune accumulate): before
    each backward but a mini-batch's last, FSDP2 keeps the gradient whole and in float32 on the
    module (its reduce dtype; the weights stay gathered too), and the last backward reduces the sum
    once. The same float32 sums in the same order on one rank (bit for bit); on N ranks each rank sums
    its own micro-batches before the ranks' sum. It costs a whole float32 gradient on every rank beside
    the shards, and the compute-dtype weights held between micro-batches (machinery/memory.py)."""
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)


def _probe_sums(logp, old, entropy, mb, cfg, measured_here, first):
    """Diagnostics of one micro-batch's forward where no trainer pass measured them before: the
    entropy in every mini-batch (each under the policy that trains on it: the rollout's tokens all
    count, as in the trainer's pass), the engine-vs-trainer gap on the first mini-batch only, where
    π_θ is still π_old. On the first mini-batch also Σ|r − 1|, 0 unless π_old came from other
    kernels or from the engine."""
    sums = {}
    if measured_here:
        sums["sum_entropy"] = (entropy * mb.mask).sum()
        if first:
            engine = mb.engine_logp if mb.engine_logp is not None else logp
            sums.update(engine_gap_sums(logp, engine, mb.mask, cfg))
    if first:
        old = logp if old is None else old
        sums["sum_first_abs_dev"] = ((logp - old).exp().sub(1).abs() * mb.mask).sum().double()
        sums["n_first_tokens"] = mb.mask.sum().double()
    return sums


def _step(model, optimizer, cfg, total, m):
    """Clip the gradient and take the optimizer step, unless the mini-batch's loss `total` or the
    gradient is not finite: a NaN loss can still have finite gradients (clamp passes none through
    a NaN), so both are checked; the verdict is summed over ranks and the norm is global, so all
    ranks branch alike. One host sync. -> (grad norm, whether the step was taken)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    bad = (~torch.isfinite(total)).double() + (~torch.isfinite(grad_norm)).double()
    dist.all_reduce(bad)
    if bad.item() == 0:
        optimizer.step()
        return grad_norm, True
    optimizer.zero_grad(set_to_none=True)  # a non-finite loss or gradient never reaches the weights
    if dist.get_rank() == 0:
        print(f"non-finite loss/gradient in mini-batch {m} (loss {total.item()}): update skipped",
              flush=True)
    return grad_norm, False

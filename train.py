"""BandPO / GRPO training with FSDP2: `torchrun --nproc_per_node 2 train.py --method bandkl`.

The objective of docs/paper.md §3 (the BandPO objective of arXiv 2603.04918): GRPO group advantages,
the clipped surrogate with per-token bounds [r̲(p), r̄(p)] from band.ratio_bounds, dual clip c = 10,
"seq-mean-token-mean" aggregation, an optional low-variance KL to a frozen reference. One step, top
to bottom in `main`: prompts -> rollout of G completions each (vLLM or HF) -> rewards -> advantages
-> old and reference log-probs -> mini-batch updates (policy.update_policy) -> weight sync into the
engine -> metrics -> eval -> checkpoint. Log-probs are those of the distribution the engine sampled
from, softmax(logits / temperature) (so --top-p must be 1); with one mini-batch per rollout the
update is on-policy (policy.on_policy) and the old-log-prob pass is skipped, as in TRL and verl;
with several, the pass skips the first mini-batch, whose update forward (before any optimizer step)
is π_old itself.

    torchrun --nproc_per_node 2 train.py --method bandkl --delta 0.05  # the tiny model, minutes
    torchrun --nproc_per_node 2 train.py --method clip --out-dir runs/grpo
    torchrun --nproc_per_node 2 train.py --resume runs/grpo            # from its last checkpoint
    python train.py --max-steps 5                                      # one process: same program
    python train.py --help                                             # every config.Config field a flag

Departures from the authors' verl recipe, on purpose (docs/design.md has the rest):
- Rollout and training alternate on the same ranks (colocated), one vLLM engine per rank, TP = 1.
- The paper's batch is 256 prompts x 16 samples in mini-batches of 64 prompts, 4 optimizer steps
  per rollout; the tiny default keeps the 4 steps with 32 x 8 (recipes/paper.sh has the paper's).
- The tiny default uses lr 1e-4 (not 1e-6) and no KL: a 0.7 M-parameter model needs larger steps.
"""

import ctypes
import dataclasses
import json
import os
import random
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import transformers
from tqdm import tqdm
from transformers import AutoTokenizer

import data
import eval as evaluation
import grpo
import reward
import rollout
from machinery.checkpoint import (checkpoint_step, export_hf, latest_checkpoint, load_checkpoint,
                                  prune_checkpoints, save_checkpoint)
from machinery.flops import device_peak_tflops, mfu, model_flops
from machinery.jsonl import resumed_lines
from config import (Config, decide_grad_checkpointing, method_defaults, micro_batch_tokens,  # noqa: F401
                    parse_config, resolve_config, resumed_config, update_fits, update_memory_gb)
from logprobs import check_packable, pack, sequence_logprobs
from policy import (batch_logprobs, build_model, check_batch_shape, make_optimizer,  # noqa: F401 (re-exported)
                    old_policy_sums, on_policy, pack_reason, packed_attention_label, packed_kernel, reshard,
                    update_policy)


# --- distributed: a few explicit lines, the same path for 1 and N processes ----------------------
RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))


def print0(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def init_distributed():
    """One process group for 1 or N processes. `python train.py` is the same program as torchrun
    with one process: the variables torchrun would set are set here (vLLM's SPMD executor reads RANK
    and LOCAL_RANK itself), with a free port for the rendezvous."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if torch.cuda.is_available():
        device = torch.device("cuda", LOCAL_RANK)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=RANK, world_size=WORLD, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=RANK, world_size=WORLD)
    return device


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keep_freed_memory(cfg, device, free, longest_prompt=None):
    """On a CPU with memory to spare, glibc (Linux): allocations from the heap, not mapped afresh (mallopt
    M_MMAP_MAX 0; glibc's per-thread arenas still map blocks above 64 MiB), and the main heap never trimmed
    (M_TRIM_THRESHOLD 2 GiB), so the blocks a step frees serve the next without page faults. glibc's defaults map
    blocks above its threshold (128 KiB, growing to 32 MiB) afresh and shrink the heap's top: FSDP2's cast copies,
    logits and activations then fault their pages in on every micro-batch, ~30% of an update in the kernel
    (docs/benchmarks.md). The price: freed blocks stay resident, ~0.6 GB more peak, so only where checkpointing is
    off and the memory test (config.update_fits, on the `free` bytes of decide_grad_checkpointing and the longest
    prompt) finds room, whatever the flag said. Left alone: GPU runs, other platforms, and a user's own
    GLIBC_TUNABLES / MALLOC_* settings. -> whether it was set."""
    own = "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(
        k.startswith("MALLOC_") for k in os.environ)
    if (device.type != "cpu" or cfg.grad_checkpointing or not sys.platform.startswith("linux")
            or own or not update_fits(cfg, free, longest_prompt, device)):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    # 2**31 - 1: mallopt takes a C int; the trim threshold first, so that a refusal leaves mapping as it was
    return mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and mallopt(M_MMAP_MAX, 0) == 1


def peak_rss_gb():
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def all_reduce_sums(sums, device):
    """Sum a dict of scalars (numbers or 0-dim tensors) over ranks, `max_*` keys by their maximum:
    one collective and one host sync for the sums (one more for the maxima, if any)."""
    out = {}
    for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in sums if not k.startswith("max_"))),
                     (dist.ReduceOp.MAX, sorted(k for k in sums if k.startswith("max_")))):
        if keys:
            vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device)
                               for k in keys])
            dist.all_reduce(vec, op=op)
            out.update(zip(keys, vec.tolist()))
    return out


# --- data order: a seeded permutation per epoch, so the position in the stream is an index -------
def prompt_batch(records, step, cfg):
    """The global prompts of `step` (all ranks), then this rank's contiguous share."""
    P, N = cfg.prompts_per_step, len(records)
    perms, out = {}, []  # one shuffle per epoch; a step spans at most two
    for i in range(step * P, (step + 1) * P):
        epoch, j = divmod(i, N)
        if epoch not in perms:
            perms[epoch] = torch.randperm(
                N, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
        out.append(records[perms[epoch][j]])
    per_rank = P // WORLD
    return out[RANK * per_rank:(RANK + 1) * per_rank]


# --- evaluation: mean@n and pass@k on held-out prompts, sharded over ranks -----------------------
EVAL_SEED_OFFSET = 1 << 40  # evaluation's sampling seeds never coincide with a training rollout's


def validate(engine, tokenizer, eval_sets, cfg, step):
    sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens,
                                seed=cfg.seed * 7919 + step * WORLD + RANK + EVAL_SEED_OFFSET)
    shards = {name: recs[RANK::WORLD] for name, recs in eval_sets.items()}
    local = evaluation.evaluate(engine, tokenizer, shards, n=cfg.eval_n, sampling=sampling,
                                max_prompt_len=cfg.max_prompt_len, progress=False,
                                scorer=eval_scorer(cfg))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {name: r["correct_counts"] for name, r in local.items()})
    return {f"eval/{name}/{key}": value for name in eval_sets
            for key, value in evaluation.summarize([c for g in gathered for c in g[name]],
                                                   cfg.eval_n).items()}


def eval_scorer(cfg):
    """The held-out task is scored for real, also when the training rewards are coins."""
    return "math-verify" if reward.random_probability(cfg.reward) is not None else cfg.reward


def train_rewards(completions, prompts, cfg, step):
    """(B,) rewards: the scorer's verdict on each completion, or under --reward random[:P] a coin
    per completion seeded by (seed, step, rank), the same for every method (random_rewards)."""
    coin = reward.random_probability(cfg.reward)
    if coin is not None:
        scores = reward.random_rewards(len(completions), coin, (cfg.seed, step, RANK),
                                       correct=cfg.reward_correct, incorrect=cfg.reward_incorrect)
    else:
        scores = reward.score_batch([c.text for c in completions],
                                    [prompts[c.prompt_index]["answer"] for c in completions],
                                    scorer=cfg.reward, correct=cfg.reward_correct,
                                    incorrect=cfg.reward_incorrect)
    return torch.tensor(scores, dtype=torch.float32)


def engine_trainer_gap(engine, model, records, cfg, device):
    """Mean |engine log-prob − trainer log-prob| (nats per sampled token) of the dtypes chosen, on 2
    training prompts x 2 samples per rank before any update, for the start-up line: what
    rollout/logprob_diff will read (docs/design.md, the engine is not the trainer). The samples
    fork the RNGs and the engine's prefix cache is emptied after, so the run is unchanged."""
    prompt_ids = [records[(2 * RANK + i) % len(records)]["prompt_ids"] for i in range(2)]
    sampling = rollout.Sampling(temperature=cfg.temperature, max_new_tokens=min(8, cfg.max_new_tokens),
                                seed=EVAL_SEED_OFFSET - 1 - RANK, logprobs=True)
    completions = engine.generate(prompt_ids, 2, sampling)
    engine.reset_prefix_cache()
    if any(c.logprobs is None for c in completions):
        return float("nan")
    batch = pack(prompt_ids, completions, device)
    with torch.no_grad():  # one forward of the 4 rows on every rank: FSDP's collectives match
        trainer_logp, _ = sequence_logprobs(model, batch.input_ids, batch.attn, batch.n_prompt,
                                            len(batch), cfg.temperature)
    reshard(model)  # no backward follows before the first rollout: its gathered copy would stay
    sums = torch.stack([((trainer_logp - batch.engine_logp).abs() * batch.mask).sum(),
                        batch.mask.sum()]).double()
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


# --- the run: its directory, metrics file and console --------------------------------------------
def load_run_config(argv):
    """The Config that will run: the flags, or a resumed run's saved settings with what config.resumed_config takes
    from the flags (it says which, on one line), checked against this world size. Raises ValueError / OSError
    naming the value."""
    cfg = resolve_config(parse_config(argv))
    if cfg.resume:
        with open(os.path.join(cfg.out_dir, "config.json")) as f:
            cfg, note = resumed_config(argv, json.load(f))
        print0(note)
    check_batch_shape(cfg, WORLD)  # the shape that will run: a resumed run's own, on this world
    return cfg


def open_run(cfg, start_step):
    """Rank 0: write config.json, give metrics.jsonl the lines up to the checkpoint we resume from, from it or
    from the committed metrics.jsonl.gz (atomically), open it for appending, start wandb if asked. Others: (None,
    None)."""
    if RANK != 0:
        return None, None
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
    metrics_file = os.path.join(cfg.out_dir, "metrics.jsonl")
    kept = resumed_lines(metrics_file, start_step)  # the plain file's, else the committed .gz's
    if kept is not None:
        with open(metrics_file + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(metrics_file + ".tmp", metrics_file)
    wandb_run = None
    if cfg.wandb:
        import wandb  # optional (resolve_config checked that it is installed)
        wandb_run = wandb.init(project=cfg.wandb, config=dataclasses.asdict(cfg), dir=cfg.out_dir)
    return open(metrics_file, "a"), wandb_run


def timing_metrics(times, sums, peak_tflops):
    """The phase times {name: (start, end)}, response tokens per second, peak memory and `mfu`: the update's MFU,
    its model FLOPs (machinery/flops.model_flops of every rank's rows) over the update phase's seconds on WORLD devices
    of `peak_tflops`, not the whole step's (rollout, old log-probs, sync); absent where the peak is unknown (a CPU)."""
    metrics = {f"time/{name}": end - start for name, (start, end) in times.items()}
    metrics["tokens_per_s"] = sums["n_tokens"] / metrics["time/step"]
    if peak_tflops:
        metrics["mfu"] = mfu(sums["sum_update_flops"], metrics["time/update"], peak_tflops * WORLD)
    metrics["memory/peak_rss_gb"] = peak_rss_gb()  # rank 0's process: trainer + colocated engine
    if torch.cuda.is_available():
        metrics["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics


def console_line(metrics, cfg):
    acc = next((f" | eval {v:.3f}" for k, v in metrics.items() if k.endswith(f"mean@{cfg.eval_n}")), "")
    return (f"step {metrics['step']} | reward {metrics['reward/mean']:.3f} | "
            f"entropy {metrics['entropy']:.3f} | "
            f"clip {metrics['clip/frac']:.3f} (hi {metrics['clip/frac_upper']:.3f}) | "
            f"low-p hi {metrics['clip/low_p_upper_rate']:.3f}{acc} | {metrics['tokens_per_s']:.0f} tok/s"
            + (f" | MFU {100 * metrics['mfu']:.1f}%" if "mfu" in metrics else "") + f" | {metrics['time/step']:.1f} s")


def main(argv=None):
    # --- configuration: every error is one line and exit code 2, before any process group ---
    try:
        cfg = load_run_config(argv)
        ckpt = latest_checkpoint(cfg.out_dir) if cfg.resume else None
        resumed_lines(os.path.join(cfg.out_dir, "metrics.jsonl"), checkpoint_step(ckpt))  # what open_run will keep
        # the synthetic task is unlimited: a fixed 100k problems, so the data order does not
        # depend on --max-steps
        train_records = [r for name in data.split_names(cfg.data) for r in data.load(
            name, split="train", seed=cfg.seed,
            n=100_000 if name.startswith("arithmetic") else None)]
        eval_names = data.split_names(cfg.eval_data) or data.split_names(cfg.data)
        eval_sets = {n: data.load(n, split="test", n=cfg.eval_prompts or None, seed=0)
                     for n in eval_names}
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        prompt_ids, kept, dropped = data.tokenize_prompts(train_records, tokenizer,
                                                          cfg.max_prompt_len)
        if not prompt_ids:
            raise ValueError(f"every training prompt is longer than --max-prompt-len "
                             f"{cfg.max_prompt_len} tokens")
        train_records = [dict(r, prompt_ids=ids) for r, ids in zip(kept, prompt_ids)]
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)

    # A quiet console: the start-up summary, one line per step, the bar, and warnings that matter.
    # vLLM logs ~6 INFO lines per weight sync; --verbose (or VLLM_LOGGING_LEVEL=INFO) brings them
    # back. Set before vLLM is imported (rollout imports it when the engine is built).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if cfg.verbose else "WARNING")
    transformers.utils.logging.disable_progress_bar()
    if not cfg.verbose:
        transformers.utils.logging.set_verbosity_error()
    device = init_distributed()
    try:  # on the device this rank uses and the prompts' real lengths, the same on every rank
        given, lens = cfg, [len(x) for x in prompt_ids]
        cfg, free, free_source, why = decide_grad_checkpointing(cfg, device, lens, explain=True)
        if cfg.pack:  # what the packed path does not implement: refused before the model loads
            check_packable(transformers.AutoConfig.from_pretrained(cfg.model), packed_kernel(cfg, device))
    except ValueError as e:
        print0(f"train.py: error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    keep_freed_memory(cfg, device, free, max(map(len, prompt_ids)))
    model = build_model(cfg, device)
    ref_model = build_model(cfg, device, trainable=False) if cfg.kl_coef > 0 else None
    optimizer = make_optimizer(model, cfg)
    n_params, peak = sum(p.numel() for p in model.parameters()), device_peak_tflops(device)  # MFU's
    # the engine before the checkpoint: vLLM reseeds the global RNGs when it starts, the
    # checkpoint restores them
    engine = rollout.make_engine(cfg.rollout, cfg.model, tokenizer=tokenizer, seed=cfg.seed + RANK,
                                 dtype=cfg.rollout_dtype,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    torch.manual_seed(cfg.seed + RANK)  # after the engine, which reseeds the global RNGs at start
    random.seed(cfg.seed + RANK)
    start_step = 0
    if ckpt:
        start_step = load_checkpoint(ckpt, model, optimizer)
        print0(f"resumed from {ckpt} at step {start_step}")
    rollout.sync_weights(engine, model)  # after a resume: the engine starts from the checkpoint
    gap = engine_trainer_gap(engine, model, train_records, cfg, device)

    print0(f"train prompts: {len(train_records)} ({dropped} dropped as longer than "
           f"{cfg.max_prompt_len} tokens)")
    log, wandb_run = open_run(cfg, start_step)
    print0(f"run dir {cfg.out_dir} | {WORLD} rank(s) on {device.type} | engine {type(engine).__name__} | "
           f"method {cfg.method} delta {cfg.delta} | {cfg.train_dtype} trainer, {cfg.rollout_dtype} engine "
           f"(gap {gap:.1e} nats/token) | recompute {cfg.recompute} ({why}; {free / 2**30:.0f} GB free on {device} "
           f"per rank, least of {WORLD}, from {free_source}) | shared prompt {'on' if cfg.share_prompt else 'off'} | "
           f"packed rows {'on, ' + packed_attention_label(cfg, device) if cfg.pack else 'off'} "
           f"({pack_reason(given, cfg, device, WORLD, lens)}) | "
           f"compiled layers {'on' if cfg.compile_layers else 'off'}, head {'on' if cfg.compile_head else 'off'} | "
           f"peak RSS {peak_rss_gb():.1f} GB")

    if start_step == 0 and cfg.eval_every:
        ev = validate(engine, tokenizer, eval_sets, cfg, 0)
        if log:
            log.write(json.dumps({"step": 0, **ev}) + "\n")
            log.flush()
        print0("step 0 | " + " | ".join(f"{k} {v:.3f}" for k, v in ev.items()
                                        if k.endswith("mean@%d" % cfg.eval_n)))

    # the bar on a terminal only: in a log file its redraws would interleave with the step lines
    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps,
               disable=RANK != 0 or not sys.stderr.isatty(), desc="train", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        G = cfg.group_size
        # --- rollout ---
        prompts = prompt_batch(train_records, step, cfg)
        prompt_ids = [r["prompt_ids"] for r in prompts]
        sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                    max_new_tokens=cfg.max_new_tokens,
                                    seed=cfg.seed * 1_000_003 + step * WORLD + RANK, logprobs=True)
        completions = engine.generate(prompt_ids, G, sampling)  # len(prompts) * G, by prompt
        if ((cfg.old_logp == "engine" or cfg.rollout_is != "none")
                and any(c.logprobs is None for c in completions)):
            raise RuntimeError(f"--old-logp {cfg.old_logp} --rollout-is {cfg.rollout_is} needs the "
                               f"engine's log-probs, and {type(engine).__name__} returned none")
        engine.sleep()  # the engine gives its memory to the trainer until the weight sync
        t_rollout = time.time()

        # --- rewards and advantages ---
        rewards = train_rewards(completions, prompts, cfg, step)  # (B,), B = len(prompts) * G
        advantages = grpo.group_advantages(rewards, G,
                                           norm_by_std=cfg.norm_by_std).to(device)  # (B,)
        stats = {**grpo.group_stats(rewards, G), **grpo.reward_sums(rewards, cfg.reward_correct)}

        # --- old and reference log-probs (old: the engine's, or the trainer's when off-policy) ---
        batch = pack(prompt_ids, completions, device)
        stats["sum_update_flops"] = model_flops(model.config, n_params, *zip(*batch.spans))[0]
        old_logp = ref_logp = old_entropy = None
        if cfg.old_logp == "engine":  # the band is built around the engine's probability: no pass
            old_logp = batch.engine_logp
        elif not on_policy(cfg):  # the first mini-batch's are its own update forward's (filled in)
            old_logp, old_entropy = batch_logprobs(model, cfg, batch, with_entropy=True,
                                                   skip_first=True)
        if ref_model is not None:
            ref_logp, _ = batch_logprobs(ref_model, cfg, batch)
        t_logp = time.time()

        # --- mini-batch updates ---
        update_sums, _, grad_norm = update_policy(model, optimizer, cfg, batch, advantages,
                                                  old_logp, ref_logp, old_entropy)
        if old_entropy is not None:  # π_old complete now: its diagnostics
            stats.update(old_policy_sums(old_logp, old_entropy, batch.engine_logp, batch.mask, cfg))
        t_update = time.time()

        # --- weight sync: weights first, the KV cache once the gathered tensors are freed ---
        engine.wake_up(["weights"])
        rollout.sync_weights(engine, model)
        engine.wake_up(["kv_cache"])
        t_sync = time.time()

        # --- metrics: sums reduced over ranks, then rates; evaluation; the console line ---
        sums = all_reduce_sums({**stats, **update_sums}, device)
        times = {"rollout": (t0, t_rollout), "logprobs": (t_rollout, t_logp),
                 "update": (t_logp, t_update), "sync": (t_update, t_sync),
                 "step": (t0, time.time())}
        metrics = {"step": step + 1, **grpo.finalize_metrics(sums),
                   **timing_metrics(times, sums, peak), "update/grad_norm": grad_norm}
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps):
            metrics.update(validate(engine, tokenizer, eval_sets, cfg, step + 1))
        metrics["time/step"] = time.time() - t0  # with the evaluation
        if log:
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            if wandb_run:
                wandb_run.log(metrics, step=step + 1)
            bar.write(console_line(metrics, cfg))

        # --- checkpoint ---
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.max_steps:
            save_checkpoint(cfg.out_dir, step + 1, model, optimizer, cfg)
            if cfg.keep_checkpoints and RANK == 0:
                # a folder that cannot be deleted costs disk, not the run (the other ranks go on)
                try:
                    prune_checkpoints(cfg.out_dir, cfg.keep_checkpoints)
                except OSError as e:
                    print0(f"warning: could not delete an old checkpoint: {e}")

    if cfg.export_hf:
        export_hf(cfg.out_dir, model, tokenizer)
        print0(f"exported {os.path.join(cfg.out_dir, 'hf')}")
    if log:
        log.close()
    if wandb_run:
        wandb_run.finish()
    # after our last collective: vLLM adopted the default process group and tears it down here
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

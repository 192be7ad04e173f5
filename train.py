"""BandPO / GRPO training with torchrun + FSDP2: `torchrun --nproc_per_node 2 train.py --method bandkl --delta 0.05`.

The objective of shared/PAPER.md §3: GRPO group advantages, the clipped surrogate with per-token bounds
[r̲(p), r̄(p)] from band.ratio_bounds (Band-KL/TV/χ², or the clip / clip-higher / DCPO baselines), dual clip c = 10,
"seq-mean-token-mean" aggregation, optional low-variance KL to a frozen reference. One step:

    sample prompts -> rollout n completions each (vLLM or HF) -> rewards -> group advantages
    -> old log-probs recomputed by the trainer (no grad, fp32; the engine's log-probs are not trusted)
    -> reference log-probs (if kl_coef > 0) -> ratio_bounds(old_logp) -> mini-batch updates with exactly
    normalised micro-batch accumulation -> weight sync into the engine -> metrics -> eval -> checkpoint

Usage (the defaults are the embedded tiny model on the synthetic arithmetic task, CPU, a few minutes):

    torchrun --nproc_per_node 2 train.py --method bandkl --delta 0.05
    torchrun --nproc_per_node 2 train.py --method clip --max-steps 40 --out-dir runs/grpo
    torchrun --nproc_per_node 2 train.py --resume runs/grpo          # continue a run from its last checkpoint
    python train.py --help                                              # every Config field is a flag

Departures from the authors' verl recipe, on purpose:
- Rollout and training alternate on the same ranks (colocated), one vLLM engine per rank with TP = 1.
- The paper's batch shape is 256 prompts x 16 samples with mini-batches of 64 prompts (4 optimizer steps per
  rollout, so the bounds act from the second mini-batch on). The tiny default keeps that ratio at a smaller size:
  32 prompts x 8 samples, mini-batches of 8 prompts. recipes/ has the paper's numbers.
- The tiny default uses lr 1e-4 (not 1e-6) and no KL term: a 0.8 M-parameter model needs larger steps.
"""

import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import band
import grpo


@dataclass
class Config:
    # --- method (shared/PAPER.md §2-3) ---
    method: str = "bandkl"            # band.ratio_bounds method: clip, clip-higher, dcpo, bandkl, bandtv, bandchi2, ...
    delta: float = 0.05               # f-divergence radius of the Band trust region (not TRL's ratio cap)
    eps_low: float = -1.0             # clip/dcpo lower epsilon; < 0 takes the method's default
    eps_high: float = -1.0            # clip/dcpo upper epsilon; < 0 takes the method's default
    max_ratio: float = 10.0           # cap on the upper ratio bound (the authors' upper_bound_max)
    clip_c: float = 10.0              # dual-clip constant c for negative advantages; <= 0 turns it off
    agg: str = "seq-mean-token-mean"  # loss aggregation (grpo.policy_loss); the paper's is seq-mean-token-mean
    norm_by_std: bool = True          # GRPO's std normalisation of advantages (False: Dr. GRPO mean-centring)
    kl_coef: float = 0.0              # KL-to-reference coefficient (paper: 0.001 with low_var_kl)
    kl_kind: str = "low_var_kl"       # grpo.kl_penalty kind: k1, k2, k3, low_var_kl
    # --- model and data ---
    model: str = ""                   # HF id or local path; "" = the embedded tiny model (rollout.DEFAULT_MODEL)
    data: str = ""                    # data.load names or paths, comma separated; "" = the tiny model's own task
    eval_data: str = ""               # held-out sets, comma separated; "" = the test split of --data
    reward: str = "math-verify"       # reward.score_batch scorer: math-verify or dapo
    reward_correct: float = 1.0       # reward of a correct final answer
    reward_incorrect: float = 0.0     # reward of a wrong or missing final answer (paper: -1)
    # --- batch shape ---
    prompts_per_step: int = 32        # prompts per rollout step, all ranks together (paper: 256)
    group_size: int = 8               # completions per prompt, G (paper: 16)
    mini_batch_prompts: int = 8       # prompts per optimizer step (paper: 64)
    micro_batch_size: int = 64        # sequences per forward/backward on one rank
    max_prompt_len: int = 64          # prompts longer than this (tokens) are dropped (paper: 1024)
    max_new_tokens: int = 16          # response length limit (paper: 4096)
    temperature: float = 1.0          # rollout temperature (paper: 1.0)
    top_p: float = 1.0                # rollout top-p (paper: 1.0)
    # --- optimisation ---
    lr: float = 1e-4                  # AdamW learning rate, constant (paper: 1e-6)
    weight_decay: float = 0.0         # AdamW weight decay
    grad_clip: float = 1.0            # global grad-norm clip
    max_steps: int = 60               # rollout steps
    grad_checkpointing: bool = False  # activation checkpointing in the decoder layers
    # --- engines, logging, checkpoints ---
    rollout: str = "auto"             # rollout engine: vllm, hf, auto (vLLM when importable)
    eval_every: int = 10              # evaluate every k steps (and at step 0 and the end); 0 = never
    eval_n: int = 4                   # samples per held-out prompt (paper: 32) -> mean@n, pass@k
    eval_prompts: int = 128           # held-out prompts per evaluation (0 = all)
    save_every: int = 20              # checkpoint every k steps (and at the end); 0 = only at the end
    out_dir: str = ""                 # run directory; "" = runs/<timestamp>-<method>
    resume: str = ""                  # run directory (or checkpoint) to continue from
    seed: int = 0                     # seeds data order, sampling and initialisation of everything random
    wandb: str = ""                   # wandb project name; "" = off
    export_hf: bool = True            # save_pretrained the final model into <out_dir>/hf


def parse_config(argv=None):
    """argparse over dataclasses.fields(Config): every field is a flag (`--delta 0.05`, `--no-export-hf`)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return Config(**vars(parser.parse_args(argv)))


def resolve_config(cfg):
    """Fill the defaults that depend on other things, and check every field. Raises ValueError naming the value."""
    import data
    import rollout

    if cfg.method not in band.BOUNDS:
        raise ValueError(f"unknown --method {cfg.method!r}; valid: {', '.join(sorted(band.BOUNDS))}")
    if not (cfg.delta > 0 and math.isfinite(cfg.delta)):
        raise ValueError(f"--delta must be a finite number > 0, got {cfg.delta}")
    if cfg.agg not in grpo.AGG_MODES:
        raise ValueError(f"unknown --agg {cfg.agg!r}; valid: {', '.join(grpo.AGG_MODES)}")
    if cfg.rollout not in ("auto", "vllm", "hf"):
        raise ValueError(f"unknown --rollout {cfg.rollout!r}; valid: auto, vllm, hf")
    model = cfg.model or rollout.DEFAULT_MODEL
    if not os.path.isdir(model) and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise ValueError(f"--model {model!r}: no such directory, and not a Hugging Face id of the form org/name")
    task = cfg.data or _model_task(model)
    if not task:
        raise ValueError(f"--data is required: the model {model!r} does not name the task it was built for")
    for name in [*data.split_names(task), *data.split_names(cfg.eval_data)]:
        data.check_name(name)
    if cfg.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 for group advantages, got {cfg.group_size}")
    if cfg.prompts_per_step % cfg.mini_batch_prompts:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is not a multiple of "
                         f"--mini-batch-prompts {cfg.mini_batch_prompts}")
    out_dir = cfg.out_dir
    if cfg.resume:  # a resumed run continues in its own directory
        if not os.path.isfile(os.path.join(cfg.resume, "config.json")):
            raise ValueError(f"--resume {cfg.resume!r}: not a run directory (no config.json)")
        out_dir = cfg.resume
    if not out_dir:
        out_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + "-" + cfg.method)
    return dataclasses.replace(cfg, model=model, data=task, out_dir=out_dir)


def _model_task(model):
    """The tiny model records the task it was warm-started on in bandpo.json (make_tiny_model.py)."""
    path = os.path.join(model, "bandpo.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return json.load(f).get("task", "")


# --- distributed: a few explicit lines, the same path for 1 and N processes ---------------------------------------
RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))


def print0(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def init_distributed():
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


def all_reduce_sums(sums, device):
    """Sum a dict of scalars over ranks (one collective for the whole dict)."""
    keys = sorted(sums)
    vec = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    return dict(zip(keys, vec.tolist()))


# --- model -----------------------------------------------------------------------------------------------------
def build_model(cfg, device, trainable=True):
    """Load a causal LM and shard it with FSDP2: fully_shard each decoder layer, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device)
    if trainable and cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; plain fp32 on CPU.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def sequence_logprobs(model, input_ids, attn_mask, n_prompt, micro_batch_size, with_entropy=False):
    """Per-token log π(y_t | prefix) of the response tokens, fp32, in micro-batches. -> (B, T_resp) [, entropy]."""
    logps, ents = [], []
    for i in range(0, input_ids.shape[0], micro_batch_size):
        ids, am = input_ids[i:i + micro_batch_size], attn_mask[i:i + micro_batch_size]
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # positions count from each prompt's first real token, as in rollout
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, n_prompt - 1:-1]  # (b, T, V)
        # no .float(): token_logprobs upcasts one chunk at a time instead of copying the (b, T, V) logits
        out = grpo.token_logprobs(logits, ids[:, n_prompt:], with_entropy=with_entropy)
        logps.append(out[0] if with_entropy else out)
        if with_entropy:
            ents.append(out[1])
    logp = torch.cat(logps)
    return (logp, torch.cat(ents)) if with_entropy else logp


def pack(prompt_ids, completions, pad_id, device):
    """Left-pad prompts and right-pad responses into one (B, P + T) batch, so every response starts at column P.

    Returns input_ids (B, P+T), attention_mask (B, P+T), response mask (B, T) and P.
    """
    n_prompt = max(len(prompt_ids[c.prompt_index]) for c in completions)
    n_resp = max(1, max(len(c.token_ids) for c in completions))
    B = len(completions)
    input_ids = torch.full((B, n_prompt + n_resp), pad_id, dtype=torch.long)
    attn = torch.zeros((B, n_prompt + n_resp), dtype=torch.long)
    for b, c in enumerate(completions):
        p, r = prompt_ids[c.prompt_index], c.token_ids
        input_ids[b, n_prompt - len(p):n_prompt] = torch.tensor(p)
        input_ids[b, n_prompt:n_prompt + len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, n_prompt - len(p):n_prompt + len(r)] = 1
    return input_ids.to(device), attn.to(device), attn[:, n_prompt:].to(device, torch.float32), n_prompt


def update_policy(model, optimizer, cfg, device, input_ids, attn, mask, n_prompt, advantages, old_logp, lower, upper,
                  ref_logp=None):
    """The optimizer steps of one rollout: this rank's rows (B, ...) split into mini-batches, each into micro-batches.

    Mini-batch m is rows [m·B/M, (m+1)·B/M) of every rank, together cfg.mini_batch_prompts prompts of the world. The
    loss of a micro-batch is divided by the mini-batch's *global* sequence (or token) count, so summing over
    micro-batches and ranks gives exactly the loss of the whole mini-batch (dividing by each micro-batch's own count
    weights short micro-batches wrongly: the known accumulation bug). FSDP2 averages gradients over ranks, hence the
    factor WORLD on the loss. Returns (summed diagnostics, skipped updates, last grad norm).
    """
    clip_c = cfg.clip_c if cfg.clip_c > 0 else None
    B = input_ids.shape[0]
    n_mini = cfg.prompts_per_step // cfg.mini_batch_prompts
    per_mini = B // n_mini
    sums, skipped, grad_norm = {}, 0, torch.tensor(0.0)
    for m in range(n_mini):
        rows = range(m * per_mini, (m + 1) * per_mini)
        norms = all_reduce_sums({"tokens": mask[rows.start:rows.stop].sum().item(), "seqs": float(per_mini)}, device)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(rows.start, rows.stop, cfg.micro_batch_size):
            mb = slice(i, min(i + cfg.micro_batch_size, rows.stop))
            logp = sequence_logprobs(model, input_ids[mb], attn[mb], n_prompt, cfg.micro_batch_size)  # (b, T)
            loss, mets = grpo.policy_loss(logp, old_logp[mb], advantages[mb], mask[mb], lower[mb], upper[mb],
                                          clip_c=clip_c, agg=cfg.agg, num_tokens=norms["tokens"],
                                          num_seqs=norms["seqs"], max_len=cfg.max_new_tokens)
            if ref_logp is not None:
                kl = grpo.kl_penalty(logp, ref_logp[mb], cfg.kl_kind)  # (b, T)
                loss = loss + cfg.kl_coef * (kl * mask[mb]).sum() / norms["tokens"]
                mets["kl/ref_sum"] = (kl.detach() * mask[mb]).sum().double()
            (loss * WORLD).backward()
            total += loss.item()
            for k, v in mets.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # A NaN loss can still have finite gradients (clamp passes none through a NaN), so both are checked; the
        # verdict is summed over ranks and the norm is global, so every rank takes the same branch.
        bad = all_reduce_sums({"bad": float(not math.isfinite(total))}, device)["bad"]
        if bad == 0 and torch.isfinite(grad_norm):
            optimizer.step()
        else:  # a non-finite loss or gradient never reaches the weights
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            print0(f"non-finite loss/gradient in mini-batch {m} (loss {total}): update skipped")
    return sums, skipped, float(grad_norm)


# --- checkpoints: torch.distributed.checkpoint, atomic (write to a temporary name, then rename) ----------------------
def save_checkpoint(run_dir, step, model, optimizer, cfg):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    if RANK == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, os.path.join(tmp, f"rng_rank{RANK}.pt"))
    dist.barrier()
    if RANK == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "data_position": step * cfg.prompts_per_step, "world_size": WORLD,
                       "config": dataclasses.asdict(cfg)}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # the checkpoint exists only once it is complete
    dist.barrier()


def latest_checkpoint(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")) \
        if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def load_checkpoint(path, model, optimizer):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["world_size"] != WORLD:  # the RNG streams are per rank: a different world size cannot continue exactly
        print0(f"warning: checkpoint was written by {meta['world_size']} ranks, resuming with {WORLD}")
    rng_file = os.path.join(path, f"rng_rank{RANK}.pt")
    if os.path.isfile(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta["step"]


def export_hf(run_dir, model, tokenizer):
    """Full weights gathered to rank 0 and written with save_pretrained: transformers and vLLM load the result."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if RANK == 0:
        out = os.path.join(run_dir, "hf")
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=full)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    dist.barrier()


# --- data order: a seeded permutation per epoch, so the position in the stream is just an index ------------------
def prompt_batch(records, step, cfg):
    """The global prompts of `step` (all ranks), then this rank's contiguous share."""
    P, N = cfg.prompts_per_step, len(records)
    out = []
    for i in range(step * P, (step + 1) * P):
        epoch, j = divmod(i, N)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
        out.append(records[perm[j]])
    per_rank = P // WORLD
    return out[RANK * per_rank:(RANK + 1) * per_rank]


# --- evaluation: mean@n and pass@k on held-out prompts, sharded over ranks ---------------------------------------
def validate(engine, tokenizer, eval_sets, cfg, step):
    import eval as evaluation
    import rollout

    sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                seed=cfg.seed * 7919 + step * WORLD + RANK)
    shards = {name: recs[RANK::WORLD] for name, recs in eval_sets.items()}
    local = evaluation.evaluate(engine, tokenizer, shards, n=cfg.eval_n, sampling=sampling,
                                max_prompt_len=cfg.max_prompt_len, progress=False, scorer=cfg.reward)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {name: r["correct_counts"] for name, r in local.items()})
    metrics = {}
    for name in eval_sets:
        counts = [c for g in gathered for c in g[name]]
        summary = evaluation.summarize(counts, cfg.eval_n)
        for key, value in summary.items():
            metrics[f"eval/{name}/{key}"] = value
    return metrics


def main(argv=None):
    # --- configuration: every error here is one line and exit code 2, before any process group or engine ---
    try:
        cfg = resolve_config(parse_config(argv))
        if cfg.prompts_per_step % WORLD:
            raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} is not divisible by {WORLD} ranks")
        if cfg.resume:
            with open(os.path.join(cfg.out_dir, "config.json")) as f:
                saved = json.load(f)
            # the saved run's settings win, except the length of the run and where it goes
            cfg = dataclasses.replace(Config(**saved), max_steps=cfg.max_steps, resume=cfg.resume,
                                      out_dir=cfg.out_dir)
        import data
        # the synthetic task is unlimited: a fixed 100k problems, so the data order does not depend on --max-steps
        train_records = [r for name in data.split_names(cfg.data) for r in data.load(
            name, split="train", seed=cfg.seed, n=100_000 if name.startswith("arithmetic") else None)]
        eval_names = data.split_names(cfg.eval_data) or data.split_names(cfg.data)
        eval_sets = {n: data.load(n, split="test", n=cfg.eval_prompts or None, seed=0) for n in eval_names}
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)

    import rollout
    import reward
    import transformers
    from tqdm import tqdm
    from transformers import AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    device = init_distributed()
    torch.manual_seed(cfg.seed + RANK)
    random.seed(cfg.seed + RANK)
    run_dir = cfg.out_dir
    if RANK == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = build_model(cfg, device)
    ref_model = build_model(cfg, device, trainable=False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # the engine before the checkpoint: vLLM reseeds the global RNGs when it starts, the checkpoint restores them
    engine = rollout.make_engine(cfg.rollout, cfg.model, tokenizer=tokenizer, seed=cfg.seed + RANK,
                                 max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    start_step = 0
    ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    if ckpt:
        start_step = load_checkpoint(ckpt, model, optimizer)
        print0(f"resumed from {ckpt} at step {start_step}")
    rollout.sync_weights(engine, model)  # after a resume the engine must start from the checkpoint's weights

    prompt_ids, kept, dropped = data.tokenize_prompts(train_records, tokenizer, cfg.max_prompt_len)
    train_records = [dict(r, prompt_ids=ids) for r, ids in zip(kept, prompt_ids)]
    print0(f"train prompts: {len(train_records)} ({dropped} dropped as longer than {cfg.max_prompt_len} tokens)")
    eps = {"eps_low": cfg.eps_low if cfg.eps_low >= 0 else None,
           "eps_high": cfg.eps_high if cfg.eps_high >= 0 else None}
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if RANK == 0 and os.path.isfile(metrics_file):  # drop lines written after the checkpoint we resume from
        with open(metrics_file) as f:
            lines = [l for l in f if l.strip() and json.loads(l)["step"] <= start_step]
        with open(metrics_file + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(metrics_file + ".tmp", metrics_file)
    log = open(metrics_file, "a") if RANK == 0 else None
    wandb_run = None
    if cfg.wandb and RANK == 0:
        import wandb
        wandb_run = wandb.init(project=cfg.wandb, config=dataclasses.asdict(cfg), dir=run_dir)
    print0(f"run dir {run_dir} | {WORLD} rank(s) on {device.type} | engine {type(engine).__name__} | "
           f"method {cfg.method} delta {cfg.delta}")

    if start_step == 0 and cfg.eval_every:
        ev = validate(engine, tokenizer, eval_sets, cfg, 0)
        if log:
            log.write(json.dumps({"step": 0, **ev}) + "\n")
            log.flush()
        print0("step 0 | " + " | ".join(f"{k} {v:.3f}" for k, v in ev.items() if k.endswith("mean@%d" % cfg.eval_n)))

    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, disable=RANK != 0,
               desc="train", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        G = cfg.group_size
        # --- rollout ---
        batch = prompt_batch(train_records, step, cfg)
        prompt_ids = [r["prompt_ids"] for r in batch]
        sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                    seed=cfg.seed * 1_000_003 + step * WORLD + RANK)
        completions = engine.generate(prompt_ids, G, sampling)  # len(batch) * G, grouped by prompt
        engine.sleep()  # on GPU the engine gives its memory back to the trainer until the weight sync
        t_rollout = time.time()

        # --- rewards and advantages ---
        answers = [batch[c.prompt_index]["answer"] for c in completions]
        rewards = torch.tensor(reward.score_batch([c.text for c in completions], answers, scorer=cfg.reward,
                                                  correct=cfg.reward_correct, incorrect=cfg.reward_incorrect),
                               dtype=torch.float32)  # (B,) with B = len(batch) * G
        advantages = grpo.group_advantages(rewards, G, norm_by_std=cfg.norm_by_std).to(device)  # (B,)
        stats = {"reward/sum": rewards.sum().item(), "reward/count": float(len(rewards)),
                 "reward/correct": float((rewards == cfg.reward_correct).sum()), **grpo.group_stats(rewards, G)}

        # --- old and reference log-probs, recomputed by the trainer; the band from the old ones ---
        input_ids, attn, mask, n_prompt = pack(prompt_ids, completions, tokenizer.pad_token_id, device)
        with torch.no_grad():
            old_logp, entropy = sequence_logprobs(model, input_ids, attn, n_prompt, cfg.micro_batch_size, True)
            ref_logp = sequence_logprobs(ref_model, input_ids, attn, n_prompt, cfg.micro_batch_size) \
                if ref_model is not None else None
            lower, upper = band.ratio_bounds(old_logp, cfg.method, delta=cfg.delta, max_ratio=cfg.max_ratio, **eps)
        stats.update({"entropy/sum": (entropy * mask).sum().item(), "tokens/count": mask.sum().item(),
                      "response_length/sum": mask.sum().item(), "response_length/count": float(len(completions))})
        t_logp = time.time()

        # --- mini-batch updates ---
        loss_sums, skipped, grad_norm = update_policy(model, optimizer, cfg, device, input_ids, attn, mask, n_prompt,
                                                      advantages, old_logp, lower, upper, ref_logp)
        t_update = time.time()

        # --- weight sync into the rollout engine ---
        engine.wake_up()
        rollout.sync_weights(engine, model)
        t_sync = time.time()

        # --- metrics: sums reduced over ranks, then rates ---
        stats.update(loss_sums)
        stats["update/skipped"] = float(skipped)
        s = all_reduce_sums(stats, device)
        metrics = {"step": step + 1, **grpo.finalize_metrics(s)}
        metrics.update({
            "reward/mean": s["reward/sum"] / s["reward/count"], "reward/accuracy": s["reward/correct"] / s["reward/count"],
            "entropy": s["entropy/sum"] / max(s["tokens/count"], 1.0),
            "response_length/mean": s["response_length/sum"] / s["response_length/count"],
            "update/skipped": s["update/skipped"], "update/grad_norm": grad_norm,
            "time/rollout": t_rollout - t0, "time/logprobs": t_logp - t_rollout, "time/update": t_update - t_logp,
            "time/sync": t_sync - t_update, "time/step": time.time() - t0,
        })
        if "kl/ref_sum" in s:
            metrics["kl/ref"] = s["kl/ref_sum"] / max(s["tokens/count"], 1.0)
        metrics["tokens_per_s"] = s["tokens/count"] / metrics["time/step"]
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps):
            metrics.update(validate(engine, tokenizer, eval_sets, cfg, step + 1))
        metrics["time/step"] = time.time() - t0
        if log:
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            if wandb_run:
                wandb_run.log(metrics, step=step + 1)
            acc = next((f" | eval {v:.3f}" for k, v in metrics.items() if k.endswith(f"mean@{cfg.eval_n}")), "")
            bar.write(f"step {step + 1} | reward {metrics['reward/mean']:.3f} | entropy {metrics['entropy']:.3f} | "
                      f"clip {metrics['clip/frac']:.3f} (hi {metrics['clip/frac_upper']:.3f}) | "
                      f"low-p hi {metrics['clip/low_p_upper_rate']:.3f}{acc} | {metrics['time/step']:.1f} s")

        # --- checkpoint ---
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.max_steps:
            save_checkpoint(run_dir, step + 1, model, optimizer, cfg)

    if cfg.export_hf:
        export_hf(run_dir, model, tokenizer)
        print0(f"exported {os.path.join(run_dir, 'hf')}")
    if log:
        log.close()
    if wandb_run:
        wandb_run.finish()
    engine.close()  # after our last collective: vLLM adopted the default process group and tears it down here
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

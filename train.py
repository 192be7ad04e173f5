"""BandPO / GRPO training with torchrun + FSDP2: `torchrun --nproc_per_node 2 train.py --method bandkl --delta 0.05`.

The objective of shared/PAPER.md §3: GRPO group advantages, the clipped surrogate with per-token bounds
[r̲(p), r̄(p)] from band.ratio_bounds (Band-KL/TV/χ², or the clip / clip-higher / DCPO baselines), dual clip c = 10,
"seq-mean-token-mean" aggregation, optional low-variance KL to a frozen reference. One step:

    sample prompts -> rollout n completions each (vLLM or HF) -> rewards -> group advantages
    -> old log-probs recomputed by the trainer (no grad; the engine's are only compared: rollout/logprob_diff)
    -> reference log-probs (if kl_coef > 0) -> ratio_bounds(old_logp) -> mini-batch updates with exactly
    normalised micro-batch accumulation -> weight sync into the engine -> metrics -> eval -> checkpoint

Log-probs are those of the distribution the engine sampled from: logits / temperature, full softmax (so --top-p
must be 1). With one mini-batch per rollout the update is on-policy (π_old = π_θ): the old log-probs are the
update's own forward, detached, and the extra no-grad pass is skipped (as TRL and verl do).

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

The real-model path (SmolLM2-135M-Instruct, built by `make smollm2`, on the committed GSM8K subset):

    torchrun --nproc_per_node 2 train.py --model models/smollm2-135m-instruct --data data/gsm8k \
        --prompts-per-step 8 --group-size 4 --mini-batch-prompts 8 --micro-batch-size 8 --max-prompt-len 512 \
        --max-new-tokens 256 --lr 1e-6 --eval-prompts 64

Checkpoint save / load / export live in checkpoint.py.
"""

import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import band
import grpo
from checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint


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
    temperature: float = 1.0          # rollout temperature; log-probs use logits / temperature (paper: 1.0)
    top_p: float = 1.0                # rollout top-p; training needs 1.0 (the log-probs are of the full softmax)
    # --- optimisation ---
    lr: float = 1e-4                  # AdamW learning rate, constant (paper: 1e-6)
    weight_decay: float = 0.0         # AdamW weight decay
    grad_clip: float = 1.0            # global grad-norm clip
    max_steps: int = 60               # rollout steps
    grad_checkpointing: bool = False  # activation checkpointing in the decoder layers
    # --- engines, logging, checkpoints ---
    rollout: str = "auto"             # rollout engine: vllm, hf, auto (vLLM when importable)
    rollout_dtype: str = "auto"       # engine weights: auto = bfloat16 on CUDA, float32 on CPU; float32, bfloat16
    gpu_memory_utilization: float = 0.5  # GPU share of the vLLM engine (weights + KV cache); it sleeps in updates
    verbose: bool = False             # also show vLLM's INFO logs (or set VLLM_LOGGING_LEVEL yourself)
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
    rollout.resolve_dtype(cfg.rollout_dtype)  # raises on a bad value
    if not 0 < cfg.gpu_memory_utilization < 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1), got {cfg.gpu_memory_utilization}")
    if not (cfg.temperature > 0 and math.isfinite(cfg.temperature)):
        raise ValueError(f"--temperature must be > 0 for training (log-probs divide the logits by it), "
                         f"got {cfg.temperature}")
    if cfg.top_p != 1.0:  # π_old would be the truncated distribution, which the trainer's log-probs are not
        raise ValueError(f"--top-p must be 1.0 for training: the trainer's log-probs are those of the full softmax, "
                         f"got {cfg.top_p}")
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
    out_dir = cfg.out_dir
    if cfg.resume:  # a resumed run continues in its own directory
        if not os.path.isfile(os.path.join(cfg.resume, "config.json")):
            raise ValueError(f"--resume {cfg.resume!r}: not a run directory (no config.json)")
        out_dir = cfg.resume
    if not out_dir:
        out_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + "-" + cfg.method)
    return dataclasses.replace(cfg, model=model, data=task, out_dir=out_dir)


def _model_task(model):
    """The embedded models record their task in bandpo.json (make_tiny_model.py: "arithmetic:1,3"; make_smollm2.py:
    "data/gsm8k", a path relative to this repository, resolved here so that any working directory works)."""
    path = os.path.join(model, "bandpo.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        task = json.load(f).get("task", "")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), task)
    # as written when it resolves from here (short metric names: eval/data/gsm8k/...), else from the repository
    return here if task and not os.path.exists(task) and os.path.exists(here) else task


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


def peak_rss_gb():
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def all_reduce_sums(sums, device):
    """Sum a dict of scalars (numbers or 0-dim tensors) over ranks: one collective and one host sync for it all."""
    keys = sorted(sums)
    vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device) for k in keys])
    dist.all_reduce(vec)
    return dict(zip(keys, vec.tolist()))


# --- model -----------------------------------------------------------------------------------------------------
def build_model(cfg, device, trainable=True):
    """Load a causal LM once and shard it with FSDP2: fully_shard each decoder layer, then the root.

    Every rank builds the model with its parameters on the meta device (no memory), shards it, and allocates only
    its own shards; rank 0 alone reads the checkpoint and set_model_state_dict(broadcast_from_rank0=True) sends
    each tensor to the others, which keep their shard (the FSDP2 recipe of torchtitan and the pytorch/examples FSDP2
    example). Loading the full fp32 model on every rank first would cost a 7B model 28 GB per GPU. Buffers are not
    parameters: non-persistent ones (the rotary inverse frequencies) are in no checkpoint, so they are built for
    real (accelerate's init_empty_weights(include_buffers=False)) and put back after to_empty.
    """
    from accelerate import init_empty_weights
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model), dtype=torch.float32)
    model.tie_weights()  # from_config does not tie (from_pretrained would): lm_head = embed_tokens when configured
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    if trainable and cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; plain fp32 on CPU.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)  # this rank's shards, uninitialised: the broadcast below fills them
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    full = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).state_dict() if RANK == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    if model.config.tie_word_embeddings:  # to_empty swaps DTensor parameters in place: the tie must survive it
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "lm_head lost its tie"
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def sequence_logprobs(model, input_ids, attn_mask, n_prompt, micro_batch_size, temperature=1.0, with_entropy=False,
                      spans=None):
    """Per-token log π(y_t | prefix) of the response tokens under softmax(logits / temperature), the distribution
    the engine sampled from (verl divides the logits the same way), in micro-batches. -> (B, T) [, entropy (B, T)].

    Each micro-batch is cut to its own longest prompt and response (the step's batch is padded to the longest of
    all), and the LM head runs on the response positions only (logits_to_keep): the prompt's logits, a (b, P, V)
    tensor, are never made. Positions past a row's response hold 0 (masked out downstream).
    spans: [(prompt length, response length)] of the rows (`row_spans`); computed here (one host sync) when None.
    """
    B, T = input_ids.shape[0], input_ids.shape[1] - n_prompt
    spans = row_spans(attn_mask, n_prompt) if spans is None else spans
    logps, ents = [], []
    for i in range(0, B, micro_batch_size):
        rows = slice(i, i + micro_batch_size)
        p = max(s[0] for s in spans[rows])  # this micro-batch's longest prompt (left-padded) ...
        t = max(1, max(s[1] for s in spans[rows]))  # ... and longest response (right-padded)
        ids, am = input_ids[rows, n_prompt - p:n_prompt + t], attn_mask[rows, n_prompt - p:n_prompt + t]  # (b, p+t)
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # positions count from each prompt's first real token, as in rollout
        # the t + 1 last positions predict the response tokens and one past the end, which is dropped
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, logits_to_keep=t + 1).logits[:, :-1]
        # no .float() and no / temperature here: token_logprobs upcasts one chunk at a time, then divides by T
        out = grpo.token_logprobs(logits, ids[:, p:], with_entropy=with_entropy, temperature=temperature)  # (b, t)
        keep = am[:, p:].to(torch.float32)                                          # (b, t) 0 past each response
        out = [torch.nn.functional.pad(x * keep, (0, T - t)) for x in (out if with_entropy else (out,))]  # (b, T)
        logps.append(out[0])
        ents.extend(out[1:])
    logp = torch.cat(logps)
    return (logp, torch.cat(ents)) if with_entropy else logp


def row_spans(attn_mask, n_prompt):
    """[(prompt length, response length)] of each packed row, on the host (one sync)."""
    return torch.stack([attn_mask[:, :n_prompt].sum(-1), attn_mask[:, n_prompt:].sum(-1)], -1).tolist()


def pack(prompt_ids, completions, device):
    """Left-pad prompts and right-pad responses into one (B, P + T) batch, so every response starts at column P.

    Returns input_ids (B, P+T), attention_mask (B, P+T), response mask (B, T), P, and the engine's log-probs of the
    sampled tokens (B, T) (0 where it gave none). Padding positions hold token 0 under a zero attention mask: the
    pad id is never read, so a tokenizer without a pad token (Llama 3) needs none.
    """
    n_prompt = max(len(prompt_ids[c.prompt_index]) for c in completions)
    n_resp = max(1, max(len(c.token_ids) for c in completions))
    B = len(completions)
    input_ids = torch.zeros((B, n_prompt + n_resp), dtype=torch.long)
    attn = torch.zeros((B, n_prompt + n_resp), dtype=torch.long)
    engine_logp = torch.zeros((B, n_resp), dtype=torch.float32)
    for b, c in enumerate(completions):
        p, r = prompt_ids[c.prompt_index], c.token_ids
        input_ids[b, n_prompt - len(p):n_prompt] = torch.tensor(p)
        input_ids[b, n_prompt:n_prompt + len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, n_prompt - len(p):n_prompt + len(r)] = 1
        if c.logprobs:
            engine_logp[b, :len(r)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return (input_ids.to(device), attn.to(device), attn[:, n_prompt:].to(device, torch.float32), n_prompt,
            engine_logp.to(device))


def old_policy_sums(old_logp, entropy, engine_logp, mask):
    """Diagnostics of π_old on the sampled tokens, as sums for all_reduce_sums: the entropy, and |engine log-prob −
    trainer log-prob| (rollout/logprob_diff; TRL logs it as sampling/sampling_logp_difference). The two are the same
    distribution computed twice: a gap means mismatched temperature, stale weights or a precision problem."""
    return {"entropy/sum": (entropy * mask).sum(),
            "rollout/logprob_diff_sum": ((engine_logp - old_logp).abs() * mask).sum()}


def mini_batches(n_rows, cfg):
    """This rank's rows of each optimizer step: cfg.prompts_per_step / cfg.mini_batch_prompts equal slices (exact:
    check_batch_shape). The old-log-prob pass uses the same slices and micro-batches as the update, so both run the
    same shapes: with bf16 kernels, other shapes would round differently and the first step's ratio would not be 1."""
    n_mini = cfg.prompts_per_step // cfg.mini_batch_prompts
    per_mini = n_rows // n_mini
    return [slice(m * per_mini, (m + 1) * per_mini) for m in range(n_mini)]


def update_policy(model, optimizer, cfg, device, input_ids, attn, mask, n_prompt, advantages, old_logp=None,
                  ref_logp=None, engine_logp=None):
    """The optimizer steps of one rollout: this rank's rows (B, ...) split into mini-batches, each into micro-batches.

    Mini-batch m is rows [m·B/M, (m+1)·B/M) of every rank, together cfg.mini_batch_prompts prompts of the world
    (check_batch_shape makes the split exact). The loss of a micro-batch is divided by the mini-batch's *global*
    sequence (or token) count, so summing over micro-batches and ranks gives exactly the loss of the whole
    mini-batch (dividing by each micro-batch's own count weights short micro-batches wrongly: the known accumulation
    bug). FSDP2 averages gradients over ranks, hence the factor WORLD on the loss. The band [lower, upper] is
    ratio_bounds of the old log-probs, per micro-batch.
    old_logp None = on-policy (a single mini-batch): π_old is π_θ before the step, i.e. this forward's own log-probs,
    detached (ratio 1), and the entropy and rollout/logprob_diff are measured here instead of in a separate pass.
    Host syncs: one per update (the rows' lengths) and one per mini-batch (the skip decision); diagnostics stay on
    the device until the step's single all_reduce_sums.
    Returns (summed diagnostics as 0-dim tensors, skipped updates, last grad norm).
    """
    clip_c = cfg.clip_c if cfg.clip_c > 0 else None
    eps = {"eps_low": cfg.eps_low if cfg.eps_low >= 0 else None,
           "eps_high": cfg.eps_high if cfg.eps_high >= 0 else None}
    minis, on_policy = mini_batches(input_ids.shape[0], cfg), old_logp is None
    if on_policy and len(minis) > 1:
        raise ValueError("old_logp is required when a rollout feeds several mini-batches (off-policy)")
    sums, skipped, grad_norm = {}, 0, torch.tensor(0.0)
    spans = row_spans(attn, n_prompt)  # the micro-batches' trimmed widths: one host sync for the whole update
    for m, rows in enumerate(minis):
        per_mini = rows.stop - rows.start
        n_tokens = mask[rows].sum()  # (), summed over ranks below: the global normaliser Z
        dist.all_reduce(n_tokens)
        n_seqs = float(per_mini * WORLD)
        norm = dict(num_tokens=n_tokens, num_seqs=n_seqs, max_len=cfg.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(rows.start, rows.stop, cfg.micro_batch_size):
            mb = slice(i, min(i + cfg.micro_batch_size, rows.stop))
            out = sequence_logprobs(model, input_ids[mb], attn[mb], n_prompt, cfg.micro_batch_size,
                                    cfg.temperature, with_entropy=on_policy, spans=spans[mb])
            logp = out[0] if on_policy else out                                     # (b, T)
            old = logp.detach() if on_policy else old_logp[mb]                      # (b, T)
            lower, upper = band.ratio_bounds(old, cfg.method, delta=cfg.delta, max_ratio=cfg.max_ratio, **eps)
            loss, mets = grpo.policy_loss(logp, old, advantages[mb], mask[mb], lower, upper, clip_c=clip_c,
                                          agg=cfg.agg, **norm)
            if ref_logp is not None:  # aggregated like the policy loss (the authors' recipe), not a token mean
                kl = grpo.kl_penalty(logp, ref_logp[mb], cfg.kl_kind)              # (b, T)
                loss = loss + cfg.kl_coef * grpo.aggregate(kl, mask[mb], cfg.agg, **norm)
                mets["kl/ref_sum"] = (kl.detach() * mask[mb]).sum().double()
            if on_policy:
                mets.update(old_policy_sums(old, out[1], engine_logp[mb] if engine_logp is not None else old,
                                            mask[mb]))
            (loss * WORLD).backward()
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
            print0(f"non-finite loss/gradient in mini-batch {m} (loss {total.item()}): update skipped")
    return sums, skipped, float(grad_norm)


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
EVAL_SEED_OFFSET = 1 << 40  # evaluation's sampling seeds never coincide with a training rollout's
def validate(engine, tokenizer, eval_sets, cfg, step):
    import eval as evaluation
    import rollout

    sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                seed=cfg.seed * 7919 + step * WORLD + RANK + EVAL_SEED_OFFSET)
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
        if cfg.resume:
            with open(os.path.join(cfg.out_dir, "config.json")) as f:
                saved = json.load(f)
            # the saved run's settings win, except the length of the run and where it goes
            cfg = dataclasses.replace(Config(**saved), max_steps=cfg.max_steps, resume=cfg.resume,
                                      out_dir=cfg.out_dir)
        check_batch_shape(cfg, WORLD)  # the shape that will run: a resumed run's own, on this world size
        import data
        # the synthetic task is unlimited: a fixed 100k problems, so the data order does not depend on --max-steps
        train_records = [r for name in data.split_names(cfg.data) for r in data.load(
            name, split="train", seed=cfg.seed, n=100_000 if name.startswith("arithmetic") else None)]
        eval_names = data.split_names(cfg.eval_data) or data.split_names(cfg.data)
        eval_sets = {n: data.load(n, split="test", n=cfg.eval_prompts or None, seed=0) for n in eval_names}
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)

    # A quiet console: the start-up summary, one line per step, the bar, and warnings that matter. vLLM logs ~6 INFO
    # lines per weight sync; --verbose (or VLLM_LOGGING_LEVEL=INFO) brings them back. Set before vLLM is imported.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if cfg.verbose else "WARNING")
    import rollout
    import reward
    import transformers
    from tqdm import tqdm
    from transformers import AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    if not cfg.verbose:
        transformers.utils.logging.set_verbosity_error()
    device = init_distributed()
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
                                 dtype=cfg.rollout_dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    torch.manual_seed(cfg.seed + RANK)  # after the engine, which reseeds the global RNGs when it starts
    random.seed(cfg.seed + RANK)
    start_step = 0
    ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    if ckpt:
        start_step = load_checkpoint(ckpt, model, optimizer)
        print0(f"resumed from {ckpt} at step {start_step}")
    rollout.sync_weights(engine, model)  # after a resume the engine must start from the checkpoint's weights

    prompt_ids, kept, dropped = data.tokenize_prompts(train_records, tokenizer, cfg.max_prompt_len)
    train_records = [dict(r, prompt_ids=ids) for r, ids in zip(kept, prompt_ids)]
    print0(f"train prompts: {len(train_records)} ({dropped} dropped as longer than {cfg.max_prompt_len} tokens)")
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
           f"method {cfg.method} delta {cfg.delta} | peak RSS {peak_rss_gb():.1f} GB")

    if start_step == 0 and cfg.eval_every:
        ev = validate(engine, tokenizer, eval_sets, cfg, 0)
        if log:
            log.write(json.dumps({"step": 0, **ev}) + "\n")
            log.flush()
        print0("step 0 | " + " | ".join(f"{k} {v:.3f}" for k, v in ev.items() if k.endswith("mean@%d" % cfg.eval_n)))

    # the bar on a terminal only: in a log file its redraws would interleave with the step lines
    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps,
               disable=RANK != 0 or not sys.stderr.isatty(), desc="train", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        G = cfg.group_size
        # --- rollout ---
        batch = prompt_batch(train_records, step, cfg)
        prompt_ids = [r["prompt_ids"] for r in batch]
        sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                    seed=cfg.seed * 1_000_003 + step * WORLD + RANK, logprobs=True)
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

        # --- old and reference log-probs, recomputed by the trainer (old: only off-policy, see update_policy) ---
        input_ids, attn, mask, n_prompt, engine_logp = pack(prompt_ids, completions, device)
        old_logp = ref_logp = None
        minis, spans = mini_batches(input_ids.shape[0], cfg), row_spans(attn, n_prompt)

        def logprobs(m, with_entropy=False):  # the update's mini-batch and micro-batch slices: the same shapes
            outs = [sequence_logprobs(m, input_ids[r], attn[r], n_prompt, cfg.micro_batch_size, cfg.temperature,
                                      with_entropy, spans[r]) for r in minis]
            return tuple(map(torch.cat, zip(*outs))) if with_entropy else torch.cat(outs)

        with torch.no_grad():
            if len(minis) > 1:  # several optimizer steps per rollout: off-policy, π_old needs its own pass
                old_logp, entropy = logprobs(model, with_entropy=True)
                stats.update(old_policy_sums(old_logp, entropy, engine_logp, mask))
            if ref_model is not None:
                ref_logp = logprobs(ref_model)
        stats.update({"tokens/count": mask.sum(), "response_length/count": float(len(completions))})
        t_logp = time.time()

        # --- mini-batch updates ---
        loss_sums, skipped, grad_norm = update_policy(model, optimizer, cfg, device, input_ids, attn, mask, n_prompt,
                                                      advantages, old_logp, ref_logp, engine_logp)
        t_update = time.time()

        # --- weight sync into the rollout engine: weights first, the KV cache once the gathered tensors are gone ---
        engine.wake_up(["weights"])
        rollout.sync_weights(engine, model)
        engine.wake_up(["kv_cache"])
        t_sync = time.time()

        # --- metrics: sums reduced over ranks, then rates ---
        stats.update(loss_sums)
        stats["update/skipped"] = float(skipped)
        s = all_reduce_sums(stats, device)
        metrics = {"step": step + 1, **grpo.finalize_metrics(s)}
        metrics.update({
            "reward/mean": s["reward/sum"] / s["reward/count"], "reward/accuracy": s["reward/correct"] / s["reward/count"],
            "entropy": s["entropy/sum"] / max(s["tokens/count"], 1.0),
            "rollout/logprob_diff": s["rollout/logprob_diff_sum"] / max(s["tokens/count"], 1.0),
            "response_length/mean": s["tokens/count"] / s["response_length/count"],
            "update/skipped": s["update/skipped"], "update/grad_norm": grad_norm,
            "time/rollout": t_rollout - t0, "time/logprobs": t_logp - t_rollout, "time/update": t_update - t_logp,
            "time/sync": t_sync - t_update, "time/step": time.time() - t0,
        })
        metrics["loss"] = s["loss/sum"] / (cfg.prompts_per_step // cfg.mini_batch_prompts)  # mean over mini-batches
        if "kl/ref_sum" in s:
            metrics["kl/ref"] = s["kl/ref_sum"] / max(s["tokens/count"], 1.0)
        metrics["tokens_per_s"] = s["tokens/count"] / metrics["time/step"]
        metrics["memory/peak_rss_gb"] = peak_rss_gb()  # rank 0's process: trainer + its colocated engine
        if device.type == "cuda":
            metrics["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
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

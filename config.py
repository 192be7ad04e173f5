"""The run's configuration: one dataclass whose every field is a train.py flag, and the one place
its defaults are decided.

`Config` is the CleanRL pattern (STYLE): a field with a one-line comment per hyperparameter, turned
into argparse flags by `parse_config`; `resolve_config` fills every default that depends on
something else (the method's epsilons of docs/paper.md §2, the dtypes, the run directory) and checks
every field, raising ValueError naming the value. Activation checkpointing, which depends on the
device's free memory and on the data's prompt lengths, is decided after the device is set and the
prompts are tokenized (decide_grad_checkpointing, with --share-prompt). Kept
apart from train.py, which re-exports these names, so that the training loop reads on its own.

    cfg = resolve_config(parse_config(["--method", "bandkl", "--delta", "0.05"]))
    cfg = resolve_config(Config(method="clip"))   # tests build a Config directly
"""

import argparse
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import time
import typing
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers import AutoConfig

import band
import data
import grpo
import reward
import rollout
from machinery.memory import (choose_recompute, free_memory, grad_checkpointing_default, largest_micro_batch,
                              update_memory)
from machinery.packed_attention import float32_attention
from machinery.precision import resolve_dtype
from policy import pack_pays, resolve_recompute


@dataclass
class Config:
    # --- method (docs/paper.md §2-3) ---
    method: str = "bandkl"            # band.BOUNDS: clip, clip-higher, noclip, dcpo, bandkl, ...
    delta: float = 0.05               # f-divergence radius of the Band (not TRL's ratio cap)
    eps_low: Optional[float] = None   # clip/dcpo lower epsilon; unset = the method's (band.EPS)
    eps_high: Optional[float] = None  # clip/dcpo upper epsilon; unset = the method's (band.EPS)
    max_ratio: float = 10.0           # cap on the upper ratio bound (the authors' upper_bound_max)
    clip_c: Optional[float] = 10.0    # dual-clip constant c for negative advantages; 0 turns it off
    agg: str = "seq-mean-token-mean"  # loss aggregation (grpo.AGG_MODES); default: the paper's
    norm_by_std: bool = True          # GRPO's std-normalised advantages (False: Dr. GRPO's)
    kl_coef: float = 0.0              # KL-to-reference coefficient (paper: 0.001 with low_var_kl)
    kl_kind: str = "low_var_kl"       # grpo.kl_penalty kind: k1, k2, k3, low_var_kl
    # --- the engine is not the trainer (docs/design.md) ---
    old_logp: str = "trainer"         # π_old: trainer (recomputed, the paper) or engine log-probs
    rollout_is: str = "none"          # correction of the engine's sampling, grpo.rollout_is_weights
    rollout_is_max: float = 3.0       # its upper cap on ρ (TRL's vllm_importance_sampling_clip_max)
    rollout_is_min: float = 0.0       # its lower bound on ρ; 0 = none (ρ > 0)
    # --- model and data ---
    model: str = ""                   # HF id or local path; "" = the tiny rollout.DEFAULT_MODEL
    data: str = ""                    # data.load names or paths, comma-separated; "" = model's task
    eval_data: str = ""               # held-out sets, comma-separated; "" = --data's test split
    reward: str = "math-verify"       # math-verify, dapo, or random[:P] (coins, no text read)
    reward_correct: float = 1.0       # reward of a correct final answer
    reward_incorrect: float = 0.0     # reward of a wrong or missing final answer (paper: -1)
    # --- batch shape ---
    prompts_per_step: int = 32        # prompts per rollout step, all ranks together (paper: 256)
    group_size: int = 8               # completions per prompt, G (paper: 16)
    mini_batch_prompts: int = 8       # prompts per optimizer step (paper: 64)
    micro_batch_size: int = 64        # sequences per forward/backward on one rank
    micro_batch_tokens: Optional[int] = None  # or rows by length, <= N padded tokens each; 0 = off; unset = auto
    pack: Optional[bool] = None       # rows end to end, no padding; unset = where the padding it removes pays
    max_prompt_len: int = 64          # prompts longer than this (tokens) are dropped (paper: 1024)
    max_new_tokens: int = 16          # response length limit (paper: 4096)
    temperature: float = 1.0          # rollout temperature; log-probs use logits / T (paper: 1.0)
    top_p: float = 1.0                # rollout top-p; training needs 1.0 (log-probs: full softmax)
    # --- optimisation ---
    lr: float = 1e-4                  # AdamW learning rate, constant (paper: 1e-6)
    weight_decay: float = 0.0         # AdamW weight decay
    grad_clip: float = 1.0            # global grad-norm clip
    max_steps: int = 60               # rollout steps
    recompute: str = "auto"           # activation recomputation: none, selective, full; auto = by memory
    grad_checkpointing: Optional[bool] = None  # alias: on = --recompute full, off = --recompute none
    compile_layers: Optional[bool] = None  # torch.compile each decoder layer; unset = where it measured faster
    compile_head: Optional[bool] = None  # torch.compile the packed fused head's chunk passes; unset = on CUDA
    share_prompt: Optional[bool] = None  # each prompt run once for its G samples; unset = where it pays
    train_dtype: str = "auto"         # compute dtype, fp32 master weights: auto = bf16 where native
    # --- engines, logging, checkpoints ---
    rollout: str = "auto"             # rollout engine: vllm, hf, auto (vLLM when importable)
    rollout_dtype: str = "auto"       # engine weights: float32, bfloat16, or auto: bf16 where native, not --train-dtype
    gpu_memory_utilization: float = 0.5  # vLLM's GPU share (weights, KV cache); sleeps in updates
    verbose: bool = False             # also show vLLM's INFO logs (or set VLLM_LOGGING_LEVEL)
    eval_every: int = 10              # evaluate every k steps, at step 0 and at the end; 0 = never
    eval_n: int = 4                   # samples per held-out prompt (paper: 32) -> mean@n, pass@k
    eval_prompts: int = 128           # held-out prompts per evaluation (0 = all)
    save_every: int = 20              # checkpoint every k steps and at the end; 0 = only at the end
    keep_checkpoints: int = 0         # keep the newest k checkpoints (~12 B/param each); 0 = all
    out_dir: str = ""                 # run directory; "" = runs/<timestamp>-<method>
    resume: str = ""                  # run directory (or checkpoint) to continue from
    seed: int = 0                     # seeds data order, sampling and everything else random
    wandb: str = ""                   # wandb project name; "" = off
    export_hf: bool = True            # save_pretrained the final model into <out_dir>/hf


def _parser(defaults=True):
    """argparse over dataclasses.fields(Config); without `defaults`, a flag not given is absent from the result."""
    parser = argparse.ArgumentParser(prog="train.py", description="BandPO / GRPO training with "
                                     "FSDP2 (docs/paper.md §3): every Config field a flag.")
    # each field's one-line comment in Config's source is its --help text
    comments = dict(re.findall(r"^    (\w+):.*?#\s*(.+)$", inspect.getsource(Config), re.M))
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        # Optional[X] -> X
        kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
        help_text = comments.get(f.name, "").replace("%", "%%")
        default = f.default if defaults else argparse.SUPPRESS
        if kind is bool:  # --x / --no-x; unset keeps the default (None: decided in resolve_config)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)
    return parser


def parse_config(argv=None):
    """argparse over dataclasses.fields(Config): every field is a flag (`--delta 0.05`,
    `--no-export-hf`)."""
    return Config(**vars(_parser().parse_args(argv)))


def given_flags(argv=None):
    """The fields whose flags `argv` names (argparse fills the others with defaults, which a resume must tell
    apart from a value asked for)."""
    return set(vars(_parser(defaults=False).parse_args(argv)))


def resolve_config(cfg):
    """Fill every default that depends on something else (the method's epsilons, the dtypes,
    activation checkpointing, the run directory), once, and check every field. Raises ValueError
    naming the value."""
    if cfg.method not in band.BOUNDS:
        raise ValueError(f"unknown --method {cfg.method!r}; "
                         f"valid: {', '.join(sorted(band.BOUNDS))}")
    if not (cfg.delta > 0 and math.isfinite(cfg.delta)):
        raise ValueError(f"--delta must be a finite number > 0, got {cfg.delta}")
    if cfg.old_logp not in ("trainer", "engine"):
        raise ValueError(f"unknown --old-logp {cfg.old_logp!r}; valid: trainer, engine")
    if cfg.rollout_is not in grpo.IS_MODES:
        raise ValueError(f"unknown --rollout-is {cfg.rollout_is!r}; "
                         f"valid: {', '.join(grpo.IS_MODES)}")
    if cfg.rollout_is != "none" and cfg.old_logp == "engine":
        raise ValueError(f"--rollout-is {cfg.rollout_is} with --old-logp engine: π_old is the "
                         f"engine's own probability there, so every weight would be 1; use "
                         f"--old-logp trainer")
    if not 0 <= cfg.rollout_is_min < 1 < cfg.rollout_is_max:
        raise ValueError(f"need 0 <= --rollout-is-min < 1 < --rollout-is-max, "
                         f"got {cfg.rollout_is_min}, {cfg.rollout_is_max}")
    if (cfg.micro_batch_tokens or 0) < 0 or (cfg.micro_batch_tokens and cfg.share_prompt):
        raise ValueError(f"--micro-batch-tokens must be >= 0 (0 = off) and cannot be combined with "
                         f"--share-prompt (whose micro-batches are whole groups), "
                         f"got {cfg.micro_batch_tokens}")
    # packing confines attention to each row; a shared prompt's G responses all attend to one copy
    # of the prompt, a tree rather than the block diagonal the packed kernels compute
    if cfg.pack and cfg.share_prompt:
        raise ValueError("--pack and --share-prompt do not combine: packed attention stays within "
                         "each row, and a shared prompt is attended by G rows; drop one of them")
    if reward.random_probability(cfg.reward) is None and cfg.reward not in ("math-verify", "dapo"):
        raise ValueError(f"unknown --reward {cfg.reward!r}; valid: math-verify, dapo, random, "
                         f"random:P")
    if cfg.agg not in grpo.AGG_MODES:
        raise ValueError(f"unknown --agg {cfg.agg!r}; valid: {', '.join(grpo.AGG_MODES)}")
    if cfg.rollout not in ("auto", "vllm", "hf"):
        raise ValueError(f"unknown --rollout {cfg.rollout!r}; valid: auto, vllm, hf")
    if cfg.train_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"unknown --train-dtype {cfg.train_dtype!r}; "
                         f"valid: auto, float32, bfloat16")
    if cfg.rollout_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"unknown --rollout-dtype {cfg.rollout_dtype!r}; "
                         f"valid: auto, float32, bfloat16")
    recompute = resolve_recompute(cfg)
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb {cfg.wandb!r} needs the wandb package: pip install wandb")
    if not 0 < cfg.gpu_memory_utilization < 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1), "
                         f"got {cfg.gpu_memory_utilization}")
    if not (cfg.temperature > 0 and math.isfinite(cfg.temperature)):
        raise ValueError(f"--temperature must be > 0 for training (log-probs divide the logits by "
                         f"it), got {cfg.temperature}")
    # π_old would be the truncated distribution, which the trainer's log-probs are not
    if cfg.top_p != 1.0:
        raise ValueError(f"--top-p must be 1.0 for training: the trainer's log-probs are those of "
                         f"the full softmax, got {cfg.top_p}")
    model = cfg.model or rollout.DEFAULT_MODEL
    if not os.path.isdir(model) and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise ValueError(f"--model {model!r}: no such directory, and not a Hugging Face id of the "
                         f"form org/name")
    task = cfg.data or data.model_task(model)
    if not task:
        raise ValueError(f"--data is required: the model {model!r} does not name the task it "
                         f"was built for")
    for name in [*data.split_names(task), *data.split_names(cfg.eval_data)]:
        data.check_name(name)
    if cfg.group_size < 2:
        raise ValueError(f"--group-size must be >= 2 for group advantages, got {cfg.group_size}")
    if cfg.keep_checkpoints < 0:
        raise ValueError(f"--keep-checkpoints must be >= 0 (0 keeps all), "
                         f"got {cfg.keep_checkpoints}")
    out_dir = cfg.out_dir
    if cfg.resume:  # a resumed run continues in its own directory
        if not os.path.isfile(os.path.join(cfg.resume, "config.json")):
            raise ValueError(f"--resume {cfg.resume!r}: not a run directory (no config.json)")
        out_dir = cfg.resume
    if not out_dir:
        out_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + "-" + cfg.method)
    # the shared-prompt forward needs the prompt's KV cache, which HF drops under activation
    # checkpointing, and micro-batches of whole groups (unset: decide_grad_checkpointing)
    if cfg.share_prompt and (recompute not in ("auto", "none") or cfg.micro_batch_size % cfg.group_size):
        raise ValueError(f"--share-prompt needs --recompute none (HF drops the KV cache under "
                         f"recomputation) and --micro-batch-size a multiple of --group-size; "
                         f"got --recompute {recompute}, micro-batch "
                         f"{cfg.micro_batch_size}, group size {cfg.group_size}")
    # every default is decided here (checkpointing once the device is set), so config.json records
    # what ran, and a resumed run keeps it
    return method_defaults(dataclasses.replace(
        cfg, model=model, data=task, out_dir=out_dir, recompute=recompute,
        grad_checkpointing=None if recompute == "auto" else recompute != "none",
        train_dtype=resolve_dtype(cfg.train_dtype), rollout_dtype=resolve_dtype(cfg.rollout_dtype)))


# Fields added after runs were saved, with the value that reproduces such a run: a config.json
# without the key was written by code that behaved so (a run from before packing existed was
# padded; one from before --recompute has its resolved grad_checkpointing, the alias).
SAVED_BEFORE = {"pack": False, "compile_layers": False, "compile_head": False, "recompute": "auto"}


def saved_config(saved):
    """The Config of a run's saved config.json (a dict): a field the run predates takes the value
    that reproduces it (SAVED_BEFORE), never today's default; an unknown key is an error naming it."""
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(saved) - names)
    if unknown:
        raise ValueError(f"saved config has unknown settings {', '.join(unknown)}")
    return Config(**{**{k: v for k, v in SAVED_BEFORE.items() if k not in saved}, **saved})


# What a resume takes from the command line where its flag is given: the run's length, its checkpoints, console,
# logging and export, and how the update spends time and memory (recomputation, packed rows, compiled layers), which
# change the order of float sums at most, never what is computed. Every other setting is the saved run's; a flag
# given with another value than the saved one is refused, naming it (a run is a function of its config).
RESUME_TAKES = ("max_steps", "keep_checkpoints", "save_every", "verbose", "wandb", "export_hf",
                "recompute", "grad_checkpointing", "pack", "compile_layers", "compile_head")


def resumed_config(argv, saved):
    """The Config that `train.py --resume RUN ...` runs: RUN's saved config.json (`saved`, a dict) with the
    RESUME_TAKES fields whose flags `argv` names. -> (Config, one line saying what it keeps and what it takes).
    Raises ValueError naming a flag that would change the run's maths."""
    cli, given = resolve_config(parse_config(argv)), given_flags(argv)
    # a config saved when -1 meant "the method's eps" reads as unset
    saved = {**saved, **{k: None for k in ("eps_low", "eps_high") if (saved.get(k) or 0) < 0}}
    own = method_defaults(saved_config(saved))
    if "out_dir" in given and os.path.abspath(parse_config(argv).out_dir) != os.path.abspath(cli.resume):
        raise ValueError(f"--out-dir {parse_config(argv).out_dir!r} with --resume {cli.resume!r}: a resumed run "
                         f"continues in its own directory")
    for name in sorted(given - set(RESUME_TAKES) - {"resume", "out_dir"}):
        if getattr(cli, name) != getattr(own, name):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cli, name)!r} with --resume: the run was saved "
                             f"with {getattr(own, name)!r}, and a resume keeps the saved run's maths (train a new "
                             f"run to change it)")
    taken = [n for n in RESUME_TAKES if n in given]
    if {"recompute", "grad_checkpointing"} & given:   # one setting under two flags: both come from the command line
        taken += [n for n in ("recompute", "grad_checkpointing") if n not in taken]
    cfg = dataclasses.replace(own, resume=cli.resume, out_dir=cli.out_dir, **{n: getattr(cli, n) for n in taken})
    if {"recompute", "grad_checkpointing", "pack", "compile_layers"} & given:
        cfg = resolve_config(cfg)   # the saved run's other settings may not combine with them (--share-prompt)
    flags = [f"--{'' if v else 'no-'}{f}" if isinstance(v, bool) else f"--{f} {v}"
             for n in RESUME_TAKES if n in given for v, f in [(getattr(cfg, n), n.replace("_", "-"))]]
    return cfg, (f"resuming {cli.resume}: the saved run's settings (config.json)"
                 + (f", and from the command line {' '.join(flags)}" if flags else ", nothing from the command line"))


def decide_grad_checkpointing(cfg, device, prompt_lens=None, explain=False):
    """--recompute auto (and --grad-checkpointing unset): the cheapest recomputation the memory
    model says fits (memory.choose_recompute; without selective under compiled layers), from the
    memory free on this rank's device once it is set, the least over all ranks, so that every rank
    decides the same, and from the longest training prompt (`prompt_lens`, the token count of every
    training prompt; None: --max-prompt-len), not the longest allowed: GSM8K's chat prompts are
    ~100-250 tokens under a 512 limit. Then --share-prompt unset (`shares_prompt_pays`).
    Then --pack unset (pack_pays, off where the shared prompt is on),
    --compile-layers unset (COMPILE_DEFAULT) and --compile-head unset (the same table).
    --micro-batch-tokens unset: with packed rows under compiled layers, the largest token budget whose update fits
    (memory.largest_micro_batch), else 0 (rows of --micro-batch-size).
    Returns (cfg with the decisions, the free bytes it used, where they were read), and with `explain` the
    recomputation's reason in words (the start-up line's). Raises ValueError where no recomputation fits under auto,
    or where --share-prompt would need checkpointing off. Needs the process group."""
    free, source = free_memory(device)
    free_t = torch.tensor(float(free), dtype=torch.float64, device=device)
    dist.all_reduce(free_t, op=dist.ReduceOp.MIN)
    free = int(free_t.item())
    longest = max(prompt_lens) if prompt_lens else None
    # unset, compiled layers yield to an explicit --recompute selective, which they cannot combine with
    compiled = (cfg.compile_layers if cfg.compile_layers is not None
                else compile_default(device) and resolve_recompute(cfg) != "selective")
    recompute = resolve_recompute(dataclasses.replace(cfg, compile_layers=compiled))
    # the memory model's inputs: packed rows have the fused head, padded ones their (rows, t + 1, V) logits (rows x
    # (t + 1) positions; under a token budget at most its tokens, in rows of one-token responses at worst)
    fused = bool(cfg.pack if cfg.pack is not None
                 else pack_pays(cfg, device, dist.get_world_size(), prompt_lens)[0] and not cfg.share_prompt)
    model_config = AutoConfig.from_pretrained(cfg.model)
    # packed rows on a CPU without AMX keep their attention's tensors in float32 (packed_attention.float32_attention)
    attention = attention_bytes(cfg, device, fused)
    # --micro-batch-tokens unset: packed under compiled layers (the fewest saved tensors), the largest budget whose
    # update fits without recomputation (or with the full recomputation asked for): larger micro-batches measured
    # faster than less recomputation (docs/gpu.md, the pack section); a budget short of the longest row, or eager or
    # padded rows: off, rows of --micro-batch-size as before
    note = ""
    if cfg.micro_batch_tokens is None:
        budget = largest_micro_batch(model_config, dtype_bytes(cfg), free, "full" if recompute == "full" else "none",
                                     compiled=True, attention_bytes=attention) if fused and compiled else 0
        budget = budget if budget >= (longest or cfg.max_prompt_len) + cfg.max_new_tokens else 0
        cfg = dataclasses.replace(cfg, micro_batch_tokens=budget)
        note = f"; micro-batches of <= {budget} tokens, the most that fit compiled" if budget else ""
    tokens = micro_batch_tokens(cfg, longest)
    rows = tokens if cfg.micro_batch_tokens else cfg.micro_batch_size
    logits = None if fused else (rows, tokens if cfg.micro_batch_tokens else rows * (cfg.max_new_tokens + 1))
    estimate = dict(fused_head=fused, logits=logits, compiled=compiled, attention_bytes=attention)
    if recompute == "auto":
        modes = ("none", "full") if compiled else ("none", "selective", "full")
        recompute, why = choose_recompute(model_config, tokens, dtype_bytes(cfg), free, modes, **estimate)
    else:
        need = update_memory(model_config, tokens, dtype_bytes(cfg), recompute, **estimate)
        why = f"as given; the update ~{need / 2**30:.1f} GiB by the memory model"
        if cfg.share_prompt and recompute != "none":
            raise ValueError(f"--share-prompt needs --recompute none, and the update "
                             f"(~{update_memory_gb(cfg, longest):.1f} GB) would not fit in half of "
                             f"the {free / 2**30:.1f} GB free on {device}: pass "
                             f"--recompute none to run it anyway, or drop --share-prompt")
    why += note
    share = cfg.share_prompt
    if share is None:
        share = (recompute == "none" and not cfg.pack
                 and shares_prompt_pays(cfg, dist.get_world_size(), prompt_lens))
    # --pack unset: where the padding it removes pays (pack_pays), unless the shared prompt, which it
    # cannot combine with, was chosen as paying
    pack = cfg.pack if cfg.pack is not None else pack_pays(cfg, device, dist.get_world_size(), prompt_lens)[0] and not share
    # --compile-head unset: where compiled layers are (the same table; it changes no memory estimate)
    head = cfg.compile_head if cfg.compile_head is not None else compile_default(device)
    return (dataclasses.replace(cfg, recompute=recompute, grad_checkpointing=recompute != "none",
                                compile_layers=compiled, compile_head=head, share_prompt=share, pack=pack),
            free, source) + ((why,) if explain else ())


# --compile-layers unset: on where compiled layers measured faster than eager ones — CUDA: 1.23x the
# same packed update eager, 0.38x its peak memory, 23 s of compilation on the first step (one H200,
# Qwen2.5-1.5B's shape; docs/gpu.md, `make gpu-check`'s section pack); a CPU pays minutes of
# compilation for a short run. The fused head's chunk functions (--compile-head) follow the same
# table: one block's ~8 float32 passes over (chunk, V) fused into a few, seconds of compilation on a
# GPU; the pack section's compiled setting measures both (its `head` phase against the eager settings')
COMPILE_DEFAULT = {"cuda": True}


def compile_default(device):
    return COMPILE_DEFAULT.get(torch.device(device).type, False)


def shares_prompt_pays(cfg, world, prompt_lens):
    """--share-prompt unset: on where it can run (no token budget, every micro-batch and every
    rank's mini-batch whole groups; the caller rules out checkpointing) and where it at least halves
    the tokens of a forward: G (p + t) packed against p + G t shared, with p the mean training
    prompt and t = --max-new-tokens. At 2.4x fewer tokens it measured 1.79x faster
    (docs/benchmarks.md, the shared-prompt forward); a second model call per micro-batch and the
    repeated cache make smaller savings not worth it (the tiny model's short prompts)."""
    G, per_rank = cfg.group_size, cfg.prompts_per_step // world * cfg.group_size
    per_mini = per_rank // max(1, cfg.prompts_per_step // cfg.mini_batch_prompts)
    if cfg.micro_batch_tokens or cfg.micro_batch_size % G or per_mini % G or not prompt_lens:
        return False
    p, t = sum(prompt_lens) / len(prompt_lens), cfg.max_new_tokens
    return G * (p + t) >= 2 * (p + G * t)


def dtype_bytes(cfg):
    return 2 if cfg.train_dtype == "bfloat16" else 4


def attention_bytes(cfg, device, packed):
    """Bytes per element of what the attention keeps for its backward: 4 where packed rows on `device` compute a bf16
    run's attention in float32 (packed_attention.float32_attention), else the compute dtype's."""
    bf16 = cfg.train_dtype == "bfloat16"  # unresolved ("auto"): sized as float32, as dtype_bytes does
    return 4 if packed and float32_attention(device, torch.bfloat16 if bf16 else torch.float32) else dtype_bytes(cfg)


def update_fits(cfg, free, longest_prompt, device):
    """The memory test: whether the update without checkpointing fits in half of `free` bytes on `device`
    (memory.grad_checkpointing_default). Decides whether train.keep_freed_memory keeps the heap."""
    return not grad_checkpointing_default(AutoConfig.from_pretrained(cfg.model),
                                          micro_batch_tokens(cfg, longest_prompt), dtype_bytes(cfg),
                                          free, attention_bytes(cfg, device, cfg.pack))


def update_memory_gb(cfg, longest_prompt=None):
    """The update's memory estimate without checkpointing (memory.update_memory), in GB."""
    return update_memory(AutoConfig.from_pretrained(cfg.model),
                         micro_batch_tokens(cfg, longest_prompt), dtype_bytes(cfg)) / 2**30


def micro_batch_tokens(cfg, longest_prompt=None):
    """The most tokens a micro-batch can hold: rows x longest row, or the token budget (a row
    longer than the budget is a micro-batch of its own). Padded tokens, or with --pack real ones:
    a packed micro-batch's memory is that of its real tokens, and its fused head keeps no logits,
    so the same bound decides recomputation for both. longest_prompt: the data's longest prompt in
    tokens; None: --max-prompt-len."""
    longest = (longest_prompt or cfg.max_prompt_len) + cfg.max_new_tokens
    return max(cfg.micro_batch_tokens, longest) if cfg.micro_batch_tokens \
        else cfg.micro_batch_size * longest


def method_defaults(cfg):
    """The method's published epsilons where unset (band.EPS; None for methods without), no dual
    clip where --clip-c <= 0."""
    eps_low, eps_high = band.EPS.get(cfg.method, (None, None))
    return dataclasses.replace(cfg, eps_low=eps_low if cfg.eps_low is None else cfg.eps_low,
                               eps_high=eps_high if cfg.eps_high is None else cfg.eps_high,
                               clip_c=(cfg.clip_c if cfg.clip_c is not None and cfg.clip_c > 0
                                       else None))

"""The clip's mechanism one update at a time: paired branches of a training trajectory.

The paper (docs/paper.md §3; arXiv 2603.04918 §3) argues causally: the fixed clip caps the rise of rare
positive-advantage tokens, which drains the entropy; Band's wider bounds for rare tokens keep it. Here
that is measured per rollout. A base trajectory trains as train.py does (same rollouts, rewards,
advantages, policy.update_policy). At every k-th rollout (a branch point) the weights, AdamW state and
RNGs are snapshot, a fresh probe is sampled from the current policy on held-out prompts, and each arm
is restored and given that one rollout's optimizer steps (same batch, advantages, old log-probs). Per
arm and branch (one line of pairs.jsonl, keys below): the entropy change on the probe (teacher-forced),
the same re-weighted by sequence importance weights (what a rollout of the new policy would log), the
change on the rollout's own tokens, KL(old || new) on the probe, and the token anatomy (old-probability
bin x advantage sign). Then the base trajectory advances by its own method's arm, exactly as train.py.

Checks built in: every arm's first mini-batch ratio is exactly 1 (the restore worked; the old
log-probs are one no-grad pass over all rows), and at each seed's first branch point the first arm is
run twice and must give the same readings bit for bit. Arms: any band.BOUNDS method (its published
eps, --delta for the bands), `clip-upper` (the clip's upper side alone: lower bound 0, as no-clip),
`clip-lower` (its lower side alone: upper bound --max-ratio, as no-clip), `noclip-matched` (no clip at
learning rate x --matched-lr: AdamW's step scales with lr, so it takes a step as large as the clip's,
in KL, without the clip's per-token shape) and `noclip@F` (no clip at lr x F, the pilot that sets F).
Config flags this script cannot honour (--kl-coef > 0, --old-logp engine, ... `REFUSED`) are refused.

    python experiments/drift.py --seeds 0,1 --branches 60 --out runs/drift-toy \\
        -- --lr 1e-4 --mini-batch-prompts 2 --train-dtype float32     # flags after -- go to Config
    python experiments/drift.py --resume ...   # continue: the same command (a seed resumes only as it began)
    python experiments/drift.py --minutes 10 --skip-merged PAIRS_GZ ...   # whole seeds in 10 min, new ones only
    python experiments/drift.py --analyse runs/drift-toy   # drift_report.py: drift.md and the figure
    python experiments/drift.py --out runs/drift-toy --branches 60 \
        --merge-into experiments/results/drift-toy/pairs.jsonl.gz   # finished seeds into the committed file

Departures from train.py: the HF engine by default (its generate is cheap on the tiny model and
needs no vLLM start), generating with the trainer's own module where the dtypes agree on one rank
(shares_engine: no second copy of the weights), no evaluation, one checkpoint per branch point (for
--resume). On SmolLM2 (`-- --model models/smollm2-135m-instruct`, a smaller probe) memory is what
limits a CPU: the probe's logits stay in the model's dtype and are widened to float64 a chunk of
rows at a time, the new ones computed a micro-batch at a time (probe_readings), and the state the
arms restore from (weights and AdamW moments, 1.6 GB in float32) is kept in a file, not on the
heap (snapshot; any snapshot over SNAPSHOT_RAM_BYTES).
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import sys
import time

START = time.time()  # before the heavy imports: --minutes counts them

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import band  # noqa: E402
import data  # noqa: E402
import grpo  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from config import method_defaults, parse_config, resolve_config  # noqa: E402
from logprobs import pack  # noqa: E402
from machinery.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint  # noqa: E402
from machinery.jsonl import read_appended  # noqa: E402

ARMS = ("clip", "noclip", "bandkl", "clip-upper", "clip-higher", "clip-lower",
        "noclip-matched")  # the protocol's arms
MATCHED_LR = 0.76  # noclip-matched's lr factor f, fixed from a pilot (experiments/results/drift-toy/plan.md)
PROBE_SEED_OFFSET = 1 << 41  # probe sampling seeds never meet a rollout's or an evaluation's (1 << 40)
P_EDGES = (0.0, 0.05, 0.2, 0.5, 0.8, 1.0)  # anatomy bins of the old probability; last one closed
SIGNS = ("+", "-", "0")  # advantage sign of a token's response
PROBE_CHUNK_BYTES = 1 << 24  # float64 working set per distribution of one chunk of probe rows (16 MiB)
SNAPSHOT_RAM_BYTES = 1 << 28  # a larger snapshot (weights + AdamW moments) is kept in a file
TRAIN_DEFAULTS = ["--method", "clip", "--reward", "random", "--rollout", "hf", "--eval-every", "0",
                  "--no-export-hf", "--save-every", "0"]  # before the user's flags, which win
# Config fields this script does not honour: set to anything but the value it runs with (TRAIN_DEFAULTS
# over Config's defaults), the flag is refused before a model or an engine starts. Every other field is
# read as train.py reads it (tests/test_drift.py checks that the two lists cover Config).
REFUSED = {
    "kl_coef": "no reference model is built: every arm is the policy loss alone",
    "old_logp": "π_old is the trainer's no-grad pass over all rows (the restore check reads its ratio 1)",
    "eps_low": "each arm takes its method's published eps (clip-upper / clip-lower set one side)",
    "eps_high": "each arm takes its method's published eps (clip-upper / clip-lower set one side)",
    "max_steps": "the trajectory is --branches x --every rollouts",
    "seed": "the trajectories are --seeds",
    "out_dir": "the run directory is --out",
    "resume": "drift.py's own --resume continues a run",
    "eval_every": "no evaluation runs", "eval_n": "no evaluation runs", "eval_prompts": "no evaluation runs",
    "save_every": "a checkpoint is written at every branch point",
    "keep_checkpoints": "one checkpoint per seed is kept", "export_hf": "no model is exported",
    "wandb": "no wandb logging", "verbose": "the engine's logs are not configured here",
    "gpu_memory_utilization": "the engine is built without it",
}
# kl_kind acts only with --kl-coef > 0: inert, as in train.py
HONOURED = ("method", "delta", "max_ratio", "clip_c", "agg", "norm_by_std", "kl_kind", "rollout_is",
            "rollout_is_max", "rollout_is_min", "model", "data", "eval_data", "reward", "reward_correct",
            "reward_incorrect", "prompts_per_step", "group_size", "mini_batch_prompts", "micro_batch_size",
            "micro_batch_tokens", "pack", "max_prompt_len", "max_new_tokens", "temperature", "top_p", "lr",
            "weight_decay", "grad_clip", "grad_checkpointing", "share_prompt", "train_dtype", "rollout",
            "rollout_dtype", "recompute", "compile_layers")


def refused_flag(rest):
    """The first flag among `rest` (train.py's) that this script would silently ignore, as
    '--name value', else None."""
    ours, base = parse_config(TRAIN_DEFAULTS + rest), parse_config(TRAIN_DEFAULTS)
    for name in REFUSED:
        if getattr(ours, name) != getattr(base, name):
            return f"--{name.replace('_', '-')} {getattr(ours, name)}"
    return None


# --- arms ------------------------------------------------------------------------------------------
def arm_config(cfg, arm, matched_lr=MATCHED_LR):
    """The Config an arm trains with: a band.BOUNDS method with its published eps (the base's
    --delta and --max-ratio), one side of the clip alone, or no clip at a smaller learning rate."""
    if arm in band.BOUNDS:
        return method_defaults(dataclasses.replace(cfg, method=arm, eps_low=None, eps_high=None))
    clip = method_defaults(dataclasses.replace(cfg, method="clip", eps_low=None, eps_high=None))
    if arm == "clip-upper":  # lower bound 1 - 1 = 0: no-clip's
        return dataclasses.replace(clip, eps_low=1.0)
    if arm == "clip-lower":  # upper bound 1 + (max_ratio - 1), capped at max_ratio: no-clip's
        return dataclasses.replace(clip, eps_high=cfg.max_ratio - 1)
    if arm == "noclip-matched" or arm.startswith("noclip@"):
        f = matched_lr if arm == "noclip-matched" else float(arm[len("noclip@"):])
        if not 0 < f <= 1:
            raise ValueError(f"arm {arm!r}: the lr factor must be in (0, 1], got {f}")
        return dataclasses.replace(arm_config(cfg, "noclip"), lr=cfg.lr * f)
    raise ValueError(f"unknown arm {arm!r}; valid: {', '.join(sorted(band.BOUNDS))}, clip-upper, "
                     f"clip-lower, noclip-matched, noclip@F")


def _bounds_key(cfg):
    return (cfg.method, cfg.eps_low, cfg.eps_high, cfg.delta, cfg.max_ratio, cfg.clip_c, cfg.lr)


def _set_lr(optimizer, lr):
    """AdamW's step is lr x (its moment ratio): the lr of an arm is set on the optimizer it steps
    (make_optimizer read the base's once); the snapshot does not hold it."""
    for g in optimizer.param_groups:
        g["lr"] = lr


# --- snapshot and restore ------------------------------------------------------------------------
def _local(t):
    """The tensor a rank holds: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(model, optimizer, path=None):
    """Copies of the weights, the AdamW state and the RNGs (the optimizer's own parameter objects:
    the sharded ones it steps). One rank keeps the weights it gathered for the last forward
    (policy.build_model); resharded, the parameters are the shards again, and weights written into
    them (restore) are what the next forward gathers. With `path` the tensors' bytes go to that
    file, one after another, and stay off the heap (SmolLM2's weights and moments are 1.6 GB in
    float32); restore reads them back a tensor at a time, bit for bit."""
    policy.reshard(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {i: dict(optimizer.state[p]) for i, p in enumerate(params) if p in optimizer.state}
    rng = (torch.get_rng_state(), random.getstate())
    if path is None:
        return ([p.detach().clone() for p in params],
                {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                 for i, st in state.items()}, *rng)
    tensors = [p.detach() for p in params] + [v for st in state.values() for v in st.values()
                                              if torch.is_tensor(v)]
    with open(path + ".tmp", "wb") as f:
        for t in tensors:
            f.write(memoryview(_local(t).detach().cpu().contiguous().view(-1).view(torch.uint8)
                               .numpy()))
    os.replace(path + ".tmp", path)
    layout = [(tuple(_local(t).shape), _local(t).dtype, hasattr(t, "device_mesh")) for t in tensors]
    state = {i: {k: v if not torch.is_tensor(v) else None for k, v in st.items()}
             for i, st in state.items()}  # None: the tensor's bytes are in the file
    return (path, layout), state, *rng


def _read(f, layout):
    """The next tensor of a snapshot file, as its layout entry (shape, dtype, is a DTensor) says."""
    out = torch.empty(layout[0], dtype=layout[1])
    size = out.numel() * out.element_size()
    if f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != size:
        raise RuntimeError(f"{f.name}: the snapshot file ends early")
    return out


def _like(layout, f, param):
    """A state tensor read back as its parameter holds it: AdamW's moments of an FSDP2 parameter are
    DTensors sharded as the parameter (its step count is a plain scalar)."""
    local = _read(f, layout).to(_local(param).device)
    if layout[2]:
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


@torch.no_grad()
def restore(model, optimizer, snap):
    weights, state, torch_rng, py_rng = snap
    policy.reshard(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    optimizer.state.clear()
    if isinstance(weights, tuple):  # a file: the parameters' bytes, then each state tensor's
        path, layout = weights
        shapes = iter(layout)
        with open(path, "rb") as f:
            for p in params:
                _local(p).copy_(_read(f, next(shapes)))
            for i, st in state.items():
                optimizer.state[params[i]] = {
                    k: v if v is not None else _like(next(shapes), f, params[i])
                    for k, v in st.items()}
    else:
        for p, w in zip(params, weights):
            p.copy_(w)
        for i, st in state.items():
            optimizer.state[params[i]] = {k: v.clone() if torch.is_tensor(v) else v
                                          for k, v in st.items()}
    torch.set_rng_state(torch_rng)
    random.setstate(py_rng)
    policy.reshard(model)


@contextlib.contextmanager
def recording():
    """update_policy looks policy.micro_batch_loss up at each call: wrapped, it hands back every
    micro-batch's log π at the moment of its forward (before that mini-batch's optimizer step), in
    the order of policy.plan_micro_batches."""
    seen, inner = [], policy.micro_batch_loss

    def wrapped(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen.append(out[2].detach())
        return out
    policy.micro_batch_loss = wrapped
    try:
        yield seen
    finally:
        policy.micro_batch_loss = inner


# --- readings ------------------------------------------------------------------------------------
@torch.no_grad()
def probe_logits(model, probe, cfg, rows=None):
    """Teacher-forced logits at every probe response position: (B, T, V) in the model's compute
    dtype (float32, or bf16 where the CPU has it natively), as logprobs.sequence_logprobs builds
    its positions, micro-batch by micro-batch; the whole vocabulary is kept for KL. `rows`: a slice
    of the probe (a whole number of micro-batches from a multiple of them). Never widened to
    float64 here: at SmolLM2's 49k vocabulary that copy would be gigabytes (probe_readings widens
    chunks)."""
    T, out = probe.mask.shape[1], []
    pos = (probe.attn.cumsum(-1) - 1).clamp(min=0)
    rows = rows or slice(0, len(probe))
    for i in range(rows.start, min(rows.stop, len(probe)), cfg.micro_batch_size):
        mb = slice(i, i + cfg.micro_batch_size)
        out.append(model(input_ids=probe.input_ids[mb], attention_mask=probe.attn[mb],
                         position_ids=pos[mb], logits_to_keep=T + 1).logits[:, :-1])  # (b, T, V)
    return torch.cat(out)


def _probe_positions(old, new, ids, temperature, chunk_bytes):
    """Per probe position of the rows of `old` and `new` ((b, T, V) logits): H_old, H_new,
    KL(old || new) and Δ log p of the sampled token `ids` (b, T, 1), log-softmax(logits / T) in
    float64 a chunk of rows at a time (at most `chunk_bytes` of float64 per distribution)."""
    step = max(1, chunk_bytes // (8 * old.shape[1] * old.shape[2]))
    parts = []
    for i in range(0, len(old), step):
        o = torch.log_softmax(old[i:i + step].double() / temperature, -1)   # (b, T, V) float64
        n = torch.log_softmax(new[i:i + step].double() / temperature, -1)
        po = o.exp()
        parts.append((-(po * o).sum(-1), -(n.exp() * n).sum(-1),            # (b, T) each
                      (po * (o - n)).sum(-1),
                      (n.gather(-1, ids[i:i + step]) - o.gather(-1, ids[i:i + step]))[..., 0]))
        del o, n, po
    return [torch.cat(x) for x in zip(*parts)]


def probe_readings(old, new, probe, temperature=1.0, chunk_bytes=PROBE_CHUNK_BYTES):
    """Entropy change per probe token, its importance-weighted version and KL(old || new), from the
    (B, T, V) logits before and after an arm's updates (`new`: the logits, or a function of a slice
    of probe rows that computes theirs, so that only one micro-batch of them exists at a time):
    log-softmax(logits / T) in float64, a chunk of rows at a time (at most `chunk_bytes` of float64
    per distribution), reduced per position before the next chunk. The weighted version is what a
    rollout of the new policy would log as its token-mean entropy: Σ_i w_i Σ_t H_new / Σ_i w_i n_i
    with w_i ∝ π_new(y_i) / π_old(y_i) (self-normalised), minus the old mean."""
    m = probe.mask.double()                                                  # (B, T)
    ids = probe.input_ids[:, probe.n_prompt:].unsqueeze(-1)                  # (B, T, 1)
    if callable(new):
        parts, per = [], getattr(new, "rows", len(old))
        for i in range(0, len(old), per):
            rows = slice(i, i + per)
            parts.append(_probe_positions(old[rows], new(rows), ids[rows], temperature, chunk_bytes))
        H_old, H_new, kl, dlogp = (torch.cat(x) for x in zip(*parts))       # (B, T)
    else:
        H_old, H_new, kl, dlogp = _probe_positions(old, new, ids, temperature, chunk_bytes)
    dlogp = dlogp * m
    w = torch.softmax(dlogp.sum(-1), 0)                                      # (B,) sequence weights
    n, h_old = m.sum(), (H_old * m).sum() / m.sum()
    return {"dH_probe": ((H_new - H_old) * m).sum().item() / n.item(),
            "dH_probe_is": ((w * (H_new * m).sum(-1)).sum() / (w * m.sum(-1)).sum() - h_old).item(),
            "kl": (kl * m).sum().item() / n.item(), "H_probe": h_old.item(),
            "ess": (1 / (w ** 2).sum()).item() / len(w), "probe_tokens": int(n.item())}


def anatomy(old_logp, new_logp, old_ent, new_ent, upd_logp, advantages, mask, cfg):
    """The cells of old-probability bin x advantage sign on the rollout's tokens: tokens, Σ Δlog p,
    Σ entropy change at those positions, and the tokens the arm's band clipped during its optimizer
    step, upward (Â > 0, r > upper) and downward (Â < 0, r < lower), as grpo._clip_metrics counts
    them, r taken from the forward of the token's own mini-batch (`upd_logp`)."""
    m = mask.bool()                                                          # (B, T)
    p = old_logp.exp()
    adv = advantages.unsqueeze(-1).expand_as(old_logp)                       # (B, T)
    lower, upper = band.ratio_bounds(old_logp, cfg.method, delta=cfg.delta, eps_low=cfg.eps_low,
                                     eps_high=cfg.eps_high, max_ratio=cfg.max_ratio)
    r = (upd_logp - old_logp).clamp(-20.0, 20.0).exp()
    up, down = (adv > 0) & (r > upper), (adv < 0) & (r < lower)              # (B, T)
    dlogp, dH = (new_logp - old_logp).double(), (new_ent - old_ent).double()
    cells, last = [], len(P_EDGES) - 2
    for k, (lo, hi) in enumerate(zip(P_EDGES[:-1], P_EDGES[1:])):
        in_bin = (p >= lo) & ((p < hi) if k < last else (p <= hi))
        for sign, s in zip(SIGNS, (adv > 0, adv < 0, adv == 0)):
            c = in_bin & s & m
            cells.append({"p": [lo, hi], "adv": sign, "tokens": int(c.sum()),
                          "dlogp_sum": dlogp[c].sum().item(), "dH_sum": dH[c].sum().item(),
                          "up": int((c & up).sum()), "down": int((c & down).sum())})
    return cells


# --- one rollout, as train.py ----------------------------------------------------------------------
def rollout_batch(engine, records, cfg, step, device):
    """train.py's rollout of `step`: prompts, completions, coins or scores, group advantages."""
    prompts = train.prompt_batch(records, step, cfg)
    ids = [r["prompt_ids"] for r in prompts]
    sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens,
                                seed=cfg.seed * 1_000_003 + step * train.WORLD + train.RANK,
                                logprobs=True)
    completions = engine.generate(ids, cfg.group_size, sampling)
    rewards = train.train_rewards(completions, prompts, cfg, step)
    advantages = grpo.group_advantages(rewards, cfg.group_size, norm_by_std=cfg.norm_by_std)
    return pack(ids, completions, device), advantages.to(device)


def base_update(model, optimizer, cfg, batch, advantages):
    """A rollout's updates exactly as train.py makes them (π_old's first mini-batch from the update)."""
    old_logp, old_entropy = None, None
    if not policy.on_policy(cfg):
        old_logp, old_entropy = policy.batch_logprobs(model, cfg, batch, with_entropy=True,
                                                      skip_first=True)
    policy.update_policy(model, optimizer, cfg, batch, advantages, old_logp, None, old_entropy)


def arm_update(model, optimizer, cfg, batch, advantages, old_logp, old_ent, probe, probe_old):
    """One arm's optimizer steps on the rollout from the restored state, and its readings."""
    with recording() as seen:
        sums, _, _ = policy.update_policy(model, optimizer, cfg, batch, advantages, old_logp.clone())
    if sums["sum_first_abs_dev"].item() != 0:
        raise RuntimeError(f"arm {cfg.method}: first mini-batch ratio is not exactly 1 "
                           f"(Σ|r - 1| = {sums['sum_first_abs_dev'].item():.3g}): restore failed")
    plan = policy.plan_micro_batches(len(batch), cfg, batch.spans, batch.input_ids.device)
    upd_logp = torch.zeros_like(old_logp)                                    # (B, T)
    for rows, lp in zip([mb for _, mbs in plan for mb in mbs], seen):
        upd_logp[rows] = lp
    new_logp, new_ent = policy.batch_logprobs(model, cfg, batch, with_entropy=True)
    m = batch.mask.double()
    new = functools.partial(probe_logits, model, probe, cfg)
    new.rows = cfg.micro_batch_size  # one micro-batch of the probe's new logits at a time
    out = probe_readings(probe_old, new, probe, cfg.temperature)
    out.update(dH_train=((new_ent - old_ent) * m).sum().item() / m.sum().item(),
               dlogp_train=((new_logp - old_logp) * m).sum().item() / m.sum().item(),
               H_train=(old_ent * m).sum().item() / m.sum().item(), tokens=int(m.sum().item()),
               n_upper=int(sums["n_upper"].item()), n_lower=int(sums["n_lower"].item()),
               first_abs_dev=sums["sum_first_abs_dev"].item(),
               cells=anatomy(old_logp, new_logp, old_ent, new_ent, upd_logp, advantages,
                             batch.mask, cfg))
    return out


def branch(model, optimizer, cfg, arms, batch, advantages, probe, repeat_first=False,
           matched_lr=MATCHED_LR, snapshot_path=None):
    """Every arm from the same state on the same rollout; the model ends on the base's update (its
    own arm, run last, or a separate one). snapshot_path: where the state the arms restore from is
    kept (None: in memory). -> [readings per arm]."""
    old_logp, old_ent = policy.batch_logprobs(model, cfg, batch, with_entropy=True)  # (B, T) all rows
    probe_old = probe_logits(model, probe, cfg)
    snap = snapshot(model, optimizer, snapshot_path)
    base = _bounds_key(cfg)
    configs = [arm_config(cfg, a, matched_lr) for a in arms]
    order = sorted(range(len(arms)), key=lambda i: _bounds_key(configs[i]) == base)
    runs = ([0] if repeat_first else []) + order
    out = [None] * len(arms)
    for j, i in enumerate(runs):
        restore(model, optimizer, snap)
        acfg = configs[i]
        _set_lr(optimizer, acfg.lr)
        r = arm_update(model, optimizer, acfg, batch, advantages, old_logp, old_ent, probe,
                       probe_old)
        r.update(arm=arms[i], method=acfg.method, eps_low=acfg.eps_low, eps_high=acfg.eps_high,
                 delta=acfg.delta, lr=acfg.lr)
        if repeat_first and j == 0:
            first = r
        elif out[i] is None:
            out[i] = r
        if repeat_first and j > 0 and i == 0 and r != first:
            raise RuntimeError(f"arm {arms[0]} run twice from the same state gave different readings")
    _set_lr(optimizer, cfg.lr)
    if _bounds_key(configs[order[-1]]) != base:
        restore(model, optimizer, snap)
        base_update(model, optimizer, cfg, batch, advantages)
    if snapshot_path:
        os.remove(snapshot_path)
    return out


# --- a seed's trajectory ---------------------------------------------------------------------------
def load_prompts(cfg, tokenizer, n_probe):
    """train.py's training prompts, and `n_probe` held-out probe prompts (the eval split)."""
    train_recs = [r for name in data.split_names(cfg.data) for r in data.load(
        name, split="train", seed=cfg.seed, n=100_000 if name.startswith("arithmetic") else None)]
    ids, kept, _ = data.tokenize_prompts(train_recs, tokenizer, cfg.max_prompt_len)
    names = data.split_names(cfg.eval_data) or data.split_names(cfg.data)
    probe = [r for name in names for r in data.load(
        name, split="test", seed=PROBE_SEED_OFFSET + cfg.seed,
        n=n_probe if name.startswith("arithmetic") else None)]
    pids, _, _ = data.tokenize_prompts(probe, tokenizer, cfg.max_prompt_len)
    return [dict(r, prompt_ids=i) for r, i in zip(kept, ids)], pids


def shares_engine(cfg):
    """Whether the rollouts and probes are generated with the trainer's own module instead of a copy:
    the HF engine, in the trainer's dtype, on one rank (SmolLM2's float32 copy would be 0.54 GB
    more). The same weights and the same forward: the samples a copy synced after every update
    would draw."""
    return (cfg.rollout == "hf" and cfg.rollout_dtype == cfg.train_dtype
            and train.WORLD == 1)


RESUME_FREE = ("out_dir", "resume", "keep_checkpoints", "wandb")  # Config fields a trajectory's maths ignores
SHAPING = ("arms", "every", "probe_prompts", "probe_samples", "matched_lr", "check_all")  # drift.py's own


def check_resume(run_dir, ckpt, cfg, args, device):
    """A seed continues only with the settings it began with, on the machine it began on: its checkpoint's Config
    (all but RESUME_FREE) and drift.py's flags that shape its lines (SHAPING) and the machine, kept in
    <run_dir>/drift.json (written whenever the seed starts afresh; --branches may grow). A key newer than the
    record is not compared; a seed begun by a drift.py without the record has none checked. Raises SystemExit
    naming the first difference, before a model is built."""
    path = os.path.join(run_dir, "drift.json")
    now = {**{k: getattr(args, k) for k in SHAPING}, "machine": machine(device)}
    if ckpt:
        with open(os.path.join(ckpt, "meta.json")) as f:
            saved = json.load(f)["config"]
        mine = json.loads(json.dumps(dataclasses.asdict(cfg)))
        began = {}
        if os.path.isfile(path):
            with open(path) as f:
                began = json.load(f)
        # a field newer than the record is not compared: the seed began before it existed
        for key, old, new in ([(k, saved[k], v) for k, v in mine.items() if k in saved and k not in RESUME_FREE] +
                              [(k if k == "machine" else f"--{k.replace('_', '-')}", began[k], v)
                               for k, v in now.items() if k in began]):
            if old != new:
                raise SystemExit(f"drift.py: {run_dir} began with {key} = {old!r}, not {new!r}: resume a seed "
                                 f"with the settings it began with, on its machine, or give it another --out")
    else:
        os.makedirs(run_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(now, f)
        os.replace(path + ".tmp", path)


def machine(device):
    """What ran a line: the CUDA device's name, else the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def run_seed(args, cfg, engine, tokenizer, device, bar):
    """One base trajectory with its branch points, appended to <out>/seeds/s<seed>.jsonl; resumable
    from the checkpoint written after each branch point."""
    run_dir = os.path.join(args.out, f"s{cfg.seed}")
    pairs_file = os.path.join(args.out, "seeds", f"s{cfg.seed}.jsonl")
    total = args.branches * args.every
    ckpt = latest_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    if ckpt and not args.resume:
        raise SystemExit(f"drift.py: {run_dir} exists; pass --resume to continue it")
    check_resume(run_dir, ckpt, cfg, args, device)
    n_probe = args.probe_prompts
    records, probe_ids = load_prompts(cfg, tokenizer, n_probe * args.branches)
    model = policy.build_model(cfg, device)
    optimizer = policy.make_optimizer(model, cfg)
    weights = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    snap_file = (os.path.join(run_dir, "snapshot.bin")  # weights + two AdamW moments
                 if 3 * weights > SNAPSHOT_RAM_BYTES else None)
    os.makedirs(run_dir, exist_ok=True)
    if engine is None:  # shares_engine: generate with the trainer's module, which is always current
        engine = rollout.make_engine("hf", cfg.model, model=model, tokenizer=tokenizer,
                                     dtype=cfg.rollout_dtype,
                                     max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    start = load_checkpoint(ckpt, model, optimizer) if ckpt else 0
    kept = [r for r in read_appended(pairs_file) if r["step"] < start] \
        if os.path.isfile(pairs_file) else []
    os.makedirs(os.path.dirname(pairs_file), exist_ok=True)
    with open(pairs_file + ".tmp", "w") as f:  # lines past the checkpoint are redone
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(pairs_file + ".tmp", pairs_file)
    bar.update(start)
    rollout.sync_weights(engine, model)
    for step in range(start, total):
        t0, c0 = time.time(), time.process_time()
        batch, advantages = rollout_batch(engine, records, cfg, step, device)
        if step % args.every:
            base_update(model, optimizer, cfg, batch, advantages)
        else:
            b = step // args.every  # a fresh slice of held-out prompts per branch point
            ids = [probe_ids[(b * n_probe + i) % len(probe_ids)] for i in range(n_probe)]
            sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                        max_new_tokens=cfg.max_new_tokens,
                                        seed=PROBE_SEED_OFFSET + cfg.seed * 1_000_003 + step)
            probe = pack(ids, engine.generate(ids, args.probe_samples, sampling), device)
            rows = branch(model, optimizer, cfg, args.arms, batch, advantages, probe,
                          repeat_first=step == 0 or args.check_all, matched_lr=args.matched_lr,
                          snapshot_path=snap_file)
            with open(pairs_file, "a") as f:
                for r in rows:
                    f.write(json.dumps({"seed": cfg.seed, "step": step, **r, "machine": machine(device),
                                        "time_s": time.time() - t0,
                                        "cpu_s": time.process_time() - c0}) + "\n")
        rollout.sync_weights(engine, model)
        if step % args.every == 0 or step + 1 == total:
            save_checkpoint(run_dir, step + 1, model, optimizer, cfg)
            prune_checkpoints(run_dir, 1)
        bar.update(1)
    del model, optimizer


def merge(out):
    """<out>/pairs.jsonl: every seed's lines, sorted by (seed, step), written atomically."""
    folder = os.path.join(out, "seeds")
    rows = [r for name in sorted(os.listdir(folder)) if name.endswith(".jsonl")
            for r in read_appended(os.path.join(folder, name))]
    rows.sort(key=lambda r: (r["seed"], r["step"]))
    tmp = os.path.join(out, f"pairs.jsonl.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, os.path.join(out, "pairs.jsonl"))
    return len(rows)


def _same_reading(kept, new):
    """A committed line and a new one of the same (seed, step, arm) agree on every reading the
    committed one holds (not its times or machine; a newer drift.py may add keys)."""
    return all(k in new and new[k] == v for k, v in kept.items() if k not in ("time_s", "cpu_s", "machine"))


def merge_into(out, target, branches, every):
    """Add <out>'s whole seeds (every branch point 0, every, ..., of `branches`, each with the arms of
    its first) to `target` (pairs.jsonl.gz, written gzip -n, byte-stable), atomically. A line
    already there for the same (seed, step, arm) must hold the same readings (a re-run base
    trajectory reproduces the committed one); where one differs the seed is not merged.
    -> (seeds merged, lines added, [(seed, why) not merged])."""
    import gzip
    import io
    from machinery.jsonl import jsonl_path, read_jsonl
    have = read_jsonl(target) if jsonl_path(target) else []
    index = {(r["seed"], r["step"], r["arm"]): r for r in have}
    want = set(range(0, branches * every, every))
    merged, added, skipped = [], [], []
    for name in sorted(os.listdir(os.path.join(out, "seeds"))):
        rows = read_appended(os.path.join(out, "seeds", name)) if name.endswith(".jsonl") else []
        if not rows:
            continue
        seed, arms = rows[0]["seed"], [r["arm"] for r in rows if r["step"] == rows[0]["step"]]
        got = {(r["step"], r["arm"]) for r in rows}
        if {t for t, _ in got} != want or len(got) != len(want) * len(arms):
            skipped.append((seed, f"{len(got)} of {len(want) * len(arms)} lines: not finished"))
            continue
        clash = [k for r in rows if (k := (seed, r["step"], r["arm"])) in index
                 and not _same_reading(index[k], r)]
        if clash:
            skipped.append((seed, f"{len(clash)} lines differ from the committed ones, first {clash[0]}"))
            continue
        new = [r for r in rows if (seed, r["step"], r["arm"]) not in index]
        merged.append(seed)
        added += new
    rows = sorted(have + added, key=lambda r: (r["seed"], r["step"]))  # stable: arms keep their order
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = target + f".{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, target)
    return sorted(merged), len(added), skipped


KEYS = """pairs.jsonl, one line per (seed, branch point, arm): seed; step (train.py's 0-based rollout index);
arm, method, eps_low, eps_high, delta, lr; dH_probe, dH_probe_is (entropy change per probe token, plain and
importance-weighted), kl (KL(old || new) per probe token), H_probe, ess (the weights' effective sample share);
dH_train, dlogp_train, H_train (on the rollout's tokens); tokens, n_upper, n_lower (the update's clips),
first_abs_dev (0: the restore check); cells (per old-probability bin x advantage sign: p, adv, tokens,
dlogp_sum, dH_sum, up, down); machine (the CUDA device or CPU that ran it); time_s, cpu_s. A seed resumes only
with the settings it began with.

Flags after -- are train.py's (Config); defaults here: {}"""


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help, epilog=KEYS.format(
        " ".join(TRAIN_DEFAULTS)))
    ap.add_argument("--seeds", default="0", help="base trajectories, comma-separated (the units)")
    ap.add_argument("--branches", type=int, default=60, help="branch points per trajectory")
    ap.add_argument("--every", type=int, default=1, help="rollouts from one branch point to the next")
    ap.add_argument("--arms", default=",".join(ARMS), help="band.BOUNDS methods, clip-upper, "
                    "clip-lower, noclip-matched, noclip@F (comma-separated)")
    ap.add_argument("--matched-lr", type=float, default=MATCHED_LR,
                    help="noclip-matched's learning-rate factor f (the plan's)")
    ap.add_argument("--probe-prompts", type=int, default=64, help="held-out prompts per probe")
    ap.add_argument("--probe-samples", type=int, default=4, help="samples per probe prompt")
    ap.add_argument("--check-all", action="store_true",
                    help="run the first arm twice at every branch point, not only the first")
    ap.add_argument("--out", default="runs/drift", help="run directory: pairs.jsonl, seeds/, s<seed>/")
    ap.add_argument("--resume", action="store_true", help="skip finished (seed, step), continue")
    ap.add_argument("--skip-merged", metavar="PAIRS_GZ", help="leave out the --seeds this pairs file holds already "
                    "(a fresh machine adding seeds to the committed results)")
    ap.add_argument("--minutes", type=float, help="whole seeds within N minutes (a machine lent for N): start a "
                    "seed only where the longest one so far would still end in time; the first always starts")
    ap.add_argument("--merge-into", metavar="PAIRS_GZ", help="add --out's finished seeds (all --branches "
                    "branch points) to this pairs.jsonl.gz, and train nothing")
    ap.add_argument("--analyse", metavar="PAIRS", help="write the report of a pairs.jsonl (or run "
                    "directory) with drift_report.py, and train nothing")
    args = ap.parse_args(ours)
    if args.minutes is not None and not args.minutes > 0:
        ap.error(f"--minutes must be above 0, got {args.minutes:g}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.arms = [a for a in args.arms.split(",") if a]
    return args, rest


def main(argv=None):
    args, rest = parse_args(argv)
    if args.analyse:
        import drift_report
        return drift_report.main([args.analyse] + rest)
    if args.merge_into:
        seeds, n, skipped = merge_into(args.out, args.merge_into, args.branches, args.every)
        print(f"{args.merge_into}: {n} lines added; whole seeds in {args.out} (their lines already there kept): "
              f"{seeds}; not merged: {skipped or 'none'}")
        return
    if args.skip_merged:
        from machinery.jsonl import jsonl_path, read_jsonl
        found = jsonl_path(args.skip_merged)
        have = {r["seed"] for r in read_jsonl(found)} if found else set()
        done = [s for s in args.seeds if s in have]
        args.seeds = [s for s in args.seeds if s not in have]
        print(f"drift.py: seeds {done or 'none'} are in {args.skip_merged} already"
              f"{'' if found else ' (no such file yet)'}; running {args.seeds or 'none'}", file=sys.stderr)
        if not args.seeds:
            return
    refused = refused_flag(rest)
    if refused:  # one line, before a model or an engine starts
        name = refused.split()[0][2:].replace("-", "_")
        print(f"drift.py: {refused} is not honoured here ({REFUSED[name]}); drop it", file=sys.stderr)
        sys.exit(2)
    cfg = resolve_config(parse_config(TRAIN_DEFAULTS + rest))
    for arm in args.arms:
        arm_config(cfg, arm, args.matched_lr)  # unknown arms fail before anything starts
    policy.check_batch_shape(cfg, 1)
    os.makedirs(args.out, exist_ok=True)
    import transformers
    from transformers import AutoTokenizer
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = train.init_distributed()
    cfg, _, _ = train.decide_grad_checkpointing(cfg, device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    # the HF engine generates with each seed's trainer module where it can (run_seed): no second copy
    engine = None if shares_engine(cfg) else rollout.make_engine(
        cfg.rollout, cfg.model, tokenizer=tokenizer, seed=cfg.seed, dtype=cfg.rollout_dtype,
        max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    total = len(args.seeds) * args.branches * args.every
    with tqdm(total=total, desc="rollouts", dynamic_ncols=True,
              mininterval=1 if sys.stderr.isatty() else 60) as bar:
        longest = 0.0
        for i, seed in enumerate(args.seeds):  # --minutes counts from the process's start (START), imports too
            if args.minutes is not None and i and time.time() - START + longest > 60 * args.minutes:
                print(f"drift.py: {time.time() - START:.0f} s gone, the longest seed took {longest:.0f} s: "
                      f"stopping before seed {seed} to end within {args.minutes:g} minutes", file=sys.stderr)
                break
            t0 = time.time()
            run_seed(args, dataclasses.replace(cfg, seed=seed, out_dir=args.out), engine,
                     tokenizer, device, bar)
            longest = max(longest, time.time() - t0)
    n = merge(args.out)
    print(f"{n} lines in {os.path.join(args.out, 'pairs.jsonl')}")
    if engine is not None:
        engine.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

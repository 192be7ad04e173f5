"""Branching and arms: every arm from the same state on the same rollout, and what each reads.

A branch point (experiments/drift.py runs the trajectory) snapshots the weights, AdamW state and RNGs
(`snapshot`; in a file where they are large), restores them before each arm (`restore`), and gives the
arm that rollout's optimizer steps with its own bounds (`arm_config`: a band.BOUNDS method, `clip-upper`,
`clip-lower`, `noclip-matched`, `noclip@F`). Per arm: the entropy change on a probe sampled at the branch
point (teacher-forced, `probe_readings`, float64 a chunk of rows at a time), its importance-weighted
version, KL(old || new), the change on the rollout's own tokens and the token anatomy (old-probability
bin x advantage sign, `anatomy`). `branch` checks that every arm's first mini-batch ratio is exactly 1
and, where asked, that the first arm run twice gives the same readings bit for bit.

Antithetic coins (`branch(..., flipped=...)`): under coin rewards a rollout rewarded 1 - r is as likely as
one rewarded r, and its group advantages are exactly -Â (grpo.group_advantages: the deviations change sign,
the std does not). Each arm then also runs on the flipped advantages from the same state; the pair's mean
(drift_antithetic.pair_means) keeps what is even in Â (the bounds' asymmetric effect) and cancels the
first-order, mean-zero part that is odd in it. The base trajectory always advances on the drawn rewards.
"""

import contextlib
import dataclasses
import functools
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import band  # noqa: E402
import grpo  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from config import method_defaults  # noqa: E402
from logprobs import pack  # noqa: E402

ARMS = ("clip", "noclip", "bandkl", "clip-upper", "clip-higher", "clip-lower",
        "noclip-matched")  # the protocol's arms
MATCHED_LR = 0.76  # noclip-matched's lr factor f, fixed from a pilot (experiments/results/drift-toy/plan.md)
P_EDGES = (0.0, 0.05, 0.2, 0.5, 0.8, 1.0)  # anatomy bins of the old probability; last one closed
SIGNS = ("+", "-", "0")  # advantage sign of a token's response
PROBE_CHUNK_BYTES = 1 << 24  # float64 working set per distribution of one chunk of probe rows (16 MiB)
SNAPSHOT_RAM_BYTES = 1 << 28  # a larger snapshot (weights + AdamW moments) is kept in a file


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
def rollout_batch(engine, records, cfg, step, device, flip=False):
    """train.py's rollout of `step`: prompts, completions, coins or scores, group advantages; with `flip`, also
    the advantages of the same rollout rewarded 1 - r (antithetic coins; exactly -Â, tests/test_drift.py)."""
    prompts = train.prompt_batch(records, step, cfg)
    ids = [r["prompt_ids"] for r in prompts]
    sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens,
                                seed=cfg.seed * 1_000_003 + step * train.WORLD + train.RANK,
                                logprobs=True)
    completions = engine.generate(ids, cfg.group_size, sampling)
    rewards = train.train_rewards(completions, prompts, cfg, step)
    advantages = grpo.group_advantages(rewards, cfg.group_size, norm_by_std=cfg.norm_by_std)
    if not flip:
        return pack(ids, completions, device), advantages.to(device)
    coin = cfg.reward_correct + cfg.reward_incorrect - rewards   # each coin turned over: 1 - r by default
    flipped = grpo.group_advantages(coin, cfg.group_size, norm_by_std=cfg.norm_by_std)
    return pack(ids, completions, device), advantages.to(device), flipped.to(device)


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
           matched_lr=MATCHED_LR, snapshot_path=None, flipped=None):
    """Every arm from the same state on the same rollout; the model ends on the base's update (its
    own arm, run last, or a separate one). snapshot_path: where the state the arms restore from is
    kept (None: in memory). flipped: the advantages of the rollout's flipped coins (antithetic), on
    which every arm also runs, first, so that the drawn rollout's arms (flip 0) are run exactly as
    without them. -> [readings per arm], then [readings per arm on the flipped coins] (flip 1)."""
    old_logp, old_ent = policy.batch_logprobs(model, cfg, batch, with_entropy=True)  # (B, T) all rows
    probe_old = probe_logits(model, probe, cfg)
    snap = snapshot(model, optimizer, snapshot_path)
    base = _bounds_key(cfg)
    configs = [arm_config(cfg, a, matched_lr) for a in arms]
    order = sorted(range(len(arms)), key=lambda i: _bounds_key(configs[i]) == base)

    def run(i, adv, flip):
        restore(model, optimizer, snap)
        acfg = configs[i]
        _set_lr(optimizer, acfg.lr)
        r = arm_update(model, optimizer, acfg, batch, adv, old_logp, old_ent, probe, probe_old)
        r.update(arm=arms[i], method=acfg.method, eps_low=acfg.eps_low, eps_high=acfg.eps_high,
                 delta=acfg.delta, lr=acfg.lr, **({} if flipped is None else {"flip": flip}))
        return r

    anti = [run(i, flipped, 1) for i in range(len(arms))] if flipped is not None else []
    runs = ([0] if repeat_first else []) + order
    out = [None] * len(arms)
    for j, i in enumerate(runs):
        r = run(i, advantages, 0)
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
    return out + anti

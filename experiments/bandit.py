"""The clip bottleneck without a language model: one state, a softmax over V tokens, the exact expected surrogate.

docs/paper.md §1: a fixed clip lets a token of old probability p rise by at most ε₊·p per update, so a rare token
with a positive advantage is stopped after a ×1.2 rise however good it is; Band's upper bound r̄(p) (Theorem 1)
grows as p shrinks (Prop. 2). This script watches that happen rollout by rollout from one start (head token 0.6,
rare token p0, the rest spread evenly over V − 2 = 48 tokens), in two settings: one good token (reward 1 for the
rare token only; figure row 1: p_rare, entropy, and the growth per rollout p_new/p_old drawn over each method's
upper bound) and two good tokens (the head and the rare one, the paper's entropy-collapse story; row 2).

The update is GRPO's in expectation over sampling, so every curve is deterministic: per rollout π_old = π,
Â(a) = (R(a) − E R) / (std R + 1e-6) (0 for a constant R, as grpo.group_advantages), the bounds from
band.ratio_bounds(log π_old, ...); then K plain-SGD steps on E_{a~π_old}[ℓ(r_a, Â_a)], ℓ computed by
grpo.policy_loss itself (one "response" whose V "tokens" are the vocabulary, advantage π_old(a)·Â(a),
agg="seq-mean-token-sum": exact because ℓ(r, c·Â) = c·ℓ(r, Â) for c > 0, checked in tests/test_bandit.py).
"No clip" (grey, dashed) is the band [0, ∞).

Choices, each explained with the results in docs/results.md (the mechanism without a language model): plain SGD,
not Adam (with every logit its own parameter, Adam rescales the softmax normaliser's residue on a clipped token to a
full-size step); K = 16 steps of lr 0.25 per rollout, the same total step as 4 of lr 1 cut finer, so that the step
crossing a bound overshoots it by less; the exact expectation instead of sampled groups.

    python experiments/bandit.py                      # the table + figures/bandit.png, a few seconds on a CPU
    python experiments/bandit.py --p0 0.01            # also --p0 0.05, --delta, --lr, --steps, --rollouts, --optim
"""

import argparse
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import band  # noqa: E402
import grpo  # noqa: E402

METHODS = ("clip", "clip-higher", "dcpo", "bandkl", "bandtv", "bandchi2")
NO_CLIP = "no clip"                                     # the reference: band [0, inf), plain policy gradient
HEAD, RARE = 0, 1                                       # token indices
STYLE = {"clip": ("#d62728", "-"), "clip-higher": ("#ff7f0e", "-"), "dcpo": ("#9467bd", "-"),
         "bandkl": ("#1f77b4", "-"), "bandtv": ("#17becf", "-"), "bandchi2": ("#2ca02c", "-"),
         NO_CLIP: ("#7f7f7f", "--")}


# --- the bandit ---

def initial_logits(vocab=50, p_head=0.6, p0=0.02):
    """log π at the start: head token p_head, rare token p0, the rest uniform. (V,) float64."""
    rest = (1.0 - p_head - p0) / (vocab - 2)
    if not (0 < p0 < 1 and 0 < p_head < 1 and rest > 0):
        raise ValueError(f"need 0 < p0, p_head and p_head + p0 < 1, got p_head={p_head}, p0={p0}")
    p = torch.full((vocab,), rest, dtype=torch.float64)
    p[HEAD], p[RARE] = p_head, p0
    return p.log()


def rewards(vocab, good):
    """R(a) = 1 for the tokens in `good`, 0 otherwise. (V,) float64."""
    R = torch.zeros(vocab, dtype=torch.float64)
    R[list(good)] = 1.0
    return R


def exact_advantages(p, R, norm_by_std=True, eps=1e-6):
    """GRPO's advantage for an infinite group: (R − E_p R) / (std_p R + eps), 0 where R is constant under p
    (grpo.group_advantages zeroes a constant group too). p: (..., V), R: (V,) -> (..., V)."""
    adv = R - (p * R).sum(-1, keepdim=True)                                  # (..., V)
    var = (p * adv.square()).sum(-1, keepdim=True)                           # (..., 1)
    scaled = adv / (var.sqrt() + eps) if norm_by_std else adv
    return torch.where(var > 1e-300, scaled, torch.zeros_like(scaled))


def expected_surrogate(logits, old_logp, adv, lower, upper):
    """Σ over rows of E_{a~π_old}[ℓ(r_a, Â_a)], through grpo.policy_loss: each row is one response whose V "tokens"
    are the vocabulary, with advantage π_old(a)·Â(a), summed over tokens (agg="seq-mean-token-sum", times the number
    of rows to undo its mean over responses). Exact because the surrogate of §3 is positively homogeneous in Â (see
    the module docstring). All arguments (V,) or (M, V), one row per independent policy; returns a scalar."""
    logp = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])       # (M, V)
    M = logp.shape[0]
    as_rows = lambda x: x.reshape(M, -1)                                     # noqa: E731
    weighted = as_rows(old_logp.exp() * adv)                                 # (M, V) π_old(a)·Â(a)
    ones = torch.ones_like(logp, dtype=torch.bool)                           # (M, V)
    loss, _ = grpo.policy_loss(logp, as_rows(old_logp), weighted, ones, as_rows(lower), as_rows(upper),
                               agg="seq-mean-token-sum")
    return loss * M


def bounds(old_logp, method, delta):
    """(lower, upper) of `method` for old log-probs of any shape; NO_CLIP is [0, inf)."""
    if method == NO_CLIP:
        return torch.zeros_like(old_logp), torch.full_like(old_logp, math.inf)
    return band.ratio_bounds(old_logp, method, delta=delta)


def train_all(methods, *, good=(RARE,), vocab=50, p_head=0.6, p0=0.02, rollouts=30, steps=16, lr=0.25, delta=0.05,
              optim="sgd", norm_by_std=True):
    """Train one policy per method, all at once (row m of the logits belongs to methods[m]; the loss is a sum of
    independent rows and SGD/Adam act elementwise, so the rows do not interact). Returns {method: the policy after
    every rollout, (rollouts+1, V) float64, row 0 the start}."""
    M = len(methods)
    logits = initial_logits(vocab, p_head, p0).repeat(M, 1)                  # (M, V)
    m1, m2, t = torch.zeros_like(logits), torch.zeros_like(logits), 0         # Adam's moments, kept across rollouts
    R = rewards(vocab, good)                                                 # (V,)
    history = [torch.softmax(logits.detach(), -1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the tensors are tiny: intra-op threads only add waiting (25x on a busy 2-core CPU)
    try:
        for _ in range(rollouts):
            # --- rollout: freeze π_old, its advantages and its bounds ---
            old_logp = torch.log_softmax(logits.detach(), -1)                # (M, V)
            adv = exact_advantages(old_logp.exp(), R, norm_by_std)           # (M, V)
            lower, upper = (torch.stack(b) for b in zip(*(bounds(old_logp[m], methods[m], delta) for m in range(M))))
            # --- update: K steps on the same surrogate (K mini-batches whose expectation is the same) ---
            for _ in range(steps):
                logits.requires_grad_()
                (g,) = torch.autograd.grad(expected_surrogate(logits, old_logp, adv, lower, upper), logits)
                if optim == "adam":     # torch.optim.Adam's defaults by hand (torch.optim imports torch._dynamo: ~2 s)
                    t, m1, m2 = t + 1, 0.9 * m1 + 0.1 * g, 0.999 * m2 + 0.001 * g * g
                    g = m1 / (1 - 0.9 ** t) / ((m2 / (1 - 0.999 ** t)).sqrt() + 1e-8)
                logits = (logits - lr * g).detach()
            history.append(torch.softmax(logits.detach(), -1))
    finally:
        torch.set_num_threads(threads)
    P = torch.stack(history)                                                 # (rollouts+1, M, V)
    return {method: P[:, m] for m, method in enumerate(methods)}


def train(method, **kw):
    """One method's run (see train_all): (rollouts+1, V)."""
    return train_all((method,), **kw)[method]


def entropy(P):
    """H(π) in nats for each row of P (n, V)."""
    return -(P * torch.log(P.clamp_min(1e-300))).sum(-1)


def first_reach(x, level):
    """Index of the first rollout with x ≥ level, None if never."""
    hit = (x >= level).nonzero()
    return int(hit[0]) if len(hit) else None


# --- table and figure ---

def summarise(runs, p0, delta):
    rows = []
    for method, P in runs.items():
        pr, H = P[:, RARE], entropy(P)
        growth = pr[1:] / pr[:-1]
        upper0 = float(bounds(torch.tensor([math.log(p0)], dtype=torch.float64), method, delta)[1])
        rows.append(dict(method=method, upper0=upper0, growth1=float(growth[0]), growth_max=float(growth.max()),
                         t_half=first_reach(pr, 0.5), p_max=float(pr.max()), t_max=int(pr.argmax()),
                         p_end=float(pr[-1]), head_end=float(P[-1, HEAD]), H_end=float(H[-1]), H_max=float(H.max()),
                         H5=float(H[min(5, len(H) - 1)]), H10=float(H[min(10, len(H) - 1)])))
    return rows


def print_tables(single, two, p0, delta, args):
    print(f"Softmax bandit: V={args.vocab}, head {args.p_head}, rare p0={p0}, δ={delta}, "
          f"{args.steps} {args.optim.upper()} steps/rollout, lr={args.lr}, {args.rollouts} rollouts")
    print("\n[one good token: the rare one]   r̄(p0) = upper bound at p0 (clip: 1+ε₊); growth = p_rare(k+1)/p_rare(k)")
    print(f"{'method':12} {'r̄(p0)':>7} {'growth@1':>9} {'max growth':>10} {'rollouts→0.5':>13} "
          f"{'p_rare end':>10} {'H max':>6} {'H end':>6}")
    for r in single:
        t = "never" if r["t_half"] is None else str(r["t_half"])
        print(f"{r['method']:12} {r['upper0']:7.3f} {r['growth1']:9.3f} {r['growth_max']:10.3f} {t:>13} "
              f"{r['p_end']:10.3f} {r['H_max']:6.3f} {r['H_end']:6.3f}")
    print("\n[two good tokens: head and rare]   the rare good token's probability; entropy after 5, 10, all rollouts")
    print(f"{'method':12} {'r̄(p0)':>7} {'growth@1':>9} {'p_rare max':>10} {'at':>4} {'p_rare end':>10} "
          f"{'p_head end':>10} {'H@5':>6} {'H@10':>6} {'H end':>6}")
    for r in two:
        print(f"{r['method']:12} {r['upper0']:7.3f} {r['growth1']:9.3f} {r['p_max']:10.4f} {r['t_max']:4d} "
              f"{r['p_end']:10.2e} {r['head_end']:10.4f} {r['H5']:6.3f} {r['H10']:6.3f} {r['H_end']:6.3f}")


def plot(single, two, p0, delta, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 9), constrained_layout=True)
    rows = fig.subfigures(2, 1, hspace=0.04)
    ax = [row.subplots(1, 3) for row in rows]
    rows[0].suptitle(f"One good token: reward 1 for the rare token only (p0 = {p0})", fontsize=12, weight="bold")
    rows[1].suptitle(f"Two good tokens: reward 1 for the head token (p = {args.p_head}) and the rare one "
                     f"(p0 = {p0})", fontsize=12, weight="bold")
    k = torch.arange(args.rollouts + 1)
    for row, runs in ((0, single), (1, two)):
        for method, P in runs.items():
            color, ls = STYLE[method]
            lw = 1.6 if method != NO_CLIP else 1.2
            ax[row][0].plot(k, P[:, RARE], color=color, ls=ls, lw=lw, label=method)
            ax[row][1].plot(k, entropy(P), color=color, ls=ls, lw=lw, label=method)
        ax[row][0].set_yscale("log")
        ax[row][0].set_ylabel("p(rare token)")
        ax[row][0].set_title("probability of the rare token")
        ax[row][1].set_ylabel("policy entropy (nats)")
        ax[row][1].set_title("entropy of the policy")
        for a in ax[row][:2]:
            a.set_xlabel("rollout")
            a.grid(alpha=0.3)
    # the clip's nominal promise as a line: p0·1.2^k until 1
    kk = k[k <= math.log(1 / p0) / math.log(1.2)]
    ax[0][0].plot(kk, p0 * 1.2 ** kk, color="#d62728", ls=":", lw=1, label="p0·1.2^k: ×(1+ε₊) per rollout")
    ax[0][0].axhline(0.5, color="k", lw=0.6, alpha=0.4)
    ax[0][0].legend(fontsize=8, loc="lower right")

    # row 1, col 3: the paper's bound-versus-p picture with the measured per-rollout growth on it
    a = ax[0][2]
    grid = torch.logspace(math.log10(min(p0, 0.01) / 2), 0, 400, dtype=torch.float64)[:-1]
    for method, P in single.items():
        color, ls = STYLE[method]
        if method != NO_CLIP:
            a.plot(grid, bounds(grid.log(), method, delta)[1], color=color, lw=1.2, alpha=0.8)
        pr = P[:, RARE]
        keep = pr[:-1] < 0.99                                                # growth is meaningless once p ≈ 1
        a.plot(pr[:-1][keep], (pr[1:] / pr[:-1])[keep], "o", ms=3.5, color=color, alpha=0.9,
               mfc="none" if method == NO_CLIP else color)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_ylim(0.9, 12)
    a.set_xlabel("p(rare token) before the rollout")
    a.set_ylabel("growth p_new / p_old in one rollout")
    a.set_title("growth per rollout (dots) vs upper bound (lines)")
    a.text(0.02, 0.03, "colours as in the legend; hollow: no clip", transform=a.transAxes, fontsize=8, alpha=0.8)
    a.grid(alpha=0.3, which="both")

    # row 2, col 3: how the good mass is split between the two good tokens (diversity among correct answers)
    a = ax[1][2]
    for method, P in two.items():
        color, ls = STYLE[method]
        a.plot(k, P[:, RARE] / (P[:, RARE] + P[:, HEAD]), color=color, ls=ls, lw=1.6 if method != NO_CLIP else 1.2)
    a.set_yscale("log")
    a.set_xlabel("rollout")
    a.set_ylabel("p(rare) / (p(rare) + p(head))")
    a.set_title("the rare token's share of the rewarded mass")
    a.grid(alpha=0.3)
    ax[1][0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Softmax bandit (V = {args.vocab}), exact expected GRPO surrogate, {args.steps} {args.optim.upper()} "
                 f"steps per rollout at lr {args.lr}, δ = {delta} for the bands", fontsize=13)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p0", type=float, default=0.02, help="initial probability of the rare token")
    ap.add_argument("--p-head", type=float, default=0.6, help="initial probability of the head token")
    ap.add_argument("--vocab", type=int, default=50, help="vocabulary size V")
    ap.add_argument("--delta", type=float, default=0.05, help="trust-region radius δ of the band methods")
    ap.add_argument("--rollouts", type=int, default=30, help="number of rollouts (π_old refreshes)")
    ap.add_argument("--steps", type=int, default=16, help="gradient steps per rollout (see the docstring)")
    ap.add_argument("--lr", type=float, default=0.25, help="learning rate (SGD on the logits)")
    ap.add_argument("--optim", choices=("sgd", "adam"), default="sgd", help="sgd (default; see docstring) or adam")
    ap.add_argument("--no-std", action="store_true", help="advantage R − E R without dividing by the std")
    ap.add_argument("--out", default=os.path.join(ROOT, "figures", "bandit.png"), help="figure path ('' = none)")
    args = ap.parse_args()

    t0 = time.time()
    kw = dict(vocab=args.vocab, p_head=args.p_head, p0=args.p0, rollouts=args.rollouts, steps=args.steps,
              lr=args.lr, delta=args.delta, optim=args.optim, norm_by_std=not args.no_std)
    methods = METHODS + (NO_CLIP,)
    single = train_all(methods, good=(RARE,), **kw)
    two = train_all(methods, good=(HEAD, RARE), **kw)
    print_tables(summarise(single, args.p0, args.delta), summarise(two, args.p0, args.delta), args.p0, args.delta,
                 args)
    if args.out:
        plot(single, two, args.p0, args.delta, args, args.out)
        print(f"\nwrote {os.path.relpath(args.out)}")
    print(f"{time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

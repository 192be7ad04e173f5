"""The paper's bound-versus-p picture: ratio bounds and probability-variation bounds versus the old probability p.

    make figures            # = .venv/bin/python derivations/figures.py  ->  figures/band_bounds.png

Top row: the interval [lower, upper] each method clips the ratio r = pi_new(a)/pi_old(a) to (band.ratio_bounds
without the cap), for the clip (GRPO, 0.2/0.2), clip-higher (DAPO, 0.2/0.28), DCPO (0.16/0.20) and Band with the
KL, TV and chi^2 generators (and the generic-path Hellinger), at delta = 0.05 and 0.1. Bottom row: the same interval
as a change of probability, p (r - 1): how far the token's probability may move. The simplex limits r in [0, 1/p]
(probability change in [-p, 1 - p]) are shaded. The clip's allowed rise eps * p vanishes for rare tokens; Band-KL's
tends to 1 - e^-delta (Prop. 1).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import band  # noqa: E402

METHODS = [  # (ratio_bounds name, label, colour, line width)
    ("clip", "clip [0.8, 1.2] (GRPO)", "0.45", 1.6),
    ("clip-higher", "clip-higher [0.8, 1.28] (DAPO)", "0.1", 1.6),
    ("dcpo", "DCPO (0.16 / 0.20)", "tab:purple", 1.6),
    ("bandkl", "Band-KL", "tab:red", 2.4),
    ("bandtv", "Band-TV", "tab:blue", 1.8),
    ("bandchi2", "Band-$\\chi^2$", "tab:green", 1.8),
    ("bandhellinger", "Band-Hellinger (generic path)", "tab:orange", 1.2),
]


def main():
    p = torch.logspace(-4, -1e-4, 600, dtype=torch.float64)
    logp = p.log()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5), sharex=True)
    for col, delta in enumerate((0.05, 0.1)):
        ax_r, ax_d = axes[0, col], axes[1, col]
        ax_r.fill_between(p, 1 / p, 1e4, color="0.92", lw=0)
        ax_r.plot(p, 1 / p, color="0.6", lw=1, ls=":", label="simplex limit r = 1/p")
        ax_d.fill_between(p, 1 - p, 1.2, color="0.92", lw=0)
        ax_d.fill_between(p, -1.2, -p, color="0.92", lw=0)
        ax_d.plot(p, 1 - p, color="0.6", lw=1, ls=":", label="simplex limits 1 - p, -p")
        ax_d.plot(p, -p, color="0.6", lw=1, ls=":")
        for name, label, colour, lw in METHODS:
            lower, upper = band.ratio_bounds(logp, name, delta=delta, max_ratio=float("inf"))
            ls = "-" if name.startswith("band") else "--"
            ax_r.plot(p, upper, color=colour, lw=lw, ls=ls, label=label)
            ax_r.plot(p, lower, color=colour, lw=lw, ls=ls)
            ax_d.plot(p, p * (upper - 1), color=colour, lw=lw, ls=ls, label=label)
            ax_d.plot(p, p * (lower - 1), color=colour, lw=lw, ls=ls)
        ax_d.axhline(-torch.expm1(torch.tensor(-delta)).item(), color="tab:red", lw=0.8, ls="-.")
        ax_d.text(1.2e-4, 1.08 * -torch.expm1(torch.tensor(-delta)).item(), "$1 - e^{-\\delta}$ (Band-KL, p $\\to$ 0)",
                  color="tab:red", fontsize=9, va="bottom")
        ax_r.set(xscale="log", yscale="log", ylim=(0.02, 200), ylabel="ratio bound r = $\\pi_{new}/\\pi_{old}$",
                 title=f"ratio bounds [lower, upper], $\\delta$ = {delta}")
        ax_d.set(xscale="log", ylim=(-0.75, 0.75), xlabel="old probability p of the sampled token",
                 ylabel="probability change p (r - 1)", title=f"probability-variation bounds, $\\delta$ = {delta}")
        for ax in (ax_r, ax_d):
            ax.axhline(1 if ax is ax_r else 0, color="k", lw=0.6)
            ax.grid(True, which="major", color="0.85", lw=0.5)
    axes[0, 0].legend(loc="upper right", fontsize=8.5, framealpha=0.95)
    fig.suptitle("Band: per-token clipping intervals implied by an f-divergence trust region (dashed: baselines; "
                 "shaded: outside the simplex)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = ROOT / "figures" / "band_bounds.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

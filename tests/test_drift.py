"""experiments/drift.py on the embedded tiny model (one process, gloo) and on hand-built tensors.

The claims: a restored arm is the same as an arm trained from a fresh build that never saw the snapshot (so
restoring weights, AdamW state and RNGs is exact), arms with equal bounds give equal readings bit for bit, the
restore is seen by the next
forward (and would not be without the reshard), the anatomy's cells add up to the batch
(and its clip counts to grpo's own), and the probe readings equal the formulas worked out by hand.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import drift  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
from config import Config, resolve_config  # noqa: E402
from logprobs import RolloutBatch, pack  # noqa: E402

F64 = torch.finfo(torch.float64).eps  # float64 sums of at most a few hundred terms: 1e-12 relative is ample


@pytest.fixture(scope="module")
def setup(group):
    """A small coin-reward shape: 4 prompts x 4 samples, 2 mini-batches (off-policy), 8-token responses, at
    temperature 2: at 1 the tiny model is certain of every token of its own task (p = 1 in float32, no gradient)."""
    cfg = resolve_config(Config(method="clip", reward="random", rollout="hf", prompts_per_step=4, group_size=4,
                                mini_batch_prompts=2, max_new_tokens=8, train_dtype="float32",
                                rollout_dtype="float32", grad_checkpointing=False, share_prompt=False, lr=1e-3,
                                temperature=2.0))
    engine = rollout.make_engine("hf", cfg.model, dtype="float32")
    records, probe_ids = drift.load_prompts(cfg, engine.tokenizer, 8)
    return cfg, engine, records, probe_ids


def start(setup, cfg=None):
    """A fresh build after one base rollout (so AdamW has state to restore), the engine synced, then the
    rollout and the probe of step 1."""
    cfg = cfg or setup[0]
    _, engine, records, probe_ids = setup
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = policy.build_model(cfg, device)
    opt = policy.make_optimizer(model, cfg)
    rollout.sync_weights(engine, model)
    drift.base_update(model, opt, cfg, *drift.rollout_batch(engine, records, cfg, 0, device))
    rollout.sync_weights(engine, model)
    batch, adv = drift.rollout_batch(engine, records, cfg, 1, device)
    probe = pack(probe_ids, engine.generate(probe_ids, 2, rollout.Sampling(temperature=cfg.temperature,
                                                                          max_new_tokens=8, seed=7)), device)
    return model, opt, batch, adv, probe


def test_restored_arm_equals_a_fresh_build(setup):
    """The clip arm, run after the no-clip arm from the restored snapshot, gives the readings (first-mini-batch
    ratio exactly 1 included) of a fresh build that takes the same rollout's updates with no snapshot at all."""
    cfg = setup[0]
    model, opt, batch, adv, probe = start(setup)
    rows = drift.branch(model, opt, cfg, ["noclip", "clip"], batch, adv, probe)
    assert [r["first_abs_dev"] for r in rows] == [0.0, 0.0]
    assert all(r["kl"] > 1e-4 and r["dlogp_train"] != 0 for r in rows)  # the updates moved the policy
    fresh, fopt, fbatch, fadv, fprobe = start(setup)
    old_logp, old_ent = policy.batch_logprobs(fresh, cfg, fbatch, with_entropy=True)
    ref = drift.arm_update(fresh, fopt, cfg, fbatch, fadv, old_logp, old_ent, fprobe,
                           drift.probe_logq(fresh, fprobe, cfg))
    got = {k: v for k, v in rows[1].items() if k in ref}
    assert got == ref
    # the base trajectory continues from the clip arm: the same weights as the fresh build's
    policy.reshard(model), policy.reshard(fresh)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def test_equal_bounds_give_equal_readings(setup):
    """The same bounds twice, separated by another arm (and the first arm repeated by the built-in check):
    the readings are equal bit for bit; different bounds give different ones."""
    cfg = setup[0]
    model, opt, batch, adv, probe = start(setup)
    a, b, c = drift.branch(model, opt, cfg, ["noclip", "bandkl", "noclip"], batch, adv, probe,
                           repeat_first=True)
    assert a == c
    assert a["dH_probe"] != b["dH_probe"] and a["kl"] != b["kl"]


def test_restore_is_seen_by_the_next_forward(setup, monkeypatch):
    """Weights restored after a no-grad forward are the ones the next no-grad forward uses: restoring halved
    weights changes the log-probs, restoring the snapshot brings them back bit for bit. Without the reshard the
    halved weights go unseen: one rank's FSDP2 keeps the weights it gathered for the last forward."""
    cfg = setup[0]
    _, _, batch, _, _ = start(setup)
    for patched in (False, True):
        model = policy.build_model(cfg, torch.device("cpu"))
        opt = policy.make_optimizer(model, cfg)
        if patched:
            monkeypatch.setattr(policy, "reshard", lambda model: None)
        old_logp, _ = policy.batch_logprobs(model, cfg, batch)
        snap = drift.snapshot(model, opt)
        drift.restore(model, opt, ([w * 0.5 for w in snap[0]], *snap[1:]))
        halved, _ = policy.batch_logprobs(model, cfg, batch)
        assert torch.equal(halved, old_logp) == patched
        if not patched:
            drift.restore(model, opt, snap)
            assert torch.equal(policy.batch_logprobs(model, cfg, batch)[0], old_logp)


def test_anatomy_cells_sum_to_the_batch(setup):
    """Every response token falls in exactly one cell: tokens, Σ Δlog p and Σ ΔH over the cells equal the batch
    totals, and the upward / downward clips equal grpo._clip_metrics' own counts (n_upper, n_lower)."""
    cfg = dataclasses.replace(setup[0], lr=3e-3, mini_batch_prompts=1)  # 4 larger steps: the bounds bind
    model, opt, batch, adv, probe = start(setup, cfg)
    for r in drift.branch(model, opt, cfg, ["clip", "clip-upper", "bandkl"], batch, adv, probe):
        cells = r["cells"]
        assert len(cells) == (len(drift.P_EDGES) - 1) * len(drift.SIGNS)
        assert sum(c["tokens"] for c in cells) == r["tokens"] == int(batch.mask.sum())
        total = sum(c["dlogp_sum"] for c in cells)
        assert total == pytest.approx(r["dlogp_train"] * r["tokens"], rel=1e-12, abs=1e-12)
        assert sum(c["up"] for c in cells) == r["n_upper"]
        assert sum(c["down"] for c in cells) == r["n_lower"]
        assert r["n_upper"] > 0 and r["n_lower"] > 0 or r["arm"] != "clip"  # the clip acted, both sides


def test_anatomy_on_hand_built_tokens():
    """Four tokens, one per cell, worked by hand: p = 0.01 (Â > 0, r = 2 > 1.2: clipped up), p = 0.1 (Â < 0,
    r = 0.5 < 0.8: clipped down), p = 0.3 (Â > 0, r = 1.1: inside), p = 1.0 (the closed last bin); masked
    tokens (padding, a masked row with Â > 0) never count."""
    p = torch.tensor([[0.01, 0.3], [0.1, 1.0], [0.5, 0.5]], dtype=torch.float64)
    old = p.log()
    upd = old + torch.tensor([[math.log(2.0), math.log(1.1)], [math.log(0.5), 0.0], [0, 0]], dtype=torch.float64)
    new = old + torch.tensor([[0.5, 0.1], [-0.3, 0.0], [9, 9]], dtype=torch.float64)
    ent_old, ent_new = torch.zeros(3, 2, dtype=torch.float64), torch.full((3, 2), 0.25, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.float64)  # row 1's second token is padding
    adv2 = torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64)
    cfg = resolve_config(Config(method="clip"))
    cells = {(tuple(c["p"]), c["adv"]): c for c in drift.anatomy(old, new, ent_old, ent_new, upd, adv2, mask, cfg)}
    rare = cells[((0.0, 0.05), "+")]
    assert (rare["tokens"], rare["up"], rare["down"], rare["dH_sum"]) == (1, 1, 0, 0.25)
    assert rare["dlogp_sum"] == pytest.approx(0.5, abs=4 * F64 * 5)  # (log 0.01 + 0.5) - log 0.01: |log p| < 5
    assert cells[((0.05, 0.2), "-")]["down"] == 1
    assert cells[((0.05, 0.2), "-")]["dlogp_sum"] == pytest.approx(-0.3, abs=4 * F64 * 5)
    assert cells[((0.2, 0.5), "+")]["tokens"] == 1 and cells[((0.2, 0.5), "+")]["up"] == 0
    assert sum(c["tokens"] for c in cells.values()) == 3  # padding and row 2 (masked) never count
    # p = 1.0 lands in the closed last bin when unmasked, with Â = 0 in the "0" cell
    mask[1, 1] = 1
    cells = {(tuple(c["p"]), c["adv"]): c for c in drift.anatomy(old, new, ent_old, ent_new, upd, adv, mask, cfg)}
    assert cells[((0.8, 1.0), "-")]["tokens"] == 1  # row 1 has Â < 0
    assert sum(c["tokens"] for c in cells.values()) == 4


def test_probe_readings_by_hand():
    """Two rows of one token over a 2-token vocabulary. Row 0 moves (0.5, 0.5) -> (0.9, 0.1) and sampled token 0;
    row 1 does not move. By hand: ΔH = (H(0.9) - ln 2) / 2, KL = (0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)) / 2,
    sequence weights ∝ (0.9 / 0.5, 1) = (1.8, 1), so the weighted entropy is (1.8 H(0.9) + ln 2) / 2.8."""
    old = torch.tensor([[[0.5, 0.5]], [[0.5, 0.5]]], dtype=torch.float64).log()
    new = torch.tensor([[[0.9, 0.1]], [[0.5, 0.5]]], dtype=torch.float64).log()
    probe = RolloutBatch(torch.tensor([[3, 0], [3, 1]]), torch.ones(2, 2, dtype=torch.long),
                         torch.ones(2, 1), 1)
    r = drift.probe_readings(old, new, probe)
    H9 = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    assert r["dH_probe"] == pytest.approx((H9 - math.log(2)) / 2, rel=16 * F64)
    assert r["kl"] == pytest.approx((0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5)) / 2, rel=16 * F64)
    assert r["dH_probe_is"] == pytest.approx((1.8 * H9 + math.log(2)) / 2.8 - math.log(2), rel=1e-12)
    assert r["ess"] == pytest.approx(1 / ((1.8 / 2.8) ** 2 + (1 / 2.8) ** 2) / 2, rel=1e-12)


def test_small_run_and_resume(tmp_path):
    """The command runs 2 branch points x 2 arms, writes the public keys, and --resume with more branch points
    keeps the finished lines and adds only the new step."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "drift.py"), "--seeds", "0", "--arms", "clip,noclip",
           "--probe-prompts", "4", "--probe-samples", "2", "--out", str(tmp_path), "--branches", "2", "--",
           "--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--max-new-tokens", "8",
           "--train-dtype", "float32", "--rollout-dtype", "float32"]
    # the module's process group (the fixture above) leaves its rendezvous variables in os.environ, and its store
    # still holds that port: the command must pick its own, as a run from a shell does
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    first = [json.loads(x) for x in open(tmp_path / "pairs.jsonl")]
    assert [(r["step"], r["arm"]) for r in first] == [(0, "clip"), (0, "noclip"), (1, "clip"), (1, "noclip")]
    for key in ("seed", "step", "arm", "dH_probe", "dH_probe_is", "dH_train", "kl", "cells"):
        assert all(key in r for r in first), key
    cmd[cmd.index("--branches") + 1] = "3"
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)
    assert refused.returncode != 0 and b"--resume" in refused.stderr  # an existing run is not overwritten
    cut = cmd.index("--")
    subprocess.run(cmd[:cut] + ["--resume"] + cmd[cut:], check=True, cwd=ROOT, env=env, capture_output=True,
                   timeout=600)
    again = [json.loads(x) for x in open(tmp_path / "pairs.jsonl")]
    assert again[:4] == first
    assert [(r["step"], r["arm"]) for r in again[4:]] == [(2, "clip"), (2, "noclip")]


def test_report_reads_seed_means_by_hand(tmp_path):
    """drift_report on hand-built lines: 3 seeds x 2 branch points; clip - no-clip dH_probe per branch point
    (-1, -3), (-2, -2), (-4, -2) e-4 -> seed means -2, -2, -3: mean -2.333e-4, sd 0.577e-4, half 4.303 x 0.577 /
    sqrt(3) = 1.434e-4: [-3.77, -0.90] e-4 lies below 0 and reaches past -2.5: "below 0". The collapse drift
    from two GRPO runs whose step-1 entropies are 0.1 and 0.2 (one plain, one gzipped): 0.9 x 0.15 / 300 = 4.5e-4;
    the report's yardstick is the fixed c = 0.9 x 0.157 / 300 = 4.71e-4. The lines read back from pairs.jsonl.gz
    are the lines written."""
    import gzip

    import drift_report
    cells = [{"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0, "up": 0, "down": 0}]
    rows = []
    for seed, diffs in enumerate([(-1, -3), (-2, -2), (-4, -2)]):
        for step, d in enumerate(diffs):
            for arm, v in (("clip", d * 1e-4), ("noclip", 0.0)):
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": v, "dH_probe_is": v, "dH_train": v,
                             "kl": 0.0, "H_probe": 0.1, "n_upper": 0, "n_lower": 0, "cells": cells})
    for i, h in enumerate((0.1, 0.2)):  # GRPO's runs, and a clip-higher run of the same seed that must not count
        for name, entropy in ((f"clip-d0.05-s{i}", h), (f"clip-higher-d0.05-s{i}", 9.0)):
            os.makedirs(tmp_path / name)
            line = json.dumps({"step": 1, "entropy": entropy}) + "\n"
            if i:
                with gzip.open(tmp_path / name / "metrics.jsonl.gz", "wt") as f:
                    f.write(line)
            else:
                (tmp_path / name / "metrics.jsonl").write_text(line)
    c, H1, n = drift_report.collapse_drift(str(tmp_path))
    assert n == 2 and H1 == pytest.approx(0.15, rel=4 * F64) and c == pytest.approx(4.5e-4, rel=8 * F64)
    with gzip.open(tmp_path / "pairs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert drift_report.load(str(tmp_path / "pairs.jsonl.gz")) == rows
    md, data, arms = drift_report.report(rows)
    assert "| clip − noclip | dH_probe | -2.33 ± 1.43 |" in md and "| below 0 |" in md
    assert "c = 0.9 x 0.157 / 300 = 4.71e-4" in md
    assert "**the clip drains the entropy**; no collapse-sized drain (lower end -3.77e-4 > -c = -4.71e-4)" in md
    assert drift_report.label(0.5e-4, 1e-4) == "no effect of interest (within ±2.5e-4)"
    assert drift_report.label(2e-4, 3e-4) == "unresolved" and drift_report.label(2e-4, 1e-4) == "above 0"
    assert drift_report.label(-2e-4, 0.3e-4) == "no effect of interest (within ±2.5e-4) (below 0, but smaller)"

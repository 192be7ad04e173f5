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


@pytest.mark.parametrize("in_file", [False, True])
def test_restored_arm_equals_a_fresh_build(setup, in_file, tmp_path):
    """The clip arm, run after the no-clip arm from the restored snapshot, gives the readings (first-mini-batch
    ratio exactly 1 included) of a fresh build that takes the same rollout's updates with no snapshot at all;
    with the snapshot kept in a file (SmolLM2's), too, and the file is gone after the branch point."""
    cfg = setup[0]
    model, opt, batch, adv, probe = start(setup)
    path = str(tmp_path / "snapshot.bin") if in_file else None
    rows = drift.branch(model, opt, cfg, ["noclip", "clip"], batch, adv, probe, snapshot_path=path)
    assert not os.listdir(tmp_path)
    assert [r["first_abs_dev"] for r in rows] == [0.0, 0.0]
    assert all(r["kl"] > 1e-4 and r["dlogp_train"] != 0 for r in rows)  # the updates moved the policy
    fresh, fopt, fbatch, fadv, fprobe = start(setup)
    old_logp, old_ent = policy.batch_logprobs(fresh, cfg, fbatch, with_entropy=True)
    ref = drift.arm_update(fresh, fopt, cfg, fbatch, fadv, old_logp, old_ent, fprobe,
                           drift.probe_logits(fresh, fprobe, cfg))
    got = {k: v for k, v in rows[1].items() if k in ref}
    assert got == ref
    # the base trajectory continues from the clip arm: the same weights as the fresh build's
    policy.reshard(model), policy.reshard(fresh)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())


@pytest.mark.parametrize("pack", [False, True])
def test_shared_engine_samples_what_a_synced_copy_samples(setup, pack):
    """drift.py generates with the trainer's own FSDP2 module (shares_engine) instead of a copy synced after
    every update: after an update, both draw the same tokens with the same log-probs, bit for bit, from the same
    seed (packed rows too: the packed attention must leave a plain generate alone)."""
    cfg = dataclasses.replace(setup[0], pack=pack)
    _, copy, records, probe_ids = setup
    assert drift.shares_engine(cfg)
    model = policy.build_model(cfg, torch.device("cpu"))
    opt = policy.make_optimizer(model, cfg)
    rollout.sync_weights(copy, model)
    drift.base_update(model, opt, cfg, *drift.rollout_batch(copy, records, cfg, 0, torch.device("cpu")))
    rollout.sync_weights(copy, model)
    shared = rollout.make_engine("hf", cfg.model, model=model, dtype="float32")
    sampling = rollout.Sampling(temperature=cfg.temperature, max_new_tokens=8, seed=11, logprobs=True)
    a, b = (e.generate(probe_ids[:4], 3, sampling) for e in (copy, shared))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    assert not drift.shares_engine(dataclasses.replace(cfg, rollout_dtype="bfloat16"))


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


def _shell_env():
    """The module's process group (the fixture above) leaves its rendezvous variables in os.environ, and its store
    still holds that port: a drift.py command must pick its own, as a run from a shell does."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_small_run_and_resume(tmp_path):
    """The command runs 2 branch points x 2 arms, writes the public keys, and --resume with more branch points
    keeps the finished lines and adds only the new step."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "drift.py"), "--seeds", "0", "--arms", "clip,noclip",
           "--probe-prompts", "4", "--probe-samples", "2", "--out", str(tmp_path), "--branches", "2", "--",
           "--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--max-new-tokens", "8",
           "--train-dtype", "float32", "--rollout-dtype", "float32"]
    env = _shell_env()
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
    assert all(r["machine"] for r in again)
    # a seed resumes only with the settings it began with: another lr, or other arms, is refused by name
    other_arms = list(cmd)
    other_arms[cmd.index("--arms") + 1] = "clip"
    record = json.loads((tmp_path / "s0" / "drift.json").read_text())
    assert record["arms"] == ["clip", "noclip"] and record["machine"]
    for bad, name in ((cmd[:cut] + ["--resume"] + cmd[cut:] + ["--lr", "3e-4"], b"began with lr = "),
                      (other_arms[:cut] + ["--resume"] + other_arms[cut:], b"began with --arms = ")):
        refused = subprocess.run(bad, cwd=ROOT, env=env, capture_output=True, timeout=600)
        assert refused.returncode != 0 and name in refused.stderr, refused.stderr[-300:]
    (tmp_path / "s0" / "drift.json").write_text(json.dumps(dict(record, machine="another CPU")))
    refused = subprocess.run(cmd[:cut] + ["--resume"] + cmd[cut:], cwd=ROOT, env=env, capture_output=True,
                             timeout=600)
    assert refused.returncode != 0 and b"began with machine = 'another CPU'" in refused.stderr
    assert [json.loads(x) for x in open(tmp_path / "pairs.jsonl")] == again  # nothing was redone or lost


def test_minutes_stops_between_whole_seeds(tmp_path):
    """--minutes 0.001 (60 ms): the first seed always runs, and no second one fits after it; the run says so and
    keeps the first seed's lines. --minutes 0 is refused by name. --skip-merged leaves out a merged seed."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "drift.py"), "--seeds", "0,1", "--arms", "clip,noclip",
           "--probe-prompts", "4", "--probe-samples", "2", "--out", str(tmp_path), "--branches", "1", "--minutes",
           "0.001", "--", "--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2",
           "--max-new-tokens", "8", "--train-dtype", "float32", "--rollout-dtype", "float32"]
    env = _shell_env()
    done = subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    assert b"stopping before seed 1 to end within 0.001 minutes" in done.stderr
    assert {(r["seed"], r["arm"]) for r in map(json.loads, open(tmp_path / "pairs.jsonl"))} == {
        (0, "clip"), (0, "noclip")}
    cmd[cmd.index("--minutes") + 1] = "0"
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)
    assert refused.returncode == 2 and b"--minutes must be above 0, got 0" in refused.stderr
    # a fresh machine leaves out the seeds the committed file holds: here all of them, so nothing starts
    target = tmp_path / "committed.jsonl.gz"
    drift.merge_into(str(tmp_path), str(target), branches=1, every=1)
    cmd[cmd.index("--minutes") + 1] = "1"
    cmd[cmd.index("--seeds") + 1] = "0"
    skipped = subprocess.run(cmd[:2] + ["--skip-merged", str(target)] + cmd[2:], check=True, cwd=ROOT, env=env,
                             capture_output=True, timeout=600)
    assert f"seeds [0] are in {target} already; running none".encode() in skipped.stderr


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
    # exploratory, 95% t on 2 df: the interval above
    # 3 seeds: no sign interval reaches 95%, the median stands alone
    assert "| clip − noclip | dH_probe_is | 3 | -2.33 ± 1.43 | -2.00 |" in md
    assert "c = 0.9 x 0.157 / 300 = 4.71e-4" in md
    # the family at 1 - 0.05 / 8: t(0.996875, 2) = u sqrt(2 / (1 - u^2)), u = 0.99375 (t's CDF on 2 df is
    # 1/2 + t / (2 sqrt(2 + t^2))): 12.590, half 12.590 x 0.577 / sqrt(3) = 4.197 -> [-6.53, +1.86]
    assert "| clip − noclip | 3 | -2.33 ± 4.20 |" in md
    assert ("**unresolved: neither excludes 0 nor lies within the margin**; a collapse-sized drain is not excluded "
            "(lower end -6.53e-4 <= -c = -4.71e-4)") in md
    assert "**Interim: 3 of the plan's 32 seeds. No reading below is the plan's.**" in md
    assert drift_report.label(0.5e-4, 1e-4) == "no effect of interest (within ±2.5e-4)"
    assert drift_report.label(2e-4, 3e-4) == "unresolved" and drift_report.label(2e-4, 1e-4) == "above 0"
    assert drift_report.label(-2e-4, 0.3e-4) == "no effect of interest (within ±2.5e-4) (below 0, but smaller)"


REFUSALS = [("kl-coef", "0.001"), ("old-logp", "engine"), ("eps-low", "0.1"), ("eps-high", "0.3"), ("max-steps", "5"),
            ("seed", "3"), ("out-dir", "x"), ("resume", "x"), ("eval-every", "5"), ("eval-n", "2"),
            ("eval-prompts", "3"), ("save-every", "5"), ("keep-checkpoints", "2"), ("export-hf", None),
            ("wandb", "p"), ("verbose", None), ("gpu-memory-utilization", "0.3")]


@pytest.mark.parametrize("flag,value", REFUSALS)
def test_refuses_what_it_cannot_honour(flag, value, tmp_path, capsys, monkeypatch):
    """A train.py flag that drift.py would silently ignore (--kl-coef > 0: no reference model is built; --old-logp
    engine: π_old is always the trainer's; the rest of its audit) ends the command with exit 2 and one line on
    stderr naming the flag and its value, before a model, an engine or a process group starts."""
    def started(*args, **kwargs):
        raise AssertionError("something started before the refusal")
    for mod, name in ((drift.policy, "build_model"), (drift.rollout, "make_engine"), (drift.train, "init_distributed")):
        monkeypatch.setattr(mod, name, started)
    with pytest.raises(SystemExit) as e:
        drift.main(["--out", str(tmp_path), "--", f"--{flag}"] + ([value] if value else []))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--{flag} {value or 'True'} " in err[0], err
    assert not os.listdir(tmp_path)


def test_every_config_field_is_audited():
    """Every Config field is either read as train.py reads it (HONOURED) or refused (REFUSED), never both; a
    field added to Config later fails here until it is classified. The defaults themselves are not refused."""
    from config import Config as C
    names = {f.name for f in dataclasses.fields(C)}
    assert names <= set(drift.REFUSED) | set(drift.HONOURED), names - set(drift.REFUSED) - set(drift.HONOURED)
    assert not set(drift.REFUSED) & set(drift.HONOURED)
    assert drift.refused_flag([]) is None
    assert drift.refused_flag(["--kl-coef", "0", "--old-logp", "trainer", "--lr", "3e-4"]) is None


def test_clip_sides_and_matched_arm_bounds_by_hand():
    """At any old probability the clip is [0.8, 1.2] (ε = 0.2), no-clip [0, 10] (the ratio cap): clip-upper is
    [0, 1.2], clip-lower [0.8, 10]; noclip-matched has no-clip's bounds at lr x f, noclip@0.6 at lr x 0.6."""
    import band
    cfg = resolve_config(Config(method="clip", lr=1e-4))
    p = torch.tensor([1e-3, 0.1, 0.5, 0.99], dtype=torch.float64)
    for arm, lo, hi in (("clip", 0.8, 1.2), ("noclip", 0.0, 10.0), ("clip-upper", 0.0, 1.2), ("clip-lower", 0.8, 10.0),
                        ("noclip-matched", 0.0, 10.0), ("noclip@0.6", 0.0, 10.0)):
        a = drift.arm_config(cfg, arm)
        lower, upper = band.ratio_bounds(p.log(), a.method, delta=a.delta, eps_low=a.eps_low, eps_high=a.eps_high,
                                         max_ratio=a.max_ratio)
        assert torch.allclose(lower, torch.full_like(p, lo), rtol=0, atol=4 * F64), arm  # 1 - 0.2 in float64
        assert torch.allclose(upper, torch.full_like(p, hi), rtol=0, atol=16 * F64), arm
    assert drift.arm_config(cfg, "noclip-matched").lr == pytest.approx(1e-4 * drift.MATCHED_LR, rel=F64)
    assert drift.arm_config(cfg, "noclip@0.6").lr == pytest.approx(0.6e-4, rel=F64)
    assert drift.arm_config(cfg, "clip").lr == 1e-4
    with pytest.raises(ValueError):
        drift.arm_config(cfg, "noclip@1.5")


def test_matched_arm_is_noclip_at_the_smaller_lr(setup):
    """noclip-matched run from the restored snapshot equals a fresh build that trains no-clip with AdamW at lr x f,
    and the arm after it (no-clip) runs at the full lr again: it equals a fresh no-clip build at lr."""
    cfg = setup[0]
    model, opt, batch, adv, probe = start(setup)
    rows = drift.branch(model, opt, cfg, ["noclip-matched", "noclip"], batch, adv, probe, matched_lr=0.5)
    assert rows[0]["lr"] == cfg.lr * 0.5 and rows[1]["lr"] == cfg.lr
    assert all(g["lr"] == cfg.lr for g in opt.param_groups)  # the base trajectory goes on at its own lr
    for row, f in ((rows[0], 0.5), (rows[1], 1.0)):
        fresh, fopt, fbatch, fadv, fprobe = start(setup)
        for g in fopt.param_groups:
            g["lr"] = cfg.lr * f
        ncfg = dataclasses.replace(drift.arm_config(cfg, "noclip"), lr=cfg.lr * f)
        old_logp, old_ent = policy.batch_logprobs(fresh, cfg, fbatch, with_entropy=True)
        ref = drift.arm_update(fresh, fopt, ncfg, fbatch, fadv, old_logp, old_ent, fprobe,
                               drift.probe_logits(fresh, fprobe, cfg))
        assert {k: v for k, v in row.items() if k in ref} == ref
    assert rows[0]["kl"] < rows[1]["kl"]  # the smaller step moves the policy less


def test_merge_into_takes_whole_seeds_only(tmp_path):
    """Seed 0 finished (2 branch points x arms a, b) is added; seed 1 (one branch point of 2) is not; seed 2 repeats
    a committed line with a different reading and is not merged; seed 3 repeats a committed line with the same
    readings (another time_s, a key the committed line lacks): its new arm is added, the repeat kept once. The file
    is gzip -n: merging again adds nothing and leaves the bytes as they were."""
    import gzip
    target = tmp_path / "pairs.jsonl.gz"
    committed = [{"seed": 2, "step": 0, "arm": "a", "dH_probe": 1.0, "time_s": 1},
                 {"seed": 3, "step": 0, "arm": "a", "dH_probe": 2.0, "time_s": 1}]
    with gzip.open(target, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in committed)
    os.makedirs(tmp_path / "run" / "seeds")

    def seed_file(seed, lines):
        with open(tmp_path / "run" / "seeds" / f"s{seed}.jsonl", "w") as f:
            f.writelines(json.dumps(dict(seed=seed, step=t, arm=a, dH_probe=v, time_s=9, lr=1e-4)) + "\n"
                         for t, a, v in lines)
    seed_file(0, [(0, "a", 0.1), (0, "b", 0.2), (1, "a", 0.3), (1, "b", 0.4)])
    seed_file(1, [(0, "a", 0.1), (0, "b", 0.2)])
    seed_file(2, [(0, "a", 1.5), (1, "a", 0.0)])
    seed_file(3, [(0, "a", 2.0), (0, "c", 5.0), (1, "a", 2.5), (1, "c", 6.0)])
    merged, added, skipped = drift.merge_into(str(tmp_path / "run"), str(target), branches=2, every=1)
    assert merged == [0, 3] and added == 4 + 3 and [s for s, _ in skipped] == [1, 2]
    with gzip.open(target, "rt") as f:
        got = [json.loads(x) for x in f]
    assert [(r["seed"], r["step"], r["arm"]) for r in got] == [
        (0, 0, "a"), (0, 0, "b"), (0, 1, "a"), (0, 1, "b"), (2, 0, "a"), (3, 0, "a"), (3, 0, "c"), (3, 1, "a"),
        (3, 1, "c")]
    assert got[4] == committed[0] and got[5] == committed[1]  # committed lines are kept as they were
    before = target.read_bytes()
    assert drift.merge_into(str(tmp_path / "run"), str(target), branches=2, every=1)[1] == 0
    assert target.read_bytes() == before
    fresh = tmp_path / "new" / "pairs.jsonl.gz"  # a first merge makes its folder
    assert drift.merge_into(str(tmp_path / "run"), str(fresh), branches=2, every=1)[:2] == ([0, 2, 3], 10)


def _rows(values, seeds=3, steps=2, kl=None, cells=None, clipped=0):
    """Hand-built lines: arm a's reading at (seed, step) is values[a] + a noise shared by every arm (it cancels in
    each contrast, whose weights sum to 0), so every contrast is constant over seeds: its interval is the point.
    Each update has 1,000 tokens, `clipped` of them held by the bounds (upward) in the arms that clip."""
    cells = cells or [{"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0, "up": 0, "down": 0}]
    rows = []
    for seed in range(seeds):
        for step in range(steps):
            noise = 1e-4 * ((seed * 7 + step * 3) % 5)
            for arm, v in values.items():
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": v * 1e-4 + noise,
                             "dH_probe_is": v * 1e-4 + noise, "dH_train": v * 1e-4 + noise,
                             "kl": (kl or {}).get(arm, 50e-4), "H_probe": 0.1, "ess": 0.5, "tokens": 1000,
                             "n_upper": clipped if arm.startswith("clip") else 0, "n_lower": 0, "cells": cells})
    return rows


def _readings(values, rules=None, **kw):
    import drift_report
    md = drift_report.report(_rows(values, **kw), rules=rules or drift_report.TOY)[0]
    return md[md.index("## Readings"):md.index("## Exploratory")]


def test_band_that_drains_like_clip_upper_does_not_pass():
    """A Band arm whose lines equal clip-upper's: the upper side drains (-1e-4, below 0 by less than the margin), and
    Band-KL − no-clip (-1e-4) lies within ±2.5e-4 — the one condition the rule checked before — but Band-KL −
    clip-upper is exactly 0, not above it: the verdict is not "Band removes the upper side's drain"."""
    r = _readings({"noclip": 0.0, "clip-upper": -1.0, "bandkl": -1.0})
    assert "**the upper side drains, by less than ±2.50e-4**" in r
    assert "**not shown: Band-KL − clip-upper does not lie above 0**" in r
    assert "Band removes" not in r


def test_band_removes_the_upper_sides_drain_by_hand():
    """Upper side -3e-4 (drains), Band-KL − clip-upper +2.5e-4 (above 0), Band-KL − no-clip -0.5e-4 (within ±2.5):
    all three conditions hold. With Band-KL − no-clip at -2.6e-4 (outside the margin) the third fails."""
    assert "**Band removes the upper side's drain**" in _readings({"noclip": 0.0, "clip-upper": -3.0, "bandkl": -0.5})
    r = _readings({"noclip": 0.0, "clip-upper": -3.0, "bandkl": -2.6})
    assert "**not shown: Band-KL − noclip does not lie within ±2.50e-4**" in r
    r = _readings({"noclip": 0.0, "clip-upper": 1.0, "bandkl": 0.0})
    assert "**not read: the upper side's drain is not shown**" in r


def test_two_by_two_sides_and_interaction_by_hand():
    """no-clip 0, clip-upper -3, clip-lower +1 (e-4). clip -2.5: interaction -2.5 + 3 - 1 + 0 = -0.5, within its
    ±1.25 margin: the sides add. clip -4: interaction -2, outside it and below 0: they interact."""
    r = _readings({"noclip": 0.0, "clip-upper": -3.0, "clip-lower": 1.0, "clip": -2.5})
    assert "**the upper side drains**" in r and "**the lower side raises the entropy, by less than ±2.50e-4**" in r
    assert "interaction: clip − clip-upper − clip-lower + noclip: -0.50 ± 0.00e-4" in r
    assert "**the two sides add (within ±1.25e-4)**" in r
    r = _readings({"noclip": 0.0, "clip-upper": -3.0, "clip-lower": 1.0, "clip": -4.0})
    assert "**the sides interact (below 0)**" in r
    assert "a collapse-sized drain is not excluded" not in r  # clip − noclip -4 > -c = -4.71
    r = _readings({"noclip": 0.0, "clip": -5.0})
    assert "**the clip drains the entropy**; a collapse-sized drain is not excluded" in r


def test_brake_and_step_by_hand():
    """KL of noclip-matched equal to the clip's (ratio 1): clip -4, noclip-matched -0.5, no-clip 0 -> brake -3.5
    (below 0, past the margin: the clip's per-token shape), step -0.5 (below 0, within the margin). With
    noclip-matched's KL twice the clip's the steps were not matched and neither is read."""
    r = _readings({"noclip": 0.0, "noclip-matched": -0.5, "clip": -4.0})
    assert "noclip-matched's KL is 1.00x the clip's" in r
    assert "**the clip drains beyond a no-clip step of the same size (its per-token shape)**" in r
    assert "**a smaller step alone lowers the entropy change, by less than ±2.50e-4**" in r
    r = _readings({"noclip": 0.0, "noclip-matched": -0.5, "clip": -4.0}, kl={"noclip-matched": 100e-4})
    assert "**not read: noclip-matched's KL is 2.00x the clip's, outside [0.8, 1.25]: the steps were not matched**" in r
    assert "per-token shape" not in r


def test_smollm2_rules_by_hand():
    """The SmolLM2 plan's numbers from its pilot's probe entropy H = 2.628 nats per token: SESOI = H / 2 / 300 =
    0.00438, c = 0.9 H / 300 = 0.007884, the interaction's margin half the SESOI; 48 seeds. clip − no-clip at
    -50e-4 drains (past ±43.8) with no collapse-sized drain (-50 > -c = -78.84); at -40 it drains by less than the
    margin; the toy's rules read the same -50 as a collapse-sized drain not excluded (c 4.71). An update whose
    clip held 5 of 1,000 tokens (0.5%, under the plan's 1%) reads "cannot test" and no contrast; 20 (2%) is read."""
    import drift_report as d
    assert (d.SMOLLM2.sesoi, d.SMOLLM2.interaction, d.SMOLLM2.k) == (0.00438, 0.00219, 48)
    assert d.SMOLLM2.collapse == pytest.approx(0.007884, rel=F64 * 8)
    r = _readings({"noclip": 0.0, "clip": -50.0}, rules=d.SMOLLM2, clipped=20)
    assert "- the clip acted: it bounded 2.00% of an update's tokens (the plan asks for 1%)" in r
    assert "**the clip drains the entropy**; no collapse-sized drain (lower end -50.00e-4 > -c = -78.84e-4)" in r
    r = _readings({"noclip": 0.0, "clip": -40.0}, rules=d.SMOLLM2, clipped=20)
    assert "**the clip drains the entropy, by less than ±43.80e-4**" in r
    r = _readings({"noclip": 0.0, "clip": -50.0}, clipped=20)  # the toy's rules: no clip-acted check
    assert "**the clip drains the entropy**; a collapse-sized drain is not excluded" in r and "acted" not in r
    r = _readings({"noclip": 0.0, "clip": -50.0}, rules=d.SMOLLM2, clipped=5)
    assert ("- **cannot test: the clip did not act** (it bounded 0.50% of an update's tokens, under the plan's 1%); "
            "no contrast is read") in r and "drains" not in r
    md = d.report(_rows({"noclip": 0.0, "clip": -50.0}, clipped=20), rules=d.SMOLLM2)[0]
    assert "**Interim: 3 of the plan's 48 seeds." in md and "Rules: experiments/results/drift-smollm2/plan.md" in md
    assert "Margins: ±43.80e-4 (the smallest effect of interest), the interaction ±21.90e-4" in md


def test_segments_by_hand():
    """Branch points at rollouts 0, 50 (segment 0–99) and 100, 150 (segment 100–199), 3 seeds. clip − no-clip is
    -1e-4 at every early branch point (interval the point: within ±2.5, below 0 but smaller) and -4 + (seed - 1)
    (e-4) late: seed means -5, -4, -3, sd 1, half-width t(0.975, 2) / sqrt(3) = 4.303 / 1.732 = 2.48: below 0.
    The per-branch sd late is that of (-5, -5, -4, -4, -3, -3): sqrt(4 / 5) = 0.894 -> 0.9. Last minus first segment
    per seed: -4, -3, -2, half-width 2.48 again: below 0."""
    import drift_report
    rows = []
    for seed in range(3):
        for step in (0, 50, 100, 150):
            d = -1.0 if step < 100 else -4.0 + (seed - 1)
            for arm, v in (("noclip", 0.0), ("clip", d)):
                rows.append({"seed": seed, "step": step, "arm": arm, "dH_probe": (v + 0.3 * seed) * 1e-4,
                             "dH_probe_is": 0.0, "dH_train": 0.0, "kl": 50e-4, "H_probe": 0.1 + step * 1e-4,
                             "ess": 0.5, "n_upper": 0, "n_lower": 0, "cells": [
                                 {"p": [0.0, 1.0], "adv": "+", "tokens": 1, "dlogp_sum": 0.0, "dH_sum": 0.0,
                                  "up": 0, "down": 0}]})
    md = drift_report.report(rows, segment=100, plan="later/plan.md")[0]
    assert "**Read by later/plan.md:" in md and "Interim" not in md
    seg = md[md.index("## By segment"):]
    assert "| | rollouts 0–99 | rollouts 100–199 | last − first segment, per seed |" in seg
    assert "| probe entropy (nats per token) | 0.1025 | 0.1125 | |" in seg
    assert "| seeds x branch points | 3 x 2 | 3 x 2 | |" in seg
    assert ("| clip − noclip | -1.00 ± 0.00: no effect of interest (within ±2.5e-4) (below 0, but smaller) | "
            "-4.00 ± 2.48: below 0 | -3.00 ± 2.48: below 0 |") in seg
    assert "| per-branch sd of it (1e-4) | 0.0 | 0.9 | |" in seg


def test_report_sections_labels_and_zero_advantage_tokens():
    """The family table is labelled confirmatory at 99.375%, everything else exploratory; the ESS share appears per
    arm; a cell of zero-advantage tokens (2 per branch point of 5 in all) is counted: 2.0 of 5.0, 40.0%."""
    import drift_report
    cells = [{"p": [0.0, 1.0], "adv": "+", "tokens": 3, "dlogp_sum": 0.3, "dH_sum": 0.0, "up": 0, "down": 0},
             {"p": [0.0, 1.0], "adv": "0", "tokens": 2, "dlogp_sum": 0.1, "dH_sum": 0.0, "up": 0, "down": 0}]
    md = drift_report.report(_rows({"noclip": 0.0, "clip": -1.0}, cells=cells))[0]
    assert "## The family (confirmatory): dH_probe, 99.375% t intervals" in md
    assert "## Exploratory (95% t; not in the family)" in md and "## Token anatomy (exploratory)" in md
    assert "(zero-advantage tokens: 2.0 of 5.0 per rollout, 40.0%)" in md
    assert "| 0–1 | 0 | 2.0 | +0.0500 ± 0.0000 |" in md  # 0.1 / 2 per token
    assert "| clip | 3 |" in md and "| 0.500 (0.500) |" in md


def test_statistics_by_hand():
    """t quantiles against a printed table (3 decimals: ±5e-4): t(0.975, 1) = 12.706, t(0.975, 15) = 2.131,
    t(0.995, 15) = 2.947, t(0.9975, 30) = 3.030. The sign interval of 16 numbers 1..16: the largest k with
    1 - 2 P(Bin(16, 1/2) <= k - 1) >= 0.95 is 4 (P(<= 3) = 697 / 65536), so [x_(4), x_(13)] = [4, 13], coverage
    1 - 1394 / 65536; 5 numbers reach no 95% interval (1 - 2 / 32 = 0.9375). The design effect of seed means (1, 3)
    from branch values (1, 1, 3, 3): var 2 / ((4 / 3) / 2) = 3. Power of a 95% t interval over 4 seeds (sd 1) to
    exclude 0 at a true 2: Φ(2 x 2 - 3.182) = Φ(0.818) = 0.793 (normal table, ±1e-3)."""
    import drift_report as d
    for p, df, t in ((0.975, 1, 12.706), (0.975, 15, 2.131), (0.995, 15, 2.947), (0.9975, 30, 3.030)):
        assert d.t_quantile(p, df) == pytest.approx(t, abs=5e-4)
    med, lo, hi, cov = d.median_interval([float(x) for x in range(16, 0, -1)])
    assert (med, lo, hi) == (8.5, 4.0, 13.0) and cov == pytest.approx(1 - 1394 / 65536, rel=F64 * 16)
    assert math.isnan(d.median_interval([1.0, 2, 3, 4, 5])[1])
    assert d.design_effect([1.0, 3.0], [1.0, 1.0, 3.0, 3.0]) == pytest.approx(3.0, rel=F64 * 16)
    assert d.power(1.0, 4, 2.0, level=0.95) == pytest.approx(0.793, abs=1e-3)
    assert d.equivalence_power(1.0, 4, 0.5, level=0.95) == 0.0  # the half-width 1.59 exceeds the margin
    assert d.label(-1e-4, 0.5e-4) == "no effect of interest (within ±2.5e-4) (below 0, but smaller)"
    assert d.label(-1e-4, 0.5e-4, margin=1.25e-4) == "below 0"


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_probe_readings_equal_the_whole_vocabulary_in_float64(dtype, streamed, monkeypatch):
    """probe_readings widens logits to float64 one chunk of probe rows at a time (SmolLM2's 49k vocabulary would
    make a float64 copy of a probe's logits gigabytes). On a vocabulary slice (V = 96; logits in float32 and in
    bf16, the model's dtypes) read one row at a time, it equals a brute force written here on the whole (B, T, V)
    tensor widened at once: H = -Σ p log p, KL = Σ p_old (log p_old - log p_new), masked token means, at T = 2.
    Tolerance: float64 sums of at most 96 terms per position and 40 positions, terms below log 96 < 5: 1e-12
    relative is ample. And no log-softmax ever sees more than one row. Streamed: the new logits come from a
    function of a slice of rows, 2 rows per call (as arm_update computes them, a micro-batch at a time), and no
    call is asked for more."""
    B, T, V, temp = 5, 8, 96, 2.0
    g = torch.Generator().manual_seed(0)
    old = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
    new = (old.double() + 0.2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).to(dtype)
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    ids = torch.randint(0, V, (B, 2 + T), generator=g)
    probe = RolloutBatch(ids, torch.ones(B, 2 + T, dtype=torch.long), mask, 2)
    seen, inner = [], torch.log_softmax

    def recording(x, dim):
        seen.append(x.shape[0])
        return inner(x, dim)
    monkeypatch.setattr(torch, "log_softmax", recording)
    asked = []

    def streamed_new(rows):
        asked.append(rows)
        return new[rows]
    streamed_new.rows = 2
    got = drift.probe_readings(old, streamed_new if streamed else new, probe, temp,
                               chunk_bytes=8 * T * V)  # one row per chunk
    if streamed:
        assert [(r.start, r.stop) for r in asked] == [(0, 2), (2, 4), (4, 6)]
    monkeypatch.setattr(torch, "log_softmax", inner)
    assert max(seen) == 1 and len(seen) == 2 * B
    lo, ln = (inner(x.double() / temp, -1) for x in (old, new))              # the whole tensor, float64
    m = mask.double()
    H_old, H_new = -(lo.exp() * lo).sum(-1), -(ln.exp() * ln).sum(-1)
    assert got["dH_probe"] == pytest.approx(((H_new - H_old) * m).sum().item() / m.sum().item(), rel=1e-12)
    assert got["kl"] == pytest.approx(((lo.exp() * (lo - ln)).sum(-1) * m).sum().item() / m.sum().item(), rel=1e-12)
    assert got["H_probe"] == pytest.approx(((H_old * m).sum() / m.sum()).item(), rel=1e-12)
    assert got["probe_tokens"] == B * T - 3

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
    still holds that port: a drift.py command must pick its own, as a run from a shell does (test_train.env)."""
    from test_train import env
    return dict(env(), OMP_NUM_THREADS="1")


def _refused(argv, capsys, monkeypatch):
    """drift.main(argv) in this process, where it must refuse before a model, an engine or a process group starts:
    (exit code, what it said)."""
    def started(*args, **kwargs):
        raise AssertionError("something started before the refusal")
    for mod, name in ((drift.policy, "build_model"), (drift.rollout, "make_engine"), (drift.train, "init_distributed")):
        monkeypatch.setattr(mod, name, started)
    with pytest.raises(SystemExit) as e:
        drift.main(argv)
    code = e.value.code
    return code, (code if isinstance(code, str) else "") + capsys.readouterr().err


def _small_run(tmp_path):
    """The command on 2 branch points x 2 arms of seed 0 with --minutes 0.001, then resumed with 3 branch points ->
    (its command, its run, its lines before the resume, the resume's command, its folder)."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "drift.py"), "--seeds", "0,1", "--minutes", "0.001",
           "--arms", "clip,noclip", "--probe-prompts", "4", "--probe-samples", "2", "--out", str(tmp_path),
           "--branches", "2", "--", "--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2",
           "--max-new-tokens", "8", "--train-dtype", "float32", "--rollout-dtype", "float32"]
    done = subprocess.run(cmd, check=True, cwd=ROOT, env=_shell_env(), capture_output=True, timeout=600)
    first = [json.loads(x) for x in open(tmp_path / "pairs.jsonl")]
    resume = list(cmd)
    resume[resume.index("--branches") + 1] = "3"
    resume.insert(resume.index("--"), "--resume")
    subprocess.run(resume, check=True, cwd=ROOT, env=_shell_env(), capture_output=True, timeout=600)
    return cmd, done, first, resume, tmp_path


@pytest.mark.ahead.with_args(_small_run, cpu_s=26)
def test_small_run_minutes_and_resume(ahead, capsys, monkeypatch):
    """The command runs 2 branch points x 2 arms of its first seed and writes the public keys; --minutes 0.001
    (60 ms) lets no second seed start after it, and says so. --resume with more branch points keeps the finished
    lines and adds only the new step. Refused before anything starts, one line each: a run that exists without
    --resume, a seed resumed with another lr, other arms or on another machine, --minutes 0; --skip-merged leaves
    out a merged seed, here all of them."""
    cmd, done, first, resume, tmp_path = ahead.result(_small_run)
    assert b"stopping before seed 1 to end within 0.001 minutes" in done.stderr
    assert [(r["seed"], r["step"], r["arm"]) for r in first] == [(0, 0, "clip"), (0, 0, "noclip"), (0, 1, "clip"),
                                                                 (0, 1, "noclip")]
    for key in ("seed", "step", "arm", "dH_probe", "dH_probe_is", "dH_train", "kl", "cells"):
        assert all(key in r for r in first), key
    code, said = _refused([x for x in resume if x != "--resume"][2:], capsys, monkeypatch)
    assert code and "pass --resume" in said  # an existing run is not overwritten
    again = [json.loads(x) for x in open(tmp_path / "pairs.jsonl")]
    assert again[:4] == first
    assert [(r["step"], r["arm"]) for r in again[4:]] == [(2, "clip"), (2, "noclip")]
    assert all(r["machine"] for r in again)
    # a seed resumes only with the settings it began with: another lr, or other arms, is refused by name
    other_arms = list(resume)
    other_arms[resume.index("--arms") + 1] = "clip"
    record = json.loads((tmp_path / "s0" / "drift.json").read_text())
    assert record["arms"] == ["clip", "noclip"] and record["machine"]
    for bad, name in ((resume + ["--lr", "3e-4"], "began with lr = "), (other_arms, "began with --arms = ")):
        code, said = _refused(bad[2:], capsys, monkeypatch)
        assert code and name in said and len(said.strip().splitlines()) == 1, said
    (tmp_path / "s0" / "drift.json").write_text(json.dumps(dict(record, machine="another CPU")))
    code, said = _refused(resume[2:], capsys, monkeypatch)
    assert code and "began with machine = 'another CPU'" in said, said
    assert [json.loads(x) for x in open(tmp_path / "pairs.jsonl")] == again  # nothing was redone or lost
    minutes = list(resume)
    minutes[resume.index("--minutes") + 1] = "0"
    code, said = _refused(minutes[2:], capsys, monkeypatch)
    assert code == 2 and "--minutes must be above 0, got 0" in said, said
    # a fresh machine leaves out the seeds the committed file holds: here all of them, so nothing starts
    target = tmp_path / "committed.jsonl.gz"
    drift.merge_into(str(tmp_path), str(target), branches=3, every=1)
    seed0 = list(resume)
    seed0[resume.index("--seeds") + 1] = "0"
    assert drift.main(["--skip-merged", str(target)] + seed0[2:]) is None
    assert f"seeds [0] are in {target} already; running none" in capsys.readouterr().err


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

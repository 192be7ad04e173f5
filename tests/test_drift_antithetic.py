"""Antithetic coins (drift.py --antithetic): the flipped coins give exactly -Â, an update from a fresh optimizer on
them is exactly the negated update, the drawn half of a pair is the plain run's line bit for bit, and the pair's
mean keeps the even part of a reading and cancels the odd part (hand-built lines, worked by hand).

Why -Â: group advantages are (r - mean) / (std + eps); with 1 - r the deviations change sign and the std does not.
Why the negated update: on-policy with one mini-batch the loss is linear in Â, so its gradient is -g; AdamW's first
step from zero moments is lr m̂ / (sqrt(v̂) + eps) with m̂ = g, v̂ = g², odd in g; with weight decay 0 and the same
grad-norm clip (‖-g‖ = ‖g‖) the two moves are equal and opposite.
"""

import dataclasses
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import drift  # noqa: E402
import drift_antithetic  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
from config import Config, resolve_config  # noqa: E402
from logprobs import pack  # noqa: E402

F32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def setup(group):
    """test_drift.py's coin shape (4 prompts x 4 samples, 8 tokens, temperature 2), one mini-batch per rollout."""
    cfg = resolve_config(Config(method="clip", reward="random", rollout="hf", prompts_per_step=4, group_size=4,
                                mini_batch_prompts=4, max_new_tokens=8, train_dtype="float32",
                                rollout_dtype="float32", grad_checkpointing=False, share_prompt=False, lr=1e-3,
                                temperature=2.0, weight_decay=0.0))
    engine = rollout.make_engine("hf", cfg.model, dtype="float32")
    records, probe_ids = drift.load_prompts(cfg, engine.tokenizer, 8)
    return cfg, engine, records, probe_ids


def _fresh(setup, step):
    cfg, engine, records, probe_ids = setup
    torch.manual_seed(0)
    model = policy.build_model(cfg, torch.device("cpu"))
    opt = policy.make_optimizer(model, cfg)
    rollout.sync_weights(engine, model)
    batch, adv, flipped = drift.rollout_batch(engine, records, cfg, step, torch.device("cpu"), flip=True)
    sampling = rollout.Sampling(temperature=cfg.temperature, max_new_tokens=8, seed=7)
    probe = pack(probe_ids, engine.generate(probe_ids, 2, sampling), torch.device("cpu"))
    return model, opt, batch, adv, flipped, probe


def _weights(model):
    policy.reshard(model)
    return [p.full_tensor().clone() for p in model.parameters()]


def test_flipped_coins_negate_the_advantages_and_the_first_update(setup):
    cfg = setup[0]
    model, opt, batch, adv, flipped, probe = _fresh(setup, 0)
    assert adv.abs().sum() > 0 and torch.equal(flipped, -adv)                  # exactly, not to rounding
    plain = drift.rollout_batch(setup[1], setup[2], cfg, 0, torch.device("cpu"))
    assert torch.equal(plain[0].input_ids, batch.input_ids) and torch.equal(plain[1], adv)
    theta = _weights(model)
    snap = drift.snapshot(model, opt)
    old_logp, old_ent = policy.batch_logprobs(model, cfg, batch, with_entropy=True)
    probe_old = drift.probe_logits(model, probe, cfg)
    moves = []
    for a in (adv, flipped):
        drift.restore(model, opt, snap)
        drift.arm_update(model, opt, cfg, batch, a, old_logp, old_ent, probe, probe_old)
        moves.append([w - t for w, t in zip(_weights(model), theta)])
    for up, down, t in zip(*moves, theta):
        assert up.abs().max() > 0
        # θ + u and θ - u each round once in float32: the moves agree to an ulp of |θ| + |u| each
        assert torch.all((up + down).abs() <= 2 * F32 * (t.abs() + up.abs()))


def test_drawn_half_is_the_plain_line(setup):
    """branch(..., flipped) returns the plain branch's lines bit for bit (flip 0), then one flipped line per arm,
    and leaves the model on the same weights: the antithetic run's drawn halves are a plain run."""
    cfg = dataclasses.replace(setup[0], mini_batch_prompts=2, weight_decay=0.01)
    arms = ["noclip", "clip"]
    out = []
    for anti in (False, True):
        model, opt, batch, adv, flipped, probe = _fresh((cfg, *setup[1:]), 1)
        rows = drift.branch(model, opt, cfg, arms, batch, adv, probe, flipped=flipped if anti else None)
        out.append((rows, _weights(model)))
    (plain, w0), (anti, w1) = out
    assert [r["flip"] for r in anti] == [0, 0, 1, 1] and [r["arm"] for r in anti] == arms + arms
    assert [{k: v for k, v in r.items() if k != "flip"} for r in anti[:2]] == plain
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert anti[2]["dH_probe"] != anti[0]["dH_probe"] and anti[2]["first_abs_dev"] == 0.0


def _line(seed, step, arm, flip, dh, up=0):
    cells = [{"p": [0.0, 1.0], "adv": "+", "tokens": 4, "dlogp_sum": dh, "dH_sum": 2 * dh, "up": up, "down": 0}]
    return {"seed": seed, "step": step, "arm": arm, "flip": flip, "dH_probe": dh, "dH_probe_is": dh, "kl": 0.5,
            "dH_train": dh, "dlogp_train": dh, "ess": 0.5, "n_upper": up, "n_lower": 0, "first_abs_dev": 0.0,
            "H_probe": 0.1, "H_train": 0.2, "tokens": 4, "time_s": 1.0, "cpu_s": 1.0, "cells": cells}


def test_pair_mean_keeps_the_even_part_by_hand():
    """An arm's reading at branch b is e + o_b on the drawn coins and e - o_b on the flipped ones (dyadic numbers:
    exact). Clip: e = -0.25, noclip: e = 0; odd parts o = 0.5, -1.5, 2.0 (clip) and 1.0, 0.25, -0.75 (noclip).
    The pair means are the even parts alone: clip − noclip = -0.25 at every branch point, sd 0; on the drawn halves
    clip − noclip = -0.25 + (0.5 - 1.0, -1.5 - 0.25, 2.0 + 0.75) = -0.75, -2.0, 2.5: variance ratio 0."""
    rows = []
    for b, (oc, on) in enumerate([(0.5, 1.0), (-1.5, 0.25), (2.0, -0.75)]):
        rows += [_line(0, b, "clip", 0, -0.25 + oc, up=3), _line(0, b, "noclip", 0, on),
                 _line(0, b, "clip", 1, -0.25 - oc, up=1), _line(0, b, "noclip", 1, -on)]
    paired = drift_antithetic.pair_means(rows)
    assert [(r["arm"], r["dH_probe"], r["flip"]) for r in paired] == [("clip", -0.25, "pair"),
                                                                      ("noclip", 0.0, "pair")] * 3
    assert paired[0]["n_upper"] == 2.0 and paired[0]["cells"][0]["up"] == 2.0 and paired[0]["time_s"] == 2.0
    assert paired[0]["cells"][0]["dH_sum"] == -0.5 and paired[0]["H_probe"] == 0.1
    assert drift_antithetic.branch_values(drift_antithetic.drawn(rows), {"clip": 1, "noclip": -1}) == {
        (0, 0): -0.75, (0, 1): -2.0, (0, 2): 2.5}
    (name, n, sx, sy, ratio, lo, hi), = drift_antithetic.compare(rows, [("c", {"clip": 1, "noclip": -1}, 0)])
    assert (n, sy, ratio, lo, hi) == (3, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="seed 0 step 2 arm noclip: an antithetic half without its twin"):
        drift_antithetic.pair_means(rows[:-1])
    odd = [dict(r, H_probe=0.3) if r["flip"] == 1 and r["step"] == 1 and r["arm"] == "clip" else r for r in rows]
    with pytest.raises(ValueError, match="seed 0 step 1 arm clip: the halves differ in H_probe"):
        drift_antithetic.pair_means(odd)
    plain = [{k: v for k, v in r.items() if k != "flip"} for r in rows if r["flip"] == 0]
    assert drift_antithetic.pair_means(plain) == plain   # lines of a plain run pass unchanged


def test_merge_into_keeps_both_halves(tmp_path):
    """A seed of 2 branch points x 2 arms x 2 halves is whole at 8 lines and merged with every line; one missing
    half makes it unfinished."""
    os.makedirs(tmp_path / "run" / "seeds")
    lines = [_line(s, t, a, f, 0.5) for s in (0, 1) for t in (0, 1) for f in (1, 0) for a in ("clip", "noclip")]
    for s in (0, 1):
        mine = [r for r in lines if r["seed"] == s][: 8 if s == 0 else 7]
        (tmp_path / "run" / "seeds" / f"s{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
    merged, added, skipped = drift.merge_into(str(tmp_path / "run"), str(tmp_path / "p.jsonl.gz"), 2, 1)
    assert merged == [0] and added == 8 and skipped == [(1, "7 of 8 lines: not finished")]


def test_refused_without_fair_coins(tmp_path, capsys):
    """--antithetic under a reward that reads the text, or coins of P != 1/2, is one line and exit 2, before
    anything is written (drift.main in this process: the refusal comes before any model or engine)."""
    for reward in ("math-verify", "random:0.3"):
        with pytest.raises(SystemExit) as e:
            drift.main(["--antithetic", "--out", str(tmp_path / "o"), "--", "--reward", reward])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and f"not --reward {reward}" in err
    assert not os.listdir(tmp_path)

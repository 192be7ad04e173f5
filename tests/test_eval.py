"""eval.py: the unbiased pass@k against brute-force enumeration of k-subsets, maj@n, `evaluate` with a fake engine,
and the command line with a stand-in rollout module."""

import itertools
import json
import math
import os
import re
import sys
import types
from dataclasses import dataclass
from fractions import Fraction

import pytest

import eval as evaluation

HUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hub")


def brute_pass_at_k(n, c, k):
    """The fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    """pass@k = 1 - C(n-c, k)/C(n, k) is the probability that k samples drawn without replacement contain a
    correct one (Chen et al. 2021)."""
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):  # float64, <= 10 factors of size <= 1: rounding <= 10 u ~ 1e-15 << 1e-12
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    """The product form stays accurate where the binomials overflow a float (C(1000, 500) ~ 1e299)."""
    for n, c, k in [(200, 3, 7), (1000, 10, 100), (1000, 500, 500), (5000, 1, 1)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # vs a product of k <= 500 float64 factors:
        # relative rounding <= k u ~ 5.5e-14, 1e-12 leaves 18x; a float overflow or a cancellation would be >= 1e-3
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    assert evaluation.pass_at_k(32, 0, 32) == 0.0 and evaluation.pass_at_k(32, 1, 32) == 1.0
    assert evaluation.pass_at_k(32, 8, 1) == pytest.approx(0.25)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            evaluation.pass_at_k(*bad)


def test_ks_and_summarize():
    assert evaluation.ks(32) == [1, 2, 4, 8, 16, 32]
    assert evaluation.ks(6) == [1, 2, 4, 6]
    assert evaluation.ks(1) == [1]
    s = evaluation.summarize([0, 2, 4], 4)
    assert s["prompts"] == 3 and s["mean@4"] == pytest.approx(0.5)
    assert s["pass@1"] == pytest.approx(0.5) and s["pass@4"] == pytest.approx(2 / 3)
    assert s["pass@2"] == pytest.approx((0 + brute_pass_at_k(4, 2, 2) + 1) / 3)
    assert math.isnan(evaluation.summarize([], 4)["mean@4"])


def test_majority_vote():
    assert evaluation.majority_correct(["5", "5", "6"], [1, 1, 0]) is True
    assert evaluation.majority_correct(["6", "5", "6", None, None, None], [0, 1, 0, 0, 0, 0]) is False
    assert evaluation.majority_correct(["5", "6"], [1, 0]) is True  # tie: the answer seen first
    assert evaluation.majority_correct(["6", "5"], [0, 1]) is False
    assert evaluation.majority_correct(["0.5", "\\frac{1}{2}", "3", "3"], [1, 1, 0, 0]) is True  # same key "1/2"
    assert evaluation.majority_correct([None, None], [0, 0]) is False


# --- evaluate with a fake engine ---------------------------------------------------------------------------------
class FakeTokenizer:
    chat_template = "<u>{content}<a>"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "<u>" + messages[0]["content"] + "<a>"

    def __call__(self, texts, add_special_tokens, **ids_only):
        return {"input_ids": [[ord(ch) for ch in t] for t in texts]}


@dataclass
class Completion:
    prompt_index: int
    token_ids: list
    text: str


class FakeEngine:
    """Prompt "<u>id=I c=C ans=A<a>": of its n samples the first C answer A (alternating the two formats), one
    more has no final answer, the rest answer A+1."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, n, sampling):
        self.calls.append((len(prompt_ids), n, sampling))
        out = []
        for i, ids in enumerate(prompt_ids):
            c, a = map(int, re.search(r"c=(\d+) ans=(\d+)", "".join(map(chr, ids))).groups())
            for j in range(n):
                text = (f"Answer: {a}" if j % 2 else f"so \\boxed{{{a}}}") if j < c else \
                       "I am not sure." if j == c else f"Answer: {a + 1}"
                out.append(Completion(i, list(range(j + 1)), text))
        return out


def _records(counts):
    return [{"messages": [{"role": "user", "content": f"id={i} c={c} ans={10 + i}"}], "answer": str(10 + i)}
            for i, c in enumerate(counts)]


def test_evaluate_with_fake_engine():
    n, counts = 4, [0, 1, 4, 2, 3]
    engine = FakeEngine()
    long_one = {"messages": [{"role": "user", "content": "id=9 c=1 ans=1 " + "x" * 100}], "answer": "1"}
    datasets = {"a": _records(counts) + [long_one], "b": _records([4])}
    res = evaluation.evaluate(engine, FakeTokenizer(), datasets, n=n, sampling="S", max_prompt_len=60,
                              batch_size=2, progress=False)
    a = res["a"]
    assert a["correct_counts"] == counts and a["dropped"] == 1 and a["prompts"] == 5
    assert a["mean@4"] == pytest.approx(sum(counts) / (4 * 5))
    for k in (1, 2, 4):
        assert a[f"pass@{k}"] == pytest.approx(sum(brute_pass_at_k(4, c, k) for c in counts) / 5)
    # majority: c=4 and c=3 win outright; c=2 ties A (first) with A+1 -> correct; c=0, c=1 lose
    assert a["maj@4"] == pytest.approx(3 / 5)
    assert a["no_answer"] == pytest.approx(sum(c < n for c in counts) / (4 * 5))
    assert a["mean_tokens"] == pytest.approx(2.5)
    assert res["b"]["mean@4"] == 1.0 and res["b"]["pass@1"] == 1.0
    assert [c[0] for c in engine.calls] == [2, 2, 1, 1] and all(c[1:] == (4, "S") for c in engine.calls)
    empty = evaluation.evaluate(engine, FakeTokenizer(), {"none": []}, n=n, sampling="S", progress=False)
    assert empty["none"]["prompts"] == 0 and empty["none"]["correct_counts"] == []


def test_evaluate_rejects_a_short_engine():
    class Short(FakeEngine):
        def generate(self, prompt_ids, n, sampling):
            return super().generate(prompt_ids, n, sampling)[:-1]

    with pytest.raises(RuntimeError, match="completions"):
        evaluation.evaluate(Short(), FakeTokenizer(), {"a": _records([1])}, n=2, sampling=None, progress=False)


def test_command_line(monkeypatch, tmp_path, capsys):
    """`python eval.py --model M --data aime24,amc23 --n 4`: a table on stdout and a JSON report. rollout.py and
    transformers are replaced by stand-ins that answer every prompt correctly twice out of four."""

    class Engine:
        def generate(self, prompt_ids, n, sampling):
            texts = ["Answer: 14", "Answer: 024", "Answer: 27", "Answer: 9"]  # aime24: 14 and 024 are right
            return [Completion(i, [1, 2], texts[(i + j) % 4] if j < 2 else "none") for i in range(len(prompt_ids))
                    for j in range(n)]

    made = {}

    def make_engine(kind, model_path, **kw):
        made.update(kind=kind, model=model_path, **kw)
        return Engine()

    rollout = types.SimpleNamespace(make_engine=make_engine, DEFAULT_MODEL="tiny",
                                    Sampling=lambda **kw: types.SimpleNamespace(**kw))
    transformers = types.SimpleNamespace(
        AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda path: FakeTokenizer()))
    monkeypatch.setitem(sys.modules, "rollout", rollout)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    out = tmp_path / "report.json"
    evaluation.main(["--model", "some/model", "--data", "aime24,amc23", "--n", "4", "--temperature", "1.0",
                     "--data-dir", HUB, "--out", str(out), "--max-prompt-len", "4096"])
    table = capsys.readouterr().out
    assert "mean@4" in table and "pass@4" in table and "maj@4" in table
    assert re.search(r"^aime24\s+2\s", table, re.M) and re.search(r"^amc23\s+2\s", table, re.M)
    report = json.loads(out.read_text())
    assert made["kind"] == "auto" and made["model"] == "some/model"
    assert report["results"]["aime24"]["correct_counts"] == [1, 1]  # prompt 0 gets texts 0,1; prompt 1 texts 1,2
    assert report["results"]["amc23"]["correct_counts"] == [0, 0]
    with pytest.raises(SystemExit, match="unknown dataset"):
        evaluation.main(["--data", "aime2024"])

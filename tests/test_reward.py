"""reward.py against labelled cases: the default scorer's final answer (the last explicit one -- \\boxed{}, an
`Answer:` line, "the (final) answer is", "####" -- else the last number or math at the end) compared with
math-verify equivalence, on hand-written cases and on 228 real model solutions labelled by the GSM8K authors; the
paper's DAPO rule (last `Answer:` line in the final 300 characters, Minerva normalisation, exact match, +1/-1).
The worker pool that runs math-verify (bounded time, threads, forks) is tested in test_verify_pool.py."""

import json
import os
import re

import pytest

import data
import reward

# (response, reference answer, expected is_correct)
IS_CORRECT_CASES = [
    # --- the DAPO format: the last "Answer:" line ---
    ("Answer: 42", "42", True),
    ("Answer: 41", "42", False),
    ("The sum is 7.\nAnswer: 7", "7", True),
    ("answer: 7", "7", True),
    ("**Answer:** 7", "7", True),
    ("**Final Answer**: 7", "7", True),
    ("Answer: 5.", "5", True),
    ("Answer: $5$", "5", True),
    ("Answer: \\(5\\)", "5", True),
    ("Answer: 024", "24", True),
    ("Answer: 1,000", "1000", True),
    ("Answer: 1\\,000\\,000", "1000000", True),
    ("Answer: 3\nWait, that is wrong.\nAnswer: 4", "4", True),
    ("Answer: 4\nHmm, no.\nAnswer: 3", "4", False),
    ("Answer:\n\n", "5", False),
    ("Answer: 6", "5", False),
    ("Answer: \\$5", "5", True),
    # --- equivalent forms (math-verify) ---
    ("Final Answer: $\\frac{1}{2}$", "0.5", True),
    ("Answer: 0.5", "\\frac{1}{2}", True),
    ("Answer: \\dfrac{3}{4}", "\\frac34", True),
    ("Answer: 5/2", "2.5", True),
    ("Answer: 2.50", "2.5", True),
    ("Answer: \\frac{2}{4}", "\\frac{1}{2}", True),
    ("Answer: -\\frac{1}{2}", "-0.5", True),
    ("Answer: 1/3", "\\frac{1}{3}", True),
    ("Answer: 0.333", "\\frac{1}{3}", False),
    ("Answer: 0.333333", "\\frac{1}{3}", True),  # math-verify rounds to 6 decimals
    ("Answer: 1.4142136", "\\sqrt{2}", True),
    ("Answer: 10\\%", "10", True),  # math-verify's percent rule
    ("Answer: 3x+3", "3(x+1)", True),
    ("Answer: 3y+3", "3(x+1)", False),
    ("Answer: 10\\%", "0.1", True),
    ("Answer: 2\\sqrt{3}", "\\sqrt{12}", True),
    ("Answer: \\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("Answer: (x+1)^2", "x^2+2x+1", True),
    ("Answer: x^2+2x", "x^2+2x+1", False),
    ("Answer: y = 2x + 1", "2x+1", True),
    ("Answer: x = 3", "3", True),
    ("Answer: [2, 5)", "[2,5)", True),
    ("Answer: (2, 5]", "[2,5)", False),
    ("Answer: (1, 2)", "(1,2)", True),
    ("Answer: (2, 1)", "(1,2)", False),
    ("Answer: \\{1, 2\\}", "\\{2, 1\\}", True),
    ("Answer: \\pi", "\\pi", True),
    ("Answer: 3.14", "\\pi", False),
    ("Answer: \\infty", "\\infty", True),
    ("Answer: 5^\\circ", "5", True),
    ("Answer: 3 apples", "3", True),
    ("Answer: 5 \\text{ cm}", "5", True),
    ("Answer: \\text{(C)}", "C", True),
    ("Answer: 100000000000000000001", "100000000000000000000", False),
    ("Answer: -0", "0", True),
    # --- the boxed format (nested braces, several boxes: the last counts) ---
    ("so the total is \\boxed{42}", "42", True),
    ("\\boxed{41}", "42", False),
    ("\\boxed{-5}", "5", False),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", True),
    ("first \\boxed{3}, then on reflection \\boxed{4}", "4", True),
    ("first \\boxed{3}, then on reflection \\boxed{4}", "3", False),
    ("\\boxed{ \\left( 1, 2 \\right) }", "(1,2)", True),
    ("$\\boxed{7}$.", "7", True),
    ("\\boxed{x^{2}}", "x^2", True),
    ("\\boxed{2^{10}}", "1024", True),
    ("\\boxed{\\text{(B)}}", "B", True),
    ("\\fbox{5}", "5", True),
    ("\\boxed{12}", "\\boxed{12}", True),
    ("\\boxed{5} and then \\boxed{6", "5", True),
    ("\\boxed{}", "5", False),
    ("\\boxed{\\boxed{3}}", "3", True),
    # --- both formats: whichever comes last ---
    ("\\boxed{3}\nAnswer: 4", "4", True),
    ("Answer: 4\nso \\boxed{3}", "3", True),
    ("Answer: 4\nso \\boxed{3}", "4", False),
    ("Answer: $\\boxed{5}$", "5", True),
    # --- the other explicit endings: lm-eval-harness gsm8k-cot, Minerva, GSM8K ---
    ("The answer is 5", "5", True),
    ("The answer is 18.", "18", True),
    ("The answer is 18.", "17", False),
    ("So the final answer is $18$", "18", True),
    ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "0.5", True),
    ("The answer is: **18**", "18", True),
    ("The answer is $\\boxed{18}$.", "18", True),
    ("The answer is 18 miles away from home.", "18", True),
    ("The answer is 7 kittens", "7", True),
    ("The answer is 60%", "60", True),  # math-verify's percent rule, as for 10\\%
    ("The answer is -5.", "5", False),
    ("#### 72", "72", True),
    ("#### 1,200", "1200", True),
    ("#### $1,200", "1200", True),
    ("**Answer:** $1,200", "1200", True),
    # --- no explicit final answer: the last number or math at the end (math-verify's last resort) ---
    ("A: 18", "18", True),
    ("She eats 3 + 4 = <<3+4=7>>7 eggs\nA: 9", "9", True),
    ("She makes 9 * 2 = $18 every day.", "18", True),
    ("So she pays $1,200.", "1200", True),
    ("It costs \\$1,200.50 in total.", "1200.5", True),
    ("He runs 45 mph", "45", True),
    ("so each friend gets 3/4", "0.75", True),
    ("so $x = \\frac{1}{2}$", "0.5", True),
    ("She has 5 left.", "7", False),
    ("A: 90,000", "70000", False),
    ("For the thirteenth glass Kylar needs to pay 5 * 1", "64", False),  # cut off mid-sentence
    # --- precedence: an explicit final answer wins over later numbers; the last one if several ---
    ("The answer is 18.\nCheck: 18 - 3 = 15 eggs left", "18", True),
    ("The answer is 18.\nCheck: 18 - 3 = 15 eggs left", "15", False),
    ("The answer is 3.\nWait, I miscounted: the answer is 4.", "4", True),
    ("The answer is 3.\nWait, I miscounted: the answer is 4.", "3", False),
    ("#### 3\nAnswer: 4", "4", True),
    ("\\boxed{3}\nThe answer is 4", "4", True),
    ("The answer is not 5; recounting gives 7", "7", True),  # "answer is" + a word is no final answer
    ("#### Step 2\nSo the total is 7", "7", True),  # nor is a markdown heading
    # --- no final answer ---
    ("I don't know.", "5", False),
    ("", "5", False),
    ("The answer is unclear.", "5", False),
    ("18" + " and more words" * 200, "18", False),  # a number far before the end is no final answer
    (None, "5", False),
    ("Answer: 5", "", False),
    # --- adversarial, answered quickly and wrong ---
    ("Answer: \\frac{1}{0}", "5", False),
    ("\\boxed{9^{9^{9^{9}}}}", "5", False),
]

# (response, reference answer, expected dapo_score)
DAPO_CASES = [
    ("Answer: 42", "42", 1.0),
    ("Answer: 41", "42", -1.0),
    ("\\boxed{42}", "42", -1.0),  # boxes do not count in the paper's rule
    ("answer: 42", "42", 1.0),
    ("Answer: $42$", "42", 1.0),
    ("Answer: 42.", "42", -1.0),  # exact match: a trailing period is not normalised away
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: \\frac{1}{2}", "0.5", -1.0),  # no equivalence beyond Minerva normalisation
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),
    ("Answer: x = 5", "5", 1.0),
    ("Answer: 5 degrees", "5", 1.0),
    ("Answer: \\text{5 cm}", "5", 1.0),
    ("Answer: 5^\\circ", "5", 1.0),
    ("Answer: 42 \\text{ students}", "42", 1.0),
    ("Answer: \\boxed{42}", "42", 1.0),
    ("Answer: $\\$5$", "5", 1.0),
    ("Answer:\n42", "42", 1.0),  # \s* after the colon spans the newline, as in verl
    ("Answer: 3\nAnswer: 4", "4", 1.0),
    ("Answer: 4\nAnswer: 3", "4", -1.0),
    ("Answer: 42" + "x" * 400, "42", -1.0),  # outside the final 300 characters
    ("x" * 400 + "\nAnswer: 42", "42", 1.0),
    ("no answer here", "42", -1.0),
    ("The answer is 42", "42", -1.0),  # the paper's rule reads `Answer:` lines only
    ("#### 42", "42", -1.0),
    ("A: 42", "42", -1.0),
    ("", "42", -1.0),
    (None, "42", -1.0),
]



@pytest.mark.parametrize("response,answer,expected", IS_CORRECT_CASES)
def test_is_correct(response, answer, expected):
    assert reward.is_correct(response, answer) is expected


@pytest.mark.parametrize("response,answer,expected", DAPO_CASES)
def test_dapo_score(response, answer, expected):
    assert reward.dapo_score(response, answer) == expected


def test_score_batch_reward_map():
    responses = ["Answer: 1/2", "no final answer", "\\boxed{3}", "Answer: 0.5"]
    answers = ["0.5", "1", "4", "\\frac{1}{2}"]
    assert reward.score_batch(responses, answers) == [1.0, 0.0, 0.0, 1.0]
    assert reward.score_batch(responses, answers, correct=1, incorrect=-1) == [1, -1, -1, 1]
    assert reward.score_batch(responses, answers, correct=1, incorrect=-1, missing=-2) == [1, -2, -1, 1]
    dapo = reward.score_batch(responses, answers, correct=1, incorrect=-1, missing=-2, scorer="dapo")
    assert dapo == [-1, -2, -2, -1]
    assert reward.score_batch([], []) == []
    with pytest.raises(ValueError, match="scorer"):
        reward.score_batch(["a"], ["b"], scorer="exact")
    with pytest.raises(ValueError, match="answers"):
        reward.score_batch(["a", "b"], ["b"])


def test_extract_answer():
    assert reward.extract_answer("We get \\boxed{\\frac{1}{\\sqrt{2}}}.") == "\\frac{1}{\\sqrt{2}}"
    assert reward.extract_answer("**Answer:** $x=1$.") == "x=1"
    assert reward.extract_answer("\\boxed{1}\nAnswer: 2") == "2"
    assert reward.extract_answer("Answer: 2 \\boxed{1}") == "1"
    assert reward.extract_answer("nothing") is None
    assert reward.extract_answer("The answer is 18.") == "18"
    assert reward.extract_answer("Final Answer: The final answer is $18$. I hope it is correct.") == "18"
    assert reward.extract_answer("The answer is 18 miles away from home.") == "18"
    assert reward.extract_answer("#### 1,200") == "1,200"
    assert reward.extract_answer("The answer is 18.\nCheck: 18 - 3 = 15") == "18"
    # without an explicit final answer, math-verify's reading (parser.py extract_expr): thousands separators go,
    # a decimal comma becomes a point, a percent sign stays
    assert reward.extract_answer("He has 3 + 4 = 7 apples.\nA: 7") == "7"
    assert reward.extract_answer("so she pays $1,200.") == "1200"
    assert reward.extract_answer("so x = 3,5") == "3.5"
    assert reward.extract_answer("so 60% of them") == "60\\%"
    assert reward.extract_answer("so $x = \\frac{1}{2}$ works") == "x = \\frac{1}{2}"


# --- real model outputs labelled by the GSM8K authors ------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTIONS = os.path.join(ROOT, "tests", "fixtures", "gsm8k_model_solutions", "example_model_solutions.jsonl")
MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
ENDINGS = {"Answer:": "Answer: {}", "**Answer:**": "**Answer:** {}", "####": "#### {}",
           "the answer is": "The answer is {}.", "boxed": "So the answer is $\\boxed{{{}}}$.", "bare last line": "{}",
           "Minerva": "Final Answer: The final answer is ${}$. I hope it is correct."}


def labelled_solutions():
    """(solution, reference N, the authors' label) for each of the 228 model solutions in the fixture. N is the
    reference solution's last line "A: N", checked against GSM8K's own "#### N" for the same problem."""
    rows = [json.loads(line) for line in open(SOLUTIONS)]
    with open(os.path.join(ROOT, "data", "gsm8k", "test.jsonl")) as f:
        problems = [json.loads(line) for line in f][:len(rows)]
    out = []
    for row, problem in zip(rows, problems, strict=True):
        gold = re.fullmatch(r"(?s).*\nA: (\S+)", row["ground_truth"])[1]
        assert row["question"] == problem["question"] and problem["answer"].endswith("\n#### " + gold)
        out += [(row[m]["solution"], gold, row[m]["is_correct"]) for m in MODELS]
    return out


def with_ending(solution, template):
    """The solution with its last line "A: N" written as `template` (N verbatim); unchanged if cut off before it."""
    return re.sub(r"\nA: (\S+)$", lambda m: "\n" + template.format(m[1]), solution)


def agreement(scores, items):
    return sum((score == 1.0) == label for score, (_, _, label) in zip(scores, items, strict=True)) / len(items)


def test_gsm8k_model_solutions_agree_with_the_authors_labels():
    """The default scorer agrees with the GSM8K authors' labels on >= 99% of 228 real solutions (GPT-3 6B/175B,
    ending in "A: N"; 79 correct). Reading only `Answer:` lines and boxes, it agreed on 65.4% (all read as wrong)."""
    items = labelled_solutions()
    assert len(items) == 228 and sum(label for *_, label in items) == 79
    scores = reward.score_batch([s for s, _, _ in items], [g for _, g, _ in items])
    assert agreement(scores, items) >= 0.99


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_gsm8k_model_solutions_with_other_endings(ending):
    """The same labelled solutions, their last line "A: N" rewritten into another common ending with the same N (so
    the authors' labels still hold): the default scorer still agrees with >= 99% of the labels."""
    original = labelled_solutions()
    items = [(with_ending(s, ENDINGS[ending]), g, label) for s, g, label in original]
    assert sum(new != old for (new, _, _), (old, _, _) in zip(items, original)) == 226  # all but the 2 cut off
    scores = reward.score_batch([s for s, _, _ in items], [g for _, g, _ in items])
    assert agreement(scores, items) >= 0.99


def test_gsm8k_model_solutions_dapo_keeps_the_papers_rule():
    """scorer="dapo" is the paper's rule, unchanged: it reads `Answer:` lines only, so every original solution (none
    contains the word "answer") scores -1; rewritten to end in "Answer: N", a solution scores +1 exactly when N,
    Minerva-normalised (for a plain number: thousands commas dropped), equals the reference N -- which agrees with
    the authors' labels on >= 99%."""
    items = labelled_solutions()
    assert not any("answer" in s.lower() for s, _, _ in items)
    assert reward.score_batch([s for s, _, _ in items], [g for _, g, _ in items], correct=1.0, incorrect=-1.0,
                              scorer="dapo") == [-1.0] * len(items)
    expected = []
    for s, gold, _ in items:
        n = re.search(r"\nA: (\S+)$", s)
        n = None if n is None else n[1].replace(",", "") if n[1].replace(",", "").isdigit() else n[1]
        expected.append(1.0 if n == gold else -1.0)
    rewritten = [(with_ending(s, "Answer: {}"), g, label) for s, g, label in items]
    assert [reward.dapo_score(s, g) for s, g, _ in rewritten] == expected
    assert agreement(expected, rewritten) >= 0.99


@pytest.mark.parametrize("level", sorted(data.LEVELS))
def test_synthetic_task_answers(level):
    """The synthetic task's answer format is scored by the same reward: the perfect response is correct under
    both scorers, a wrong number is not."""
    records = data.arithmetic(50, split="train", levels=(level,), seed=level)
    perfect = [data.arithmetic_response(r["answer"]) for r in records]
    wrong = [data.arithmetic_response(str(int(r["answer"]) + 1)) for r in records]
    answers = [r["answer"] for r in records]
    assert all(reward.is_correct(p, a) for p, a in zip(perfect, answers))
    assert not any(reward.is_correct(w, a) for w, a in zip(wrong, answers))
    assert all(reward.dapo_score(p, a) == 1.0 for p, a in zip(perfect, answers))
    assert reward.score_batch(perfect + wrong, answers + answers) == [1.0] * 50 + [0.0] * 50


def test_unevaluated_arithmetic_is_not_a_final_answer():
    """math-verify itself accepts "93*95" for 8835 (it evaluates the expression), which lets a policy echo the
    question; is_correct does not, for plain numbers joined by + - * / and their LaTeX forms, while real final
    forms still pass: a fraction, a negative number, a surd, a number after a worked equation."""
    import math_verify
    assert math_verify.verify(math_verify.parse("8835"), math_verify.parse("$93*95$"))  # the hole, in the package
    for echo, gold in [("93*95", "8835"), ("795 + 535", "1330"), ("25-80", "-55"), ("3 \\times 4", "12"),
                       ("12 \\div 4", "3"), ("1.5*2", "3")]:
        assert not reward.is_correct(f"Answer: {echo}", gold), echo
    for good, gold in [("8835", "8835"), ("-55", "-55"), ("1/2", "0.5"), ("\\frac{3}{4}", "0.75"),
                       ("2\\sqrt{3}", "\\sqrt{12}")]:
        assert reward.is_correct(f"Answer: {good}", gold), good
    assert reward.is_correct("so 47+38 = 85", "85")  # the last number of a worked line is still read
    assert reward.is_correct("Answer: 93*95", "93*95")  # a reference that is itself an expression: equal texts


def test_random_rewards_ignore_the_text_and_repeat_for_a_seed():
    """--reward random: a coin per completion, seeded by (seed, step, rank), independent of the text.

    Checked against numpy's own generator on the same seed sequence (the draw is defined as its uniforms below P),
    and statistically: over 20,000 coins at P = 0.3 the share of 1s lies within 5 binomial s.d. of P.
    """
    np = pytest.importorskip("numpy")
    seed = (3, 17, 1)
    a = reward.random_rewards(64, 0.5, seed)
    assert a == reward.random_rewards(64, 0.5, seed)  # repeats for a seed (any method: no text is read)
    assert a != reward.random_rewards(64, 0.5, (3, 18, 1)) and a != reward.random_rewards(64, 0.5, (3, 17, 0))
    expected = [1.0 if u < 0.5 else 0.0 for u in np.random.default_rng([3, 17, 1]).random(64)]
    assert a == expected
    assert reward.random_rewards(4, 0.5, seed, correct=1.0, incorrect=-1.0) == [
        1.0 if x else -1.0 for x in expected[:4]]
    n, p = 20_000, 0.3
    share = sum(reward.random_rewards(n, p, (0, 0, 0))) / n
    assert abs(share - p) < 5 * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("scorer, p", [("random", 0.5), ("random:0.25", 0.25), ("math-verify", None),
                                       ("dapo", None)])
def test_random_probability(scorer, p):
    assert reward.random_probability(scorer) == p


@pytest.mark.parametrize("scorer", ["random:0", "random:1", "random:x", "random:nan"])
def test_random_probability_rejects_a_non_probability(scorer):
    with pytest.raises(ValueError, match="0 < P < 1"):
        reward.random_probability(scorer)

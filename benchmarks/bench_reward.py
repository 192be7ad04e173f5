"""Throughput of reward.py on typical completions, and its latency on adversarial ones.

Typical completions: ~1.5 kB of reasoning with inline LaTeX, then the final answer as an `Answer:` line or a
\\boxed{}; groups of 16 samples per prompt (the paper's rollout), 40% right, 10% right in another form (0.5 for
\\frac{1}{2}, \\sqrt{12} for 2\\sqrt{3}, ...), 40% wrong, 10% cut off before a final answer (the default scorer
then reads the last math of the reasoning, math-verify's last resort, and most such pairs go to math-verify; the
"dapo" scorer reads nothing). The reference answers:
"integer" is AIME / AMC / DAPO-Math-17k (whose answers are all integers); "paper's training mix" is DAPO-Math-17k
+ MATH levels 3-5 (~90% integers); "MATH-500-like" ~60% integers, the rest fractions, radicals, expressions with a
variable and intervals; the last row has no integer answer at all (every distinct answer goes to math-verify).
The verdict cache of machinery/verify_pool.py is emptied before every row, so each row pays for its
own math-verify calls (math-verify's own parse cache in the workers stays warm, as in training).

Then agreement with the GSM8K authors' correctness labels on 228 real model solutions
(tests/fixtures/gsm8k_model_solutions), and the time taken: the default scorer, scorer="dapo", and math-verify's
own parse + verify applied to each whole completion (in this process, one after the other).

    python benchmarks/bench_reward.py            # prints a table; the target is >= 1,000 scores/s
"""

import json
import logging
import os
import platform
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reward  # noqa: E402
from machinery import verify_pool  # noqa: E402

FILLER = ("We expand $(a+b)^2 = a^2 + 2ab + b^2$ and use $\\frac{x}{y}$ with $y \\neq 0$, so the sum over "
          "$\\{1, \\dots, n\\}$ is $\\frac{n(n+1)}{2}$. Checking the case $n = 3$ again gives the same value. ") * 8


def math_answer(rng, kind):
    """(reference, an equivalent other form, a wrong answer) of one kind."""
    a, b = rng.randint(2, 999), rng.randint(2, 97)
    if kind == "int":
        return str(a), f"{a}.0", str(a + rng.choice([-1, 1, 10]))
    if kind == "frac":
        return f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{2 * a}}}{{{2 * b}}}", f"\\frac{{{a + 1}}}{{{b}}}"
    if kind == "sqrt":
        return f"{b}\\sqrt{{3}}", f"\\sqrt{{{3 * b * b}}}", f"{b}\\sqrt{{2}}"
    if kind == "interval":
        return f"[{b}, {a})", f"[{b},{a})", f"({b}, {a}]"
    return f"{b}x^2+{a}", f"{a}+{b}x^2", f"{b}x^2-{a}"  # an expression with a variable


def completions(rng, prompts, kinds, group=16):
    """kinds: {kind: weight} of the reference answers."""
    responses, answers = [], []
    for _ in range(prompts):
        ref, other, wrong = math_answer(rng, rng.choices(list(kinds), weights=list(kinds.values()))[0])
        for _ in range(group):
            u = rng.random()
            final = ref if u < 0.4 else other if u < 0.5 else wrong if u < 0.9 else None
            endings = [f"\n\nAnswer: {final}", f"\n\nSo the answer is $\\boxed{{{final}}}$."]
            tail = "" if final is None else rng.choice(endings)
            responses.append(FILLER[: rng.randint(800, len(FILLER))] + tail)
            answers.append(ref)
    return responses, answers


def labelled_solutions():
    """(solution, reference N, the authors' label) for the 4 model solutions of each fixture problem."""
    path = os.path.join(ROOT, "tests", "fixtures", "gsm8k_model_solutions", "example_model_solutions.jsonl")
    rows = [json.loads(line) for line in open(path)]
    return [(row[m]["solution"], re.search(r"\nA: (\S+)$", row["ground_truth"])[1], row[m]["is_correct"])
            for row in rows for m in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")]


def agreement_rows():
    from math_verify import parse, verify  # deferred: the rows before run without it in this process, as a trainer

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    solutions, golds, labels = zip(*labelled_solutions())
    rows = []
    for name, fn in [("default scorer (score_batch)", lambda: [s == 1.0 for s in reward.score_batch(solutions, golds)]),
                     ("scorer='dapo'", lambda: [s == 1.0 for s in reward.score_batch(solutions, golds, scorer="dapo")]),
                     ("math-verify parse + verify of each whole completion",
                      lambda: [verify(parse(g), parse(s)) for s, g in zip(solutions, golds)])]:
        seconds, verdicts = timed(fn)
        rows.append((name, sum(v == label for v, label in zip(verdicts, labels)) / len(labels), seconds))
    return len(labels), rows


def timed(fn):
    verify_pool._CACHE.clear()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main():
    rng = random.Random(0)
    rows = []

    # cold start: the first call that needs math-verify also starts the worker processes
    seconds, _ = timed(lambda: reward.is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"))
    rows.append(("first math-verify call (starts the workers)", 1, seconds))

    integers = completions(rng, 256, {"int": 1})
    paper = completions(rng, 256, {"int": 90, "frac": 4, "sqrt": 2, "expr": 3, "interval": 1})
    mixed = completions(rng, 256, {"int": 60, "frac": 14, "sqrt": 8, "expr": 10, "interval": 8})
    hard = completions(rng, 64, {"frac": 1, "sqrt": 1, "interval": 1, "expr": 1})
    for name, (responses, answers) in [("score_batch, integer answers (AIME/AMC/DAPO)", integers),
                                       ("score_batch, paper's training mix", paper),
                                       ("score_batch, MATH-500-like mix", mixed),
                                       ("score_batch, no integer answers", hard)]:
        seconds, _ = timed(lambda: reward.score_batch(responses, answers, correct=1.0, incorrect=-1.0))
        rows.append((name, len(responses), seconds))
    responses, answers = mixed
    seconds, _ = timed(lambda: reward.score_batch(responses, answers, correct=1.0, incorrect=-1.0, scorer="dapo"))
    rows.append(("score_batch, scorer='dapo' (paper's exact match)", len(responses), seconds))
    seconds, _ = timed(lambda: [reward.is_correct(r, a) for r, a in zip(responses[:1024], answers[:1024])])
    rows.append(("is_correct one by one, main thread, MATH-500-like", 1024, seconds))
    with ThreadPoolExecutor(4) as ex:
        seconds, _ = timed(lambda: list(ex.map(reward.is_correct, responses[:1024], answers[:1024])))
    rows.append(("is_correct from 4 threads, MATH-500-like", 1024, seconds))

    print(f"# reward.py on {platform.machine()} ({os.cpu_count()} cores), Python {platform.python_version()}, "
          f"{verify_pool.NUM_WORKERS} math-verify workers")
    print(f"{'case':<52}{'items':>7}{'seconds':>10}{'scores/s':>11}")
    for name, items, seconds in rows:
        print(f"{name:<52}{items:>7}{seconds:>10.3f}{items / seconds:>11.0f}")

    adversarial = {"\\boxed{9^{9^{9^{9}}}}": "so \\boxed{9^{9^{9^{9}}}}", "1 MB string": "a " * 500_000 + "Answer: 5",
                   "20,000 unbalanced \\boxed{": "\\boxed{" * 20_000, "\\frac{1}{0}": "\\boxed{\\frac{1}{0}}",
                   "(9^9)!": "\\boxed{(9^9)!}", "1 MB of braces": "{" * 500_000 + "}" * 500_000}
    print(f"\n{'adversarial input (is_correct, worst of 3 refs)':<52}{'seconds':>10}")
    for name, text in adversarial.items():
        worst = max(timed(lambda: reward.is_correct(text, ref))[0] for ref in ("5", "\\frac{1}{2}", "x+1"))
        print(f"{name:<52}{worst:>10.3f}")
    n, rows = agreement_rows()
    title = f"agreement with the GSM8K authors' labels ({n} solutions)"
    print(f"\n{title:<56}{'agree':>6}{'seconds':>10}")
    for name, share, seconds in rows:
        print(f"{name:<56}{share:>6.1%}{seconds:>10.3f}")
    print(f"\nworker timeouts/restarts so far: {reward.STATS}")


if __name__ == "__main__":
    main()

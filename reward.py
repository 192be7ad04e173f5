"""Math reward: is the completion's final answer equal to the reference? (docs/paper.md §4)

`score_batch(responses, answers, correct=, incorrect=, missing=, scorer=)` is the reward map of
train.py and eval.py (`missing`: an optional penalty for no final answer). Two scorers, and a
control that reads no text (`random_rewards`, train.py's `--reward random`):

- `is_correct` (scorer "math-verify", the default): the last explicit final answer (`\\boxed{}`,
  `Answer:`, "the (final) answer is", `####`), else the last number or math at the end of the
  text, compared through math-verify (1/2 = 0.5 = \\dfrac12, 2\\sqrt3 = \\sqrt{12}, intervals, sets).
- `dapo_score`: the paper's reward, as verl's `math_dapo.py::compute_score`: the last `Answer:`
  line of the final 300 characters, Minerva-normalised, exact string match, +1 / -1.

Departures (docs/design.md#choices-and-departures): the default is more lenient than the authors'
exact match (`scorer="dapo"` is their rule); against math-verify, the later of two explicit answers
wins, and "93*95" is not a final answer when the reference is a plain number (the echo).

Never hangs, and no text makes it raise: one linear-time regex pass over the last MAX_SCAN_CHARS
characters, plain numbers compared exactly here (`fractions.Fraction`), the rest in math-verify
workers under a CPU-time limit (machinery/verify_pool.py), safe from any thread. Where math-verify
cannot run at all, scoring raises verify_pool.Unavailable rather than score answers wrong.
Agreement with 228 labelled GSM8K solutions, and throughput: docs/benchmarks.md#reward.

    python reward.py 'so the total is \\boxed{\\dfrac{1}{2}}' '0.5'   # both scorers' verdicts
"""

import logging
import re
import sys
from fractions import Fraction

import numpy as np

from machinery import verify_pool

log = logging.getLogger("reward")

MAX_ANSWER_CHARS = 1000   # longer extracted answers (or references) are compared as strings only
MAX_SCAN_CHARS = 200_000  # look for the final answer in this many last chars (4096 tokens ~ 16k)
TAIL_CHARS = 2000         # with no explicit final answer, the last math in these last chars counts
STATS = verify_pool.STATS  # math-verify CPU overruns, worker restarts, crashes: for a metrics line

# --- final-answer extraction ---------------------------------------------------------------------
# 1. Explicit final answers, the last one in the text: a box, or the rest of the line after a
#    marker. "answer is" must not be followed by a word ("the answer is not 5", "the answer is
#    correct"), nor "####" by anything but a number or math (a markdown heading "#### Step 2" is no
#    answer).
_BRACES = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# Answer: / the answer is
_ANSWER_MARKER = re.compile(r"(?i)answer(?:[ \t*]*:\s*|\s+is\b[ \t*:]*+(?![a-z]{2}))")
# a separate regex: its literal prefix keeps both fast
_GSM8K_MARKER = re.compile(r"####[ \t]*+(?=[-$\\\d.])")
# "$18$. I hope it is correct." (Minerva's prompt) -> "$18$"
_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z])")
# "18 miles away", "$18 per day", "60 percent": the number (math-verify reads the same)
_UNITS_AFTER = re.compile(
    r"\$?(-?\d+(?:,\d{3})*(?:\.\d+)?)\s*(\\?%|percent\b)?"
    r"(?(2)|,?\s+(?!(?:and|or)\b)[a-z]{2})", re.I)
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# 2. Otherwise math-verify's last resort (parser.py: the priority-300 patterns of lazy_latex_regex
#    and lazy_expr_regex): of the LaTeX environments, numbers and arithmetic expressions, the one
#    that ends last, the longest on ties. Read in the last TAIL_CHARS characters only, with bounded
#    or possessive repeats, so that it stays linear-time. Departures: expressions do not span lines,
#    "1 234" is not a thousands separator, and the last match counts even if sympy cannot parse it
#    (math-verify would try the one before).
_TAIL_LATEX = re.compile(r"\$\$(?<!\\\$\$)((?:[^$]|\$(?!\$)){1,1000}?)(?<!\\)\$\$"  # literal 1st
                         r"|\\\[(?<!\\\\\[)((?:[^\\]|\\(?!\])){1,1000}?)(?<!\\)\\\]"
                         r"|\$(?<![\\\d]\$)((?:\\\$|[^\n$]){1,500}?)(?<!\\)\$"
                         r"|\\\((?<!\\\\\()((?:[^\\\n]|\\(?!\))){1,500}?)(?<!\\)\\\)"
                         r"|(-?\\frac\{-?\d+(?:\.\d+)?\}\{-?\d+(?:\.\d+)?\})")
# 1,234.5 | 3.5 or 3,5 | .5
_NUM = r"(?:-?[1-9]\d{0,2}(?:,\d{3})++(?:\.\d+)?|-?\d++(?:[.,]\d+)?|\.\d+)"
# after a space, "=" or the start; maybe bold, with a currency sign; then operators
_TAIL_NUMBER = re.compile(
    rf"(?<![^\s=])(?:\*\*)?\\?[$€£¥]?({_NUM}(?:[ \t]*+[-+*/^×÷][ \t]*+{_NUM})*+)"
    rf"(\s*(?:\\?%|[Pp]ercent|[Pp]ct))?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _last_box(text):
    """(start, end, content) of the last complete \\boxed{...}/\\fbox{...} in one pass, or None."""
    stack, last = [], None  # stack holds (is_box, start of the command, index after its "{")
    for m in _BRACES.finditer(text):
        tok = m.group()
        if tok != "}":
            stack.append((tok != "{", m.start(), m.end()))
        elif stack:
            is_box, start, inner = stack.pop()
            if is_box and (last is None or start > last[0]):
                last = (start, m.end(), text[inner:m.start()])
    return last


def _clean(s):
    """Strip what surrounds an answer: spaces, markdown bold, math delimiters, a final period,
    currency signs."""
    s = s.replace("\\$", "").strip().rstrip(".").strip().strip("*`").strip().rstrip(".").strip()
    for a, b in _DELIMITERS:
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):len(s) - len(b)].strip().rstrip(".").strip()
            break
    return s


def _marker_answer(line):
    """The answer in the rest of a marker's line: its first sentence, cleaned; a number followed by
    words or a percent sign ("18 miles away from home", "60%") is that number."""
    s = _clean(_SENTENCE_END.split(line, 1)[0])
    m = _UNITS_AFTER.match(s)
    return (m[1] + ("\\%" if m[2] else "")) if m else s


def _tail_answer(text):
    """math-verify's reading of a completion with no explicit final answer: its last math."""
    tail = text[-TAIL_CHARS:]
    if len(text) > TAIL_CHARS:
        tail = re.sub(r"\A\S+", "", tail)  # do not read the end of a token that the window cuts
    found = [((m.end(), -m.start()), next(g for g in m.groups() if g is not None).strip())
             for m in _TAIL_LATEX.finditer(tail)]
    for m in _TAIL_NUMBER.finditer(tail):  # as math-verify's extract_expr: 1,234->1234, 3,5->3.5
        found.append(((m.end(), -m.start()),
                      _THOUSANDS.sub("", m[1]).replace(",", ".") + ("\\%" if m[2] else "")))
    return next((answer for _, answer in sorted(found, reverse=True) if answer), None)


def _last_match(regex, text):
    last = None
    for last in regex.finditer(text):
        pass
    return last


def extract_answer(response):
    """The final answer of `response` as a string, or None when it has none.

    An explicit final answer first, the last one in the text: a `\\boxed{}`, or the rest of the line
    after `Answer:`, `the (final) answer is` or `####`. A box on that line wins
    (``Answer: $\\boxed{5}$`` -> "5"); an unbalanced last box is skipped in favour of the last
    complete one. Without one (or when all are empty), the last number, arithmetic expression or
    LaTeX environment at the end of the text (math-verify's last resort).
    """
    if not isinstance(response, str):
        return None
    response = response[-MAX_SCAN_CHARS:]
    box = _last_box(response)
    found = [] if box is None else [(box[0], _clean(box[2]))]
    for head in (_last_match(_ANSWER_MARKER, response), _last_match(_GSM8K_MARKER, response)):
        if head is not None:
            end = response.find("\n", head.end())
            found.append((head.start(),
                          _marker_answer(response[head.end():end if end >= 0 else None])))
    return (next((answer for _, answer in sorted(found, reverse=True) if answer), None)
            or _tail_answer(response))


# --- fast exact paths (no sympy) ------------------------------------------------------------------
_FORMATTING = re.compile(r"\\[!,;: ]|\\left|\\right|\s+|\$")
_INTEGER_PART = r"([+-]?)(\d{1,3}(?:,\d{3})+|\d{1,100})"
_DECIMAL = re.compile(rf"^{_INTEGER_PART}(?:\.(\d{{1,100}}))?$")
_FRACTION = re.compile(r"^([+-]?)(?:\\frac\{(\d{1,100})\}\{(\d{1,100})\}|(\d{1,100})/(\d{1,100}))$")
# plain numbers joined by + - * / and their LaTeX forms, after _normalize: "93*95", "3\times4"
_PLAIN_NUM = r"[+-]?\d{1,100}(?:\.\d{1,100})?"
_ARITHMETIC = re.compile(
    rf"^{_PLAIN_NUM}(?:(?:[-+*/×·÷]|\\times|\\cdot|\\div){_PLAIN_NUM}){{1,50}}$")


def _normalize(s):
    """Formatting-only normalisation: equal results mean the same mathematical text."""
    s = _FORMATTING.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _number(s):
    """(Fraction, is_decimal) for a plain number (n, 1,234, -3.25, a/b, \\frac{a}{b}); else None."""
    m = _DECIMAL.match(s)
    if m:
        sign, whole, frac = m.groups()
        value = Fraction(int(whole.replace(",", "") + (frac or "")), 10 ** len(frac or ""))
        return (-value if sign == "-" else value), frac is not None
    m = _FRACTION.match(s)
    if m:
        sign, a, b, c, d = m.groups()
        num, den = int(a or c), int(b or d)
        if den == 0:
            return None
        return (-Fraction(num, den) if sign == "-" else Fraction(num, den)), False
    return None


def _quick_verdict(pred, gold):
    """True/False when decidable without sympy, None when math-verify must decide."""
    p, g = _normalize(pred), _normalize(gold)
    if p and p == g:
        return True
    np_, ng = _number(p), _number(g)
    if np_ is not None and ng is not None:
        if np_[0] == ng[0]:
            return True
        if not (np_[1] or ng[1]):
            return False  # integers and fractions are exact; math-verify rounds only decimals
    if ng is not None and np_ is None and _ARITHMETIC.match(p):
        return False  # unevaluated arithmetic ("93*95" for 8835) is no final answer (see top)
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    return None


def _verdict(pred, gold):
    quick = _quick_verdict(pred, gold)
    return quick if quick is not None else verify_pool.verify(pred, gold)


def _reference(answer):
    """The reference answer as a clean string (a reference may itself be boxed or $-delimited)."""
    if not isinstance(answer, str):
        answer = "" if answer is None else str(answer)
    if len(answer) <= 10 * MAX_ANSWER_CHARS and ("\\boxed" in answer or "\\fbox" in answer):
        box = _last_box(answer)
        if box is not None:
            return _clean(box[2])
    return _clean(answer)


# --- public API -----------------------------------------------------------------------------------
def is_correct(response, answer):
    """Whether the final answer of `response` equals the reference `answer` (as math-verify).
    Raises only verify_pool.Unavailable, when math-verify cannot run."""
    try:
        pred, gold = extract_answer(response), _reference(answer)
        return bool(pred) and bool(gold) and _verdict(pred, gold)
    except verify_pool.Unavailable:
        raise  # no verdict at all, rather than a wrong one
    except Exception:  # noqa: BLE001  (no text makes it raise)
        log.debug("is_correct failed", exc_info=True)
        return False


def answer_key(pred):
    """A canonical form of an extracted answer for grouping equal answers (maj@n): formatting
    stripped, plain numbers as reduced fractions ("0.50", "1/2" and "\\dfrac{1}{2}" share a key)."""
    p = _normalize(pred)
    number = _number(p)
    return str(number[0]) if number is not None else p


def score_batch(responses, answers, *, correct=1.0, incorrect=0.0, missing=None,
                scorer="math-verify"):
    """Rewards for a batch: `correct` / `incorrect`, or `missing` (None = `incorrect`) when there is
    no final answer.

    scorer "math-verify" uses `is_correct`'s rule, "dapo" the paper's exact-match rule
    (`dapo_score`). Distinct (answer, reference) pairs that need math-verify are checked once each,
    in parallel over the worker pool. Raises ValueError only for a caller error (unknown scorer,
    lengths that differ), never for any text; verify_pool.Unavailable when math-verify cannot run.
    """
    responses, answers = list(responses), list(answers)
    if len(responses) != len(answers):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
    if scorer not in ("math-verify", "dapo"):
        raise ValueError(f"unknown scorer {scorer!r}; expected 'math-verify' or 'dapo' (random "
                         f"rewards read no text: random_rewards)")
    miss = incorrect if missing is None else missing
    if scorer == "dapo":
        out = []
        for r, a in zip(responses, answers):
            pred = _dapo_extract(r)
            out.append(miss if pred is None else correct if _dapo_match(pred, a) else incorrect)
        return out

    pairs = []  # (pred, gold, verdict): verdict None until math-verify decides
    for r, a in zip(responses, answers):
        try:
            pred, gold = extract_answer(r), _reference(a)
            verdict = None if not pred else (False if not gold else _quick_verdict(pred, gold))
        except Exception:  # noqa: BLE001
            pred, gold, verdict = "", "", False
        pairs.append((pred, gold, verdict))
    slow = list(dict.fromkeys((pred, gold) for pred, gold, verdict in pairs
                              if pred and verdict is None))
    slow = dict(zip(slow, verify_pool.verify_all(slow)))  # each distinct pair once
    return [miss if not pred
            else correct if (verdict if verdict is not None else slow[pred, gold]) else incorrect
            for pred, gold, verdict in pairs]


# --- the control: rewards that ignore the text ---------------------------------------------------
def random_probability(scorer):
    """P of a `random` (P = 0.5) or `random:P` scorer, None for a scorer that reads the text.
    Raises ValueError naming the value when P is not a probability."""
    if scorer != "random" and not scorer.startswith("random:"):
        return None
    text = scorer.partition(":")[2] or "0.5"
    try:
        p = float(text)
    except ValueError:
        p = float("nan")
    if not 0 < p < 1:
        raise ValueError(f"--reward {scorer!r}: random:P needs a probability 0 < P < 1, "
                         f"got {text!r}")
    return p


def random_rewards(n, p, seed, *, correct=1.0, incorrect=0.0):
    """`n` rewards, each `correct` with probability `p` and `incorrect` otherwise, independent of
    the completions. `seed` is a tuple of integers (train.py: the run's seed, the step, the rank): one
    numpy SeedSequence over them, so the coins repeat for a seed and are the same for every method.

    With such rewards the expected policy gradient is zero (the advantage is independent of the
    sampled text), so a policy trained without a clip has nothing to learn, and any drift of an arm
    against the no-clip arm is its clip's own (docs/design.md, "Random rewards").
    """
    rng = np.random.default_rng([int(s) % 2**63 for s in seed])
    return [correct if u < p else incorrect for u in rng.random(n)]


# --- the paper's reward: DAPO / Minerva exact match -----------------------------------------------
# The DAPO recipe's rule (verl math_dapo.py): findall(r"(?i)Answer\s*:\s*([^\n]+)") on the last 300
# characters, the last match, Minerva-normalised, compared as a string with the Minerva-normalised
# reference.
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_MINERVA_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
                    ("\\text{m}", "\\text{}"))
_MINERVA_REMOVE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
                   "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees",
                   "cm", "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets",
                   "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
                   "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!",
                   "{,}", '"', "\\dots")
_MINERVA_REGEX = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"),
                  (r"(\\textbf\{)(.*?)(\})", "\\2"), (r"(\\overline\{)(.*?)(\})", "\\2"),
                  (r"(\\boxed\{)(.*)(\})", "\\2"),
                  (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
                  (r"(sqrt)([^{])", "sqrt{\\2}"))  # \sqrta -> \sqrt{a}


def _minerva_normalize(s):
    """Minerva's final-answer normaliser (Lewkowycz et al. 2022, App. D), as in verl's
    normalize_final_answer (same substitution and removal lists, same order)."""
    s = s.split("=")[-1]
    for before, after in _MINERVA_REPLACE:
        s = s.replace(before, after)
    for expr in _MINERVA_REMOVE:
        s = s.replace(expr, "")
    for pattern, repl in _MINERVA_REGEX:
        s = re.sub(pattern, repl, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _dapo_extract(response):
    """The last `Answer:` line's text within the final 300 characters (the DAPO rule), or None."""
    if not isinstance(response, str):
        return None
    # 300: "The longest answer in MATH-500 has 159 characters" (verl)
    found = _DAPO_ANSWER.findall(response[-300:])
    return found[-1] if found else None


def _dapo_match(pred, answer):
    if not isinstance(answer, str):
        answer = "" if answer is None else str(answer)
    if len(answer) > MAX_ANSWER_CHARS:  # no real reference is that long; keeps regexes linear-time
        return False
    try:
        return _minerva_normalize(pred) == _minerva_normalize(answer)
    except Exception:  # noqa: BLE001
        return False


def dapo_score(response, answer):
    """The paper's reward: +1.0 if the last `Answer:` line (final 300 chars) matches after Minerva
    normalisation, else -1.0."""
    pred = _dapo_extract(response)
    return 1.0 if pred is not None and _dapo_match(pred, answer) else -1.0


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: python reward.py RESPONSE ANSWER")
    response, answer = sys.argv[1:]
    print(f"extracted answer : {extract_answer(response)!r}")
    print(f"is_correct       : {is_correct(response, answer)}")
    print(f"dapo_score       : {dapo_score(response, answer):+.0f}  "
          f"(DAPO answer: {_dapo_extract(response)!r})")


if __name__ == "__main__":
    main()

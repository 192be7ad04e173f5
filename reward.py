"""Math reward: is the completion's final answer equal to the reference? (docs/paper.md §4)

Two scorers, one batch entry point:

- `is_correct(response, answer)` (scorer "math-verify", the default) reads the final answer the way math-verify and
  the evaluation harnesses do. An explicit final answer first, the last one in the text: the last `\\boxed{...}`
  (nested braces), or the rest of the line after `Answer:` (the DAPO prompt's format), `the (final) answer is`
  (lm-eval-harness' gsm8k-cot; Minerva's "The final answer is $X$. I hope it is correct.") or `####` (GSM8K).
  Without one, math-verify's last resort on a whole completion: the last number, arithmetic expression or LaTeX
  environment at its end (GSM8K solutions' "A: 18", "so she pays $1,200."). The answer is compared with the
  reference through math-verify (1/2 = 0.5 = \\dfrac12, 10\\% = 0.1, 2\\sqrt3 = \\sqrt{12}, intervals, tuples, sets,
  symbolic equality). Precedence: an explicit final answer wins over any later number ("The answer is 18.\\nCheck:
  18 - 3 = 15" reads 18), and the later of two explicit ones wins (a self-correction counts), where math-verify
  would rank a box above an `Answer:` line wherever they stand. One departure from math-verify's equivalence: when
  the reference is a plain number, plain numbers joined by + - * / (`93*95`, `795 + 535`, `3 \\times 4`) are not a
  final answer, although math-verify evaluates them as equal. A policy finds this at once: SmolLM2-135M trained on
  "What is 93*95? End with 'Answer: <number>'." learned in 20 steps to echo the question, and held-out "accuracy"
  went from 14% to 99.6% (docs/results.md).
- `dapo_score(response, answer)`: the paper's own reward, reproduced: the last `Answer:` line within the final 300
  characters, Minerva normalisation (Lewkowycz et al. 2022, App. D, as in lm-eval-harness' hendrycks_math), exact
  string match, +1 / -1. This mirrors verl's `verl/utils/reward_score/math_dapo.py::compute_score`
  (github.com/volcengine/verl; the reward of the DAPO recipe that the authors' verl fork trains with), and
  `_minerva_normalize` follows its `normalize_final_answer` (same substitution and removal lists, same order).
- `score_batch(responses, answers, correct=, incorrect=, missing=, scorer=)`: the reward map used by train.py and
  eval.py; `missing` is the optional format penalty for a completion with no final answer (for the default scorer:
  no explicit one and no number or math at its end).

Departure from the authors' code: `is_correct` is more lenient than the paper's exact match (other answer formats
and equivalent forms count). Use `scorer="dapo"` to train with the paper's rule exactly.

Measured on real outputs: 228 solutions of GPT-3 6B/175B to the first 57 GSM8K test problems, each labelled
correct or not by the GSM8K authors (tests/fixtures/gsm8k_model_solutions; they end in "A: N", two are cut off):
share of verdicts that agree with the labels.
  the last `Answer:` line or box only (every correct one reads as missing)                               65.4%
  default scorer                                                                                        100.0%
  scorer="dapo" (the paper's rule finds no `Answer:` line here: -1 for all)                              65.4%
  math-verify's parse + verify of the whole completion (its default extraction)                         100.0%
With their last line rewritten into the other endings (`Answer: N`, `**Answer:** N`, `#### N`, "The answer is N.",
a box, a bare N, Minerva's sentence), the default scorer stays at 100% (the last `Answer:` line or box only: 65.4%
on ####, "the answer is" and a bare N).

Never raises, never hangs. Every call returns within ~2.5 s whatever the text (ms typically):
  1. Extraction is linear: one regex pass over the last MAX_SCAN_CHARS characters matches braces with a stack, so
     20,000 unbalanced `\\boxed{` cost ~10 ms and the worst text (all braces) ~0.1 s, never a quadratic rescan;
     the markers are one more pass, and the last-resort search reads only the final TAIL_CHARS characters.
     Extracted answers (and references) longer than MAX_ANSWER_CHARS are only string-compared.
  2. Fast exact paths in this process: equal after formatting-only normalisation -> correct; two plain numbers
     (integers, a/b, \\frac{a}{b}, decimals) are compared exactly with `fractions.Fraction` (integers and
     fractions both ways; decimals only when equal, otherwise math-verify decides its rounding rule). Typical
     AIME/AMC/DAPO answers are integers and never leave this process.
  3. Everything else goes to math-verify in worker processes (verify_pool.py): a CPU-time limit per check, a
     wall-clock deadline after which the worker is killed and the answer counts as incorrect, a cache of verdicts.
     This process never calls math-verify nor uses signals, so every function here is safe from any thread and
     from processes forked later. The first math-verify call of a process waits once for the workers (~1 s).
  If no worker can be started, the fast paths' verdict is used alone and a warning is logged once.
Speed (benchmarks/bench_reward.py; 2-core machine, 2 workers, busy at load ~7): integer answers (AIME/AMC/DAPO)
~900-1,000 scores/s, the paper's training mix ~950-1,200/s, a MATH-500-like mix ~500-650/s, no integer answer
~270/s. The 10% of completions cut off before a final answer cost most of that time (their last math goes to
math-verify): scoring those 0 unchecked measured ~3,800-6,200 / ~2,000 / ~600-750 / ~350 scores/s in the same runs.

    python reward.py 'so the total is \\boxed{\\dfrac{1}{2}}' '0.5'      # prints both scorers' verdicts
"""

import logging
import re
import sys
from fractions import Fraction

import verify_pool

log = logging.getLogger("reward")

MAX_ANSWER_CHARS = 1000   # longer extracted answers (or references) are compared as strings only
MAX_SCAN_CHARS = 200_000  # the final answer is looked for in this many last characters (4096 tokens ~ 16k chars)
TAIL_CHARS = 2000         # without an explicit final answer, the last math in this many last characters counts
STATS = verify_pool.STATS  # math-verify timeouts, worker restarts, fallbacks: diagnostics for a metrics line

# --- final-answer extraction -------------------------------------------------------------------------------------
# 1. Explicit final answers, the last one in the text: a box, or the rest of the line after a marker. "answer is"
#    must not be followed by a word ("the answer is not 5", "the answer is correct"), nor "####" by anything but a
#    number or math (a markdown heading "#### Step 2" is no answer).
_BRACES = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
_ANSWER_MARKER = re.compile(r"(?i)answer(?:[ \t*]*:\s*|\s+is\b[ \t*:]*+(?![a-z]{2}))")  # Answer: / the answer is
_GSM8K_MARKER = re.compile(r"####[ \t]*+(?=[-$\\\d.])")  # a separate regex: its literal prefix keeps both fast
_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z])")  # "$18$. I hope it is correct." (Minerva's prompt) -> "$18$"
_UNITS_AFTER = re.compile(  # "18 miles away", "$18 per day", "60 percent": the number (math-verify reads the same)
    r"\$?(-?\d+(?:,\d{3})*(?:\.\d+)?)\s*(\\?%|percent\b)?(?(2)|,?\s+(?!(?:and|or)\b)[a-z]{2})", re.I)
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# 2. Otherwise math-verify's last resort (parser.py: the priority-300 patterns of lazy_latex_regex and
#    lazy_expr_regex): of the LaTeX environments, numbers and arithmetic expressions, the one that ends last, the
#    longest on ties. Read in the last TAIL_CHARS characters only, with bounded or possessive repeats, so that it
#    stays linear-time. Departures: expressions do not span lines, "1 234" is not a thousands separator, and the
#    last match counts even if sympy cannot parse it (math-verify would try the one before).
_TAIL_LATEX = re.compile(r"\$\$(?<!\\\$\$)((?:[^$]|\$(?!\$)){1,1000}?)(?<!\\)\$\$"  # (literal first: fast scans)
                         r"|\\\[(?<!\\\\\[)((?:[^\\]|\\(?!\])){1,1000}?)(?<!\\)\\\]"
                         r"|\$(?<![\\\d]\$)((?:\\\$|[^\n$]){1,500}?)(?<!\\)\$"
                         r"|\\\((?<!\\\\\()((?:[^\\\n]|\\(?!\))){1,500}?)(?<!\\)\\\)"
                         r"|(-?\\frac\{-?\d+(?:\.\d+)?\}\{-?\d+(?:\.\d+)?\})")
_NUM = r"(?:-?[1-9]\d{0,2}(?:,\d{3})++(?:\.\d+)?|-?\d++(?:[.,]\d+)?|\.\d+)"  # 1,234.5 | 3.5 or 3,5 | .5
_TAIL_NUMBER = re.compile(  # after a space, "=" or the start; maybe bold, with a currency sign; then operators
    rf"(?<![^\s=])(?:\*\*)?\\?[$€£¥]?({_NUM}(?:[ \t]*+[-+*/^×÷][ \t]*+{_NUM})*+)(\s*(?:\\?%|[Pp]ercent|[Pp]ct))?")
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
    """Strip what surrounds an answer: spaces, markdown bold, math delimiters, a final period, currency signs."""
    s = s.replace("\\$", "").strip().rstrip(".").strip().strip("*`").strip().rstrip(".").strip()
    for a, b in _DELIMITERS:
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):len(s) - len(b)].strip().rstrip(".").strip()
            break
    return s


def _marker_answer(line):
    """The answer in the rest of a marker's line: its first sentence, cleaned; a number followed by words or a
    percent sign ("18 miles away from home", "60%") is that number."""
    s = _clean(_SENTENCE_END.split(line, 1)[0])
    m = _UNITS_AFTER.match(s)
    return (m[1] + ("\\%" if m[2] else "")) if m else s


def _tail_answer(text):
    """math-verify's reading of a completion without an explicit final answer: the last math at its end."""
    tail = text[-TAIL_CHARS:]
    if len(text) > TAIL_CHARS:
        tail = re.sub(r"\A\S+", "", tail)  # do not read the end of a token that the window cuts
    found = [((m.end(), -m.start()), next(g for g in m.groups() if g is not None).strip())
             for m in _TAIL_LATEX.finditer(tail)]
    for m in _TAIL_NUMBER.finditer(tail):  # as math-verify's extract_expr: 1,234 -> 1234, 3,5 -> 3.5
        found.append(((m.end(), -m.start()), _THOUSANDS.sub("", m[1]).replace(",", ".") + ("\\%" if m[2] else "")))
    return next((answer for _, answer in sorted(found, reverse=True) if answer), None)


def _last_match(regex, text):
    last = None
    for last in regex.finditer(text):
        pass
    return last


def extract_answer(response):
    """The final answer of `response` as a string, or None when it has none.

    An explicit final answer first, the last one in the text: a `\\boxed{}`, or the rest of the line after
    `Answer:`, `the (final) answer is` or `####`. A box on that line wins (``Answer: $\\boxed{5}$`` -> "5"); an
    unbalanced last box is skipped in favour of the last complete one. Without one (or when all are empty), the
    last number, arithmetic expression or LaTeX environment at the end of the text (math-verify's last resort).
    """
    if not isinstance(response, str):
        return None
    response = response[-MAX_SCAN_CHARS:]
    box = _last_box(response)
    found = [] if box is None else [(box[0], _clean(box[2]))]
    for head in (_last_match(_ANSWER_MARKER, response), _last_match(_GSM8K_MARKER, response)):
        if head is not None:
            end = response.find("\n", head.end())
            found.append((head.start(), _marker_answer(response[head.end():end if end >= 0 else None])))
    return next((answer for _, answer in sorted(found, reverse=True) if answer), None) or _tail_answer(response)


# --- fast exact paths (no sympy) ---------------------------------------------------------------------------------
_FORMATTING = re.compile(r"\\[!,;: ]|\\left|\\right|\s+|\$")
_INTEGER_PART = r"([+-]?)(\d{1,3}(?:,\d{3})+|\d{1,100})"
_DECIMAL = re.compile(rf"^{_INTEGER_PART}(?:\.(\d{{1,100}}))?$")
_FRACTION = re.compile(r"^([+-]?)(?:\\frac\{(\d{1,100})\}\{(\d{1,100})\}|(\d{1,100})/(\d{1,100}))$")
# plain numbers joined by + - * / and their LaTeX forms, after _normalize: "93*95", "795+535", "3\times4"
_PLAIN_NUM = r"[+-]?\d{1,100}(?:\.\d{1,100})?"
_ARITHMETIC = re.compile(rf"^{_PLAIN_NUM}(?:(?:[-+*/×·÷]|\\times|\\cdot|\\div){_PLAIN_NUM}){{1,50}}$")


def _normalize(s):
    """Formatting-only normalisation: equal results mean the same mathematical text."""
    s = _FORMATTING.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _number(s):
    """(Fraction, is_decimal) for a plain number written as n, 1,234, -3.25, a/b or \\frac{a}{b}; else None."""
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
            return False  # integers and fractions are exact; math-verify's rounding only concerns decimals
    if ng is not None and np_ is None and _ARITHMETIC.match(p):
        return False  # arithmetic left unevaluated ("93*95" for 8835) is not a final answer (module docstring)
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


# --- public API --------------------------------------------------------------------------------------------------
def is_correct(response, answer):
    """Whether the final answer of `response` equals the reference `answer` (math-verify equivalence)."""
    try:
        pred, gold = extract_answer(response), _reference(answer)
        return bool(pred) and bool(gold) and _verdict(pred, gold)
    except Exception:  # noqa: BLE001  (contract: never raises)
        log.debug("is_correct failed", exc_info=True)
        return False


def answer_key(pred):
    """A canonical form of an extracted answer for grouping equal answers (maj@n): formatting stripped, plain
    numbers as reduced fractions ("0.50", "1/2" and "\\dfrac{1}{2}" share a key)."""
    p = _normalize(pred)
    number = _number(p)
    return str(number[0]) if number is not None else p


def score_batch(responses, answers, *, correct=1.0, incorrect=0.0, missing=None, scorer="math-verify"):
    """Rewards for a batch: `correct` / `incorrect`, or `missing` (None = `incorrect`) when there is no final answer.

    scorer "math-verify" uses `is_correct`'s rule, "dapo" the paper's exact-match rule (`dapo_score`). Distinct
    (answer, reference) pairs that need math-verify are checked once each, in parallel over the worker pool.
    Raises ValueError only for a caller error (unknown scorer, lengths that differ), never for any text.
    """
    responses, answers = list(responses), list(answers)
    if len(responses) != len(answers):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
    if scorer not in ("math-verify", "dapo"):
        raise ValueError(f"unknown scorer {scorer!r}; expected 'math-verify' or 'dapo'")
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
    slow = list(dict.fromkeys((pred, gold) for pred, gold, verdict in pairs if pred and verdict is None))
    slow = dict(zip(slow, verify_pool.verify_all(slow)))  # each distinct pair once
    return [miss if not pred else correct if (verdict if verdict is not None else slow[pred, gold]) else incorrect
            for pred, gold, verdict in pairs]


# --- the paper's reward: DAPO / Minerva exact match ----------------------------------------------------------------
# The DAPO recipe's rule (verl math_dapo.py): findall(r"(?i)Answer\s*:\s*([^\n]+)") on the last 300 characters,
# the last match, Minerva-normalised, compared as a string with the Minerva-normalised reference.
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_MINERVA_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                   "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                   "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                   "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}",
                   "\\;", ",\\!", "{,}", '"', "\\dots")
_MINERVA_REGEX = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"),
                  (r"(\\textbf\{)(.*?)(\})", "\\2"), (r"(\\overline\{)(.*?)(\})", "\\2"),
                  (r"(\\boxed\{)(.*)(\})", "\\2"),
                  (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
                  (r"(sqrt)([^{])", "sqrt{\\2}"))  # \sqrta -> \sqrt{a}


def _minerva_normalize(s):
    """Minerva's final-answer normaliser (Lewkowycz et al. 2022, App. D), as in verl's normalize_final_answer."""
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
    found = _DAPO_ANSWER.findall(response[-300:])  # "The longest answer in MATH-500 has 159 characters" (verl)
    return found[-1] if found else None


def _dapo_match(pred, answer):
    if not isinstance(answer, str):
        answer = "" if answer is None else str(answer)
    if len(answer) > MAX_ANSWER_CHARS:  # no real reference is that long; keeps the regexes linear-time
        return False
    try:
        return _minerva_normalize(pred) == _minerva_normalize(answer)
    except Exception:  # noqa: BLE001
        return False


def dapo_score(response, answer):
    """The paper's reward: +1.0 if the last `Answer:` line (final 300 chars) matches after Minerva normalisation."""
    pred = _dapo_extract(response)
    return 1.0 if pred is not None and _dapo_match(pred, answer) else -1.0


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: python reward.py RESPONSE ANSWER")
    response, answer = sys.argv[1:]
    print(f"extracted answer : {extract_answer(response)!r}")
    print(f"is_correct       : {is_correct(response, answer)}")
    print(f"dapo_score       : {dapo_score(response, answer):+.0f}  (DAPO answer: {_dapo_extract(response)!r})")


if __name__ == "__main__":
    main()

"""Math reward: is the completion's final answer equal to the reference? (shared/PAPER.md §4)

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
  would rank a box above an `Answer:` line wherever they stand.
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
  default scorer before this rule (last `Answer:` line or box only: every correct one read as missing)   65.4%
  default scorer (this rule)                                                                            100.0%
  scorer="dapo" (the paper's rule finds no `Answer:` line here: -1 for all)                               65.4%
  math-verify's parse + verify of the whole completion (its default extraction)                         100.0%
With their last line rewritten into the other endings (`Answer: N`, `**Answer:** N`, `#### N`, "The answer is N.",
a box, a bare N, Minerva's sentence), the default scorer stays at 100% (before: 65.4% on ####, "the answer is" and
a bare N).

Never raises, never hangs. Every call returns within ~2.5 s whatever the text (ms typically):
  1. Extraction is linear: one regex pass over the last MAX_SCAN_CHARS characters matches braces with a stack, so
     20,000 unbalanced `\\boxed{` cost ~10 ms and the worst text (all braces) ~0.1 s, never a quadratic rescan;
     the markers are one more pass, and the last-resort search reads only the final TAIL_CHARS characters.
     Extracted answers (and references) longer than MAX_ANSWER_CHARS are only string-compared.
  2. Fast exact paths in this process: equal after formatting-only normalisation -> correct; two plain numbers
     (integers, a/b, \\frac{a}{b}, decimals) are compared exactly with `fractions.Fraction` (integers and
     fractions both ways; decimals only when equal, otherwise math-verify decides its rounding rule). Typical
     AIME/AMC/DAPO answers are integers and never leave this process.
  3. Everything else goes to math-verify in a small pool of worker *subprocesses* (`python reward.py --worker`,
     one JSON line per request; BANDPO_REWARD_WORKERS of them, default min(4, cores)). Timeouts need signals, and
     signals only work in a main thread (math-verify's SIGALRM raises ValueError elsewhere): in a worker the check
     always runs in the main thread, under a CPU-time limit (CPU_LIMIT_S, ITIMER_VIRTUAL) that stops runaway sympy
     work (9^{9^{9^{9}}} comes back wrong after ~0.5 s) without penalising checks that are merely slowed down by a
     busy machine. What no signal can stop (C code that never returns to the interpreter), the parent stops: it
     waits on the pipe with `poll` for at most ITEM_TIMEOUT_S, then kills the worker, counts the answer as
     incorrect and starts a replacement (the next call takes another, ready worker). The parent never calls
     math-verify nor uses signals, so every function here is safe from any thread (the pool is shared under a
     lock; concurrent callers queue for a free worker) and from processes forked later (the pool is rebuilt per
     pid). Fresh interpreters rather than fork(): forking a trainer that runs CUDA/vLLM/OpenMP threads can
     deadlock. The first math-verify call of a process waits once for the workers to start (~1 s here).
  If no worker can be started, the fast paths' verdict is used alone and a warning is logged once.
Speed: before math-verify's `verify`, a worker evaluates both parsed expressions at a fixed generic point and calls
them different when they differ by more than 1e-4 relative: math-verify, which rounds to 6 decimals, would reach
the same verdict, but only after an expensive sympy.simplify. benchmarks/bench_reward.py measures throughput; 10%
of its completions are cut off before a final answer, and their last math now goes to math-verify. On the 2-core
dev machine (2 workers), busy (load ~7), back to back with the previous rule (which scored those 0 unchecked):
integer answers (AIME/AMC/DAPO) ~900-1,000 scores/s (before ~3,800-6,200), the paper's training mix ~950-1,200/s
(~2,000), a MATH-500-like mix ~500-650/s (~600-750), no integer answer ~270/s (~350). Idle, the previous rule
measured ~15,000 / ~5,000 / ~2,000-3,000 / ~600-1,300 scores/s.

    python reward.py 'so the total is \\boxed{\\dfrac{1}{2}}' '0.5'      # prints both scorers' verdicts
"""

import atexit
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

log = logging.getLogger("reward")

MAX_ANSWER_CHARS = 1000   # longer extracted answers (or references) are compared as strings only
MAX_SCAN_CHARS = 200_000  # the final answer is looked for in this many last characters (4096 tokens ~ 16k chars)
TAIL_CHARS = 2000         # without an explicit final answer, the last math in this many last characters counts
CPU_LIMIT_S = 0.5         # CPU time one math-verify check may use in a worker (typical: 1-60 ms)
ITEM_TIMEOUT_S = 2.0      # wall-clock deadline of one check, after which the parent kills the worker
START_TIMEOUT_S = 20.0    # a worker that has not imported math-verify by then is declared broken
NUM_WORKERS = int(os.environ.get("BANDPO_REWARD_WORKERS", min(4, os.cpu_count() or 1)))
STATS = {"timeouts": 0, "restarts": 0, "fallbacks": 0}  # diagnostics, e.g. for a metrics line

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
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    return None


# --- math-verify, in worker processes ----------------------------------------------------------------------------
def _as_latex(s):
    """math-verify reads delimited LaTeX; a bare answer is wrapped in \\boxed{} so that all of it is parsed."""
    return s if any(d in s for d in ("$", "\\(", "\\[", "\\boxed")) else "\\boxed{" + s + "}"


def _clearly_different(g, p):
    """Whether two parsed sympy expressions differ numerically at a fixed generic point of their free symbols.

    math-verify spends most of its time in sympy.simplify proving that *wrong* answers are unequal; a numeric
    difference far beyond its rounding (6 decimals) settles that in ~1 ms. Only plain expressions are tested:
    sets, intervals, tuples, relations and matrices, and anything that does not evaluate, go to math-verify. A
    predicted equation against a plain reference is its right side, as math-verify compares it (grader.py
    sympy_expr_eq: "x = 3" vs 3), which keeps the last math of a cut-off completion cheap to reject.
    """
    import sympy

    if isinstance(p, sympy.Eq) and isinstance(g, sympy.Expr):
        p = p.rhs
    if not (isinstance(g, sympy.Expr) and isinstance(p, sympy.Expr)):
        return False
    symbols = sorted(g.free_symbols | p.free_symbols, key=str)
    point = {s: sympy.Float(0.5772156649 + 0.3183098862 * i, 30) for i, s in enumerate(symbols)}
    try:
        a, b = complex(g.subs(point).evalf(30)), complex(p.subs(point).evalf(30))
    except (TypeError, ValueError, ArithmeticError):  # zoo, nan, unevaluated functions
        return False
    return abs(a - b) > 1e-4 * max(1.0, abs(a), abs(b))


class _CpuTimeout(BaseException):
    """Raised by the CPU-time timer; a BaseException so that math-verify's `except Exception` cannot swallow it."""


def _on_cpu_timeout(signum, frame):
    raise _CpuTimeout


def _math_verify(pred, gold):
    """The math-verify comparison, limited to CPU_LIMIT_S of CPU time (raises _CpuTimeout beyond).

    The limit is a CPU-time timer (ITIMER_VIRTUAL / SIGVTALRM) instead of math-verify's wall-clock SIGALRM, so a
    busy machine (a trainer and vLLM on the same cores) does not turn slow-but-legit checks into timeouts. Signals:
    call it only from a main thread, which the worker processes are.
    """
    from math_verify import parse, verify

    signal.signal(signal.SIGVTALRM, _on_cpu_timeout)
    signal.setitimer(signal.ITIMER_VIRTUAL, CPU_LIMIT_S)
    try:
        g = parse(_as_latex(gold), parsing_timeout=None)
        p = parse(_as_latex(pred), parsing_timeout=None)
        if not (g and p):
            return False
        if "%" not in pred + gold and _clearly_different(g[0], p[0]):  # math-verify's percent rule: 10\% == 10
            return False
        return bool(verify(g, p, timeout_seconds=None))
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)


def _serve():
    """Worker main loop: one JSON request [pred, gold] per stdin line, one JSON verdict per stdout line."""
    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off: ours replace them
    out, sys.stdout = sys.stdout, sys.stderr  # the protocol owns stdout; stray prints from libraries go to stderr
    for pred, gold in (("x^2/3", "\\frac{x^2}{3}"), ("(1, 2]", "[1,2)"), ("\\sqrt{2}", "1.41")):
        try:  # warm up: the first parse builds the LaTeX parser, which must not count against a real check
            _math_verify(pred, gold)
        except BaseException:  # noqa: BLE001
            pass
    try:
        out.write('"ready"\n')
        out.flush()
    except OSError:  # the parent gave up on us while we warmed up
        os._exit(0)
    for line in sys.stdin:
        try:
            pred, gold = json.loads(line)
            verdict = _math_verify(pred, gold)
        except BaseException:  # noqa: BLE001  (a bad item must not kill the worker)
            verdict = False
        try:
            out.write("true\n" if verdict else "false\n")
            out.flush()
        except OSError:  # the parent is gone or gave up on us
            os._exit(0)


class _Worker:
    """One `python reward.py --worker` subprocess, read through a raw fd so that `poll` sees every byte."""

    def __init__(self):
        self.proc, self.buf, self.ready = None, b"", False
        self.start()

    def start(self):
        self.buf, self.ready = b"", False
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)  # no Ctrl-C tracebacks
        except OSError as e:
            log.warning("reward: cannot start a math-verify worker: %s", e)
            self.proc = None

    def kill(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        self.proc = None

    def _readline(self, timeout):
        """Next line from the worker, or None on timeout / exit. Never blocks longer than `timeout`."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # not select.select: a trainer may hold > 1024 fds, beyond select's FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while b"\n" not in self.buf:
            left = max(0.0, deadline - time.monotonic())
            if not poller.poll(math.ceil(left * 1000)):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def wait_ready(self, timeout):
        if not self.ready and self.proc is not None:
            self.ready = self._readline(timeout) == b'"ready"'
        return self.ready

    def check(self, pred, gold):
        """math-verify's verdict, False when it overran ITEM_TIMEOUT_S, None when the worker is unusable."""
        if not self.wait_ready(START_TIMEOUT_S):
            return None
        try:
            self.proc.stdin.write((json.dumps([pred, gold]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            reply = None
        else:
            reply = self._readline(ITEM_TIMEOUT_S)
        if reply in (b"true", b"false"):
            return reply == b"true"
        STATS["timeouts"] += 1  # hung (or crashed) on this item: replace the worker, count the answer wrong
        STATS["restarts"] += 1
        self.kill()
        self.start()
        return False


class _Pool:
    def __init__(self, size):
        self.pid, self.broken = os.getpid(), False
        self.idle = [_Worker() for _ in range(max(1, size))]
        self.size = len(self.idle)
        self.cond = threading.Condition()

    def _acquire(self):
        with self.cond:
            while not self.idle:
                self.cond.wait()
            for i, w in enumerate(self.idle):  # prefer a worker that is already up (e.g. not just restarted)
                if w.ready or (w.proc is not None and w.wait_ready(0)):
                    return self.idle.pop(i)
            return self.idle.pop(0)

    def check(self, pred, gold):
        w = self._acquire()
        try:
            verdict = w.check(pred, gold)
            if verdict is None:  # could not start: one retry with a fresh process, then give up for good
                w.kill()
                w.start()
                verdict = w.check(pred, gold)
                if verdict is None:
                    self.broken = True
            return verdict
        finally:
            with self.cond:
                self.idle.append(w)
                self.cond.notify()

    def close(self):
        if self.pid == os.getpid():
            for w in self.idle:
                w.kill()


_POOL, _POOL_LOCK, _CACHE, _WARNED = None, threading.Lock(), {}, []


def _pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # fork()ed children build their own workers
            _POOL = _Pool(NUM_WORKERS)
            atexit.register(_POOL.close)
        return _POOL


def _slow_verdict(pred, gold):
    key = (pred, gold)
    if key in _CACHE:
        return _CACHE[key]
    pool = _pool()
    verdict = None if pool.broken else pool.check(pred, gold)
    if verdict is None:
        STATS["fallbacks"] += 1
        if not _WARNED:
            _WARNED.append(True)
            log.warning("reward: math-verify workers unavailable; only exact/numeric matches count as correct")
        return False
    if len(_CACHE) > 200_000:
        _CACHE.clear()
    _CACHE[key] = verdict  # timeouts are cached too: a pathological pair would hang again
    return verdict


def _verdict(pred, gold):
    quick = _quick_verdict(pred, gold)
    return quick if quick is not None else _slow_verdict(pred, gold)


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

    pairs, todo = [], {}
    for r, a in zip(responses, answers):
        try:
            pred, gold = extract_answer(r), _reference(a)
            verdict = None if not pred else (False if not gold else _quick_verdict(pred, gold))
        except Exception:  # noqa: BLE001
            pred, gold, verdict = "", "", False
        pairs.append((pred, gold, verdict))
        if pred and verdict is None:
            todo[(pred, gold)] = None
    if todo:
        with ThreadPoolExecutor(max_workers=_pool().size) as ex:  # threads only wait on pipes
            for key, v in zip(todo, ex.map(lambda k: _slow_verdict(*k), todo)):
                todo[key] = v
    return [miss if not pred else correct if (v if v is not None else todo[(pred, gold)]) else incorrect
            for pred, gold, v in pairs]


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
    if sys.argv[1:] == ["--worker"]:
        return _serve()
    if len(sys.argv) != 3:
        sys.exit("usage: python reward.py RESPONSE ANSWER")
    response, answer = sys.argv[1:]
    print(f"extracted answer : {extract_answer(response)!r}")
    print(f"is_correct       : {is_correct(response, answer)}")
    print(f"dapo_score       : {dapo_score(response, answer):+.0f}  (DAPO answer: {_dapo_extract(response)!r})")


if __name__ == "__main__":
    main()

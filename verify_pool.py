"""math-verify in worker processes: the slow, symbolic half of reward.py (docs/paper.md §4).

reward.py decides most answers itself (equal text, two plain numbers compared exactly). The rest --
2\\sqrt3 against \\sqrt{12}, intervals, sets, expressions with a variable -- goes to math-verify,
whose parsing and sympy simplification can take seconds or never end (9^{9^{9^{9}}}). This file runs
it where it can be stopped. The authors' reward, an exact string match, needs none of this.

- Why processes: stopping a computation needs a signal, and Python delivers signals only to the main
  thread; math-verify's SIGALRM timeouts raise ValueError in any other thread. So checks run in
  fresh worker interpreters (`python verify_pool.py --worker`; not fork(), which can deadlock a
  trainer running CUDA, vLLM or OpenMP threads). The parent never calls math-verify nor uses
  signals: every function here is safe from any thread (callers queue for a free worker) and from
  processes forked later (the pool is rebuilt per pid).
- The limits: a CPU-time limit per check in the worker (CPU_LIMIT_S, ITIMER_VIRTUAL), which a busy
  machine does not trip as a wall clock would; a deadline in the parent (ITEM_TIMEOUT_S, `poll` on
  the pipe) for C code no signal stops, after which the worker is killed, the answer counts as
  incorrect and a fresh worker replaces it. A worker not ready within START_TIMEOUT_S, twice, marks
  the pool broken: `verify` then answers False, with one logged warning.
- NUM_WORKERS processes (BANDPO_REWARD_WORKERS, default min(4, cores)), started by a process's first
  check. Protocol: one JSON [pred, gold] per stdin line, one `true`/`false` per stdout line.
  Verdicts are cached per pair, timeouts included. Before `verify`, a worker compares the two
  expressions at a fixed generic point, which rejects most wrong answers without sympy.simplify.

STATS counts timeouts, restarts and fallbacks (= reward.STATS). Speed: docs/benchmarks.md#reward.

    python verify_pool.py '2\\sqrt{3}' '\\sqrt{12}'     # math-verify's verdict through the pool
"""

import atexit
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("verify_pool")

CPU_LIMIT_S = 0.5       # CPU time one math-verify check may use in a worker (typical: 1-60 ms)
ITEM_TIMEOUT_S = 2.0    # wall-clock deadline of one check, after which the parent kills the worker
START_TIMEOUT_S = 20.0  # a worker that has not imported math-verify by then is declared broken
NUM_WORKERS = int(os.environ.get("BANDPO_REWARD_WORKERS", min(4, os.cpu_count() or 1)))
STATS = {"timeouts": 0, "restarts": 0, "fallbacks": 0}


# --- the check, run inside a worker ---------------------------------------------------------------
def _as_latex(s):
    """math-verify reads delimited LaTeX; a bare answer is wrapped in \\boxed{} so that all of it
    is parsed."""
    return s if any(d in s for d in ("$", "\\(", "\\[", "\\boxed")) else "\\boxed{" + s + "}"


def _clearly_different(g, p):
    """Whether two parsed sympy expressions differ numerically at a fixed generic point of their
    free symbols.

    math-verify spends most of its time in sympy.simplify proving that *wrong* answers are unequal;
    a numeric difference far beyond its rounding (6 decimals) settles that in ~1 ms. Only plain
    expressions are tested: sets, intervals, tuples, relations and matrices, and anything that does
    not evaluate, go to math-verify. A predicted equation against a plain reference is its right
    side, as math-verify compares it (grader.py sympy_expr_eq: "x = 3" vs 3), which keeps the last
    math of a cut-off completion cheap to reject.
    """
    # deferred: only workers run this, so the parent (a trainer) never pays the import (~0.6 s)
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
    """Raised by the CPU-time timer; a BaseException so that math-verify's `except Exception`
    cannot swallow it."""


def _on_cpu_timeout(signum, frame):
    raise _CpuTimeout


def _math_verify(pred, gold):
    """The math-verify comparison, limited to CPU_LIMIT_S of CPU time (raises _CpuTimeout beyond).

    The limit is a CPU-time timer (ITIMER_VIRTUAL / SIGVTALRM) instead of math-verify's wall-clock
    SIGALRM, so a busy machine (a trainer and vLLM on the same cores) does not turn slow-but-legit
    checks into timeouts; it stops runaway sympy work (9^{9^{9^{9}}} comes back wrong). Signals:
    call it only from a main thread, which the worker processes are.
    """
    from math_verify import parse, verify  # deferred, as sympy above (~0.8 s)

    signal.signal(signal.SIGVTALRM, _on_cpu_timeout)
    signal.setitimer(signal.ITIMER_VIRTUAL, CPU_LIMIT_S)
    try:
        g = parse(_as_latex(gold), parsing_timeout=None)
        p = parse(_as_latex(pred), parsing_timeout=None)
        if not (g and p):
            return False
        # math-verify's percent rule: 10\% == 10
        if "%" not in pred + gold and _clearly_different(g[0], p[0]):
            return False
        return bool(verify(g, p, timeout_seconds=None))
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)


def _serve():
    """Worker main loop: one JSON request [pred, gold] per stdin line, one JSON verdict per stdout
    line."""
    # math-verify warns that its own timeouts are off: ours replace them
    logging.disable(logging.WARNING)
    # the protocol owns stdout; stray prints from libraries go to stderr
    out, sys.stdout = sys.stdout, sys.stderr
    for pred, gold in (("x^2/3", "\\frac{x^2}{3}"), ("(1, 2]", "[1,2)"), ("\\sqrt{2}", "1.41")):
        # warm up: the first parse builds the LaTeX parser, which must not count against a check
        try:
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


# --- the parent's side: workers, the pool, the cache ----------------------------------------------
class _Worker:
    """One `python verify_pool.py --worker` subprocess, read through a raw fd so that `poll` sees
    every byte."""

    def __init__(self):
        self.proc, self.buf, self.ready = None, b"", False
        self.start()

    def start(self):
        self.buf, self.ready = b"", False
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                start_new_session=True)  # no Ctrl-C tracebacks
        except OSError as e:
            log.warning("verify_pool: cannot start a math-verify worker: %s", e)
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
        """Next line from the worker, or None on timeout / exit; never blocks beyond `timeout`."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        # not select.select: a trainer may hold > 1024 fds, beyond select's FD_SETSIZE
        poller = select.poll()
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
        """math-verify's verdict; False if it overran ITEM_TIMEOUT_S; None if the worker is dead."""
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
        # hung (or crashed) on this item: replace the worker, count the answer wrong
        STATS["timeouts"] += 1
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
            # prefer a worker that is already up (e.g. not just restarted)
            for i, w in enumerate(self.idle):
                if w.ready or (w.proc is not None and w.wait_ready(0)):
                    return self.idle.pop(i)
            return self.idle.pop(0)

    def check(self, pred, gold):
        w = self._acquire()
        try:
            verdict = w.check(pred, gold)
            # could not start: one retry with a fresh process, then give up for good
            if verdict is None:
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


# --- public API -----------------------------------------------------------------------------------
def verify(pred, gold):
    """math-verify's verdict on an extracted answer `pred` against the reference `gold` (both
    strings): False when the check overran its limits or no worker can start. Never raises; safe
    from any thread."""
    key = (pred, gold)
    if key in _CACHE:
        return _CACHE[key]
    pool = _pool()
    verdict = None if pool.broken else pool.check(pred, gold)
    if verdict is None:
        STATS["fallbacks"] += 1
        if not _WARNED:
            _WARNED.append(True)
            log.warning("verify_pool: math-verify workers unavailable; answers that need "
                        "math-verify count as wrong")
        return False
    if len(_CACHE) > 200_000:
        _CACHE.clear()
    _CACHE[key] = verdict  # timeouts are cached too: a pathological pair would hang again
    return verdict


def verify_all(pairs):
    """`verify` of every (pred, gold) pair, in parallel over the workers; a list of bools in the
    pairs' order."""
    pairs = list(pairs)
    if not pairs:
        return []
    with ThreadPoolExecutor(max_workers=_pool().size) as ex:  # threads only wait on pipes
        return list(ex.map(lambda pair: verify(*pair), pairs))


def main():
    if sys.argv[1:] == ["--worker"]:
        return _serve()
    if len(sys.argv) != 3:
        sys.exit("usage: python verify_pool.py PREDICTED_ANSWER REFERENCE   "
                 "(or --worker: serve as a worker)")
    print(f"math-verify: {verify(*sys.argv[1:])}   {STATS}")


if __name__ == "__main__":
    main()

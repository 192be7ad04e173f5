"""math-verify in worker processes: the slow, symbolic half of reward.py (docs/paper.md §4).

reward.py decides most answers itself (equal text, two plain numbers compared exactly). The rest --
2\\sqrt3 against \\sqrt{12}, intervals, sets, expressions with a variable -- goes to math-verify,
whose parsing and sympy simplification can take seconds or never end (9^{9^{9^{9}}}): it runs here,
where it can be stopped (the authors' exact string match needs none of this).

- Processes, not threads: Python delivers signals only to the main thread, so checks run in fresh
  worker interpreters (`python machinery/verify_pool.py --worker`; not fork(), which can deadlock a trainer
  running CUDA, vLLM or OpenMP threads). The parent never calls math-verify nor uses signals: it is
  safe from any thread and from processes forked later (the pool is rebuilt per pid).
- Limits are CPU time, which a busy machine does not trip: CPU_LIMIT_S per check in the worker,
  CPU_KILL_S before the parent kills it (C code no signal stops); the answer counts as wrong. The
  wall clock only replaces a worker that gains no CPU time for STALL_S (WALL_KILL_S decides where
  CPU time cannot be read; docs/design.md#choices-and-departures has the rest). Where math-verify
  cannot run (START_ATTEMPTS failed starts in a row), `verify` raises Unavailable, a RuntimeError,
  rather than score answers wrong; the next call tries again.
- NUM_WORKERS processes (BANDPO_REWARD_WORKERS, default min(4, cores)), started by the first
  check. One JSON [pred, gold] per stdin line, one `true`/`false` per stdout line; verdicts cached
  per pair. A worker first compares the two expressions at a generic point, which rejects most wrong
  answers without sympy.simplify. STATS (= reward.STATS) counts CPU overruns, restarts and crashes.
  Speed: docs/benchmarks.md#reward.

    python machinery/verify_pool.py '2\\sqrt{3}' '\\sqrt{12}'     # math-verify's verdict through the pool
"""

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:  # CPU time where /proc is missing (macOS)
    import psutil
except ImportError:
    psutil = None

log = logging.getLogger("verify_pool")

CPU_LIMIT_S = 0.5      # CPU time one math-verify check may use in a worker (typical: 1-60 ms)
CPU_KILL_S = 2.0       # worker CPU time in one check after which the parent kills the worker
START_CPU_S = 60.0     # worker CPU time to import math-verify (~1-2 s) beyond which a start failed
STALL_S = 60.0         # wall seconds without any CPU time gained: the worker is hung (not slow)
WALL_KILL_S = 10.0     # no CPU time readable: a check's wall seconds (CPU_LIMIT_S at 5% of a core)
START_WALL_S = 300.0   # no CPU time readable: a start's wall seconds (~1-2 s of CPU)
SLOW_START_S = 20.0    # wall seconds of a start after which a log line says that we wait for it
START_ATTEMPTS = 3     # failed starts in a row after which `verify` raises Unavailable
NUM_WORKERS = int(os.environ.get("BANDPO_REWARD_WORKERS", min(4, os.cpu_count() or 1)))
STATS = {"timeouts": 0, "restarts": 0, "crashes": 0}
PYTHON = sys.executable  # the workers' interpreter (tests point it elsewhere: never at sys, which every thread reads)
# a worker checks these before it says "ready": a math-verify that imports but cannot read LaTeX
# (e.g. a mismatched antlr4 runtime) would otherwise score every such answer wrong
SELF_CHECK = (("\\sqrt{8}", "2\\sqrt{2}", True), ("(x+1)^2", "x^2+2x+1", True),
              ("(1, 2]", "[1,2)", False))


class Unavailable(RuntimeError):
    """math-verify cannot run in a worker process; the message says why, on one line."""


# --- the check, run inside a worker ---------------------------------------------------------------
def _as_latex(s):
    """math-verify reads delimited LaTeX; a bare answer is wrapped in \\boxed{} so that all of it
    is parsed."""
    return s if any(d in s for d in ("$", "\\(", "\\[", "\\boxed")) else "\\boxed{" + s + "}"


def _clearly_different(g, p):
    """Whether two parsed sympy expressions differ numerically at a fixed generic point of their
    free symbols. math-verify spends most of its time in sympy.simplify proving that *wrong* answers
    are unequal; a numeric difference far beyond its rounding (6 decimals) settles that in ~1 ms.
    Only plain expressions are tested: sets, intervals, tuples, relations and matrices, and anything
    that does not evaluate, go to math-verify. A predicted equation against a plain reference is its
    right side, as math-verify compares it (grader.py sympy_expr_eq: "x = 3" vs 3), which keeps the
    last math of a cut-off completion cheap to reject."""
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
    """Raised by the CPU-time timer: a BaseException, which math-verify's `except` lets through."""


def _on_cpu_timeout(signum, frame):
    raise _CpuTimeout


def _math_verify(pred, gold, cpu_limit=CPU_LIMIT_S):
    """The math-verify comparison, limited to `cpu_limit` seconds of CPU time (beyond: raises
    _CpuTimeout; None: no limit). The limit is a CPU-time timer (ITIMER_VIRTUAL / SIGVTALRM) instead
    of math-verify's wall-clock SIGALRM, so a busy machine (a trainer and vLLM on the same cores)
    does not turn slow-but-legit checks into timeouts; it stops runaway sympy work (9^{9^{9^{9}}}
    comes back wrong). Signals: call it only from a main thread, which the worker processes are.
    """
    from math_verify import parse, verify  # deferred, as sympy above (~0.8 s)

    if cpu_limit is not None:
        signal.signal(signal.SIGVTALRM, _on_cpu_timeout)
        signal.setitimer(signal.ITIMER_VIRTUAL, cpu_limit)
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
        if cpu_limit is not None:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)


def _one_line(text):
    return " ".join(str(text).split())[:300]


def _serve(cpu_limit):
    """Worker main loop: `"ready"` (or {"error": why} and exit) once math-verify passes its
    self-check, then one JSON request [pred, gold] per stdin line, one verdict per stdout line."""
    # the protocol owns the real stdout; prints from libraries, C code's included, go to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # math-verify warns that its own timeouts are off: ours replace them
    logging.disable(logging.WARNING)
    try:
        # also the warm-up: the LaTeX parser, built by the first parse, counts against no check
        for pred, gold, expected in SELF_CHECK:
            if _math_verify(pred, gold, cpu_limit=None) is not expected:
                raise RuntimeError(f"math-verify's self-check failed: verify({pred!r}, {gold!r}) "
                                   f"is not {expected}")
        reply = '"ready"'
    except Exception as e:  # noqa: BLE001  (reported to the parent, which raises it)
        reply = json.dumps({"error": _one_line(f"{type(e).__name__}: {e}")})
    try:
        out.write(reply + "\n")
        out.flush()
    except OSError:  # the parent gave up on us while we started
        os._exit(0)
    if reply != '"ready"':
        os._exit(1)
    for line in sys.stdin:
        try:
            pred, gold = json.loads(line)
            verdict = _math_verify(pred, gold, cpu_limit)
        except BaseException:  # noqa: BLE001  (a bad item must not kill the worker)
            verdict = False
        try:
            out.write("true\n" if verdict else "false\n")
            out.flush()
        except OSError:  # the parent is gone
            os._exit(0)


# --- the parent's side: workers, the pool, the cache ----------------------------------------------
_TICK_MS = 50  # how often a waiting parent looks at the worker's CPU time
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid):
    """CPU time used so far by process `pid`: /proc, else psutil; None where neither reads it."""
    cpu = _proc_cpu_seconds(pid)
    if cpu is not None or psutil is None:
        return cpu
    try:
        return sum(psutil.Process(pid).cpu_times()[:2])  # user, system
    except (psutil.Error, OSError):
        return None


def _proc_cpu_seconds(pid):
    """Its main thread's time in ns where the kernel keeps it (schedstat: a worker computes there),
    else the process's in clock ticks (stat; 10 ms: a starved worker may gain none in a second)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the name, in (), may hold spaces
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


class _Worker:
    """One `python machinery/verify_pool.py --worker` subprocess, read through a raw fd so that `poll` sees
    every byte."""

    def __init__(self):
        self.proc = None
        self.start()

    def start(self):
        self.buf, self.ready, self.slow_logged = b"", False, False
        self.started, self.spawn_error = time.monotonic(), None
        try:
            self.proc = subprocess.Popen(
                [PYTHON, "-u", os.path.abspath(__file__), "--worker", str(CPU_LIMIT_S)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                start_new_session=True)  # no Ctrl-C tracebacks
        except OSError as e:
            self.proc, self.spawn_error = None, f"cannot start {PYTHON}: {e}"
            return
        # not select.select: a trainer may hold > 1024 fds, beyond select's FD_SETSIZE
        self.poller = select.poll()
        self.poller.register(self.proc.stdout.fileno(), select.POLLIN)

    def kill(self):
        """Stop the process (a next check starts another); its exit status (negative: a signal)."""
        self.ready = False
        if self.proc is None:
            return None
        try:
            self.proc.kill()
            code = self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            code = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self.proc = None
        return code

    def has_output(self):
        return self.proc is not None and (b"\n" in self.buf or bool(self.poller.poll(0)))

    def _next_line(self, cpu_until, wall_until):
        """The worker's next line (bytes), or why none will come: "died"; "cpu" (its CPU time passed
        `cpu_until`, None: no limit); "stalled" (it gained no CPU time in STALL_S of wall clock);
        "wall" (its CPU time cannot be read, and the monotonic clock passed `wall_until`)."""
        fd, pid = self.proc.stdout.fileno(), self.proc.pid
        cpu, last_progress = _cpu_seconds(pid), time.monotonic()
        while b"\n" not in self.buf:
            if self.poller.poll(_TICK_MS):
                chunk = os.read(fd, 65536)
                if not chunk:
                    return "died"
                self.buf += chunk
                continue
            now, was = time.monotonic(), cpu
            cpu = _cpu_seconds(pid)
            if cpu is None:  # no stall rule without CPU time: it would kill what is merely slow
                if now > wall_until:
                    return "wall"
            elif cpu_until is not None and cpu > cpu_until:
                return "cpu"
            elif cpu != was:  # any CPU time gained: slow, not hung
                last_progress = now
            elif now - last_progress > STALL_S:
                return "stalled"
            if not self.ready and not self.slow_logged and now - self.started > SLOW_START_S:
                self.slow_logged = True
                log.warning("verify_pool: a math-verify worker has not started after %.0f s "
                            "(a busy machine?); waiting for it", now - self.started)
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def wait_ready(self):
        """None once the worker is ready for checks, else (why it is not, whether that is final).
        A worker that failed is stopped."""
        if self.ready:
            return None
        if self.proc is None and self.spawn_error is None:
            self.start()
        if self.proc is None:
            reason, self.spawn_error = self.spawn_error, None  # the next call spawns again
            return reason, False
        line = self._next_line(START_CPU_S, self.started + START_WALL_S)
        if line == b'"ready"':
            self.ready = True
            return None
        code = self.kill()
        if line == "died":
            how = "unknown status" if code is None else (
                f"signal {-code}" if code < 0 else f"exit code {code}")
            return f"a worker exited while starting ({how})", False
        lost = {"stalled": f"a starting worker used no CPU time for {STALL_S:.0f} s",
                "cpu": f"a worker used {START_CPU_S:.0f} s of CPU time without starting",
                "wall": f"a worker did not start in {START_WALL_S:.0f} s"}
        if line in lost:
            return lost[line], False
        try:
            return json.loads(line)["error"], True
        except (ValueError, TypeError, KeyError):
            return f"a starting worker wrote {_one_line(line[:100])!r}", False

    def check(self, pred, gold):
        """math-verify's verdict (a bool) from a ready worker, or how the worker was lost: "died",
        "stalled", "cpu" or "wall" (see _next_line)."""
        cpu = _cpu_seconds(self.proc.pid)
        try:
            self.proc.stdin.write((json.dumps([pred, gold]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return "died"
        reply = self._next_line(None if cpu is None else cpu + CPU_KILL_S,
                                time.monotonic() + WALL_KILL_S)
        if reply in (b"true", b"false"):
            return reply == b"true"
        return reply if isinstance(reply, str) else "died"  # anything else: the protocol broke


class _Pool:
    def __init__(self, size):
        self.pid = os.getpid()
        self.idle = [_Worker() for _ in range(max(1, size))]
        self.size = len(self.idle)
        self.cond = threading.Condition()

    def _acquire(self):
        with self.cond:
            while not self.idle:
                self.cond.wait()
            # prefer a worker that is up, or has just said something (e.g. not just restarted)
            for i, w in enumerate(self.idle):
                if w.ready or w.has_output():
                    return self.idle.pop(i)
            return self.idle.pop(0)

    @staticmethod
    def _ready(w):
        """Wait until `w` is ready, restarting it after a failed start; raises Unavailable when the
        worker reports that math-verify cannot run, or after START_ATTEMPTS failures in a row."""
        for attempt in range(1, START_ATTEMPTS + 1):
            why = w.wait_ready()
            if why is None:
                return
            reason, final = why
            if final or attempt == START_ATTEMPTS:
                raise Unavailable(f"verify_pool: math-verify cannot run in a worker process: "
                                  f"{_one_line(reason)}" + ("" if final else f" ({attempt} times)"))
            log.warning("verify_pool: %s; starting another", reason)
            STATS["restarts"] += 1
            time.sleep(0.5 * attempt)  # a passing shortage (processes, memory) may pass

    def check(self, pred, gold):
        w = self._acquire()
        try:
            lost = []
            while len(lost) < 2:
                self._ready(w)
                verdict = w.check(pred, gold)
                if isinstance(verdict, bool):
                    return verdict
                w.kill()
                STATS["restarts"] += 1
                w.start()
                if verdict in ("cpu", "wall"):  # C code the worker's own timer cannot stop
                    STATS["timeouts"] += 1
                    return False
                lost.append(verdict)  # died or stalled: not the answer's verdict, so once again
            if lost == ["died", "died"]:  # it kills math-verify, as others make it raise: wrong
                STATS["crashes"] += 1
                log.warning("verify_pool: math-verify crashed twice on %r against %r; counted "
                            "wrong", pred[:100], gold[:100])
                return False
            raise Unavailable(f"verify_pool: math-verify workers were lost twice ("
                              f"{' then '.join(lost)}) on {pred[:100]!r} against {gold[:100]!r}")
        except BaseException:  # interrupted (Ctrl-C) or failed: a reply may be on its way
            w.kill()
            raise
        finally:
            with self.cond:
                self.idle.append(w)
                self.cond.notify()

    def close(self):
        if self.pid == os.getpid():
            for w in self.idle:
                w.kill()


_POOL, _POOL_LOCK, _CACHE = None, threading.Lock(), {}


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
    strings); False also when the check overran its CPU-time limit. Safe from any thread. Raises
    Unavailable (a RuntimeError) when math-verify cannot run; never answers for a slow machine."""
    key = (pred, gold)
    if key in _CACHE:
        return _CACHE[key]
    verdict = _pool().check(pred, gold)
    if len(_CACHE) > 200_000:
        _CACHE.clear()
    _CACHE[key] = verdict  # CPU overruns are cached too: a pathological pair would overrun again
    return verdict


def verify_all(pairs):
    """`verify` of every (pred, gold) pair, in parallel over the workers; a list of bools in the
    pairs' order. Raises as `verify` does, without starting the pairs not yet begun."""
    pairs = list(pairs)
    if not pairs:
        return []
    with ThreadPoolExecutor(max_workers=_pool().size) as ex:  # threads only wait on pipes
        futures = [ex.submit(verify, pred, gold) for pred, gold in pairs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            ex.shutdown(cancel_futures=True)
            raise


def main():
    if sys.argv[1:2] == ["--worker"] and len(sys.argv) == 3:
        return _serve(float(sys.argv[2]))
    if len(sys.argv) != 3:
        sys.exit("usage: python machinery/verify_pool.py PREDICTED_ANSWER REFERENCE   "
                 "(or --worker CPU_LIMIT_S: serve as a worker)")
    print(f"math-verify: {verify(*sys.argv[1:])}   {STATS}")


if __name__ == "__main__":
    main()

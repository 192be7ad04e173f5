"""machinery/verify_pool.py, the worker processes that run math-verify for reward.py: every call comes back in bounded time and
never raises for any text (adversarial inputs, runaway sympy, a hung worker); a slow machine is slow, not wrong
(workers slow to start are waited for, stalled or killed ones replaced, and the verdicts stay right); where
math-verify cannot run at all, scoring raises a one-line RuntimeError instead of counting answers wrong; it works
with file descriptors above 1024, from several threads at once, and in a forked child."""

import importlib.util
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import reward
from machinery import verify_pool
from test_reward import IS_CORRECT_CASES

ADVERSARIAL = {
    "tower of powers": "so \\boxed{9^{9^{9^{9}}}}",
    "1 MB string": "a " * 500_000 + "Answer: 5",
    "20,000 unbalanced boxes": "\\boxed{" * 20_000,
    "division by zero": "\\boxed{\\frac{1}{0}}",
    "huge factorial": "\\boxed{(9^9)!}",
    "1 MB of braces": "{" * 500_000 + "}" * 500_000,
    "1 MB of answer lines": "Answer: 1\n" * 100_000,
    "1 MB of 'the answer is'": "the answer is " * 75_000,
    "1 MB of \\(": "\\(" * 500_000,
    "1 MB of $": "$ " * 500_000,
    "1 MB of 1 +": "1 + " * 250_000,
    "1 MB number": "9" * 1_000_000,
}


# A hang guard, not a speed claim: each math-verify check is bounded by its CPU-time limit, and the parent kills a
# worker past verify_pool.CPU_KILL_S of CPU time in one check; on an idle machine the slowest input takes ~2 s
# (benchmarks/bench_reward.py measures it). On a loaded 2-core CI box wall time stretches several-fold, so the test
# only asserts that every call comes back -- an unbounded call (a hung worker, sympy on 9^9^9^9) never would.
HANG_S = 30.0


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_inputs_are_bounded(name):
    """Every call returns (within the hang guard) and never raises, whatever the text."""
    text = ADVERSARIAL[name]
    for answer in ("5", "\\frac{1}{2}"):
        for call, ok in [(lambda: reward.is_correct(text, answer), lambda v: isinstance(v, bool)),
                         (lambda: reward.dapo_score(text, answer), lambda v: v in (1.0, -1.0)),
                         (lambda: reward.score_batch([text], [answer]), lambda v: v in ([0.0], [1.0]))]:
            t = time.monotonic()
            assert ok(call())
            assert time.monotonic() - t < HANG_S, name


def test_cpu_time_limit_stops_runaway_sympy():
    """Inside a worker, 9^{9^{9^{9}}} is stopped by the CPU-time limit (CPU seconds, not wall seconds, so a busy
    machine does not cause spurious timeouts); run here in the main thread to measure it."""
    import math_verify  # noqa: F401  (import outside the measurement)

    t = time.process_time()
    with pytest.raises(verify_pool._CpuTimeout):
        verify_pool._math_verify("9^{9^{9^{9}}}", "7")
    assert time.process_time() - t < verify_pool.CPU_LIMIT_S + 0.5
    assert verify_pool._math_verify("x^{3}", "x^3") is True  # the timer is off again


def test_adversarial_reference_and_types():
    """The reference side and non-string inputs do not raise either."""
    for response, answer in [("Answer: 5", "x" * 1_000_000), ("Answer: 5", None), (b"Answer: 5", "5"),
                             ("Answer: 5", 5), ("Answer: 5", "\\boxed{" * 20_000)]:
        t = time.monotonic()
        assert isinstance(reward.is_correct(response, answer), bool)
        assert reward.dapo_score(response, answer) in (1.0, -1.0)
        assert time.monotonic() - t < HANG_S
    assert reward.is_correct("Answer: 5", 5) and reward.dapo_score("Answer: 5", 5) == 1.0


def fresh_pool(monkeypatch, workers=1):
    """An empty pool of `workers` processes (one: each start costs ~1-2 s of CPU on a busy machine) and an empty
    verdict cache for this test, restored after it; the old pool's workers stay up."""
    monkeypatch.setattr(verify_pool, "_POOL", None)
    monkeypatch.setattr(verify_pool, "_CACHE", {})
    monkeypatch.setattr(verify_pool, "NUM_WORKERS", workers)


def close_pool():
    if verify_pool._POOL is not None:
        verify_pool._POOL.close()


# answers that only math-verify can judge right (reward.py's exact paths cannot), and two that it judges wrong
NEEDS_MATH_VERIFY = [("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0), ("Answer: 0.25", "\\frac14", 1.0),
                     ("Answer: (x+1)^2", "x^2+2x+1", 1.0), ("Answer: (x-1)^2", "x^2+2x+1", 0.0),
                     ("\\boxed{\\sqrt{2}}", "1.41", 0.0)]


def judged_right():
    return reward.score_batch([r for r, _, _ in NEEDS_MATH_VERIFY], [a for _, a, _ in NEEDS_MATH_VERIFY]) == [
        e for _, _, e in NEEDS_MATH_VERIFY]


def test_cpu_overrun_is_killed_and_replaced(monkeypatch):
    """A check that uses more than CPU_KILL_S of CPU time in its worker is killed there by the parent (counted wrong)
    and the next check still works. The worker's own CPU limit is raised to 30 s so that only the parent can stop
    the sympy factorial: it stands in for C code that no signal interrupts."""
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "CPU_LIMIT_S", 30.0)  # passed to the workers this pool starts
    monkeypatch.setattr(verify_pool, "CPU_KILL_S", 0.1)
    try:
        before = dict(reward.STATS)
        t = time.monotonic()
        assert reward.is_correct("\\boxed{(9^9)!}", "7") is False
        assert time.monotonic() - t < HANG_S
        assert reward.STATS["timeouts"] == before["timeouts"] + 1  # the parent's CPU limit ended it
        assert reward.STATS["restarts"] == before["restarts"] + 1
        assert reward.is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt{3}") is True
    finally:
        close_pool()


def stop_workers_at_start(monkeypatch, count, resume_after=None):
    """Freeze the first `count` worker processes with SIGSTOP as soon as they are spawned -- a real slow start: the
    kernel runs none of their code, as on a machine too busy to schedule them -- and, with `resume_after`, let
    them go on (SIGCONT) that many seconds later. Returns the pids it froze."""
    frozen, start = [], verify_pool._Worker.start

    def resume(pid):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def frozen_start(self):
        start(self)
        if len(frozen) < count and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            frozen.append(self.proc.pid)
            if resume_after is not None:
                threading.Timer(resume_after, resume, args=(self.proc.pid,)).start()

    monkeypatch.setattr(verify_pool._Worker, "start", frozen_start)
    return frozen


def test_slow_start_is_waited_for(monkeypatch, caplog):
    """Workers that cannot run for a while after they are spawned (frozen 3 s; the old pool gave up on a start after
    20 s, twice, and then scored every such answer wrong) are waited for, with a log line once the wait is long:
    2\\sqrt2 = \\sqrt8, 0.25 = 1/4, (x+1)^2 = x^2+2x+1 are judged right and no worker is replaced."""
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "SLOW_START_S", 1.0)
    frozen = stop_workers_at_start(monkeypatch, verify_pool.NUM_WORKERS, resume_after=3.0)
    restarts = reward.STATS["restarts"]
    try:
        t = time.monotonic()
        assert judged_right()
        assert len(frozen) == verify_pool.NUM_WORKERS and time.monotonic() - t >= 3.0  # the freeze was real
        assert "has not started after" in caplog.text and "waiting for it" in caplog.text
        assert reward.STATS["restarts"] == restarts
        assert judged_right()  # and the pool stays up
    finally:
        close_pool()


def test_stalled_start_is_replaced(monkeypatch, caplog):
    """Workers that gain no CPU time at all for STALL_S (here 2 s; frozen for good) are hung, not slow: they are
    killed and fresh ones started, and the answers are judged right -- never counted wrong for it."""
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "STALL_S", 2.0)
    frozen = stop_workers_at_start(monkeypatch, verify_pool.NUM_WORKERS)
    restarts = reward.STATS["restarts"]
    try:
        assert judged_right()
        assert frozen and all(verify_pool._cpu_seconds(pid) is None for pid in frozen)  # killed and reaped
        assert reward.STATS["restarts"] >= restarts + 1 and "used no CPU time" in caplog.text
    finally:
        close_pool()


def test_pool_recovers_after_its_workers_are_killed_or_hung(monkeypatch):
    """A running pool's worker killed (SIGKILL, as the OOM killer would): the next checks start a fresh worker and
    judge right. Its replacement hung for good (SIGSTOP) while idle: the next check gets no reply and no CPU time
    for STALL_S (here 2 s), so the worker is replaced and the check retried -- judged right, not counted wrong."""
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "STALL_S", 2.0)
    try:
        for how in (signal.SIGKILL, signal.SIGSTOP):
            assert judged_right()
            pids = {w.proc.pid for w in verify_pool._POOL.idle}
            for pid in pids:
                os.kill(pid, how)
            verify_pool._CACHE.clear()
            restarts = reward.STATS["restarts"]
            assert judged_right()
            assert reward.STATS["restarts"] >= restarts + len(pids)
            assert not {w.proc.pid for w in verify_pool._POOL.idle} & pids
    finally:
        close_pool()



def runaway_check_is_killed(monkeypatch):
    """A check that only the parent can stop (the worker's own CPU limit raised to 30 s, as in
    test_cpu_overrun_is_killed_and_replaced) comes back wrong within the hang guard, counted as a timeout, and the
    replaced worker judges right."""
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "CPU_LIMIT_S", 30.0)
    timeouts = reward.STATS["timeouts"]
    try:
        t = time.monotonic()
        assert verify_pool.verify("(9^9)!", "7") is False
        assert time.monotonic() - t < HANG_S
        assert reward.STATS["timeouts"] == timeouts + 1
        assert verify_pool.verify("\\sqrt{12}", "2\\sqrt{3}") is True
    finally:
        close_pool()


@pytest.mark.skipif(importlib.util.find_spec("psutil") is None, reason="psutil is not installed")
def test_without_proc_psutil_reads_the_cpu_time(monkeypatch):
    """Where /proc cannot be read (macOS), the CPU time comes from psutil: this process's agrees with os.times()
    to one clock tick (both count ticks), and a worker is killed at CPU_KILL_S of CPU time (0.1 s here), with the
    wall-clock deadline out of reach (1,000 s)."""
    monkeypatch.setattr(verify_pool, "_proc_cpu_seconds", lambda pid: None)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = os.times()
    cpu = verify_pool._cpu_seconds(os.getpid())
    after = os.times()
    assert before.user + before.system - tick <= cpu <= after.user + after.system + tick
    monkeypatch.setattr(verify_pool, "CPU_KILL_S", 0.1)
    monkeypatch.setattr(verify_pool, "WALL_KILL_S", 1000.0)
    runaway_check_is_killed(monkeypatch)


def test_without_cpu_time_a_check_gets_a_wall_clock_deadline(monkeypatch):
    """Where no CPU time can be read at all (no /proc, no psutil), a check gets WALL_KILL_S (2 s here) of wall clock:
    a runaway check comes back wrong, as the CPU limit makes it where the time can be read. The stall rule needs CPU
    time and does not apply (with it, at STALL_S = 1 s, the worker would be replaced, the check retried, and
    Unavailable raised): a worker that runs nothing for longer than STALL_S (frozen 1.5 s) still gets its verdict
    within the default WALL_KILL_S."""
    monkeypatch.setattr(verify_pool, "_cpu_seconds", lambda pid: None)
    monkeypatch.setattr(verify_pool, "WALL_KILL_S", 2.0)
    monkeypatch.setattr(verify_pool, "STALL_S", 1.0)
    runaway_check_is_killed(monkeypatch)
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "WALL_KILL_S", 10.0)  # the default: the frozen check must not reach it
    try:
        assert verify_pool.verify("\\sqrt{8}", "2\\sqrt{2}") is True  # the worker is up
        (w,) = verify_pool._POOL.idle
        os.kill(w.proc.pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, args=(w.proc.pid, signal.SIGCONT)).start()
        restarts = reward.STATS["restarts"]
        assert verify_pool.verify("(x+1)^2", "x^2+2x+1") is True
        assert reward.STATS["restarts"] == restarts
    finally:
        close_pool()


def test_an_interrupted_check_does_not_shift_later_verdicts(monkeypatch):
    """A check interrupted between its request and its reply (KeyboardInterrupt from a timer 0.2 s into 9^{9^{9^{9}}},
    whose worker replies only once its CPU_LIMIT_S of 0.5 s CPU time is spent) leaves no reply in a worker's pipe for
    the next check to read: the worker is killed and replaced, and the verdicts after it are each its own (a stale
    reply would shift them by one: False, False, True, False)."""
    fresh_pool(monkeypatch)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    handler = signal.signal(signal.SIGALRM, interrupt)
    try:
        assert verify_pool.verify("\\sqrt{8}", "2\\sqrt{2}") is True  # the worker is up
        (w,) = verify_pool._POOL.idle
        pid = w.proc.pid
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            verify_pool.verify("9^{9^{9^{9}}}", "7")
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert w.proc is None or w.proc.pid != pid  # killed
        for pred, gold, want in [("x+2", "x+1", False), ("\\sqrt{12}", "2\\sqrt{3}", True), ("x+3", "x+1", False),
                                 ("\\frac{1}{4}", "0.25", True)]:
            assert verify_pool.verify(pred, gold) is want, (pred, gold)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        close_pool()


def test_a_closed_pool_starts_again(monkeypatch):
    """After the pool's close() (registered at exit) a check starts a worker again and judges right: it never
    answers without asking one."""
    fresh_pool(monkeypatch)
    try:
        assert verify_pool.verify("\\sqrt{8}", "2\\sqrt{2}") is True
        verify_pool._POOL.close()
        assert verify_pool.verify("\\sqrt{12}", "2\\sqrt{3}") is True
        assert reward.is_correct("\\boxed{(x+1)^2}", "x^2+2x+1") is True
    finally:
        close_pool()

def test_without_math_verify_scoring_raises(monkeypatch, tmp_path):
    """Workers whose Python cannot import math-verify (run with -S: no site-packages) report it, and scoring raises a
    one-line RuntimeError that names the import error, instead of counting such answers wrong. Answers decided
    without math-verify still score."""
    python = tmp_path / "python-without-site-packages"
    python.write_text(f"#!/bin/sh\nexec {verify_pool.PYTHON} -S \"$@\"\n")
    python.chmod(0o755)
    fresh_pool(monkeypatch)
    monkeypatch.setattr(verify_pool, "PYTHON", str(python))
    try:
        assert reward.is_correct("Answer: 1/2", "0.5") is True  # exact path: no worker needed
        for call in (lambda: reward.is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"),
                     lambda: reward.score_batch(["Answer: 7", "Answer: x+1"], ["7", "1+x"]),
                     lambda: verify_pool.verify("\\sqrt{12}", "2\\sqrt{3}")):
            with pytest.raises(RuntimeError, match="No module named 'math_verify'") as err:
                call()
            assert "\n" not in str(err.value) and isinstance(err.value, verify_pool.Unavailable)
    finally:
        close_pool()


def test_workers_that_cannot_start_raise_then_recover(monkeypatch):
    """No worker process can be spawned (a missing interpreter): after START_ATTEMPTS tries, scoring raises a
    one-line RuntimeError naming it. The pool is not given up for good: once workers can start again, the same
    process judges right."""
    fresh_pool(monkeypatch)
    executable = verify_pool.PYTHON
    monkeypatch.setattr(verify_pool, "PYTHON", "/nonexistent/python")
    try:
        with pytest.raises(RuntimeError, match="cannot start /nonexistent/python.*3 times") as err:
            reward.score_batch(["\\boxed{\\sqrt{12}}"], ["2\\sqrt{3}"])
        assert "\n" not in str(err.value)
        monkeypatch.setattr(verify_pool, "PYTHON", executable)
        assert judged_right()
    finally:
        close_pool()


def test_many_open_files(monkeypatch):
    """Worker pipes numbered above 1024 (a trainer holds many fds) still work: select() would fail there."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(hard, 4096) < 1200:
        pytest.skip("RLIMIT_NOFILE too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        fresh_pool(monkeypatch)
        assert reward.is_correct("\\boxed{\\sqrt{8}}", "2\\sqrt{2}") is True
        assert verify_pool._POOL.idle[0].proc.stdout.fileno() > 1024
        verify_pool._POOL.close()
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_from_threads():
    """Safe from any thread: math-verify's SIGALRM never runs in this process (it runs in worker processes)."""
    slow = [c for c in IS_CORRECT_CASES if c[0] and ("sqrt" in c[0] or "frac" in c[0])]
    results = {}

    def run(i):
        r, a, _ = slow[i]
        results[i] = reward.is_correct(r, a)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(slow))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [results[i] for i in range(len(slow))] == [e for _, _, e in slow]
    with ThreadPoolExecutor(4) as ex:  # score_batch from several threads at once
        out = list(ex.map(lambda c: reward.score_batch([c[0]], [c[1]])[0], IS_CORRECT_CASES))
    assert out == [1.0 if e else 0.0 for _, _, e in IS_CORRECT_CASES]


def _forked_child(queue):
    queue.put(reward.is_correct("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"))


def test_in_forked_child():
    """A process forked after the pool exists builds its own workers instead of sharing the parent's pipes."""
    verify_pool._pool()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_child, args=(q,))
    p.start()
    assert q.get(timeout=30) is True
    p.join(timeout=30)

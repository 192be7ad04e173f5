"""verify_pool.py, the worker processes that run math-verify for reward.py: every call comes back in bounded time and
never raises, whatever the text (adversarial inputs, runaway sympy, a hung worker, no workers at all); it works with
file descriptors above 1024, from several threads at once, and in a forked child."""

import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import reward
import verify_pool
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


# A hang guard, not a speed claim: each math-verify check is bounded by its CPU-time limit and a 2 s wall deadline
# (verify_pool.ITEM_TIMEOUT_S) after which the worker is killed; on an idle machine the slowest input takes ~2 s
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


def test_hung_worker_is_killed_and_replaced(monkeypatch):
    """A check that overruns the hard deadline is killed (counted wrong) and the next check still works.
    A sympy factorial that the worker's CPU limit (0.5 s) would stop stands in for an uninterruptible C-level hang
    by shrinking the parent's wall-clock deadline to 50 ms."""
    verify_pool._pool().check("1", "1")  # make sure the workers are up before the deadline shrinks
    deadline = verify_pool.ITEM_TIMEOUT_S
    monkeypatch.setattr(verify_pool, "ITEM_TIMEOUT_S", 0.05)
    monkeypatch.setattr(verify_pool, "_CACHE", {})
    before = reward.STATS["timeouts"]
    t = time.monotonic()
    assert reward.is_correct("\\boxed{(9^9)!}", "7") is False
    assert time.monotonic() - t < HANG_S
    assert reward.STATS["timeouts"] == before + 1  # the deadline, not the CPU limit, ended it: the worker was killed
    monkeypatch.setattr(verify_pool, "ITEM_TIMEOUT_S", deadline)
    assert reward.is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt{3}") is True


def test_without_workers_falls_back_to_exact_matches(monkeypatch, caplog):
    """If no worker process can start, nothing raises: exact and numeric matches still count, the rest is wrong."""
    monkeypatch.setattr(verify_pool, "_POOL", None)
    monkeypatch.setattr(verify_pool, "_CACHE", {})
    monkeypatch.setattr(verify_pool, "_WARNED", [])
    monkeypatch.setattr(verify_pool.sys, "executable", "/nonexistent/python")
    assert reward.is_correct("Answer: 1/2", "0.5") is True
    assert reward.is_correct("\\boxed{\\sqrt{12}}", "2\\sqrt{3}") is False
    assert reward.score_batch(["Answer: 7", "Answer: x+1"], ["7", "1+x"]) == [1.0, 0.0]
    assert "unavailable" in caplog.text and verify_pool._POOL.broken


def test_many_open_files(monkeypatch):
    """Worker pipes numbered above 1024 (a trainer holds many fds) still work: select() would fail there."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(hard, 4096) < 1200:
        pytest.skip("RLIMIT_NOFILE too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        monkeypatch.setattr(verify_pool, "_POOL", None)
        monkeypatch.setattr(verify_pool, "_CACHE", {})
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

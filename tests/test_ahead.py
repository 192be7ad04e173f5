"""conftest.Ahead, the runner of the jobs that tests marked `ahead` read: each job runs once however many tests ask,
in the runner's thread (from the last job backwards) or in the asking test's, whichever comes first; what a job
raises reaches every test that asks; the thread stays until the pytest run closes it (tests count this process's
threads)."""
import threading

import pytest

from conftest import Ahead


class Folders:
    """tmp_path_factory's mktemp, counted."""

    def __init__(self, base):
        self.base, self.made = base, []

    def mktemp(self, name):
        path = self.base / f"{name}{len(self.made)}"
        path.mkdir()
        self.made.append(name)
        return path


def test_the_thread_starts_from_the_last_job_and_the_tests_from_the_first(tmp_path):
    """Jobs first, last, last (one job asked by two tests): the thread starts `last` and holds it; a test that asks
    for `first` runs it in its own thread at once; two tests that ask for `last` wait for the thread's one run. A job
    that fails raises in every test that asks; one never marked runs where it is asked, once."""
    calls, started, gate = [], threading.Event(), threading.Event()

    def record(name):
        calls.append((name, threading.current_thread().name))

    def _first(folder):
        record("first")
        return folder.name

    def _last(folder):
        record("last")
        started.set()
        gate.wait(timeout=60)   # held until both tests wait on it
        return folder.name

    def _fails(folder):
        record("fails")
        raise ValueError("boom")

    folders = Folders(tmp_path)
    runner = Ahead([_first, _last, _last], folders, threads=1)
    try:
        assert started.wait(timeout=60)
        assert runner.result(_first) == "first1"   # the thread holds `last` (folder 0): this runs here, now
        got = []
        askers = [threading.Thread(target=lambda: got.append(runner.result(_last))) for _ in range(2)]
        for t in askers:
            t.start()
        gate.set()
        for t in askers:
            t.join(timeout=60)
        assert got == ["last0", "last0"]
        for _ in range(2):  # the same exception, to each test that asks
            with pytest.raises(ValueError, match="boom"):
                runner.result(_fails)
        here = threading.current_thread().name
        assert calls == [("last", "tests-ahead-0"), ("first", here), ("fails", here)], calls
        assert folders.made == ["last", "first", "fails"]
        assert runner.threads[0].is_alive()  # the queue is empty; the thread waits for the close
    finally:
        runner.close()
    assert not runner.threads[0].is_alive()


def test_without_the_thread_a_job_runs_where_it_is_asked(tmp_path):
    threads = []

    def _job(folder):
        threads.append(threading.current_thread())
        return folder.name

    runner = Ahead([_job], Folders(tmp_path), threads=0)
    assert runner.threads == [] and runner.result(_job) == "job0" and threads == [threading.current_thread()]
    runner.close()


def test_jobs_added_while_collecting_then_selected(tmp_path):
    """As collection finds them, jobs are added: the thread starts the first at once, then takes the costliest. Once
    collection ends, the queue becomes the selected jobs not started yet: a deselected job never runs, a started one
    is not run again."""
    calls, started, gate = [], threading.Event(), threading.Event()

    def _a(folder):
        calls.append("a")
        started.set()
        gate.wait(timeout=60)
        return "a"

    def _b(folder):
        calls.append("b")
        return "b"

    def _c(folder):  # collected, then deselected (-k, -m)
        calls.append("c")
        return "c"

    runner = Ahead([], Folders(tmp_path), threads=1)
    try:
        runner.add(_a)
        assert started.wait(timeout=60)   # started before collection ended
        runner.add(_c, cost=5.0)
        runner.add(_b, cost=1.0)
        assert runner.queue == [_b, _c]   # the thread takes the costliest first (the queue's end)
        runner.select([_a, _b])           # the selected tests' jobs, the cheapest first: `a` is running, `c` is gone
        assert runner.queue == [_b]
        gate.set()
        assert runner.result(_a) == "a" and runner.result(_b) == "b"
    finally:
        runner.close()
    assert sorted(calls) == ["a", "b"], calls

"""conftest.Ahead, the runner of the jobs that tests marked `ahead` read: each job runs once however many tests ask,
in the thread or in the asking test's, whichever comes first; what a job raises reaches every test that asks; the
runner's thread stays until the session closes it (tests count this process's threads)."""
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


def test_each_job_runs_once_in_its_own_folder_and_errors_reach_every_asker(tmp_path):
    calls, gate = [], threading.Event()

    def _slow(folder):
        gate.wait(timeout=60)   # held until both askers wait on it
        calls.append(("slow", folder))
        return 1

    def _fails(folder):
        calls.append(("fails", folder))
        raise ValueError("boom")

    def _later(folder):
        calls.append(("later", folder))
        return 3

    folders = Folders(tmp_path)
    runner = Ahead([_slow, _fails, _slow], folders, start=True)
    try:
        got = []
        askers = [threading.Thread(target=lambda: got.append(runner.result(_slow))) for _ in range(2)]
        for t in askers:
            t.start()
        gate.set()
        for t in askers:
            t.join(timeout=60)
        assert got == [1, 1]
        for _ in range(2):  # the same exception, to each test that asks
            with pytest.raises(ValueError, match="boom"):
                runner.result(_fails)
        assert runner.result(_later) == 3    # never queued: run in the asking thread, once
        assert runner.result(_later) == 3
        assert [name for name, _ in calls] == ["slow", "fails", "later"]
        assert folders.made == ["slow", "fails", "later"] and len({f for _, f in calls}) == 3
        assert runner.thread.is_alive()      # the queue is empty; the thread waits for the close
    finally:
        runner.close()
    assert not runner.thread.is_alive()


def test_without_the_thread_a_job_runs_where_it_is_asked(tmp_path):
    threads = []

    def _job(folder):
        threads.append(threading.current_thread())
        return folder.name

    runner = Ahead([_job], Folders(tmp_path), start=False)
    assert runner.thread is None and runner.result(_job) == "job0" and threads == [threading.current_thread()]
    runner.close()

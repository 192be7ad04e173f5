"""pytest set-up for tests/ and derivations/: this file's folder (the repository root) goes on sys.path, which makes
band.py, grpo.py, ... importable; `gpu` tests are skipped without CUDA; `group` is the one-process gloo group of the
tests that build FSDP2 models in this process. precision is imported first: its oneMKL warm-up must run before any
test's first multithreaded float math (machinery/precision.py says why).

`ahead`: a test whose work is a command it then reads (a torchrun pair, a vLLM probe) names that work with
`@pytest.mark.ahead.with_args(job, cpu_s=S)` (`with_args`: a mark called on a function alone would decorate it; a
test's own mark overrides its module's; S, the job's CPU seconds as once measured, orders the jobs) and gets its result
with `ahead.result(job)`. The marked jobs of the selected tests run one after another in a thread of this process,
the first as soon as its test is collected (collection keeps one core busy for ~20 s), then the costliest first,
while the tests of this process run beside them; the tests that read a job run last, the cheapest job's first, and
run a job not yet started themselves: the two meet at cheap jobs, and the two cores work at once to the end. Each job
runs once per pytest run, however many tests share it, in a folder of its own; what it raises is raised in each test
that asks for it. BANDPO_TESTS_AHEAD=N runs N threads (1 by default); 0 runs every job where its test asks for it, in
the files' order."""
import os
import socket
import threading

import pytest

# Threads that wait for their OpenMP peers sleep instead of spinning: beside a job of `ahead` (or any busy process) a
# spinning thread holds a core its peer needs, and the 2-thread tests of this process ran 2.4x slower (SmolLM2's
# generate, 36.8 s against 15.0 s beside a busy loop). Read by libgomp when torch loads: set before it is imported
# (here, unless a plugin imported torch first), and inherited by the commands the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from machinery import precision  # noqa: E402,F401

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")
_GIVEN_PORTS, _PORTS_LOCK = set(), threading.Lock()


def free_port():
    """A port free now and not given before in this pytest run: the kernel may give a closed port out again at once,
    and two commands started together (a job of `ahead` and a test's, or a 1- and a 2-rank run) must not share it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _PORTS_LOCK:  # the ahead thread and a test may ask at once
            if port not in _GIVEN_PORTS:
                _GIVEN_PORTS.add(port)
                return port


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group (world size 1) for a test module that builds FSDP2 models in this process, on a free
    port; afterwards the rendezvous variables are as they were, so a later subprocess picks its own port."""
    import torch.distributed as dist

    before = {k: os.environ.get(k) for k in RENDEZVOUS}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


AHEAD_THREADS = 1  # threads that start marked jobs (BANDPO_TESTS_AHEAD overrides; 0: each where its test asks)


def ahead_threads():
    return int(os.environ.get("BANDPO_TESTS_AHEAD", AHEAD_THREADS))


class Ahead:
    """The marked jobs, started by the thread from the last test's backwards while the tests ask from the first
    forwards: a test that asks for a job not started yet runs it in its own thread, so that neither waits for the
    other until the two meet; `result(job)` waits for a started one. The thread stays until the pytest run ends
    (tests count this process's threads)."""

    def __init__(self, jobs, tmp_path_factory, threads):
        self.tmp, self.lock, self.done = tmp_path_factory, threading.Condition(), {}
        self.queue, self.running, self.closing, self.costs = list(dict.fromkeys(jobs)), set(), False, {}
        self.threads = [threading.Thread(target=self._work, name=f"tests-ahead-{i}", daemon=True)
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def _take(self, job=None):
        """-> the job to run now (the asked one, or the queue's next), marked running; None if there is none."""
        with self.lock:
            if job is None:  # a thread: waits for the queue (it stays until close)
                while not self.queue and not self.closing:
                    self.lock.wait()
                job = None if self.closing else self.queue[-1]
            if job is None or job in self.done or job in self.running:
                return None
            if job in self.queue:  # a job leaves the queue when it starts, so the queue holds none done or running
                self.queue.remove(job)
            self.running.add(job)
            return job

    def _run(self, job):
        try:
            out = (True, job(self.tmp.mktemp(job.__name__.strip("_"))))
        except BaseException as e:  # the test that asks raises it, with its traceback
            out = (False, e)
        with self.lock:
            self.running.discard(job)
            self.done[job] = out
            self.lock.notify_all()

    def _work(self):
        while (job := self._take()) is not None:
            self._run(job)

    def result(self, job):
        if (mine := self._take(job)) is not None:
            self._run(mine)
        with self.lock:
            while job not in self.done:
                self.lock.wait()
            ok, value = self.done[job]
        if not ok:
            raise value
        return value

    def add(self, job, cost=0.0):
        """Queue `job` (collection found it), ordered by `cost`: the thread takes the costliest first."""
        with self.lock:
            self.costs[job] = cost
            if job not in self.queue and job not in self.running and job not in self.done and not self.closing:
                self.queue.append(job)
                self.queue.sort(key=lambda j: self.costs.get(j, 0.0))  # stable
                self.lock.notify_all()

    def select(self, jobs):
        """The queue becomes `jobs` not started yet, in that order (what collection left selected)."""
        with self.lock:
            if not self.closing:
                self.queue = [j for j in jobs if j not in self.running and j not in self.done]
                self.lock.notify_all()

    def close(self):
        """No job starts after this; a running one ends (its subprocesses have their own hang guards)."""
        with self.lock:
            self.closing, self.queue = True, []
            self.lock.notify_all()
        for t in self.threads:
            t.join()


def skipped(item):
    """A test that is skipped whatever it computes (a skip mark, or a skipif whose condition is already true)."""
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
               for m in item.iter_markers())


def ahead_cost(item):
    """The CPU seconds of the job `item` reads (its mark's `cpu_s`: an order, not a limit; measured with
    BANDPO_TESTS_AHEAD=0, children's CPU included, on a 2-core Zen 4 VM, 2026-12-03); -1 if none.
    The thread runs the costliest jobs first and the tests read the cheapest first, so that the two meet at cheap
    ones: a costly job left to the end would leave a core idle while it runs alone."""
    mark = item.get_closest_marker("ahead")  # a test's own mark over its module's
    return -1.0 if mark is None else float(mark.kwargs.get("cpu_s", 0.0))


def selected_jobs(items):
    """The jobs of `items` that will run, once each, the cheapest first (the thread takes them from the end)."""
    ahead_items = sorted((item for item in items if not skipped(item) and ahead_cost(item) >= 0), key=ahead_cost)
    return list(dict.fromkeys(item.get_closest_marker("ahead").args[0] for item in ahead_items))


def will_be_selected(item, config):
    """Whether -k and -m will keep `item`, asked as it is collected (pytest deselects after collection, with the same
    matchers); None where pytest's matchers cannot be read."""
    try:
        from _pytest.mark import KeywordMatcher, MarkMatcher
        from _pytest.mark.expression import Expression
    except ImportError:
        return None
    keyword, marks = config.option.keyword.strip(), config.option.markexpr
    return ((not keyword or Expression.compile(keyword).evaluate(KeywordMatcher.from_item(item)))
            and (not marks or Expression.compile(marks).evaluate(MarkMatcher.from_markers(item.iter_markers()))))


def pytest_itemcollected(item):
    """A selected test's job is queued as its module is collected, so that the thread starts the first one while
    pytest still imports the other modules (~20 s of one core on this project's CPUs): collection leaves the
    second core idle otherwise. The queue is set to the run's selected tests when the first test starts."""
    config = item.config
    mark = item.get_closest_marker("ahead")
    if (mark is None or not ahead_threads() or config.option.collectonly or skipped(item)
            or not will_be_selected(item, config)):
        return
    if not hasattr(config, "_bandpo_ahead"):
        config._bandpo_ahead = Ahead([], config._tmp_path_factory, threads=ahead_threads())
    config._bandpo_ahead.add(mark.args[0], ahead_cost(item))


def pytest_unconfigure(config):
    if hasattr(config, "_bandpo_ahead"):  # a run that collected jobs but ran no test that reads one
        config._bandpo_ahead.close()


@pytest.fixture(scope="session", autouse=True)
def ahead(request, tmp_path_factory):
    """The pytest run's Ahead, started with it (or as the first job's test was collected): the jobs of the selected
    tests that will run."""
    runner = getattr(request.config, "_bandpo_ahead", None)
    if runner is None:
        runner = Ahead(selected_jobs(request.node.items), tmp_path_factory, threads=ahead_threads())
    else:  # the queue becomes the selected tests' jobs not started yet (the costliest taken first)
        runner.select(selected_jobs(request.node.items))
    yield runner
    runner.close()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without CUDA. The tests that read a job of `ahead` run last, in their order: the tests of
    this process run first, beside the thread's jobs, and no test of this process is left to run alone at the end."""
    import torch

    if ahead_threads():
        items.sort(key=ahead_cost)  # stable: the order kept within; the tests that read a job last, the cheapest first
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

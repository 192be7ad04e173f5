"""The configuration's memory-dependent default: activation checkpointing decided on each rank's own device, the
same on every rank, and free memory read without /proc/meminfo (macOS) and under a container's memory limit.

Claims checked: free memory has a portable source when /proc/meminfo is missing, bounded by the physical memory; the
room under cgroup v1 and v2 memory limits (hand-computed on written trees, and on a real cgroup of the machine where
one can be made) bounds it; two ranks whose free memory differs decide the same, from the least of them (the MIN collective); the memory
estimate's micro-batch holds a row longer than the token budget (hand-computed).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import config
from conftest import free_port
from machinery import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-arith")
PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
NO_CGROUP = "/nonexistent/cgroup"  # as on macOS: no cgroup limit bounds the host's free memory


def test_free_memory_without_proc_meminfo(monkeypatch):
    """No /proc/meminfo: psutil where installed, else os.sysconf; each a positive amount within the physical
    memory, the source named."""
    free, source = memory.free_memory("cpu", meminfo="/nonexistent/meminfo", proc_cgroup=NO_CGROUP)
    assert 0 < free <= PHYSICAL and source in ("psutil", "os.sysconf free pages")
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    free, source = memory.free_memory("cpu", meminfo="/nonexistent/meminfo", proc_cgroup=NO_CGROUP)
    assert 0 < free <= PHYSICAL and source.startswith(("os.sysconf", "half the physical"))


def test_free_memory_reads_memavailable_per_local_rank(monkeypatch, tmp_path):
    """A meminfo file written here: MemAvailable (not MemFree) in KiB, split over the local ranks, who share
    the RAM, by integer division: 1000003 KiB = 1024003072 B, / 4 = 256000768 B."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        2000000 kB\nMemFree:          500000 kB\n"
                       "MemAvailable:    1000003 kB\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert memory.free_memory("cpu", meminfo=str(meminfo), proc_cgroup=NO_CGROUP) == (1024003072, str(meminfo))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory.free_memory("cpu", meminfo=str(meminfo), proc_cgroup=NO_CGROUP) == (256000768, str(meminfo))
    # a meminfo without MemAvailable (an old kernel) falls through to the portable sources
    meminfo.write_text("MemTotal:        2000000 kB\n")
    assert memory.free_memory("cpu", meminfo=str(meminfo), proc_cgroup=NO_CGROUP)[1] != str(meminfo)


def _tree(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _mountinfo(tmp_path, fstype, root, point):
    """A /proc/self/mountinfo with one cgroup mount: hierarchy `root` mounted at `point` (v1: the memory controller)."""
    f = tmp_path / "mountinfo"
    opts = "rw,memory" if fstype == "cgroup" else "rw"
    f.write_text(f"23 1 0:21 / /sys rw,relatime - sysfs sysfs rw\n35 31 0:32 {root} {point} rw,relatime - {fstype} "
                 f"{fstype} {opts}\n")
    return str(f)


def test_cgroup_memory_room_v2_takes_the_tightest_ancestor(tmp_path, monkeypatch):
    """cgroup v2 files written here: the job's own cgroup has no limit ("max"), its parent 4 GiB with 1.0e9 B used
    of which 2.0e8 B inactive file cache: room = 4294967296 - 1000000000 + 200000000 = 3494967296 B, named by the
    parent's memory.max. A tighter limit on the job itself (1 GiB, 5.0e8 used, none inactive) wins: 573741824 B.
    free_memory takes the cgroup's room where it is below MemAvailable (8 GiB here), and splits it over ranks."""
    root = tmp_path / "cg"
    _tree(root, {"cgroup.controllers": "cpu memory\n",
                 "user.slice/memory.max": "4294967296\n", "user.slice/memory.current": "1000000000\n",
                 "user.slice/memory.stat": "anon 800000000\ninactive_file 200000000\n",
                 "user.slice/job/memory.max": "max\n", "user.slice/job/memory.current": "600000000\n",
                 "user.slice/job/memory.stat": "anon 600000000\ninactive_file 0\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    mounts = _mountinfo(tmp_path, "cgroup2", "/", root)
    limit = str(root / "user.slice" / "memory.max")
    assert memory.cgroup_memory_room(str(proc), mounts) == (3494967296, limit)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable:    {8 * 2**20} kB\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert memory.free_memory("cpu", str(meminfo), str(proc), mounts) == (3494967296 // 2, limit)
    _tree(root, {"user.slice/job/memory.max": f"{2**30}\n", "user.slice/job/memory.current": "500000000\n"})
    assert memory.cgroup_memory_room(str(proc), mounts) == (2**30 - 500000000, str(root / "user.slice/job/memory.max"))
    # a path above the namespace's root ("/../x"): the mounted cgroup, an ancestor, and never a sibling
    _tree(root, {"memory.max": f"{2**31}\n", "memory.current": "1000\n", "memory.stat": "inactive_file 0\n"})
    proc.write_text("0::/../user.slice/job\n")
    assert memory.cgroup_memory_room(str(proc), mounts) == (2**31 - 1000, str(root / "memory.max"))
    # no limit anywhere: MemAvailable stands
    _tree(root, {"memory.max": "max\n", "user.slice/memory.max": "max\n", "user.slice/job/memory.max": "max\n"})
    proc.write_text("0::/user.slice/job\n")
    assert memory.cgroup_memory_room(str(proc), mounts) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert memory.free_memory("cpu", str(meminfo), str(proc), mounts) == (8 * 2**30, str(meminfo))


def test_cgroup_memory_room_v1_containers_and_hierarchical_limits(tmp_path):
    """cgroup v1 files written here. The host's view: /docker/abc limits 2 GiB with 1.5e9 B used, 1.0e8 B of it
    inactive file cache: 2147483648 - 1500000000 + 100000000 = 747483648 B. A container without a cgroup namespace
    mounts its own cgroup (mountinfo's root /docker/abc) while /proc/self/cgroup names the host's path: its 1 GiB,
    2.5e8 used -> 823741824 B; a cgroup inside it (/docker/abc/sub, 512 MiB, 1.0e8 used) -> 436870912 B. A limit set
    on an ancestor the container cannot see shows only as memory.stat's hierarchical_memory_limit (3 GiB, own limit
    unlimited, 1.0e9 used) -> 2221225472 B; one the process can see counts its other children's usage too."""
    unlimited = "9223372036854771712\n"
    host = tmp_path / "host"
    _tree(host, {"memory/memory.limit_in_bytes": unlimited, "memory/memory.usage_in_bytes": "9000000000\n",
                 "memory/memory.stat": "total_inactive_file 0\n",
                 "memory/docker/abc/memory.limit_in_bytes": f"{2**31}\n",
                 "memory/docker/abc/memory.usage_in_bytes": "1500000000\n",
                 "memory/docker/abc/memory.stat": "cache 300000000\ntotal_inactive_file 100000000\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n\n0::/\n")  # a blank line is skipped
    assert memory.cgroup_memory_room(str(proc), _mountinfo(tmp_path, "cgroup", "/", host / "memory")) == (
        747483648, str(host / "memory/docker/abc/memory.limit_in_bytes"))
    box = tmp_path / "box"
    _tree(box, {"memory/memory.limit_in_bytes": f"{2**30}\n", "memory/memory.usage_in_bytes": "250000000\n",
                "memory/memory.stat": "total_inactive_file 0\n"})
    mounts = _mountinfo(tmp_path, "cgroup", "/docker/abc", box / "memory")
    assert memory.cgroup_memory_room(str(proc), mounts) == (823741824, str(box / "memory/memory.limit_in_bytes"))
    _tree(box, {"memory/sub/memory.limit_in_bytes": f"{2**29}\n", "memory/sub/memory.usage_in_bytes": "100000000\n",
                "memory/sub/memory.stat": "total_inactive_file 0\n"})
    proc.write_text("4:memory:/docker/abc/sub\n")
    assert memory.cgroup_memory_room(str(proc), mounts) == (436870912, str(box / "memory/sub/memory.limit_in_bytes"))
    _tree(box, {"memory/memory.limit_in_bytes": unlimited, "memory/memory.usage_in_bytes": "1000000000\n",
                "memory/memory.stat": f"hierarchical_memory_limit {3 * 2**30}\ntotal_inactive_file 0\n"})
    proc.write_text("4:memory:/docker/abc\n")
    assert memory.cgroup_memory_room(str(proc), mounts) == (
        2221225472, str(box / "memory/memory.stat") + " hierarchical_memory_limit")
    # a visible ancestor with its own limit counts what its other children use: kube limits 4 GiB with 3.5e9 B used
    # (the pod 1.0e9 of it): 4294967296 - 3500000000 = 794967296 B, below the pod's hierarchical 4 GiB - 1.0e9
    _tree(host, {"memory/kube/memory.limit_in_bytes": f"{2**32}\n", "memory/kube/memory.usage_in_bytes": "3500000000\n",
                 "memory/kube/memory.stat": f"hierarchical_memory_limit {2**32}\ntotal_inactive_file 0\n",
                 "memory/kube/pod/memory.limit_in_bytes": unlimited,
                 "memory/kube/pod/memory.usage_in_bytes": "1000000000\n",
                 "memory/kube/pod/memory.stat": f"hierarchical_memory_limit {2**32}\ntotal_inactive_file 0\n"})
    proc.write_text("4:memory:/kube/pod\n")
    assert memory.cgroup_memory_room(str(proc), _mountinfo(tmp_path, "cgroup", "/", host / "memory")) == (
        794967296, str(host / "memory/kube/memory.limit_in_bytes"))
    proc.write_text("4:memory:/docker/abc\n")
    mounts = _mountinfo(tmp_path, "cgroup", "/docker/abc", box / "memory")  # the container's again
    # a malformed limit file is skipped, not raised; no memory controller, no mount, no /proc/self/cgroup: None
    _tree(box, {"memory/memory.limit_in_bytes": "\n", "memory/memory.stat": "total_inactive_file 0\n"})
    assert memory.cgroup_memory_room(str(proc), mounts) is None
    proc.write_text("3:cpuset:/\n")
    assert memory.cgroup_memory_room(str(proc), mounts) is None
    proc.write_text("4:memory:/docker/abc\n")
    assert memory.cgroup_memory_room(str(proc), _mountinfo(tmp_path, "cgroup2", "/", box)) is None
    assert memory.cgroup_memory_room(NO_CGROUP, mounts) is None


def _memory_cgroup(limit):
    """A memory cgroup of this machine limited to `limit` bytes (v1 or v2), or None where this process may not make
    one (not root, no memory controller, a read-only cgroup mount)."""
    name = f"bandpo-test-{os.getpid()}"
    for d, limit_file in ((os.path.join("/sys/fs/cgroup/memory", name), "memory.limit_in_bytes"),
                          (os.path.join("/sys/fs/cgroup", name), "memory.max")):
        if not os.path.isdir(os.path.dirname(d)) or (limit_file == "memory.max" and not os.path.exists(
                "/sys/fs/cgroup/cgroup.controllers")):
            continue
        try:
            os.mkdir(d)
        except OSError:
            continue
        try:
            with open(os.path.join(d, limit_file), "w") as f:
                f.write(str(limit))
            return d
        except OSError:
            os.rmdir(d)
    return None


def test_cgroup_memory_room_sees_this_machines_cgroup_limit():
    """A real cgroup of this machine limited to 3 GiB, and a Python process in it (it joins before it imports
    anything): the room is at most the 3 GiB less what the process already uses, and more than 3 GiB less 1.5 GiB
    (the interpreter with torch takes ~0.35 GiB), named by the cgroup's own files. Skipped where this process may
    not make a memory cgroup."""
    limit = 3 * 2**30
    d = _memory_cgroup(limit)
    if d is None:
        pytest.skip("no writable memory cgroup here (needs root and a memory controller)")
    try:
        code = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); sys.path.insert(0, sys.argv[2]); "
                "from machinery import memory; print(*memory.cgroup_memory_room(), sep='\\n')")
        r = subprocess.run([sys.executable, "-c", code, os.path.join(d, "cgroup.procs"), ROOT], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        room, source = r.stdout.split("\n")[:2]
        assert limit - 1.5 * 2**30 < int(room) < limit and source.startswith(d), (room, source)
    finally:
        os.rmdir(d)  # empty again: the process has exited


def test_a_row_longer_than_the_budget_is_its_own_micro_batch():
    """A 2048-token budget with 1024 + 4096-token rows: the largest micro-batch is one row of 5120 tokens."""
    cfg = config.Config(micro_batch_tokens=2048, max_prompt_len=1024, max_new_tokens=4096)
    assert config.micro_batch_tokens(cfg) == 5120
    cfg = config.Config(micro_batch_tokens=8192, max_prompt_len=1024, max_new_tokens=4096)
    assert config.micro_batch_tokens(cfg) == 8192
    cfg = config.Config(micro_batch_size=4, max_prompt_len=64, max_new_tokens=16)
    assert config.micro_batch_tokens(cfg) == 4 * 80


# (free memory by rank, the decision, Config fields): the last two leave --micro-batch-tokens to auto under packed
# rows and compiled layers (the largest budget that fits: machinery/memory.largest_micro_batch)
CASES = (((1 << 40, 1 << 20), "refused", {}), ((1 << 40, 1 << 41), "none", {}),
         ((1 << 40, 1 << 27), "none", dict(pack=True, compile_layers=True)),
         ((1 << 40, 1 << 40), "none", dict(pack=True, compile_layers=True)))


def _decide(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case, (free_by_rank, _, fields) in enumerate(CASES):
            # what this rank's device would report (a spawned process: the patch dies with it)
            config.free_memory = lambda device, f=free_by_rank: (f[rank], "test")
            cfg = config.Config(model=TINY, grad_checkpointing=None, **fields)
            try:
                decided, free, _ = config.decide_grad_checkpointing(cfg, torch.device("cpu"))
                out.put((case, rank, decided.recompute, free, decided.micro_batch_tokens))
            except ValueError as e:   # auto refuses where nothing fits: the message names the free memory it used
                out.put((case, rank, "refused", str(e)))
    except BaseException as e:   # anything else reaches the parent at once, not at its hang guard
        out.put((-1, rank, "error", repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def _two_ranks_decide(tmp):
    """_decide on two spawned ranks -> every rank's result of every case, sorted."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_decide, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    # a hang guard: a spawned interpreter importing torch and transformers on a busy 2-core machine
    results = []
    for _ in range(2 * len(CASES)):
        results.append(out.get(timeout=600))
        assert results[-1][2] != "error", results[-1]
    results.sort()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    return results


@pytest.mark.ahead.with_args(_two_ranks_decide, cpu_s=11)
def test_checkpointing_is_decided_from_the_least_free_memory_of_any_rank(ahead):
    """Two ranks, two cases in one process group. Rank 0 has 1 TiB free, rank 1 only 1 MiB (less than the tiny
    model's update needs under any recomputation): both ranks refuse, naming rank 1's memory (0.0 GiB), though rank 0
    alone would fit. With both ample, both recompute nothing and report the lesser memory. Under packed rows and
    compiled layers the token budget auto picks is the same on both ranks and follows the lesser memory: 128 MiB on
    rank 1 gives a smaller budget (but one) than 1 TiB on both."""
    results = ahead.result(_two_ranks_decide)
    for case, (free_by_rank, expected, _) in enumerate(CASES):
        got = [r for r in results if r[0] == case]
        assert [r[2] for r in got] == [expected, expected], results
        if expected == "refused":
            assert all("no recomputation fits the update in half the 0.0 GiB free" in r[3] for r in got), results
        else:
            assert [r[3] for r in got] == [min(free_by_rank)] * 2
            assert got[0][4] == got[1][4], results
    budget = {case: next(r[4] for r in results if r[0] == case) for case in (2, 3)}
    assert 0 < budget[2] < budget[3], budget


@pytest.mark.parametrize("kw,world,lens,expected", [
    # G (p + t) against 2 (p + G t), by hand: 8 x 80 = 640 >= 2 x (48 + 256) = 608: the chat arithmetic shares
    (dict(group_size=8, max_new_tokens=32, micro_batch_size=16), 1, [48, 48], True),
    # the tiny model's 8-token prompts: 8 x 24 = 192 < 2 x (8 + 128) = 272
    (dict(group_size=8, max_new_tokens=16, micro_batch_size=16), 1, [8, 8], False),
    # the mean prompt decides: (40 + 56) / 2 = 48 as above
    (dict(group_size=8, max_new_tokens=32, micro_batch_size=16), 1, [40, 56], True),
    # micro-batches of 12 rows cut groups of 8
    (dict(group_size=8, max_new_tokens=32, micro_batch_size=12), 1, [48], False),
    # a token budget plans rows by length, not by group
    (dict(group_size=8, max_new_tokens=32, micro_batch_size=16, micro_batch_tokens=512), 1, [48], False),
    # 4 prompts over 4 ranks in 2 mini-batches: each rank's mini-batch is half a group
    (dict(group_size=8, max_new_tokens=32, micro_batch_size=8, prompts_per_step=4, mini_batch_prompts=2), 4,
     [48], False),
    # no prompt lengths known: off
    (dict(group_size=8, max_new_tokens=32, micro_batch_size=16), 1, [], False),
])
def test_shared_prompt_decided_where_it_halves_the_tokens(kw, world, lens, expected):
    cfg = config.Config(**{**dict(prompts_per_step=8, mini_batch_prompts=4), **kw})
    assert config.shares_prompt_pays(cfg, world, lens) is expected

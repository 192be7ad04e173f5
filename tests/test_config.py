"""The configuration's memory-dependent default: activation checkpointing decided on each rank's own device, the
same on every rank, and free memory read without /proc/meminfo (macOS).

Claims checked: free memory has a portable source when /proc/meminfo is missing, bounded by the physical memory;
two ranks whose free memory differs decide the same, from the least of them (the MIN collective); the memory
estimate's micro-batch holds a row longer than the token budget (hand-computed).
"""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import config
import policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-arith")
PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_free_memory_without_proc_meminfo(monkeypatch):
    """No /proc/meminfo: psutil where installed, else os.sysconf; each a positive amount within the physical
    memory, the source named."""
    free, source = policy.free_memory("cpu", meminfo="/nonexistent/meminfo")
    assert 0 < free <= PHYSICAL and source in ("psutil", "os.sysconf free pages")
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    free, source = policy.free_memory("cpu", meminfo="/nonexistent/meminfo")
    assert 0 < free <= PHYSICAL and source.startswith(("os.sysconf", "half the physical"))


def test_free_memory_reads_memavailable_per_local_rank(monkeypatch, tmp_path):
    """A meminfo file written here: MemAvailable (not MemFree) in KiB, split over the local ranks, who share
    the RAM, by integer division: 1000003 KiB = 1024003072 B, / 4 = 256000768 B."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        2000000 kB\nMemFree:          500000 kB\n"
                       "MemAvailable:    1000003 kB\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert policy.free_memory("cpu", meminfo=str(meminfo)) == (1024003072, str(meminfo))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert policy.free_memory("cpu", meminfo=str(meminfo)) == (256000768, str(meminfo))
    # a meminfo without MemAvailable (an old kernel) falls through to the portable sources
    meminfo.write_text("MemTotal:        2000000 kB\n")
    assert policy.free_memory("cpu", meminfo=str(meminfo))[1] != str(meminfo)


def test_a_row_longer_than_the_budget_is_its_own_micro_batch():
    """A 2048-token budget with 1024 + 4096-token rows: the largest micro-batch is one row of 5120 tokens."""
    cfg = config.Config(micro_batch_tokens=2048, max_prompt_len=1024, max_new_tokens=4096)
    assert config.micro_batch_tokens(cfg) == 5120
    cfg = config.Config(micro_batch_tokens=8192, max_prompt_len=1024, max_new_tokens=4096)
    assert config.micro_batch_tokens(cfg) == 8192
    cfg = config.Config(micro_batch_size=4, max_prompt_len=64, max_new_tokens=16)
    assert config.micro_batch_tokens(cfg) == 4 * 80


def _decide(rank, world, port, free_by_rank, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # what this rank's device would report (a spawned process: the patch dies with it)
        config.free_memory = lambda device: (free_by_rank[rank], "test")
        cfg = config.Config(model=TINY, grad_checkpointing=None)
        decided, free, _ = config.decide_grad_checkpointing(cfg, torch.device("cpu"))
        out.put((rank, decided.grad_checkpointing, free))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("free_by_rank, expected", [((1 << 40, 1 << 20), True), ((1 << 40, 1 << 41), False)])
def test_checkpointing_is_decided_from_the_least_free_memory_of_any_rank(free_by_rank, expected):
    """Rank 0 has 1 TiB free, rank 1 only 1 MiB (less than the tiny model's update needs): both ranks turn
    checkpointing on and report rank 1's memory. With both ample, both leave it off."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_decide, args=(r, 2, port, free_by_rank, out)) for r in range(2)]
    for p in procs:
        p.start()
    # a hang guard: a spawned interpreter importing torch and transformers on a busy 2-core machine
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    assert [r[1] for r in results] == [expected, expected]
    assert [r[2] for r in results] == [min(free_by_rank)] * 2


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

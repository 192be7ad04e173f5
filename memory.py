"""The memory a rank has, and what an update needs: the defaults that depend on them.

Activation checkpointing (--grad-checkpointing unset) is decided from these: recomputation costs a
third more FLOPs, so config.decide_grad_checkpointing turns it on only where the update would not
fit in half of the memory free on the device (the least over all ranks). On a CPU the free memory
is the host's (MemAvailable, or a portable source) bounded by the room under this process's
cgroup memory limits: in a container MemAvailable reports the host's RAM, and a step sized from it
is killed by the container's limit (measured: docs/benchmarks.md).

    free, source = free_memory(device)     # bytes for this rank, and where they were read
    update_memory(model_config, tokens, 2) > free / 2   # -> checkpointing on

Tests: tests/test_config.py (MemAvailable per local rank, the portable sources, written cgroup v1 and
v2 trees, a real cgroup of the machine where one can be made, the decision agreed over ranks).
"""
import os

import torch


# --- the estimate --------------------------------------------------------------------------------
def update_memory(model_config, tokens, dtype_bytes):
    """Bytes an update needs on one device without activation checkpointing, roughly: what each
    decoder layer keeps for its backward, ~ (8 h + 4 i) values per token (the two norms, q k v,
    attention output, residuals; gate, up, act(gate)·up), times layers and the micro-batch's tokens,
    plus 16 bytes per parameter (fp32 weights, gradients and the two AdamW moments; sharding would
    divide these, which the estimate ignores)."""
    h, i, n = (model_config.hidden_size, model_config.intermediate_size,
               model_config.num_hidden_layers)
    params = (model_config.vocab_size * h * (1 if model_config.tie_word_embeddings else 2)
              + n * (4 * h * h + 3 * h * i))
    return tokens * n * (8 * h + 4 * i) * dtype_bytes + 16 * params


def grad_checkpointing_default(model_config, tokens, dtype_bytes, free_bytes):
    """Recompute activations in the backward (--grad-checkpointing unset) only where the update
    would not fit in half the memory free on the device (`update_memory`): recomputation costs a
    third more FLOPs, so it is worth it only for memory. The tiny model never needs it; SmolLM2 on a
    24 GB CPU at the default shape does not."""
    return update_memory(model_config, tokens, dtype_bytes) > free_bytes / 2


# --- the memory free ----------------------------------------------------------------------------
def free_memory(device, meminfo="/proc/meminfo", cgroup_root="/sys/fs/cgroup",
                proc_cgroup="/proc/self/cgroup"):
    """(bytes free for one rank, where they were read): this rank's GPU (`device` itself, never a
    default GPU), or on CPU the available RAM / local ranks, from the first source that answers:
    Linux's MemAvailable, psutil (macOS, Windows; if installed), the free pages of os.sysconf, and
    as a last resort half the physical memory (said so in the source). On Linux the room left under
    this process's cgroup memory limits bounds it (`cgroup_memory_room`): in a container limited to
    8 GB, MemAvailable still reports the host's RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"torch.cuda.mem_get_info({device})"
    free, source = None, None
    try:
        with open(meminfo) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        free, source = kib * 1024, meminfo
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            import psutil  # optional: not a dependency
            free, source = psutil.virtual_memory().available, "psutil"
        except ImportError:
            names = os.sysconf_names
            if "SC_AVPHYS_PAGES" in names:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                source = "os.sysconf free pages"
            else:
                free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
                source = "half the physical memory (no free-memory source)"
    room = cgroup_memory_room(cgroup_root, proc_cgroup)
    if room is not None and room[0] < free:
        free, source = room
    return free // int(os.environ.get("LOCAL_WORLD_SIZE", 1)), source


def cgroup_memory_room(root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup"):
    """(bytes, the limit file) left under the tightest memory limit of this process's cgroup and its
    ancestors, or None where none is set or readable (not Linux, no memory controller, no limit).
    Room = limit − usage + inactive file cache (reclaimable: Docker's and the kubelet's "working
    set" subtract it too). cgroup v2: memory.max, memory.current, `inactive_file` of memory.stat;
    v1: memory.limit_in_bytes, memory.usage_in_bytes, `total_inactive_file`. The process's path is
    read from /proc/self/cgroup; a container that mounts its own cgroup at the root (no cgroup
    namespace, v1) still names the host's path, so the mount's root is read too."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    v1 = [path for _, ctrls, path in lines if "memory" in ctrls.split(",")]
    v2 = [path for hid, ctrls, path in lines if hid == "0" and ctrls == ""]
    if v1:
        base, path = os.path.join(root, "memory"), v1[0]
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    elif v2:
        # a unified-only mount holds cgroup.controllers; a hybrid one mounts v2 at unified/
        base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(
            root, "unified")
        path = v2[0]
        files = ("memory.max", "memory.current", "inactive_file")
    else:
        return None
    parts = [p for p in path.split("/") if p]
    best = None
    for depth in range(len(parts) + 1):  # the mount's root, then each ancestor down to our own
        d = os.path.join(base, *parts[:depth])
        try:
            with open(os.path.join(d, files[0])) as f:
                limit = f.read().strip()
            with open(os.path.join(d, files[1])) as f:
                usage = int(f.read())
            with open(os.path.join(d, "memory.stat")) as f:
                stat = dict(line.split() for line in f if line.strip())
        except (OSError, ValueError):
            continue
        # v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712), v2 as "max"
        if limit == "max" or int(limit) >= 2**62:
            continue
        room = max(0, int(limit) - usage + int(stat.get(files[2], 0)))
        if best is None or room < best[0]:
            best = (room, os.path.join(d, files[0]))
    return best

"""The memory a rank has, and what an update needs: the defaults that depend on them.

Activation recomputation (--recompute auto) is decided from these: config.decide_grad_checkpointing
takes the cheapest mode (none, selective, full) whose update fits in half of the memory free on
the device (the least over all ranks), says why, and refuses where none fits. On a CPU the free memory
is the host's (MemAvailable, or a portable source) bounded by the room under this process's
cgroup memory limits: in a container MemAvailable reports the host's RAM, and a step sized from it
is killed by the container's limit (measured: docs/benchmarks.md).

    free, source = free_memory(device)     # bytes for this rank, and where they were read
    update_memory(model_config, tokens, 2) > free / 2   # -> checkpointing on

Tests: tests/test_memory.py (what a layer keeps in each mode against a count on a real layer, the padded
logits by hand, the choice and the refusal); tests/test_config.py (MemAvailable per local rank, the portable
sources, written cgroup v1 and v2 trees, a real cgroup of the machine where one can be made, the decision agreed
over ranks).
"""
import os

import torch


# --- the estimate --------------------------------------------------------------------------------
def update_memory(model_config, tokens, dtype_bytes, recompute="none", fused_head=False, logits=None,
                  compiled=False, attention_bytes=None):
    """Bytes an update needs on one device, roughly, under `recompute` (machinery/model.set_recompute): the
    tensors a Llama/Qwen2 decoder layer keeps for its backward, per token (`layer_bytes`, eager or compiled), times
    layers and the micro-batch's tokens, plus 16 bytes per parameter (fp32 weights, gradients and the two AdamW
    moments; sharding would divide these, which the estimate ignores) and 4 + b more (policy._reduce_on_last: the
    float32 gradient accumulated whole over a mini-batch's micro-batches, on N ranks beside the shards, and the
    compute-dtype weights held gathered from the first forward to the last backward), plus, for the fused head of packed
    micro-batches (machinery/fused_head.py), its float32 weight gradient (V x h) before it is cast to the weights'
    dtype, or for padded micro-batches their logits and gradient (`logits`: (rows, positions), `padded_logits_bytes`).
    attention_bytes: bytes per element of the attention's compute dtype (`layer_bytes`' a; None: dtype_bytes).
    On one H200 the measured peaks ran ~1.45x the saved tensors under both none and selective (docs/gpu.md): the
    caller's half-the-free-memory rule leaves that room."""
    if compiled and recompute == "selective":
        raise ValueError("compiled layers do not combine with selective recomputation (machinery/model.py)")
    n = model_config.num_hidden_layers
    params = (model_config.vocab_size * model_config.hidden_size
              * (1 if model_config.tie_word_embeddings else 2)
              + n * (4 * model_config.hidden_size ** 2
                     + 3 * model_config.hidden_size * model_config.intermediate_size))
    a = attention_bytes
    layer = layer_bytes(model_config, dtype_bytes, "compiled" if compiled else "none", a)
    # full: each layer's input, and one layer's whole set while its backward reruns it
    kept = {"none": n * layer, "full": n * layer_bytes(model_config, dtype_bytes, "full") + layer,
            "selective": n * layer_bytes(model_config, dtype_bytes, "selective", a)}[recompute]
    head = 4 * model_config.vocab_size * model_config.hidden_size if fused_head else 0
    if logits is not None:
        head += padded_logits_bytes(model_config.vocab_size, *logits, dtype_bytes)
    return tokens * kept + (16 + 4 + dtype_bytes) * params + head


def layer_bytes(model_config, b, recompute="none", a=None):
    """Bytes one decoder layer keeps for its backward per token, in compute dtype of b bytes, as transformers'
    Llama/Qwen2 layers do with the CPU's packed kernel (tests/test_memory.py counts them on real layers), the attention
    computing in a bytes (None: b; 4 where packed_attention.float32_attention casts bf16 q, k, v up):
    none — each RMSNorm a float32 copy of its input and its output (4 h + b h bytes), q, k and their rotate_half
    copies (2 h + 2 h_kv), gate, up, act(gate) and their product (4 i), what the attention saves in a bytes: the
    rotated q and k, v and its output (2 h + 2 h_kv), plus float32 scalars per token (the attention's
    log-sum-exp per head, each norm's 1/rms); selective — what a matmul or the attention made and the layer's input:
    q k v, o, gate, up, down, input (4 h + 2 h_kv + 2 i), the attention's output (h, in a bytes) and the log-sum-exp;
    full — the layer's input (h); compiled (--compile-layers, no recomputation: what Inductor's partitioner saves,
    counted on a compiled layer) — the input and both norms' outputs, the attention's output joined, the residual,
    gate, up and their product (5 h + 3 i), the rotated q k and v and the attention's output per row (2 h + 2 h_kv,
    in a bytes: the eager kernel saves them), the log-sum-exp and the two 1/rms."""
    a = b if a is None else a
    h, i = model_config.hidden_size, model_config.intermediate_size
    heads = model_config.num_attention_heads
    h_kv = (getattr(model_config, "num_key_value_heads", None) or heads) * (
        getattr(model_config, "head_dim", None) or h // heads)
    if recompute == "selective":
        return b * (4 * h + 2 * h_kv + 2 * i) + a * h + 4 * heads
    if recompute == "full":
        return b * h
    if recompute == "compiled":
        return b * (5 * h + 3 * i) + a * (2 * h + 2 * h_kv) + 4 * heads + 2 * 4
    if recompute != "none":
        raise ValueError(f"layer_bytes: unknown mode {recompute!r}")
    return 2 * (4 * h + b * h) + b * (2 * h + 2 * h_kv + 4 * i) + a * (2 * h + 2 * h_kv) + 4 * heads + 2 * 4


def largest_micro_batch(model_config, dtype_bytes, free_bytes, recompute="none", fused_head=True, compiled=True,
                        multiple=1024, attention_bytes=None):
    """--micro-batch-tokens unset (config.decide_grad_checkpointing): the most tokens a packed micro-batch may hold
    with its update (`update_memory`: a fixed part, the parameters' and the head's, plus the layers' bytes per token)
    within half of `free_bytes`, the caller's rule, rounded down to whole `multiple`s; 0 where not one fits."""
    fixed = update_memory(model_config, 0, dtype_bytes, recompute, fused_head, None, compiled, attention_bytes)
    per_token = update_memory(model_config, 1, dtype_bytes, recompute, fused_head, None, compiled,
                              attention_bytes) - fixed
    return max(0, int((free_bytes / 2 - fixed) // per_token) // multiple * multiple)


def padded_logits_bytes(vocab, rows, positions, b, chunk=64):
    """Bytes the padded path's head needs at its peak: the logits (b bytes each) of a micro-batch's `positions`
    response positions (rows x (t + 1): logits_to_keep), then their gradient of the same size while the logits are
    still held (logprobs._TokenLogprob's backward), and one float32 chunk of `chunk` positions per row
    (`min(positions, rows x chunk)`) that the log-softmax works in."""
    return 2 * positions * vocab * b + 4 * min(positions, rows * chunk) * vocab


def grad_checkpointing_default(model_config, tokens, dtype_bytes, free_bytes, attention_bytes=None):
    """Recompute activations in the backward (--grad-checkpointing unset) only where the update
    would not fit in half the memory free on the device (`update_memory`): recomputation costs a
    third more FLOPs, so it is worth it only for memory. The tiny model never needs it; SmolLM2 on a
    24 GB CPU at the default shape does not."""
    return update_memory(model_config, tokens, dtype_bytes, attention_bytes=attention_bytes) > free_bytes / 2


def choose_recompute(model_config, tokens, dtype_bytes, free_bytes, modes=("none", "selective", "full"),
                     fused_head=False, logits=None, compiled=False, attention_bytes=None):
    """--recompute auto: the cheapest of `modes` (in the order of their FLOPs: none, then selective, which reruns
    only element-wise ops, then full, a third more matmul FLOPs) whose update (`update_memory`) fits in half the
    memory free on the device. -> (mode, the reason in words, for the start-up line). Raises ValueError, one line with
    every mode's estimate, where none fits: a forced mode (--recompute full) is the user's call, not auto's."""
    gib = {m: update_memory(model_config, tokens, dtype_bytes, m, fused_head, logits, compiled,
                            attention_bytes) / 2**30 for m in modes}
    half = free_bytes / 2 / 2**30
    logit_note = (f" (the padded logits and their gradient "
                  f"{padded_logits_bytes(model_config.vocab_size, *logits, dtype_bytes) / 2**30:.1f} GiB of each)"
                  if logits is not None else "")
    for k, mode in enumerate(modes):
        if gib[mode] <= half:
            over = ", ".join(f"{m} ~{gib[m]:.1f} GiB" for m in modes[:k])
            return mode, (f"auto: the update ~{gib[mode]:.1f} GiB{' compiled' if compiled else ''} fits in half the "
                          f"{2 * half:.1f} GiB free" + (f"; {over} would not" if over else "") + logit_note)
    raise ValueError(f"--recompute auto: no recomputation fits the update in half the {2 * half:.1f} GiB free: "
                     + ", ".join(f"{m} ~{gib[m]:.1f} GiB" for m in modes) + logit_note
                     + "; shorten the micro-batches (--micro-batch-size, --micro-batch-tokens), or force a mode "
                       "(--recompute full) to run anyway")


def recompute_default(model_config, tokens, dtype_bytes, free_bytes, modes=("none", "selective", "full"),
                      fused_head=False, logits=None, compiled=False, attention_bytes=None):
    """`choose_recompute`'s mode alone."""
    return choose_recompute(model_config, tokens, dtype_bytes, free_bytes, modes, fused_head, logits, compiled,
                            attention_bytes)[0]


# --- the memory free ----------------------------------------------------------------------------
def free_memory(device, meminfo="/proc/meminfo", proc_cgroup="/proc/self/cgroup",
                mountinfo="/proc/self/mountinfo"):
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
    room = cgroup_memory_room(proc_cgroup, mountinfo)
    if room is not None and room[0] < free:
        free, source = room
    return free // int(os.environ.get("LOCAL_WORLD_SIZE", 1)), source


def cgroup_memory_room(proc_cgroup="/proc/self/cgroup", mountinfo="/proc/self/mountinfo"):
    """(bytes, where the limit was read) left under this process's cgroup memory limits, or None
    where none is set or readable (not Linux, no memory controller, no limit). Room = limit − usage
    + inactive file cache (reclaimable: Docker's and the kubelet's "working set" subtract it too),
    the tightest over the cgroup and its ancestors down from the mounted one, each with its own
    usage (v1: memory.limit_in_bytes, memory.usage_in_bytes, `total_inactive_file` of memory.stat;
    v2: memory.max, memory.current, `inactive_file`). v1 also bounds each by memory.stat's
    `hierarchical_memory_limit`, the kernel's limit over all its ancestors, also those a container
    cannot see; paired with the cgroup's own usage, it misses what siblings under that ancestor use.
    The cgroup's directory is its path in /proc/self/cgroup, made relative to the hierarchy's root
    mounted at the mount point /proc/self/mountinfo names: a container without a cgroup namespace
    mounts its own cgroup, whose host path /proc/self/cgroup still shows (OpenJDK resolves it the
    same way)."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    v1 = [path for _, ctrls, path in lines if "memory" in ctrls.split(",")]
    v2 = [path for hid, ctrls, path in lines if hid == "0" and ctrls == ""]
    if v1 and (mount := _cgroup_mount(mounts, "cgroup")):
        path, is_v1 = v1[0], True
    elif v2 and (mount := _cgroup_mount(mounts, "cgroup2")):
        path, is_v1 = v2[0], False
    else:
        return None
    root, point = mount
    inside = path == root or path.startswith(root.rstrip("/") + "/")
    # outside the mounted root, or above it (a path with ".."): the mount's own cgroup, an ancestor
    parts = ([] if not inside or ".." in path.split("/")
             else [p for p in path[len(root):].split("/") if p])
    dirs = [os.path.join(point, *parts[:depth]) for depth in range(len(parts) + 1)]
    best = None
    for d in dirs:  # the mount's cgroup, then each one down to ours; a missing one is skipped
        try:
            room = _room(d, is_v1)
        except (OSError, ValueError):
            continue
        if room is not None and (best is None or room[0] < best[0]):
            best = room
    return best


def _cgroup_mount(mounts, fstype):
    """(root within the hierarchy, mount point) of the first `fstype` mount (v1: the one with the
    memory controller) in /proc/self/mountinfo's split lines: '... root point opts - type src super'."""
    for m in mounts:
        if "-" in m[5:]:
            i = m.index("-", 5)
            if len(m) > i + 3 and m[i + 1] == fstype and (
                    fstype == "cgroup2" or "memory" in m[i + 3].split(",")):
                return m[3], m[4]
    return None


def _room(d, v1):
    """(limit − usage + inactive file, where the limit was read) of cgroup directory d, or None
    where it has no limit: v1 writes none as ~2^63 (page-aligned), v2 as "max"."""
    def read(name):
        with open(os.path.join(d, name)) as f:
            return f.read().strip()
    with open(os.path.join(d, "memory.stat")) as f:
        stat = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    limits = [(read("memory.limit_in_bytes" if v1 else "memory.max"),
               os.path.join(d, "memory.limit_in_bytes" if v1 else "memory.max"))]
    if v1 and "hierarchical_memory_limit" in stat:
        limits.append((stat["hierarchical_memory_limit"],
                       os.path.join(d, "memory.stat") + " hierarchical_memory_limit"))
    limits = [(int(v), where) for v, where in limits if v != "max" and int(v) < 2**62]
    if not limits:
        return None
    limit, where = min(limits)
    usage = int(read("memory.usage_in_bytes" if v1 else "memory.current"))
    inactive = int(stat.get("total_inactive_file" if v1 else "inactive_file", 0))
    return max(0, limit - usage + inactive), where

"""GPU check, timing an update (the pack section's): its phases on the device's clock, and a profiler summary.

The phases of train.update_policy, marked by hooks on the model and the optimizer, so that the trainer's code runs
as train.py runs it:
  forward    the decoder body's forward (`model.base_model`), summed over the micro-batches
  head       from the body's output to its gradient: the LM head and the log-prob (fused when packed), the loss and
             the head's backward
  backward   from the gradient of the body's output to the end of the backward (FSDP2's reduction included)
  optimizer  the optimizer's step, from its pre-hook to its post-hook
  other      the update's time less these: the plan, zero_grad, clipping, the skip check's host sync
On CUDA a mark is a CUDA event on the current stream, read after the update's synchronisation; on a CPU, which runs
each op as it is issued, the host's clock. The profiler summary (one more update under torch.profiler): on CUDA
kernel time by category, the GPU's busy time (the union of kernel intervals) and idle fraction, host-device
synchronisations and host-to-device copies; on a CPU the operators' own time by category.
"""
import re
import statistics
import time

import torch

# kernel (CUDA) or operator (CPU) names by category, the first match wins; lower-case
CATEGORIES = [
    ("attention", r"flash|fmha|attention|attn|flex"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|wgmma|cublas|aten::(mm|addmm|bmm|matmul|linear)$"),
    ("compiled (triton)", r"^triton_|cpp_fused|compiledfunction"),
    ("communication", r"nccl|all_reduce|allreduce|reduce_scatter|all_gather|gloo|c10d"),
    ("optimizer", r"multi_tensor_apply|foreach|fused_adam|adam"),
    ("copy/cast", r"copy|cast|memcpy|memset|to_copy|cat|fill|clone|contiguous"),
    ("index/gather", r"index|scatter|gather|embedding|take"),
    ("reduce/softmax", r"reduce|softmax|logsumexp|norm|sum|amax|max|mean"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|mul|add|sub|div|exp|log|silu|sigmoid|neg|pow|rsqrt"),
]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def category(name):
    low = name.lower()
    return next((c for c, rx in CATEGORIES if re.search(rx, low)), "other")


class Phases:
    """Marks of one update's phases (the module docstring), through hooks on `model` and `optimizer`; `on` only
    between start() and split()."""

    def __init__(self, model, optimizer, device):
        self.cuda, self.marks, self.on = device.type == "cuda", [], False
        body = model.base_model
        body.register_forward_pre_hook(lambda *_: self.mark("forward"))
        body.register_forward_hook(self._body_done)
        optimizer.register_step_pre_hook(lambda *_: self.mark("optimizer"))
        optimizer.register_step_post_hook(lambda *_: self.mark("optimizer_end"))

    def mark(self, name):
        if not self.on:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def _body_done(self, module, args, output):
        self.mark("head")
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        if self.on and hidden.requires_grad:
            hidden.register_hook(self._grad_reached)

    def _grad_reached(self, grad):
        self.mark("backward")
        # runs when the whole backward is done, after FSDP2's own final callback (queued before this one)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.mark("backward_end"))

    def start(self):
        self.marks, self.on = [], True
        self.mark("begin")

    def split(self):
        """Seconds per phase of the update since start() (call after the device's queue is drained)."""
        self.mark("end")
        self.on = False
        t0 = self.marks[0][1]
        at = [(n, t0.elapsed_time(e) / 1e3 if self.cuda else e - t0) for n, e in self.marks]
        res = dict.fromkeys(("forward", "head", "backward", "optimizer"), 0.0)
        nxt = {"forward": "head", "head": "backward", "backward": "backward_end", "optimizer": "optimizer_end"}
        for i, (name, t) in enumerate(at):  # a phase ends at its end's next mark, unless it starts again first
            if name in nxt:
                n, u = next(((n, u) for n, u in at[i + 1:] if n in (nxt[name], name)), (None, None))
                if n == nxt[name]:
                    res[name] += u - t
        wall = at[-1][1]
        res = {k: round(v, 5) for k, v in res.items()}
        res["other"] = round(wall - sum(res.values()), 5)
        res["wall"] = round(wall, 5)
        return res


def summarize(times, splits):
    """{median, spread (max - min), all} of the timed updates' seconds, and the phases of the median update (the
    lower median: a measured update, whose phases add up to its time)."""
    median = statistics.median_low(times)
    return {"median": round(median, 4), "spread": round(max(times) - min(times), 4),
            "all": [round(t, 4) for t in times], "phases": splits[times.index(median)]}


def profiled(update, device, wall_unprofiled):
    """Run update() once under torch.profiler; the summary of the module docstring. wall_unprofiled: the
    setting's median update seconds, against which the GPU's busy time gives the idle fraction (the profiler's
    own overhead stretches the profiled update's wall time, not its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        update()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    res = {"profiled_update_s": round(wall, 4)}
    if not cuda:  # the operators' own (self) time: nested operators are not counted twice
        by = {}
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                by[category(e.key)] = by.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e6
        return {**res, "time_by_category_s": {k: round(v, 5) for k, v in sorted(by.items(), key=lambda x: -x[1])},
                "measured": "CPU operators' self time", "gpu_busy_s": None, "gpu_idle_fraction": None,
                "syncs": None, "host_to_device_copies": None}
    events = prof.profiler.kineto_results.events()
    kernels = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
    by, spans = {}, sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in kernels)
    for e in kernels:
        by[category(e.name())] = by.get(category(e.name()), 0.0) + e.duration_ns() / 1e9
    busy, cur = 0, None  # the union of the kernels' intervals
    for s, e in spans:
        if cur is None or s > cur[1]:
            busy += cur[1] - cur[0] if cur else 0
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    busy = (busy + (cur[1] - cur[0] if cur else 0)) / 1e9
    names = [e.name() for e in events if e.device_type() != torch.autograd.DeviceType.CUDA]
    return {**res, "time_by_category_s": {k: round(v, 5) for k, v in sorted(by.items(), key=lambda x: -x[1])},
            "measured": "CUDA kernels' time", "kernels": len(kernels), "gpu_busy_s": round(busy, 4),
            "gpu_idle_fraction": round(max(0.0, 1 - busy / wall_unprofiled), 4),
            "syncs": sum(n in SYNCS for n in names),
            "host_to_device_copies": sum("HtoD" in e.name() for e in kernels)}

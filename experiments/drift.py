"""The clip's mechanism one update at a time: paired branches of a training trajectory.

The paper (docs/paper.md §3; arXiv 2603.04918 §3) argues causally: the fixed clip caps the rise of rare
positive-advantage tokens, which drains the entropy; Band's wider bounds for rare tokens keep it. Here that
is measured per rollout. A base trajectory trains as train.py does (same rollouts, rewards, advantages,
policy.update_policy); at every k-th rollout (a branch point) each arm restarts from the same weights, AdamW
state and RNGs and takes that rollout's optimizer steps, and a fresh probe of held-out prompts reads its
entropy change (drift_branch.py: the arms, snapshot and restore, the readings; KEYS below lists a line's
keys). Then the base advances by its own method's arm, exactly as train.py. `--antithetic` also runs each arm
on the rollout's flipped coins (rewards 1 - r: exactly -Â), the pair averaged per arm by the report.
Config flags this script cannot honour (--kl-coef > 0, --old-logp engine, ... `REFUSED`) are refused.

    python experiments/drift.py --seeds 0,1 --branches 60 --out runs/drift-toy \\
        -- --lr 1e-4 --mini-batch-prompts 2 --train-dtype float32     # flags after -- go to Config
    python experiments/drift.py --resume ...   # continue: the same command (a seed resumes only as it began)
    python experiments/drift.py --minutes 10 --skip-merged PAIRS_GZ ...   # whole seeds in 10 min, new ones only
    python experiments/drift.py --analyse runs/drift-toy   # drift_report.py: drift.md and the figure
    python experiments/drift.py --out runs/drift-toy --branches 60 \\
        --merge-into experiments/results/drift-toy/pairs.jsonl.gz   # finished seeds into the committed file

Departures from train.py: the HF engine, generating with the trainer's own module where the dtypes agree on one
rank (shares_engine), no evaluation, one checkpoint per branch point (for --resume). On SmolLM2 the probe's logits
are widened to float64 a chunk at a time and a large snapshot is kept in a file, not on the heap.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import time

START = time.time()  # before the heavy imports: --minutes counts them

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(ROOT, "scripts")]
import data  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from compress_results import gzip_bytes  # noqa: E402
from config import parse_config, resolve_config  # noqa: E402
from logprobs import pack  # noqa: E402
from machinery.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint  # noqa: E402
from machinery.jsonl import jsonl_path, read_appended, read_jsonl  # noqa: E402
# the branching and the arms; every name tests/ and scripts/gpu_drift.py import from drift is re-exported
from drift_branch import (ARMS, MATCHED_LR, P_EDGES, PROBE_CHUNK_BYTES, SIGNS, SNAPSHOT_RAM_BYTES,  # noqa: E402,F401
                          anatomy, arm_config, arm_update, base_update, branch, probe_logits, probe_readings,
                          recording, restore, rollout_batch, snapshot, _local)

PROBE_SEED_OFFSET = 1 << 41  # probe sampling seeds never meet a rollout's or an evaluation's (1 << 40)
TRAIN_DEFAULTS = ["--method", "clip", "--reward", "random", "--rollout", "hf", "--eval-every", "0",
                  "--no-export-hf", "--save-every", "0"]  # before the user's flags, which win
# Config fields this script does not honour: set to anything but the value it runs with (TRAIN_DEFAULTS
# over Config's defaults), the flag is refused before a model or an engine starts. Every other field is
# read as train.py reads it (tests/test_drift.py checks that the two lists cover Config).
REFUSED = {
    "kl_coef": "no reference model is built: every arm is the policy loss alone",
    "old_logp": "π_old is the trainer's no-grad pass over all rows (the restore check reads its ratio 1)",
    "eps_low": "each arm takes its method's published eps (clip-upper / clip-lower set one side)",
    "eps_high": "each arm takes its method's published eps (clip-upper / clip-lower set one side)",
    "max_steps": "the trajectory is --branches x --every rollouts",
    "seed": "the trajectories are --seeds",
    "out_dir": "the run directory is --out",
    "resume": "drift.py's own --resume continues a run",
    "eval_every": "no evaluation runs", "eval_n": "no evaluation runs", "eval_prompts": "no evaluation runs",
    "save_every": "a checkpoint is written at every branch point",
    "keep_checkpoints": "one checkpoint per seed is kept", "export_hf": "no model is exported",
    "wandb": "no wandb logging", "verbose": "the engine's logs are not configured here",
    "gpu_memory_utilization": "the engine is built without it",
}
# kl_kind acts only with --kl-coef > 0: inert, as in train.py
HONOURED = ("method", "delta", "max_ratio", "clip_c", "agg", "norm_by_std", "kl_kind", "rollout_is",
            "rollout_is_max", "rollout_is_min", "model", "data", "eval_data", "reward", "reward_correct",
            "reward_incorrect", "prompts_per_step", "group_size", "mini_batch_prompts", "micro_batch_size",
            "micro_batch_tokens", "pack", "max_prompt_len", "max_new_tokens", "temperature", "top_p", "lr",
            "weight_decay", "grad_clip", "grad_checkpointing", "share_prompt", "train_dtype", "rollout",
            "rollout_dtype", "recompute", "compile_layers", "compile_head")


def refused_flag(rest):
    """The first flag among `rest` (train.py's) that this script would silently ignore, as
    '--name value', else None."""
    ours, base = parse_config(TRAIN_DEFAULTS + rest), parse_config(TRAIN_DEFAULTS)
    for name in REFUSED:
        if getattr(ours, name) != getattr(base, name):
            return f"--{name.replace('_', '-')} {getattr(ours, name)}"
    return None


# --- a seed's trajectory ---------------------------------------------------------------------------
def load_prompts(cfg, tokenizer, n_probe):
    """train.py's training prompts, and `n_probe` held-out probe prompts (the eval split)."""
    train_recs = [r for name in data.split_names(cfg.data) for r in data.load(
        name, split="train", seed=cfg.seed, n=100_000 if name.startswith("arithmetic") else None)]
    ids, kept, _ = data.tokenize_prompts(train_recs, tokenizer, cfg.max_prompt_len)
    names = data.split_names(cfg.eval_data) or data.split_names(cfg.data)
    probe = [r for name in names for r in data.load(
        name, split="test", seed=PROBE_SEED_OFFSET + cfg.seed,
        n=n_probe if name.startswith("arithmetic") else None)]
    pids, _, _ = data.tokenize_prompts(probe, tokenizer, cfg.max_prompt_len)
    return [dict(r, prompt_ids=i) for r, i in zip(kept, ids)], pids


def shares_engine(cfg):
    """Whether the rollouts and probes are generated with the trainer's own module instead of a copy:
    the HF engine, in the trainer's dtype, on one rank (SmolLM2's float32 copy would be 0.54 GB
    more). The same weights and the same forward: the samples a copy synced after every update
    would draw."""
    return (cfg.rollout == "hf" and cfg.rollout_dtype == cfg.train_dtype
            and train.WORLD == 1)


RESUME_FREE = ("out_dir", "resume", "keep_checkpoints", "wandb")  # Config fields a trajectory's maths ignores
DECIDED = ("recompute", "grad_checkpointing", "compile_layers", "compile_head", "share_prompt", "pack",
           "micro_batch_tokens")  # Config fields train.decide_grad_checkpointing sets at start-up
SHAPING = ("arms", "every", "probe_prompts", "probe_samples", "matched_lr", "check_all", "antithetic")  # its own


def check_resume(run_dir, ckpt, cfg, args, device, unchecked=(), write=True):
    """A seed continues only with the settings it began with, on the machine it began on: its checkpoint's Config
    (all but RESUME_FREE) and drift.py's flags that shape its lines (SHAPING) and the machine, kept in
    <run_dir>/drift.json (written whenever the seed starts afresh; --branches may grow). A key newer than the
    record is not compared; a seed begun by a drift.py without the record has none checked. Raises SystemExit
    naming the first difference, before a model is built. `unchecked`: Config fields not compared (main's check
    before start-up has not decided them yet); `write`: False writes no record."""
    path = os.path.join(run_dir, "drift.json")
    now = {**{k: getattr(args, k) for k in SHAPING}, "machine": machine(device)}
    if ckpt:
        with open(os.path.join(ckpt, "meta.json")) as f:
            saved = json.load(f)["config"]
        mine = json.loads(json.dumps(dataclasses.asdict(cfg)))
        began = {}
        if os.path.isfile(path):
            with open(path) as f:
                began = json.load(f)
        # a field newer than the record is not compared: the seed began before it existed
        for key, old, new in ([(k, saved[k], v) for k, v in mine.items()
                               if k in saved and k not in RESUME_FREE + tuple(unchecked)] +
                              [(k if k == "machine" else f"--{k.replace('_', '-')}", began[k], v)
                               for k, v in now.items() if k in began]):
            if old != new:
                raise SystemExit(f"drift.py: {run_dir} began with {key} = {old!r}, not {new!r}: resume a seed "
                                 f"with the settings it began with, on its machine, or give it another --out")
    elif write:
        os.makedirs(run_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(now, f)
        os.replace(path + ".tmp", path)


def machine(device):
    """What ran a line: the CUDA device's name, else the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def run_seed(args, cfg, engine, tokenizer, device, bar):
    """One base trajectory with its branch points, appended to <out>/seeds/s<seed>.jsonl; resumable
    from the checkpoint written after each branch point."""
    run_dir = os.path.join(args.out, f"s{cfg.seed}")
    pairs_file = os.path.join(args.out, "seeds", f"s{cfg.seed}.jsonl")
    total = args.branches * args.every
    ckpt = latest_checkpoint(run_dir) if os.path.isdir(run_dir) else None  # main refused it without --resume
    check_resume(run_dir, ckpt, cfg, args, device)
    n_probe = args.probe_prompts
    records, probe_ids = load_prompts(cfg, tokenizer, n_probe * args.branches)
    model = policy.build_model(cfg, device)
    optimizer = policy.make_optimizer(model, cfg)
    weights = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    snap_file = (os.path.join(run_dir, "snapshot.bin")  # weights + two AdamW moments
                 if 3 * weights > SNAPSHOT_RAM_BYTES else None)
    os.makedirs(run_dir, exist_ok=True)
    if engine is None:  # shares_engine: generate with the trainer's module, which is always current
        engine = rollout.make_engine("hf", cfg.model, model=model, tokenizer=tokenizer,
                                     dtype=cfg.rollout_dtype,
                                     max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    start = load_checkpoint(ckpt, model, optimizer) if ckpt else 0
    kept = [r for r in read_appended(pairs_file) if r["step"] < start] \
        if os.path.isfile(pairs_file) else []
    os.makedirs(os.path.dirname(pairs_file), exist_ok=True)
    with open(pairs_file + ".tmp", "w") as f:  # lines past the checkpoint are redone
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(pairs_file + ".tmp", pairs_file)
    bar.update(start)
    rollout.sync_weights(engine, model)
    for step in range(start, total):
        t0, c0 = time.time(), time.process_time()
        flipped = None   # antithetic coins at a branch point: the same rollout rewarded 1 - r
        if args.antithetic and not step % args.every:
            batch, advantages, flipped = rollout_batch(engine, records, cfg, step, device, flip=True)
        else:
            batch, advantages = rollout_batch(engine, records, cfg, step, device)
        if step % args.every:
            base_update(model, optimizer, cfg, batch, advantages)
        else:
            b = step // args.every  # a fresh slice of held-out prompts per branch point
            ids = [probe_ids[(b * n_probe + i) % len(probe_ids)] for i in range(n_probe)]
            sampling = rollout.Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                        max_new_tokens=cfg.max_new_tokens,
                                        seed=PROBE_SEED_OFFSET + cfg.seed * 1_000_003 + step)
            probe = pack(ids, engine.generate(ids, args.probe_samples, sampling), device)
            rows = branch(model, optimizer, cfg, args.arms, batch, advantages, probe,
                          repeat_first=step == 0 or args.check_all, matched_lr=args.matched_lr,
                          snapshot_path=snap_file, flipped=flipped)
            with open(pairs_file, "a") as f:
                for r in rows:
                    f.write(json.dumps({"seed": cfg.seed, "step": step, **r, "machine": machine(device),
                                        "time_s": time.time() - t0,
                                        "cpu_s": time.process_time() - c0}) + "\n")
        rollout.sync_weights(engine, model)
        if step % args.every == 0 or step + 1 == total:
            save_checkpoint(run_dir, step + 1, model, optimizer, cfg)
            prune_checkpoints(run_dir, 1)
        bar.update(1)
    del model, optimizer


def merge(out):
    """<out>/pairs.jsonl: every seed's lines, sorted by (seed, step), written atomically."""
    folder = os.path.join(out, "seeds")
    rows = [r for name in sorted(os.listdir(folder)) if name.endswith(".jsonl")
            for r in read_appended(os.path.join(folder, name))]
    rows.sort(key=lambda r: (r["seed"], r["step"]))
    tmp = os.path.join(out, f"pairs.jsonl.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, os.path.join(out, "pairs.jsonl"))
    return len(rows)


def _same_reading(kept, new):
    """A committed line and a new one of the same (seed, step, arm) agree on every reading the
    committed one holds (not its times or machine; a newer drift.py may add keys)."""
    return all(k in new and new[k] == v for k, v in kept.items() if k not in ("time_s", "cpu_s", "machine"))


def merge_into(out, target, branches, every):
    """Add <out>'s whole seeds (every branch point 0, every, ..., of `branches`, each with the arms of
    its first) to `target` (pairs.jsonl.gz, written gzip -n, byte-stable), atomically. A line
    already there for the same (seed, step, arm, flip) must hold the same readings (a re-run base
    trajectory reproduces the committed one); where one differs the seed is not merged.
    -> (seeds merged, lines added, [(seed, why) not merged])."""
    have = read_jsonl(target) if jsonl_path(target) else []
    key = lambda r: (r["seed"], r["step"], r["arm"], r.get("flip"))  # noqa: E731  flip: antithetic halves
    index = {key(r): r for r in have}
    want = set(range(0, branches * every, every))
    merged, added, skipped = [], [], []
    for name in sorted(os.listdir(os.path.join(out, "seeds"))):
        rows = read_appended(os.path.join(out, "seeds", name)) if name.endswith(".jsonl") else []
        if not rows:
            continue
        seed, arms = rows[0]["seed"], [key(r)[2:] for r in rows if r["step"] == rows[0]["step"]]
        got = {key(r)[1:] for r in rows}
        if {k[0] for k in got} != want or len(got) != len(want) * len(arms):
            skipped.append((seed, f"{len(got)} of {len(want) * len(arms)} lines: not finished"))
            continue
        clash = [k for r in rows if (k := key(r)) in index and not _same_reading(index[k], r)]
        if clash:
            skipped.append((seed, f"{len(clash)} lines differ from the committed ones, first {clash[0]}"))
            continue
        new = [r for r in rows if key(r) not in index]
        merged.append(seed)
        added += new
    rows = sorted(have + added, key=lambda r: (r["seed"], r["step"]))  # stable: arms keep their order
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = target + f".{os.getpid()}.tmp"
    with open(tmp, "wb") as f:   # the project's gzip writer: mtime 0, no file name
        f.write(gzip_bytes("".join(json.dumps(r) + "\n" for r in rows).encode()))
    os.replace(tmp, target)
    return sorted(merged), len(added), skipped


KEYS = """pairs.jsonl, one line per (seed, branch point, arm): seed; step (train.py's 0-based rollout index);
arm, method, eps_low, eps_high, delta, lr; dH_probe, dH_probe_is (entropy change per probe token, plain and
importance-weighted), kl (KL(old || new) per probe token), H_probe, ess (the weights' effective sample share);
dH_train, dlogp_train, H_train (on the rollout's tokens); tokens, n_upper, n_lower (the update's clips),
first_abs_dev (0: the restore check); flip (--antithetic only: 0 the drawn coins, 1 the same rollout's
flipped coins); cells (per old-probability bin x advantage sign: p, adv, tokens,
dlogp_sum, dH_sum, up, down); machine (the CUDA device or CPU that ran it); time_s, cpu_s. A seed resumes only
with the settings it began with.

Flags after -- are train.py's (Config); defaults here: {}"""


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help, epilog=KEYS.format(
        " ".join(TRAIN_DEFAULTS)))
    ap.add_argument("--seeds", default="0", help="base trajectories, comma-separated (the units)")
    ap.add_argument("--branches", type=int, default=60, help="branch points per trajectory")
    ap.add_argument("--every", type=int, default=1, help="rollouts from one branch point to the next")
    ap.add_argument("--arms", default=",".join(ARMS), help="band.BOUNDS methods, clip-upper, "
                    "clip-lower, noclip-matched, noclip@F (comma-separated)")
    ap.add_argument("--matched-lr", type=float, default=MATCHED_LR,
                    help="noclip-matched's learning-rate factor f (the plan's)")
    ap.add_argument("--probe-prompts", type=int, default=64, help="held-out prompts per probe")
    ap.add_argument("--probe-samples", type=int, default=4, help="samples per probe prompt")
    ap.add_argument("--antithetic", action="store_true", help="also run every arm on the branch point's "
                    "flipped coins (rewards 1 - r, exactly -Â; --reward random only); the report averages each pair")
    ap.add_argument("--check-all", action="store_true",
                    help="run the first arm twice at every branch point, not only the first")
    ap.add_argument("--out", default="runs/drift", help="run directory: pairs.jsonl, seeds/, s<seed>/")
    ap.add_argument("--resume", action="store_true", help="skip finished (seed, step), continue")
    ap.add_argument("--skip-merged", metavar="PAIRS_GZ", help="leave out the --seeds this pairs file holds already "
                    "(a fresh machine adding seeds to the committed results)")
    ap.add_argument("--minutes", type=float, help="whole seeds within N minutes (a machine lent for N): start a "
                    "seed only where the longest one so far would still end in time; the first always starts")
    ap.add_argument("--merge-into", metavar="PAIRS_GZ", help="add --out's finished seeds (all --branches "
                    "branch points) to this pairs.jsonl.gz, and train nothing")
    ap.add_argument("--analyse", metavar="PAIRS", help="write the report of a pairs.jsonl (or run "
                    "directory) with drift_report.py, and train nothing")
    args = ap.parse_args(ours)
    if args.minutes is not None and not args.minutes > 0:
        ap.error(f"--minutes must be above 0, got {args.minutes:g}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.arms = [a for a in args.arms.split(",") if a]
    return args, rest


def fair_coins(reward):
    """Whether `reward` is coins of probability 1/2 (random, random:0.5): there 1 - r is distributed as r."""
    import reward as scorers
    return scorers.random_probability(reward) == 0.5


def main(argv=None):
    args, rest = parse_args(argv)
    if args.analyse:
        import drift_report
        return drift_report.main([args.analyse] + rest)
    if args.merge_into:
        seeds, n, skipped = merge_into(args.out, args.merge_into, args.branches, args.every)
        print(f"{args.merge_into}: {n} lines added; whole seeds in {args.out} (their lines already there kept): "
              f"{seeds}; not merged: {skipped or 'none'}")
        return
    if args.skip_merged:
        found = jsonl_path(args.skip_merged)
        have = {r["seed"] for r in read_jsonl(found)} if found else set()
        done = [s for s in args.seeds if s in have]
        args.seeds = [s for s in args.seeds if s not in have]
        print(f"drift.py: seeds {done or 'none'} are in {args.skip_merged} already"
              f"{'' if found else ' (no such file yet)'}; running {args.seeds or 'none'}", file=sys.stderr)
        if not args.seeds:
            return
    refused = refused_flag(rest)
    if refused:  # one line, before a model or an engine starts
        name = refused.split()[0][2:].replace("-", "_")
        print(f"drift.py: {refused} is not honoured here ({REFUSED[name]}); drop it", file=sys.stderr)
        sys.exit(2)
    cfg = resolve_config(parse_config(TRAIN_DEFAULTS + rest))
    if args.antithetic and not fair_coins(cfg.reward):
        print(f"drift.py: --antithetic needs fair coins (--reward random), not --reward {cfg.reward}: only there is "
              f"a rollout rewarded 1 - r as likely as one rewarded r", file=sys.stderr)
        sys.exit(2)
    for arm in args.arms:
        arm_config(cfg, arm, args.matched_lr)  # unknown arms fail before anything starts
    policy.check_batch_shape(cfg, 1)
    # every seed's resume, before a model, an engine or a process group starts (the fields start-up decides are
    # compared once decided, in run_seed)
    device = torch.device("cuda", train.LOCAL_RANK) if torch.cuda.is_available() else torch.device("cpu")
    for seed in args.seeds:
        run_dir = os.path.join(args.out, f"s{seed}")
        ckpt = latest_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        if ckpt and not args.resume:
            raise SystemExit(f"drift.py: {run_dir} exists; pass --resume to continue it")
        check_resume(run_dir, ckpt, dataclasses.replace(cfg, seed=seed, out_dir=args.out), args, device,
                     unchecked=DECIDED, write=False)
    os.makedirs(args.out, exist_ok=True)
    import transformers
    from transformers import AutoTokenizer
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = train.init_distributed()
    cfg, _, _ = train.decide_grad_checkpointing(cfg, device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    # the HF engine generates with each seed's trainer module where it can (run_seed): no second copy
    engine = None if shares_engine(cfg) else rollout.make_engine(
        cfg.rollout, cfg.model, tokenizer=tokenizer, seed=cfg.seed, dtype=cfg.rollout_dtype,
        max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    total = len(args.seeds) * args.branches * args.every
    with tqdm(total=total, desc="rollouts", dynamic_ncols=True,
              mininterval=1 if sys.stderr.isatty() else 60) as bar:
        longest = 0.0
        for i, seed in enumerate(args.seeds):  # --minutes counts from the process's start (START), imports too
            if args.minutes is not None and i and time.time() - START + longest > 60 * args.minutes:
                print(f"drift.py: {time.time() - START:.0f} s gone, the longest seed took {longest:.0f} s: "
                      f"stopping before seed {seed} to end within {args.minutes:g} minutes", file=sys.stderr)
                break
            t0 = time.time()
            run_seed(args, dataclasses.replace(cfg, seed=seed, out_dir=args.out), engine,
                     tokenizer, device, bar)
            longest = max(longest, time.time() - t0)
    n = merge(args.out)
    print(f"{n} lines in {os.path.join(args.out, 'pairs.jsonl')}")
    if engine is not None:
        engine.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Our train.py against TRL 1.16's GRPOTrainer on the same job: time per generation, its split, and peak memory.

Same model, same prompts in the same order (TRL gets them with shuffle_dataset=False; the child checks that TRL's
prompt token ids equal data.tokenize_prompts'), same G, response length, prompts and optimizer steps per generation
(TRL's steps_per_generation / gradient_accumulation_steps = our --prompts-per-step / --mini-batch-prompts),
micro-batch, AdamW at a constant lr, the same reward (reward.score_batch in a TRL reward function) and GRPO's
objective: clip 0.2, dual clip c = 10 (TRL's delta), seq-mean-token-mean (TRL's loss_type="grpo"), no KL and no
reference model, no evaluation, no checkpoints. TRL runs with HF generate (use_vllm=False) in --trl-dtype (auto:
bf16 where the CPU has it natively), activation checkpointing off (--grad-checkpointing turns it on in both). Ours
runs with train.py's defaults, or with --matched in TRL's configuration (HF generate, float32 in both, no shared
prompt).

Each run is one subprocess under /usr/bin/time (peak RSS of the process, %M), ours and TRL's alternating, each for
--steps generations; the first generation of every run is dropped (warm-up). Ours: the split from metrics.jsonl.
TRL: a TrainerCallback takes a timestamp every k-th on_step_end (k optimizer steps = one generation) and a subclass
times `_generate_and_score_completions` and, inside it, `_generate`; the rest of the interval is the update. What
each side does that the other does not, and why vLLM is not compared: docs/benchmarks.md (against TRL).

    make smollm2 && python benchmarks/bench_vs_trl.py                    # SmolLM2-135M, ~15 min on 2 CPU cores
    python benchmarks/bench_vs_trl.py --trl-dtype bfloat16-weights --repeats 1  # TRL with bf16 weights too
    python benchmarks/bench_vs_trl.py --model models/tiny-arith --data arithmetic:1,3 --steps 2 --repeats 1
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # data, reward, train (the TRL child imports them)
COLUMNS = ["step", "generate", "score+old logp", "update+rest", "tokens/completion", "RSS at last step GB",
           "RSS process GB"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "gsm8k", "train.jsonl"))
    p.add_argument("--prompts", type=int, default=8, help="prompts per generation")
    p.add_argument("--group-size", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--mini-batch-prompts", type=int, default=4, help="prompts per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are dropped, in both")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--method", default="clip", help="our band.BOUNDS method; clip is TRL's objective")
    p.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                   help="activation checkpointing in both (TRL's gradient_checkpointing, non-reentrant as ours)")
    p.add_argument("--steps", type=int, default=3, help="generations per run (the first is dropped)")
    p.add_argument("--repeats", type=int, default=2, help="runs per system, alternating")
    p.add_argument("--ours", default="", help="extra train.py flags of our run only, e.g. '--micro-batch-tokens "
                   "4096' (features TRL has no counterpart of; the header names them)")
    p.add_argument("--matched", action="store_true", help="ours in TRL's configuration instead of train.py's "
                   "defaults: HF generate, float32 in both, no shared prompt")
    p.add_argument("--trl-dtype", default="auto", choices=["auto", "float32", "bfloat16", "bfloat16-weights"],
                   help="TRL's precision: float32; bfloat16 = bf16=True over fp32 weights (TRL's default mixed "
                   "precision); bfloat16-weights = the model loaded in bf16 too (TRL's fastest); auto = bfloat16 "
                   "where the CPU has native bf16 (precision.resolve_dtype), else float32")
    p.add_argument("--trl-child", default="", help=argparse.SUPPRESS)  # internal: run TRL, write rows here
    return p.parse_args(argv)


def check_shape(a):
    """Raise ValueError unless both trainers can run exactly this shape; returns TRL's (GA steps, steps/generation)."""
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        raise ValueError(f"--model {a.model}: no such model directory (run `make smollm2`, or pass models/tiny-arith)")
    import data
    for name in data.split_names(a.data):
        data.check_name(name)
    if a.steps < 2:
        raise ValueError(f"--steps must be >= 2 (the first generation is dropped), got {a.steps}")
    rows, mini = a.prompts * a.group_size, a.mini_batch_prompts * a.group_size
    if a.prompts % a.mini_batch_prompts or mini % a.micro_batch_size:
        raise ValueError(f"--prompts {a.prompts} must be a multiple of --mini-batch-prompts {a.mini_batch_prompts}, "
                         f"and {mini} rows per optimizer step a multiple of --micro-batch-size {a.micro_batch_size}")
    return mini // a.micro_batch_size, rows // a.micro_batch_size


def train_records(a, tokenizer):
    """The records train.py trains on, in its order: the same loading, the same dropping of long prompts, then
    train.prompt_batch for each step (seed 0, one rank)."""
    import data
    import train
    records = [r for name in data.split_names(a.data) for r in data.load(
        name, split="train", seed=0, n=100_000 if name.startswith("arithmetic") else None)]  # as train.main
    ids, kept, _ = data.tokenize_prompts(records, tokenizer, a.max_prompt_len)
    kept = [dict(r, prompt_ids=x) for r, x in zip(kept, ids)]
    cfg = train.Config(prompts_per_step=a.prompts, seed=0)
    return [r for step in range(a.steps) for r in train.prompt_batch(kept, step, cfg)]


# --- the TRL child: one process, one GRPOTrainer run ----------------------------------------------------------------
def trl_child(a):
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import reward

    ga, spg = check_shape(a)
    k = spg // ga  # optimizer steps per generation
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    order = train_records(a, tokenizer)
    ds = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in order])

    def math_reward(completions, answer, **unused):  # our reward, on the text TRL decoded (skip_special_tokens)
        return reward.score_batch([c[0]["content"] for c in completions], answer, scorer="math-verify")

    class TimedGRPO(trl.GRPOTrainer):
        t_gen = t_all = 0.0
        n_tokens = n_seqs = 0

        def _generate(self, prompts):  # tokenize, generate, decode
            t = time.perf_counter()
            out = super()._generate(prompts)
            self.t_gen += time.perf_counter() - t
            self.n_tokens += sum(len(c) for c in out[1])  # out[1]: completion token ids, EOS included
            self.n_seqs += len(out[1])
            return out

        def _generate_and_score_completions(self, inputs):  # + padding, old log-probs, rewards, advantages
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.t_all += time.perf_counter() - t
            return out

    class GenerationTimes(TrainerCallback):
        """A mark at the start and after every k-th optimizer step: one generation and its k updates between."""

        def __init__(self):
            self.marks = []

        def mark(self):
            t, rss = trainer, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GB (Linux: KiB)
            self.marks.append((time.perf_counter(), t.t_gen, t.t_all, t.n_tokens, t.n_seqs, rss))

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % k == 0:
                self.mark()

    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.GRPOConfig(
            output_dir=out_dir, seed=0, max_steps=a.steps * k, learning_rate=a.lr, lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=a.micro_batch_size,
            gradient_accumulation_steps=ga, steps_per_generation=spg, num_generations=a.group_size,
            max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            loss_type="grpo", epsilon=0.2, delta=10.0, beta=0.0, num_iterations=1,  # = our clip, clip_c 10, no KL
            shuffle_dataset=False,  # the dataset is already in train.py's order
            use_cpu=True, bf16=a.trl_dtype != "float32", use_vllm=False,  # HF generate, on CPU
            gradient_checkpointing=a.grad_checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
        model = AutoModelForCausalLM.from_pretrained(
            a.model, dtype=torch.bfloat16 if a.trl_dtype == "bfloat16-weights" else torch.float32)
        trainer = TimedGRPO(model=model, reward_funcs=math_reward, args=args, train_dataset=ds,
                            processing_class=tokenizer)
        trl_ids = trainer._tokenize_prompts([r["messages"] for r in order])[0]
        if [list(x) for x in trl_ids] != [r["prompt_ids"] for r in order]:
            sys.exit("TRL tokenizes the prompts differently from data.tokenize_prompts: not the same job")
        times = GenerationTimes()
        trainer.add_callback(times)
        trainer.train()
    rows = []
    for (t0, g0, a0, n0, s0, _), (t1, g1, a1, n1, s1, rss) in zip(times.marks, times.marks[1:]):
        rows.append({"step": t1 - t0, "generate": g1 - g0, "score+old logp": (a1 - a0) - (g1 - g0),
                     "update+rest": (t1 - t0) - (a1 - a0), "tokens/completion": (n1 - n0) / (s1 - s0),
                     "RSS at last step GB": rss})
    with open(a.trl_child, "w") as f:
        json.dump(rows, f)


# --- the parent: one subprocess per run -----------------------------------------------------------------------------
def shape_flags(a):
    return ["--model", a.model, "--data", a.data, "--max-new-tokens", str(a.max_new_tokens),
            "--max-prompt-len", str(a.max_prompt_len), "--lr", str(a.lr), "--micro-batch-size",
            str(a.micro_batch_size), "--mini-batch-prompts", str(a.mini_batch_prompts),
            "--grad-checkpointing" if a.grad_checkpointing else "--no-grad-checkpointing"]


def our_flags(a):
    """TRL's configuration (--matched), or train.py's defaults: the engine, the dtypes, activation checkpointing and
    the shared-prompt forward as train.py decides them (--grad-checkpointing still forces it on)."""
    if a.matched:
        return [*shape_flags(a), "--rollout", "hf", "--train-dtype", "float32", "--rollout-dtype", "float32",
                "--no-share-prompt"]
    return [f for f in shape_flags(a) if f != "--no-grad-checkpointing"]


def run(cmd, d):
    """Run cmd under /usr/bin/time; its peak RSS in GB (the largest process of the run)."""
    rss_file = os.path.join(d, "rss")
    r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_file, *cmd], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if r.returncode:
        sys.exit(f"{' '.join(cmd[:3])} ... failed (exit {r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    with open(rss_file) as f:
        return int(f.read().split()[-1]) / 2**20, r.stdout


def run_ours(a):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "train.py", *our_flags(a), "--method", a.method, "--prompts-per-step", str(a.prompts),
               "--group-size", str(a.group_size), "--max-steps", str(a.steps), "--kl-coef", "0", "--clip-c", "10",
               "--agg", "seq-mean-token-mean", "--seed", "0", "--eval-every", "0", "--save-every", "0",
               "--no-export-hf", "--out-dir", os.path.join(d, "run"), *a.ours.split()]
        rss, stdout = run(cmd, d)
        setup = next((line for line in stdout.splitlines() if line.startswith("run dir")), "")
        with open(os.path.join(d, "run", "metrics.jsonl")) as f:
            ms = [json.loads(line) for line in f if line.strip() and "time/step" in line]
    rows = [{"step": m["time/step"], "generate": m["time/rollout"], "score+old logp": m["time/logprobs"],
             "update+rest": m["time/step"] - m["time/rollout"] - m["time/logprobs"],
             "tokens/completion": m["response_length/mean"], "RSS at last step GB": m["memory/peak_rss_gb"],
             "update": m["time/update"], "sync": m["time/sync"]} for m in ms]
    return rows, rss, setup.split(" | ", 1)[-1]


def run_trl(a, argv):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        rss, _ = run([sys.executable, os.path.abspath(__file__), *argv, "--trl-child", out], d)
        with open(out) as f:
            return json.load(f), rss, f"TRL {a.trl_dtype}"


def header(a, ga, spg):
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    git = lambda *c: subprocess.run(["git", *c], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if git("status", "--porcelain") else "")
    import torch
    import transformers
    import trl
    data = a.data.removeprefix(ROOT + os.sep)
    model = a.model.removeprefix(ROOT + os.sep)
    return (f"train.py (--method {a.method}) against TRL {trl.__version__} GRPOTrainer, the same job: {model} on "
            f"{data}, {a.prompts} prompts x G {a.group_size} per generation, {a.max_new_tokens} new tokens, prompts "
            f"up to {a.max_prompt_len} tokens, {a.prompts // a.mini_batch_prompts} optimizer steps per generation "
            f"(mini-batch {a.mini_batch_prompts} prompts; TRL steps_per_generation {spg} / gradient_accumulation_steps "
            f"{ga}), micro-batch {a.micro_batch_size} sequences, lr {a.lr:g} constant; TRL in {a.trl_dtype} with HF "
            f"generate, activation checkpointing {'on' if a.grad_checkpointing else 'off'}; ours "
            f"{'matched to TRL (float32, HF generate, no shared prompt)' if a.matched else 'with train.py defaults'}, "
            f"no KL, no eval{'; ours also ' + a.ours if a.ours else ''}; {a.steps} generations per run, the first dropped, {a.repeats} run(s) "
            f"per system alternating. Machine: {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}; commit {commit}; "
            f"{time.strftime('%Y-%m-%d')}. Seconds per generation (one rollout and its updates), unless named.")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.trl_child:
        return trl_child(a)
    a.model, a.data = os.path.abspath(a.model), (os.path.abspath(a.data) if os.path.exists(a.data) else a.data)
    try:
        ga, spg = check_shape(a)
    except ValueError as e:
        print(f"bench_vs_trl.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if a.trl_dtype == "auto":
        from machinery import precision
        a.trl_dtype = "bfloat16" if precision.resolve_dtype("auto") == "bfloat16" else "float32"
    argv = [*shape_flags(a), "--prompts", str(a.prompts), "--group-size", str(a.group_size), "--steps", str(a.steps),
            "--trl-dtype", a.trl_dtype]
    print(header(a, ga, spg), flush=True)
    steps = {"ours": [], "TRL": []}  # the kept generations of every run
    rss = {"ours": 0.0, "TRL": 0.0}
    per_run, setups = [], {}
    for i in range(a.repeats):
        for name, fn in (("ours", lambda: run_ours(a)), ("TRL", lambda: run_trl(a, argv))):
            rows, peak, setups[name] = fn()
            steps[name] += rows[1:]
            rss[name] = max(rss[name], peak)
            per_run.append(f"{name} {statistics.mean(r['step'] for r in rows[1:]):.2f}")
            print(f"  run {i + 1}: {per_run[-1]} s per generation", flush=True)
    mean = {name: {c: statistics.mean(r[c] for r in rows) for c in COLUMNS[:-2]} for name, rows in steps.items()}
    for name, rows in steps.items():  # memory: the largest of any run, not a mean
        mean[name].update({"RSS at last step GB": max(r["RSS at last step GB"] for r in rows),
                           "RSS process GB": rss[name]})
    print("\n| system | " + " | ".join(COLUMNS) + " |\n|---|" + "---:|" * len(COLUMNS))
    for name in ("ours", "TRL"):
        print(f"| {name} | " + " | ".join(f"{mean[name][c]:.2f}" for c in COLUMNS) + " |")
    print("| TRL / ours | " + " | ".join(f"{mean['TRL'][c] / mean['ours'][c]:.2f}" for c in COLUMNS) + " |")
    ours = steps["ours"]
    print(f"\nours ran: {setups['ours']}")
    print(f"ours' update+rest = update {statistics.mean(r['update'] for r in ours):.2f} + weight sync into the "
          f"engine {statistics.mean(r['sync'] for r in ours):.2f} + metrics; runs in order: {', '.join(per_run)}")


if __name__ == "__main__":
    main()

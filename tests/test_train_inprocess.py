"""train.py's pieces called in this process, beside the subprocess smoke tests of test_train.py.

Claims checked: a non-finite loss skips the update and keeps the weights; a resumed run keeps its own config, takes
the flags of time and memory and refuses others that differ; --share-prompt on part groups per rank exits 2 with one
line before any engine starts; a one-rank checkpoint adds no thread and round-trips; the heap is kept only where the
memory test finds room, and then freed blocks are reused without page faults.
"""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

import rollout
import train
from test_train import HANG, ROOT, env, free_port


def test_non_finite_loss_skips_the_update_and_keeps_the_weights(monkeypatch):
    """A NaN in the loss never reaches the weights: the update is skipped (and counted), the weights are unchanged."""
    import torch.distributed as dist

    from logprobs import RolloutBatch

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=2, mini_batch_prompts=1, group_size=2,
                           micro_batch_size=4, max_new_tokens=6, train_dtype="float32")
        model = train.build_model(cfg, torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        B, P, T = 4, 3, 6
        ids = torch.randint(4, model.config.vocab_size, (B, P + T), generator=torch.Generator().manual_seed(0))
        attn, mask = torch.ones(B, P + T, dtype=torch.long), torch.ones(B, T)
        old_logp = torch.full((B, T), -1.0)
        old_logp[0, 2] = float("nan")  # poisons mini-batch 0 only
        advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
        _, skipped, _ = train.update_policy(model, optimizer, cfg, RolloutBatch(ids, attn, mask, P), advantages,
                                            old_logp)
        assert skipped == 1  # mini-batch 0 skipped, mini-batch 1 applied
        after = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.isfinite(v).all() for v in after.values())
        assert any(not torch.equal(before[k], after[k]) for k in before)  # the finite mini-batch did update
    finally:
        dist.destroy_process_group()


def test_resume_keeps_its_own_config_takes_speed_flags_and_refuses_others(tmp_path, capsys):
    """A resumed run runs its saved settings. From the command line it takes, where given, the run's length,
    --keep-checkpoints and how the update spends time and memory (--recompute, --pack, --compile-layers), and says
    so on one line; without --max-steps it runs to its own end. A flag that would change the maths (--method, --lr)
    with another value than the saved one is refused, naming it; with the saved value it is accepted."""
    import dataclasses


    run = tmp_path / "run"
    run.mkdir()
    saved = train.resolve_config(train.Config(method="clip", seed=7, keep_checkpoints=3, max_steps=10,
                                              out_dir=str(run), recompute="none", pack=True, compile_layers=False))
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(saved)))
    cfg = train.load_run_config(["--resume", str(run), "--max-steps", "20", "--method", "clip"])
    assert (cfg.method, cfg.seed, cfg.keep_checkpoints, cfg.max_steps) == ("clip", 7, 3, 20)
    assert (cfg.recompute, cfg.pack, cfg.compile_layers) == ("none", True, False)
    assert capsys.readouterr().out.strip() == (f"resuming {run}: the saved run's settings (config.json), and from the "
                                               f"command line --max-steps 20")
    cfg = train.load_run_config(["--resume", str(run), "--keep-checkpoints", "1", "--recompute", "full", "--no-pack",
                                 "--compile-layers"])
    assert (cfg.method, cfg.keep_checkpoints, cfg.max_steps) == ("clip", 1, 10)
    assert (cfg.recompute, cfg.grad_checkpointing, cfg.pack, cfg.compile_layers) == ("full", True, False, True)
    assert capsys.readouterr().out.strip().endswith(
        "from the command line --keep-checkpoints 1 --recompute full --no-pack --compile-layers")
    assert train.load_run_config(["--resume", str(run), "--grad-checkpointing"]).recompute == "full"
    for flags, message in ((["--method", "bandkl"], "--method 'bandkl' with --resume: the run was saved with 'clip'"),
                           (["--lr", "0.001"], "--lr 0.001 with --resume: the run was saved with 0.0001"),
                           (["--out-dir", str(tmp_path / "other")], "a resumed run continues in its own directory")):
        with pytest.raises(ValueError, match=message):
            train.load_run_config(["--resume", str(run), *flags])
    shared = dataclasses.replace(saved, share_prompt=True, pack=False)   # a shared prompt cannot be packed
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(shared)))
    with pytest.raises(ValueError, match="--pack and --share-prompt do not combine"):
        train.load_run_config(["--resume", str(run), "--pack"])


@pytest.mark.parametrize("resumed", [False, True], ids=["explicit", "resumed"])
def test_share_prompt_on_part_groups_per_rank_exits_2_before_the_engine(tmp_path, monkeypatch, capsys, resumed):
    """--share-prompt runs each prompt once for its G rows, so each rank's mini-batch must be whole groups. 4 prompts
    x G 4 in 4 mini-batches on 2 ranks give 2 rows per rank and mini-batch, half a group (on 1 rank: 4, one group).
    Given on 2 ranks, or saved by a 1-rank run (where the defaults may decide it) that is resumed on 2, train.main
    exits 2 with one line before it sets up a process group (and so before the engine and the first rollout)."""
    import dataclasses


    monkeypatch.setattr(train, "WORLD", 2)
    monkeypatch.setattr(train, "init_distributed", lambda: pytest.fail("the shape passed its check"))
    shape = dict(prompts_per_step=4, mini_batch_prompts=1, group_size=4, micro_batch_size=4)
    run = tmp_path / "run"
    if resumed:
        run.mkdir()
        saved = train.Config(**shape, share_prompt=True, grad_checkpointing=False, out_dir=str(run))
        (run / "config.json").write_text(json.dumps(dataclasses.asdict(saved)))
        argv = ["--resume", str(run)]
    else:
        argv = [*(f"--{k.replace('_', '-')}={v}" for k, v in shape.items()), "--share-prompt",
                "--no-grad-checkpointing", "--out-dir", str(run)]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    assert "--share-prompt" in lines[0] and "2 rows of --group-size 4" in lines[0]

@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="counts the threads in /proc; one OpenMP thread opens no team")
def test_one_rank_checkpoint_adds_no_thread_and_round_trips(tmp_path, monkeypatch):
    """A one-rank save and load open no second OpenMP team (a gloo worker thread running a parallel copy would: libgomp
    then counts more threads than CPUs and stops spin-waiting, every step after the first checkpoint ~1.5x slower);
    what is loaded is what was saved."""
    import torch.distributed as dist

    from machinery import checkpoint

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = train.Config(model=rollout.DEFAULT_MODEL, train_dtype="float32", out_dir=str(tmp_path))
        model = train.build_model(cfg, torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=torch.arange(8)[None]).logits.sum().backward()
        optimizer.step()
        saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        threads = set(os.listdir("/proc/self/task"))
        checkpoint.save_checkpoint(str(tmp_path), 1, model, optimizer, cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert checkpoint.load_checkpoint(checkpoint.latest_checkpoint(str(tmp_path)), model, optimizer) == 1
        assert not set(os.listdir("/proc/self/task")) - threads  # no new thread (one of an earlier test may end)
        assert all(torch.equal(saved[k], v.full_tensor()) for k, v in model.state_dict().items())
    finally:
        dist.destroy_process_group()


def _fault_probes(tmp):
    """Two fresh interpreters allocate and free 64 MiB blocks, one where train.keep_freed_memory keeps the heap, one
    under checkpointing, where it is not set -> {name: (kept?, page faults of the last 5 rounds)}."""
    probe = (
        "import resource, sys, torch, rollout, train\n"
        "cfg = train.Config(model=rollout.DEFAULT_MODEL, grad_checkpointing=sys.argv[1] == 'on')\n"
        "kept = train.keep_freed_memory(cfg, torch.device('cpu'), free=float(sys.argv[2]))\n"
        "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "counts = []\n"
        "for _ in range(20):\n"  # two 64 MiB float32 blocks, touched, then freed
        "    before = faults(); x = torch.ones(16 * 2**20); y = x * 2; counts.append(faults() - before); del x, y\n"
        "print(kept, sum(counts[-5:]))\n")
    runs = {}
    for name, gc in (("kept", "off"), ("checkpointing", "on")):
        clean = {k: v for k, v in env().items()  # glibc's defaults, and torch's: no huge pages asked for
                 if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")}
        out = subprocess.run([sys.executable, "-c", probe, gc, str(2**40)], capture_output=True, text=True, cwd=ROOT,
                             env=clean, timeout=HANG)
        assert out.returncode == 0, out.stderr[-2000:]
        kept, faults = out.stdout.split()[-2:]
        runs[name] = (kept == "True", int(faults))
    return runs


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
@pytest.mark.ahead.with_args(_fault_probes, cpu_s=15)
def test_keep_freed_memory_reuses_freed_blocks_without_page_faults(ahead, monkeypatch):
    """train.keep_freed_memory: blocks of 64 MiB allocated and freed over and over, as a step's logits and casts are,
    come from the heap's freed blocks once it has them, without page faults; under glibc's default every one is a
    fresh mmap whose 16k pages fault in again (two fresh processes, one kept, one under checkpointing, where it is not
    set). Nor is it set over a user's own GLIBC_TUNABLES or MALLOC_*, nor with checkpointing off where the memory test
    finds no room: the tiny model's update without checkpointing needs over 10 MB (16 bytes per parameter), and 1 MB
    free is forced (decided here, in this process: a refusal returns before mallopt is called)."""
    runs = ahead.result(_fault_probes)
    # the last 5 rounds: 10 blocks mapped and faulted afresh under the defaults (16k pages of 4 KiB each, or 32 where
    # the kernel backs them with 2 MiB pages: transparent huge pages "always"), the heap's own pages when kept
    assert runs["kept"][0] and not runs["checkpointing"][0], runs
    assert runs["checkpointing"][1] >= 10 * 32, runs
    assert runs["kept"][1] * 10 < runs["checkpointing"][1], runs
    cfg, cpu = train.Config(model=rollout.DEFAULT_MODEL, grad_checkpointing=False), torch.device("cpu")
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(key)
    assert train.keep_freed_memory(cfg, cpu, free=2**20) is False  # no room
    for key, value in (("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"), ("MALLOC_ARENA_MAX", "2")):
        with monkeypatch.context() as m:
            m.setenv(key, value)
            assert train.keep_freed_memory(cfg, cpu, free=2**40) is False, key

"""Checkpoints of a run: DCP shards, per-rank RNG state, the final Hugging Face export.

Not part of the paper's method (docs/paper.md §4 lists the training system). A checkpoint is
`<run_dir>/checkpoints/step_NNNNNN/`: the sharded model and optimizer state of
torch.distributed.checkpoint (DCP; each rank writes its own shards, no gather), `rng_rank<r>.pt`
(torch / python / CUDA RNG of every rank, so a resumed run draws the same random numbers as an
uninterrupted one) and `meta.json` (step, data position, world size, the Config). It is written
under a temporary name and renamed when complete, so a run killed mid-save (kill -9 included) leaves
either the previous checkpoint or the new one, never half of one; `latest_checkpoint` ignores
`*.tmp`. `export_hf` gathers the full weights to rank 0 and writes a plain `save_pretrained`
directory that transformers and vLLM load.

Called by train.py on every rank (each function holds collectives), e.g. through `torchrun
--nproc_per_node 2 train.py --resume runs/<run-dir>`. tests/test_train.py kills a run with SIGKILL
and checks that the resumed run ends where an uninterrupted one ends.
"""
import contextlib
import dataclasses
import json
import os
import random
import shutil
import warnings

import torch
import torch.distributed as dist


def _alone():
    """One process: DCP without its collectives (no_dist). Its plans travel by gather_object,
    whose copy of a plan's bytes runs on a gloo worker thread as a parallel torch op: that thread
    opens a second OpenMP team, and libgomp, finding more threads than CPUs from then on, stops
    spin-waiting at every barrier for the rest of the process (a one-rank run's steps ~1.5x
    slower after its first checkpoint; tests/test_train.py checks no thread is added). Several
    ranks need the collectives; torchrun gives each rank one OpenMP thread there (unless
    OMP_NUM_THREADS says otherwise), so no second team opens."""
    return dist.get_world_size() == 1


@contextlib.contextmanager
def _quiet():
    """DCP warns that no_dist means one process: it does, on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(run_dir, step, model, optimizer, cfg):
    """Write checkpoints/step_NNNNNN of a run atomically (every rank; collectives)."""
    # deferred, here and below: torch.distributed.checkpoint takes ~1 s to import, and only these
    # functions need it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, no_dist=_alone())
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, os.path.join(tmp, f"rng_rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "data_position": step * cfg.prompts_per_step,
                       "world_size": dist.get_world_size(), "config": dataclasses.asdict(cfg)},
                      f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # the checkpoint exists only once it is complete
    dist.barrier()


def latest_checkpoint(run_dir):
    """The newest complete checkpoint of a run directory, or None."""
    root = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")) \
        if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def checkpoint_step(path):
    """The step a checkpoint folder was saved at (its meta.json); 0 for None, a run with no checkpoint."""
    if path is None:
        return 0
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)["step"]


def prune_checkpoints(run_dir, keep):
    """Delete all but the newest `keep` complete checkpoints of a run (rank 0, after a save);
    returns those deleted.

    A checkpoint is deleted only after a newer one is complete, so a run killed at any moment still
    has one to resume from. Unfinished `*.tmp` folders are left to save_checkpoint, which clears its
    own before writing.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    old = [os.path.join(root, d) for d in done[:-keep]]
    for path in old:
        shutil.rmtree(path)
    return old


def load_checkpoint(path, model, optimizer):
    """Restore model, optimizer and this rank's RNG from a checkpoint; returns its step (every rank;
    collectives)."""
    import torch.distributed.checkpoint as dcp  # deferred: ~1 s to import (see save_checkpoint)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet():
        dcp.load(state, checkpoint_id=path, no_dist=_alone())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    # the RNG streams are per rank: a different world size cannot continue exactly
    if meta["world_size"] != dist.get_world_size() and dist.get_rank() == 0:
        print(f"warning: checkpoint was written by {meta['world_size']} ranks, resuming with "
              f"{dist.get_world_size()}", flush=True)
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta["step"]


def export_hf(run_dir, model, tokenizer):
    """Full weights gathered to rank 0 and written with save_pretrained: transformers and vLLM load
    the result."""
    # deferred, as above
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        out = os.path.join(run_dir, "hf")
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=full)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    dist.barrier()

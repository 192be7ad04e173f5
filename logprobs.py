"""Log-probabilities of sequences: per-token log π(y_t | prefix) of sampled responses, and entropy.

The surrogate of docs/paper.md §3 needs, for every response token, log π_θ(a_t | s_t) (with
gradient) and log π_old(a_t | s_t) (without): the ratio r_t = exp(log π_θ − log π_old). This file
computes them from a causal LM as the distribution the engine sampled from, softmax(logits /
temperature) over the full vocabulary, so that π_old recomputed here and the engine's own log-probs
are the same numbers up to rounding (rollout/logprob_diff).

    batch = pack(prompt_ids, completions, device)  # a RolloutBatch: (B, P + T), ...
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.attn, batch.n_prompt,
                                micro_batch_size=8)  # (B, T)

Three memory choices, because with a real vocabulary the naive form is a step's largest tensor:
- `pack` left-pads prompts and right-pads responses, so every response starts at column P;
- `sequence_logprobs` cuts each micro-batch to its own longest prompt and response and asks the
  model for the response positions' logits only (`logits_to_keep`), never the prompt's (b, P, V);
- `token_logprobs` upcasts one chunk of positions at a time to float32 (a custom autograd Function):
  it never holds a second full-vocabulary float32 tensor, forward or backward.
With --pack, `packed_logprobs` runs a micro-batch's rows end to end without padding (attention
confined to each row: machinery/packed_attention.py) and fuses the LM head with the log-prob, so
no (N, V) logits exist at all; the padded path above is its reference (tests/test_pack.py).

Tests: tests/test_logprobs.py (float64, gradcheck, bf16 against the naive form, temperature, shared
prompt), tests/test_policy.py (against an unpadded forward). Memory: bench_logprob_memory.py.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from machinery.fused_head import HeadLogprob


@dataclass
class RolloutBatch:
    """One rank's rollout, packed: prompts left-padded and responses right-padded, so every response
    starts at column P. `batch[rows]` (a slice or a list of row indices): those rows' sub-batch."""
    input_ids: torch.Tensor                     # (B, P + T) token ids; 0 at padding (never read)
    attn: torch.Tensor                          # (B, P + T) attention mask, 1 on real tokens
    mask: torch.Tensor                          # (B, T) float, 1 on response tokens
    n_prompt: int                               # P
    engine_logp: Optional[torch.Tensor] = None  # (B, T) the engine's log-probs (0 where none)
    spans: Optional[list] = None                # row_spans: [(prompt length, response length)]

    def __post_init__(self):
        if self.spans is None:
            self.spans = row_spans(self.attn, self.n_prompt)  # one host sync per packed batch

    def __len__(self):
        return self.input_ids.shape[0]

    def __getitem__(self, rows):
        pick = ((lambda x: x[rows]) if isinstance(rows, slice)
                else (lambda x: x[torch.as_tensor(rows, device=x.device)]))
        spans = self.spans[rows] if isinstance(rows, slice) else [self.spans[i] for i in rows]
        return RolloutBatch(pick(self.input_ids), pick(self.attn), pick(self.mask), self.n_prompt,
                            None if self.engine_logp is None else pick(self.engine_logp), spans)


def pack(prompt_ids, completions, device):
    """Left-pad prompts and right-pad responses into one RolloutBatch (B, P + T), so every response
    starts at column P. Padding positions hold token 0 under a zero attention mask: the pad id is
    never read, so a tokenizer without a pad token (Llama 3) needs none."""
    n_prompt = max(len(prompt_ids[c.prompt_index]) for c in completions)
    n_resp = max(1, max(len(c.token_ids) for c in completions))
    B = len(completions)
    input_ids = torch.zeros((B, n_prompt + n_resp), dtype=torch.long)
    attn = torch.zeros((B, n_prompt + n_resp), dtype=torch.long)
    engine_logp = torch.zeros((B, n_resp), dtype=torch.float32)
    for b, c in enumerate(completions):
        p, r = prompt_ids[c.prompt_index], c.token_ids
        input_ids[b, n_prompt - len(p):n_prompt] = torch.tensor(p)
        input_ids[b, n_prompt:n_prompt + len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, n_prompt - len(p):n_prompt + len(r)] = 1
        if c.logprobs:
            engine_logp[b, :len(r)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return RolloutBatch(input_ids.to(device), attn.to(device),
                        attn[:, n_prompt:].to(device, torch.float32), n_prompt,
                        engine_logp.to(device))


def row_spans(attn_mask, n_prompt):
    """[(prompt length, response length)] of each packed row, on the host (one sync)."""
    return torch.stack([attn_mask[:, :n_prompt].sum(-1),
                        attn_mask[:, n_prompt:].sum(-1)], -1).tolist()


def sequence_logprobs(model, input_ids, attn_mask, n_prompt, micro_batch_size, temperature=1.0,
                      with_entropy=False, spans=None, group_size=0):
    """Per-token log π(y_t | prefix) of the response tokens under softmax(logits / temperature),
    the distribution the engine sampled from (verl divides the logits the same way), in
    micro-batches of `micro_batch_size` rows. -> (logp (B, T), entropy (B, T) or None): the
    entropy only with with_entropy.

    Each micro-batch is cut to its own longest prompt and response (the step's batch is padded to
    the longest of all), and the LM head runs on the response positions only (logits_to_keep): the
    prompt's logits, a (b, P, V) tensor, are never made. Positions past a row's response hold 0
    (masked out downstream). spans: the rows' `row_spans`, computed here (one host sync) when None.
    group_size: G > 1 when the rows come in groups of G that share one prompt (a GRPO rollout) and
    every micro-batch holds whole groups: each prompt then runs once, not G times
    (`_shared_prompt_logits`).
    """
    B, T = input_ids.shape[0], input_ids.shape[1] - n_prompt
    spans = row_spans(attn_mask, n_prompt) if spans is None else spans
    shared = group_size > 1
    if shared and (micro_batch_size % group_size or B % group_size):
        raise ValueError(f"a shared-prompt forward needs whole groups: micro-batch "
                         f"{micro_batch_size} and batch {B} must be multiples of the group size "
                         f"{group_size}")
    logps, ents = [], []
    for i in range(0, B, micro_batch_size):
        rows = slice(i, i + micro_batch_size)
        p = max(s[0] for s in spans[rows])  # this micro-batch's longest prompt (left-padded) ...
        t = max(1, max(s[1] for s in spans[rows]))  # ... and longest response (right-padded)
        ids, am = (input_ids[rows, n_prompt - p:n_prompt + t],
                   attn_mask[rows, n_prompt - p:n_prompt + t])                # (b, p + t)
        if shared:
            logits = _shared_prompt_logits(model, ids, am, p, group_size)     # (b, t, V)
        else:
            # positions count from each prompt's first real token, as in the rollout
            pos = (am.cumsum(-1) - 1).clamp(min=0)                            # (b, p + t)
            # the t + 1 last positions predict the response tokens and one past the end (dropped)
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos,
                           logits_to_keep=t + 1).logits[:, :-1]               # (b, t, V)
        # no .float() and no / temperature here: token_logprobs upcasts a chunk, then divides
        out = token_logprobs(logits, ids[:, p:], with_entropy=with_entropy,
                             temperature=temperature)                         # (b, t)
        keep = am[:, p:].to(torch.float32)                                    # (b, t) 0 past end
        out = [torch.nn.functional.pad(x * keep, (0, T - t))
               for x in (out if with_entropy else (out,))]                    # (b, T)
        logps.append(out[0])
        ents.extend(out[1:])
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


def _shared_prompt_logits(model, ids, am, p, G):
    """The logits that predict the response tokens ids[:, p:] (b, t, V), for rows in groups of G
    with one prompt each, the prompt run once per group: a forward of the b / G prompts that keeps
    their KV cache, the cache repeated G times, then a forward of the b responses on top of it. The
    same function as the packed forward of every row (tests/test_logprobs.py checks values and
    gradients in float64), with the prompt's share of the compute divided by G: GRPO's G completions
    of a 48-token chat prompt are ~25 tokens each, so the prompt is most of the packed forward.
    Gradients reach the prompt's positions through the cache. HF turns the cache off under
    activation checkpointing, so the two do not combine (train.py resolves --share-prompt)."""
    prompts, prompt_am = ids[::G, :p], am[::G, :p]                          # (b/G, p)
    if not torch.equal(ids[:, :p].view(-1, G, p), prompts[:, None].expand(-1, G, p)):
        raise ValueError(f"rows are not in groups of {G} that share a prompt")
    pos = (prompt_am.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompts, attention_mask=prompt_am, position_ids=pos, use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(G)                                        # (b, h, p, d) per layer
    t = ids.shape[1] - p
    resp_pos = (prompt_am.sum(-1).repeat_interleave(G)[:, None]
                + torch.arange(t, device=ids.device))                       # (b, t)
    # the last prompt position predicts the first response token; positions 0..t-2 the rest
    rest = model(input_ids=ids[:, p:], attention_mask=am, position_ids=resp_pos,
                 past_key_values=cache, logits_to_keep=t).logits[:, :-1]  # (b, t-1, V)
    return torch.cat([out.logits.repeat_interleave(G, 0), rest], 1)         # (b, t, V)


# --- the log-prob of the sampled token, one float32 chunk at a time ---

def entropy_from_logits(logits):
    """H = logsumexp(z) − Σ softmax(z)·z over the last dim, in float32: the plain reference, with
    full-size temporaries."""
    z = logits.float() if logits.dtype != torch.float64 else logits
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


class _TokenLogprob(torch.autograd.Function):
    """log softmax(z)[target] over chunks of positions. Saves only the caller's logits (no copy),
    the log-normaliser and the targets; the backward rebuilds softmax chunk by chunk and writes the
    gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, targets, chunk_size, with_entropy, temperature):
        # logits (B, T, V), targets (B, T)
        cdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        B, T, _ = logits.shape
        logp = torch.empty(B, T, dtype=cdtype, device=logits.device)    # (B, T)
        lse = torch.empty_like(logp)                                    # (B, T)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s in range(0, T, chunk_size):
            z = logits[:, s:s + chunk_size].to(cdtype)                  # (B, c, V) the fp32 chunk
            if temperature != 1.0:
                z = z / temperature                                     # (B, c, V) after the upcast
            lse[:, s:s + chunk_size] = lse_c = torch.logsumexp(z, -1)   # (B, c)
            logp[:, s:s + chunk_size] = z.gather(
                -1, targets[:, s:s + chunk_size, None]).squeeze(-1) - lse_c  # (B, c)
            if with_entropy:
                ent[:, s:s + chunk_size] = lse_c - (torch.exp(z - lse_c[..., None]) * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):                            # grad_logp (B, T)
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)                                 # (B, T, V), logits' dtype
        c, temp = ctx.chunk_size, ctx.temperature
        for s in range(0, logits.shape[1], c):
            g = grad_logp[:, s:s + c, None].to(lse.dtype) / temp        # (B, c, 1) d(z/T)/dz = 1/T
            d = logits[:, s:s + c].to(lse.dtype, copy=True)             # (B, c, V) the fp32 chunk
            if temp != 1.0:
                d.div_(temp)
            d.sub_(lse[:, s:s + c, None]).exp_().mul_(-g)               # −g·softmax, in place
            d.scatter_add_(-1, targets[:, s:s + c, None], g)            # + g at the target
            grad[:, s:s + c] = d
        return grad, None, None, None, None


def token_logprobs(logits, targets, *, chunk_size=64, with_entropy=False, temperature=1.0):
    """log softmax(logits / temperature)[target] from logits (B, T, V) of any float dtype -> (B, T)
    float32 (float64 for float64 logits), differentiable w.r.t. logits.

    The naive `logits.float().log_softmax(-1).gather(...)` holds a float32 copy of the logits plus
    the float32 log_softmax that autograd keeps for backward (8 bytes per logit on top of the bf16
    logits, 12 with the backward); here only a (B, chunk_size, V) float32 chunk exists at a time,
    forward and backward, and the gradient is written straight in the logits' dtype (the peaks:
    docs/benchmarks.md, benchmarks/bench_logprob_memory.py). `chunk_size` is in sequence positions
    (a chunk has B·chunk_size·V float32 elements). `with_entropy=True` also returns the entropy
    (B, T), computed in the same pass, without gradient (a diagnostic; the paper has no entropy
    bonus). `temperature` divides each chunk after its upcast: dividing the bf16 logits first would
    round z/T to bf16 (error up to 2^-9·|z/T|, ~0.05 nats at |z/T| = 25) and copy all (B, T, V).
    """
    logp, ent = _TokenLogprob.apply(logits, targets.long(), int(chunk_size), bool(with_entropy),
                                    float(temperature))
    return (logp, ent) if with_entropy else logp


# --- packed micro-batches: the rows' real tokens end to end, the LM head fused with the log-prob ---

PACKED_FORWARD = "bandpo_packed_forward"  # the method enable_packing gives the model
PACKED_KERNEL = "bandpo_packed_kernel"    # its attention kernel (packed_attention.KERNELS)
PACKED_WINDOWS = "bandpo_packed_windows"  # its layers' sliding windows (packed_attention.model_windows)
PACKED_UPCAST = "bandpo_packed_upcast"    # bf16 attention computed in float32 (packed_attention.float32_attention)
HEAD_CHUNK = "bandpo_head_chunk"          # its fused head's rows per chunk (head_chunk_rows)
HEAD_COMPILED = "bandpo_head_compiled"    # its fused head's chunk functions compiled (--compile-head)
# The fused head's chunk: its temporaries (~12 bytes a logit: the float32 block, its exp, the
# gradient's block in the weights' dtype) within this many bytes. A constant, not the memory free:
# the chunk sets the order in which the weight gradient is summed (and cuBLAS's kernel for the
# block), so a chunk read from the free memory would make a run's bits depend on the day.
HEAD_CHUNK_BYTES = 2 << 30


def head_chunk_rows(vocab, budget=HEAD_CHUNK_BYTES, most=2048):
    """Rows per chunk of the fused head, a function of the vocabulary only: as many as keep a
    chunk's temporaries within `budget` bytes, at most `most` (2048: the head's matmuls are then
    large enough to run at the GPU's matmul rate; more only adds memory). A 152k vocabulary: 1177
    rows, 2.0 GiB; a 49k one: 2048 rows, 1.1 GiB."""
    return int(max(1, min(most, budget // (12 * vocab))))


def enable_packing(model, kernel=None, chunk=None, compile_head=False, upcast=None):
    """Let `model` (a Llama/Qwen2-style causal LM, FSDP2-sharded or not) run packed micro-batches:
    attention through machinery/packed_attention.py's implementation (which serves padded calls
    with transformers' SDPA as before), and `_packed_forward` as a method FSDP2 treats as a forward
    (register_fsdp_forward_method: the weights are gathered around it as around `forward`), so that
    the LM head's weight can be read outside `forward`. `kernel`: the packed attention kernel
    (None: packed_attention.kernel_for the weights' device in bfloat16); `chunk`: the fused head's
    rows per chunk (None: head_chunk_rows of the vocabulary); `compile_head`: its chunk functions
    through torch.compile (machinery/fused_head.py); `upcast`: the SDPA kernels compute bf16
    attention in float32 (None: packed_attention.float32_attention of the weights' device and dtype; build_model
    passes the run's compute dtype). Refuses (ValueError, one line) a
    model whose attention or head the packed path does not implement, before anything runs.
    Returns the model."""
    import types

    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    from machinery import packed_attention
    head = model.get_output_embeddings()
    kernel = kernel or packed_attention.kernel_for(head.weight.device)
    windows = check_packable(model, kernel)
    packed_attention.register()
    model.set_attn_implementation(packed_attention.NAME)
    setattr(model, PACKED_FORWARD, types.MethodType(_packed_forward, model))
    setattr(model, PACKED_KERNEL, kernel)
    setattr(model, PACKED_WINDOWS, tuple(sorted(windows, key=lambda w: -1 if w is None else w)))
    setattr(model, HEAD_CHUNK, int(chunk or head_chunk_rows(head.weight.shape[0])))
    setattr(model, HEAD_COMPILED, bool(compile_head))
    setattr(model, PACKED_UPCAST, bool(packed_attention.float32_attention(head.weight.device, head.weight.dtype)
                                       if upcast is None else upcast))
    if isinstance(model, FSDPModule):
        register_fsdp_forward_method(model, PACKED_FORWARD)
    return model


def check_packable(model, kernel):
    """Refuse (ValueError, one line naming it) a model the packed path does not implement: an LM
    head with a bias or soft-capped logits (the fused head computes hidden @ W^T only), or attention
    that packed_attention.check_supported refuses; else return its sliding windows. `model`: a
    transformers model, or its config (its modules then built on the meta device, no weights, so
    train.py refuses before anything loads)."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from machinery import packed_attention
    if isinstance(model, PretrainedConfig):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model)
    if (getattr(model.get_output_embeddings(), "bias", None) is not None
            or getattr(model.config, "final_logit_softcapping", None)):
        raise ValueError(f"{type(model).__name__}: the fused head computes logits = hidden @ "
                         f"W^T only (no bias, no soft-capping): run with --no-pack")
    return packed_attention.check_supported(model, kernel)


def packed_logprobs(model, input_ids, n_prompt, spans, temperature=1.0, with_entropy=False,
                    kernel=None):
    """The same (logp (b, T), entropy (b, T) or None) as `sequence_logprobs` of one micro-batch,
    from a packed forward: the rows' real tokens (prompt + response, no padding) concatenated into
    one sequence (1, N), positions restarting at each row, attention confined to each row
    (machinery/packed_attention.py; `kernel` None: the one enable_packing chose). The LM head runs
    on the response positions only and is fused with the log-prob (machinery/fused_head.py): no (N, V)
    logits, in any dtype. `model` needs enable_packing. The indices are built on the device from
    one copy of the spans (`packed_indices`), never from host lists of N entries."""
    from machinery import packed_attention
    b, T = input_ids.shape[0], input_ids.shape[1] - n_prompt
    dev = input_ids.device
    x = packed_indices(spans, n_prompt, dev)
    ids = input_ids[x["row"], x["col"]]                                                  # (N,)
    packing = packed_attention.make_packing([p + r for p, r in spans], dev,
                                            kernel or getattr(model, PACKED_KERNEL),
                                            getattr(model, PACKED_WINDOWS), x["lengths"],
                                            getattr(model, PACKED_UPCAST))
    logp, ent = getattr(model, PACKED_FORWARD)(ids[None], x["pos"][None], packing, x["src"],
                                               ids[x["src"] + 1], temperature, with_entropy)
    at = (x["dst_row"], x["dst_col"])
    out = [torch.zeros(b, T, dtype=logp.dtype, device=dev).index_put(at, v)             # (b, T)
           for v in ((logp, ent) if with_entropy else (logp,))]
    return out[0], out[1] if with_entropy else None


def packed_indices(spans, n_prompt, device):
    """The packed micro-batch's indices, int64 on `device`, from one host-to-device copy of the
    spans [(p, r)] (pinned and asynchronous on CUDA: no stream synchronisation; the sizes come
    from the host's spans, so no repeat_interleave waits on the device): for the N packed tokens,
    `row`, `col` (in the padded (b, P + T) batch) and `pos` (in its row); for the R response
    tokens, `src` (the packed position that predicts each: the token before it), `dst_row` and
    `dst_col` (in the (b, T) output); `lengths` (b,) of the rows."""
    N, R = sum(p + r for p, r in spans), sum(r for _, r in spans)
    host = torch.tensor(spans, dtype=torch.long).reshape(-1, 2)                        # (b, 2)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    pr = host.to(device, non_blocking=True)
    p, r = pr[:, 0], pr[:, 1]                                                          # (b,) each
    n = p + r                                                                          # (b,)
    rows = torch.arange(len(spans), device=device)
    row = torch.repeat_interleave(rows, n, output_size=N)                             # (N,)
    pos = torch.arange(N, device=device) - (n.cumsum(0) - n)[row]                      # (N,)
    dst_row = torch.repeat_interleave(rows, r, output_size=R)                         # (R,)
    dst_col = torch.arange(R, device=device) - (r.cumsum(0) - r)[dst_row]              # (R,)
    src = (n.cumsum(0) - n + p - 1)[dst_row] + dst_col                                 # (R,)
    return {"row": row, "col": n_prompt - p[row] + pos, "pos": pos, "src": src,
            "dst_row": dst_row, "dst_col": dst_col, "lengths": n}


def _packed_forward(self, ids, position_ids, packing, src, targets, temperature, with_entropy):
    """The model's decoder on the packed sequence ids (1, N), then the fused head on the hidden
    states at `src` (n_resp,) against `targets` (n_resp,). A method of the model (enable_packing),
    so that FSDP2 gathers the LM head's weight around it."""
    hidden = self.base_model(input_ids=ids, position_ids=position_ids, packing=packing,
                             use_cache=False).last_hidden_state                       # (1, N, h)
    weight = self.get_output_embeddings().weight                                        # (V, h)
    return HeadLogprob.apply(hidden[0, src], weight, targets, getattr(self, HEAD_CHUNK), with_entropy,
                             temperature, getattr(self, HEAD_COMPILED))

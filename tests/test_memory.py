"""The memory model that picks a recomputation (machinery/memory.py, config.decide_grad_checkpointing): its bytes by
hand, the bytes a decoder layer keeps for its backward counted on real eager and compiled layers, and `--recompute
auto` deciding, saying why, and refusing where no mode fits. The modes themselves: tests/test_recompute.py.
"""
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

import config
import policy
import train
from logprobs import enable_packing
from machinery import memory, packed_attention

BF16, FP32 = torch.bfloat16, torch.float32

# --- the memory model ------------------------------------------------------------------------------
def test_memory_model_by_hand_and_auto_picks_the_cheapest_that_fits():
    """h 8, i 16, 2 layers, 4 heads of 2 with 2 key/value heads (h_kv 4), V 10, untied, 100 tokens,
    2 bytes: params 10·8·2 + 2 (4·64 + 3·8·16) = 1440 (16 + 4 + 2 bytes each: 31680); bytes per token and
    layer — none 2 (32 + 16) + 2 (32 + 16 + 64) + 4·4 + 8 = 344, selective 2 (40 + 8 + 32) + 16 =
    176, full 2·8 = 16, compiled 2 (56 + 8 + 48) + 16 + 8 = 248 — so per token none 688, selective 352, full
    2·16 + 344 = 376, compiled 496 and compiled full 2·16 + 248 = 280; the fused head adds 4·10·8 = 320 bytes; 4
    padded rows of 5 positions, 2·20·10·2 + 4·20·10 = 1600. The attention in float32 (a = 4 bytes) keeps its rotated
    q, k, v and output in 4 bytes instead of 2: none 344 + 2 (16 + 8) = 392 per layer, selective (its output only)
    176 + 2·8 = 192, compiled 248 + 2 (16 + 8) = 296. Where no mode fits, auto refuses with every estimate."""
    conf = types.SimpleNamespace(hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=10,
                                 tie_word_embeddings=False)
    want = {"none": 68800 + 31680, "selective": 35200 + 31680, "full": 37600 + 31680}
    for mode, b in want.items():
        assert memory.update_memory(conf, 100, 2, mode) == b
        assert memory.update_memory(conf, 100, 2, mode, fused_head=True) == b + 320
        assert memory.update_memory(conf, 100, 2, mode, logits=(4, 20)) == b + 1600
    assert memory.update_memory(conf, 100, 2, "none", attention_bytes=4) == 78400 + 31680
    assert memory.update_memory(conf, 100, 2, "selective", attention_bytes=4) == 38400 + 31680
    assert memory.update_memory(conf, 100, 2, "none", compiled=True, attention_bytes=4) == 59200 + 31680
    assert memory.update_memory(conf, 100, 2, "none", compiled=True) == 49600 + 31680
    assert memory.update_memory(conf, 100, 2, "full", compiled=True) == 28000 + 31680
    assert memory.recompute_default(conf, 100, 2, 2 * want["none"]) == "none"
    assert memory.recompute_default(conf, 100, 2, 2 * want["none"] - 1) == "selective"
    assert memory.recompute_default(conf, 100, 2, 2 * want["none"] - 1, ("none", "full")) == "full"
    # the head's buffer counts: a budget that fits the update without it does not with it
    assert memory.recompute_default(conf, 100, 2, 2 * want["none"], fused_head=True) == "selective"
    # so do the padded logits: 1600 bytes more than none's budget, selective's fits
    mode, why = memory.choose_recompute(conf, 100, 2, 2 * want["none"], logits=(4, 20))
    assert mode == "selective" and why.startswith("auto: ") and "none ~" in why and "padded logits" in why
    with pytest.raises(ValueError, match=r"--recompute auto: no recomputation fits .* none ~.* selective ~.* full ~"):
        memory.choose_recompute(conf, 100, 2, 2 * want["selective"] - 1)


def test_padded_logits_by_hand():
    """The padded path's head at its peak, by hand: the logits of every response position and one more
    (logits_to_keep t + 1), their gradient while they are held, and a float32 chunk of 64 positions per row.
    Qwen2.5-0.5B's vocabulary (151,936), 64 rows of 512 new tokens, bf16: 2 · 64 · 513 · 151936 · 2 bytes = 18.6 GiB
    and 4 · 64 · 64 · 151936 = 2.3 GiB; rows shorter than the chunk: the chunk is all their positions."""
    assert memory.padded_logits_bytes(151936, 64, 64 * 513, 2) == 2 * 64 * 513 * 151936 * 2 + 4 * 64 * 64 * 151936
    assert round(2 * 64 * 513 * 151936 * 2 / 2**30, 1) == 18.6
    assert memory.padded_logits_bytes(10, 3, 3 * 9, 4, chunk=64) == 2 * 27 * 10 * 4 + 4 * 27 * 10


SHAPE = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
             max_position_embeddings=512)


def kept_per_token(mode, dtype, shape=SHAPE, upcast=False):
    """Bytes one decoder layer keeps for its backward per token, counted on a packed Qwen2-shaped model (grouped-query
    heads, biases; no KV cache, as policy.build_model) over 256 tokens, its bf16 attention computed in float32 where
    `upcast` (packed_attention.float32_attention): the difference between 2 layers and 1. Two counts: the distinct storages that
    saved-tensor hooks see, and the distinct storages of every op's output still alive after the forward (weak
    references). The hooks see all a layer saves without recomputation; inside a checkpointed layer torch's own hooks
    take what is saved, so there what a layer keeps is what stays alive. -> {count: bytes per token}."""
    def saved(layers):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, num_hidden_layers=layers, use_cache=False),
                                                 dtype=dtype)
        model = enable_packing(model, "sdpa-rows").train()
        policy.set_recompute(model, mode)
        packing = packed_attention.make_packing([100, 156], "cpu", "sdpa-rows", upcast=upcast)
        kw = dict(input_ids=torch.randint(0, shape["vocab_size"], (1, 256)), packing=packing,
                  position_ids=torch.cat([torch.arange(100), torch.arange(156)])[None])
        hooked, refs = {}, []

        def keep(t):
            hooked[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        class Outputs(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                refs.extend(weakref.ref(t) for t in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(t, torch.Tensor))
                return out
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), Outputs():
            out = model.model(**kw)
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for r in refs if (t := r()) is not None}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        del out
        return {name: sum(v for k, v in d.items() if k not in weights) for name, d in
                (("hooks", hooked), ("alive", alive))}
    one, two = saved(1), saved(2)
    return {k: (two[k] - one[k]) / 256 for k in one}


@pytest.mark.parametrize("dtype, upcast", [(FP32, False), (BF16, False), (BF16, True)])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_layer_bytes_are_what_a_layer_keeps(mode, dtype, upcast):
    """memory.layer_bytes in each mode against what a real layer keeps, counted (`kept_per_token`), bf16 attention
    in bf16 and in float32 (its a = 4); without recomputation both counts agree, which is what makes the count of
    storages alive a measure of what is kept."""
    kept = kept_per_token(mode, dtype, upcast=upcast)
    a = 4 if upcast else None
    assert kept["alive"] == memory.layer_bytes(Qwen2Config(**SHAPE), dtype.itemsize, mode, a)
    if mode == "none":
        assert kept["hooks"] == kept["alive"]


@pytest.mark.parametrize("dtype, upcast", [(FP32, False), (BF16, True)])
def test_compiled_layer_bytes_are_what_a_compiled_layer_saves(dtype, upcast):
    """memory.layer_bytes(compiled) against the saved-tensor count of a compiled decoder layer (Inductor's partitioner
    chooses what to save, less than the eager layer keeps), float32, and bf16 with its attention in float32, over 256
    packed tokens: the storages its call saves, less its weights and the rotary's cos and sin (computed once for all
    layers). Compiled before the count, which the shapes of test_compiled_layers_*'s grouped-query model let share
    their compilation in float32."""
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                 max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, num_hidden_layers=1), dtype=dtype)
    layer = policy.compile_layers(enable_packing(model, "sdpa-rows").train()).model.layers[0]
    packing = packed_attention.make_packing([100, 156], "cpu", "sdpa-rows", upcast=upcast)
    pos = torch.cat([torch.arange(100), torch.arange(156)])[None]
    x = torch.randn(1, 256, 32, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, pos)
    layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin), packing=packing)  # compiles
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin), packing=packing)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    conf = Qwen2Config(**shape)
    b, a = dtype.itemsize, 4 if upcast else None
    assert sum(v for k, v in saved.items() if k not in skip) / 256 == memory.layer_bytes(conf, b, "compiled", a)
    assert memory.layer_bytes(conf, b, "compiled", a) < memory.layer_bytes(conf, b, "none", a)


def test_auto_recompute_decided_by_memory(group):
    """--recompute auto on the tiny model: none with a CPU's memory (decide_grad_checkpointing)."""
    cfg = train.resolve_config(train.Config())
    decided = train.decide_grad_checkpointing(cfg, torch.device("cpu"), [8] * 4)[0]
    assert decided.recompute == "none" and decided.grad_checkpointing is False
    assert decided.compile_layers is False and decided.compile_head is False  # no measured default on a CPU


def test_auto_refuses_where_nothing_fits_and_a_forced_mode_runs(group, monkeypatch, capsys, tmp_path):
    """Micro-batches of 10^7 rows need terabytes under every mode: --recompute auto refuses in one line naming each
    mode's estimate, and train.py exits 2 with it before any model is built or anything written; --recompute full
    forced is the user's call and goes on, its line saying so."""
    import torch.distributed as dist
    cpu, huge = torch.device("cpu"), dict(micro_batch_size=10**7)
    with pytest.raises(ValueError, match="--recompute auto: no recomputation fits .* full ~"):
        train.decide_grad_checkpointing(train.resolve_config(train.Config(**huge)), cpu, [8] * 4)
    forced = train.resolve_config(train.Config(**huge, recompute="full"))
    cfg, _, _, why = train.decide_grad_checkpointing(forced, cpu, [8] * 4, explain=True)
    assert cfg.recompute == "full" and why.startswith("as given")
    monkeypatch.setattr(train, "init_distributed", lambda: cpu)          # the test's own process group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)     # kept for the module's other tests
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--micro-batch-size", str(10**7), "--out-dir", str(out)])
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert e.value.code == 2 and len(lines) == 1 and "no recomputation fits" in lines[0], lines
    assert not out.exists()


def test_unset_compiled_layers_yield_to_explicit_selective(group, monkeypatch):
    """Where compiled layers are the device's default, an explicit --recompute selective (which they
    cannot combine with) turns the default off instead of failing; an explicit --compile-layers
    with it is refused. The compiled head follows the same table, whatever the recomputation, unless
    --no-compile-head says otherwise."""
    monkeypatch.setitem(config.COMPILE_DEFAULT, "cpu", True)
    cpu = torch.device("cpu")
    sel = train.decide_grad_checkpointing(train.resolve_config(train.Config(recompute="selective")), cpu,
                                          [8] * 4)[0]
    assert sel.recompute == "selective" and sel.compile_layers is False and sel.compile_head is True
    auto = train.decide_grad_checkpointing(train.resolve_config(train.Config()), cpu, [8] * 4)[0]
    assert auto.compile_layers is True and auto.recompute == "none" and auto.compile_head is True
    off = train.decide_grad_checkpointing(train.resolve_config(train.Config(compile_head=False)), cpu, [8] * 4)[0]
    assert off.compile_head is False and train.parse_config(["--no-compile-head"]).compile_head is False
    with pytest.raises(ValueError, match="--compile-layers with --recompute selective"):
        train.resolve_config(train.Config(recompute="selective", compile_layers=True))


def test_largest_micro_batch_by_hand():
    """A Qwen2 of h 64, 2 layers of 4 heads (head 16, 4 KV heads: h_kv 64), i 128, V 256, tied, bf16 (b 2). A compiled
    layer keeps b (7 h + 2 h_kv + 3 i) + 4 heads + 8 = 2 x 960 + 24 = 1944 bytes a token, 3888 for both; the
    parameters 256 x 64 + 2 (4 x 64^2 + 3 x 64 x 128) = 98,304, at 16 + 4 + b = 22 bytes each, and the fused head's
    float32 gradient 4 x 256 x 64 = 65,536: 2,228,224 fixed. Half of free = 2,228,224 + 5000 x 3888 holds 5000
    tokens (4096 in whole 1024s; one byte less, 4999); with full recomputation a token costs 2 x 2 x 64 + 1944 = 2200
    (each layer's input, one compiled layer rerun): 19,440,000 / 2200 = 8836. Not one block: 0."""
    conf = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=128, vocab_size=256, tie_word_embeddings=True)
    free = 2 * (2_228_224 + 5000 * 3888)
    assert memory.largest_micro_batch(conf, 2, free) == 4096
    assert memory.largest_micro_batch(conf, 2, free, multiple=1) == 5000
    assert memory.largest_micro_batch(conf, 2, free - 2, multiple=1) == 4999
    assert memory.largest_micro_batch(conf, 2, free, "full", multiple=1) == 8836
    assert memory.largest_micro_batch(conf, 2, 2 * 2_228_224) == 0 == memory.largest_micro_batch(conf, 2, 0)


def test_unset_micro_batch_tokens_under_compiled_layers_is_the_largest_that_fits(group, monkeypatch):
    """--micro-batch-tokens unset, packed, compiled layers: the tiny model (h 128, 4 layers, h_kv 128, i 256, V 103,
    untied, float32) keeps 4 (7 x 128 + 2 x 128 + 3 x 256) + 24 = 7704 bytes a token per compiled layer, 30,816 for
    four; its 681,728 parameters at 24 bytes and the head's 4 x 103 x 128: 16,414,208 fixed. Half the free memory
    at 16,414,208 + 3000 x 30,816 holds 3000 tokens: a budget of 2048, and no recomputation. At 1000 tokens not one
    block fits: rows of --micro-batch-size as before (64 x 24 tokens, which need full recomputation). Eager layers,
    padded rows or a budget given: as given (0 = off)."""
    monkeypatch.setitem(config.COMPILE_DEFAULT, "cpu", True)
    cpu, fixed, per_token = torch.device("cpu"), 16_414_208, 30_816

    def decided(free, **kw):
        monkeypatch.setattr(config, "free_memory", lambda device: (free, "test"))
        cfg = train.resolve_config(train.Config(pack=True, train_dtype="float32", **kw))
        return train.decide_grad_checkpointing(cfg, cpu, [8] * 4, explain=True)

    cfg, _, _, why = decided(2 * (fixed + 3000 * per_token))
    assert (cfg.micro_batch_tokens, cfg.recompute, cfg.compile_layers) == (2048, "none", True)
    assert "micro-batches of <= 2048 tokens" in why
    cfg = decided(2 * (fixed + 1000 * per_token))[0]
    assert (cfg.micro_batch_tokens, cfg.recompute) == (0, "full")
    big = 2 * (fixed + 3000 * per_token)
    assert decided(big, compile_layers=False)[0].micro_batch_tokens == 0
    assert decided(big, micro_batch_tokens=512)[0].micro_batch_tokens == 512
    assert decided(big, micro_batch_tokens=0)[0].micro_batch_tokens == 0
    monkeypatch.setattr(config, "free_memory", lambda device: (big, "test"))
    padded = train.resolve_config(train.Config(pack=False, train_dtype="float32"))
    assert train.decide_grad_checkpointing(padded, cpu, [8] * 4)[0].micro_batch_tokens == 0

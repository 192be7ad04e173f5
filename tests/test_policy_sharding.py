"""What one rank's FSDP2 keeps gathered after a forward, and what policy.py does about it (gloo, world size 1, the
embedded tiny model): the weights sent to an engine after a no-grad bf16 pass are the fp32 master weights; the
reference model, which never runs a backward, is resharded after its pass; weights written in place after a no-grad
forward reach the master weights (policy.reshard); activation checkpointing changes where memory goes, not the step.
"""
import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import policy
import rollout
import train
from logprobs import RolloutBatch
from test_policy import batch


def test_weights_sent_after_a_no_grad_forward_are_the_fp32_master_weights(group):
    """One rank keeps FSDP2 modules unsharded after a forward (policy.build_model): after a no-grad pass in bf16
    compute the modules' parameters are bf16 copies. What rollout.sync_weights streams must still be the fp32 master
    weights, equal to the model's state dict."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=2, mini_batch_prompts=2, group_size=3,
                       micro_batch_size=6, max_new_tokens=9, train_dtype="bfloat16")
    model = policy.build_model(cfg, torch.device("cpu"))
    ids, attn, mask, P = batch(seed=4)
    policy.batch_logprobs(model, cfg, RolloutBatch(ids, attn, mask, P))
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())  # unsharded: the compute-dtype copies
    sent = dict(rollout._full_parameters(model))
    # after: state_dict() reshards through FSDP2's own hook
    master = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert master.keys() <= sent.keys()
    for name, tensor in sent.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, master[name]), name



@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_reference_model_is_resharded_after_its_pass(group, train_dtype):
    """One rank keeps a module's gathered weights after a forward until a backward reshards it (policy.build_model).
    The reference model runs no backward: after its pass (policy.batch_logprobs) every parameter FSDP2 registers is
    its DTensor shard again, so the gathered copy (4 bytes per parameter in float32, 2 in bf16 compute) is not held
    for the rest of the run; a second pass, which gathers again, repeats its log-probs bit for bit. The trained
    policy's pass keeps its copy, as the update's speed wants."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=2, mini_batch_prompts=2, group_size=3,
                       micro_batch_size=2, max_new_tokens=9, train_dtype=train_dtype, kl_coef=0.001)
    ids, attn, mask, P = batch(seed=6)
    b = RolloutBatch(ids, attn, mask, P)
    policy_model = policy.build_model(cfg, torch.device("cpu"))
    ref_model = policy.build_model(cfg, torch.device("cpu"), trainable=False)
    policy.batch_logprobs(policy_model, cfg, b)
    assert not any(isinstance(p, DTensor) for p in policy_model.parameters())  # gathered, until the backward
    ref_logp, _ = policy.batch_logprobs(ref_model, cfg, b)
    assert all(isinstance(p, DTensor) for p in ref_model.parameters())
    again, _ = policy.batch_logprobs(ref_model, cfg, b)
    assert torch.equal(again * mask, ref_logp * mask)


def test_weights_written_in_place_after_a_no_grad_forward_reach_the_master_weights(group):
    """After a no-grad forward one rank's parameters are the gathered compute copies, which the next reshard drops:
    weights written there would be lost. policy.reshard first makes the parameters the fp32 master shards again, so
    that a write in place reaches them (the state dict) and the next forward, exactly as the same write made before
    any forward."""
    cfg = train.Config(model=rollout.DEFAULT_MODEL, prompts_per_step=2, mini_batch_prompts=2, group_size=3,
                       micro_batch_size=6, max_new_tokens=9, train_dtype="bfloat16")
    ids, attn, mask, P = batch(seed=7)
    b = RolloutBatch(ids, attn, mask, P)
    before = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).state_dict()
    out = []
    for forward_first in (True, False):
        model = policy.build_model(cfg, torch.device("cpu"))
        if forward_first:
            first, _ = policy.batch_logprobs(model, cfg, b)
            policy.reshard(model)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # exact in binary floating point
        logp, _ = policy.batch_logprobs(model, cfg, b)
        out.append(logp * mask)
        for name, w in model.state_dict().items():
            assert torch.equal(w.full_tensor(), before[name] * 0.5), name
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], first * mask)

@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_checkpointing_updates_the_weights_bit_for_bit(group, train_dtype):
    """Activation checkpointing (with which one rank also reshards its weights after each forward, policy.build_model:
    checked) changes where the update's memory goes, not what it computes: two mini-batches of AdamW steps leave the
    same bits in every weight as the update without it, in float32 and in bf16 compute. The recomputed forward runs
    the same kernels on the same inputs, and a re-gathered weight is the same cast of the same fp32 master weight."""
    ids, attn, mask, P = batch(seed=5, B=8, P=7, T=9)
    adv = torch.linspace(-1.0, 1.2, 8)
    weights, old = [], None
    for ckpt in (False, True):
        cfg = train.Config(method="bandkl", model=rollout.DEFAULT_MODEL, prompts_per_step=4, mini_batch_prompts=2,
                           group_size=2, micro_batch_size=2, max_new_tokens=9, lr=1e-3, train_dtype=train_dtype,
                           grad_checkpointing=ckpt)
        torch.manual_seed(0)
        model = policy.build_model(cfg, torch.device("cpu"))
        opt = policy.make_optimizer(model, cfg)
        b = RolloutBatch(ids, attn, mask, P)
        with torch.no_grad():
            logp, _ = policy.batch_logprobs(model, cfg, b)
        old = logp if old is None else old  # the same π_old for both
        # after a forward one rank keeps its layers unsharded (plain tensors) for speed, or reshards them (the
        # parameters FSDP2 registers are DTensors again) where checkpointing says memory is short
        assert isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor) == ckpt
        sums, skipped, _ = policy.update_policy(model, opt, cfg, b, adv, old)
        assert skipped == 0
        weights.append({k: v.full_tensor().clone() for k, v in model.state_dict().items()})
    before = AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).state_dict()
    assert max((weights[0][k] - before[k]).abs().max().item() for k in before) > 1e-4  # the update moved them
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_export_of_a_tied_model_reloads_with_its_trained_weights(group, tmp_path):
    """SmolLM2, like most small chat models, ties lm_head to embed_tokens. checkpoint.export_hf gathers the FSDP2
    shards and writes save_pretrained: transformers reloads the export with the head tied again and every weight the
    trained one, bit for bit, after a step that moved the (tied) embedding. The embedded tiny model, made tied here."""
    from transformers import AutoConfig, AutoTokenizer
    from machinery.checkpoint import export_hf

    src = tmp_path / "tied"
    config = AutoConfig.from_pretrained(rollout.DEFAULT_MODEL)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(src)
    tokenizer = AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)
    tokenizer.save_pretrained(src)
    cfg = train.Config(model=str(src), prompts_per_step=2, mini_batch_prompts=2, group_size=3, micro_batch_size=6,
                       max_new_tokens=9, train_dtype="float32")
    model = policy.build_model(cfg, torch.device("cpu"))
    before = model.state_dict()["model.embed_tokens.weight"].full_tensor().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, attn, _, _ = batch(seed=4)
    model(input_ids=ids, attention_mask=attn).logits.pow(2).mean().backward()
    optimizer.step()
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["model.embed_tokens.weight"], before)
    export_hf(str(tmp_path / "run"), model, tokenizer)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    assert out.lm_head.weight.data_ptr() == out.model.embed_tokens.weight.data_ptr()
    saved = out.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(saved[name], tensor), name

"""The embedded default model (models/tiny-arith, built by make_tiny_model.py) is what the project claims it is.

Claims: one token per character and lossless text (spaces and newlines intact, the Qwen2-tokenizer trap of
docs/setup.md avoided); save/load gives identical logits and text; the recorded held-out accuracy at T = 1 lies in
the 20-50 % band that leaves room for RL, is reproduced by a fresh measurement, and the distribution is
non-degenerate (pass@8 well above mean@8: groups of 8 mix right and wrong answers).
"""

import json
import os
import string
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import rollout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import make_tiny_model  # noqa: E402

TEXT = "Answer: 857\n  x = -12 * 3;\tend\n" + string.ascii_letters + string.digits + string.punctuation + " \n"


@pytest.fixture(scope="module")
def meta():
    with open(os.path.join(rollout.DEFAULT_MODEL, "bandpo.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(rollout.DEFAULT_MODEL, dtype=torch.float32).eval()


def test_one_token_per_character_and_lossless(tokenizer):
    text = TEXT.replace("\t", " ")  # tab is outside the vocabulary (printable ASCII + newline)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids
    assert tokenizer("\t", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_saved_tokenizer_equals_the_built_one(tokenizer):
    built = make_tiny_model.build_tokenizer()
    assert tokenizer(TEXT)["input_ids"] == built(TEXT)["input_ids"]
    assert tokenizer.get_vocab() == built.get_vocab()
    messages = [{"role": "user", "content": "47+38"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><|user|>47+38<|assistant|>"
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "Answer: 85"}], tokenize=False)
    assert full == "<bos><|user|>47+38<|assistant|>Answer: 85<eos>"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 3 + len("47+38")


def test_save_load_round_trip(model, tokenizer, tmp_path):
    """Identical logits and identical decoded text after save_pretrained/from_pretrained."""
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([tokenizer(TEXT, add_special_tokens=False)["input_ids"][:100]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model2(input_ids=ids).logits)
    assert tok2.decode(tok2(TEXT.replace("\t", " "))["input_ids"]) == TEXT.replace("\t", " ")
    assert tok2.chat_template == tokenizer.chat_template
    assert model2.config.eos_token_id == tok2.eos_token_id


def test_metadata_names_the_task_and_an_accuracy_with_room_for_rl(meta):
    assert set(meta["levels"]) <= set(data.LEVELS)
    assert meta["task"] == "arithmetic:" + ",".join(map(str, meta["levels"]))
    acc = meta["heldout_accuracy"]
    assert 0.2 <= acc["t1_mean@8"] <= 0.5
    assert acc["t1_pass@8"] >= acc["t1_mean@8"] + 0.2  # non-degenerate: 8 samples often disagree


def test_heldout_accuracy_reproduces(model, tokenizer, meta):
    """A fresh T = 1 measurement on other held-out problems agrees with the recorded one (~3 standard errors)."""
    records = data.arithmetic(250, split="test", levels=tuple(meta["levels"]), seed=123)
    acc = make_tiny_model.heldout_eval(model, tokenizer, records, n=4, temperature=1.0, seed=0)
    assert abs(acc["mean"] - meta["heldout_accuracy"]["t1_mean@8"]) <= 0.08
    assert acc["pass"] > acc["mean"]


def test_build_script_smoke(tmp_path):
    """make_tiny_model's pieces run end to end in a few steps and produce a loadable model."""
    torch.manual_seed(0)
    tok = make_tiny_model.build_tokenizer()
    m = make_tiny_model.build_model(tok)
    records = data.arithmetic(8, split="test", levels=(1,), seed=0)
    steps = make_tiny_model.train(m, tok, levels=(1,), max_steps=4, batch_size=8, lr=1e-3, target=1.0,
                                  eval_every=4, eval_records=records, seed=0, log=lambda s: None)
    assert steps == 4
    m.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size == len(tok)

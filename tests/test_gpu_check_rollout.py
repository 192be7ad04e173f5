"""The rollout section's roofline (scripts/gpu_check_rollout.py, docs/gpu.md), against numbers worked by hand: the
floor of a decode is the prefill at peak plus, step by step, the larger of the bytes read at HBM bandwidth and the
FLOPs at peak; and the parameter count whose bytes it reads is Qwen2.5-1.5B's, from its config's shapes.
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check_rollout import decode_roofline  # noqa: E402
from gpu_common import QWEN25_1_5B  # noqa: E402

TOY = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)  # head_dim 4


def test_decode_floor_by_hand():
    """1 prompt x 2 samples, P = 3, G = 2, N = 1000, at 1 FLOP/s. KV bytes per token 2 x 2 layers x 1 head x 4 x 2
    bytes = 32. Step c = 3: reads 2000 + 2 x 3 x 32 = 2192 B, computes 2 x 1000 x 2 + 4 x 2 x 3 x 2 x 2 x 4 = 4384
    FLOPs; c = 4: 2256 B, 4512 FLOPs. Prefill 2 x 1000 x 3 = 6000 FLOPs. At 1 B/s the steps are compute-bound:
    6000 + 4384 + 4512 = 14896 s; at 0.25 B/s memory-bound: 6000 + 8768 + 9024 = 23792 s."""
    fast = decode_roofline(TOY, 1000, 1, 2, 3, 2, peak_tflops=1e-12, hbm=1e-12)
    assert fast["kv_bytes_per_token"] == 32 and fast["sequences"] == 2
    assert fast["prefill_s"] == 6000 and fast["floor_s"] == 14896 and fast["memory_bound_steps"] == 0
    slow = decode_roofline(TOY, 1000, 1, 2, 3, 2, peak_tflops=1e-12, hbm=0.25e-12)
    assert slow["floor_s"] == 23792 and slow["memory_bound_steps"] == 2
    assert decode_roofline(TOY, 1000, 1, 2, 3, 2, peak_tflops=None, hbm=1.0)["floor_s"] is None  # no guess


def test_the_weights_read_per_step_are_qwen25_1_5b():
    """The section's model (random weights, Qwen2.5-1.5B's config) has the parameters the config's shapes give:
    per layer q, o (h x h, q's bias h), k, v (h x 128 and their biases: 2 kv heads of 128), the MLP (3 h x 8960),
    two norms; the tied embedding (151936 x h) once; the final norm: 1,543,714,304."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    h, kv, L = 1536, 2 * 128, 28
    by_hand = L * (2 * h * h + h + 2 * (h * kv + kv) + 3 * h * 8960 + 2 * h) + 151936 * h + h
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_1_5B))
    model.tie_weights()
    assert by_hand == 1_543_714_304 == sum(p.numel() for p in model.parameters())

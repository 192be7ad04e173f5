"""machinery/flops.py and train.py's speed on the console: the update's model FLOPs of a tiny shape by hand, MFU by
hand against a named card's dense bf16 peak, no MFU (never a guess) for a card not in the table, a MIG slice or a
CPU, and a console line that shows tokens/s always and MFU only where it is known. That a real run writes
tokens_per_s and no mfu on a CPU: tests/test_train.py::test_python_train_py_one_process_bf16.
"""
from types import SimpleNamespace

import pytest
import torch

from machinery.flops import bf16_peak_tflops, device_peak_tflops, mfu, model_flops


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_by_hand(tied):
    """h = 4, V = 10, L = 2 layers of 2 heads of size 2 (d = 4), 100 parameters; rows (p, r) = (2, 3) and (1, 1), so
    S = 5 and 2. Tied: the decoder body is 100 - 40 = 60 parameters, per row 2·60·S + 2·4·10·r + 2·2·S²·4 =
    600 + 240 + 400 = 1240 and 240 + 80 + 64 = 384, times 3 (forward + backward) = 4872. Untied, the input embedding
    is a lookup: body 100 - 80 = 20, 200 + 240 + 400 = 840 and 80 + 80 + 64 = 224, times 3 = 3192."""
    conf = SimpleNamespace(hidden_size=4, vocab_size=10, num_hidden_layers=2, num_attention_heads=2,
                           tie_word_embeddings=tied)
    flops, formula = model_flops(conf, 100, torch.tensor([2, 1]), torch.tensor([3, 1]))
    assert flops == (4872 if tied else 3192)
    assert ("tied" if tied else "untied") in formula
    assert model_flops(conf, 100, (2, 1), (3, 1))[0] == flops  # train.py passes the spans' tuples


def test_mfu_by_hand_and_none_where_the_peak_is_unknown():
    """An H100 SXM reports "NVIDIA H100 80GB HBM3": 989 TFLOP/s dense bf16. 494.5 TFLOPs in 2 s is 247.25 TFLOP/s,
    a quarter of the peak. A name not in the table (a MIG slice of that card, an H800) and a CPU get None."""
    peak = bf16_peak_tflops("NVIDIA H100 80GB HBM3")
    assert peak == 989
    assert mfu(494.5e12, 2.0, peak) == 0.25
    assert mfu(494.5e12, 2.0, 989 * 8) == 0.0312  # eight cards: train.py passes the peak times the world size
    for name in ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H800", ""):
        assert bf16_peak_tflops(name) is None and mfu(1e12, 1.0, bf16_peak_tflops(name)) is None, name
    assert device_peak_tflops("cpu") is None


def test_bf16_peaks_by_device_name():
    """MFU's denominator from torch.cuda.get_device_name(): the names the cards report, each to its dense bf16 peak;
    a name not in the table (a MIG slice, an H800, a GH200, an L40S, a CPU) gets none, so MFU reads unknown."""
    known = {"NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835, "NVIDIA H200": 989,
             "NVIDIA H200 NVL": 835, "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-SXM4-40GB": 312,
             "NVIDIA A100-PCIE-40GB": 312, "NVIDIA A100 80GB PCIe": 312}
    for name, peak in known.items():
        assert bf16_peak_tflops(name) == peak, name
    for name in ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA L40S",
                 "NVIDIA H200 PCIe", "NVIDIA A10", "CPU", ""):
        assert bf16_peak_tflops(name) is None, name


def test_console_line_shows_tokens_per_s_always_and_mfu_only_when_given():
    """One line per step: tokens/s on every line; MFU (a percentage) only where metrics hold `mfu` (CUDA, a card in
    the table), never a placeholder."""
    import train

    cfg = train.Config(eval_n=4)
    m = {"step": 3, "reward/mean": 0.5, "entropy": 0.25, "clip/frac": 0.0, "clip/frac_upper": 0.0,
         "clip/low_p_upper_rate": 0.0, "tokens_per_s": 1234.4, "time/step": 2.0}
    line = train.console_line(m, cfg)
    assert "| 1234 tok/s |" in line and "MFU" not in line and line.endswith("| 2.0 s"), line
    line = train.console_line({**m, "mfu": 0.3021}, cfg)
    assert "| 1234 tok/s | MFU 30.2% | 2.0 s" in line, line

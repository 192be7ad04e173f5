"""machinery/precision.py's guard on the CPU's float math. PyTorch's CPU wheels (2.10-2.13) bundle oneMKL 2024.2, whose vector
math library (VML) picks each function's kernel on its first call; when that first call runs on several threads at
once, one thread can run a low-accuracy kernel for its share (pytorch/pytorch#188792). Importing precision calls
each VML-backed op once on one thread first (`precision.warm_up_vml`).

Claims checked: precision.VML_OPS are the ops ATen sends to VML (its header's list); in fresh processes with 2 threads
that import precision, the first cos, sin, exp and log over 3,840 float32 values (a rotary embedding's shape) are
accurate to a few ulp against float64 (slow). Without the import, the first VML call of 20 of 336 fresh processes here
erred by up to 1.5e-4 (~2,500 ulp) on one thread's half of the tensor, about 0.06 per process
(experiments/results/laptop/vml-race.txt, probes a, b and g); a later call never did.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from machinery import precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one fresh process: import precision (as every entry point of the project does, through rollout.py or config.py),
# then the *first* multithreaded call of each op, against float64 (not rounded). The bound: VML's high-accuracy mode
# and ATen's own kernels are within 1 ulp; 4 ulp of float32 at |f(x)| leaves room, and the low-accuracy kernel errs
# by hundreds to thousands of ulp.
PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from machinery import precision  # noqa: F401
import torch
torch.set_num_threads(2)
x = torch.linspace(0.01, 3.0, 3840).reshape(8, 15, 32)  # 3,840 > ATen's grain of 2,048: two threads' shares
worst = {}
for op in ("cos", "sin", "exp", "log"):
    y = getattr(torch, op)(x)  # the first call of op in this process
    ref = getattr(torch, op)(x.double())
    ulp = (torch.nextafter(ref.abs().float(), torch.tensor(float("inf"))) - ref.abs().float()).double()
    worst[op] = ((y.double() - ref).abs() / ulp).max().item()
print(worst)
"""


def test_vml_ops_are_atens_vml_ops():
    """The ops warmed up are those torch's ATen/cpu/vml.h sends to oneMKL (its IMPLEMENT_VML_MKL lines, commented-out
    ones excluded), read from the installed torch's headers."""
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "cpu", "vml.h")
    if not os.path.exists(header):
        pytest.skip("this torch ships no C++ headers")
    text = open(header).read()
    ops = set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+), \w+\)", text, re.M))
    assert ops == set(precision.VML_OPS)


@pytest.mark.slow
def test_first_multithreaded_vml_calls_are_accurate_after_import():
    """48 fresh processes, one at a time: each one's first cos, sin, exp and log within 4 ulp. Without the warm-up a
    process's first VML call erred with probability ~0.06 here, so 48 processes would all pass with probability
    ~0.94^48 = 5%."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    results = []
    for _ in range(48):
        r = subprocess.run([sys.executable, "-c", PROBE, ROOT], capture_output=True, text=True, env=env,
                           timeout=600)  # a hang guard
        assert r.returncode == 0, r.stderr[-2000:]
        results.append(eval(r.stdout.strip().splitlines()[-1]))
    worst = {op: max(r[op] for r in results) for op in results[0]}
    assert all(v <= 4 for v in worst.values()), worst

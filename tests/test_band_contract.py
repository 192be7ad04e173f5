"""band.py's contract, beside the paper's claims (test_band.py): shapes, dtypes and devices kept, half precision
computed in float32, bad input refused with the value named, the solver captured whole by torch.compile and by a CUDA
graph, and the same numbers on CUDA as on the CPU (the `gpu` tests skip without CUDA).
"""
import math

import pytest
import torch

import band
from test_band import one_thread  # noqa: F401  (autouse fixture: one torch thread per test)

F64, F32 = torch.float64, torch.float32


def test_band_keeps_shape_dtype_device_and_has_no_gradient():
    logp = (-torch.rand(3, 4, 5, dtype=F64) * 10).requires_grad_()
    for name in band.DIVERGENCES:
        lower, upper = band.band(logp.transpose(0, 2), name, 0.05)  # non-contiguous input
        assert lower.shape == upper.shape == (5, 4, 3) and lower.dtype == upper.dtype == F64
        assert not lower.requires_grad and not upper.requires_grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_band_half_precision_is_computed_in_float32(dtype):
    """float16 / bfloat16 inputs: the float32 result rounded to the input dtype."""
    logp = torch.linspace(-12, 0, 97).to(dtype)
    for name in band.DIVERGENCES:
        lower, upper = band.band(logp, name, 0.05)
        want_lo, want_up = band.band(logp.float(), name, 0.05)
        assert lower.dtype == upper.dtype == dtype
        assert torch.equal(lower, want_lo.to(dtype)) and torch.equal(upper, want_up.to(dtype))


def test_band_bad_input():
    """delta <= 0 / NaN / inf / non-number -> ValueError naming it; unknown method -> ValueError listing the valid
    ones; log p slightly above 0 counts as 0; -inf gives (0, inf); NaN gives NaN without raising."""
    logp = torch.tensor([-1.0])
    for bad in (0, -0.1, math.nan, math.inf, -math.inf, "0.05", None, True):
        with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(")", r"\)")):
            band.band(logp, "bandkl", bad)
    with pytest.raises(ValueError, match="bandchi2, bandhellinger, bandkl, bandtv"):
        band.band(logp, "kl", 0.05)
    with pytest.raises(TypeError):
        band.band(torch.tensor([-1, -2]), "bandkl", 0.05)
    for name in band.DIVERGENCES:
        for dtype in (torch.float16, torch.bfloat16, F32, F64):
            x = torch.tensor([1e-4, 0.0, -math.inf, math.nan], dtype=dtype)
            lower, upper = band.band(x, name, 0.05)
            assert lower[0] == lower[1] and upper[0] == upper[1] == 1
            assert lower[2] == 0 and upper[2] == math.inf
            assert lower[3].isnan() and upper[3].isnan()


def test_solver_compiles_without_graph_breaks():
    """No .item(), no data-dependent Python branch: torch.compile(fullgraph=True) captures ratio_bounds with the
    KL solver inside in one graph (dynamo only: backend="eager" checks capture without code generation)."""
    torch._dynamo.reset()
    compiled = torch.compile(band.ratio_bounds, fullgraph=True, backend="eager", dynamic=False)
    logp = -torch.rand(64, dtype=F32) * 30
    got, want = compiled(logp, "bandkl-relax"), band.ratio_bounds(logp, "bandkl-relax")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- CUDA -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, F32, F64])
def test_cuda_matches_cpu(dtype):
    """The same numbers on CUDA as on the CPU, up to the rounding each side is allowed. Both run band.py's operations
    in the same order and differ only in the last bits of exp, expm1, log, log1p and sqrt, so each is within its
    rounding bound of the exact interval: |got - exact| / max(exact, 1) <= TOL_U u (absolute below 1, relative
    above; TV and χ² 8 u, KL 64 u, derived in tests/test_gpu_check.py; Hellinger's generic path, bisection to the
    dtype's spacing then one Newton step as in KL's solver, is held to KL's 64 u: it measured 7 u on a CPU), and the
    two sides within twice that of each other (a lower bound of 5.6e-3 on an H200: 1 u apart, 179 u relative).
    float16 and bfloat16 are computed in float32 and rounded: two such values may round to neighbours, one spacing,
    2 u of the half dtype, apart."""
    from test_gpu_check import TOL_U

    logp = torch.cat([-torch.rand(10_000, dtype=F64) * 60, torch.tensor([0.0, -1e-12, -math.inf, 1e-5])]).to(dtype)
    work = dtype if dtype in (F32, F64) else F32
    half = 0.0 if dtype in (F32, F64) else torch.finfo(dtype).eps  # one spacing: 2 u
    for name in band.DIVERGENCES:
        tol = 2 * TOL_U.get(name, TOL_U["bandkl"]) * torch.finfo(work).eps / 2 + half
        for got, want in zip(band.band(logp.cuda(), name, 0.05), band.band(logp, name, 0.05)):
            got, want = got.cpu().double(), want.double()
            err = torch.where(got == want, 0.0, (got - want).abs() / want.abs().clamp_min(1.0))  # (n,)
            assert err.max() <= tol, (name, err.max().item() / tol, err.argmax().item())


@pytest.mark.gpu
def test_cuda_graph_capture_no_host_sync():
    """The solver captures into a CUDA graph (which forbids host synchronisation) and replays correctly."""
    logp = -torch.rand(1 << 16, device="cuda") * 30
    band.band(logp, "bandkl", 0.05)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lower, upper = band.band(logp, "bandkl", 0.05)
    logp.copy_(-torch.rand_like(logp) * 10)
    graph.replay()
    want = band.band(logp, "bandkl", 0.05)
    assert torch.equal(lower, want[0]) and torch.equal(upper, want[1])

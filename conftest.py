"""pytest set-up for tests/ and derivations/: this file's folder (the repository root) goes on sys.path, which makes
band.py, grpo.py, ... importable; `gpu` tests are skipped without CUDA. precision is imported first: its oneMKL
warm-up must run before any test's first multithreaded float math (machinery/precision.py says why)."""
import pytest

from machinery import precision  # noqa: F401


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

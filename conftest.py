"""pytest set-up for tests/ and derivations/: this file's folder (the repository root) goes on sys.path, which makes
band.py, grpo.py, ... importable; `gpu` tests are skipped without CUDA; `group` is the one-process gloo group of the
tests that build FSDP2 models in this process. precision is imported first: its oneMKL warm-up must run before any
test's first multithreaded float math (machinery/precision.py says why)."""
import os
import socket

import pytest

from machinery import precision  # noqa: F401

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group (world size 1) for a test module that builds FSDP2 models in this process, on a free
    port; afterwards the rendezvous variables are as they were, so a later subprocess picks its own port."""
    import torch.distributed as dist

    before = {k: os.environ.get(k) for k in RENDEZVOUS}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Fixtures for the kernel tests: the Triton interpreter on CPU, the device, seeded generators.

NOTE: TRITON_INTERPRET is read when a kernel is decorated, i.e. when its module is
first imported; the kernel modules are imported lazily by the dispatcher, so
setting it here (before any test imports them) is early enough. On a CUDA
machine the real compiler is used unless the caller sets TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip the Triton tests where neither a GPU nor the interpreter can run them."""
    try:
        import triton  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="triton is not installed")
        for item in items:
            if "triton" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (GPU or TRITON_INTERPRET=1)")

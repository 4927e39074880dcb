"""Shared fixtures: the real model and real SGLang servers (one per session and kind).

Servers are started lazily, once per test session, on free loopback ports, and
always stopped at the end of the session.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

# NOTE: Triton reads TRITON_INTERPRET when it is first imported, and importing
# SGLang (admin, frontend tests) imports Triton. Without a GPU the kernel tests
# need the interpreter, so it is set here, before any test module loads.
# Servers started by the tests never see it (ServerProcess drops it).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from sglang_kvshare.server_process import ServerProcess


@pytest.fixture(scope="session")
def model_path() -> str:
    from sglang_kvshare.models import prepare

    return str(prepare("smollm2-135m"))


@pytest.fixture(scope="session")
def server_pool(model_path) -> Iterator[Callable[..., ServerProcess]]:
    """``get(name, **kwargs)`` returns a running server, started on first use.

    Two servers at once would fight over this machine's 2 cores, so starting
    a new kind stops the previously running one unless ``keep=True``.
    """
    running: dict[str, ServerProcess] = {}

    def get(name: str, *, kvshare_args=(), extra_args=(), stock: bool = False) -> ServerProcess:
        if name in running and running[name].proc.poll() is None:
            return running[name]
        for other in list(running):
            running.pop(other).stop()
        server = ServerProcess(model_path=model_path, kvshare_args=tuple(kvshare_args),
                               extra_args=tuple(extra_args), stock=stock)
        server.start()
        running[name] = server
        return server

    try:
        yield get
    finally:
        for server in running.values():
            server.stop()


@pytest.fixture
def seed() -> int:
    import torch

    torch.manual_seed(0)
    return 0


def pytest_configure(config) -> None:
    # Tests share 2 cores with the servers they start.
    os.environ.setdefault("OMP_NUM_THREADS", "2")

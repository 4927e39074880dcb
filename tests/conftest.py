"""Shared fixtures: the real model and real SGLang servers (one per session and kind).

Servers are started lazily, once per test session, on free loopback ports, and
always stopped at the end of the session.
"""

from __future__ import annotations

import os
from collections import OrderedDict
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


# Idle servers sleep (the launcher's --sleep-on-idle) and cost only memory, about 2 GiB each.
MAX_ALIVE_SERVERS = 3


@pytest.fixture(scope="session")
def server_pool(model_path) -> Iterator[Callable[..., ServerProcess]]:
    """``get(name, **kwargs)`` returns a running server, started on first use.

    Servers are keyed by their arguments, not by ``name`` (a label for the log):
    every test that asks for the same arguments shares one server, so tests must
    not assume a server fresh (``tests.servers.clean`` empties its caches). The
    last ``MAX_ALIVE_SERVERS`` servers used stay up; an idle one costs no CPU.
    """
    running: OrderedDict[tuple, ServerProcess] = OrderedDict()

    def get(name: str, *, kvshare_args=(), extra_args=(), stock: bool = False) -> ServerProcess:
        key = (tuple(kvshare_args), tuple(extra_args), stock)
        server = running.get(key)
        if server is not None and server.proc.poll() is None:
            running.move_to_end(key)
            return server
        running.pop(key, None)
        while len(running) >= MAX_ALIVE_SERVERS:
            running.popitem(last=False)[1].stop()
        server = ServerProcess(model_path=model_path, kvshare_args=key[0], extra_args=key[1], stock=stock)
        server.start()
        running[key] = server
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

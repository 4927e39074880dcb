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

from devtools.server_process import ServerProcess


@pytest.fixture(scope="session")
def model_path() -> str:
    from devtools.models import prepare

    return str(prepare("smollm2-135m"))


# Idle servers sleep (the launcher's --sleep-on-idle) and cost only memory, about 2 GiB each.
# Every server the suite asks for (shared, off, stock, the soak's, the adversary's, the plain launch's and the
# tensor-parallel one until its module ends) stays up, so none restarts.
MAX_ALIVE_SERVERS = 7


@pytest.fixture(scope="session")
def server_pool(model_path) -> Iterator[Callable[..., ServerProcess]]:
    """``get(name, **kwargs)`` returns a running server, started on first use.

    ``get.launch(name, **kwargs)`` starts one without waiting for it (the next
    ``get`` of those arguments waits until it answers); ``get.defer(name, **kwargs)``
    launches one later, once every running server answers (``get.start_deferred``,
    called before each test).

    Servers are keyed by their arguments, not by ``name`` (a label for the log):
    every test that asks for the same arguments shares one server, so tests must
    not assume a server fresh (``tests.servers.clean`` empties its caches). The
    last ``MAX_ALIVE_SERVERS`` servers used stay up; an idle one costs no CPU.
    """
    running: OrderedDict[tuple, ServerProcess] = OrderedDict()
    deferred: list[tuple[str, dict]] = []

    def launch(name: str, *, kvshare_args=(), extra_args=(), stock: bool = False,
               fault_injection: bool = False, startup_timeout: float = 300.0) -> tuple:
        key = (tuple(kvshare_args), tuple(extra_args), stock, fault_injection)
        server = running.get(key)
        if server is not None and server.proc.poll() is None:
            return key
        running.pop(key, None)
        while len(running) >= MAX_ALIVE_SERVERS:
            running.popitem(last=False)[1].stop()
        running[key] = ServerProcess(model_path=model_path, kvshare_args=key[0], extra_args=key[1], stock=stock,
                                     fault_injection=fault_injection, startup_timeout=startup_timeout).launch()
        return key

    def get(name: str, *, kvshare_args=(), extra_args=(), stock: bool = False,
            fault_injection: bool = False, startup_timeout: float = 300.0) -> ServerProcess:
        key = launch(name, kvshare_args=kvshare_args, extra_args=extra_args, stock=stock,
                     fault_injection=fault_injection, startup_timeout=startup_timeout)
        server = running[key]
        running.move_to_end(key)
        server.wait_ready()  # at once when it has answered before
        return server

    def release(name: str, *, kvshare_args=(), extra_args=(), stock: bool = False,
                fault_injection: bool = False, **_launch) -> None:
        """Stop the server of these arguments now (one whose ranks would slow the tests after its module)."""
        server = running.pop((tuple(kvshare_args), tuple(extra_args), stock, fault_injection), None)
        if server is not None:
            server.stop()

    def defer(name: str, **kwargs) -> None:
        """Start this server once every running one answers (``start_deferred``)."""
        deferred.append((name, kwargs))

    def start_deferred() -> None:
        if deferred and all(_answers(server) for server in running.values()):
            for name, kwargs in deferred:
                launch(name, **kwargs)
            deferred.clear()

    def stop_all() -> None:
        """Stop every running server (none of the tests left needs one) and drop those not yet launched."""
        for server in running.values():
            server.terminate()
        for server in running.values():
            server.stop()
        running.clear()
        deferred.clear()

    get.launch, get.defer, get.start_deferred, get.release, get.stop_all = launch, defer, start_deferred, release, \
        stop_all
    try:
        yield get
    finally:
        stop_all()


def _answers(server: ServerProcess) -> bool:
    """Whether ``server`` is up, without waiting for it."""
    import requests

    if server.ready:
        return True
    try:
        return requests.get(server.url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


@pytest.fixture(scope="session", autouse=True)
def _launch_common_servers_together(request, tmp_path_factory) -> Callable[[], None]:
    """When the run spans many server modules, launch their servers at once, up front.

    A server start is mostly single-threaded imports (about 45 s here alone).
    The tests that need no server run first (``pytest_collection_modifyitems``;
    mostly single-threaded too: the Triton interpreter, the cache's unit tests)
    and fill the cores while the four servers start: the three common ones and
    the soak's, whose start otherwise ran alone in the eviction test with one
    core idle. Before that order, three at once paid (the first server test
    waited about 81 s, not 135 s) and five did not (154 s). The adversary's
    server starts once those four answer, while the tests that need no server
    still run, so its start costs its module nothing; so do the plain launch's and the
    tensor-parallel one's (``tests.servers.DEFERRED_MODULE_SERVERS``), whose starts
    then overlap the first server tests instead of waiting alone. A run of one or two server
    modules starts its servers lazily. Returns what each test calls first: the
    deferred start, when it is due.
    """
    modules = {item.module.__name__ for item in request.session.items
               if "server_pool" in getattr(item, "fixturenames", ()) and getattr(item, "module", None)}
    if len(modules) < 3:
        return lambda: None
    from tests.servers import DEFERRED_MODULE_SERVERS, OFF, SHARED_LAUNCH, adversary_launch, soak_pool

    server_pool = request.getfixturevalue("server_pool")
    server_pool.launch("shared", **SHARED_LAUNCH)
    server_pool.launch("off", kvshare_args=OFF)
    server_pool.launch("stock", stock=True)
    server_pool.launch("soak", **soak_pool())
    if "tests.test_adversary" in modules:
        server_pool.defer("adversary", **adversary_launch(tmp_path_factory.getbasetemp()))
    for module, name, launch in DEFERRED_MODULE_SERVERS:
        if module in modules:
            server_pool.defer(name, **launch)
    return server_pool.start_deferred


@pytest.fixture(autouse=True)
def _start_deferred_servers(request, _launch_common_servers_together) -> None:
    if _runs_its_own_servers(request.node):
        # Sorted last (``pytest_collection_modifyitems``): no test after it needs the pool's servers, and its own
        # start (the DP workers, a restart) then has the cores and the memory to itself.
        request.getfixturevalue("server_pool").stop_all()
        return
    _launch_common_servers_together()


def _runs_its_own_servers(item) -> bool:
    """A server test that starts its own servers rather than borrowing the pool's."""
    return item.get_closest_marker("server") is not None and "server_pool" not in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that need no server first, in their usual order, then the tests of the pool's servers in theirs, then
    the server tests that start servers of their own.

    Why: the common servers start up front and take about 85 s of mostly
    single-threaded imports, during which the first server test can only wait.
    The tests that need no server (kernels under the Triton interpreter, the
    cache's unit tests on fake pools, about 60 s alone) fill that wait instead.
    A server of a test's own (two DP workers, a restart with saved pools) started
    in that wait as well made it 14 processes importing on 2 cores, with every
    pool server in memory beside them: it started last, or not within its timeout.
    Last, the pool's servers are stopped first (``_start_deferred_servers``).
    Module-scoped server fixtures stay contiguous: the sort is stable.
    """
    for item in items:  # every test that starts or borrows a server carries the marker: -m "not server" skips it
        if "server_pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)
    items.sort(key=lambda item: 2 if _runs_its_own_servers(item) else
               int("server_pool" in getattr(item, "fixturenames", ())))


@pytest.fixture
def seed() -> int:
    import torch

    torch.manual_seed(0)
    return 0


def pytest_configure(config) -> None:
    # Tests share 2 cores with the servers they start.
    os.environ.setdefault("OMP_NUM_THREADS", "2")

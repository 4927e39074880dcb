"""SGLang's router (``sglang-router``) in front of running servers, for tests and benchmarks.

Why a helper: the scale-out recipe across servers (docs/SCALING.md) is the
router with ``--policy manual``, which pins each ``X-SMG-Routing-Key`` to one
server; the live test and the scale-out benchmark start it the same way.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import requests

from devtools.server_process import ServerProcess, ServerStartError, _die_with_parent, free_port, log_tail, stop_group


@dataclass
class RouterProcess:
    """A router over ``worker_urls``; use as a context manager so it is always stopped."""

    worker_urls: Sequence[str]
    policy: str = "manual"
    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    startup_timeout: float = 120.0
    log_path: Optional[Path] = None
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.worker_urls, "--policy", self.policy, "--log-level", "warn",
                *self.extra_args]

    def start(self) -> "RouterProcess":
        """Launch and wait until the router answers and knows every worker."""
        fd, name = tempfile.mkstemp(prefix="kvshare-router-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/readiness", timeout=10).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"router not ready after {self.startup_timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        stop_group(self.proc)

    def __enter__(self) -> "RouterProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def fleet(model_path: str, kvshare_args: Sequence[str], extra_args: Sequence[str] = (),
          servers: int = 2) -> Iterator[tuple[RouterProcess, list[ServerProcess]]]:
    """``servers`` kvshare servers started side by side (on a CPU machine one core each, as ``--dp-size``
    gives each rank) and the router (``--policy manual``) in front; all stopped on exit."""
    cores = os.cpu_count() or 1
    procs = [ServerProcess(model_path=model_path, kvshare_args=kvshare_args, extra_args=extra_args,
                           cores=str(i % cores) if cores >= servers else None) for i in range(servers)]
    try:
        for server in procs:
            server.launch()
        for server in procs:
            server.wait_ready()
        with RouterProcess([s.url for s in procs]) as router:
            yield router, procs
    finally:
        for server in procs:
            server.terminate()
        for server in procs:
            server.stop()

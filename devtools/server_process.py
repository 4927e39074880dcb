"""Start, wait for and stop a real SGLang server in a subprocess.

Why here and not in tests: the demo, the tests and every benchmark need the
same thing (a server on a free loopback port, with kvshare on or off, or
stock SGLang for comparison), and all of them must always shut it down.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import requests


# Ports for servers and routers come from below the kernel's ephemeral range: bind(0) and every outgoing
# connection take ports from that range, so one picked there can be taken (by another server's sockets) in the
# seconds before the server binds it. SGLang picks its own late-bound ports from 22000 up; stay under that too.
_PORT_LOW, _PORT_HIGH = 12000, 21999
_BIND_RACE_RETRIES = 2  # relaunches, on a fresh port, of a server whose port was taken before it bound


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, outside the range the kernel hands out on its own where it can."""
    high = min(_PORT_HIGH, _ephemeral_low() - 1)
    candidates = random.sample(range(_PORT_LOW, high + 1), 64) if high - _PORT_LOW >= 64 else []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the process that started it dies.

    Why: a test or benchmark killed by ``timeout`` (SIGTERM) never runs its
    ``finally: server.stop()``, and an orphaned SGLang server spins a core at
    100 % in its idle event loop. Linux only; elsewhere a no-op.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def log_tail(path: Optional[Path], n: int) -> str:
    """The last ``n`` lines of a process's log ("" before it has one)."""
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def stop_group(proc: Optional[subprocess.Popen]) -> None:
    """SIGTERM a process started with ``start_new_session`` and its whole group; SIGKILL after 30 s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


class ServerStartError(RuntimeError):
    """The server exited or did not answer in time; the message holds its log tail."""


@dataclass
class ServerProcess:
    """A running server; use as a context manager so it is always stopped.

    ``stock=True`` runs ``python -m sglang.launch_server`` with SGLang's default
    cache (and the same CPU defaults), the reference every comparison needs.
    """

    model_path: str
    kvshare_args: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    stock: bool = False
    port: int = field(default_factory=free_port)
    startup_timeout: float = 300.0
    log_path: Optional[Path] = None
    wrapper: Sequence[str] = ()  # a command prefix, e.g. a profiler: ``py-spy record ... --``
    cores: Optional[str] = None  # CPU only: the cores its one rank binds to ("1", "0-3"), for servers side by side
    fault_injection: bool = False  # tests only: assembled KV of ``fault:`` slots is noise (devtools.fault_injection)
    proc: Optional[subprocess.Popen] = None
    ready: bool = field(default=False, init=False)  # seen answering since the last launch

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        from sglang_kvshare.server.launcher import gpu_visible, with_defaults

        base = ["--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(self.port),
                *self.extra_args]
        if self.stock:
            # SGLang's own launcher and default cache, with the same CPU defaults as ours.
            argv = with_defaults(base, cpu=not gpu_visible(), select_backend=False)
            return [*self.wrapper, sys.executable, "-m", "sglang.launch_server", *argv]
        entry = "devtools.fault_injection" if self.fault_injection else "sglang_kvshare.launch_server"
        return [*self.wrapper, sys.executable, "-m", entry, *base, *self.kvshare_args]

    def start(self) -> "ServerProcess":
        """Launch and wait until the server answers ``/health_generate``."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> "ServerProcess":
        """Start the process without waiting for it (``wait_ready`` later).

        Call it from the thread that will outlive the server: the child gets
        SIGTERM when the *thread* that started it exits (``PR_SET_PDEATHSIG``
        follows the parent thread, not the process).
        """
        from sglang_kvshare.server.launcher import cpu_thread_env, gpu_visible, parallel_ranks

        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvshare-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # a test session's interpreter flag must not reach the server
        if not gpu_visible():
            ranks = parallel_ranks(self.extra_args)
            threads = cpu_thread_env(ranks)
            env = {**threads, **env}
            if ranks > 1:  # one bind group per rank, whatever a single-rank session set
                env["SGLANG_CPU_OMP_THREADS_BIND"] = threads["SGLANG_CPU_OMP_THREADS_BIND"]
            if self.cores is not None:
                first, _, last = self.cores.partition("-")
                env["SGLANG_CPU_OMP_THREADS_BIND"] = self.cores
                env["OMP_NUM_THREADS"] = str(int(last or first) - int(first) + 1)
        log = open(self.log_path, "wb")
        self.ready = False
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        return self

    def wait_ready(self) -> None:
        """Block until ``/health_generate`` answers; returns at once once it has (no request)."""
        if self.ready:
            return
        deadline = time.monotonic() + self.startup_timeout
        relaunches = _BIND_RACE_RETRIES
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if relaunches > 0 and "address already in use" in self.log_text().lower():
                    relaunches -= 1  # another process took the port first: not the server's fault
                    self.port = free_port()
                    self.launch()
                    continue
                raise ServerStartError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    self.ready = True
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"server not ready after {self.startup_timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def terminate(self) -> None:
        """Ask the server to exit, without waiting: call on several, then ``stop`` each, and they
        shut down side by side (a shutdown takes seconds here)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        stop_group(self.proc)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- small client helpers -------------------------------------------------

    def generate(self, text: str | None = None, *, input_ids: list[int] | None = None,
                 max_new_tokens: int = 16, custom_params: dict | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, timeout: float = 900,
                 **extra) -> dict:
        """Greedy ``/generate``; ``extra`` goes into the body as is (e.g. ``cache_salt``, ``rid``)."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        if custom_params is not None:
            sampling["custom_params"] = custom_params
        body: dict = {"sampling_params": sampling, **extra}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
        if return_logprob:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs_num, logprob_start_len=-1)
        resp = requests.post(self.url + "/generate", json=body, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def server_info(self) -> dict:
        return requests.get(self.url + "/get_server_info", timeout=30).json()


def settings_args(settings: Mapping[str, Any]) -> list[str]:
    """Launch arguments that set ``settings`` (key -> value, as in docs/CONFIGURATION.md).

    A setting that is a flag becomes ``--kvshare-<key> value``; the others go into one ``--kvshare-config``
    file in the temp directory, named by its content, so the same settings always give the same arguments
    (the test pool keys its servers by them).
    """
    from sglang_kvshare.config import FLAG_FIELDS, config_file_text

    args: list[str] = []
    in_file = {}
    for key, value in settings.items():
        if key in FLAG_FIELDS:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            args += ["--kvshare-" + key.replace("_", "-"), text]
        else:
            in_file[key] = value
    if in_file:
        text = config_file_text(in_file)
        path = Path(tempfile.gettempdir()) / f"kvshare-config-{hashlib.sha256(text.encode()).hexdigest()[:16]}.toml"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        args += ["--kvshare-config", str(path)]
    return args

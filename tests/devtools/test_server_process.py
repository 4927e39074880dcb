"""Ports for test servers: picked where no other process takes them on its own, and a lost bind race relaunches.

The relaunch is exercised with a stand-in HTTP server (a few lines of stdlib) in place of SGLang: what is under
test is the process handling, and a real server would spend a minute loading the model before it fails to bind.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

import pytest

from devtools.server_process import ServerProcess, ServerStartError, _ephemeral_low, free_port

STAND_IN = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


@dataclass
class _StandIn(ServerProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, str(self.port)]


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_bind():
    ports = {free_port() for _ in range(20)}
    assert all(p < _ephemeral_low() for p in ports)
    assert len(ports) > 1  # drawn at random, so two servers started together do not pick the same one
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_server_whose_port_was_taken_relaunches_on_a_fresh_one():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))  # bound, not listening: a probe is refused at once rather than left hanging
        taken = squatter.getsockname()[1]
        server = _StandIn(model_path="unused", port=taken, startup_timeout=60)
        try:
            server.start()
            assert server.port != taken
            assert server.ready
            assert "address already in use" not in server.log_text().lower()  # the log is the second launch's
        finally:
            server.stop()


def test_a_server_that_fails_for_another_reason_is_not_relaunched():
    class _Broken(_StandIn):
        def command(self) -> list[str]:
            return [sys.executable, "-c", "import sys; print('no model here'); sys.exit(2)"]

    server = _Broken(model_path="unused", startup_timeout=60)
    try:
        with pytest.raises(ServerStartError, match="no model here"):
            server.start()
    finally:
        server.stop()

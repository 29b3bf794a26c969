"""The metrics port under idle clients: per-connection timeouts and a cap on connections,
and ``/healthz`` and ``/readyz`` answered whatever idle clients hold."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from broker_adapter.app.metrics import Observed
from broker_adapter.app.serving import MetricsServer
from tests.support.cli import cli_env, wait_for
from tests.support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: The open-file limit of the process under test (a container's).
FD_LIMIT = 256


@contextmanager
def _server(redis_server: RedisServer, **kwargs: float) -> Iterator[MetricsServer]:
    server = MetricsServer(Observed(redis_url=redis_server.url), "127.0.0.1", 0, **kwargs)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _idle(stack: ExitStack, port: int, n: int) -> list[socket.socket]:
    """``n`` connections that send nothing."""
    out = []
    for _ in range(n):
        s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        out.append(s)
    return out


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (a read sees the end; no data is ever sent to it)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


def _get_within(port: int, path: str, limit_s: float) -> tuple[int, float]:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=limit_s) as resp:
        status = resp.status
    return status, time.monotonic() - started


def _descriptors_limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def test_receive_metrics_port_answers_readyz_within_a_second_while_300_idle_connections_are_open(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """``receive --metrics-port`` as a subprocess with 256 descriptors (a container's
    limit): 300 clients that connect and send nothing, then the probes, each answered
    within a second."""
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps({"alice": {"k1": "alice-secret: a test key of 32 bytes+"}}))
    keyring.chmod(0o600)
    port = free_port()
    rcv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "receive",
            "--redis",
            redis_server.url,
            "--db",
            str(tmp_path / "r.db"),
            "--principal",
            "alice",
            "--prefix",
            prefix,
            "--keyring",
            str(keyring),
            "--metrics-port",
            str(port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        preexec_fn=_descriptors_limited,
    )
    try:
        wait_for(lambda: _ready(port), "the receiver's /readyz")
        with ExitStack() as stack:
            _idle(stack, port, 300)
            for path in ("/healthz", "/readyz"):
                status, took = _get_within(port, path, 1.0)
                assert status == 200
                assert took < 1.0
    finally:
        rcv.terminate()
        out, _ = rcv.communicate(timeout=60)
    assert rcv.returncode == 0, out


def _ready(port: int) -> bool:
    try:
        return _get_within(port, "/readyz", 1.0)[0] == 200
    except OSError:
        return False


def test_metrics_server_keeps_idle_connections_below_the_cap_and_evicts_the_oldest_at_it(
    redis_server: RedisServer,
) -> None:
    cap = 8
    with _server(redis_server, max_connections=cap) as server, ExitStack() as stack:
        held = _idle(stack, server.port, cap - 1)
        wait_for(lambda: len(server._httpd._waiting) == cap - 1, "the idle ones held")
        assert _get_within(server.port, "/healthz", 1.0)[0] == 200  # the cap-th: room left
        assert server._httpd.evicted == 0
        assert not any(_closed_by_server(s) for s in held)
        held += _idle(stack, server.port, 1)  # now the cap is reached by idle connections
        wait_for(lambda: len(server._httpd._waiting) == cap, "the cap reached")
        assert _get_within(server.port, "/readyz", 1.0)[0] == 200
        assert server._httpd.evicted == 1
        wait_for(lambda: _closed_by_server(held[0]), "the oldest idle one closed")
        assert not any(_closed_by_server(s) for s in held[1:])


def test_metrics_server_closes_a_connection_idle_past_its_timeout(
    redis_server: RedisServer,
) -> None:
    with _server(redis_server, timeout_s=0.2) as server, ExitStack() as stack:
        (idle,) = _idle(stack, server.port, 1)
        wait_for(lambda: _closed_by_server(idle), "the idle connection closed", timeout_s=10)
        # a client that sends its request at once is answered under the same timeout
        assert _get_within(server.port, "/healthz", 1.0)[0] == 200

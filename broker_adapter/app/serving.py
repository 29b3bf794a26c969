"""The metrics port: ``/metrics``, ``/healthz`` and ``/readyz`` on one HTTP server
(``run --metrics-port``, ``receive --metrics-port``; off by default).

Health: ``/healthz`` answers 200 while the process serves HTTP; ``/readyz`` answers 200
only when every check passes (``Readiness``: Redis answers a PING, the database can be
written, every stage runs), else 503 with one line per failed check. What ``/metrics``
holds is ``app.metrics``'s.

Idle clients cannot starve the probes: every connection has a socket timeout
(``CONNECTION_TIMEOUT_S`` per read or write), and at most ``MAX_CONNECTIONS`` are held at
once. A connection that arrives when the cap is reached makes room by closing the oldest
one that has not sent its request line yet (a connection being answered is never closed),
so a probe that sends its request at once is answered whatever idle clients hold.
"""

from __future__ import annotations

import http.server
import logging
import socket
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker_adapter.app.metrics import (
    CHECK_TIMEOUT_S,
    DEFAULT_METRICS_HOST,
    AdapterCollector,
    Observed,
)
from broker_adapter.errors import ConfigError
from broker_adapter.redis.probe import redis_check
from broker_adapter.store.probe import writable_check

log = logging.getLogger("broker_adapter.app.serving")

#: How long the metrics server waits for one read or write of a client, seconds.
CONNECTION_TIMEOUT_S = 5.0
#: The most connections the metrics server holds at once (see the module's text).
MAX_CONNECTIONS = 64

# -- health ---------------------------------------------------------------------------------


def database_check(path: Path | str) -> Callable[[], str | None]:
    """The file exists and its write lock can be had within ``CHECK_TIMEOUT_S``
    (``store.probe.writable_check``). A PostgreSQL database: the server answers within
    ``CHECK_TIMEOUT_S`` and is not in recovery (a standby cannot be written)."""
    from broker_adapter.store.backends import probe
    from broker_adapter.store.urls import is_postgres_url

    if is_postgres_url(path):
        return lambda: probe(str(path), CHECK_TIMEOUT_S)
    return writable_check(Path(path), CHECK_TIMEOUT_S)


@dataclass
class Readiness:
    """The checks behind ``/readyz``: Redis answers a PING, the database can be written,
    and every stage runs (``Observed.stages``)."""

    observed: Observed

    def problems(self) -> list[str]:
        obs = self.observed
        found: list[str] = []
        if obs.redis_url is not None:
            found.append(redis_check(obs.redis_url, CHECK_TIMEOUT_S)() or "")
        if obs.db_path is not None:
            found.append(database_check(obs.db_path)() or "")  # SQLite, or a SELECT 1
        found += [f"stage not running: {name}" for name in obs.stages()]
        return [p for p in found if p]


# -- the HTTP server ------------------------------------------------------------------------


class BoundedHTTPServer(http.server.ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them: at the cap, a new
    connection closes the oldest one that has not sent its request line yet (or, when every
    held connection is being answered, is itself closed)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[http.server.BaseHTTPRequestHandler],
        max_connections: int,
    ) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        #: connections that have not sent a request line yet, oldest first
        self._waiting: OrderedDict[Any, None] = OrderedDict()
        self._answering: set[Any] = set()
        #: idle connections closed to make room (for the logs and the tests)
        self.evicted = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            while len(self._waiting) + len(self._answering) >= self.max_connections:
                if not self._waiting:
                    break
                oldest, _ = self._waiting.popitem(last=False)
                self.evicted += 1
                _cut(oldest)  # its thread's read ends at once and closes it
            full = len(self._waiting) + len(self._answering) >= self.max_connections
            if not full:
                self._waiting[request] = None
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def answering(self, request: Any) -> None:
        """``request`` sent its request line: it is answered, not evicted."""
        with self._lock:
            if self._waiting.pop(request, False) is None:
                self._answering.add(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._waiting.pop(request, None)
            self._answering.discard(request)
        super().shutdown_request(request)


def _cut(conn: Any) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed by its client meanwhile


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (port 0: any free one,
    see ``port``), served by a daemon thread of the stdlib's HTTP server, with a socket
    timeout of ``timeout_s`` per connection and at most ``max_connections`` connections
    (see the module's text)."""

    def __init__(
        self,
        observed: Observed,
        host: str = DEFAULT_METRICS_HOST,
        port: int = 0,
        *,
        timeout_s: float = CONNECTION_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.readiness = Readiness(observed)
        self.collector = AdapterCollector(observed, readiness=self.readiness)
        self.registry.register(self.collector)
        self.timeout_s = timeout_s
        self._httpd = BoundedHTTPServer((host, port), self._handler(), max_connections)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = server.timeout_s  # per read and write (StreamRequestHandler.setup)

            def parse_request(self) -> bool:
                server._httpd.answering(self.connection)
                return super().parse_request()

            def do_GET(self) -> None:
                status, ctype, body = server.respond(self.path.partition("?")[0])
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics http: " + format, *args)

        return Handler

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """Status, content type and body for a GET of ``path``."""
        text_type = "text/plain; charset=utf-8"
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            return 200, text_type, b"ok\n"
        if path == "/readyz":
            problems = self.readiness.problems()
            if problems:
                return 503, text_type, ("\n".join(problems) + "\n").encode()
            return 200, text_type, b"ready\n"
        return 404, text_type, b"not found: /metrics, /healthz, /readyz\n"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="metrics-http", daemon=True
        )
        self._thread.start()
        host, port = self._httpd.server_address[:2]
        log.info("metrics on http://%s:%d/metrics (/healthz, /readyz)", host, port)

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()


@contextmanager
def serve_metrics(
    observed: Observed, host: str, port: int | None, *, worker_files: bool = True
) -> Iterator[MetricsServer | None]:
    """Serve ``observed`` on ``host:port`` while the block runs; ``port`` ``None``: do
    nothing (prometheus-client is not imported). With ``worker_files`` a temporary
    directory is made for the worker processes' counters (``Observed.worker_dir``) and
    removed afterwards."""
    if port is None:
        yield None
        return
    server = serve(observed, host, port)
    files = tempfile.TemporaryDirectory(prefix="ba-metrics-") if worker_files else None
    observed.worker_dir = None if files is None else Path(files.name)
    try:
        yield server
    finally:
        server.stop()
        observed.worker_dir = None
        if files is not None:
            files.cleanup()


def serve(observed: Observed, host: str, port: int) -> MetricsServer:
    """Start a ``MetricsServer``.

    Raises:
        ConfigError: prometheus-client is not installed (the ``metrics`` extra), or the
            port cannot be bound.
    """
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--metrics-port needs prometheus-client: pip install 'broker_adapter[metrics]'"
        ) from None
    try:
        server = MetricsServer(observed, host, port)
    except OSError as exc:
        raise ConfigError(f"metrics port {host}:{port}: {exc}") from None
    server.start()
    return server

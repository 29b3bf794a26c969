"""The metrics port: ``/metrics``, ``/healthz`` and ``/readyz`` on one HTTP server
(``run --metrics-port``, ``receive --metrics-port``; off by default).

Health: ``/healthz`` answers 200 while the process serves HTTP; ``/readyz`` answers 200
only when every check passes (``Readiness``: Redis answers a PING, the database can be
written, every stage runs), else 503 with one line per failed check. What ``/metrics``
holds is ``app.metrics``'s.
"""

from __future__ import annotations

import http.server
import logging
import tempfile
import threading
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

# -- health ---------------------------------------------------------------------------------


def database_check(path: Path | str) -> Callable[[], str | None]:
    """The file exists and its write lock can be had within ``CHECK_TIMEOUT_S``
    (``store.probe.writable_check``). A PostgreSQL database: the server answers within
    ``CHECK_TIMEOUT_S`` and is not in recovery (a standby cannot be written)."""
    from broker_adapter.store.backends import is_postgres_url, probe

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


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (port 0: any free one,
    see ``port``), served by a daemon thread of the stdlib's HTTP server."""

    def __init__(self, observed: Observed, host: str = DEFAULT_METRICS_HOST, port: int = 0):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.readiness = Readiness(observed)
        self.collector = AdapterCollector(observed, readiness=self.readiness)
        self.registry.register(self.collector)
        self._httpd = http.server.ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
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

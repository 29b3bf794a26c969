"""A fake external service for the side-effect tests: its own process, its own SQLite file.

It applies "effects" (rows in its ``effects`` table) over HTTP on loopback and can be asked
what it applied, so a test can kill a worker at any point and then count what reached the
target. Run it with::

    python -m tests.support.fake_target --db target.db --port-file port.txt [--non-idempotent]

* ``POST /effects`` with a JSON body ``{"what": ..., "fence_key": ..., "fence": ...}`` (the
  fence pair optional) and an optional ``Idempotency-Key`` header applies one effect. An
  idempotent target (the default) applies a key once and answers a repeat with the first
  effect (``"duplicate": true``); a non-idempotent one applies every request. With a fence,
  the write is conditional (``broker_adapter.fences.SqlFence``, in the same transaction):
  a fence lower than the highest seen for ``fence_key`` is refused with 409.
  ``"drop_response": true`` applies the effect and closes the connection unanswered (the
  caller cannot know whether it happened).
* ``GET /effects[?key=K]``: ``{"count": n, "effects": [...]}``, effects not compensated.
* ``POST /compensate`` with ``{"effect_id": n}``: marks one effect compensated (once).
* ``POST /throttle`` with ``{"requests": n, "retry_after": s}``: the next ``n`` effect
  requests are answered ``429 Too Many Requests`` with ``Retry-After: s`` and applied not
  at all (``GET /effects`` answers ``throttled``: how many were turned away).

It writes its port to ``--port-file`` (atomically) once it listens. ``FakeTarget`` starts
and stops one from a test; ``FakeTargetClient`` talks to one (also from a handler in
another process, given the URL).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from broker_adapter.fences import SqlFence, TargetFenced
from broker_adapter.handler.effects import CompensateFn, Observation, ReconcileFn
from broker_adapter.store.task_types import ClaimedTask
from tests.support.cli import wait_for

_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    effect_id   INTEGER PRIMARY KEY AUTOINCREMENT,
    idem_key    TEXT,
    what        TEXT NOT NULL,
    fence_key   TEXT,
    fence       INTEGER,
    compensated INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS effects_key ON effects (idem_key);
"""
FENCE = SqlFence("target_fences")


class _Target:
    """The service's state: one SQLite connection, used under a lock."""

    def __init__(self, db: Path, idempotent: bool) -> None:
        self.idempotent = idempotent
        self.lock = threading.Lock()
        self.throttle_left = 0
        self.retry_after = "0"
        self.throttled = 0
        self.conn = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.executescript(_SCHEMA)
        self.conn.execute(FENCE.create_sql())

    def apply(self, key: str | None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        what = json.dumps(body.get("what"), sort_keys=True)
        fence_key, fence = body.get("fence_key"), body.get("fence")
        with self.lock:
            c = self.conn
            c.execute("BEGIN IMMEDIATE")
            try:
                if self.idempotent and key is not None:
                    row = c.execute(
                        "SELECT effect_id FROM effects WHERE idem_key = ? ORDER BY effect_id",
                        (key,),
                    ).fetchone()
                    if row is not None:
                        c.execute("COMMIT")
                        return 200, {"applied": False, "duplicate": True, "effect_id": row[0]}
                if fence_key is not None and fence is not None:
                    FENCE.advance(c.cursor(), str(fence_key), int(fence))
                effect_id = c.execute(
                    "INSERT INTO effects (idem_key, what, fence_key, fence) VALUES (?, ?, ?, ?)",
                    (key, what, fence_key, fence),
                ).lastrowid
                c.execute("COMMIT")
            except TargetFenced as exc:
                c.execute("ROLLBACK")
                return 409, {"applied": False, "fenced": True, "highest": exc.highest}
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return 201, {"applied": True, "duplicate": False, "effect_id": effect_id}

    def effects(self, key: str | None) -> dict[str, Any]:
        with self.lock:
            sql = "SELECT * FROM effects WHERE compensated = 0"
            rows = (
                self.conn.execute(sql + " AND idem_key = ? ORDER BY effect_id", (key,))
                if key is not None
                else self.conn.execute(sql + " ORDER BY effect_id")
            ).fetchall()
            throttled = self.throttled
        effects = [{**dict(r), "what": json.loads(r["what"])} for r in rows]
        return {"count": len(effects), "effects": effects, "throttled": throttled}

    def throttle(self, requests: int, retry_after: str) -> None:
        with self.lock:
            self.throttle_left, self.retry_after = requests, retry_after

    def turned_away(self) -> str | None:
        """The ``Retry-After`` of a request to answer 429, or None to apply it."""
        with self.lock:
            if self.throttle_left <= 0:
                return None
            self.throttle_left -= 1
            self.throttled += 1
            return self.retry_after

    def compensate(self, effect_id: int) -> bool:
        with self.lock:
            hit = self.conn.execute(
                "UPDATE effects SET compensated = 1 WHERE effect_id = ? AND compensated = 0",
                (effect_id,),
            ).rowcount
        return bool(hit)


def _handler(target: _Target) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(
            self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
        ) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            parsed = json.loads(self.rfile.read(length) or b"{}")
            return parsed if isinstance(parsed, dict) else {}

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/health":
                self._answer(200, {"ok": True, "idempotent": target.idempotent})
            elif url.path == "/effects":
                key = urllib.parse.parse_qs(url.query).get("key", [None])[0]
                self._answer(200, target.effects(key))
            else:
                self._answer(404, {"error": "no such path"})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/effects" and (wait := target.turned_away()) is not None:
                self._answer(429, {"throttled": True}, {"Retry-After": wait})
            elif self.path == "/effects":
                status, answer = target.apply(self.headers.get("Idempotency-Key"), body)
                if body.get("drop_response"):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # applied, never answered
                    return
                self._answer(status, answer)
            elif self.path == "/compensate":
                self._answer(200, {"compensated": target.compensate(int(body["effect_id"]))})
            elif self.path == "/throttle":
                target.throttle(int(body["requests"]), str(body["retry_after"]))
                self._answer(200, {"ok": True})
            else:
                self._answer(404, {"error": "no such path"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fake_target")
    parser.add_argument("--db", required=True, type=Path)
    parser.add_argument("--port-file", required=True, type=Path)
    parser.add_argument("--non-idempotent", action="store_true")
    args = parser.parse_args(argv)
    target = _Target(args.db, idempotent=not args.non_idempotent)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(target))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever(poll_interval=0.1)
    return 0


class TargetError(Exception):
    """The fake target answered with an error status (``status``, ``body``, and its
    ``Retry-After`` header as ``retry_after``, or None)."""

    def __init__(self, status: int, body: dict[str, Any], retry_after: str | None = None) -> None:
        self.status = status
        self.body = body
        self.retry_after = retry_after
        super().__init__(f"fake target answered {status}: {body}")


class FakeTargetClient:
    """Talks to a running fake target at ``url`` (``http://127.0.0.1:PORT``)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as exc:
            answer = json.loads(exc.read() or b"{}")
            raise TargetError(exc.code, answer, exc.headers.get("Retry-After")) from None

    def apply(
        self,
        what: Any,
        *,
        key: str | None = None,
        fence_key: str | None = None,
        fence: int | None = None,
        drop_response: bool = False,
    ) -> dict[str, Any]:
        """Apply one effect (``TargetError`` 409 when fenced; ``http.client`` or ``OSError``
        errors when the answer was dropped)."""
        body: dict[str, Any] = {"what": what, "fence_key": fence_key, "fence": fence}
        if drop_response:
            body["drop_response"] = True
        headers = {} if key is None else {"Idempotency-Key": key}
        return self._call("POST", "/effects", body, headers)

    def effects(self, key: str | None = None) -> list[dict[str, Any]]:
        """The effects applied (and not compensated), all or those of one key."""
        query = "" if key is None else "?" + urllib.parse.urlencode({"key": key})
        return list(self._call("GET", "/effects" + query)["effects"])

    def throttle(self, requests: int, retry_after: str) -> None:
        """Answer the next ``requests`` effect requests 429 with ``Retry-After``."""
        self._call("POST", "/throttle", {"requests": requests, "retry_after": retry_after})

    def throttled(self) -> int:
        """How many effect requests were answered 429."""
        return int(self._call("GET", "/effects")["throttled"])

    def compensate(self, effect_id: int) -> bool:
        return bool(self._call("POST", "/compensate", {"effect_id": effect_id})["compensated"])

    def healthy(self) -> bool:
        try:
            return bool(self._call("GET", "/health")["ok"])
        except (OSError, http.client.HTTPException, TargetError):
            return False


def reconcile_with(client: FakeTargetClient) -> ReconcileFn:
    """A reconcile function asking the target for the effects under the task's key: none is
    ``not-done``; some is ``done`` with their ids as the result, ``applied`` their number."""

    def reconcile(task: ClaimedTask, key: str) -> Observation:
        applied = client.effects(key)
        if not applied:
            return Observation.not_happened(f"no effect under {key}")
        ids = [e["effect_id"] for e in applied]
        return Observation.happened({"effect_ids": ids}, applied=len(ids))

    return reconcile


def compensate_with(client: FakeTargetClient) -> CompensateFn:
    """A compensation undoing every effect but the first of those ``reconcile_with`` found."""

    def compensate(task: ClaimedTask, seen: Observation) -> Any:
        extra = list(seen.result["effect_ids"][1:])
        return {"compensated": [i for i in extra if client.compensate(i)]}

    return compensate


class FakeTarget:
    """One fake target process in ``workdir`` (its database ``target.db`` there).

    Args:
        workdir: where its database and port file go.
        idempotent: dedupe by the ``Idempotency-Key`` header.
    """

    def __init__(self, workdir: Path, *, idempotent: bool = True) -> None:
        self.workdir = workdir
        self.idempotent = idempotent
        self.db = workdir / "target.db"
        self.port_file = workdir / "target.port"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: FakeTargetClient | None = None

    @property
    def url(self) -> str:
        assert self.client is not None, "not started"
        return self.client.url

    def start(self) -> FakeTargetClient:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port_file.unlink(missing_ok=True)
        args = [
            sys.executable,
            "-m",
            "tests.support.fake_target",
            "--db",
            str(self.db),
            "--port-file",
            str(self.port_file),
        ]
        if not self.idempotent:
            args.append("--non-idempotent")
        root = Path(__file__).resolve().parents[2]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        proc = self.proc = subprocess.Popen(args, cwd=root, env=env)
        wait_for(
            lambda: self.port_file.exists() or proc.poll() is not None,
            "the fake target's port file",
            30,
        )
        if proc.poll() is not None:
            raise RuntimeError(f"the fake target exited with {proc.returncode}")
        client = FakeTargetClient(f"http://127.0.0.1:{self.port_file.read_text().strip()}")
        wait_for(client.healthy, "the fake target to answer", 30)
        self.client = client
        return client

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> FakeTargetClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())

"""Reply-path helpers for tests, and a worker script that runs ONE dispatcher or receiver step.

Run as ``python -m tests.support.replies_script dispatch|receive ...`` with
``BA_CRASHPOINT`` set to make it SIGKILL itself at a named point; the test then reopens the
databases and checks what survived. ``record_effect`` is the effect both the script and the
in-process recovery use: an append-only table, so a second effect for one reply id shows up
as a count of 2 instead of being hidden by a key.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.reply import Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
from broker_adapter.store import AcceptItem, OutboxStore, ReceiptStore, TaskStore
from broker_adapter.store.backends import open_store
from broker_adapter.store.db import Database
from broker_adapter.store.outbox_types import OutboxPolicy
from broker_adapter.store.postgres import PgDatabase
from broker_adapter.store.urls import is_postgres_url
from tests.support.backends import Backend

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The keys replies are signed with in these tests: each principal's keyring entry (the
#: adapter signs with the first key id, a receiver verifies with any of them).
REPLY_KEYS: dict[str, dict[str, str]] = {
    "alice": {
        "alice-r2": "alice reply-signing secret, the current one",
        "alice-r1": "alice reply-signing secret, the older one",
    },
    "bob": {"bob-r1": "bob reply-signing secret, thirty-two bytes+"},
    "p1": {"p1-r1": "p1 reply-signing secret, thirty-two bytes++"},
    "agent-a": {"agent-a-r1": "agent-a reply-signing secret, 32 bytes+"},
}


def reply_keyring() -> Keyring:
    """``REPLY_KEYS`` as a ``Keyring``."""
    return Keyring(REPLY_KEYS)


def record_effect(conn: Any, reply: Reply) -> dict[str, Any]:
    """The test effect: one appended row per application, on the receipt's connection
    (SQLite's or psycopg's)."""
    mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
    conn.execute(
        "CREATE TABLE IF NOT EXISTS effects (reply_id TEXT NOT NULL, task_id TEXT, status TEXT)"
    )
    conn.execute(
        f"INSERT INTO effects (reply_id, task_id, status) VALUES ({mark}, {mark}, {mark})",
        (reply.reply_id, reply.task_id, reply.status),
    )
    return {"applied": reply.reply_id}


def effect_counts(db_path: str | Path) -> dict[str, int]:
    """Effects per reply id, read with a connection of its own (a SQLite file, or a
    PostgreSQL URL)."""
    if is_postgres_url(str(db_path)):
        import psycopg

        with psycopg.connect(str(db_path)) as pg:
            found = pg.execute("SELECT to_regclass('effects') IS NOT NULL").fetchone()
            if not found or not found[0]:
                return {}
            pairs = pg.execute("SELECT reply_id, count(*) FROM effects GROUP BY reply_id")
            return {str(r[0]): int(r[1]) for r in pairs}
    conn = sqlite3.connect(str(db_path))
    try:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'effects'"
        ).fetchone()
        if exists is None:
            return {}
        rows = conn.execute("SELECT reply_id, count(*) FROM effects GROUP BY reply_id").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}
    finally:
        conn.close()


def make_replies(
    db: Database | PgDatabase, clock: FakeClock, principal: str, n: int, *, first: int = 0
) -> list[str]:
    """Accept ``n`` tasks from ``principal``, run them to ``done``: ``n`` outbox replies."""
    tasks = TaskStore(db, clock)
    items = [
        AcceptItem(
            principal,
            Envelope.build(
                message_id=f"m{i}",
                sender=principal,
                payload={"i": i},
                deadline=clock.now() + 86_400,
            ),
        )
        for i in range(first, first + n)
    ]
    tasks.accept(items)
    return [
        tasks.finish(t.task_id, "worker", t.fence, {"i": t.payload["i"]})
        for t in tasks.claim("worker", n)
    ]


def entries_per_reply(client: redis.Redis, stream: str) -> Counter[str]:
    """How many entries each reply id has on ``stream``."""
    entries: Any = client.xrange(stream)
    return Counter(f[b"reply_id"].decode() for _, f in entries)


def _client(redis_at: str | redis.Redis) -> redis.Redis:
    """A client of its own for a Redis URL; a client as it is."""
    return connect(redis_at) if isinstance(redis_at, str) else redis_at


def dispatcher_for(
    redis_at: str | redis.Redis,
    db: Database | PgDatabase,
    clock: FakeClock,
    prefix: str,
    owner: str,
) -> Dispatcher:
    """A dispatcher on ``redis_at`` (a URL or a client) signing with ``reply_keyring``."""
    return Dispatcher(
        DispatcherConfig(prefix=prefix, owner=owner),
        _client(redis_at),
        OutboxStore(db, clock),
        keyring=reply_keyring(),
    )


def make_dispatcher(
    backend: Backend,
    db: Database,
    clock: FakeClock,
    prefix: str,
    owner: str = "d1",
    client: redis.Redis | None = None,
    policy: OutboxPolicy | None = None,
    **cfg: Any,
) -> Dispatcher:
    """A dispatcher on ``client`` (else a new client of ``backend``) with ``DispatcherConfig``
    options ``cfg``."""
    return Dispatcher(
        DispatcherConfig(prefix=prefix, owner=owner, **cfg),
        client or backend.connect(),
        OutboxStore(db, clock, policy),
        keyring=reply_keyring(),
    )


def receiver_for(
    redis_at: str | redis.Redis,
    db: Database | PgDatabase,
    clock: FakeClock,
    prefix: str,
    principal: str,
    consumer: str,
    **cfg: Any,
) -> Receiver:
    """A receiver on ``redis_at`` (a URL or a client), BLOCK 20 ms, applying ``record_effect``."""
    config = ReceiverConfig(
        prefix=prefix, principal=principal, consumer=consumer, block_ms=20, **cfg
    )
    return Receiver(
        config,
        _client(redis_at),
        ReceiptStore(db, clock),
        record_effect,
        keyring=reply_keyring(),
        clock=clock,
    )


def drain(receiver: Receiver, *, max_steps: int = 50) -> int:
    """Step ``receiver`` until three steps in a row handle nothing."""
    total, idle = 0, 0
    for _ in range(max_steps):
        n = receiver.step()
        total += n
        idle = idle + 1 if n == 0 else 0
        # an empty step may only have recreated a lost group, the next only ended the
        # replay of own pending entries; the third read '>' and found nothing
        if idle >= 3:
            return total
    raise AssertionError(f"receiver still busy after {max_steps} steps")


def run_worker(
    role: str, args: Sequence[str], *, crashpoint: str | None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run this script in a subprocess, armed with ``crashpoint``; return when it ends."""
    env = dict(os.environ)
    env.pop("BA_CRASHPOINT", None)
    env.pop("BA_PAUSEPOINT", None)
    if crashpoint is not None:
        env["BA_CRASHPOINT"] = crashpoint
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "tests.support.replies_script", role, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replies_script")
    parser.add_argument("role", choices=["dispatch", "receive"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--now", type=float, required=True)
    parser.add_argument("--principal", default="alice")
    parser.add_argument("--consumer", default="r1")
    parser.add_argument("--owner", default="d-script")
    args = parser.parse_args(argv)
    clock = FakeClock(args.now)
    db = open_store(args.db)  # a SQLite file or a postgresql:// URL
    if args.role == "dispatch":
        marked = dispatcher_for(args.url, db, clock, args.prefix, args.owner).step()
        print(f"dispatched {marked}", flush=True)
    else:
        rc = receiver_for(args.url, db, clock, args.prefix, args.principal, args.consumer)
        handled = 0
        for _ in range(5):  # the first read only replays own pending (none): read on
            handled = rc.step()
            if handled:
                break
        print(f"received {handled}", flush=True)
    db.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

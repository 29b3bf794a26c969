"""Run store operations in a child process, for the crash and race tests.

Usage::

    python -m tests.support.store_script op <db> <now> <op> '<json args>'
        Open <db> (a SQLite file, or a ``postgresql://`` URL), run one store operation at
        the fake time <now>, print its result as one JSON line and exit 0. With
        ``BA_CRASHPOINT=store.<op>.before_commit`` (or ``after_commit``) set, the process
        SIGKILLs itself inside the operation instead.

    python -m tests.support.store_script serve <db> <owner>
        A long-lived claimer driven over stdin/stdout, one command per line:
        ``claim <now> <go-file>``: answer ``ready``, spin until <go-file> exists, claim one
        task, answer with a JSON list of the claimed task ids. ``quit``: exit 0.

The same module holds the helpers the tests share (policies, envelope builder, table dump),
so the parent and the child build their stores exactly the same way.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from psycopg.rows import tuple_row

from broker_adapter.backoff import Backoff
from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.reply import Reply
from broker_adapter.store import (
    AcceptItem,
    Database,
    OutboxStore,
    ReceiptStore,
    TaskStore,
)
from broker_adapter.store.backends import open_store
from broker_adapter.store.outbox_types import OutboxPolicy
from broker_adapter.store.outbox_writes import enqueue
from broker_adapter.store.postgres import PgDatabase
from broker_adapter.store.receipts import Effect, Receipt, ReceiptItem, ReceiptOutcome
from broker_adapter.store.task_types import TaskPolicy

T0 = 1_800_000_000.0
LEASE_S = 30.0
RETENTION_S = 3600.0
MAX_HOPS = 16
OUTBOX_LEASE_S = 30.0
OUTBOX_MAX_ATTEMPTS = 3
TASK_BACKOFF = Backoff(base_s=1.0, cap_s=8.0)
OUTBOX_BACKOFF = Backoff(base_s=0.5, cap_s=4.0)
TABLES = ("tasks", "inbox", "outbox", "receipts", "effects")

Json = Any
Dump = dict[str, list[dict[str, Any]]]


def task_policy() -> TaskPolicy:
    return TaskPolicy(
        lease_s=LEASE_S, max_hops=MAX_HOPS, retention_s=RETENTION_S, backoff=TASK_BACKOFF
    )


def outbox_policy() -> OutboxPolicy:
    return OutboxPolicy(
        lease_s=OUTBOX_LEASE_S, max_attempts=OUTBOX_MAX_ATTEMPTS, backoff=OUTBOX_BACKOFF
    )


AnyDatabase = Database | PgDatabase


@dataclass(frozen=True)
class Stores:
    db: AnyDatabase
    tasks: TaskStore
    outbox: OutboxStore
    receipts: ReceiptStore

    @property
    def backend(self) -> str:
        return "postgresql" if isinstance(self.db, PgDatabase) else "sqlite"

    def enqueue(self, c: Any, **reply: Any) -> bool:
        """``outbox_writes.enqueue`` in transaction ``c`` of ``db``."""
        return enqueue(c, **reply)

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (``?`` placeholders) in a write transaction of its own, as
        a test that sets a row up by hand does; its rows as tuples."""
        if isinstance(self.db, PgDatabase):
            with self.db.write("accept") as c:
                cur = c.raw.cursor(row_factory=tuple_row)
                cur.execute(statement.replace("?", "%s"), params)
                return cur.fetchall() if cur.description else []
        with self.db.write("accept") as c:
            return [tuple(r) for r in c.execute(statement, params).fetchall()]


def open_any(target: str | Path) -> AnyDatabase:
    """The database ``target`` names: a ``postgresql://`` URL, else a SQLite file."""
    return open_store(target)


def reopen(db: AnyDatabase) -> AnyDatabase:
    """A second connection (pool) to the database ``db`` is on."""
    return open_any(db.url if isinstance(db, PgDatabase) else db.path)


@dataclass(frozen=True)
class SqliteStores(Stores):
    """The stores on a SQLite database (what the SQLite-only tests use)."""

    db: Database
    tasks: TaskStore
    receipts: ReceiptStore


@overload
def stores(db: Database, clock: FakeClock, seed: int = 0) -> SqliteStores: ...
@overload
def stores(db: AnyDatabase, clock: FakeClock, seed: int = 0) -> Stores: ...


def stores(db: AnyDatabase, clock: FakeClock, seed: int = 0) -> Stores:
    """The three stores on one database (either backend), with the shared test policies
    and a seeded rng."""
    if isinstance(db, PgDatabase):
        return Stores(
            db=db,
            tasks=TaskStore(db, clock, task_policy(), random.Random(seed)),
            outbox=OutboxStore(db, clock, outbox_policy(), random.Random(seed + 1)),
            receipts=ReceiptStore(db, clock),
        )
    return SqliteStores(
        db=db,
        tasks=TaskStore(db, clock, task_policy(), random.Random(seed)),
        outbox=OutboxStore(db, clock, outbox_policy(), random.Random(seed + 1)),
        receipts=ReceiptStore(db, clock),
    )


def envelope_fields(message_id: str, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "message_id": message_id,
        "sender": "alice",
        "payload": {"q": message_id},
        "deadline": T0 + 600.0,
    }
    fields.update(overrides)
    return fields


def envelope(message_id: str, **overrides: Any) -> Envelope:
    return Envelope.build(**envelope_fields(message_id, **overrides))


def item(message_id: str, principal: str = "alice", **overrides: Any) -> AcceptItem:
    return AcceptItem(principal, envelope(message_id, **overrides))


def create_effects_table(db: AnyDatabase) -> None:
    """The receiver's own business table, written by ``record_effect``."""
    sql = "CREATE TABLE IF NOT EXISTS effects (reply_id TEXT PRIMARY KEY, status TEXT NOT NULL)"
    if isinstance(db, PgDatabase):
        with db.pool.connection() as c:  # not ``write``: no store crash point here
            c.execute(sql)
    else:
        db.conn.execute(sql)


def record_effect(conn: Any, reply: Reply) -> Json:
    """A receiver effect: one row in ``effects`` per applied reply (a PK makes a second one
    fail loudly). ``conn``: the transaction's connection, SQLite's or psycopg's."""
    mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
    conn.execute(
        f"INSERT INTO effects (reply_id, status) VALUES ({mark}, {mark})",
        (reply.reply_id, reply.status),
    )
    return {"applied": reply.reply_id}


def dump(db: AnyDatabase) -> Dump:
    """Every row of every table, in a stable order (to compare before/after). On
    PostgreSQL the ``seq`` columns (SQLite's rowid) are left out, as the rowid is."""
    if isinstance(db, PgDatabase):
        return _dump_pg(db)
    out: Dump = {}
    with db.read() as c:
        present = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for table in TABLES:
            if table not in present:
                out[table] = []
                continue
            rows = [dict(r) for r in c.execute(f"SELECT * FROM {table}")]
            out[table] = sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=repr))
    return out


def _dump_pg(db: PgDatabase) -> Dump:
    out: Dump = {}
    with db.read() as c:
        present = {
            r["name"]
            for r in c.execute(
                "SELECT table_name AS name FROM information_schema.tables"
                " WHERE table_schema = current_schema()"
            )
        }
        for table in TABLES:
            if table not in present:
                out[table] = []
                continue
            rows = []
            for r in c.execute(f"SELECT * FROM {table}"):
                r.pop("seq", None)
                rows.append({k: bytes(v) if isinstance(v, memoryview) else v for k, v in r.items()})
            out[table] = sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=repr))
    return out


def dump_path(path: str | Path) -> Dump:
    with open_any(path) as db:
        return dump(db)


# -- one operation --------------------------------------------------------------------------


def running(s: Stores, mid: str = "m1", owner: str = "w1", **overrides: Any) -> tuple[str, int]:
    """Accept ``item(mid, **overrides)`` and claim it for ``owner``: its task id and fence."""
    s.tasks.accept([item(mid, **overrides)])
    (task,) = s.tasks.claim(owner)
    return task.task_id, task.fence


def task_row(s: Stores, task_id: str) -> dict[str, Any]:
    """The ``tasks`` row of ``task_id``, as ``dump`` gives it."""
    (found,) = [r for r in dump(s.db)["tasks"] if r["task_id"] == task_id]
    return found


def task_state(s: Stores, task_id: str) -> str:
    """The state of ``task_id``."""
    row = s.tasks.get(task_id)
    assert row is not None
    return row.state


def reply_body(s: Stores, task_id: str) -> dict[str, Any]:
    """The body of the one outbox reply of ``task_id``."""
    (found,) = [r for r in dump(s.db)["outbox"] if r["task_id"] == task_id]
    body: dict[str, Any] = json.loads(found["body"])
    return body


def _accept(s: Stores, a: dict[str, Any]) -> Json:
    env = Envelope.build(**a["envelope"])
    results = s.tasks.accept([AcceptItem(a["principal"], env)])
    return [[r.outcome.value, r.task_id, r.reply_id] for r in results]


def _claim(s: Stores, a: dict[str, Any]) -> Json:
    return [[t.task_id, t.fence] for t in s.tasks.claim(a["owner"], a.get("n", 1))]


def _claim_each(s: Stores, a: dict[str, Any]) -> Json:
    """Claim one task per transaction, ``times`` times, reporting after each commit."""
    got = []
    for _ in range(a["times"]):
        claimed = [t.task_id for t in s.tasks.claim(a["owner"], 1)]
        print(json.dumps(claimed), flush=True)
        got.append(claimed)
    return got


def _finish(s: Stores, a: dict[str, Any]) -> Json:
    return s.tasks.finish(a["task_id"], a["owner"], a["fence"], a["result"])


def _fail(s: Stores, a: dict[str, Any]) -> Json:
    out = s.tasks.fail(a["task_id"], a["owner"], a["fence"], a["error"], retryable=a["retryable"])
    return out.value


def _cancel(s: Stores, a: dict[str, Any]) -> Json:
    return s.tasks.cancel(a["task_id"]).value


def _renew(s: Stores, a: dict[str, Any]) -> Json:
    return s.tasks.renew(a["task_id"], a["owner"], a["fence"])


def _reconcile(s: Stores, a: dict[str, Any]) -> Json:
    return s.tasks.reconcile()


def _purge(s: Stores, a: dict[str, Any]) -> Json:
    return s.tasks.purge(**({"limit": a["limit"]} if "limit" in a else {}))


def _purge_receipts(s: Stores, a: dict[str, Any]) -> Json:
    """The receiver's purge: its transactions are ``store.purge`` ones too."""
    return s.receipts.purge(RETENTION_S, a.get("limit", 100))


def _outbox_claim(s: Stores, a: dict[str, Any]) -> Json:
    return [[r.reply_id, r.fence] for r in s.outbox.claim(a["owner"], a.get("n", 1))]


def _mark_sent(s: Stores, a: dict[str, Any]) -> Json:
    s.outbox.mark_sent(a["reply_id"], a["owner"], a["fence"], a["entry_id"])
    return None


def _reply_retry(s: Stores, a: dict[str, Any]) -> Json:
    return s.outbox.retry(a["reply_id"], a["owner"], a["fence"], a["error"])


def _reply_dead(s: Stores, a: dict[str, Any]) -> Json:
    s.outbox.mark_dead(a["reply_id"], a["owner"], a["fence"], a["error"])
    return None


def _reply_replay(s: Stores, a: dict[str, Any]) -> Json:
    return s.outbox.replay(a["reply_id"], a["by"]).replays


def apply_receipt(
    receipts: ReceiptStore,
    *,
    reply_id: str,
    content_hash: str,
    principal: str,
    body: bytes,
    effect: Effect | None,
    entry_id: str | None = None,
) -> tuple[ReceiptOutcome, Receipt]:
    """One reply through ``ReceiptStore.apply_many`` (the receiver's path); an exception of
    the effect is raised again, as the receiver reports it."""
    item = ReceiptItem(reply_id, content_hash, principal, body, entry_id)
    (done,) = receipts.apply_many([item], effect)
    if done.error is not None:
        raise done.error
    assert done.outcome is not None
    assert done.receipt is not None
    return done.outcome, done.receipt


def _receipt(s: Stores, a: dict[str, Any]) -> Json:
    outcome, receipt = apply_receipt(
        s.receipts,
        reply_id=a["reply_id"],
        content_hash=a["content_hash"],
        principal=a["principal"],
        body=a["body"].encode("utf-8"),
        effect=record_effect if a.get("effect", True) else None,
    )
    return [outcome.value, receipt.effect_result]


OPS: dict[str, Callable[[Stores, dict[str, Any]], Json]] = {
    "accept": _accept,
    "claim": _claim,
    "claim_each": _claim_each,
    "finish": _finish,
    "fail": _fail,
    "cancel": _cancel,
    "renew": _renew,
    "reconcile": _reconcile,
    "purge": _purge,
    "purge_receipts": _purge_receipts,
    "outbox_claim": _outbox_claim,
    "mark_sent": _mark_sent,
    "reply_retry": _reply_retry,
    "reply_dead": _reply_dead,
    "reply_replay": _reply_replay,
    "receipt": _receipt,
}


def run_op(db_path: str | Path, now: float, op: str, args: dict[str, Any]) -> Json:
    """Open the database, run ``op`` at the fake time ``now`` and return its JSON result."""
    with open_any(db_path) as db:
        if op == "receipt":
            create_effects_table(db)
        return OPS[op](stores(db, FakeClock(now), args.get("seed", 0)), args)


# -- the claim server -----------------------------------------------------------------------


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve(db_path: str, owner: str) -> int:
    clock = FakeClock(T0)
    with open_any(db_path) as db:
        tasks = stores(db, clock).tasks
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                return 0
            if words[0] != "claim" or len(words) != 3:
                _say(json.dumps({"error": f"bad command {line!r}"}))
                return 2
            clock.set(float(words[1]))
            go = words[2]
            _say("ready")
            give_up = time.monotonic() + 30.0
            while not os.path.exists(go):  # a start barrier, not a wait for time to pass
                if time.monotonic() > give_up:
                    _say(json.dumps({"error": "go file never appeared"}))
                    return 3
                os.sched_yield()
            _say(json.dumps([t.task_id for t in tasks.claim(owner, 1)]))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "op":
        _, db_path, now, op, args = argv
        result = run_op(db_path, float(now), op, json.loads(args))
        print(json.dumps(result), flush=True)
        return 0
    if len(argv) == 3 and argv[0] == "serve":
        return serve(argv[1], argv[2])
    print(__doc__, file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

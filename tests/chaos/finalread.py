"""Final reads: the ground truth the checker judges, taken after every component stopped.

Everything comes from the stores themselves, never from logs: the
adapter's tables (tasks, inbox, outbox) in its SQLite file or PostgreSQL database, the
receivers' receipts and effect ledgers, the handler's effects database, and from Redis the
inbound and reply streams, their dead-letter streams, pending lists and undelivered
entries. SQLite files are opened read-only (``mode=ro``), a PostgreSQL database in a
read-only session (``default_transaction_read_only``); both answer the same SQL (the two
schemas name their tables and columns alike), through ``open_ro``. Redis is read with
XRANGE / XPENDING / XINFO only.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from broker_adapter.protocol.keys import INGEST_GROUP, RECEIVER_GROUP, Keys
from tests.chaos.model import (
    AttemptRec,
    DeadLetterRec,
    EffectRec,
    FinalState,
    InboxRec,
    OutboxRec,
    ReceiptRec,
    TaskRec,
)

PAGE = 1000
#: The first field of every inbound entry the harness made bad: its ``<principal>:<id>``.
CHAOS_KEY_FIELD = b"chaos_key"
#: The first field of every reply stream entry the harness forged or poisoned: its mark.
CHAOS_FORGED_FIELD = b"chaos_forged"
#: The ``status`` of a forged reply body (so a receiver effect made from one shows it).
FORGED_STATUS = "forged"


#: The adapter's database: a SQLite file, or a ``postgresql://`` URL.
StoreTarget = Path | str


def is_postgres(target: StoreTarget) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def _store_errors() -> tuple[type[Exception], ...]:
    try:
        import psycopg
    except ImportError:
        return (sqlite3.Error,)
    return (sqlite3.Error, psycopg.Error)


#: What reading a store may raise (a table not made yet, a busy or a killed session).
STORE_ERRORS = _store_errors()


class _PgReader:
    """A read-only PostgreSQL session that takes the portable SQL (``?`` placeholders) and
    gives rows by column name, like ``sqlite3.Row``."""

    def __init__(self, url: str) -> None:
        import psycopg
        from psycopg.rows import dict_row

        self.conn = psycopg.connect(url, autocommit=True, row_factory=dict_row, connect_timeout=10)
        self.conn.execute("SET default_transaction_read_only = on")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        from broker_adapter.store.sql import pg_sql

        return self.conn.execute(pg_sql(sql), tuple(params))

    def close(self) -> None:
        self.conn.close()


@contextmanager
def open_ro(target: StoreTarget, timeout_s: float = 30.0) -> Iterator[Any]:
    """A read-only connection to a store (SQLite file or PostgreSQL URL): ``execute(sql,
    params)`` with ``?`` placeholders, rows readable by column name."""
    conn: Any = _PgReader(str(target)) if is_postgres(target) else _ro(Path(target), timeout_s)
    try:
        yield conn
    finally:
        conn.close()


def store_rows(target: StoreTarget, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """The rows of one read-only query of a store; none while it cannot be read (not made
    yet, busy, its session killed)."""
    if not is_postgres(target) and not Path(target).exists():
        return []
    try:
        with open_ro(target, timeout_s=10.0) as c:
            return list(c.execute(sql, params).fetchall())
    except STORE_ERRORS:
        return []


@dataclass(frozen=True)
class Sources:
    """Where a run keeps its state.

    Attributes:
        adapter_db: the adapter's database, shared by every adapter process: a SQLite
            file or a ``postgresql://`` URL.
        receiver_dbs: principal -> that principal's receiver database.
        effects_db: the chaos handler's effects database.
        prefix: the Redis key prefix.
        principals: every agent principal.
        partitions: the inbound partition streams (1: the shared stream alone).
    """

    adapter_db: StoreTarget
    receiver_dbs: dict[str, Path]
    effects_db: Path
    prefix: str
    principals: tuple[str, ...]
    partitions: int = 1


def _ro(path: Path, timeout_s: float = 30.0) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    conn.row_factory = sqlite3.Row
    return conn


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return row is not None


def _json(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (TypeError, ValueError, RecursionError):  # a planted entry nests 50,000 deep
        return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_adapter(target: StoreTarget, final: FinalState) -> None:
    """Tasks, inbox and outbox of the adapter database (SQLite or PostgreSQL)."""
    if not is_postgres(target) and not Path(target).exists():
        return
    with open_ro(target) as c:
        for r in c.execute(
            "SELECT task_id, principal, message_id, state, fence, attempts, max_attempts,"
            " fingerprint, owner, lease_until, result, error, created_at, finished_at FROM tasks"
        ):
            final.tasks.append(
                TaskRec(
                    task_id=r["task_id"],
                    principal=r["principal"],
                    message_id=r["message_id"],
                    state=r["state"],
                    fence=r["fence"],
                    attempts=r["attempts"],
                    max_attempts=r["max_attempts"],
                    fingerprint=r["fingerprint"],
                    owner=r["owner"],
                    lease_until=r["lease_until"],
                    result=_json(r["result"]),
                    error=r["error"],
                    created_at=r["created_at"],
                    finished_at=r["finished_at"],
                )
            )
        for r in c.execute(
            "SELECT principal, message_id, fingerprint, task_id, duplicates, conflicts FROM inbox"
        ):
            final.inbox.append(
                InboxRec(
                    principal=r["principal"],
                    message_id=r["message_id"],
                    fingerprint=r["fingerprint"],
                    task_id=r["task_id"],
                    duplicates=r["duplicates"],
                    conflicts=r["conflicts"],
                )
            )
        for r in c.execute(
            "SELECT reply_id, task_id, principal, message_id, status, state, content_hash, body,"
            " attempts, last_error FROM outbox"
        ):
            body = _json(bytes(r["body"]).decode("utf-8", "replace")) or {}
            final.outbox.append(
                OutboxRec(
                    reply_id=r["reply_id"],
                    task_id=r["task_id"],
                    principal=r["principal"],
                    message_id=r["message_id"],
                    status=r["status"],
                    state=r["state"],
                    content_hash=r["content_hash"],
                    fence=_int_or_none(body.get("fence")),
                    fingerprint=body.get("fingerprint"),
                    attempts=r["attempts"],
                    last_error=r["last_error"],
                )
            )


def read_receiver(principal: str, path: Path, final: FinalState) -> None:
    """One receiver's receipts and, if it keeps one, its append-only effect ledger."""
    if not path.exists():
        return
    with closing(_ro(path)) as c:
        if _has_table(c, "receipts"):
            for r in c.execute(
                "SELECT reply_id, principal, content_hash, task_id, status, body, received_at,"
                " effects FROM receipts"
            ):
                body = _json(bytes(r["body"]).decode("utf-8", "replace")) or {}
                forged = body.get("chaos_forged")
                final.receipts.append(
                    ReceiptRec(
                        reply_id=r["reply_id"],
                        principal=r["principal"],
                        content_hash=r["content_hash"],
                        task_id=r["task_id"],
                        status=r["status"],
                        fence=_int_or_none(body.get("fence")),
                        received_at=r["received_at"],
                        effects=r["effects"],
                        forged=forged if isinstance(forged, str) else None,
                    )
                )
        if _has_table(c, "chaos_effects"):
            final.ledger_principals.add(principal)
            for rid, status, n in c.execute(
                "SELECT reply_id, status, count(*) FROM chaos_effects GROUP BY reply_id, status"
            ):
                final.receiver_effects[rid] = final.receiver_effects.get(rid, 0) + int(n)
                if status == FORGED_STATUS:
                    final.forged_effects[rid] = final.forged_effects.get(rid, 0) + int(n)


def read_effects(path: Path, final: FinalState) -> None:
    """The handler's idempotent effects and its append-only attempt ledger."""
    if not path.exists():
        return
    with closing(_ro(path)) as c:
        if _has_table(c, "effects"):
            for r in c.execute(
                "SELECT idempotency_key, task_id, principal, message_id, first_fence, last_fence,"
                " applications FROM effects"
            ):
                final.effects.append(EffectRec(*tuple(r)))
        if _has_table(c, "attempts"):
            for r in c.execute(
                "SELECT task_id, principal, message_id, fence, attempt, event FROM attempts"
            ):
                final.attempts.append(AttemptRec(*tuple(r)))


def sqlite_health(path: Path) -> tuple[str, int]:
    """``PRAGMA integrity_check`` and the size of the ``-wal`` file (0 if none)."""
    if not path.exists():
        return "missing", 0
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)) as c:
        verdict = str(c.execute("PRAGMA integrity_check").fetchone()[0])
    wal = Path(f"{path}-wal")
    return verdict, wal.stat().st_size if wal.exists() else 0


# -- Redis --------------------------------------------------------------------------------


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def xrange_all(client: redis.Redis, stream: str) -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Every entry of ``stream``, in pages."""
    start = "-"
    while True:
        page = client.xrange(stream, min=start, max="+", count=PAGE)
        if not page:
            return
        for eid, fields in page:
            yield _text(eid), {bytes(k): bytes(v) for k, v in (fields or {}).items()}  # type: ignore[arg-type]
        start = "(" + _text(page[-1][0])
        if len(page) < PAGE:
            return


def group_state(client: redis.Redis, stream: str, group: str) -> tuple[int, int]:
    """``(pending, undelivered)`` of one group; ``(0, 0)`` when the stream or group is absent.

    Undelivered counts the entries after the group's last-delivered-id.
    """
    if not client.exists(stream):
        return 0, 0
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return 0, 0
    for g in groups:
        if _text(g.get("name")) != group:
            continue
        pending = int(g.get("pending", 0))
        last = _text(g.get("last-delivered-id", "0-0"))
        after = client.xrange(stream, min="(" + last, max="+", count=PAGE) or []
        return pending, len(after)
    # No group at all: everything in the stream is undelivered.
    return 0, int(client.xlen(stream))


def dead_letter(stream: str, entry_id: str, fields: dict[bytes, bytes]) -> DeadLetterRec:
    """Parse one dead-letter entry: reason, the harness's markers, the original identity."""
    reason = _text(fields.get(b"dl.reason", b"?"))
    chaos = fields.get(b"orig." + CHAOS_KEY_FIELD)
    forged = fields.get(b"orig." + CHAOS_FORGED_FIELD)
    sender = message_id = None
    env = _json(_text(fields[b"orig.env"])) if b"orig.env" in fields else None
    if isinstance(env, dict):
        s, m = env.get("sender"), env.get("message_id")
        sender = s if isinstance(s, str) else None
        message_id = m if isinstance(m, str) else None
    if message_id is None and b"orig.body" in fields:  # a reply's dead letter
        body = _json(_text(fields[b"orig.body"]))
        if isinstance(body, dict) and isinstance(body.get("reply_id"), str):
            message_id = body["reply_id"]
    return DeadLetterRec(
        stream=stream,
        entry_id=entry_id,
        reason=reason,
        chaos_key=_text(chaos) if chaos is not None else None,
        sender=sender,
        message_id=message_id,
        chaos_forged=_text(forged) if forged is not None else None,
    )


def read_redis(
    client: redis.Redis,
    prefix: str,
    principals: tuple[str, ...],
    final: FinalState,
    partitions: int = 1,
) -> None:
    """Streams, dead letters, pending lists and undelivered entries (of every inbound
    partition). Entries the harness planted on the reply streams (``chaos_forged``) are
    counted apart from the copies."""
    keys = Keys(prefix)
    for inbound in keys.inbound_partitions(partitions):
        pending, undelivered = group_state(client, inbound, INGEST_GROUP)
        final.pending[f"{inbound} {INGEST_GROUP}"] = pending
        final.undelivered[f"{inbound} {INGEST_GROUP}"] = undelivered
        dead = keys.dead_for(inbound)
        for eid, fields in xrange_all(client, dead):
            final.dead_letters.append(dead_letter(dead, eid, fields))
    copies: Counter[str] = Counter()
    for p in principals:
        stream = keys.replies(p)
        for _eid, fields in xrange_all(client, stream):
            if CHAOS_FORGED_FIELD in fields:
                final.forged_on_streams += 1
            else:
                copies[_text(fields.get(b"reply_id", b"?"))] += 1
        pending, undelivered = group_state(client, stream, RECEIVER_GROUP)
        final.pending[f"{stream} {RECEIVER_GROUP}"] = pending
        final.undelivered[f"{stream} {RECEIVER_GROUP}"] = undelivered
        rdead = keys.replies_dead(p)
        for eid, fields in xrange_all(client, rdead):
            final.reply_dead_letters.append(dead_letter(rdead, eid, fields))
    final.reply_copies = dict(copies)


def read_final(sources: Sources, client: redis.Redis) -> FinalState:
    """Everything the checker needs, from every store of one run."""
    final = FinalState()
    read_adapter(sources.adapter_db, final)
    for principal, path in sources.receiver_dbs.items():
        read_receiver(principal, path, final)
    read_effects(sources.effects_db, final)
    read_redis(client, sources.prefix, sources.principals, final, sources.partitions)
    dbs: dict[str, Path] = {"effects": sources.effects_db}
    if not is_postgres(sources.adapter_db):  # the SQLite checks are for SQLite files
        dbs["adapter"] = Path(sources.adapter_db)
    dbs.update({f"receiver-{p}": path for p, path in sources.receiver_dbs.items()})
    for name, path in dbs.items():
        verdict, wal = sqlite_health(path)
        final.integrity[name] = verdict
        final.wal_bytes[name] = wal
    return final

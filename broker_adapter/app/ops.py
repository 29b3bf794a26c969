"""Operator views: ``status`` and ``dead-letters``. Reads the database and Redis; the only
writes are an explicit replay, which goes through the same fenced paths as the adapter."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from broker_adapter.app.audit import audit, bounded_text, os_user
from broker_adapter.client.dead_letters import letter_view
from broker_adapter.clock import SystemClock
from broker_adapter.protocol.deadletter import DeadLetter
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.redis.client import call, connect, text
from broker_adapter.store import OutboxStore
from broker_adapter.store.backends import open_store
from broker_adapter.store.dbclock import clock_report, read_now
from broker_adapter.store.outbox_types import OUTBOX_STATES
from broker_adapter.store.report import snapshot, task_counts


def _streams(client: Any, pattern: str) -> list[str]:
    """The keys matching ``pattern`` (SCAN), sorted, each once."""
    return sorted({text(k) for k in call(lambda: list(client.scan_iter(match=pattern)))})


def _dead_streams(client: Any, prefix: str) -> list[str]:
    return _streams(client, f"{prefix}:{{*}}:dead")


def collect_status(db_path: Path | str, redis_url: str | None, prefix: str) -> dict[str, Any]:
    """Everything ``broker-adapter status`` shows, as one JSON-ready dict.

    Raises:
        ConfigError: there is no database at ``db_path`` (none is created).
    """
    db = open_store(db_path, read_only=True)  # a SQLite file or a postgresql:// URL
    try:
        report: dict[str, Any] = snapshot(db, read_now(db, SystemClock()))
        report["clock"] = clock_report(db)
        by_task = task_counts(db)
        if by_task:  # only once tasks were sent with a name
            report["by_task"] = by_task
    finally:
        db.close()
    if redis_url:
        client: Any = connect(redis_url)
        streams: dict[str, Any] = {}
        for stream in _streams(client, f"{prefix}:{{in*}}:tasks"):
            info = call(partial(client.xpending, stream, INGEST_GROUP))
            streams[stream] = {
                "length": call(partial(client.xlen, stream)),
                "pending": int(info.get("pending", 0)),
                "pending_by_consumer": {
                    text(c["name"]): int(c["pending"]) for c in info.get("consumers") or []
                },
            }
        report["redis"] = {
            "inbound": streams,
            "dead_letters": {
                s: call(partial(client.xlen, s)) for s in _dead_streams(client, prefix)
            },
        }
    return report


def format_status(report: dict[str, Any]) -> str:
    r, p, t, d = (report[k] for k in ("received", "processing", "terminal", "delivery"))
    oldest = d["oldest_unsent_age_s"]  # None: nothing unsent
    lines = [
        f"received    inbox {r['inbox']}  (duplicates {r['duplicates']}, "
        f"conflicts {r['conflicts']})",
        f"processing  pending {p['pending']} (ready {p['ready']})  running {p['running']}  "
        f"live leases {p['live_leases']}  expired leases {p['expired_leases']}",
        "terminal    " + "  ".join(f"{k} {v}" for k, v in t.items()),
        "delivery    "
        + "  ".join(f"{k} {d[k]}" for k in OUTBOX_STATES)
        + f"  oldest unsent {'-' if oldest is None else f'{oldest}s'}",
    ]
    for name, states in report.get("by_task", {}).items():
        counts = "  ".join(f"{k} {v}" for k, v in sorted(states.items()))
        lines.append(f"task        {name or '(default)'}: {counts}")
    clock = report.get("clock")
    if clock and clock["skew_s"] is not None:
        lines.append(f"clock       {clock['source']}: this host {clock['skew_s']:+.3f} s")
    fx = report.get("effects")
    # only once something reached an external effect (every claim counts an attempt)
    if fx and any(v for k, v in fx.items() if k != "task_attempts"):
        lines.append(
            f"effects     unknown {fx['unknown']} (awaiting operator {fx['awaiting_operator']},"
            f" overdue {fx.get('operator_overdue', 0)}, oldest"
            f" {fx.get('oldest_unknown_age_s', 0)}s)"
            f"  reconciled done {fx['reconciled_done']} not-done {fx['reconciled_not-done']}"
            f" unknown {fx['reconciled_unknown']}  compensations done"
            f" {fx['compensations_done']} failed {fx['compensations_failed']}"
            f" started {fx['compensations_started']} open {fx.get('compensations_open', 0)}"
        )
        lines.append(
            f"approvals   waiting {fx['waiting_approval']}  valid {fx['approvals_valid']}"
            f"  expired {fx['approvals_expired']}  revoked {fx['approvals_revoked']}"
        )
    if "redis" in report:
        for stream, info in report["redis"]["inbound"].items():
            per = ", ".join(f"{c}={n}" for c, n in info["pending_by_consumer"].items()) or "-"
            lines.append(
                f"redis       {stream}: length {info['length']}, pending {info['pending']} ({per})"
            )
        for stream, n in report["redis"]["dead_letters"].items():
            lines.append(f"dead        {stream}: {n}")
    return "\n".join(lines)


def watch_status(
    db_path: Path | str,
    redis_url: str | None,
    prefix: str,
    interval_s: float,
    *,
    as_json: bool = False,
    out: TextIO | None = None,
    iterations: int | None = None,
    wait: Callable[[float], object] = time.sleep,
    now: Callable[[], float] = time.time,
) -> int:
    """``status --watch``: show ``collect_status`` every ``interval_s`` until Ctrl-C
    (exit 0). On a terminal each view replaces the last; elsewhere (and with
    ``as_json``, one object per line with its time in ``at``) they follow each other.
    Each view opens the database read-only; a Redis that does not answer is one line of
    the view, and the next one looks again.

    Args:
        iterations: stop after this many views (tests; ``None``: until interrupted).
        wait, now: the pause between views and the clock of their headers (tests).

    Raises:
        ConfigError: there is no database at ``db_path``.
    """
    from broker_adapter.errors import TransientError

    stream = out if out is not None else sys.stdout
    clear = not as_json and stream.isatty()
    shown = 0
    try:
        while iterations is None or shown < iterations:
            if shown:
                wait(interval_s)
            at = now()
            try:
                report = collect_status(db_path, redis_url, prefix)
                problem = None
            except TransientError as exc:  # Redis away: the database part still shows
                report, problem = collect_status(db_path, None, prefix), str(exc)
            if as_json:
                line = {"at": at, **report, **({"redis_error": problem} if problem else {})}
                stream.write(json.dumps(line, sort_keys=True, default=str) + "\n")
            else:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
                header = f"{stamp}  every {interval_s:g} s, Ctrl-C to stop"
                body = format_status(report)
                if problem:
                    body += f"\nredis       not answering: {problem}"
                stream.write(
                    ("\x1b[H\x1b[2J" if clear else "\n" if shown else "") + f"{header}\n{body}\n"
                )
            stream.flush()
            shown += 1
    except KeyboardInterrupt:
        stream.write("\n")
    return 0


def _reply_view(row: Any) -> dict[str, Any]:
    return {
        "type": "reply",
        "reply_id": row.reply_id,
        "task_id": row.task_id,
        "principal": row.principal,
        "message_id": row.message_id,
        "status": row.status,
        "state": row.state,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "replays": row.replays,
        "replayed_by": row.replayed_by,
    }


def _entry_view(stream: str, entry_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    letter = DeadLetter.parse(fields)
    return {
        "type": "entry",
        **letter_view(stream, entry_id, letter),
        "deliveries": letter.deliveries,
        "fields": letter.fields,
    }


def dead_letters_command(args: argparse.Namespace) -> int:
    """``dead-letters list|show|replay``: dead replies (database) and dead-letter entries
    (Redis, when ``--redis`` is given)."""
    from broker_adapter.errors import ConfigError

    db = open_store(args.db, read_only=args.dl_command != "replay")  # SQLite or postgresql://
    outbox = OutboxStore(db)
    client: Any = connect(args.redis) if args.redis else None
    out: list[dict[str, Any]] = []
    try:
        if args.dl_command == "list":
            out = [_reply_view(r) for r in outbox.list(state="dead")]
            if client is not None:
                out.extend(dead_letter_entries(client, args.prefix))
        elif args.dl_command == "show":
            row = outbox.get(args.id)
            if row is not None:
                out = [{**_reply_view(row), "body": json.loads(row.body)}]
            elif client is not None:
                for stream in _dead_streams(client, args.prefix):
                    for eid, fields in call(partial(client.xrange, stream, args.id, args.id)):
                        out.append(_entry_view(stream, text(eid), fields))
            if not out:
                raise ConfigError(f"no dead reply or dead-letter entry {args.id!r}")
        else:
            by = f"{bounded_text('--by', args.by)} (os user {os_user()})"
            audit("dead-letters replay", id=args.id, by=by)
            out = [replay_dead_letter(outbox, client, args.prefix, args.id, by)]
    finally:
        db.close()
    for item in out:
        print(json.dumps(item, sort_keys=True, default=str) if args.json else _line(item))
    return 0


def _line(item: dict[str, Any]) -> str:
    """One item of ``dead-letters`` as a line for a person: a dead reply or entry
    (``list``, ``show``), or what a ``replay`` did."""
    if item.get("replayed_to") is not None:
        return (
            f"replayed entry {item['entry_id']} from {item['stream']} to "
            f"{item['replayed_to']} as {item['new_entry_id']}"
        )
    if item.get("outcome") is not None:
        return f"replayed reply {item['reply_id']}: {item['outcome']}"
    if item["type"] == "reply":
        return (
            f"reply {item['reply_id']}  {item['status']}  state={item['state']}  "
            f"attempts={item['attempts']}  last_error={item['last_error']}"
        )
    return (
        f"entry {item['stream']} {item['entry_id']}  reason={item['reason']}  "
        f"{item.get('detail') or ''}"
    )


def dead_letter_entries(client: Any, prefix: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The dead-letter entries of every dead-letter stream under ``prefix`` (Redis), each
    as ``dead-letters list`` shows it; with ``limit``, at most that many per stream, the
    newest."""
    out: list[dict[str, Any]] = []
    for stream in _dead_streams(client, prefix):
        if limit is None:
            entries = call(partial(client.xrange, stream))
        else:
            entries = list(reversed(call(partial(client.xrevrange, stream, count=limit))))
        out.extend(_entry_view(stream, text(eid), fields) for eid, fields in entries)
    return out


def replay_dead_letter(
    outbox: OutboxStore, client: Any, prefix: str, item_id: str, by: str
) -> dict[str, Any]:
    """``dead-letters replay``'s and the console's: publish a dead reply again (through
    the fenced replay, recorded under ``by``), or put a dead-letter entry back on the
    stream it came from (in one MULTI: added there, deleted from the dead-letter stream).

    Raises:
        ConfigError: no such dead reply or entry, a reply without ``client``, or an entry
            that does not hold its original as it was.
    """
    from broker_adapter.errors import ConfigError

    row = outbox.get(item_id)
    if row is not None:
        if client is None:
            raise ConfigError("replaying a reply needs --redis (it checks Redis first)")
        from broker_adapter.stages.dispatch.replay import Replayer

        result = Replayer(client, outbox, Keys(prefix)).replay(item_id, by=by)
        return {
            "type": "reply",
            "reply_id": item_id,
            "replay": str(result),
            "outcome": result.outcome.value,
        }
    if client is None:
        raise ConfigError(f"no dead reply {item_id!r} in the database (entries need --redis)")
    keys = Keys(prefix)
    for stream in _dead_streams(client, prefix):
        entries = call(partial(client.xrange, stream, item_id, item_id))
        if not entries:
            continue
        letter = DeadLetter.parse(entries[0][1])
        source = letter.source
        if not source or keys.dead_for(source) != stream:
            raise ConfigError(f"dead-letter entry {item_id} does not name its source stream")
        if not letter.complete:
            # Only part of the original was copied, or a repeated name would collapse: a
            # replay would not give back the same entry (it is still in its stream).
            raise ConfigError(
                f"dead-letter entry {item_id} does not hold its original as it was; the "
                f"original is {letter.source_entry_id or '?'} in {source}"
            )
        original = letter.original
        if not original:
            raise ConfigError(f"dead-letter entry {item_id} kept no original fields to replay")
        pipe = client.pipeline(transaction=True)
        pipe.xadd(source, original)
        pipe.xdel(stream, item_id)
        new_id, _ = call(pipe.execute)
        return {
            "type": "entry",
            "stream": stream,
            "entry_id": item_id,
            "replayed_to": source,
            "new_entry_id": text(new_id),
        }
    raise ConfigError(f"no dead reply or dead-letter entry {item_id!r}")

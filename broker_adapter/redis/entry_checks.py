"""What a group reader checks of each entry before handing it on, and how it counts and
logs what it refused.

The reader refuses, before anyone parses them: deleted or trimmed entries, entries
delivered more than ``max_deliveries`` times (the counts come from XPENDING:
``with_deliveries``), too many fields or bytes (a plain read's), and a repeated field name
(``duplicate_field``): ``entry_refusal``. Entries and submit-list items refused inside Redis
(``screening``) are counted and logged here too (``count_screened``, ``count_admitted``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker_adapter.redis.admission import Admitted
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.reader_config import ReaderConfig, ReaderStats

if TYPE_CHECKING:
    import redis


def with_deliveries(
    client: redis.Redis, stream: str, group: str, consumer: str, entries: list[StreamEntry]
) -> list[StreamEntry]:
    """Attach delivery counts (from XPENDING) to entries that came from a pending list."""
    ids = [e.entry_id for e in entries]
    with translated():
        rows = client.xpending_range(
            stream,
            group,
            min=min(ids, key=_id_key),
            max=max(ids, key=_id_key),
            count=len(ids) * 2 + 10,
            consumername=consumer,
        )
    counts = {text(r["message_id"]): int(r["times_delivered"]) for r in rows}  # type: ignore[arg-type]
    return [e._replace(deliveries=counts.get(e.entry_id, 1)) for e in entries]


def entry_refusal(
    entry: StreamEntry, cfg: ReaderConfig, stats: ReaderStats
) -> tuple[str, str, dict[str, str]] | None:
    """Why ``entry`` must not be handed on, as ``(reason, detail, extra)``, or None.

    In this order: deleted, past the delivery limit, too many fields, too large, a
    repeated field name. The checks look at counts and lengths only (the per-entry cost
    on the hot path is a few list lengths)."""
    fields = entry.fields
    if fields is None:
        stats.deleted += 1
        return "payload_deleted", "entry was deleted or trimmed", {}
    if entry.deliveries > cfg.max_deliveries:
        detail = f"delivered {entry.deliveries} times, limit {cfg.max_deliveries}"
        return "delivery_limit", detail, {}
    pairs = entry.flat()
    if len(pairs) > 2 * cfg.max_entry_fields:
        detail = f"entry has {len(pairs) // 2} fields, limit {cfg.max_entry_fields}"
        return "too_many_fields", detail, {"dl.field": ""}
    size = sum(map(len, pairs))
    if size > cfg.max_entry_bytes:
        detail = f"entry is {size} bytes, limit {cfg.max_entry_bytes}"
        return "oversize", detail, {"dl.field": ""}
    if 2 * len(fields) != len(pairs):
        name = text(_repeated_name(pairs))
        detail = f"field {name!r} appears more than once"
        return "duplicate_field", detail, {"dl.field": name}
    return None


def count_screened(
    refused: Sequence[tuple[str, str]], stats: ReaderStats, log: logging.Logger, stream: str
) -> None:
    """Count and log the entries a screened read dead-lettered inside Redis."""
    for entry_id, reason in refused:
        stats.dead_lettered += 1
        stats.by_reason[reason] = stats.by_reason.get(reason, 0) + 1
        log.warning("dead-lettered %s from %s: %s (screened in Redis)", entry_id, stream, reason)


def count_admitted(
    admitted: Admitted,
    stats: ReaderStats,
    log: logging.Logger,
    *,
    stream: str,
    submit: str | None,
    dead_stream: str,
    last_error: str,
) -> str:
    """Count and log what a read moved from the submit list (or refused there); the
    admission error to remember (one alarm per error, not one per read: ``last_error``)."""
    stats.admitted += admitted.count
    for reason in admitted.refused:
        dropped = reason.startswith("dropped:")
        reason = reason.removeprefix("dropped:")
        stats.dead_lettered += 1
        stats.by_reason[reason] = stats.by_reason.get(reason, 0) + 1
        if dropped:
            stats.dead_letter_failures += 1
            log.error(
                "ALARM: an item of %s was refused (%s) and no dead letter could be "
                "written to %s: it is gone",
                submit,
                reason,
                dead_stream,
            )
        else:
            log.warning("dead-lettered an item of %s: %s (screened in Redis)", submit, reason)
    if admitted.error and admitted.error != last_error:
        log.error(
            "ALARM: cannot add entries of %s to %s (%s): they wait in the list "
            '(docs/OPERATIONS.md, "A stream with ids in the future")',
            submit,
            stream,
            admitted.error,
        )
    return admitted.error


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _repeated_name(pairs: Sequence[bytes]) -> bytes:
    """The first field name that ``pairs`` repeats (``b""`` if none does)."""
    seen: set[bytes] = set()
    for name in pairs[::2]:
        if name in seen:
            return name
        seen.add(name)
    return b""

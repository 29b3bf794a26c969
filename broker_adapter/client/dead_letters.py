"""A principal's own dead letters, as its client may read them: the refusals of its
replies (its reply stream's dead letters) and of its requests (the inbound streams' dead
letters that name it as their principal)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from broker_adapter.protocol.deadletter import DeadLetter
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import text, translated

if TYPE_CHECKING:
    from broker_adapter.redis.client import AsyncRedis

#: How many entries of one dead-letter stream are looked at, newest first.
SCAN_PER_STREAM = 1000


def letter_view(stream: str, entry_id: str, letter: DeadLetter) -> dict[str, Any]:
    """What a listing shows of one dead letter (``ops`` adds its own fields)."""
    return {
        "stream": stream,
        "entry_id": entry_id,
        "reason": letter.reason,
        "detail": letter.detail,
        "source": letter.source,
        "source_entry_id": letter.source_entry_id,
    }


async def principal_dead_letters(
    redis: AsyncRedis, keys: Keys, principal: str, partitions: int, limit: int
) -> list[dict[str, Any]]:
    """Up to ``limit`` of ``principal``'s dead letters, newest first in each stream: its
    reply stream's, its own inbound stream's (ACL mode) and those of the shared inbound
    partitions that name it (``dl.principal``). What a dead letter copied of the entry is
    left out: only the reason and where it came from."""
    own = [keys.replies_dead(principal), keys.inbound_dead(principal)]
    shared = [keys.dead_for(s) for s in keys.inbound_partitions(partitions)]
    found: list[dict[str, Any]] = []
    for stream in own + shared:
        with translated():
            got = await redis.xrevrange(stream, count=SCAN_PER_STREAM)
        rows = cast(list[tuple[bytes, dict[bytes, bytes]]], got or [])
        for entry_id, fields in rows:
            letter = DeadLetter.parse(fields)
            if stream in shared and letter.fields.get("dl.principal") != principal:
                continue
            found.append(letter_view(stream, text(entry_id), letter))
            if len(found) >= limit:
                return found
    return found

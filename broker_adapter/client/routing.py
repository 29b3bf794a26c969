"""How a requester finds the reply to its own request: by message id, never by a group.

Every instance of a principal reads the principal's reply stream ``replies(P)`` from where
it stood when it published (``XREAD``, no consumer group), and hands each reply to the
request waiting for its ``message_id``; replies to other instances' requests are passed
over. A plain ``Receiver`` of the principal keeps its group and applies every reply, as
before. A reply the tail missed (the stream trimmed it first, or the requester restarted)
is read from its result record (``redis.results``: ``keys.reply_result(P, message_id)``),
which the adapter writes when it publishes a terminal reply.

Why no group and no stream per instance: a group left behind by an instance that never
returns would hold the stream's trim point forever, and a stream per instance needs the
adapter to know instances. Here an instance that never returns leaves nothing in Redis:
its requests' replies are trimmed with the stream and their result records purged after
the result window. The price is that each instance waiting for replies reads every reply
of its principal (one ``XREAD`` per ``block_ms`` or per batch of replies, only while it
has requests in flight): fine for the handful of instances one agent runs; a principal
with very many concurrent instances and a high reply rate should split into principals.

Every reply is checked before it is handed over (``protocol.reply_entry``: signature
first), whichever way it came.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from broker_adapter.errors import TransientError
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import BadReply, Reply
from broker_adapter.protocol.reply_entry import verify_reply_entry
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import text, translated
from broker_adapter.redis.results import record_fields

if TYPE_CHECKING:
    from broker_adapter.redis.client import AsyncRedis

#: Replies read per ``XREAD``.
READ_COUNT = 256
#: The pause after the reply stream could not be read, seconds.
READ_RETRY_S = 0.2


class ReplyWatch:
    """Tails one principal's reply stream for the requests of one client.

    Args:
        redis: an asyncio client whose socket timeout exceeds ``block_ms``.
        keys: the key layout.
        principal: whose replies.
        keyring: holds the principal's keys (replies are signed with them).
        block_ms: how long one ``XREAD`` waits for new replies.
    """

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        principal: str,
        keyring: Keyring,
        *,
        block_ms: int = 1000,
        logger: logging.Logger | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.principal = principal
        self.keyring = keyring
        self.stream = keys.replies(principal)
        self.block_ms = block_ms
        self.log = logger or logging.getLogger("broker_adapter.client")
        self._waiting: dict[str, asyncio.Future[Reply]] = {}
        self._task: asyncio.Task[None] | None = None
        self._start = asyncio.Lock()
        self._last_id = "0-0"

    async def register(self, message_id: str) -> asyncio.Future[Reply]:
        """A future that gets the reply to ``message_id``; the tail starts (from the
        stream's current end) if it is not running. Call before publishing the request.

        Raises:
            RedisUnavailable: the stream's end could not be read.
        """
        async with self._start:
            if self._task is None or self._task.done():
                self._last_id = await self._tail_id()
                self._task = asyncio.create_task(self._run(), name=f"ba-replies-{self.principal}")
            waiting = self._waiting.get(message_id)
            if waiting is None or waiting.done():
                waiting = asyncio.get_running_loop().create_future()
                self._waiting[message_id] = waiting
            return waiting

    def release(self, message_id: str, waiting: asyncio.Future[Reply]) -> None:
        """The request stopped waiting; the tail stops when no request waits."""
        if self._waiting.get(message_id) is waiting:
            del self._waiting[message_id]

    async def close(self) -> None:
        """Stop the tail (waiting requests get no more replies from it)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def lookup(self, message_id: str) -> Reply | None:
        """The reply recorded for ``message_id`` (its result record), or ``None``.

        Raises:
            RedisUnavailable: Redis could not be asked.
            BadReply: the record is not a reply the adapter signed for this principal.
        """
        with translated():
            raw = await self.redis.hgetall(self.keys.reply_result(self.principal, message_id))
        fields = record_fields(raw)
        if fields is None:
            return None
        reply = verify_reply_entry(fields, self.principal, self.keyring)
        if reply.message_id != message_id:
            raise BadReply("bad_reply", f"record of {message_id!r} holds {reply.message_id!r}")
        return reply

    async def _tail_id(self) -> str:
        with translated():
            last: Any = await self.redis.xrevrange(self.stream, count=1)
        return text(last[0][0]) if last else "0-0"

    async def _run(self) -> None:
        while self._waiting:
            try:
                with translated():
                    read: Any = await self.redis.xread(
                        {self.stream: self._last_id}, count=READ_COUNT, block=self.block_ms
                    )
            except TransientError as exc:
                self.log.debug("reading %s failed, retrying: %s", self.stream, exc)
                await asyncio.sleep(READ_RETRY_S)
                continue
            for _stream, entries in read or []:
                for entry_id, fields in entries:
                    self._last_id = text(entry_id)
                    self._offer(fields)

    def _offer(self, fields: dict[bytes, bytes]) -> None:
        try:
            named = json.loads(fields[b"body"]).get("message_id")
        except (KeyError, ValueError, AttributeError, TypeError):
            return  # not a reply body: the principal's receiver dead-letters it
        waiting = self._waiting.get(named) if isinstance(named, str) else None
        if waiting is None or waiting.done():
            return
        try:
            reply = verify_reply_entry(fields, self.principal, self.keyring)
        except BadReply as exc:
            self.log.warning("reply entry for %r on %s refused: %s", named, self.stream, exc)
            return
        waiting.set_result(reply)

"""The agent side of the inbound protocol: sign an envelope and RPUSH it to the inbound
stream's submit list, from which the adapter adds it to the stream (``XADD`` with ``*``: an
agent never chooses a stream id, docs/PROTOCOL.md section 3).

Invariant kept: a request's identity is (principal, ``message_id``), fixed by the sender
and unchanged across resends (``docs/RULES.md`` rule 1). Publishing the same envelope twice is
therefore safe: the ingest's inbox answers the second copy as a duplicate of the first.

Crash and fault behaviour: the client must not re-send commands by itself (use
``redis.client.connect`` / ``connect_async``, which set ``Retry(NoBackoff(), 0)``), because a
library retry after a lost reply appends a second item without the caller knowing. A failed
publish raises ``RedisUnavailable``, which means *maybe published*: the item may or may not
be in the list. The agent then retries with the SAME envelope (same ``message_id``, same
content); the inbox turns any extra copy into a duplicate. A publisher that crashes before
its RPUSH was answered must do the same after it restarts. Never publish the retry under a
new ``message_id``: that is a second request.

Modes:

* signed (a ``Keyring`` is given): the entry goes to the shared stream's submit list
  ``keys.submit()`` (or its partition's) with ``v``, ``env``, ``kid`` and ``sig`` (see
  ``protocol.signing`` and ``docs/PROTOCOL.md``);
* ACL (``keyring=None``): the entry goes to the principal's own submit list
  ``keys.submit(principal)`` with only ``v`` and ``env``; Redis ACLs must let this
  connection's user write only that list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from broker_adapter.errors import AuthError, ConfigError, EnvelopeError
from broker_adapter.protocol.envelope import Envelope, check_principal
from broker_adapter.protocol.keys import Keys, partition_of
from broker_adapter.protocol.signing import Keyring, unsigned_fields
from broker_adapter.redis.client import translated

if TYPE_CHECKING:
    from broker_adapter.redis.client import AsyncRedis, Redis


def submit_item(fields: Mapping[str, bytes] | Mapping[bytes, bytes]) -> bytes:
    """The submit-list item of an entry's ``fields``: a JSON array of its names and values,
    in order, each a string (docs/PROTOCOL.md section 3). Values are UTF-8 text (the
    envelope is canonical JSON, the others ASCII)."""
    flat: list[str] = []
    for name, value in fields.items():
        flat += [name if isinstance(name, str) else name.decode(), value.decode()]
    return json.dumps(flat, ensure_ascii=False, separators=(",", ":")).encode()


class ChainLink(Protocol):
    """The task a request is made on behalf of (a handler's ``handler.task.Task``)."""

    @property
    def task_id(self) -> str: ...

    @property
    def correlation_id(self) -> str | None: ...

    @property
    def hops(self) -> int: ...


def chained(envelope: Envelope, parent: ChainLink) -> Envelope:
    """``envelope`` as a request made on behalf of ``parent``: ``parent_id`` is the parent's
    task, ``correlation_id`` the parent's chain (its ``correlation_id``, or its task id for
    a chain's first task; a caller's own value is replaced, so a child stays in its
    chain's budget) and ``hops`` one more than the parent's at least. ``publish(...,
    parent=task)`` does this; the adapter counts the chain by ``correlation_id`` whatever
    the request says (``TaskPolicy.max_chain_tasks``)."""
    chain = parent.correlation_id or parent.task_id
    return envelope.replace(
        parent_id=parent.task_id, correlation_id=chain, hops=max(envelope.hops, parent.hops + 1)
    )


class _Signer:
    """What both publishers share: where to write and which fields to write."""

    def __init__(
        self,
        keys: Keys,
        principal: str,
        keyring: Keyring | None,
        key_id: str | None,
        partitions: int = 1,
    ) -> None:
        try:
            self.principal = check_principal(principal, "principal")
        except EnvelopeError as exc:
            raise ConfigError(f"bad principal {principal!r}: {exc}") from None
        self.keys = keys
        self.keyring = keyring
        if keyring is None:
            if key_id is not None:
                raise ConfigError("key_id needs a keyring (ACL mode sends no signature)")
            self.key_id: str | None = None
            self.stream = keys.inbound(principal)
            self.submit = keys.submit(principal)
        else:
            kids = keyring.key_ids(principal)
            if not kids:
                raise ConfigError(f"keyring has no keys for principal {principal!r}")
            if key_id is not None and key_id not in kids:
                raise ConfigError(f"principal {principal!r} has no key {key_id!r}")
            self.key_id = key_id or kids[0]
            self.stream = keys.inbound_partition(partition_of(principal, partitions))
            self.submit = keys.submit_for(self.stream)

    def fields(self, envelope: Envelope, traceparent: str | None = None) -> dict[str, bytes]:
        """The entry fields for ``envelope`` (signed unless in ACL mode), with its
        ``traceparent`` member set to ``traceparent`` when one is given.

        Raises:
            AuthError: reason ``sender_mismatch`` when ``envelope.sender`` is not this
                publisher's principal.
            EnvelopeError: ``traceparent`` is not a W3C traceparent (``bad_value``).
        """
        if traceparent is not None and traceparent != envelope.traceparent:
            envelope = envelope.replace(traceparent=traceparent)
        if envelope.sender != self.principal:
            raise AuthError(
                "sender",
                "sender_mismatch",
                f"publisher of {self.principal!r} cannot send as {envelope.sender!r}",
            )
        if self.keyring is None:
            return unsigned_fields(envelope)
        return self.keyring.sign(envelope, self.key_id)


class Publisher:
    """Publishes one principal's envelopes to the inbound stream (synchronous redis-py).

    Args:
        client: a client from ``redis.client.connect`` (no automatic re-sends).
        keys: the key schema (its prefix must match the ingest's).
        principal: who publishes; every envelope's ``sender`` must equal it.
        keyring: signs entries (signed mode); ``None`` for ACL mode.
        key_id: the key to sign with; default the principal's first key.
        partitions: how many inbound partitions the ingest reads (signed mode; the
            adapter's ``--partitions``): entries go to ``partition_of(principal, P)``.

    Raises:
        ConfigError: bad principal, or the keyring has no such principal or key, or
            ``partitions`` out of range.
    """

    def __init__(
        self,
        client: Redis,
        keys: Keys,
        principal: str,
        keyring: Keyring | None,
        key_id: str | None = None,
        *,
        partitions: int = 1,
    ) -> None:
        self.client = client
        self._signer = _Signer(keys, principal, keyring, key_id, partitions)

    @property
    def stream(self) -> str:
        """The stream this publisher's entries go to."""
        return self._signer.stream

    @property
    def submit(self) -> str:
        """The submit list this publisher writes to (the adapter moves it into ``stream``)."""
        return self._signer.submit

    def publish(
        self,
        envelope: Envelope,
        *,
        traceparent: str | None = None,
        parent: ChainLink | None = None,
    ) -> str:
        """RPUSH ``envelope`` to the inbound stream's submit list.

        Args:
            envelope: the request.
            parent: the task a handler publishes it for: the request joins that task's
                chain (``chained``: ``parent_id``, ``correlation_id``, ``hops``).
            traceparent: the W3C trace context to send it in (e.g.
                ``stages.shared.tracing.current_traceparent()``), set as the envelope's
                ``traceparent`` member; ``None`` sends the envelope as it is. Not part of
                the request's content: a resend in another trace is still a duplicate.

        Returns:
            the envelope's ``message_id`` (with ``parent``, of the chained envelope):
            returning means only "Redis has the request", not "done". The stream entry id
            is chosen later, by the adapter, when it adds the entry to the stream.

        Raises:
            AuthError: ``envelope.sender`` is not this publisher's principal.
            EnvelopeError: ``traceparent`` is not a W3C traceparent.
            RedisUnavailable: maybe published. Retry with the SAME envelope.
            BrokerAdapterError: Redis refused the write (e.g. ``NOPERM`` under an ACL).
        """
        if parent is not None:
            envelope = chained(envelope, parent)
        fields = self._signer.fields(envelope, traceparent)
        with translated():
            self.client.rpush(self._signer.submit, submit_item(fields))
        return envelope.message_id


class AsyncPublisher:
    """``Publisher`` on ``redis.asyncio``; same arguments, same guarantees.

    Args:
        client: a client from ``redis.client.connect_async`` (no automatic re-sends).
        keys: the key schema.
        principal: who publishes.
        keyring: signs entries (signed mode); ``None`` for ACL mode.
        key_id: the key to sign with; default the principal's first key.
        partitions: how many inbound partitions the ingest reads (signed mode; the
            adapter's ``--partitions``): entries go to ``partition_of(principal, P)``.
    """

    def __init__(
        self,
        client: AsyncRedis,
        keys: Keys,
        principal: str,
        keyring: Keyring | None,
        key_id: str | None = None,
        *,
        partitions: int = 1,
    ) -> None:
        self.client = client
        self._signer = _Signer(keys, principal, keyring, key_id, partitions)

    @property
    def stream(self) -> str:
        return self._signer.stream

    @property
    def submit(self) -> str:
        return self._signer.submit

    async def publish(
        self,
        envelope: Envelope,
        *,
        traceparent: str | None = None,
        parent: ChainLink | None = None,
    ) -> str:
        """RPUSH ``envelope`` (in trace ``traceparent``, for task ``parent``, if given); see
        ``Publisher.publish`` (``RedisUnavailable`` = maybe published).

        Returns:
            the envelope's ``message_id``.
        """
        if parent is not None:
            envelope = chained(envelope, parent)
        fields = self._signer.fields(envelope, traceparent)
        with translated():
            await self.client.rpush(self._signer.submit, submit_item(fields))
        return envelope.message_id

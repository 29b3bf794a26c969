"""Ask and await: ``AsyncClient`` and ``Client`` publish a signed request and return its
verified reply.

``request`` builds the envelope once and publishes it; while it waits it publishes the
SAME envelope again (same bytes, same deadline) on a schedule (``resend_after_s``, doubling
up to ``resend_max_s``) and soon after ``RedisUnavailable``. A publish whose answer was lost
may or may not have reached the stream; resending the same envelope is always safe, because
the adapter's inbox answers every further copy as a duplicate of the first: one task, one
reply. The reply is found by message id (``routing``).

Why the message id must be stable: it is the request's identity. A random id per attempt
turns every resend, and every retry after a crash, into a new request: the work runs
twice, and the reply of the first attempt is never matched to the caller. So ``message_id``
is given by the caller, or derived from the caller's own stable key (``key=``, e.g. the
incident number plus the action) together with the principal and the client's
``instance`` (``message_id_for``): the same key asked again, also after a restart with the
same instance id, is the same request.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

from broker_adapter.client.dead_letters import principal_dead_letters
from broker_adapter.client.publisher import AsyncPublisher
from broker_adapter.client.routing import ReplyWatch
from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import (
    ConfigError,
    RedisUnavailable,
    RequestCancelled,
    RequestConflict,
    RequestError,
    RequestExpired,
    RequestFailed,
    RequestHopLimit,
    RequestTimeout,
)
from broker_adapter.handler.router import RouteError, Router, validate_payload
from broker_adapter.protocol.envelope import Envelope, check_principal
from broker_adapter.protocol.keys import DEFAULT_PREFIX, Keys
from broker_adapter.protocol.reply import BadReply, Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect_async

if TYPE_CHECKING:
    from broker_adapter.redis.client import AsyncRedis

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RESEND_AFTER_S = 2.0
DEFAULT_RESEND_MAX_S = 30.0
#: The pause before publishing again after ``RedisUnavailable``, seconds.
UNAVAILABLE_RETRY_S = 0.2
#: The statuses that raise, and what they raise.
ERRORS: dict[str, type[RequestError]] = {
    "failed": RequestFailed,
    "expired": RequestExpired,
    "hop_limit": RequestHopLimit,
    "cancelled": RequestCancelled,
    "conflict": RequestConflict,
}


def message_id_for(principal: str, instance: str, key: str) -> str:
    """The message id of the request a caller names by its own stable ``key``:
    ``"k-"`` + the first 40 hex digits of SHA-256 over ``principal \\n instance \\n key``."""
    digest = hashlib.sha256(f"{principal}\n{instance}\n{key}".encode()).hexdigest()
    return f"k-{digest[:40]}"


def cancel_message_id(message_id: str) -> str:
    """The message id of the cancel of request ``message_id`` (stable: a resent cancel is
    a duplicate): ``"cancel-"`` + the first 40 hex digits of SHA-256 of the id."""
    return "cancel-" + hashlib.sha256(message_id.encode("utf-8")).hexdigest()[:40]


def default_instance() -> str:
    """The default instance id: the host name (stable across restarts on one host; give
    each instance of one principal on one host its own with ``instance=``)."""
    return socket.gethostname().split(".")[0] or "instance"


def outcome(reply: Reply) -> Reply:
    """``reply`` when it is ``done``; else the ``RequestError`` its status calls for."""
    if reply.status == "done":
        return reply
    raise ERRORS.get(reply.status or "", RequestError)(reply)


class AsyncClient:
    """An agent's requests, each awaited for its reply (``redis.asyncio``).

    Args:
        redis: a Redis URL, or a client from ``redis.client.connect_async`` (no automatic
            re-sends; its socket timeout above ``block_ms``).
        principal: who asks; replies are checked with its keys.
        keyring: holds the principal's keys.
        instance: this instance's stable id (default ``default_instance()``): the
            namespace of the message ids derived from ``key=``. Persist it when several
            instances of one principal share a host.
        prefix: the Redis key prefix (the adapter's ``--prefix``).
        key_id: the key to sign with (default the principal's first).
        partitions: the adapter's ``--partitions``.
        mode: the adapter's ``--mode``: ``signed`` (requests signed, to the shared inbound
            stream) or ``acl`` (unsigned, to the principal's own stream; the keyring still
            checks the replies).
        resend_after_s, resend_max_s: the resend schedule while waiting.
        block_ms: how long one read of the reply stream waits.
        clock: stamps the deadlines.
        router: the adapter's ``Router``, when the caller has it: each payload is validated
            against its task's model before anything is published (``validate_payload``),
            so a request the adapter would fail is refused here, with the same errors.
    """

    def __init__(
        self,
        redis: str | AsyncRedis,
        principal: str,
        keyring: Keyring,
        *,
        instance: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        key_id: str | None = None,
        partitions: int = 1,
        mode: Literal["signed", "acl"] = "signed",
        resend_after_s: float = DEFAULT_RESEND_AFTER_S,
        resend_max_s: float = DEFAULT_RESEND_MAX_S,
        block_ms: int = 1000,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
        router: Router | None = None,
    ) -> None:
        if not 0 < resend_after_s <= resend_max_s:
            raise ConfigError("resend_after_s must be > 0 and <= resend_max_s")
        self.instance = instance if instance is not None else default_instance()
        if not self.instance or "\n" in self.instance:
            raise ConfigError(f"bad instance id {self.instance!r}")
        self.principal = check_principal(principal, "principal")
        self._owns = isinstance(redis, str)
        self.redis: AsyncRedis = (
            connect_async(redis, socket_timeout_s=block_ms / 1000 + 10)
            if isinstance(redis, str)
            else redis
        )
        self.keys = Keys(prefix)
        self.router = router
        signer = keyring if mode == "signed" else None  # ACL mode: the stream proves who
        self.partitions = partitions
        self.publisher = AsyncPublisher(
            self.redis, self.keys, principal, signer, key_id, partitions=partitions
        )
        self.log = logger or logging.getLogger("broker_adapter.client")
        self.watch = ReplyWatch(
            self.redis, self.keys, principal, keyring, block_ms=block_ms, logger=self.log
        )
        self.clock = clock or SystemClock()
        self.resend_after_s = resend_after_s
        self.resend_max_s = resend_max_s

    def message_id(self, message_id: str | None, key: str | None) -> str:
        """The request's message id: ``message_id``, or the one derived from ``key``."""
        if (message_id is None) == (key is None):
            raise ConfigError(
                "give message_id= or key= (a stable id of this request, never a random one"
                " per attempt: see broker_adapter.client.request)"
            )
        if message_id is not None:
            return message_id
        assert key is not None
        return message_id_for(self.principal, self.instance, key)

    async def request(
        self,
        task: str | None,
        payload: dict[str, Any],
        *,
        message_id: str | None = None,
        key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        deadline_s: float | None = None,
        max_attempts: int = 3,
        correlation_id: str | None = None,
        traceparent: str | None = None,
    ) -> Reply:
        """Publish a request and return its reply.

        Args:
            task: the task's name (a task of the adapter's ``Router``); ``None``: its
                default task (the one handler of ``run --handler``).
            payload: the request's JSON object.
            message_id: the request's stable id; or give ``key``.
            key: the caller's own stable key for the request (``message_id_for``).
            timeout_s: how long to wait for the reply.
            deadline_s: the task's deadline, seconds from now (default ``timeout_s``);
                fixed when the envelope is built, the same in every resend.
            max_attempts, correlation_id, traceparent: envelope members.

        Returns:
            the verified reply, status ``done``.

        Raises:
            RequestFailed, RequestExpired, RequestHopLimit, RequestCancelled,
                RequestConflict: the reply says so (``exc.reply``).
            RequestTimeout: no reply within ``timeout_s`` (collect it later with
                ``result``).
            ConfigError, EnvelopeError: a bad argument; nothing was sent.
        """
        if timeout_s <= 0:
            raise ConfigError("timeout_s must be > 0")
        envelope = self.envelope(
            task,
            payload,
            self.message_id(message_id, key),
            deadline_s or timeout_s,
            max_attempts=max_attempts,
            correlation_id=correlation_id,
            traceparent=traceparent,
        )
        return outcome(await self.send(envelope, timeout_s))

    def envelope(
        self,
        task: str | None,
        payload: dict[str, Any],
        message_id: str,
        deadline_s: float,
        *,
        max_attempts: int = 3,
        correlation_id: str | None = None,
        traceparent: str | None = None,
    ) -> Envelope:
        """A request's envelope from this principal, its deadline ``deadline_s`` from now:
        fixed here, so every resend of it (``send``) is the same request."""
        if deadline_s <= 0:
            raise ConfigError("deadline_s must be > 0")
        if self.router is not None:
            try:
                validate_payload(self.router, task, payload)
            except RouteError as exc:
                raise ConfigError(f"not sent: {exc}") from None
        return Envelope(
            message_id=message_id,
            sender=self.principal,
            payload=payload,
            task=task,
            deadline=self.clock.now() + deadline_s,
            max_attempts=max_attempts,
            correlation_id=correlation_id,
            traceparent=traceparent,
        )

    async def send(self, envelope: Envelope, timeout_s: float) -> Reply:
        """Publish ``envelope``, resend it unchanged while waiting, return its reply
        (any status). ``request`` is this plus the envelope and the status check.

        Raises:
            RequestTimeout: no reply within ``timeout_s``.
        """
        mid = envelope.message_id
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        waiting: asyncio.Future[Reply] | None = None
        sent = 0
        resend_in, next_send = self.resend_after_s, loop.time()
        try:
            while True:
                now = loop.time()
                if now >= next_send:
                    try:
                        if waiting is None:  # the tail starts before the first publish
                            waiting = await self.watch.register(mid)
                        await self.publisher.publish(envelope)
                        sent += 1
                        next_send = now + resend_in
                        resend_in = min(resend_in * 2, self.resend_max_s)
                    except RedisUnavailable as exc:
                        self.log.info("request %r not confirmed, sending again: %s", mid, exc)
                        next_send = now + UNAVAILABLE_RETRY_S
                    if sent > 1 and waiting is not None and not waiting.done():
                        recorded = await self._lookup_quietly(mid)
                        if recorded is not None:
                            return recorded
                if waiting is not None and waiting.done():
                    return waiting.result()
                if now >= end:
                    raise RequestTimeout(mid, timeout_s)
                if waiting is None:
                    await asyncio.sleep(max(0.0, min(next_send, end) - now))
                    continue
                try:
                    return await asyncio.wait_for(
                        asyncio.shield(waiting), max(0.0, min(next_send, end) - now)
                    )
                except TimeoutError:
                    continue
        finally:
            if waiting is not None:
                self.watch.release(mid, waiting)

    async def _lookup_quietly(self, message_id: str) -> Reply | None:
        """The recorded reply, if any; trouble reading it only logged (the wait goes on).
        Looked up from the first resend on, not before: a message id reused with other
        content gets its conflict answer on the stream, not the earlier request's reply."""
        try:
            return await self.watch.lookup(message_id)
        except (RedisUnavailable, BadReply) as exc:
            self.log.info("result record of %r not read: %s", message_id, exc)
            return None

    async def result(self, message_id: str) -> Reply | None:
        """The reply to this principal's earlier request ``message_id`` (any status), as
        the adapter recorded it, or ``None``: no reply recorded (still pending or running,
        never received, or older than the adapter's result window).

        Raises:
            RedisUnavailable: Redis could not be asked.
            BadReply: the record is not a reply the adapter signed for this principal.
        """
        return await self.watch.lookup(message_id)

    async def wait(self, message_id: str, timeout_s: float) -> Reply:
        """The reply to this principal's request ``message_id`` (any status), waited for up
        to ``timeout_s`` without publishing anything.

        Raises:
            RequestTimeout: no reply within ``timeout_s``.
        """
        waiting = await self.watch.register(message_id)
        try:
            recorded = await self.watch.lookup(message_id)
            if recorded is not None:
                return recorded
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
            except TimeoutError:
                raise RequestTimeout(message_id, timeout_s) from None
        finally:
            self.watch.release(message_id, waiting)

    async def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """Up to ``limit`` of this principal's dead letters, with their reasons
        (``client.dead_letters.principal_dead_letters``).

        Raises:
            RedisUnavailable: Redis could not be read.
        """
        return await principal_dead_letters(
            self.redis, self.keys, self.principal, self.partitions, limit
        )

    async def cancel(self, message_id: str, *, deadline_s: float = 300.0) -> str:
        """Ask the adapter to cancel this principal's request ``message_id`` (a signed
        envelope of kind ``cancel``): a pending task ends ``cancelled`` with its reply, a
        running one is asked to stop. Returns the cancel's own message id
        (``cancel_message_id``).

        Raises:
            RedisUnavailable: maybe sent; calling again is safe (a duplicate).
        """
        envelope = Envelope(
            message_id=cancel_message_id(message_id),
            sender=self.principal,
            kind="cancel",
            payload={"message_id": message_id},
            deadline=self.clock.now() + deadline_s,
        )
        await self.publisher.publish(envelope)
        return envelope.message_id

    async def aclose(self) -> None:
        """Stop the reply tail; close the Redis client if this client made it."""
        await self.watch.close()
        if self._owns:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Client, P], T]:
    """``method`` of a ``Client``: run on its loop and waited for (the same signature)."""

    @functools.wraps(method)
    def blocking(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self._client, *args, **kwargs))

    return blocking


class Client:
    """``AsyncClient`` without ``await``: the same arguments and methods, run on an event
    loop of its own (a daemon thread). Use one from any number of threads; close it (or use
    ``with``) when done.

    Args:
        redis_url: the Redis URL.
        principal, keyring, **options: as ``AsyncClient``.
    """

    def __init__(self, redis_url: str, principal: str, keyring: Keyring, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"ba-client-{principal}", daemon=True
        )
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(redis_url, principal, keyring, **options)

        try:
            self._client = self._run(make())
        except BaseException:
            self._stop()
            raise

    @property
    def instance(self) -> str:
        return self._client.instance

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    #: ``AsyncClient.request``: publish, resend while waiting, return the reply.
    request = _blocking(AsyncClient.request)
    #: ``AsyncClient.result``.
    result = _blocking(AsyncClient.result)
    #: ``AsyncClient.cancel``.
    cancel = _blocking(AsyncClient.cancel)

    def message_id(self, message_id: str | None = None, key: str | None = None) -> str:
        return self._client.message_id(message_id, key)

    def close(self) -> None:
        """Stop the reply tail, close the connections and the loop."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.aclose())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

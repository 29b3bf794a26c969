"""A small asyncio TCP proxy on loopback, for network faults between clients and Redis.

Modes (each can be switched at any time from any thread):

* pass (default): bytes flow both ways unchanged;
* ``delay(s)``: every chunk waits ``s`` seconds before it is forwarded, both ways;
* ``reset_all()``: abort every live connection now (the clients see a reset);
* ``drop_reply_once(match)``: the next request chunk containing ``match`` (e.g. ``b"XADD"``)
  is forwarded, then the server's next reply chunk on that connection is dropped and the
  connection aborted: the server executed the command, the client never learns it;
* ``reset_after_bytes(n)``: the next ``n`` reply bytes pass, then that connection is cut
  (a reply, or a pipeline's replies, torn in the middle);
* ``blackhole()``: bytes are swallowed both ways, new connections hang; ``heal()`` aborts
  every connection that was blackholed (their bytes are gone, so the protocol state is too).

``heal()`` returns to pass mode. The proxy never retries or reorders anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CHUNK = 65536
CONNECT_TIMEOUT_S = 2.0
CALL_TIMEOUT_S = 10.0


class _Conn:
    def __init__(self, cid: int, client: asyncio.StreamWriter) -> None:
        self.cid = cid
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.drop_next_reply = False
        self.blackholed = False

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.transport.abort()


class ChaosProxy:
    """Listens on ``127.0.0.1:<port>`` and forwards to ``upstream_host:upstream_port``.

    Args:
        upstream_port: the Redis port (a restarted server keeps its port).
        upstream_host: the Redis host (loopback).
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self.stats: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._delay_s = 0.0
        self._blackhole = False
        self._drop_match: bytes | None = None
        self._cut_after: int | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the event loop thread and the listener; returns once it listens."""
        self._thread = threading.Thread(target=self._main, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(CALL_TIMEOUT_S) or not self.port:
            raise RuntimeError("the chaos proxy did not start")

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        """Abort every connection, close the listener, stop the loop."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def shutdown() -> None:
            for conn in list(self._conns.values()):
                conn.abort()
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._call(shutdown())
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=CALL_TIMEOUT_S)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    # -- faults ---------------------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` before forwarding it (0 turns the delay off)."""
        self._delay_s = max(0.0, seconds)
        self.stats["delay"] += 1

    def drop_reply_once(self, match: bytes) -> None:
        """Arm: the next request chunk holding ``match`` runs, its reply is lost."""
        self._drop_match = match
        self.stats["drop_armed"] += 1

    def reset_after_bytes(self, n: int) -> None:
        """Arm: let ``n`` more reply bytes through, then cut that connection."""
        self._cut_after = max(0, n)
        self.stats["cut_armed"] += 1

    def reset_all(self) -> int:
        """Abort every live connection. Returns how many were aborted."""

        async def go() -> int:
            conns = list(self._conns.values())
            for conn in conns:
                conn.abort()
            return len(conns)

        n = self._call(go())
        self.stats["reset"] += n
        return n

    def blackhole(self) -> None:
        """Swallow bytes both ways; new connections hang until ``heal``."""
        self._blackhole = True
        self.stats["blackhole"] += 1

    def heal(self) -> int:
        """Back to pass mode; abort the connections that lost bytes in a blackhole.

        Returns:
            how many connections were aborted.
        """
        self._delay_s = 0.0
        self._drop_match = None
        self._cut_after = None
        self._blackhole = False

        async def go() -> int:
            holed = [c for c in self._conns.values() if c.blackholed]
            for conn in holed:
                conn.abort()
            return len(holed)

        return self._call(go())

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- forwarding -----------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(next(self._ids), writer)
        self._conns[conn.cid] = conn
        self.stats["accepted"] += 1
        try:
            if self._blackhole:
                conn.blackholed = True
                while await reader.read(CHUNK):
                    pass
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.upstream_host, self.upstream_port),
                    CONNECT_TIMEOUT_S,
                )
            except (TimeoutError, OSError):
                self.stats["upstream_refused"] += 1
                return
            conn.upstream = up_writer
            pumps = [
                asyncio.ensure_future(self._to_server(conn, reader, up_writer)),
                asyncio.ensure_future(self._to_client(conn, up_reader, writer)),
            ]
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            conn.abort()
            self._conns.pop(conn.cid, None)

    async def _to_server(
        self, conn: _Conn, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    return
                if self._delay_s:
                    await asyncio.sleep(self._delay_s)
                if self._blackhole or conn.blackholed:
                    conn.blackholed = True
                    self.stats["swallowed"] += 1  # a request chunk lost in the blackhole
                    continue
                match = self._drop_match
                if match is not None and match in data:
                    self._drop_match = None
                    conn.drop_next_reply = True
                    self.stats["drop_fired"] += 1
                upstream.write(data)
                await upstream.drain()

    async def _to_client(
        self, conn: _Conn, upstream: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = await upstream.read(CHUNK)
                if not data:
                    return
                if self._delay_s:
                    await asyncio.sleep(self._delay_s)
                if self._blackhole or conn.blackholed:
                    conn.blackholed = True
                    continue
                if conn.drop_next_reply:
                    self.stats["reply_dropped"] += 1
                    return  # the caller aborts both sides
                cut = self._cut_after
                if cut is not None:
                    if len(data) >= cut:
                        self._cut_after = None
                        if cut:
                            client.write(data[:cut])
                            await client.drain()
                        self.stats["cut_fired"] += 1
                        return
                    self._cut_after = cut - len(data)
                client.write(data)
                await client.drain()

"""Reply-path throughput, beside raw Redis on the same server in the same run.

Starts a private redis-server (``broker_adapter.testing.RedisServer``), then, for each of
``--runs`` rounds (fresh keys and databases every round), measures:

* raw XADD: ``--n`` entries of the reply's size, pipelined ``--batch`` at a time;
* raw XREADGROUP + XACK: the same entries read ``--batch`` at a time, one XACK per batch;
* dispatch: ``--n`` outbox replies claimed, published through the record script (one
  pipeline per batch) and marked sent (one transaction per batch) by ``Dispatcher.step``;
* receive: the same replies checked, applied with an effect (one transaction per batch,
  a savepoint per reply) and acknowledged by ``Receiver.step``.

Prints the median of the rounds for each, and the ratios dispatch/raw XADD and
receive/raw read. Usage::

    .venv/bin/python bench/replies.py [--n 5000] [--batch 64] [--runs 3]
        [--appendfsync everysec|always|no] [--synchronous FULL|NORMAL]
"""

from __future__ import annotations

import argparse
import logging
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
from broker_adapter.store import OutboxStore, ReceiptStore, open_database
from broker_adapter.store.db import Database
from broker_adapter.store.outbox_writes import enqueue
from broker_adapter.testing import RedisServer

PRINCIPAL = "bench"
KEYRING = Keyring({PRINCIPAL: {"k1": "a benchmark secret of reasonable length, 32+ bytes"}})


def effect(conn: sqlite3.Connection, reply: Reply) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS effects (reply_id TEXT NOT NULL, status TEXT)")
    conn.execute("INSERT INTO effects VALUES (?, ?)", (reply.reply_id, reply.status))


def fill_outbox(db: Database, n: int, now: float) -> bytes:
    """``n`` pending replies; returns one body (for sizing the raw entries)."""
    body: dict[str, Any] = {}
    with db.write("bench_fill") as c:
        for i in range(n):
            reply_id = f"r-{uuid.uuid4().hex}"
            body = {
                "v": 1,
                "reply_id": reply_id,
                "task_id": None,
                "principal": PRINCIPAL,
                "message_id": f"m{i}",
                "status": "done",
                "result": {"i": i, "text": "x" * 64},
                "error": None,
                "fence": 1,
            }
            enqueue(
                c,
                reply_id=reply_id,
                task_id=None,
                principal=PRINCIPAL,
                message_id=f"m{i}",
                status="done",
                body=body,
                now=now,
            )
    return canonical_json(body)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(server: RedisServer, workdir: Path, args: argparse.Namespace) -> dict[str, float]:
    n, batch = args.n, args.batch
    prefix = f"b{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    client = connect(server.url)
    agent = open_database(workdir / f"{prefix}-agent.db", synchronous=args.synchronous)
    rx_db = open_database(workdir / f"{prefix}-rx.db", synchronous=args.synchronous)
    body = fill_outbox(agent, n, time.time())
    raw_stream = f"{prefix}:{{raw}}:s"
    fields = {"v": "1", "reply_id": "r-" + "0" * 32, "hash": "0" * 64, "body": body}

    def raw_xadd() -> None:
        for start in range(0, n, batch):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(batch, n - start)):
                pipe.xadd(raw_stream, fields)  # type: ignore[arg-type]
            pipe.execute()

    def raw_read() -> None:
        client.xgroup_create(raw_stream, "g", id="0")
        done = 0
        while done < n:
            reply: Any = client.xreadgroup("g", "c", {raw_stream: ">"}, count=batch)
            ids = [eid for _, entries in reply for eid, _ in entries]
            client.xack(raw_stream, "g", *ids)
            done += len(ids)

    outbox = OutboxStore(agent)
    dispatcher = Dispatcher(DispatcherConfig(prefix=prefix, owner="bench", batch=batch),
                            client, outbox, keyring=KEYRING)  # fmt: skip
    dispatcher.watch()  # the first look (version, epoch) is not part of the rate

    def dispatch() -> None:
        done = 0
        while done < n:
            done += dispatcher.step()

    config = ReceiverConfig(prefix=prefix, principal=PRINCIPAL, consumer="c", count=batch,
                            block_ms=100)  # fmt: skip
    receiver = Receiver(config, client, ReceiptStore(rx_db), effect, keyring=KEYRING)

    def receive() -> None:
        done = 0
        while done < n:
            done += receiver.step()

    out = {
        "raw_xadd": n / timed(raw_xadd),
        "raw_read_ack": n / timed(raw_read),
        "dispatch": n / timed(dispatch),
        "receive": n / timed(receive),
    }
    assert outbox.counts()["sent"] == n
    assert client.xlen(keys.replies(PRINCIPAL)) == n
    assert len(receiver.receipts.list()) == n
    agent.close()
    rx_db.close()
    client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--appendfsync", default="everysec", choices=["always", "everysec", "no"])
    parser.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="ba-bench-") as tmp:
        server = RedisServer(Path(tmp) / "redis", appendfsync=args.appendfsync)
        server.start()
        try:
            rounds = [one_round(server, Path(tmp), args) for _ in range(args.runs)]
        finally:
            server.stop()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"replies bench: n={args.n} batch={args.batch} runs={args.runs} "
        f"appendfsync={args.appendfsync} sqlite synchronous={args.synchronous} (medians)"
    )
    for name, label in [
        ("raw_xadd", "raw XADD (pipelined)"),
        ("dispatch", "dispatch (claim + script + mark sent)"),
        ("raw_read_ack", "raw XREADGROUP + XACK"),
        ("receive", "receive (check + apply + XACK)"),
    ]:
        print(f"  {label:<40} {med[name]:>10,.0f} msgs/s")
    print(f"  dispatch / raw XADD        {med['dispatch'] / med['raw_xadd']:.2f}")
    print(f"  receive  / raw read + ack  {med['receive'] / med['raw_read_ack']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

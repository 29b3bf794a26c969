"""Benchmark: ingest throughput against raw XREADGROUP + XACK on the same redis-server.

Not a test. Starts a private redis-server (AOF on, ``--appendfsync``), publishes N signed
envelopes, then measures

* **ingest**: ``Ingestor.step`` until all N are in the inbox: signatures checked, envelopes
  validated, one ``TaskStore.accept`` transaction (SQLite ``synchronous=FULL``) and one XACK
  per batch;
* **raw**: XREADGROUP COUNT <count> + one XACK per batch over a copy of the same entries,
  nothing else: the ceiling any consumer on this machine and server can reach.

Each is run ``--runs`` times (fresh keys and a fresh database each run), the two back to
back in alternating order; the ratio is taken per pair (so that a burst of load from
elsewhere on a 2-core machine hits both sides of it) and the median of those ratios is the
figure. The target is ingest >= 15% of raw.

Usage::

    .venv/bin/python bench/ingest.py [--n 20000] [--count 512] [--runs 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from broker_adapter.protocol.envelope import Envelope  # noqa: E402
from broker_adapter.protocol.keys import INGEST_GROUP, Keys  # noqa: E402
from broker_adapter.protocol.signing import Keyring  # noqa: E402
from broker_adapter.redis.client import connect  # noqa: E402
from broker_adapter.stages.ingest.config import IngestConfig  # noqa: E402
from broker_adapter.stages.ingest.ingest import Ingestor  # noqa: E402
from broker_adapter.store import TaskStore, open_database  # noqa: E402
from broker_adapter.testing import RedisServer, binary_available  # noqa: E402

KEYRING = Keyring({"agent-a": {"k1": "a benchmark secret of reasonable length, 32+ bytes"}})


def _publish(client: redis.Redis, stream: str, n: int) -> None:
    """Put N signed envelopes on ``stream`` (set-up, not measured: pipelined)."""
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        env = Envelope.build(
            message_id=f"bench-{i}",
            sender="agent-a",
            payload={"action": "summarise", "doc": f"doc-{i}", "words": 400, "lang": "en"},
            deadline=time.time() + 3600,  # within the retention window, which bounds it
        )
        pipe.xadd(stream, KEYRING.sign(env))  # type: ignore[arg-type]
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()


def run_ingest(server: RedisServer, workdir: Path, n: int, count: int) -> float:
    """Messages per second through ``Ingestor.step``."""
    prefix = f"b{uuid.uuid4().hex[:8]}"
    client = connect(server.url)
    _publish(client, Keys(prefix).inbound(), n)
    db = open_database(workdir / f"{prefix}.db", synchronous="FULL")
    tasks = TaskStore(db)
    config = IngestConfig(prefix=prefix, consumer="bench-0", count=count, block_ms=100)
    ingestor = Ingestor(config, client, tasks, KEYRING)
    start = time.perf_counter()
    while ingestor.stats.accepted < n:
        ingestor.step()
    elapsed = time.perf_counter() - start
    assert not any(ingestor.stats.dead_lettered.values()), ingestor.stats.dead_lettered
    db.close()
    client.close()
    return n / elapsed


def run_raw(server: RedisServer, n: int, count: int) -> float:
    """Messages per second through bare XREADGROUP + XACK, same entry sizes."""
    stream = f"raw{uuid.uuid4().hex[:8]}"
    client = connect(server.url)
    _publish(client, stream, n)
    client.xgroup_create(stream, INGEST_GROUP, id="0")
    done = 0
    start = time.perf_counter()
    while done < n:
        reply = cast(
            list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None,
            client.xreadgroup(INGEST_GROUP, "raw-0", {stream: ">"}, count=count, block=100),
        )
        for _, items in reply or []:
            ids = [eid for eid, _fields in items]
            client.xack(stream, INGEST_GROUP, *ids)
            done += len(ids)
    elapsed = time.perf_counter() - start
    client.close()
    return n / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="messages per run")
    parser.add_argument("--count", type=int, default=512, help="entries per batch")
    parser.add_argument(
        "--runs", type=int, default=9, help="pairs; single pairs spread widely (raw lasts 0.15 s)"
    )
    parser.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"])
    args = parser.parse_args()
    if not binary_available():
        print("redis-server is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ba-bench-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir / "redis", appendfsync=args.appendfsync)
        server.start()
        try:
            ingest: list[float] = []
            raw: list[float] = []
            for run in range(1, args.runs + 1):
                if run % 2:
                    ingest.append(run_ingest(server, workdir, args.n, args.count))
                    raw.append(run_raw(server, args.n, args.count))
                else:
                    raw.append(run_raw(server, args.n, args.count))
                    ingest.append(run_ingest(server, workdir, args.n, args.count))
                print(
                    f"run {run}: ingest {ingest[-1]:,.0f} msg/s, raw {raw[-1]:,.0f} msg/s,"
                    f" ratio {ingest[-1] / raw[-1]:.1%}",
                    flush=True,
                )
        finally:
            server.stop()
    med_ingest, med_raw = statistics.median(ingest), statistics.median(raw)
    ratio = statistics.median(i / r for i, r in zip(ingest, raw, strict=True))
    print(
        f"n={args.n} count={args.count} appendfsync={args.appendfsync} sqlite=FULL "
        f"signatures=checked runs={args.runs}"
    )
    print(f"median ingest: {med_ingest:,.0f} msg/s")
    print(f"median raw XREADGROUP+XACK: {med_raw:,.0f} msg/s")
    print(f"median of the paired ratios: {ratio:.1%} (target >= 15%)")
    return 0 if ratio >= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())

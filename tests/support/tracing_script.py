"""One request through every stage, in one process, for the tracing tests: publish (with a
``traceparent`` or none), ingest, one worker batch, the dispatcher's publication, the
receiver. Imports nothing of OpenTelemetry, so that a process without it can run it.

Run as ``python -m tests.support.tracing_script --url URL --prefix P --dir DIR
[--traceparent TP]``: prints one JSON line with the reply bodies the receiver recorded,
whether ``tracing`` found a tracer, and the ``opentelemetry`` modules loaded by then.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from broker_adapter.client.publisher import Publisher
from broker_adapter.clock import FakeClock
from broker_adapter.handler.task import Task
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.shared import tracing
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import ReceiptStore, TaskStore, open_database
from tests.support.ingest_script import DEADLINE, drain, write_keyring
from tests.support.replies_script import dispatcher_for, receiver_for, reply_keyring
from tests.support.replies_script import drain as drain_receiver

#: In every payload these tests send: it must never appear in a span.
PAYLOAD_MARKER = "payload-marker-7f3a"


def echo(task: Task) -> dict[str, Any]:
    return {"echo": task.payload["text"]}


def run_pipeline(
    url: str,
    prefix: str,
    directory: Path,
    traceparents: Sequence[str | None],
    handler: Callable[[Task], Any] = echo,
) -> list[dict[str, Any]]:
    """Publish one request per item of ``traceparents`` (the same ``message_id`` and
    content each time: the later ones are resends) and run every stage once.

    Returns:
        the reply bodies the receiver recorded, parsed.
    """
    clock = FakeClock()
    client = connect(url)
    keyring = write_keyring(directory / "keys.json")
    envelope = Envelope.build(
        message_id="traced-1", sender="alice", payload={"text": PAYLOAD_MARKER}, deadline=DEADLINE
    )
    publisher = Publisher(client, Keys(prefix), "alice", keyring)
    for traceparent in traceparents:
        publisher.publish(envelope, traceparent=traceparent)
    adapter_db = open_database(directory / "inbox.db")
    rx_db = open_database(directory / "receiver.db")
    try:
        tasks = TaskStore(adapter_db, clock)
        ingestor = Ingestor(
            IngestConfig(prefix=prefix, consumer="ingest-t-0", block_ms=20),
            client,
            tasks,
            keyring,
            clock=clock,
        )
        drain(ingestor, client)
        worker = Worker(
            WorkerConfig(owner="w1", prefix=prefix),
            tasks,
            handler,
            keyring=reply_keyring(),
        )
        worker.run_once()
        dispatcher = dispatcher_for(url, adapter_db, clock, prefix, "d1")
        dispatcher.watch()
        dispatcher.step()
        receiver = receiver_for(url, rx_db, clock, prefix, "alice", "rx-1")
        drain_receiver(receiver)
        return [json.loads(r.body) for r in ReceiptStore(rx_db, clock).list()]
    finally:
        adapter_db.close()
        rx_db.close()
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--traceparent")
    args = parser.parse_args(argv)
    bodies = run_pipeline(args.url, args.prefix, args.dir, [args.traceparent])
    loaded = sorted(m for m, mod in sys.modules.items() if m.startswith("opentelemetry") and mod)
    traced = tracing.tracer() is not None
    print(json.dumps({"bodies": bodies, "traced": traced, "otel_modules": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

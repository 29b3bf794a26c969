"""What each ``broker-adapter`` command does, once ``cli`` has parsed its arguments.

Each ``cmd_*`` takes the parsed ``argparse.Namespace`` and returns the exit code; errors
are raised (``ConfigError`` for usage and configuration, other ``BrokerAdapterError`` for
runtime failures) and turned into one line on stderr by ``cli.main``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker_adapter.app.audit import audit, bounded_seconds, bounded_text, os_user
from broker_adapter.app.stop_signals import stop_on_signals
from broker_adapter.app.tasks_cli import print_json
from broker_adapter.errors import ConfigError, TransientError

if TYPE_CHECKING:
    from broker_adapter.app.metrics import MetricsSettings
    from broker_adapter.stages.receiver.receiver import Receiver
    from broker_adapter.store.db import Database
    from broker_adapter.store.postgres import PgDatabase

log = logging.getLogger("broker_adapter.app.cli")


# -- commands ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from broker_adapter.app.adapter import Adapter
    from broker_adapter.app.adapter_config import AdapterConfig
    from broker_adapter.app.options import settings_from

    if (args.handler is None) == (args.app is None):
        raise ConfigError("run needs one of --handler MOD:FUNC or --app MOD:ROUTER")
    settings = settings_from(args, AdapterConfig)
    if not settings.get("name"):
        settings.pop("name", None)  # an empty --name or BA_NAME: the default
    config = AdapterConfig(
        redis_url=args.redis,
        db_path=args.db,  # a SQLite file, or a postgresql:// URL (AdapterConfig decides)
        handler=args.handler or args.app,
        keyring_path=Path(args.keyring) if args.keyring else None,
        **settings,
    )
    stop = threading.Event()
    stop_on_signals(stop)
    return Adapter(config).run(stop)


def cmd_schema(args: argparse.Namespace) -> int:
    """Print the router's tasks with their payload and result JSON Schemas, as JSON."""
    from broker_adapter.stages.shared.handlers import load_app

    router = load_app(args.app, app_dir=Path(args.app_dir))
    print(json.dumps({"tasks": router.schemas()}, indent=2, sort_keys=True))
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from broker_adapter.client.publisher import Publisher
    from broker_adapter.errors import EnvelopeError
    from broker_adapter.protocol.canonical import loads_strict
    from broker_adapter.protocol.envelope import Envelope
    from broker_adapter.protocol.keys import Keys
    from broker_adapter.protocol.signing import Keyring
    from broker_adapter.redis.client import connect

    try:
        payload = loads_strict(args.payload)
    except ValueError as exc:
        raise ConfigError(f"--payload is not valid JSON: {exc}") from None
    keyring = Keyring.load(args.keyring)
    # The deadline is part of the request: a resend must carry the first one (--deadline).
    deadline = args.deadline if args.deadline is not None else time.time() + args.deadline_in
    try:
        envelope = Envelope.build(
            message_id=args.message_id,
            sender=args.principal,
            payload=payload,
            deadline=deadline,
            max_attempts=args.max_attempts,
            **({"correlation_id": args.correlation_id} if args.correlation_id else {}),
            **({"task": args.task} if args.task else {}),
        )
    except EnvelopeError as exc:  # built from the flags: a usage error
        raise ConfigError(f"the envelope is refused: {exc}") from None
    publisher = Publisher(
        connect(args.redis),
        Keys(args.prefix),
        args.principal,
        keyring,
        key_id=args.key_id,
        partitions=args.partitions,
    )
    publisher.publish(envelope)
    print_json(
        {
            "stream": publisher.stream,
            "submit": publisher.submit,
            "principal": args.principal,
            "message_id": args.message_id,
            "fingerprint": envelope.fingerprint(),
            "deadline": envelope.deadline,
            "max_attempts": envelope.max_attempts,
            "key_id": args.key_id or keyring.key_ids(args.principal)[0],
            "reply_stream": Keys(args.prefix).replies(args.principal),
            "result": f"broker-adapter result --principal {args.principal} --id"
            f" {shlex.quote(args.message_id)}",
        }
    )
    return 0


def cmd_receive(args: argparse.Namespace) -> int:
    from broker_adapter.app.metrics import Observed
    from broker_adapter.app.serving import serve_metrics
    from broker_adapter.backoff import call_until_stopped
    from broker_adapter.protocol.signing import Keyring
    from broker_adapter.redis.client import connect
    from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, record_effect
    from broker_adapter.store import ReceiptStore
    from broker_adapter.store.backends import open_store
    from broker_adapter.store.urls import is_postgres_url

    consumer = args.consumer or f"receive-{args.principal}"
    config = ReceiverConfig(
        prefix=args.prefix,
        principal=args.principal,
        consumer=consumer,
        retention_s=args.retention_s,
    )
    keyring = Keyring.load(args.keyring)
    stop = threading.Event()
    stop_on_signals(stop)
    # A cluster's client reads the slot map when it is made: while its seed node is down
    # (restarting) a receiver that runs until stopped waits for it, as for any outage.
    client = (
        connect(args.redis)
        if args.until_idle is not None
        else call_until_stopped(stop, lambda: connect(args.redis))
    )
    if client is None:
        return 0  # stopped before Redis could be reached
    db = open_store(args.db)  # a SQLite file, or a postgresql:// URL
    receiver = Receiver(config, client, ReceiptStore(db), record_effect, keyring=keyring)
    on_postgres = is_postgres_url(args.db)
    observed = Observed(db_path=args.db if on_postgres else Path(args.db), redis_url=args.redis)
    observed.add_receiver(receiver)
    metrics = _metrics_settings(args)
    try:
        with serve_metrics(observed, metrics.host, metrics.port, worker_files=False):
            _receive_until(receiver, stop, args.until_idle, _receipt_binder(config, client, db))
    finally:
        db.close()
    return 0


def _metrics_settings(args: argparse.Namespace) -> MetricsSettings:
    """The metrics port's section of the settings tree, from ``--metrics-port`` and
    ``--metrics-host``."""
    from broker_adapter.app.adapter_config import AdapterConfig
    from broker_adapter.app.metrics import MetricsSettings
    from broker_adapter.app.options import settings_from

    given = settings_from(args, AdapterConfig, ["metrics.port", "metrics.host"])
    return MetricsSettings(**given.get("metrics", {}))


def _receipt_binder(config: Any, client: Any, db: Any) -> Callable[[], object]:
    """What binds the principal's receiver group to this receipt store (``binding``), for
    ``_receive_until`` to call before its first read: a second receipt store on one group
    would apply redelivered replies twice."""
    from broker_adapter.app.binding import bind
    from broker_adapter.protocol.keys import Keys
    from broker_adapter.store.identity import store_identity

    identity = store_identity(db)
    key = Keys(config.prefix).receipt_binding(config.principal, config.group)
    what = f"receiver group {config.group!r} of {config.principal!r} on prefix {config.prefix!r}"
    fix = (
        "use that same receipt database (PostgreSQL for several hosts), or another --prefix;"
        " to move the group to this store on purpose: broker-adapter rebind --principal"
        f" {config.principal}"
    )
    return lambda: bind(client, key, identity, what=what, fix=fix, by="receive")


def _receive_until(
    receiver: Receiver,
    stop: threading.Event,
    until_idle: float | None,
    first: Callable[[], object] | None = None,
) -> None:
    """Run ``receiver`` until ``stop``, or until ``until_idle`` seconds passed without a
    reply applied, whether Redis answered empty or not at all (retried every second, said
    once per outage). ``first`` (the receipt store's binding) runs before the first read,
    retried the same way.

    Raises:
        TransientError: the idle time ran out while the last read failed.
    """
    idle_since = time.monotonic()
    applied = 0
    failure: TransientError | None = None
    while not stop.is_set():
        idle_s = time.monotonic() - idle_since
        if until_idle is not None and idle_s >= until_idle:
            if failure is not None:
                raise TransientError(
                    f"no reply applied for {until_idle:g} s (--until-idle) and the last read"
                    f" failed: {failure}"
                )
            return
        try:
            if first is not None:
                first()
                first = None
            n = receiver.step()
        except TransientError as exc:
            if failure is None:
                log.warning("retrying every 1 s: %s", exc)
            failure = exc
            left_s = 1.0 if until_idle is None else until_idle - idle_s
            stop.wait(max(0.0, min(1.0, left_s)))
            continue
        failure = None
        applied += n
        if n:
            idle_since = time.monotonic()
            log.info("received %d replies", applied)


def cmd_receipts(args: argparse.Namespace) -> int:
    from broker_adapter.store import ReceiptStore
    from broker_adapter.store.backends import open_store

    db = open_store(args.db, read_only=True)  # a SQLite file or a postgresql:// URL
    for r in ReceiptStore(db).list():
        reply = r.reply()
        row = {
            "reply_id": r.reply_id,
            "message_id": r.message_id,
            "task_id": r.task_id,
            "status": r.status,
            "result": reply.get("result"),
            "error": reply.get("error"),
            "effects": r.effects,
        }
        if args.json:
            print_json(row)
        else:
            print(f"{r.reply_id}  {r.message_id}  {r.status}  effects={r.effects}")
    db.close()
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    from broker_adapter.store.backup import write_snapshot

    print_json(write_snapshot(args.db, args.out))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from broker_adapter.app.ops import collect_status, format_status, watch_status
    from broker_adapter.store.urls import is_postgres_url

    db = args.db if is_postgres_url(args.db) else Path(args.db)
    if args.watch:
        bounded_seconds("--interval", args.interval, 3600)
        return watch_status(db, args.redis, args.prefix, args.interval, as_json=args.json)
    report = collect_status(db, args.redis, args.prefix)
    if args.json:
        print_json(report)
    else:
        print(format_status(report))
    return 0


def cancel_task(db: Database | PgDatabase, task_id: str, reason: str, by: str) -> dict[str, Any]:
    """Cancel a task durably: ``cancel``'s and the console's. A running task gets a cancel
    request (its handler sees it at its next check; its lease is no longer renewed after
    the grace); any other live task is cancelled now. Who asked (``by``) is kept with the
    reason.

    Returns:
        ``task_id``, ``state`` and, for a running task, ``cancel_requested``.

    Raises:
        UnknownTask: no such task.
    """
    from broker_adapter.store import TaskStore
    from broker_adapter.store.effects import EffectsStore

    state = EffectsStore(TaskStore(db).tx).request_cancel(task_id, f"{reason} [by {by}]")
    out: dict[str, Any] = {"task_id": task_id, "state": state.value, "by": by}
    if state == "running":
        out["cancel_requested"] = True
    return out


def cmd_cancel(args: argparse.Namespace) -> int:
    from broker_adapter.app.tasks_cli import cancel_task_id
    from broker_adapter.store.backends import open_store

    reason = bounded_text("--reason", args.reason)
    by = f"{bounded_text('--by', args.by)} (os user {os_user()})"
    db = open_store(args.db)  # a SQLite file or a postgresql:// URL
    try:
        task_id = cancel_task_id(args, db)
        audit("cancel", task_id=task_id, reason=reason, by=by)
        print_json(cancel_task(db, task_id, reason, by))
    finally:
        db.close()
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from broker_adapter.app.ops import dead_letters_command

    return dead_letters_command(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from broker_adapter.app.demo import run_demo

    if not args.verbose:  # the report tells the story; the adapter's own log would repeat it
        logging.getLogger("broker_adapter").setLevel(logging.ERROR)
    return run_demo(Path(args.keep) if args.keep else None)

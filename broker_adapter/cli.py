"""The ``broker-adapter`` command line: parses arguments and calls the library.

Every option can also come from a ``BA_*`` environment variable (the flag wins). Errors are
one line on stderr and a non-zero exit code: 2 for bad usage or configuration, 1 for a
runtime failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import ValidationError

from broker_adapter.errors import BrokerAdapterError, ConfigError, TransientError
from broker_adapter.store.retention import DEFAULT_RETENTION_S

if TYPE_CHECKING:
    from broker_adapter.receiver import Receiver

EXIT_USAGE = 2
EXIT_FAILURE = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"broker-adapter: error: {message}\n")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _add_redis(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--redis", default=_env("BA_REDIS_URL"), help="Redis URL [env BA_REDIS_URL]",
        required=required and _env("BA_REDIS_URL") is None,
    )  # fmt: skip


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db", default=_env("BA_DB"), required=_env("BA_DB") is None,
        help="SQLite database file [env BA_DB]",
    )  # fmt: skip


def _add_prefix(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default=_env("BA_PREFIX", "ba"), help="Redis key prefix")


def _add_retention(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--retention", type=float, metavar="SECONDS",
        default=_env("BA_RETENTION_S", f"{DEFAULT_RETENTION_S:g}"),
        help=f"the dedupe window: {what} [env BA_RETENTION_S; default 7 days]",
    )  # fmt: skip


def _add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port", type=int, default=_env("BA_METRICS_PORT"),
        help="serve /metrics, /healthz and /readyz on this port (default: off)"
        " [env BA_METRICS_PORT]",
    )  # fmt: skip
    p.add_argument(
        "--metrics-host", default=_env("BA_METRICS_HOST", "127.0.0.1"),
        help="address of the metrics port (default 127.0.0.1) [env BA_METRICS_HOST]",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="broker-adapter",
        description="Hand work between agents over Redis Streams without losing or doubling it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run ingest, worker processes and the dispatcher")
    _add_redis(run)
    _add_db(run)
    _add_prefix(run)
    run.add_argument("--handler", default=_env("BA_HANDLER"), required=_env("BA_HANDLER") is None)
    run.add_argument("--workers", type=int, default=_env("BA_WORKERS", "2"))
    run.add_argument("--keyring", default=_env("BA_KEYRING"), help="JSON keyring file")
    run.add_argument("--mode", choices=("signed", "acl"), default=_env("BA_MODE", "signed"))
    run.add_argument("--acl-principal", action="append", default=[], dest="acl_principals")
    run.add_argument("--name", default=_env("BA_NAME"), help="stable adapter name")
    run.add_argument("--lease", type=float, default=_env("BA_LEASE_S", "30"))
    run.add_argument("--grace", type=float, default=_env("BA_GRACE_S", "10"))
    run.add_argument("--claim-min-idle-ms", type=int, default=_env("BA_CLAIM_MIN_IDLE_MS", "60000"))
    run.add_argument(
        "--rate-limit", type=float, default=_env("BA_RATE_LIMIT"),
        help="entries per second per principal, over it dead-lettered (default: off)",
    )  # fmt: skip
    run.add_argument("--rate-burst", type=int, default=_env("BA_RATE_BURST"), help="bucket size")
    run.add_argument(
        "--max-open-tasks", type=int, default=_env("BA_MAX_OPEN_TASKS"),
        help="open tasks allowed per principal (default: no quota)",
    )  # fmt: skip
    _add_retention(
        run, "requests older than this are forgotten, and deadlines further ahead refused"
    )
    _add_metrics(run)

    pub = sub.add_parser("publish", help="sign and publish one task envelope")
    _add_redis(pub)
    _add_prefix(pub)
    pub.add_argument("--principal", required=True)
    pub.add_argument("--keyring", default=_env("BA_KEYRING"), required=_env("BA_KEYRING") is None)
    pub.add_argument("--key-id", default=None)
    pub.add_argument("--id", required=True, dest="message_id")
    pub.add_argument("--payload", required=True, help="a JSON object")
    pub.add_argument("--deadline-in", type=float, default=300.0, help="seconds from now")
    pub.add_argument("--max-attempts", type=int, default=3)
    pub.add_argument("--correlation-id", default=None)

    rcv = sub.add_parser("receive", help="apply replies once each (built-in recording effect)")
    _add_redis(rcv)
    _add_db(rcv)
    _add_prefix(rcv)
    rcv.add_argument("--principal", required=True)
    rcv.add_argument(
        "--keyring", default=_env("BA_KEYRING"), required=_env("BA_KEYRING") is None,
        help="JSON keyring file with the principal's keys (replies are signed) [env BA_KEYRING]",
    )  # fmt: skip
    rcv.add_argument("--consumer", default=None)
    _add_metrics(rcv)
    rcv.add_argument(
        "--until-idle", type=float, default=None, metavar="S",
        help="stop after S seconds in which no reply was applied: exit 0 when Redis answered"
        " the last read, 1 when it was unreachable (no progress counts as idle)",
    )  # fmt: skip
    _add_retention(rcv, "receipts older than this are forgotten")

    bak = sub.add_parser("backup", help="an online snapshot of a database (VACUUM INTO)")
    _add_db(bak)
    bak.add_argument("--out", required=True, help="the snapshot file to create (mode 0600)")

    rcp = sub.add_parser("receipts", help="list applied replies (the database is only read)")
    _add_db(rcp)
    rcp.add_argument("--json", action="store_true")

    st = sub.add_parser(
        "status", help="received, processing, terminal, delivery (the database is only read)"
    )
    _add_db(st)
    _add_redis(st, required=False)
    _add_prefix(st)
    st.add_argument("--json", action="store_true")

    cancel = sub.add_parser("cancel", help="cancel a task durably")
    _add_db(cancel)
    cancel.add_argument("task_id")
    cancel.add_argument("--reason", default="cancelled by operator")

    dl = sub.add_parser("dead-letters", help="inspect and replay dead letters")
    dls = dl.add_subparsers(dest="dl_command", required=True, parser_class=_Parser)
    for name in ("list", "show", "replay"):
        p = dls.add_parser(name)
        _add_db(p)
        _add_redis(p, required=False)
        _add_prefix(p)
        p.add_argument("--json", action="store_true")
        if name != "list":
            p.add_argument("id", help="a reply id (dead reply) or a dead-letter entry id")
        if name == "replay":
            p.add_argument("--by", default=_env("USER", "operator"))

    sub.add_parser("demo", help="run the end-to-end demo on an embedded default")
    return parser


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


def _install_stop() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


# -- commands ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from broker_adapter.runner import RunConfig, Runner

    fields: dict[str, Any] = {
        "redis_url": args.redis,
        "db_path": Path(args.db),
        "handler": args.handler,
        "workers": args.workers,
        "keyring_path": Path(args.keyring) if args.keyring else None,
        "mode": args.mode,
        "acl_principals": tuple(args.acl_principals),
        "prefix": args.prefix,
        "lease_s": args.lease,
        "grace_s": args.grace,
        "claim_min_idle_ms": args.claim_min_idle_ms,
        "rate_limit": args.rate_limit,
        "rate_burst": args.rate_burst,
        "max_open_tasks": args.max_open_tasks,
        "retention_s": args.retention,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
    }
    if args.name:
        fields["name"] = args.name
    config = _validated(RunConfig, fields)
    stop = _install_stop()
    return Runner(config).run(stop)


def cmd_publish(args: argparse.Namespace) -> int:
    from broker_adapter.auth import Keyring
    from broker_adapter.envelope import Envelope, loads_strict
    from broker_adapter.keys import Keys
    from broker_adapter.publisher import Publisher
    from broker_adapter.streams import connect

    try:
        payload = loads_strict(args.payload)
    except ValueError as exc:
        raise ConfigError(f"--payload is not valid JSON: {exc}") from None
    keyring = Keyring.load(args.keyring)
    envelope = Envelope.build(
        message_id=args.message_id,
        sender=args.principal,
        payload=payload,
        deadline=time.time() + args.deadline_in,
        max_attempts=args.max_attempts,
        **({"correlation_id": args.correlation_id} if args.correlation_id else {}),
    )
    publisher = Publisher(connect(args.redis), Keys(args.prefix), args.principal, keyring,
                          key_id=args.key_id)  # fmt: skip
    entry_id = publisher.publish(envelope)
    _print_json(
        {
            "stream": publisher.stream,
            "entry_id": entry_id,
            "principal": args.principal,
            "message_id": args.message_id,
            "fingerprint": envelope.fingerprint(),
        }
    )
    return 0


def cmd_receive(args: argparse.Namespace) -> int:
    from broker_adapter.auth import Keyring
    from broker_adapter.metrics import Observed, serve_metrics
    from broker_adapter.receiver import Receiver, ReceiverConfig, record_effect
    from broker_adapter.store import ReceiptStore, open_database
    from broker_adapter.streams import connect

    consumer = args.consumer or f"receive-{args.principal}"
    config = _validated(
        ReceiverConfig,
        {"prefix": args.prefix, "principal": args.principal, "consumer": consumer,
         "retention_s": args.retention},
    )  # fmt: skip
    keyring = Keyring.load(args.keyring)
    db = open_database(args.db)
    receiver = Receiver(
        config, connect(args.redis), ReceiptStore(db), record_effect, keyring=keyring
    )
    stop = _install_stop()
    observed = Observed(db_path=Path(args.db), redis_url=args.redis)
    observed.add_receiver(receiver)
    try:
        with serve_metrics(observed, args.metrics_host, args.metrics_port, worker_files=False):
            _receive_until(receiver, stop, args.until_idle)
    finally:
        db.close()
    return 0


def _receive_until(receiver: Receiver, stop: threading.Event, until_idle: float | None) -> None:
    """Run ``receiver`` until ``stop``, or until ``until_idle`` seconds passed without a
    reply applied, whether Redis answered empty or not at all (retried every second, said
    once per outage).

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
            n = receiver.step()
        except TransientError as exc:
            if failure is None:
                print(f"broker-adapter: retrying every 1 s: {exc}", file=sys.stderr)
            failure = exc
            left_s = 1.0 if until_idle is None else until_idle - idle_s
            stop.wait(max(0.0, min(1.0, left_s)))
            continue
        failure = None
        applied += n
        if n:
            idle_since = time.monotonic()
            print(f"received {applied} replies", file=sys.stderr)


def cmd_receipts(args: argparse.Namespace) -> int:
    from broker_adapter.store import ReceiptStore, open_database

    db = open_database(args.db, read_only=True)
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
            _print_json(row)
        else:
            print(f"{r.reply_id}  {r.message_id}  {r.status}  effects={r.effects}")
    db.close()
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    from broker_adapter.store.backup import snapshot

    _print_json(snapshot(args.db, args.out))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from broker_adapter.ops import collect_status, format_status

    report = collect_status(Path(args.db), args.redis, args.prefix)
    if args.json:
        _print_json(report)
    else:
        print(format_status(report))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from broker_adapter.store import TaskStore, open_database

    db = open_database(args.db)
    state = TaskStore(db).cancel(args.task_id, args.reason)
    _print_json({"task_id": args.task_id, "state": state.value})
    db.close()
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from broker_adapter.ops import dead_letters_command

    return dead_letters_command(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from broker_adapter.demo import run_demo

    if not args.verbose:  # the report tells the story; the adapter's own log would repeat it
        logging.getLogger("broker_adapter").setLevel(logging.ERROR)
    return run_demo()


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "publish": cmd_publish,
    "receive": cmd_receive,
    "receipts": cmd_receipts,
    "backup": cmd_backup,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "dead-letters": cmd_dead_letters,
    "demo": cmd_demo,
}


def _validated(model: Any, fields: dict[str, Any]) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "config"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise ConfigError(f"{where}: {msg}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"broker-adapter: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokerAdapterError as exc:
        print(f"broker-adapter: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130

"""The ``broker-adapter`` command line: parses arguments and calls the library.

Every option of ``run``, ``publish`` and ``receive`` (and ``--redis``, ``--db``, ``--prefix``
everywhere) can also come from a ``BA_*`` environment variable (the flag wins). Errors are
one line on stderr and a non-zero exit code: 2 for bad usage or configuration, 1 for a
runtime failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from broker_adapter import __version__
from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.app.audit import os_user
from broker_adapter.app.commands import (
    cmd_backup,
    cmd_cancel,
    cmd_dead_letters,
    cmd_demo,
    cmd_publish,
    cmd_receipts,
    cmd_receive,
    cmd_run,
    cmd_schema,
    cmd_status,
)
from broker_adapter.app.effects_cli import COMMANDS as EFFECT_COMMANDS
from broker_adapter.app.effects_cli import add_commands as add_effect_commands
from broker_adapter.app.mcp_cli import add_command as add_mcp_command
from broker_adapter.app.mcp_cli import cmd_mcp
from broker_adapter.app.options import add_settings
from broker_adapter.app.options import option as _option
from broker_adapter.app.passwords import resolve_redis_url
from broker_adapter.app.rebind import add_rebind, rebind_command
from broker_adapter.app.streams_cli import COMMANDS as STREAM_COMMANDS
from broker_adapter.app.streams_cli import add_commands as add_stream_commands
from broker_adapter.app.tasks_cli import add_task_commands, cmd_result, cmd_tasks
from broker_adapter.console import CONSOLE_HOST, CONSOLE_PORT
from broker_adapter.console.serve import cmd_console
from broker_adapter.errors import BrokerAdapterError, ConfigError
from broker_adapter.stages.ingest.config import IngestSettings

log = logging.getLogger("broker_adapter.app.cli")

EXIT_USAGE = 2
EXIT_FAILURE = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"broker-adapter: error: {message}\n")


def add_redis(p: argparse.ArgumentParser, required: bool = True) -> None:
    what = "the Redis holding the streams" if required else "also report what Redis holds"
    _option(
        p,
        "--redis",
        f"Redis URL (redis://, rediss://, unix://, or a cluster node's redis+cluster://): {what}",
        env="BA_REDIS_URL",
        required=required,
        metavar="URL",
    )
    _option(
        p,
        "--redis-password-file",
        "a file (mode 0600) whose first line is the Redis"
        " password, joined to --redis (or set BA_REDIS_PASSWORD): keeps it off the"
        " command line",
        env="BA_REDIS_PASSWORD_FILE",
        metavar="FILE",
    )


def _add_db(p: argparse.ArgumentParser, what: str) -> None:
    _option(p, "--db", what, env="BA_DB", required=True, metavar="PATH")


def add_prefix(p: argparse.ArgumentParser) -> None:
    add_settings(p, AdapterConfig, ["prefix"])


def add_keyring(p: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    _option(
        p,
        "--keyring",
        f"JSON keyring file, mode 0600: {what}",
        env="BA_KEYRING",
        required=required,
        metavar="FILE",
    )


def add_partitions(p: argparse.ArgumentParser) -> None:
    add_settings(p, IngestSettings, ["partitions"])


def _add_log_format(p: argparse.ArgumentParser) -> None:
    _option(
        p,
        "--log-format",
        'the log on stderr: text lines, or one JSON object per line (docs/OPERATIONS.md, "Logs")',
        env="BA_LOG_FORMAT",
        default="text",
        choices=("text", "json"),
    )


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per line")


#: What ``--retention`` does for each command that takes it.
_RUN_RETENTION = "requests older than this are forgotten, and deadlines further ahead refused"
_RECEIVE_RETENTION = "receipts older than this are forgotten"
_METRICS = ["metrics.port", "metrics.host"]


def _add_run(sub: argparse._SubParsersAction[_Parser]) -> None:
    run = sub.add_parser("run", help="run ingest, worker processes and the dispatcher")
    add_redis(run)
    _add_db(
        run,
        "the adapter's database: a SQLite file (created if absent), or a"
        " postgresql:// URL for a PostgreSQL database several adapters share",
    )
    add_prefix(run)
    _option(
        run,
        "--handler",
        "the handler run for each task, 'package.module:function' (or --app)",
        env="BA_HANDLER",
        metavar="MOD:FUNC",
    )
    _option(
        run,
        "--app",
        "a Router of named tasks, 'package.module:router', served in"
        " place of --handler (docs/ROUTER.md)",
        env="BA_APP",
        metavar="MOD:ROUTER",
    )
    # Checked by AdapterConfig, whose refusal says what each mode needs it for.
    add_keyring(
        run, "needed: verifies requests and signs every reply (in ACL mode too)", required=False
    )
    # Every other setting of the tree, from its declaration (metrics last, as on receive).
    add_settings(
        run,
        AdapterConfig,
        exclude=["prefix", *_METRICS],
        what={"retention_s": _RUN_RETENTION},
    )
    add_settings(run, AdapterConfig, _METRICS)
    _add_log_format(run)


def _add_publish(sub: argparse._SubParsersAction[_Parser]) -> None:
    pub = sub.add_parser("publish", help="sign and publish one task envelope")
    add_redis(pub)
    add_prefix(pub)
    _option(
        pub,
        "--principal",
        "who publishes (the sender)",
        env="BA_PRINCIPAL",
        required=True,
        metavar="P",
    )
    add_keyring(pub, "holds the principal's signing keys")
    _option(
        pub,
        "--key-id",
        "the key to sign with",
        env="BA_KEY_ID",
        shown="the principal's first key",
        metavar="KID",
    )
    add_partitions(pub)
    _option(
        pub,
        "--id",
        "the message id; resend the same id (and --deadline) until a reply arrives",
        env="BA_MESSAGE_ID",
        required=True,
        dest="message_id",
        metavar="ID",
    )
    _option(
        pub,
        "--payload",
        "the task's payload, a JSON object",
        env="BA_PAYLOAD",
        required=True,
        metavar="JSON",
    )
    _option(
        pub,
        "--deadline-in",
        "the deadline, seconds from now (a new deadline at each"
        " call: a resend with another deadline is a conflict, so resend with --deadline)",
        env="BA_DEADLINE_IN",
        default=300.0,
        type=float,
        metavar="S",
    )
    _option(
        pub,
        "--deadline",
        "the absolute deadline, epoch seconds (wins over"
        " --deadline-in); resend the same id with the 'deadline' the first call printed",
        env="BA_DEADLINE",
        shown="now + --deadline-in",
        type=float,
        metavar="EPOCH",
    )
    _option(
        pub,
        "--max-attempts",
        "attempts the adapter may make (1..10)",
        env="BA_MAX_ATTEMPTS",
        default=3,
        type=int,
        metavar="N",
    )
    _option(
        pub,
        "--correlation-id",
        "an id of the caller's, carried into the reply",
        env="BA_CORRELATION_ID",
        shown="none",
        metavar="ID",
    )
    _option(
        pub,
        "--task",
        "the task name (the envelope's task member; docs/ROUTER.md)",
        env="BA_TASK",
        shown="the adapter's default task",
        metavar="NAME",
    )


def _add_receive(sub: argparse._SubParsersAction[_Parser]) -> None:
    rcv = sub.add_parser("receive", help="apply replies once each (built-in recording effect)")
    add_redis(rcv)
    _add_db(
        rcv, "the receiver's database: a SQLite file (created if absent), or a postgresql:// URL"
    )
    add_prefix(rcv)
    _option(
        rcv, "--principal", "whose replies to read", env="BA_PRINCIPAL", required=True, metavar="P"
    )
    add_keyring(rcv, "the principal's keys (replies are signed)")
    _option(
        rcv,
        "--consumer",
        "this receiver's stable consumer name",
        env="BA_CONSUMER",
        shown="receive-<principal>",
    )
    _option(
        rcv,
        "--until-idle",
        "stop after S seconds in which no reply was applied: exit 0"
        " when Redis answered the last read, 1 when it was unreachable (no progress"
        " counts as idle)",
        env="BA_UNTIL_IDLE",
        shown="run until stopped",
        type=float,
        metavar="S",
    )
    add_settings(rcv, AdapterConfig, ["retention_s"], what={"retention_s": _RECEIVE_RETENTION})
    add_settings(rcv, AdapterConfig, _METRICS)
    _add_log_format(rcv)


def _add_console(sub: argparse._SubParsersAction[_Parser]) -> None:
    con = sub.add_parser(
        "console", help="serve the web console (needs the 'console' extra; docs/CONSOLE.md)"
    )
    con.add_argument(
        "--db",
        action="append",
        required=True,
        metavar="DB",
        help="an adapter's database: a SQLite file or a postgresql:// URL"
        " (repeat the flag to list several adapters' stores)",
    )
    add_redis(con)
    add_prefix(con)
    con.add_argument(
        "--port", type=int, default=CONSOLE_PORT, help=f"the port [default: {CONSOLE_PORT}]"
    )
    con.add_argument(
        "--host", default=CONSOLE_HOST, help=f"the address to bind [default: {CONSOLE_HOST}]"
    )
    con.add_argument(
        "--tokens",
        required=True,
        metavar="FILE",
        help='operator tokens, a JSON object {"name": "token", ...}, mode 0600'
        " (the name is what the audit records)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Every option of ``run``, ``publish`` and ``receive`` also
    reads a ``BA_*`` variable (``_option``)."""
    parser = _Parser(
        prog="broker-adapter",
        description="Hand work between agents over Redis Streams without losing or doubling"
        " it. Errors are one line on stderr; exit 2 for bad usage or configuration, 1 for a"
        " runtime failure.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("--version", action="version", version=f"broker-adapter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run(sub)
    _add_publish(sub)
    _add_receive(sub)

    bak = sub.add_parser("backup", help="an online snapshot of a database (VACUUM INTO)")
    _add_db(bak, "the SQLite database file to snapshot (must exist)")
    _option(
        bak,
        "--out",
        "the snapshot file to create (mode 0600; never overwritten)",
        required=True,
        metavar="FILE",
    )

    rcp = sub.add_parser("receipts", help="list applied replies (the database is only read)")
    _add_db(rcp, "the receiver's database: a SQLite file (must exist), or a postgresql:// URL")
    _add_json(rcp)

    st = sub.add_parser(
        "status", help="received, processing, terminal, delivery (the database is only read)"
    )
    _add_db(st, "the adapter's database: a SQLite file (must exist), or a postgresql:// URL")
    add_redis(st, required=False)
    add_prefix(st)
    _add_json(st)
    st.add_argument(
        "--watch",
        action="store_true",
        help="refresh until Ctrl-C (the terminal is cleared each time)",
    )
    st.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="S",
        help="with --watch: seconds between refreshes [default: 2.0]",
    )

    cancel = sub.add_parser(
        "cancel", help="cancel a task durably (a running one: requested, for its handler to stop)"
    )
    _add_db(cancel, "the adapter's database: a SQLite file, or a postgresql:// URL")
    cancel.add_argument("task_id", nargs="?", help="the task to cancel")
    cancel.add_argument("--message-id", help="name the task by its message id (with --principal)")
    cancel.add_argument("--principal", help="whose message id")
    _option(
        cancel,
        "--reason",
        "kept with the task and sent in its reply",
        default="cancelled by operator",
    )
    _option(
        cancel,
        "--by",
        "who cancels (kept with the reason, with the OS user)",
        env="BA_OPERATOR",
        default=os_user(),
        metavar="NAME",
    )

    dl = sub.add_parser("dead-letters", help="inspect and replay dead letters")
    dls = dl.add_subparsers(dest="dl_command", required=True, parser_class=_Parser)
    dl_help = {
        "list": "dead replies (database) and dead-letter entries (Redis)",
        "show": "one dead reply or dead-letter entry in full",
        "replay": "publish a dead reply again, or put a dead-letter entry back on its stream",
    }
    for name, what in dl_help.items():
        p = dls.add_parser(name, help=what)
        _add_db(p, "the adapter's database: a SQLite file (must exist), or a postgresql:// URL")
        add_redis(p, required=False)
        add_prefix(p)
        _add_json(p)
        if name != "list":
            p.add_argument("id", help="a reply id (dead reply) or a dead-letter entry id")
        if name == "replay":
            _option(p, "--by", "who replays (kept with the replay)", default=os_user())

    sch = sub.add_parser(
        "schema", help="the JSON Schema of each task's payload and result (tool definitions)"
    )
    sch.add_argument(
        "--app",
        required=True,
        metavar="MOD:ROUTER",
        help="the Router, 'package.module:router' (or a handler)",
    )
    sch.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="directory put first on the import path [default: .]",
    )

    add_effect_commands(sub, _option, _add_db)
    _add_console(sub)
    demo = sub.add_parser("demo", help="run the end-to-end demo on an embedded default")
    demo.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the demo's databases in DIR and print how to open the web console on them",
    )
    add_stream_commands(sub, add_redis, add_prefix)
    add_task_commands(sub, _option, _add_db, add_redis, add_prefix, add_keyring)
    add_mcp_command(sub, sys.modules[__name__])
    add_rebind(sub, _option, add_redis, _add_db, add_prefix)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "publish": cmd_publish,
    "receive": cmd_receive,
    "receipts": cmd_receipts,
    "backup": cmd_backup,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "dead-letters": cmd_dead_letters,
    "tasks": cmd_tasks,
    "result": cmd_result,
    "demo": cmd_demo,
    "console": cmd_console,
    "schema": cmd_schema,
    "mcp": cmd_mcp,
    "rebind": rebind_command,
    **EFFECT_COMMANDS,
    **STREAM_COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    from broker_adapter.app.logs import configure

    args = build_parser().parse_args(argv)
    configure(logging.DEBUG if args.verbose else logging.INFO, getattr(args, "log_format", "text"))
    try:
        if hasattr(args, "redis"):
            args.redis = resolve_redis_url(args.redis, args.redis_password_file)
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"broker-adapter: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokerAdapterError as exc:
        print(f"broker-adapter: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.verbose:
            raise
        print(
            f"broker-adapter: error: unexpected {type(exc).__name__}: {exc}"
            " (-v shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILURE

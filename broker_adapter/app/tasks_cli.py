"""The operator's commands that find a request by the ids they know: ``tasks list``,
``tasks show MESSAGE_ID|TASK_ID``, ``result --principal P --id MESSAGE_ID`` and the
``--message-id`` form of ``cancel``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from broker_adapter.errors import ConfigError

#: ``result`` exits with this when no reply is recorded (yet): pending, running or unknown.
EXIT_NO_REPLY = 3


def print_json(obj: Any) -> None:
    """``obj`` as one line of JSON (sorted keys) on stdout, as the CLI's commands print."""
    print(json.dumps(obj, sort_keys=True, default=str))


def add_task_commands(
    sub: argparse._SubParsersAction[Any],
    option: Callable[..., None],
    add_db: Callable[[argparse.ArgumentParser, str], None],
    add_redis: Callable[..., None],
    add_prefix: Callable[[argparse.ArgumentParser], None],
    add_keyring: Callable[..., None],
) -> None:
    """Register ``tasks`` (``list``, ``show``) and ``result``."""
    tasks = sub.add_parser("tasks", help="find tasks by state, principal, message id or task id")
    ts = tasks.add_subparsers(dest="tasks_command", required=True, parser_class=type(tasks))
    ls = ts.add_parser("list", help="tasks, newest first (the database is only read)")
    add_db(ls, "the adapter's database: a SQLite file (must exist), or a postgresql:// URL")
    ls.add_argument("--state", help="only tasks in this state (pending, running, done, ...)")
    ls.add_argument("--principal", help="only this principal's tasks")
    ls.add_argument("--limit", type=int, default=100, help="at most this many [default: 100]")
    show = ts.add_parser("show", help="one task in full, by task id or message id")
    add_db(show, "the adapter's database: a SQLite file (must exist), or a postgresql:// URL")
    show.add_argument("id", metavar="MESSAGE_ID|TASK_ID", help="a task id, or a message id")
    show.add_argument("--principal", help="the principal of a message id (several may use one)")

    res = sub.add_parser(
        "result", help="the signed reply recorded for a request (exit 3 while there is none)"
    )
    add_redis(res)
    add_prefix(res)
    option(res, "--principal", "whose request", env="BA_PRINCIPAL", required=True, metavar="P")
    add_keyring(res, "the principal's keys (the reply is checked)")
    option(
        res,
        "--id",
        "the request's message id",
        required=True,
        dest="message_id",
        metavar="MESSAGE_ID",
    )
    option(
        res,
        "--db",
        "the adapter's database, to tell pending, running and unknown apart",
        env="BA_DB",
        shown="not read",
        metavar="PATH",
    )


def cmd_tasks(args: argparse.Namespace) -> int:
    from broker_adapter.store.backends import open_store
    from broker_adapter.store.task_query import list_tasks, show_tasks

    db = open_store(args.db)
    try:
        if args.tasks_command == "list":
            for row in list_tasks(db, state=args.state, principal=args.principal, limit=args.limit):
                print_json(row)
            return 0
        rows = show_tasks(db, args.id, args.principal)
    finally:
        db.close()
    if not rows:
        raise ConfigError(f"no task with task id or message id {args.id!r}")
    for row in rows:
        print_json(row)
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    import asyncio

    from broker_adapter.client.request import AsyncClient
    from broker_adapter.protocol.signing import Keyring

    keyring = Keyring.load(args.keyring)

    async def look() -> Any:
        async with AsyncClient(args.redis, args.principal, keyring, prefix=args.prefix) as c:
            return await c.result(args.message_id)

    reply = asyncio.run(look())
    out: dict[str, Any] = {"principal": args.principal, "message_id": args.message_id}
    if reply is not None:
        print_json(out | {"state": reply.status, "reply": dict(reply.body)})
        return 0
    out["state"] = "unknown"
    if args.db:
        from broker_adapter.store.backends import open_store
        from broker_adapter.store.task_query import show_tasks

        db = open_store(args.db)
        try:
            rows = show_tasks(db, args.message_id, args.principal)
        finally:
            db.close()
        rows = [r for r in rows if r["principal"] == args.principal]
        if rows:
            out |= {"state": rows[0]["state"], "task_id": rows[0]["task_id"]}
    out["reply"] = None
    print_json(out)
    return EXIT_NO_REPLY


def cancel_task_id(args: argparse.Namespace, db: Any) -> str:
    """The task ``cancel`` names: its task id, or ``--message-id`` with ``--principal``."""
    from broker_adapter.store import TaskStore

    if args.message_id is None:
        if args.task_id is None:
            raise ConfigError("cancel needs a task id, or --message-id with --principal")
        return str(args.task_id)
    if args.task_id is not None or args.principal is None:
        raise ConfigError("--message-id needs --principal, and no task id")
    row = TaskStore(db).find(args.principal, args.message_id)
    if row is None:
        raise ConfigError(f"{args.principal!r} has no request {args.message_id!r}")
    return row.task_id

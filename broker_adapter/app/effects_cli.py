"""The operator's commands for effects beyond our transaction: ``reconcile`` (an operator's
answer for an ``unknown`` task; ``reconcile list``: the tasks whose outcome is unknown,
those waiting for an operator first; ``reconcile show TASK_ID``: one task's reconcile log
and compensations, with the effect key's digest and the adapter version of each record),
``approve``, ``approvals`` and ``revoke`` (approval records, bound to a principal and the
digest of an effect's arguments), and ``run``'s bound on operator waits
(``--operator-timeout``, ``--operator-timeout-action``).

Who may use them: whoever can write the adapter's database (its SQLite file, or its
PostgreSQL database: ``--db`` names either). That is the authority the
whole adapter already trusts (a writer of the file can mark any task done), so a signature
checked by the same processes that read the file would add nothing against that writer;
what the records keep out is the agents, who reach the adapter only through signed stream
entries and never write the file: nothing in a payload can make or stand for an approval.
Every record names the ``--by`` operator together with the operating-system user who ran
the command (``by (os user U)``), and every reconcile answer is kept in ``reconcile_log``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from broker_adapter.app import outcome_views
from broker_adapter.app.audit import audit, bounded_seconds, bounded_text, os_user
from broker_adapter.app.options import Option
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.idempotency import EFFECT_KEY_VERSION

if TYPE_CHECKING:
    from broker_adapter.store.approvals import ApprovalStore
    from broker_adapter.store.db import Database
    from broker_adapter.store.postgres import PgDatabase
    from broker_adapter.store.task_types import TaskState

#: The longest an approval may last, seconds (a year).
MAX_APPROVAL_S = 366 * 86_400


def add_commands(sub: Any, option: Option, add_db: Callable[[Any, str], None]) -> None:
    """Add ``reconcile``, ``approve`` and ``revoke`` to the CLI's subcommands."""
    rec = sub.add_parser(
        "reconcile",
        help="an operator's answer for an unknown task (audited); 'reconcile list' and"
        " 'reconcile show TASK_ID' show them",
    )
    add_db(rec, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    rec.add_argument(
        "task_id",
        metavar="TASK_ID|list|show",
        help="the unknown task to answer (with --outcome); 'list': the tasks"
        " whose outcome is unknown, those waiting for an operator first;"
        " 'show TASK_ID': its reconcile log and compensations",
    )
    rec.add_argument("shown", nargs="?", metavar="TASK_ID", help="with 'show': the task")
    rec.add_argument(
        "--outcome",
        choices=("done", "not-done"),
        help="done: the effect happened; not-done: it did not (a retry may"
        " follow); required to answer",
    )
    rec.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="with 'list': at most N tasks [default: 100]",
    )
    _add_by(rec, option, required=False)  # not for list and show: checked when answering
    rec.add_argument(
        "--result",
        default="null",
        metavar="JSON",
        help="with done: the task's result, a JSON value [default: null]",
    )
    rec.add_argument("--note", default=None, help="kept in the reconcile record")

    app = sub.add_parser(
        "approve",
        help="record an approval of an action on a target, for one principal's tasks with"
        " given arguments",
        description="Approve what a waiting task asks (--task: its action, target, scope,"
        " principal and arguments, printed back), or name it all (ACTION --target --scope"
        " --principal --arguments). A task of another principal, or whose effect has other"
        " arguments or another key version, does not run under the approval; it lets"
        " --uses tasks run (a task's retries use no more). List the waiting tasks with"
        " 'broker-adapter approvals'.",
    )
    add_db(app, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    app.add_argument("action", nargs="?", help="the action's name, as its handler declares it")
    app.add_argument(
        "--task",
        metavar="TASK_ID",
        help="approve what this waiting task asks (instead of the options below)",
    )
    app.add_argument("--target", help="what the action may act on")
    app.add_argument("--scope", help="within which scope")
    app.add_argument("--principal", metavar="P", help="whose tasks (the requesting principal)")
    app.add_argument(
        "--arguments",
        metavar="JSON",
        help="the effect's arguments, JSON (its handler's 'arguments', by default"
        " the whole payload); bound by their digest",
    )
    app.add_argument(
        "--version",
        type=int,
        default=EFFECT_KEY_VERSION,
        metavar="N",
        help=f"the effect key's version [default: {EFFECT_KEY_VERSION}]",
    )
    app.add_argument(
        "--uses",
        type=int,
        default=1,
        metavar="N",
        help="how many tasks may run under it [default: 1]",
    )
    app.add_argument(
        "--expires-in",
        required=True,
        type=float,
        metavar="S",
        help="the approval ends this many seconds from now",
    )
    _add_by(app, option)

    waits = sub.add_parser(
        "approvals",
        help="list the tasks waiting for an approval, with"
        " what each asks (principal, arguments and their digest)",
    )
    add_db(waits, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")

    rev = sub.add_parser("revoke", help="revoke an approval record")
    add_db(rev, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    rev.add_argument("approval_id", help="the approval (as approve printed it)")
    _add_by(rev, option)


def _add_by(p: argparse.ArgumentParser, option: Option, required: bool = True) -> None:
    option(
        p,
        "--by",
        "who decides (kept in the record, with the OS user)",
        env="BA_OPERATOR",
        required=required,
        metavar="NAME",
    )


def _who(by: str) -> str:
    """``--by`` with the operating-system user who ran the command (``os_user``: the real
    user id's entry, whatever ``$USER`` says)."""
    if not by.strip():
        raise ConfigError("--by must name who decides")
    return f"{bounded_text('--by', by)} (os user {os_user()})"


def resolve_unknown(
    db: Database | PgDatabase,
    task_id: str,
    outcome: Literal["done", "not-done"],
    who: str,
    *,
    result: str = "null",
    note: str | None = None,
) -> TaskState:
    """An operator's answer for an ``unknown`` task, audited under ``who``: ``reconcile``'s
    and the console's. ``result`` is the observed result as JSON text (with ``done``).

    Raises:
        ConfigError: ``result`` is not JSON.
        UnknownTask, StaleError, ValueError: as ``EffectsStore.operator_resolve``.
    """
    from broker_adapter.store import TaskStore
    from broker_adapter.store.effects import EffectsStore

    try:
        observed = json.loads(result)
    except ValueError as exc:
        raise ConfigError(f"--result is not JSON: {exc}") from None
    return EffectsStore(TaskStore(db).tx).operator_resolve(
        task_id, outcome, who, observed=observed, note=note
    )


def approval_store(db: Database | PgDatabase) -> ApprovalStore:
    """The approval records and waits of ``db``, through a task store's transaction object
    (``approve``'s, ``approvals``', ``revoke``'s and the console's)."""
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore

    return ApprovalStore(TaskStore(db).tx)


def grant_approval(
    db: Database | PgDatabase, what: dict[str, Any], who: str, expires_in: float, uses: int = 1
) -> str:
    """Record ``who``'s approval of what ``what`` names (``what_a_task_waits_for``, or
    ``approve``'s options) for ``expires_in`` seconds and ``uses`` tasks: ``approve``'s and
    the console's. Returns the approval's id.

    Raises:
        ConfigError: ``expires_in`` is not above 0, ``uses`` below 1, or a field is empty.
    """
    from broker_adapter.store.dbclock import read_now

    if not expires_in > 0:
        raise ConfigError("--expires-in must be above 0")
    if uses < 1:
        raise ConfigError("--uses must be 1 or more")
    store = approval_store(db)
    try:
        return store.grant_approval(
            what["action"],
            what["target"],
            what["scope"],
            who,
            read_now(db, store.clock) + expires_in,
            principal=what["principal"],
            arguments_digest=what["arguments_digest"],
            uses=uses,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def cmd_reconcile(args: argparse.Namespace) -> int:
    from broker_adapter.store.backends import open_store

    if args.task_id in ("list", "show"):
        return outcome_views.show_outcomes(args)
    if args.shown is not None:
        raise ConfigError(f"unexpected argument {args.shown!r}: answer one task at a time")
    if args.outcome is None or args.by is None:
        raise ConfigError("answering a task needs --outcome done|not-done and --by NAME")
    audit("reconcile", task_id=args.task_id, outcome=args.outcome, by=args.by)
    with open_store(args.db) as db:
        state = resolve_unknown(
            db, args.task_id, args.outcome, _who(args.by), result=args.result, note=args.note
        )
    print(json.dumps({"task_id": args.task_id, "state": state.value}, sort_keys=True))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    from broker_adapter.store.backends import open_store

    bounded_seconds("--expires-in", args.expires_in, MAX_APPROVAL_S)
    audit(
        "approve",
        task=args.task,
        action=args.action,
        target=args.target,
        scope=args.scope,
        by=args.by,
        expires_in=args.expires_in,
        uses=args.uses,
    )
    with open_store(args.db) as db:
        what = _what_to_approve(args, approval_store(db))
        approval_id = grant_approval(db, what, _who(args.by), args.expires_in, args.uses)
    print(json.dumps({"approval_id": approval_id, **what, "uses": args.uses}, sort_keys=True))
    return 0


def what_a_task_waits_for(store: Any, task_id: str) -> dict[str, Any]:
    """What a task waiting for an approval asks: action, target, scope, principal,
    arguments and their digest (``approve --task``'s and the console's).

    Raises:
        ConfigError: the task does not wait, or waits from before approvals were bound.
    """
    waits = store.waits(task_id)
    if not waits:
        raise ConfigError(f"task {task_id} is not waiting for an approval")
    (wait,) = waits
    if wait.principal is None or wait.arguments_digest is None:
        raise ConfigError(f"task {task_id} waits from before approvals were bound")
    arguments = None if wait.arguments is None else json.loads(wait.arguments)
    return {
        "action": wait.action,
        "target": wait.target,
        "scope": wait.scope,
        "principal": wait.principal,
        "arguments": arguments,
        "arguments_digest": wait.arguments_digest,
    }


def _what_to_approve(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    """The action, target, scope, principal, arguments and their digest an approval is
    for: a waiting task's (``--task``), or the options'."""
    from broker_adapter.handler.effects import arguments_digest

    if args.task is not None:
        if args.action or args.target or args.scope or args.principal or args.arguments:
            raise ConfigError(
                "--task takes what the task asks: give no ACTION or --target,"
                " --scope, --principal, --arguments with it"
            )
        return what_a_task_waits_for(store, args.task)
    missing = [
        flag
        for flag, value in (
            ("ACTION", args.action),
            ("--target", args.target),
            ("--scope", args.scope),
            ("--principal", args.principal),
            ("--arguments", args.arguments),
        )
        if not value
    ]
    if missing:
        raise ConfigError(f"approve needs --task, or {', '.join(missing)}")
    try:
        arguments = json.loads(args.arguments)
        digest = arguments_digest(args.action, arguments, args.version)
    except ValueError as exc:
        raise ConfigError(f"--arguments is not JSON: {exc}") from None
    return {
        "action": args.action,
        "target": args.target,
        "scope": args.scope,
        "principal": args.principal,
        "arguments": arguments,
        "arguments_digest": digest,
    }


def cmd_approvals(args: argparse.Namespace) -> int:
    from broker_adapter.store.backends import open_store

    with open_store(args.db) as db:
        waits = approval_store(db).waits()
    for wait in waits:
        row = dict(wait.__dict__)
        row["arguments"] = None if wait.arguments is None else json.loads(wait.arguments)
        print(json.dumps(row, sort_keys=True))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from broker_adapter.store.backends import open_store

    audit("revoke", approval_id=args.approval_id, by=args.by)
    with open_store(args.db) as db:
        revoked = approval_store(db).revoke_approval(args.approval_id, _who(args.by))
    print(json.dumps({"approval_id": args.approval_id, "revoked": revoked}, sort_keys=True))
    return 0 if revoked else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "reconcile": cmd_reconcile,
    "approve": cmd_approve,
    "approvals": cmd_approvals,
    "revoke": cmd_revoke,
}

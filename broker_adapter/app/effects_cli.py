"""The operator's commands for effects beyond our transaction: ``reconcile`` (an operator's
answer for an ``unknown`` task; ``reconcile list``: the tasks whose outcome is unknown,
those waiting for an operator first; ``reconcile show TASK_ID``: one task's reconcile log
and compensations, with the effect key's digest and the adapter version of each record),
``approve`` and ``revoke`` (approval records), and ``run``'s bound on operator waits
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
from broker_adapter.errors import ConfigError
from broker_adapter.stages.effects import DEFAULT_OPERATOR_TIMEOUT_S

if TYPE_CHECKING:
    from broker_adapter.store.db import Database
    from broker_adapter.store.lifecycle import TaskState
    from broker_adapter.store.postgres import PgDatabase

#: The longest an approval may last, seconds (a year).
MAX_APPROVAL_S = 366 * 86_400

Option = Callable[..., None]


def add_run_options(run: argparse.ArgumentParser, option: Option) -> None:
    """``run``'s bound on how long a task waits for an operator (``ReconcilePolicy``)."""
    option(run, "--operator-timeout", "a task whose effect's outcome is unknown waits this"
           " long for an operator's answer, seconds; then the alert, or the action below",
           env="BA_OPERATOR_TIMEOUT_S", default=DEFAULT_OPERATOR_TIMEOUT_S, type=float,
           metavar="S")  # fmt: skip
    option(run, "--operator-timeout-action", "past --operator-timeout: alert (it keeps"
           " waiting, marked overdue) or fail (it ends failed, its reply saying the"
           " effect's outcome is unknown)", env="BA_OPERATOR_TIMEOUT_ACTION",
           default="alert", choices=("alert", "fail"))  # fmt: skip


def add_commands(sub: Any, option: Option, add_db: Callable[[Any, str], None]) -> None:
    """Add ``reconcile``, ``approve`` and ``revoke`` to the CLI's subcommands."""
    rec = sub.add_parser(
        "reconcile",
        help="an operator's answer for an unknown task (audited); 'reconcile list' and"
        " 'reconcile show TASK_ID' show them",
    )
    add_db(rec, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    rec.add_argument("task_id", metavar="TASK_ID|list|show",
                     help="the unknown task to answer (with --outcome); 'list': the tasks"
                     " whose outcome is unknown, those waiting for an operator first;"
                     " 'show TASK_ID': its reconcile log and compensations")  # fmt: skip
    rec.add_argument("shown", nargs="?", metavar="TASK_ID", help="with 'show': the task")
    rec.add_argument("--outcome", choices=("done", "not-done"),
                     help="done: the effect happened; not-done: it did not (a retry may"
                     " follow); required to answer")  # fmt: skip
    rec.add_argument("--limit", type=int, default=100, metavar="N",
                     help="with 'list': at most N tasks [default: 100]")  # fmt: skip
    _add_by(rec, option, required=False)  # not for list and show: checked when answering
    rec.add_argument("--result", default="null", metavar="JSON",
                     help="with done: the task's result, a JSON value [default: null]")  # fmt: skip
    rec.add_argument("--note", default=None, help="kept in the reconcile record")

    app = sub.add_parser("approve", help="record an approval of an action on a target")
    add_db(app, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    app.add_argument("action", help="the action's name, as its handler declares it")
    app.add_argument("--target", required=True, help="what the action may act on")
    app.add_argument("--scope", required=True, help="within which scope")
    app.add_argument("--expires-in", required=True, type=float, metavar="S",
                     help="the approval ends this many seconds from now")  # fmt: skip
    _add_by(app, option)

    rev = sub.add_parser("revoke", help="revoke an approval record")
    add_db(rev, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    rev.add_argument("approval_id", help="the approval (as approve printed it)")
    _add_by(rev, option)


def _add_by(p: argparse.ArgumentParser, option: Option, required: bool = True) -> None:
    option(p, "--by", "who decides (kept in the record, with the OS user)", env="BA_OPERATOR",
           required=required, metavar="NAME")  # fmt: skip


def _who(by: str) -> str:
    """``--by`` with the operating-system user who ran the command (``os_user``: the real
    user id's entry, whatever ``$USER`` says)."""
    if not by.strip():
        raise ConfigError("--by must name who decides")
    return f"{bounded_text('--by', by)} (os user {os_user()})"


def resolve_unknown(
    db: Database | PgDatabase, task_id: str, outcome: Literal["done", "not-done"], who: str, *,
    result: str = "null", note: str | None = None,
) -> TaskState:  # fmt: skip
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
    return EffectsStore(TaskStore(db)).operator_resolve(
        task_id, outcome, who, observed=observed, note=note
    )


def grant_approval(
    db: Database | PgDatabase, action: str, target: str, scope: str, who: str, expires_in: float
) -> str:
    """Record ``who``'s approval of ``action`` on ``target`` in ``scope`` for
    ``expires_in`` seconds: ``approve``'s and the console's. Returns the approval's id.

    Raises:
        ConfigError: ``expires_in`` is not above 0, or a field is empty.
    """
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore

    if not expires_in > 0:
        raise ConfigError("--expires-in must be above 0")
    store = ApprovalStore(TaskStore(db))
    try:
        return store.grant_approval(action, target, scope, who, store.clock.now() + expires_in)
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
        state = resolve_unknown(db, args.task_id, args.outcome, _who(args.by),
                                result=args.result, note=args.note)  # fmt: skip
    print(json.dumps({"task_id": args.task_id, "state": state.value}, sort_keys=True))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    from broker_adapter.store.backends import open_store

    bounded_seconds("--expires-in", args.expires_in, MAX_APPROVAL_S)
    audit("approve", action=args.action, target=args.target, scope=args.scope, by=args.by,
          expires_in=args.expires_in)  # fmt: skip
    with open_store(args.db) as db:
        approval_id = grant_approval(db, args.action, args.target, args.scope, _who(args.by),
                                     args.expires_in)  # fmt: skip
    print(json.dumps({"approval_id": approval_id}, sort_keys=True))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore
    from broker_adapter.store.backends import open_store

    audit("revoke", approval_id=args.approval_id, by=args.by)
    with open_store(args.db) as db:
        revoked = ApprovalStore(TaskStore(db)).revoke_approval(args.approval_id, _who(args.by))
    print(json.dumps({"approval_id": args.approval_id, "revoked": revoked}, sort_keys=True))
    return 0 if revoked else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "reconcile": cmd_reconcile,
    "approve": cmd_approve,
    "revoke": cmd_revoke,
}

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
import getpass
import json
from collections.abc import Callable
from typing import Any

from broker_adapter.app import outcome_views
from broker_adapter.errors import ConfigError
from broker_adapter.stages.effects import DEFAULT_OPERATOR_TIMEOUT_S

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
    if not by.strip():
        raise ConfigError("--by must name who decides")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{by.strip()} (os user {user})"


def cmd_reconcile(args: argparse.Namespace) -> int:
    from broker_adapter.store import TaskStore
    from broker_adapter.store.backends import open_store
    from broker_adapter.store.effects import EffectsStore

    if args.task_id in ("list", "show"):
        return outcome_views.show_outcomes(args)
    if args.shown is not None:
        raise ConfigError(f"unexpected argument {args.shown!r}: answer one task at a time")
    if args.outcome is None or args.by is None:
        raise ConfigError("answering a task needs --outcome done|not-done and --by NAME")
    try:
        observed = json.loads(args.result)
    except ValueError as exc:
        raise ConfigError(f"--result is not JSON: {exc}") from None
    with open_store(args.db) as db:
        state = EffectsStore(TaskStore(db)).operator_resolve(
            args.task_id, args.outcome, _who(args.by), observed=observed, note=args.note
        )
    print(json.dumps({"task_id": args.task_id, "state": state.value}, sort_keys=True))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore
    from broker_adapter.store.backends import open_store

    if args.expires_in <= 0:
        raise ConfigError("--expires-in must be above 0")
    with open_store(args.db) as db:
        store = ApprovalStore(TaskStore(db))
        try:
            approval_id = store.grant_approval(args.action, args.target, args.scope,
                                               _who(args.by),
                                               store.clock.now() + args.expires_in)  # fmt: skip
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    print(json.dumps({"approval_id": approval_id}, sort_keys=True))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore
    from broker_adapter.store.backends import open_store

    with open_store(args.db) as db:
        revoked = ApprovalStore(TaskStore(db)).revoke_approval(args.approval_id, _who(args.by))
    print(json.dumps({"approval_id": args.approval_id, "revoked": revoked}, sort_keys=True))
    return 0 if revoked else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "reconcile": cmd_reconcile,
    "approve": cmd_approve,
    "revoke": cmd_revoke,
}

"""The operator's commands for effects beyond our transaction: ``reconcile`` (an operator's
answer for an ``unknown`` task), ``approve``, ``approvals`` and ``revoke`` (approval
records, bound to a principal and the digest of an effect's arguments).

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

from broker_adapter.errors import ConfigError
from broker_adapter.protocol.idempotency import EFFECT_KEY_VERSION

Option = Callable[..., None]


def add_commands(sub: Any, option: Option, add_db: Callable[[Any, str], None]) -> None:
    """Add ``reconcile``, ``approve`` and ``revoke`` to the CLI's subcommands."""
    rec = sub.add_parser("reconcile", help="an operator's answer for an unknown task (audited)")
    add_db(rec, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    rec.add_argument("task_id", help="the unknown task")
    rec.add_argument("--outcome", required=True, choices=("done", "not-done"),
                     help="done: the effect happened; not-done: it did not (a retry may"
                     " follow)")  # fmt: skip
    _add_by(rec, option)
    rec.add_argument("--result", default="null", metavar="JSON",
                     help="with done: the task's result, a JSON value [default: null]")  # fmt: skip
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
    app.add_argument("--task", metavar="TASK_ID",
                     help="approve what this waiting task asks (instead of the options below)")
    app.add_argument("--target", help="what the action may act on")
    app.add_argument("--scope", help="within which scope")
    app.add_argument("--principal", metavar="P", help="whose tasks (the requesting principal)")
    app.add_argument("--arguments", metavar="JSON",
                     help="the effect's arguments, JSON (its handler's 'arguments', by default"
                     " the whole payload); bound by their digest")
    app.add_argument("--version", type=int, default=EFFECT_KEY_VERSION, metavar="N",
                     help=f"the effect key's version [default: {EFFECT_KEY_VERSION}]")
    app.add_argument("--uses", type=int, default=1, metavar="N",
                     help="how many tasks may run under it [default: 1]")
    app.add_argument("--expires-in", required=True, type=float, metavar="S",
                     help="the approval ends this many seconds from now")
    _add_by(app, option)

    waits = sub.add_parser("approvals", help="list the tasks waiting for an approval, with"
                           " what each asks (principal, arguments and their digest)")
    add_db(waits, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")

    rev = sub.add_parser("revoke", help="revoke an approval record")
    add_db(rev, "the adapter's database: a SQLite file (must exist) or a postgresql:// URL")
    rev.add_argument("approval_id", help="the approval (as approve printed it)")
    _add_by(rev, option)


def _add_by(p: argparse.ArgumentParser, option: Option) -> None:
    option(p, "--by", "who decides (kept in the record, with the OS user)", env="BA_OPERATOR",
           required=True, metavar="NAME")  # fmt: skip


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
    from broker_adapter.store.dbclock import read_now

    if args.expires_in <= 0:
        raise ConfigError("--expires-in must be above 0")
    if args.uses < 1:
        raise ConfigError("--uses must be 1 or more")
    with open_store(args.db) as db:
        store = ApprovalStore(TaskStore(db))
        what = _what_to_approve(args, store)
        try:
            approval_id = store.grant_approval(
                what["action"], what["target"], what["scope"], _who(args.by),
                read_now(db, store.clock) + args.expires_in, principal=what["principal"],
                arguments_digest=what["arguments_digest"], uses=args.uses,
            )  # fmt: skip
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    print(json.dumps({"approval_id": approval_id, **what, "uses": args.uses}, sort_keys=True))
    return 0


def _what_to_approve(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    """The action, target, scope, principal, arguments and their digest an approval is
    for: a waiting task's (``--task``), or the options'."""
    from broker_adapter.stages.effects import arguments_digest

    if args.task is not None:
        if args.action or args.target or args.scope or args.principal or args.arguments:
            raise ConfigError("--task takes what the task asks: give no ACTION or --target,"
                              " --scope, --principal, --arguments with it")  # fmt: skip
        waits = store.waits(args.task)
        if not waits:
            raise ConfigError(f"task {args.task} is not waiting for an approval")
        (wait,) = waits
        if wait.principal is None or wait.arguments_digest is None:
            raise ConfigError(f"task {args.task} waits from before approvals were bound")
        arguments = None if wait.arguments is None else json.loads(wait.arguments)
        return {"action": wait.action, "target": wait.target, "scope": wait.scope,
                "principal": wait.principal, "arguments": arguments,
                "arguments_digest": wait.arguments_digest}  # fmt: skip
    missing = [flag for flag, value in (("ACTION", args.action), ("--target", args.target),
               ("--scope", args.scope), ("--principal", args.principal),
               ("--arguments", args.arguments)) if not value]  # fmt: skip
    if missing:
        raise ConfigError(f"approve needs --task, or {', '.join(missing)}")
    try:
        arguments = json.loads(args.arguments)
        digest = arguments_digest(args.action, arguments, args.version)
    except ValueError as exc:
        raise ConfigError(f"--arguments is not JSON: {exc}") from None
    return {"action": args.action, "target": args.target, "scope": args.scope,
            "principal": args.principal, "arguments": arguments,
            "arguments_digest": digest}  # fmt: skip


def cmd_approvals(args: argparse.Namespace) -> int:
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore
    from broker_adapter.store.backends import open_store

    with open_store(args.db) as db:
        waits = ApprovalStore(TaskStore(db)).waits()
    for wait in waits:
        row = dict(wait.__dict__)
        row["arguments"] = None if wait.arguments is None else json.loads(wait.arguments)
        print(json.dumps(row, sort_keys=True))
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
    "approvals": cmd_approvals,
    "revoke": cmd_revoke,
}

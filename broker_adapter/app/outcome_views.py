"""``broker-adapter reconcile list`` and ``reconcile show TASK_ID``: what an on-call engineer
reads about uncertain outcomes (``store.operator_waits``), as JSON lines (list) or one JSON
object (show). Read-only: the database is opened for reading, nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from broker_adapter.errors import ConfigError


def show_outcomes(args: argparse.Namespace) -> int:
    """``list``: one JSON line per ``unknown`` task (``OperatorWaits.waiting``), those
    waiting for an operator first. ``show TASK_ID``: the task's record, reconcile log and
    compensations. Returns 0, or 1 for a task that does not exist."""
    from broker_adapter.store import TaskStore
    from broker_adapter.store.backends import open_store
    from broker_adapter.store.effects import EffectsStore
    from broker_adapter.store.operator_waits import OperatorWaits

    if args.task_id == "show" and not args.shown:
        raise ConfigError("reconcile show needs the task: reconcile show TASK_ID")
    if args.task_id == "list" and args.shown is not None:
        raise ConfigError(f"reconcile list takes no task (got {args.shown!r})")
    if args.limit < 1:
        raise ConfigError("--limit must be at least 1")
    with open_store(args.db, read_only=True) as db:
        waits = OperatorWaits(EffectsStore(TaskStore(db).tx))
        if args.task_id == "list":
            for task in waits.waiting(args.limit):
                print(json.dumps(dataclasses.asdict(task), sort_keys=True))
            return 0
        shown = waits.show(args.shown)
    if shown is None:
        print(json.dumps({"task_id": args.shown, "error": "no such task"}, sort_keys=True))
        return 1
    print(json.dumps(shown, sort_keys=True, indent=2))
    return 0

"""Planted bugs: test-only patches that break an invariant, so the checker can be shown to
catch them. The library itself has no switch for any of this.

``python -m tests.chaos.planted <bug> <broker_adapter CLI arguments...>`` patches the
library in this process, then runs the CLI's ``main``. The bug name is also exported as
``CHAOS_PLANTED``, and importing this module applies the patch named there: worker
processes are started with multiprocessing's ``spawn``, which imports the parent's main
module (this one) in each child, so the children run the patched code too. Each process
that applies a patch says so on stderr (``planted: <bug> active in pid N``).

Bugs:

* ``xack_before_commit``: ingest acknowledges a batch (XACK) BEFORE its inbox transaction
  commits (docs/RULES.md rule 5). A crash between the two loses the batch.
* ``stale_finish``: a successful commit (``TaskStore.finish`` and the batched ``settle_*``
  methods) skips the fence check: it is made in the name of whoever holds the task now.
  A zombie worker that wakes up after another worker re-claimed its task commits its
  result although its own fence is stale (rule 10).
* ``skip_reply_signature``: the receiver takes every reply entry's signature on trust
  (``receiver.check_signature`` verifies nothing): a forged reply, well formed but signed
  wrongly or not at all, is applied like the adapter's own. The chaos runs start the
  receivers under the bug too (``tests.chaos.receiver`` imports this module).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from broker_adapter.protocol.signing import Keyring
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.receiver import receiver
from broker_adapter.store.inbox import AcceptItem, AcceptResult, Intake
from broker_adapter.store.tasks import TaskStore

ENV = "CHAOS_PLANTED"
BUGS = ("xack_before_commit", "stale_finish", "skip_reply_signature")
_applied: set[str] = set()


def _patch_xack_before_commit() -> None:
    """Wrap ``Ingestor._handle`` so that, while it runs, the store's ``accept`` first
    acknowledges the batch's entries and only then commits them (the planted bug)."""
    original_handle = Ingestor._handle

    def handle(self: Ingestor, source: Any, entries: list[Any], *, peek: bool = False) -> int:
        tasks = self.tasks
        accept, accept_and_claim = tasks.accept, tasks.accept_and_claim

        def ack_first(items: Sequence[AcceptItem]) -> None:
            ids = [item.entry_id for item in items if item.entry_id]
            self.stats.acked += source.reader.ack(ids)  # BUG: XACK before the commit

        def accept_after_ack(items: Sequence[AcceptItem]) -> list[AcceptResult]:
            ack_first(items)
            return accept(items)

        def accept_and_claim_after_ack(
            items: Sequence[AcceptItem], claim_for: Sequence[tuple[str, int]]
        ) -> Intake:
            ack_first(items)  # the hand-off's accept (``handoff.Handoff.accept``)
            return accept_and_claim(items, claim_for)

        tasks.accept = accept_after_ack  # type: ignore[method-assign]
        tasks.accept_and_claim = accept_and_claim_after_ack  # type: ignore[method-assign]
        try:
            return original_handle(self, source, entries, peek=peek)
        finally:
            del tasks.accept, tasks.accept_and_claim  # back to the class's methods

    Ingestor._handle = handle  # type: ignore[method-assign]


def _current_holder(store: TaskStore, task_id: str) -> tuple[str, int] | None:
    """The owner and fence of whoever holds ``task_id`` now, with its lease made live."""
    now = store.clock.now()
    with store.db.write("planted") as c:
        row = c.execute(
            "SELECT owner, fence FROM tasks WHERE task_id = ? AND state = 'running'", (task_id,)
        ).fetchone()
        if row is None or row["owner"] is None:
            return None
        c.execute(
            "UPDATE tasks SET lease_until = max(lease_until, ?) WHERE task_id = ?",
            (now + 60.0, task_id),
        )
        return str(row["owner"]), int(row["fence"])


def _patch_stale_finish() -> None:
    """Every successful commit (``settle_batch``, the one settle path: the worker's, and
    ``finish`` goes through it) is made in the name of whoever holds the task NOW (its
    owner, its fence, a live lease), not of the claim that ran the handler: the fence check
    can no longer refuse a zombie. Wrapping the public commit API keeps this independent of
    how the store implements its check."""
    TaskStore.settle_batch = _relabelled(TaskStore.settle_batch)  # type: ignore[method-assign]


def _relabelled(original: Callable[..., Any]) -> Callable[..., Any]:
    def settle(self: TaskStore, items: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        out = []
        for item in items:
            holder = _current_holder(self, item.task_id) if item.result is not None else None
            if holder is not None:  # BUG: the caller's fence is not checked
                item = dataclasses.replace(item, owner=holder[0], fence=holder[1])
            out.append(item)
        return original(self, out, *args, **kwargs)

    return settle


def accept_any_signature(
    fields: Mapping[bytes, bytes], principal: str, reply_id: str, keyring: Keyring
) -> str:
    """``receiver.check_signature`` without the check (the planted bug): the entry's key
    id, or ``""``, whatever ``sig`` holds."""
    kid = fields.get(b"kid")
    return kid.decode("ascii", "replace") if kid else ""  # BUG: nothing is verified


def _patch_skip_reply_signature() -> None:
    receiver.check_signature = accept_any_signature


_PATCHES: dict[str, tuple[Any, str, Callable[[], None]]] = {
    "xack_before_commit": (Ingestor, "_handle", _patch_xack_before_commit),
    "stale_finish": (TaskStore, "finish", _patch_stale_finish),
    "skip_reply_signature": (receiver, "check_signature", _patch_skip_reply_signature),
}


def apply(bug: str) -> None:
    """Patch the library in this process (idempotent).

    Raises:
        ValueError: an unknown bug name.
        RuntimeError: the library code the patch wraps is gone (refactored).
    """
    if bug not in BUGS:
        raise ValueError(f"unknown planted bug {bug!r}; known: {', '.join(BUGS)}")
    if bug in _applied:
        return
    owner, name, patch = _PATCHES[bug]
    if not callable(getattr(owner, name, None)):
        raise RuntimeError(
            f"planted bug {bug!r} patches {owner.__name__}.{name}, which no longer exists: "
            "update tests/chaos/planted.py to the library's new code path"
        )
    patch()
    _applied.add(bug)
    print(f"planted: {bug} active in pid {os.getpid()}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(
            f"usage: python -m tests.chaos.planted {{{'|'.join(BUGS)}}} <cli args>", file=sys.stderr
        )
        return 2
    bug, rest = args[0], args[1:]
    os.environ[ENV] = bug  # inherited by spawned worker processes
    apply(bug)
    from broker_adapter.app.cli import main as cli_main

    return cli_main(rest)


_from_env = os.environ.get(ENV)
if _from_env:
    apply(_from_env)

if __name__ == "__main__":
    sys.exit(main())

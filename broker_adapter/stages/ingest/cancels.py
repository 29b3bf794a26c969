"""Cancel over the wire: what the ingest does with an envelope of kind ``cancel``.

A helper of the ingest, not a stage. A ``cancel`` envelope asks to cancel one earlier
request of the SAME principal, named by ``payload["message_id"]`` (``payload["principal"]``,
if present, must be the sender: a principal cancels only its own requests). The ingest
accepts it as no task (``Outcome.NOT_TASK``) and then, after the batch's transaction,
applies it in a short transaction of its own (``EffectsStore.request_cancel``, the store
path of ``broker-adapter cancel``): a pending task ends ``cancelled`` with its reply; a
running one gets a cancel request (its handler sees it at its next check); a task already
ended is left as it is. Applying a cancel twice changes nothing, so a resent cancel (or a
redelivery after a crash before its acknowledgement) is harmless and needs no inbox record.

Refused, and dead-lettered with the reason (field ``payload``):

* ``bad_cancel``: the payload is not ``{"message_id": <id>}`` (optionally with
  ``"principal"``);
* ``not_owner``: ``payload["principal"]`` names another principal;
* ``unknown_task``: the sender has no request with that message id (never received, or
  purged after the retention window).
"""

from __future__ import annotations

from typing import Any

from broker_adapter.errors import EnvelopeError
from broker_adapter.protocol.envelope import Envelope, check_principal
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.task_types import TaskState, UnknownTask
from broker_adapter.store.tasks import TaskStore

CANCEL_KIND = "cancel"
_PAYLOAD_KEYS = frozenset({"message_id", "principal"})


def cancel_target(principal: str, envelope: Envelope) -> str:
    """The message id a ``cancel`` envelope of ``principal`` names.

    Raises:
        EnvelopeError: ``bad_cancel`` or ``not_owner`` (field ``payload``).
    """
    payload: dict[str, Any] = envelope.payload
    target = payload.get("message_id")
    if not isinstance(target, str) or not payload.keys() <= _PAYLOAD_KEYS:
        raise EnvelopeError(
            "payload",
            "bad_cancel",
            'a cancel\'s payload is {"message_id": <id>} (and optionally "principal")',
        )
    try:
        Envelope(message_id=target, sender=principal, payload={}, deadline=1.0)
    except EnvelopeError as exc:
        raise EnvelopeError("payload", "bad_cancel", f"message_id: {exc.detail}") from None
    named = payload.get("principal", principal)
    if named != principal:
        shown = named if isinstance(named, str) else repr(named)
        raise EnvelopeError(
            "payload",
            "not_owner",
            f"{principal!r} cannot cancel a request of {check_or_repr(shown)}",
        )
    return target


def check_or_repr(name: str) -> str:
    """A principal name as it may be shown (an invalid one as its repr, cut short)."""
    try:
        return repr(check_principal(name, "principal"))
    except EnvelopeError:
        return repr(name[:64])


def apply_cancel(tasks: TaskStore, principal: str, envelope: Envelope) -> tuple[str, TaskState]:
    """Apply ``principal``'s cancel envelope; returns the task id and the state it left.

    Raises:
        EnvelopeError: ``bad_cancel``, ``not_owner`` or ``unknown_task``.
        TransientError: the database was busy (nothing changed; retry the entry).
    """
    target = cancel_target(principal, envelope)
    row = tasks.find(principal, target)
    if row is None:
        raise EnvelopeError(
            "payload", "unknown_task", f"{principal!r} has no request {target!r} to cancel"
        )
    reason = f"cancelled by {principal!r} (cancel {envelope.message_id!r})"
    try:
        return row.task_id, EffectsStore(tasks.tx).request_cancel(row.task_id, reason)
    except UnknownTask:  # purged between the look and the cancel
        raise EnvelopeError(
            "payload", "unknown_task", f"{principal!r} has no request {target!r} to cancel"
        ) from None

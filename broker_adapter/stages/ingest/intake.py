"""The ingest's entry screening: each read stream entry becomes an ``AcceptItem`` or a dead
letter with its reason.

* Rule 2: every stored request carries a principal from a trusted check: a verified HMAC
  (signed mode, ``signing.Keyring``) or the stream a Redis ACL lets only that principal
  write (ACL mode). An entry that fails the check is dead-lettered, never stored.
* An authenticated entry is charged to its principal's ingress limits (``limits``); the
  refused ones are dead-lettered together, in one round trip.
* Each entry is handled on its own: an exception while checking one (a bug, or input no
  check foresaw) dead-letters that entry as ``internal_error`` with the exception class,
  and the rest of its batch goes on; only transient failures of Redis or SQLite (not the
  entry's fault) propagate, and the batch is then replayed.

The shape of an entry (fields, size) was screened by the ``GroupReader`` before it gets here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from broker_adapter.errors import EnvelopeError, TransientError
from broker_adapter.protocol import deadletter
from broker_adapter.protocol.signing import (
    Authenticated,
    EntryFields,
    Keyring,
    check_stream_principal,
)
from broker_adapter.redis.entry import StreamEntry
from broker_adapter.redis.reader import GroupReader
from broker_adapter.stages.ingest.limits import IngressLimits
from broker_adapter.store.inbox import AcceptItem


def authenticator(
    principal: str | None, keyring: Keyring | None
) -> Callable[[EntryFields], Authenticated]:
    """How an entry's fields are authenticated: against the ``principal`` its stream is
    bound to (ACL mode), else by ``keyring`` (signed mode).

    Raises:
        ValueError: neither a principal nor a keyring.
    """
    if principal is not None:
        return partial(check_stream_principal, principal=principal)
    if keyring is None:
        raise ValueError("signed mode needs a keyring to verify signatures")
    return keyring.authenticate


def screen(
    reader: GroupReader,
    entries: list[StreamEntry],
    authenticate: Callable[[EntryFields], Authenticated],
    limits: IngressLimits,
    *,
    principal: str | None = None,
) -> tuple[list[StreamEntry], list[AcceptItem]]:
    """Authenticate and admit a batch; dead-letter (through ``reader``) the entries that
    fail.

    Args:
        authenticate: from ``authenticator``.
        principal: the principal the stream is bound to (ACL mode), named in the dead
            letters of entries that fail authentication.

    Returns:
        the entries that passed and, in the same order, their accept items.

    Raises:
        TransientError: Redis or SQLite failed (not the entry's fault); nothing of the
            batch is acknowledged.
    """
    good: list[StreamEntry] = []
    items: list[AcceptItem] = []
    refused: list[tuple[StreamEntry, str, str, dict[str, str]]] = []
    limits.new_batch()
    authenticated: list[tuple[StreamEntry, Authenticated]] = []
    for entry in entries:
        try:
            auth = authenticate(entry.fields or {})
        except EnvelopeError as exc:
            extra = {deadletter.FIELD: exc.field}
            if principal is not None:
                extra[deadletter.PRINCIPAL] = principal
            reader.dead_letter(entry, exc.reason, exc.detail, extra=extra)
            continue
        except TransientError:
            raise  # not the entry's fault: the batch is replayed
        except Exception as exc:  # noqa: BLE001 - this entry's problem, not the batch's
            reader.dead_letter_exception(entry, exc, "authenticating it")
            continue
        authenticated.append((entry, auth))
    known = limits.known([(a.principal, a.envelope.message_id) for _, a in authenticated])
    for entry, auth in authenticated:
        stored = (auth.principal, auth.envelope.message_id) in known
        refusal = None if stored else limits.admit(auth.principal)
        if refusal is not None:  # dead-lettered together below: a flood is cheap to refuse
            refused.append(
                (entry, *refusal, {deadletter.FIELD: "", deadletter.PRINCIPAL: auth.principal})
            )
            continue
        good.append(entry)
        items.append(AcceptItem(auth.principal, auth.envelope, entry.entry_id, auth.kid))
    if refused:
        reader.dead_letter_many(refused)
    return good, items

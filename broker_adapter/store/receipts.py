"""Receiver-side receipts: each reply applied once, its effect committed with its receipt.

``apply_many`` applies a batch in ONE transaction, each reply under a savepoint of its own:
look up the reply id; if new, run the caller's effect on the same connection and keep the
receipt; commit. A crash before COMMIT leaves neither the receipt nor the effect, so the
redelivered reply applies cleanly; a crash after it leaves both, so the redelivery is
recognised as a duplicate and the effect is skipped. The same reply id with another content
hash is refused and nothing is written.

One text for both stores (``store.sql``). What differs is how a new reply id is held
while its effect runs:

* SQLite runs one writer at a time (``BEGIN IMMEDIATE``): the lookup in the transaction
  decides, and the receipt is inserted whole, effect result included, after the effect
  (one ``INSERT`` per reply).
* PostgreSQL lets two receivers (on two hosts) be handed the same reply at once, and a
  row that is not there yet cannot be locked. So the receipt is inserted FIRST, with
  ``ON CONFLICT DO NOTHING`` on its primary key: the one insert that wins runs the
  effect and then writes its result; the other waits for the winner's COMMIT, finds the
  row, and answers ``duplicate`` (same content hash) or ``conflict`` without running
  anything. A receipt never changes once committed, so the lookups need no row lock.

The effect callback runs inside the transaction by design: it must be a local database
write, quick and free of network calls. Effects that leave this database (HTTP, e-mail,
payments) must instead carry the reply's idempotency key to a system that checks it.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import StoreBusy
from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.protocol.reply import Reply
from broker_adapter.store.retention import PURGE_BATCH, PurgeBatch, purge_receipts, whole_pass
from broker_adapter.store.sql import Conn, Db, in_lists, marks


class ReceiptOutcome(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Receipt:
    reply_id: str
    content_hash: str
    principal: str
    message_id: str | None
    task_id: str | None
    status: str | None
    body: bytes
    entry_id: str | None
    received_at: float
    effects: int
    effect_result: str | None

    def reply(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.body)
        return value


_NAMES = tuple(Receipt.__dataclass_fields__)
_RECEIPT_COLUMNS = ", ".join(_NAMES)
_SELECT = f"SELECT {_RECEIPT_COLUMNS} FROM receipts"
_INSERT = f"INSERT INTO receipts ({_RECEIPT_COLUMNS}) VALUES ({marks(len(_NAMES))})"


def _receipt(row: Any) -> Receipt:
    """A receipt from its row (SQLite's ``Row`` or PostgreSQL's dict, read by name)."""
    values = dict(row)
    values["body"] = bytes(values["body"])
    return Receipt(**values)


#: effect(conn, reply) -> JSON value kept as the receipt's ``effect_result``; ``reply`` is
#: the parsed body (``protocol.reply.Reply``). The connection is the open transaction's
#: (``store.sql.Conn``: ``?`` placeholders): SQLite's ``Database.write`` connection, or
#: PostgreSQL's ``store.postgres.db.PgConn``.
Effect = Callable[[Any, Reply], Any]


class ReceiptStore:
    """Receipts of replies applied by one receiver, on either store.

    Args:
        db: the receiver's database (``store.db.Database`` or ``store.postgres.PgDatabase``).
        clock: time source.
    """

    def __init__(self, db: Db, clock: Clock | None = None) -> None:
        self.db = db
        self.clock = clock or SystemClock()

    def get(self, reply_id: str) -> Receipt | None:
        row = self.db.fetch_one(f"{_SELECT} WHERE reply_id = ?", (reply_id,))
        return None if row is None else _receipt(row)

    def list(self) -> builtins.list[Receipt]:
        with self.db.read() as c:
            rows = c.execute(f"{_SELECT} ORDER BY received_at").fetchall()
        return [_receipt(r) for r in rows]

    def purge_batch(self, cutoff: float, after: int = 0, limit: int = PURGE_BATCH) -> PurgeBatch:
        """Forget at most ``limit`` receipts applied at or before ``cutoff`` (a time on this
        store's clock), oldest first, in one short transaction; a reply redelivered after
        its receipt is gone would be applied again, so the receiver chooses ``cutoff``
        (its window, and no later than its oldest pending entry)."""
        return purge_receipts(self.db, cutoff, after, limit)

    def purge(self, retention_s: float, limit: int = PURGE_BATCH) -> int:
        """A whole pass of ``purge_batch`` for the receipts older than ``retention_s``.
        Returns how many were forgotten."""
        cutoff = self.clock.now() - retention_s
        return whole_pass(lambda after: self.purge_batch(cutoff, after, limit)).receipts

    # -- batches (the receiver) -----------------------------------------------------------

    def apply_many(
        self, items: Sequence[ReceiptItem], effect: Effect | None
    ) -> builtins.list[AppliedItem]:
        """Apply a batch of replies, each at most once, in ONE transaction.

        Each reply runs under its own SAVEPOINT: new → effect and receipt; known with the
        same hash → ``DUPLICATE`` with the earlier receipt, effect skipped; known with
        another hash → ``CONFLICT``, nothing written. An effect that raises rolls back to
        its savepoint (neither its receipt nor any of its writes are kept) and is reported;
        the rest of the batch commits. The same reply id twice in one batch is a duplicate
        the second time.

        Args:
            items: the replies, in stream order.
            effect: called with (connection, ``Reply``) for each new reply, inside the
                transaction; a local database write only (see the module docstring).

        Returns:
            one ``AppliedItem`` per item, in order.

        Raises:
            StoreBusy, StoreError: the transaction as a whole failed; nothing was kept.
        """
        out: builtins.list[AppliedItem] = []
        if not items:
            return out
        now = self.clock.now()
        with self.db.write("receipt") as c:
            known = self._prefetch(c, items)
            for item in items:
                if effect is None:  # nothing that can fail half-way: no savepoint needed
                    outcome, receipt = self._apply_in(c, item, None, now, known)
                    out.append(AppliedItem(item.reply_id, outcome, receipt))
                    continue
                c.execute("SAVEPOINT receipt_one")
                try:
                    outcome, receipt = self._apply_in(c, item, effect, now, known)
                except Exception as exc:  # noqa: BLE001 - the user's effect failed: report it
                    c.execute("ROLLBACK TO receipt_one")
                    out.append(AppliedItem(item.reply_id, None, None, exc))
                else:
                    out.append(AppliedItem(item.reply_id, outcome, receipt))
                c.execute("RELEASE receipt_one")
        return out

    @staticmethod
    def _prefetch(c: Conn, items: Sequence[ReceiptItem]) -> dict[str, Receipt]:
        """The receipts already kept for a batch's reply ids (primary-key searches)."""
        ids = list({item.reply_id for item in items})
        known: dict[str, Receipt] = {}
        for chunk, places in in_lists(ids):
            for row in c.execute(f"{_SELECT} WHERE reply_id IN ({places})", chunk).fetchall():
                known[row["reply_id"]] = _receipt(row)
        return known

    def _apply_in(
        self,
        c: Conn,
        item: ReceiptItem,
        effect: Effect | None,
        now: float,
        known: dict[str, Receipt] | None = None,
    ) -> tuple[ReceiptOutcome, Receipt]:
        """Apply one reply in the open transaction (see the module docstring for the two
        engines' ways). ``known``, when given, holds every receipt of the batch's reply
        ids (``_prefetch``) and learns the new ones."""
        if known is None:
            row = c.execute(f"{_SELECT} WHERE reply_id = ?", (item.reply_id,)).fetchone()
            earlier = None if row is None else _receipt(row)
        else:
            earlier = known.get(item.reply_id)
        if earlier is not None:
            return _seen(earlier, item), earlier
        reply = item.reply if item.reply is not None else Reply.from_mapping(json.loads(item.body))
        effects, outcome = (1 if effect is not None else 0), ReceiptOutcome.APPLIED
        if c.dialect.name == "sqlite":  # the only writer: the lookup decided
            result = None if effect is None else _result(effect(c, reply))
            receipt = _new(item, reply, now, effects, result)
            c.execute(_INSERT, tuple(getattr(receipt, n) for n in _NAMES))
        else:  # hold the reply id first; a concurrent holder's COMMIT is waited for
            receipt = _new(item, reply, now, effects, None)
            claim = c.execute(
                f"{_INSERT} ON CONFLICT (reply_id) DO NOTHING",
                tuple(getattr(receipt, n) for n in _NAMES),
            )
            if claim.rowcount == 0:  # another receiver's, committed: nothing of ours runs
                receipt = self._committed(c, item.reply_id)
                outcome = _seen(receipt, item)
            elif effect is not None:
                receipt = replace(receipt, effect_result=_result(effect(c, reply)))
                c.execute(
                    "UPDATE receipts SET effect_result = ? WHERE reply_id = ?",
                    (receipt.effect_result, item.reply_id),
                )
        if known is not None:
            known[item.reply_id] = receipt
        return outcome, receipt

    @staticmethod
    def _committed(c: Conn, reply_id: str) -> Receipt:
        """The receipt another transaction committed while ours tried to insert it."""
        row = c.execute(f"{_SELECT} WHERE reply_id = ?", (reply_id,)).fetchone()
        if row is None:  # it was purged in between: try the whole batch again
            raise StoreBusy(f"receipt {reply_id!r} came and went during the transaction")
        return _receipt(row)


def _seen(earlier: Receipt, item: ReceiptItem) -> ReceiptOutcome:
    """What a reply whose id has a receipt already is: the same one again, or not."""
    same = earlier.content_hash == item.content_hash
    return ReceiptOutcome.DUPLICATE if same else ReceiptOutcome.CONFLICT


def _result(value: Any) -> str:
    """An effect's return value as the receipt keeps it: canonical JSON (a value that is
    not JSON raises, and so rolls the reply back)."""
    return canonical_json(value).decode("utf-8")


def _new(item: ReceiptItem, reply: Reply, now: float, effects: int, result: str | None) -> Receipt:
    """The receipt of a reply applied now."""
    return Receipt(
        reply_id=item.reply_id,
        content_hash=item.content_hash,
        principal=item.principal,
        message_id=reply.message_id,
        task_id=reply.task_id,
        status=reply.status,
        body=item.body,
        entry_id=item.entry_id,
        received_at=now,
        effects=effects,
        effect_result=result,
    )


@dataclass(frozen=True)
class ReceiptItem:
    """One reply for ``apply_many``."""

    reply_id: str
    content_hash: str
    principal: str
    body: bytes
    entry_id: str | None = None
    #: ``body`` already parsed (by the receiver's checks), so it is not parsed twice.
    reply: Reply | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class AppliedItem:
    """What ``apply_many`` did with one reply.

    Attributes:
        outcome: ``None`` when the effect raised (nothing of this reply was kept).
        receipt: the new receipt, or the earlier one for a duplicate or a conflict.
        error: the effect's exception when ``outcome`` is ``None``.
    """

    reply_id: str
    outcome: ReceiptOutcome | None
    receipt: Receipt | None
    error: Exception | None = None

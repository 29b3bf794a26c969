"""Receiver-side receipts on PostgreSQL: each reply applied once, its effect committed with
its receipt (``store.receipts``' contract).

Two receivers (on two hosts) may be handed the same reply. The receipt is inserted FIRST,
with ``ON CONFLICT DO NOTHING`` on its primary key (the reply id): the one insert that
wins runs the effect, in the same transaction; the other waits for it to commit, finds
the row, and answers ``duplicate`` (same content hash) or ``conflict`` without running
anything. The effect gets the transaction's connection (a psycopg ``Connection``) and must
be a local database write, quick and free of network calls.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Sequence

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.protocol.reply import Reply
from broker_adapter.store.postgres.db import Conn, PgDatabase, Row
from broker_adapter.store.receipts import (
    AppliedItem,
    Effect,
    Receipt,
    ReceiptItem,
    ReceiptOutcome,
)
from broker_adapter.store.retention import PURGE_BATCH, PurgeBatch, purge_receipts, whole_pass

_COLUMNS = ", ".join(Receipt.__dataclass_fields__)


def _receipt(row: Row) -> Receipt:
    values = {name: row[name] for name in Receipt.__dataclass_fields__}
    values["body"] = bytes(values["body"])
    return Receipt(**values)


class PgReceiptStore:
    """Receipts of replies applied by one receiver (``store.receipts.ReceiptStore``)."""

    def __init__(self, db: PgDatabase, clock: Clock | None = None) -> None:
        self.db = db
        self.clock = clock or SystemClock()

    def apply(
        self, *, reply_id: str, content_hash: str, principal: str, body: bytes,
        effect: Effect | None, entry_id: str | None = None,
    ) -> tuple[ReceiptOutcome, Receipt]:  # fmt: skip
        """Apply one reply at most once (see the module docstring)."""
        item = ReceiptItem(reply_id, content_hash, principal, body, entry_id)
        with self.db.write("receipt") as c:
            return self._apply_in(c, item, effect, self.clock.now())

    def apply_many(
        self, items: Sequence[ReceiptItem], effect: Effect | None
    ) -> builtins.list[AppliedItem]:
        """Apply a batch, each reply at most once, in ONE transaction; each under its own
        savepoint when there is an effect (one that raises rolls back to it, is reported,
        and the rest commits)."""
        out: builtins.list[AppliedItem] = []
        if not items:
            return out
        now = self.clock.now()
        with self.db.write("receipt") as c:
            for item in items:
                if effect is None:
                    outcome, receipt = self._apply_in(c, item, None, now)
                    out.append(AppliedItem(item.reply_id, outcome, receipt))
                    continue
                try:
                    with c.transaction():  # a savepoint inside the open transaction
                        outcome, receipt = self._apply_in(c, item, effect, now)
                except Exception as exc:  # noqa: BLE001 - the user's effect failed: report it
                    out.append(AppliedItem(item.reply_id, None, None, exc))
                else:
                    out.append(AppliedItem(item.reply_id, outcome, receipt))
        return out

    def _apply_in(
        self, c: Conn, item: ReceiptItem, effect: Effect | None, now: float
    ) -> tuple[ReceiptOutcome, Receipt]:
        reply = item.reply if item.reply is not None else Reply.from_mapping(json.loads(item.body))
        receipt = Receipt(
            reply_id=item.reply_id, content_hash=item.content_hash, principal=item.principal,
            message_id=reply.message_id, task_id=reply.task_id,
            status=reply.status, body=item.body, entry_id=item.entry_id,
            received_at=now, effects=1 if effect is not None else 0, effect_result=None,
        )  # fmt: skip
        names = list(Receipt.__dataclass_fields__)
        inserted = c.execute(
            f"INSERT INTO receipts ({_COLUMNS}) VALUES ({', '.join(['%s'] * len(names))})"
            " ON CONFLICT (reply_id) DO NOTHING RETURNING reply_id",
            tuple(getattr(receipt, n) for n in names),
        ).fetchone()
        if inserted is None:
            row = c.execute(
                f"SELECT {_COLUMNS} FROM receipts WHERE reply_id = %s", (item.reply_id,)
            ).fetchone()
            assert row is not None  # the conflicting insert committed before ours returned
            earlier = _receipt(row)
            same = earlier.content_hash == item.content_hash
            return (ReceiptOutcome.DUPLICATE if same else ReceiptOutcome.CONFLICT), earlier
        if effect is not None:
            result = canonical_json(effect(c, reply)).decode("utf-8")
            c.execute(
                "UPDATE receipts SET effect_result = %s WHERE reply_id = %s",
                (result, item.reply_id),
            )
            receipt = Receipt(**{**receipt.__dict__, "effect_result": result})
        return ReceiptOutcome.APPLIED, receipt

    def get(self, reply_id: str) -> Receipt | None:
        row = self.db.fetch_one(f"SELECT {_COLUMNS} FROM receipts WHERE reply_id = %s", (reply_id,))
        return None if row is None else _receipt(row)

    def list(self) -> list[Receipt]:
        with self.db.read() as c:
            rows = c.execute(f"SELECT {_COLUMNS} FROM receipts ORDER BY received_at").fetchall()
        return [_receipt(r) for r in rows]

    def purge_batch(self, cutoff: float, after: int = 0, limit: int = PURGE_BATCH) -> PurgeBatch:
        return purge_receipts(self.db, cutoff, after, limit)

    def purge(self, retention_s: float, limit: int = PURGE_BATCH) -> int:
        cutoff = self.clock.now() - retention_s
        return whole_pass(lambda after: self.purge_batch(cutoff, after, limit)).receipts

"""What the outbox holds and hands out: ``OutboxPolicy`` (publication limits), ``OutboxRow``
(a reply as the reads return it), ``PublisherClaim`` (replies written already claimed by
one publisher), the tuples ``ReplySpec`` (a reply to insert) and ``SentMark`` (a confirmed
publication), and ``UnknownReply``.
"""

from __future__ import annotations

import builtins
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from broker_adapter.backoff import Backoff
from broker_adapter.config import DEFAULT_LEASE_S, ConfigModel
from broker_adapter.errors import BrokerAdapterError

#: The states of an outbox reply, in the order the reports list them.
OUTBOX_STATES = ("pending", "sending", "sent", "dead")
#: A reply older than this is never sent again (``OutboxPolicy.reply_window_s``): six days,
#: a day below a receiver's default window (``ReceiverConfig.max_reply_age_s``).
DEFAULT_REPLY_WINDOW_S = 6 * 24 * 3600.0


class OutboxPolicy(ConfigModel):
    """Publication limits.

    Attributes:
        lease_s: how long a dispatcher holds a claimed reply before another may take it.
        max_attempts: publication attempts before the row goes ``dead``.
        backoff: delay between attempts.
        reply_window_s: a reply made longer ago than this (its row's ``created_at``) is
            never sent again: a Redis wipe or restart does not put it back in line
            (``requeue_sent``), and the operator's ``replay`` refuses it. Keep it below
            every receiver's ``max_reply_age_s``, which refuses older replies as ``stale``.

    Raises:
        ConfigError: a lease not above 0, or fewer than one attempt.
    """

    lease_s: float = Field(default=DEFAULT_LEASE_S, gt=0)
    max_attempts: int = Field(default=20, ge=1)
    backoff: Backoff = Field(default_factory=lambda: Backoff(base_s=0.5, cap_s=30.0))
    reply_window_s: float = Field(default=DEFAULT_REPLY_WINDOW_S, gt=0)


@dataclass(frozen=True)
class OutboxRow:
    reply_id: str
    task_id: str | None
    principal: str
    message_id: str
    status: str
    body: bytes
    content_hash: str
    state: str
    attempts: int
    fence: int
    owner: str | None
    lease_until: float | None
    last_error: str | None
    entry_id: str | None
    created_at: float
    sent_at: float | None
    replays: int
    replayed_by: str | None
    replayed_at: float | None = None

    @classmethod
    def from_row(cls, row: sqlite3.Row | Mapping[str, Any]) -> OutboxRow:
        values = {name: row[name] for name in cls.__dataclass_fields__}
        if not isinstance(values["body"], bytes):  # a driver's buffer (``bytea``)
            values["body"] = bytes(values["body"])
        return cls(**values)


class UnknownReply(BrokerAdapterError, KeyError):
    def __init__(self, reply_id: str) -> None:
        self.reply_id = reply_id
        super().__init__(f"no reply {reply_id!r} in the outbox")


#: One reply for ``enqueue_many``: reply id, task id, principal, message id, status, the
#: body's bytes and their hash.
ReplySpec = tuple[str, str | None, str, str, str, bytes, str]


@dataclass
class PublisherClaim:
    """Replies to write already claimed by one publisher, inside a terminal transaction.

    Attributes:
        owner: the publisher's name on the rows.
        lease_until: its lease on them (after it, the dispatcher takes them back).
        rows: filled by ``enqueue_many``: the rows written, to publish after the commit.
    """

    owner: str
    lease_until: float
    rows: builtins.list[OutboxRow] = field(default_factory=list)


#: One confirmed publication to record: ``(reply_id, fence, entry_id, sent_at)``.
SentMark = tuple[str, int, str, float]

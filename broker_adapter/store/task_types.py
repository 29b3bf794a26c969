"""The task store's records and policies, imported by every store module and importing
none: the task states (``TaskState``, the sets of them and their SQL lists), ``TaskSettings``
and ``TaskPolicy`` (the store's limits), ``ClaimedTask`` (a claim, with the fence its
holder must present) and the columns a claim reads (``CLAIM_COLUMNS``, derived from its
fields), ``TaskRow`` (a task as the reads return it), ``Reconciled`` (what the clock did
to one task) and ``UnknownTask``.

The schemas' ``CHECK`` on ``tasks.state`` and the partial indexes repeat the states in
their migrations, which are never edited; a state added here needs a migration too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from broker_adapter.backoff import Backoff
from broker_adapter.config import (
    LEASE_SETTING,
    RETENTION_SETTING,
    ConfigModel,
    section,
    setting,
)
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.protocol.idempotency import idempotency_key_for


class TaskState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    HOP_LIMIT = "hop_limit"
    UNKNOWN = "unknown"
    WAITING_APPROVAL = "waiting_approval"


TERMINAL_STATES = frozenset(
    {TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED, TaskState.EXPIRED, TaskState.HOP_LIMIT}
)
#: The states of a task that has not ended: every state but the terminal ones (a cancel
#: still ends it).
LIVE_STATES = frozenset(TaskState) - TERMINAL_STATES
#: The states the clock ends at the deadline (``housekeeping``): the predicate of the
#: partial index ``tasks_live_deadline``.
CLOCKED_STATES = frozenset({TaskState.PENDING, TaskState.RUNNING})


def states_sql(states: Iterable[TaskState]) -> str:
    """``states`` as an SQL list, in ``TaskState``'s order: ``('pending', 'running')``.
    A partial index is used only by a statement that repeats its predicate, so the text
    is the migrations' own."""
    chosen = set(states)
    return "(" + ", ".join(f"'{s.value}'" for s in TaskState if s in chosen) + ")"


TERMINAL_SQL: Final = states_sql(TERMINAL_STATES)
CLOCKED_SQL: Final = states_sql(CLOCKED_STATES)

#: ``(task_id, transition, state, owner, attempts)`` of a transition the clock made.
Reconciled = tuple[str, str, str, str | None, int | None]


class TaskSettings(ConfigModel):
    """The task store's section of the settings tree (``AdapterConfig.tasks``): the limits
    of the task state machine that ``run`` sets. ``TaskPolicy`` extends it.

    Attributes:
        max_hops: envelopes with more hops are accepted straight into ``hop_limit``.
        max_chain_tasks: the chain budget: requests naming a ``correlation_id`` under which
            this many tasks were stored already (within the retention window, by any
            sender, with or without ``parent_id``) are accepted straight into
            ``hop_limit``.
        cancel_grace_s: a running task whose cancel was requested (``broker-adapter cancel``)
            keeps its lease this long for its handler to stop; then renewals are refused and
            the lapsed lease ends the task ``cancelled`` (``unknown`` if its effect started).
        backoff: delay before a retryable failure runs again.
    """

    max_hops: int = setting(
        16,
        ge=0,
        help="requests further from their root task are answered hop_limit",
        flag="--max-hops",
        env="BA_MAX_HOPS",
        metavar="N",
    )
    max_chain_tasks: int = setting(
        1000,
        ge=1,
        help="requests naming a correlation id under which this many tasks were stored"
        " (within the retention window) are answered hop_limit",
        flag="--max-chain-tasks",
        env="BA_MAX_CHAIN_TASKS",
        metavar="N",
    )
    cancel_grace_s: float = setting(
        30.0,
        ge=0,
        help="a running task whose cancel was requested keeps its lease this long for its"
        " handler to stop, seconds",
        flag="--cancel-grace",
        env="BA_CANCEL_GRACE_S",
        metavar="S",
    )
    backoff: Backoff = section(Backoff)


class TaskPolicy(TaskSettings):
    """The task state machine's policy: its section of the tree (``TaskSettings``, whose
    attributes it has) and the settings it shares with the other stages.

    Attributes:
        lease_s: lease granted by ``claim`` and ``renew``.
        retention_s: how long an inbox record dedupes its (principal, message_id); past it,
            once the task is terminal and its deadline has passed, a reused id is a new
            request. It also bounds deadlines: one further ahead than this is refused, so
            that no request outlives the record that makes its replay a duplicate.

    Raises:
        ConfigError: a lease or retention not above 0, or a negative ``max_hops``.
    """

    lease_s: float = LEASE_SETTING
    retention_s: float = RETENTION_SETTING


@dataclass(frozen=True)
class ClaimedTask:
    """A task handed to one worker, with the fence that worker must present."""

    task_id: str
    principal: str
    message_id: str
    kind: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    fence: int
    owner: str
    lease_until: float
    deadline: float
    hops: int
    correlation_id: str | None
    parent_id: str | None
    #: The request's W3C trace context, if it was sent with one (``Envelope.traceparent``).
    traceparent: str | None = None
    #: The task name the request asked for (``Envelope.task``); ``None``: the default.
    task_name: str | None = None

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts, fences and tasks of one request: key external effects
        by this. See ``idempotency_key_for``."""
        return idempotency_key_for(self.principal, self.message_id)


#: The task column behind each ``ClaimedTask`` field whose name is not the column's.
_CLAIM_COLUMN_OF: Final = {"attempt": "attempts"}
#: The fields a claim sets itself rather than reads from the row.
_SET_BY_CLAIM: Final = frozenset({"owner", "lease_until"})
#: ``(field, column)`` of what a claim reads from the task row, in field order.
_CLAIM_READS: Final = tuple(
    (name, _CLAIM_COLUMN_OF.get(name, name))
    for name in ClaimedTask.__dataclass_fields__
    if name not in _SET_BY_CLAIM
)
#: The task columns a ``ClaimedTask`` is built from (``claimed_task``): the list a claim's
#: ``RETURNING`` or a read of claimed tasks selects.
CLAIM_COLUMNS: Final = ", ".join(column for _, column in _CLAIM_READS)


def claimed_task(row: Any, owner: str, lease_until: float) -> ClaimedTask:
    """The claim of ``owner`` until ``lease_until`` on the task ``row`` (``CLAIM_COLUMNS``
    read; the payload decoded)."""
    values = {name: row[column] for name, column in _CLAIM_READS}
    values["payload"] = json.loads(values["payload"])
    values["deadline"] = float(values["deadline"])
    return ClaimedTask(owner=owner, lease_until=lease_until, **values)


@dataclass(frozen=True)
class TaskRow:
    task_id: str
    principal: str
    message_id: str
    state: str
    attempts: int
    max_attempts: int
    fence: int
    owner: str | None
    lease_until: float | None
    deadline: float
    not_before: float
    created_at: float
    finished_at: float | None
    result: str | None
    error: str | None


#: The columns of a ``TaskRow``.
TASK_COLUMNS: Final = ", ".join(TaskRow.__dataclass_fields__)


class UnknownTask(BrokerAdapterError, KeyError):
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"no task {task_id!r}")

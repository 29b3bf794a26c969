"""What the task store hands out and how it is set: ``TaskPolicy`` (its limits),
``ClaimedTask`` (a claim, with the fence its holder must present), ``TaskRow`` (a task as
the reads return it) and ``UnknownTask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from broker_adapter.backoff import Backoff
from broker_adapter.config import LEASE_SETTING, RETENTION_SETTING, ConfigModel, setting
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.store.inbox import idempotency_key_for

MAX_HOPS_SETTING = setting(
    16,
    ge=0,
    help="requests further from their root task are answered hop_limit",
    flag="--max-hops",
    env="BA_MAX_HOPS",
    metavar="N",
)
MAX_CHAIN_TASKS_SETTING = setting(
    1000,
    ge=1,
    help="requests naming a correlation id under which this many tasks were stored"
    " (within the retention window) are answered hop_limit",
    flag="--max-chain-tasks",
    env="BA_MAX_CHAIN_TASKS",
    metavar="N",
)
CANCEL_GRACE_SETTING = setting(
    30.0,
    ge=0,
    help="a running task whose cancel was requested keeps its lease this long for its"
    " handler to stop, seconds",
    flag="--cancel-grace",
    env="BA_CANCEL_GRACE_S",
    metavar="S",
)


class TaskPolicy(ConfigModel):
    """Limits of the task state machine.

    Attributes:
        lease_s: lease granted by ``claim`` and ``renew``.
        max_hops: envelopes with more hops are accepted straight into ``hop_limit``.
        retention_s: how long an inbox record dedupes its (principal, message_id); past it,
            once the task is terminal and its deadline has passed, a reused id is a new
            request. It also bounds deadlines: one further ahead than this is refused, so
            that no request outlives the record that makes its replay a duplicate.
        backoff: delay before a retryable failure runs again.
        max_chain_tasks: the chain budget: requests naming a ``correlation_id`` under which
            this many tasks were stored already (within the retention window, by any
            sender, with or without ``parent_id``) are accepted straight into
            ``hop_limit``.
        cancel_grace_s: a running task whose cancel was requested (``broker-adapter cancel``)
            keeps its lease this long for its handler to stop; then renewals are refused and
            the lapsed lease ends the task ``cancelled`` (``unknown`` if its effect started).

    Raises:
        ConfigError: a lease or retention not above 0, or a negative ``max_hops``.
    """

    lease_s: float = LEASE_SETTING
    max_hops: int = MAX_HOPS_SETTING
    retention_s: float = RETENTION_SETTING
    backoff: Backoff = Field(default_factory=Backoff)
    max_chain_tasks: int = MAX_CHAIN_TASKS_SETTING
    cancel_grace_s: float = CANCEL_GRACE_SETTING


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


class UnknownTask(BrokerAdapterError, KeyError):
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"no task {task_id!r}")

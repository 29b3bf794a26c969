"""``AdapterConfig``: everything ``broker-adapter run`` needs, validated before anything
starts (``adapter.Adapter`` runs it).

It is the root of the settings tree: a setting that a stage holds too is named here by the
type its stage declares it with (its bound, default, help and flag, once), and the adapter
builds each stage's settings from this one (``config.derive``). ``run``'s flags and ``BA_*``
variables are made from these fields (``app.options``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from broker_adapter.backoff import BACKOFF_BASE_SETTING, BACKOFF_CAP_SETTING
from broker_adapter.config import (
    LEASE_SETTING,
    RETENTION_SETTING,
    ConfigModel,
    derive,
    setting,
)
from broker_adapter.protocol.keys import (
    PARTITIONS_SETTING,
    PREFIX_SETTING,
    KeyPrefix,
    Principal,
)
from broker_adapter.redis.client import RedisUrl
from broker_adapter.redis.reader_config import MAX_DELIVERIES_SETTING, MAX_ENTRY_FIELDS_SETTING
from broker_adapter.stages.ingest.config import (
    ACL_PRINCIPALS_SETTING,
    CLAIM_MIN_IDLE_SETTING,
    MAX_ENTRY_BYTES_SETTING,
    MAX_OPEN_TASKS_SETTING,
    MODE_SETTING,
    RATE_BURST_SETTING,
    RATE_LIMIT_SETTING,
    IngestConfig,
    Mode,
)
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy
from broker_adapter.stages.worker.config import (
    CALL_TIMEOUT_SETTING,
    CONCURRENCY_SETTING,
    GRACE_SETTING,
)
from broker_adapter.store.task_types import (
    CANCEL_GRACE_SETTING,
    MAX_CHAIN_TASKS_SETTING,
    MAX_HOPS_SETTING,
)
from broker_adapter.store.urls import is_postgres_url

DEFAULT_WORKERS = 2


class AdapterConfig(ConfigModel):
    """Everything ``broker-adapter run`` needs; validated before anything starts.

    Attributes:
        redis_url: the Redis holding the streams.
        db_path: the SQLite file (created if absent), or a ``postgresql://`` URL: the
            PostgreSQL store (``store.postgres``), which several adapter processes on
            several hosts may share; the hand-off gives new tasks to the idle workers of
            this host's pool, the workers of other hosts claim the rest (``SKIP LOCKED``).
        handler: ``module:callable`` run for each task, or ``module:router``: a ``Router``
            of named tasks (``run --app``).
        app_dir: put first on the import path (here and in the worker processes) before
            the handler is imported; ``None`` leaves the path as it is.
        workers: worker processes.
        keyring_path: JSON keyring: verifies requests (signed mode) and signs every reply
            (both modes: in ACL mode each ACL principal needs its reply keys in it).
        mode: ``signed`` (HMAC per entry) or ``acl`` (the stream fixes the principal).
        acl_principals: in ACL mode, whose streams to read.
        partitions: in signed mode, how many inbound partition streams ingest reads
            (``IngestConfig.partitions``).
        prefix: Redis key prefix.
        name: this adapter's consumer name (owner names derive from it); ``None``: a
            logical id unique per store and host (``binding.default_name``). Two live
            processes never hold one name (``binding.claim_name``).
        lease_s: task lease.
        call_timeout_s: per handler call (a task's own ``call_timeout_s`` overrides it).
        concurrency: tasks each worker process runs at once (``concurrent_run``); async
            handlers share the process's one event loop, sync ones a thread per slot.
        backoff_base_s, backoff_cap_s: a retried task's backoff (``backoff.Backoff``).
        grace_s: how long running handlers may finish on stop.
        claim_min_idle_ms: pending entries idle this long are taken over from dead consumers
            (at least 1 ms: the ingest's bound).
        worker_publish: workers publish their replies right after their commit (the
            dispatcher then only sweeps what they could not publish); off, the dispatcher
            publishes every reply.
        rate_limit, rate_burst, max_open_tasks: the ingress limits per principal
            (``IngestConfig``, ``limits``); off by default.
        retention_s: the dedupe window (``TaskPolicy.retention_s``): how long a request's
            identity is remembered and the farthest a deadline may lie ahead; requests past
            it (terminal, deadline passed, reply sent) are purged (``store.retention``), and
            the streams, dead letters and publication records are trimmed by it.
        metrics_port: serve ``/metrics``, ``/healthz`` and ``/readyz`` on this port
            (``metrics``); ``None`` (default): off. 0 picks a free port.
        metrics_host: the address the metrics port binds.
        max_hops, max_chain_tasks, cancel_grace_s: the task policy's (``TaskPolicy``).
        max_deliveries, max_entry_bytes, max_entry_fields: the ingest's limits on an
            inbound entry (``IngestConfig``).
    """

    redis_url: RedisUrl
    db_path: Path | str
    handler: str
    keyring_path: Path | None = None
    prefix: KeyPrefix = PREFIX_SETTING
    concurrency: int = CONCURRENCY_SETTING
    call_timeout_s: float = CALL_TIMEOUT_SETTING
    backoff_base_s: float = BACKOFF_BASE_SETTING
    backoff_cap_s: float = BACKOFF_CAP_SETTING
    app_dir: Path | None = setting(
        None,
        help="directory put first on the import path to find the handler (in the worker"
        " processes too)",
        flag="--app-dir",
        env="BA_APP_DIR",
        metavar="DIR",
        cli_default=".",
    )
    workers: int = setting(
        DEFAULT_WORKERS,
        ge=1,
        le=64,
        help="worker processes (1..64)",
        flag="--workers",
        env="BA_WORKERS",
        metavar="N",
    )
    mode: Mode = MODE_SETTING
    acl_principals: tuple[Principal, ...] = ACL_PRINCIPALS_SETTING
    partitions: int = PARTITIONS_SETTING
    name: str | None = setting(
        None,
        min_length=1,
        max_length=200,
        help="this adapter's consumer name (owner names derive from it); two live processes"
        " never hold one",
        flag="--name",
        env="BA_NAME",
        shown="a logical id unique per store and host",
    )
    lease_s: float = LEASE_SETTING
    grace_s: float = GRACE_SETTING
    claim_min_idle_ms: int = CLAIM_MIN_IDLE_SETTING
    rate_limit: float | None = RATE_LIMIT_SETTING
    rate_burst: int | None = RATE_BURST_SETTING
    max_open_tasks: int | None = MAX_OPEN_TASKS_SETTING
    retention_s: float = RETENTION_SETTING
    #: the reconciler's policy (operator timeout and its action, ...), for a declared effect
    reconcile: ReconcilePolicy = Field(default_factory=ReconcilePolicy)
    metrics_port: int | None = setting(
        None,
        ge=0,
        le=65535,
        help="serve /metrics, /healthz and /readyz on this port",
        flag="--metrics-port",
        env="BA_METRICS_PORT",
        metavar="PORT",
        shown="off",
    )
    metrics_host: str = setting(
        "127.0.0.1",
        help="the address the metrics port binds",
        flag="--metrics-host",
        env="BA_METRICS_HOST",
        metavar="HOST",
    )
    worker_publish: bool = setting(
        True,
        help="workers publish their replies right after their commit (the dispatcher sweeps"
        " the rest); off, the dispatcher publishes every reply",
        flag="--worker-publish",
        env="BA_WORKER_PUBLISH",
    )
    max_hops: int = MAX_HOPS_SETTING
    max_chain_tasks: int = MAX_CHAIN_TASKS_SETTING
    cancel_grace_s: float = CANCEL_GRACE_SETTING
    max_deliveries: int = MAX_DELIVERIES_SETTING
    max_entry_bytes: int = MAX_ENTRY_BYTES_SETTING
    max_entry_fields: int = MAX_ENTRY_FIELDS_SETTING

    @field_validator("db_path", mode="before")
    @classmethod
    def _db_target(cls, v: object) -> object:
        """A ``postgresql://`` URL stays a string; anything else is a SQLite path."""
        return v if is_postgres_url(v) else Path(str(v)) if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and any(c in v for c in "{} \n\r\t"):
            raise ValueError("no braces or white space")
        return v

    @field_validator("handler")
    @classmethod
    def _handler(cls, v: str) -> str:
        module, sep, attr = v.partition(":")
        if not (module and sep and attr):
            raise ValueError("must look like 'package.module:function'")
        return v

    @model_validator(mode="after")
    def _modes(self) -> AdapterConfig:
        if self.keyring_path is None:
            need = (
                "to verify requests and sign replies"
                if self.mode == "signed"
                else "with the keys of every ACL principal, to sign their replies"
            )
            raise ValueError(
                f"{self.mode} mode needs a keyring {need} (--keyring FILE or BA_KEYRING)"
            )
        self.ingest_config(f"{self.name or 'adapter'}-ingest")  # refused here, not in its thread
        return self

    def ingest_config(self, consumer: str) -> IngestConfig:
        """The ingest's settings, ``consumer`` reading."""
        return derive(IngestConfig, self, consumer=consumer)

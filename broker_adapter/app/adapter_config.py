"""``AdapterConfig``: everything ``broker-adapter run`` needs, validated before anything
starts (``adapter.Adapter`` runs it).

It is the root of the settings tree (``config``): what the whole adapter shares at the top,
and one section per stage, each declared by its stage (``IngestSettings``,
``WorkerSettings``, ``TaskSettings``, ``ReconcilePolicy``, ``MetricsSettings``). The adapter
builds each stage's full settings from it (``config.derive``); ``run``'s flags and ``BA_*``
variables are made from its fields, sections included (``app.options``), and the settings
table of docs/CONFIGURATION.md is checked against it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator, model_validator

from broker_adapter.app.metrics import MetricsSettings
from broker_adapter.config import (
    LEASE_SETTING,
    RETENTION_SETTING,
    ConfigModel,
    derive,
    section,
    setting,
)
from broker_adapter.protocol.keys import PREFIX_SETTING, KeyPrefix
from broker_adapter.redis.client import RedisUrl
from broker_adapter.stages.ingest.config import IngestConfig, IngestSettings
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy
from broker_adapter.stages.worker.config import WorkerSettings
from broker_adapter.store.task_types import TaskSettings
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
        keyring_path: JSON keyring: verifies requests (signed mode) and signs every reply
            (both modes: in ACL mode each ACL principal needs its reply keys in it).
        prefix: Redis key prefix.
        app_dir: put first on the import path (here and in the worker processes) before
            the handler is imported; ``None`` leaves the path as it is.
        name: this adapter's consumer name (owner names derive from it); ``None``: a
            logical id unique per store and host (``binding.default_name``). Two live
            processes never hold one name (``binding.claim_name``).
        workers: worker processes.
        worker_publish: workers publish their replies right after their commit (the
            dispatcher then only sweeps what they could not publish); off, the dispatcher
            publishes every reply.
        lease_s: a claimed task's lease (and a publisher's claim on an outbox row).
        retention_s: the dedupe window (``TaskPolicy.retention_s``): how long a request's
            identity is remembered and the farthest a deadline may lie ahead; requests past
            it (terminal, deadline passed, reply sent) are purged (``store.retention``), and
            the streams, dead letters and publication records are trimmed by it.
        ingest: how requests come in: mode, partitions, takeover, entry and rate limits.
        worker: how each worker process runs handlers: concurrency, call timeout, grace.
        tasks: the task state machine's limits: hops, chain budget, cancel grace, the
            retry backoff.
        reconcile: the reconciler's policy (operator timeout and its action, ...), for a
            declared effect.
        metrics: the metrics port (off by default).
    """

    redis_url: RedisUrl
    db_path: Path | str
    handler: str
    keyring_path: Path | None = None
    prefix: KeyPrefix = PREFIX_SETTING
    app_dir: Path | None = setting(
        None,
        help="directory put first on the import path to find the handler (in the worker"
        " processes too)",
        flag="--app-dir",
        env="BA_APP_DIR",
        metavar="DIR",
        cli_default=".",
    )
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
    workers: int = setting(
        DEFAULT_WORKERS,
        ge=1,
        le=64,
        help="worker processes (1..64)",
        flag="--workers",
        env="BA_WORKERS",
        metavar="N",
    )
    worker_publish: bool = setting(
        True,
        help="workers publish their replies right after their commit (the dispatcher sweeps"
        " the rest); off, the dispatcher publishes every reply",
        flag="--worker-publish",
        env="BA_WORKER_PUBLISH",
    )
    lease_s: float = LEASE_SETTING
    retention_s: float = RETENTION_SETTING
    ingest: IngestSettings = section(IngestSettings)
    worker: WorkerSettings = section(WorkerSettings)
    tasks: TaskSettings = section(TaskSettings)
    reconcile: ReconcilePolicy = section(ReconcilePolicy)
    metrics: MetricsSettings = section(MetricsSettings)

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
                if self.ingest.mode == "signed"
                else "with the keys of every ACL principal, to sign their replies"
            )
            raise ValueError(
                f"{self.ingest.mode} mode needs a keyring {need} (--keyring FILE or BA_KEYRING)"
            )
        self.ingest_config(f"{self.name or 'adapter'}-ingest")  # refused here, not in its thread
        return self

    def ingest_config(self, consumer: str) -> IngestConfig:
        """The ingest's settings, ``consumer`` reading."""
        return derive(IngestConfig, self, self.ingest, consumer=consumer)

"""``AdapterConfig``: everything ``broker-adapter run`` needs, validated before anything
starts (``adapter.Adapter`` runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from broker_adapter.config import DEFAULT_CLAIM_MIN_IDLE_MS, DEFAULT_LEASE_S, ConfigModel
from broker_adapter.protocol.keys import DEFAULT_PREFIX, MAX_PARTITIONS, KeyPrefix, Principal
from broker_adapter.redis.client import RedisUrl
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy
from broker_adapter.stages.worker.config import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_GRACE_S,
    MAX_CONCURRENCY,
)
from broker_adapter.store.task_types import DEFAULT_RETENTION_S
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
            A handler declaring a side effect needs SQLite for now (``ConfigError``).
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
        claim_min_idle_ms: pending entries idle this long are taken over from dead consumers.
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
    """

    redis_url: RedisUrl
    db_path: Path | str
    handler: str
    app_dir: Path | None = None
    workers: int = Field(default=DEFAULT_WORKERS, ge=1, le=64)
    keyring_path: Path | None = None
    mode: Literal["signed", "acl"] = "signed"
    acl_principals: tuple[Principal, ...] = ()
    partitions: int = Field(default=1, ge=1, le=MAX_PARTITIONS)
    prefix: KeyPrefix = DEFAULT_PREFIX
    name: str | None = Field(default=None, min_length=1, max_length=200)
    lease_s: float = Field(default=DEFAULT_LEASE_S, gt=0)
    #: the reconciler's policy (operator timeout and its action, ...), for a declared effect
    reconcile: ReconcilePolicy = Field(default_factory=ReconcilePolicy)
    call_timeout_s: float = Field(default=DEFAULT_CALL_TIMEOUT_S, gt=0)
    concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY)
    backoff_base_s: float = Field(default=1.0, ge=0)
    backoff_cap_s: float = Field(default=60.0, ge=0)
    grace_s: float = Field(default=DEFAULT_GRACE_S, ge=0)
    claim_min_idle_ms: int = Field(default=DEFAULT_CLAIM_MIN_IDLE_MS, ge=0)
    worker_publish: bool = True
    rate_limit: float | None = Field(default=None, gt=0)
    rate_burst: int | None = Field(default=None, ge=1)
    max_open_tasks: int | None = Field(default=None, ge=1)
    retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"

    @field_validator("db_path", mode="before")
    @classmethod
    def _db_target(cls, v: object) -> object:
        """A ``postgresql://`` URL stays a string; anything else is a SQLite path."""
        return v if is_postgres_url(v) else Path(str(v)) if isinstance(v, str) else v

    @property
    def on_postgres(self) -> bool:
        return is_postgres_url(self.db_path)

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
        if self.mode == "acl" and not self.acl_principals:
            raise ValueError("acl mode needs at least one principal (--acl-principal P)")
        if self.mode == "acl" and self.partitions != 1:
            raise ValueError("--partitions is for signed mode (ACL mode reads one stream each)")
        return self

"""Prometheus metrics and health checks on one HTTP port (``run --metrics-port``,
``receive --metrics-port``; off by default).

What is counted where:

* The stages of this process (ingest, dispatcher, receiver) already count everything in
  their stats objects (``IngestStats``, ``ReaderStats``, ``DispatcherStats``,
  ``ReceiverStats``). ``AdapterCollector`` reads them at scrape time: nothing is added to
  their hot paths, and with metrics off nothing runs at all (``prometheus_client`` is
  not even imported).
* What the database holds (tasks by state, leases, outbox by state, the oldest unsent
  reply, receipts) is read at scrape time by one read transaction (``store.report``); no
  write lock. These are gauges, right whatever process changed them, and they survive
  restarts of any stage.
* Pending entries and lag per consumer group come from ``XINFO GROUPS``, sampled at most
  every ``SAMPLE_EVERY_S`` whatever the scrape rate.
* Worker processes count in their own memory (``WorkerStats``): those counters are written
  by ``WorkerMetrics`` into prometheus-client's multiprocess files, in a directory the
  runner makes and removes, once per batch after its commit (a counter then moves with
  what was committed, and a worker killed mid-batch loses only that batch's counts, which
  its commit lost too), plus one histogram observation per handler call. The database
  cannot give these counts: a refusal writes nothing, and it holds only each task's latest
  attempt. The files of dead workers stay, so their counts stay in the sums.

Counters of this process and of the workers that share a name (reply publications, lease
takeovers) are added up into one family (``Families``).

The HTTP port that serves them, with ``/healthz`` and ``/readyz``, is ``app.serving``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from broker_adapter.errors import BrokerAdapterError
from broker_adapter.redis.probe import StreamSample, redis_client, sample_groups
from broker_adapter.store.probe import DatabaseError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from broker_adapter.app.pool import WorkerPool
    from broker_adapter.redis.reader import GroupReader
    from broker_adapter.stages.dispatcher import Dispatcher
    from broker_adapter.stages.ingest import Ingestor
    from broker_adapter.stages.publish import DispatcherStats
    from broker_adapter.stages.receiver import Receiver
    from broker_adapter.stages.worker import WorkerStats

log = logging.getLogger("broker_adapter.app.metrics")

DEFAULT_METRICS_HOST = "127.0.0.1"
#: ``XINFO GROUPS`` is asked at most this often, seconds; scrapes in between reuse it.
SAMPLE_EVERY_S = 5.0
#: Each readiness check (Redis PING, the database's write lock) gives up after this long.
CHECK_TIMEOUT_S = 1.0

Labels = tuple[tuple[str, str], ...]
#: What a source of a scrape may fail with; it is then left out of that scrape.
_SOURCE_ERRORS = (BrokerAdapterError, DatabaseError, OSError, ValueError)


class Families:
    """Metric families built from plain numbers; samples of one name and labels added from
    several sources (this process and the workers' files) are summed."""

    def __init__(self) -> None:
        self._kinds: dict[str, tuple[str, str]] = {}
        self._values: dict[str, dict[Labels, float]] = {}
        self._kept: list[Metric] = []

    def counter(self, name: str, doc: str, value: float, **labels: str) -> None:
        """``name`` without ``_total`` (the sample gets it)."""
        self._add(name, "counter", doc, value, labels)

    def gauge(self, name: str, doc: str, value: float, **labels: str) -> None:
        self._add(name, "gauge", doc, value, labels)

    def _add(self, name: str, kind: str, doc: str, value: float, labels: dict[str, str]) -> None:
        if not self._kinds.get(name, (kind, ""))[1]:
            self._kinds[name] = (kind, doc)
        samples = self._values.setdefault(name, {})
        key = tuple(sorted(labels.items()))
        samples[key] = samples.get(key, 0.0) + value

    def merge(self, metrics: Iterable[Metric]) -> None:
        """Counters are added into those of the same name; other families kept as read."""
        for metric in metrics:
            if metric.type != "counter":
                self._kept.append(metric)
                continue
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    self._add(
                        metric.name,
                        "counter",
                        metric.documentation,
                        sample.value,
                        dict(sample.labels),
                    )

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, (kind, doc) in sorted(self._kinds.items()):
            samples = self._values[name]
            labelnames = sorted({k for key in samples for k, _ in key})
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, doc, labels=labelnames)
            for key, value in sorted(samples.items()):
                given = dict(key)
                family.add_metric([given.get(k, "") for k in labelnames], value)
            yield family
        yield from self._kept


@dataclass
class Observed:
    """What one process exports. The stages add themselves as they start (``run``: the
    runner's threads; ``receive``: the CLI), so a scrape sees whatever is running.

    Attributes:
        db_path: the SQLite file whose counts are read at scrape time.
        redis_url: for ``XINFO GROUPS`` samples and the readiness PING.
        streams: the stream keys whose groups are sampled.
        ingestors, dispatchers, receivers: the stages whose stats are read.
        worker_dir: the worker processes' multiprocess files (``None``: no workers).
        stages: names of the stages that should run and do not (``[]``: all running).
    """

    db_path: Path | str | None = None
    redis_url: str | None = None
    streams: list[str] = field(default_factory=list)
    ingestors: list[Ingestor] = field(default_factory=list)
    dispatchers: list[Dispatcher] = field(default_factory=list)
    receivers: list[Receiver] = field(default_factory=list)
    worker_dir: Path | None = None
    stages: Callable[[], list[str]] = list

    def add_ingestor(self, ingestor: Ingestor) -> None:
        """Export ``ingestor`` and sample the groups of the streams it reads."""
        self.ingestors.append(ingestor)
        self.streams.extend(r.stream for r in ingestor.readers)

    def add_receiver(self, receiver: Receiver) -> None:
        self.receivers.append(receiver)
        self.streams.append(receiver.reader.stream)


def stages_down(threads: Iterable[threading.Thread], pool: WorkerPool) -> list[str]:
    """The runner's stages that do not run: its threads by name, ``workers`` when no
    worker process is alive."""
    down = [t.name for t in threads if not t.is_alive()]
    return down if pool.alive() else [*down, "workers"]


# -- the collector --------------------------------------------------------------------------

_INBOX_OUTCOMES = {
    "stored": "accepted",
    "duplicate": "duplicates",
    "conflict": "conflicts",
    "expired": "expired",
    "hop_limit": "hop_limited",
}
_RECEIVER_OUTCOMES = {
    "applied": "applied",
    "duplicate": "duplicates",
    "conflict": "conflicts",
    "bad": "bad",
    "effect_failure": "effect_failures",
}
_PUBLISH_OUTCOMES = {
    "published": "published",
    "already_published": "already_published",
    "conflict": "conflicts",
    "failed": "failed",
    "dead": "dead",
    "fenced": "fenced",
}


def _reader_families(out: Families, stage: str, reader: GroupReader) -> None:
    s = reader.stats
    out.counter(
        "ba_stream_entries_read", "New stream entries read (XREADGROUP >).", s.read, stage=stage
    )
    out.counter(
        "ba_stream_entries_replayed",
        "Entries re-read from the consumer's own pending list (after a start or an error).",
        s.replayed,
        stage=stage,
    )
    out.counter(
        "ba_stream_entries_taken_over",
        "Entries claimed from idle consumers (XAUTOCLAIM).",
        s.taken_over,
        stage=stage,
    )
    out.counter("ba_stream_entries_acked", "Entries acknowledged (XACK).", s.acked, stage=stage)
    for reason, n in s.by_reason.items():
        out.counter(
            "ba_stream_dead_letters",
            "Entries moved to a dead-letter stream, by reason.",
            n,
            stage=stage,
            reason=reason,
        )
    out.counter(
        "ba_stream_dead_letter_failures",
        "Entries acknowledged without a dead letter because even a minimal one failed.",
        s.dead_letter_failures,
        stage=stage,
    )
    out.counter(
        "ba_dead_letters_capped",
        "Dead letters trimmed because their stream was at its cap.",
        s.dead_letters_capped,
        stage=stage,
    )
    out.counter(
        "ba_redis_reconnects",
        "Reads started over after a Redis or store error.",
        s.reconnects,
        stage=stage,
    )
    out.counter(
        "ba_redis_data_loss_alarms",
        "Redis data loss seen: a consumer group gone"
        " (group_lost), the epoch key gone (wipe), a restart (restart).",
        s.group_recreated,
        stage=stage,
        kind="group_lost",
    )


def _publish_families(out: Families, stage: str, s: DispatcherStats) -> None:
    for outcome, attr in _PUBLISH_OUTCOMES.items():
        out.counter(
            "ba_reply_publish",
            "Reply publications, by outcome.",
            getattr(s, attr),
            stage=stage,
            outcome=outcome,
        )


def _trim_families(
    out: Families, stage: str, trimmed: int, dead: int, failures: int, future: int
) -> None:
    out.counter("ba_stream_entries_trimmed", "Stream entries trimmed.", trimmed, stage=stage)
    out.counter("ba_dead_letters_trimmed", "Dead letters trimmed by age.", dead, stage=stage)
    out.counter("ba_trim_failures", "Trims that failed (retried).", failures, stage=stage)
    out.counter(
        "ba_stream_future_ids",
        "Trims that found a stream read past an id ahead of"
        " the server clock (poisoned: repair it).",
        future,
        stage=stage,
    )


def _stage_families(out: Families, observed: Observed) -> None:
    for ingestor in list(observed.ingestors):
        i = ingestor.stats
        for outcome, attr in _INBOX_OUTCOMES.items():
            out.counter(
                "ba_inbox_entries",
                "Authenticated entries the inbox took, by outcome.",
                getattr(i, attr),
                outcome=outcome,
            )
        _trim_families(
            out, "ingest", i.trimmed, i.dead_letters_trimmed, i.trim_failures, i.future_ids
        )
        out.counter(
            "ba_lease_takeovers",
            "Expired task leases taken back (requeued, or failed on the last attempt).",
            ingestor.tasks.lease_takeovers,
        )
        for reader in ingestor.readers:
            _reader_families(out, "ingest", reader)
    for dispatcher in list(observed.dispatchers):
        s = dispatcher.stats
        _publish_families(out, "dispatcher", s)
        _trim_families(
            out, "dispatcher", s.trimmed, s.dead_letters_trimmed, s.trim_failures, s.future_ids
        )
        out.counter(
            "ba_reply_entries_unread_trimmed",
            "Replies no group acknowledged, trimmed"
            " at the retention window (their outbox rows still hold them).",
            s.unread_trimmed,
        )
        out.counter(
            "ba_replies_requeued",
            "Sent replies put back in line after Redis data loss.",
            s.requeued,
        )
        for kind, n in (("wipe", s.wipes), ("restart", s.restarts)):
            out.counter("ba_redis_data_loss_alarms", "", n, stage="dispatcher", kind=kind)
    for receiver in list(observed.receivers):
        for outcome, attr in _RECEIVER_OUTCOMES.items():
            out.counter(
                "ba_receiver_replies",
                "Replies the receiver handled, by outcome"
                " (applied: effect run; duplicate: skipped).",
                getattr(receiver.stats, attr),
                outcome=outcome,
            )
        _reader_families(out, "receiver", receiver.reader)


def _database_families(out: Families, db_path: Path | str) -> None:
    from broker_adapter.clock import SystemClock
    from broker_adapter.store.backends import open_store
    from broker_adapter.store.dbclock import clock_skew, read_now
    from broker_adapter.store.report import snapshot

    db = open_store(db_path, read_only=True)  # a SQLite file or a postgresql:// URL
    try:
        report = snapshot(db, read_now(db, SystemClock()))
        skew = clock_skew(db)
    finally:
        db.close()
    if skew is not None:
        out.gauge(
            "ba_clock_skew_seconds",
            "How far this host's clock is ahead of the"
            " PostgreSQL server's, whose clock judges leases (negative: behind).",
            skew,
        )
    p, delivery = report["processing"], report["delivery"]
    doc = "Tasks by state (from the database)."
    for state in ("pending", "running", "unknown", "waiting_approval"):
        out.gauge("ba_tasks", doc, p[state], state=state)
    for state, n in report["terminal"].items():
        out.gauge("ba_tasks", doc, n, state=state)
    out.gauge("ba_tasks_ready", "Pending tasks whose not_before has come.", p["ready"])
    for lease in ("live", "expired"):
        out.gauge("ba_task_leases", "Running tasks by lease.", p[f"{lease}_leases"], lease=lease)
    out.gauge("ba_inbox_records", "Requests the inbox remembers.", report["received"]["inbox"])
    for state in ("pending", "sending", "sent", "dead"):
        out.gauge("ba_outbox_replies", "Outbox replies by state.", delivery[state], state=state)
    oldest = delivery["oldest_unsent_age_s"]
    out.gauge(
        "ba_outbox_oldest_unsent_age_seconds",
        "Age of the oldest reply not sent yet (0: none).",
        0.0 if oldest is None else oldest,
    )
    out.gauge("ba_receipts", "Replies the receiver recorded.", report["receipts"]["replies"])
    fx = report["effects"]
    out.gauge(
        "ba_unknown_outcomes",
        "Tasks whose external effect's outcome is not known"
        " (unknown), by whether they wait for an operator.",
        fx["unknown"] - fx["awaiting_operator"],
        waiting="reconcile",
    )
    out.gauge("ba_unknown_outcomes", "", fx["awaiting_operator"], waiting="operator")
    _outcome_families(out, fx)
    out.gauge("ba_approvals_waiting", "Tasks waiting for an approval.", fx["waiting_approval"])
    for state in ("valid", "expired", "revoked"):
        out.gauge(
            "ba_approvals",
            "Approval records by state (granted and valid, expired, revoked).",
            fx[f"approvals_{state}"],
            state=state,
        )


def _outcome_families(out: Families, fx: dict[str, Any]) -> None:
    """Uncertain outcomes. The counters come from the database's ``counters`` table
    (``store.counters``): they never fall across a purge, and count what commits in any
    process, a killed worker's attempt included; the same on every adapter sharing one
    database (aggregate with ``max``)."""
    out.counter(
        "ba_task_attempts",
        "Task attempts started, counted when the claim commits (database-wide).",
        fx["task_attempts"],
    )
    out.counter(
        "ba_task_outcomes",
        "Task outcomes committed by workers.",
        fx["task_outcomes_unknown"],
        outcome="unknown",
    )
    for outcome in ("done", "not-done", "unknown"):
        out.counter(
            "ba_reconciles",
            "Reconciles of unknown tasks (automatic or an operator's), by what they found.",
            fx[f"reconciled_{outcome}"],
            outcome=outcome,
        )
    for outcome in ("started", "done", "failed"):
        out.counter(
            "ba_compensations",
            "Compensations begun (started) and ended (done,"
            " failed), of duplicates and of cancelled tasks' effects.",
            fx[f"compensations_{outcome}"],
            outcome=outcome,
        )
    out.gauge(
        "ba_compensations_open",
        "Compensations begun and not ended (a crash half way: an operator checks the target).",
        fx["compensations_open"],
    )
    for action in ("alert", "fail"):
        out.counter(
            "ba_operator_timeouts",
            "Operator waits past operator_timeout_s, by the action taken.",
            fx[f"operator_timeouts_{action}"],
            action=action,
        )
    out.gauge(
        "ba_operator_waits_overdue",
        "Tasks waiting for an operator past operator_timeout_s.",
        fx["operator_overdue"],
    )
    out.gauge(
        "ba_unknown_oldest_age_seconds",
        "Age of the oldest unknown task, since its effect started (0: none).",
        fx["oldest_unknown_age_s"],
    )
    out.gauge(
        "ba_operator_wait_oldest_age_seconds",
        "Age of the oldest wait for an operator (0: none).",
        fx["oldest_operator_wait_age_s"],
    )


class ReadinessCheck(Protocol):
    """What ``ba_ready`` reports: ``app.serving.Readiness``."""

    def problems(self) -> list[str]: ...


class AdapterCollector:
    """A prometheus-client collector that reads ``observed`` at each scrape.

    A source that fails (database busy or gone, Redis down) leaves its families out of
    that scrape and counts ``ba_scrape_errors_total{source}``; the others are exported.
    """

    def __init__(
        self,
        observed: Observed,
        *,
        sample_every_s: float = SAMPLE_EVERY_S,
        readiness: ReadinessCheck | None = None,
    ) -> None:
        self.observed = observed
        self.readiness = readiness
        self.sample_every_s = sample_every_s
        self.errors: dict[str, int] = {"database": 0, "redis": 0, "workers": 0}
        self._sample: StreamSample | None = None
        self._client: Any = None
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # families vary with what runs; no checks at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # concurrent scrapes share one sample
            out = Families()
            _stage_families(out, self.observed)
            self._guarded("database", lambda: self._database(out))
            self._guarded("redis", lambda: self._groups(out))
            self._guarded("workers", lambda: self._workers(out))
            if self.readiness is not None:
                out.gauge(
                    "ba_ready",
                    "1 when /readyz would answer 200, else 0.",
                    0 if self.readiness.problems() else 1,
                )
            for source, n in self.errors.items():
                out.counter(
                    "ba_scrape_errors", "Sources a scrape could not read.", n, source=source
                )
        return out.collect()

    def _guarded(self, source: str, body: Callable[[], None]) -> None:
        try:
            body()
        except _SOURCE_ERRORS as exc:
            self.errors[source] += 1
            log.debug("metrics: %s not read: %s", source, exc)

    def _database(self, out: Families) -> None:
        if self.observed.db_path is not None:
            _database_families(out, self.observed.db_path)

    def _groups(self, out: Families) -> None:
        obs = self.observed
        if obs.redis_url is None or not obs.streams:
            return
        sample = self._sample
        if sample is None or time.monotonic() - sample.at >= self.sample_every_s:
            self._sample = None
            if self._client is None:
                self._client = redis_client(obs.redis_url, CHECK_TIMEOUT_S)
            sample = self._sample = sample_groups(self._client, obs.streams)
        for stream, group, pending, lag in sample.groups:
            out.gauge(
                "ba_stream_group_pending",
                "Entries delivered to the group and not acknowledged (XINFO GROUPS, sampled).",
                pending,
                stream=stream,
                group=group,
            )
            if lag is not None:
                out.gauge(
                    "ba_stream_group_lag",
                    "Entries not delivered to the group yet (XINFO GROUPS, sampled).",
                    lag,
                    stream=stream,
                    group=group,
                )
        for stream, n in sample.lengths:
            out.gauge(
                "ba_stream_length", "Entries in the stream (XLEN, sampled).", n, stream=stream
            )

    def _workers(self, out: Families) -> None:
        if self.observed.worker_dir is None:
            return
        from prometheus_client.multiprocess import MultiProcessCollector

        files = MultiProcessCollector(None, path=str(self.observed.worker_dir))  # type: ignore[no-untyped-call]
        out.merge(files.collect())  # type: ignore[no-untyped-call]


# -- worker processes -----------------------------------------------------------------------

#: ``WorkerStats`` field -> (counter, its labels), or ``None``: counted by the database in
#: the transaction that commits it (``_outcome_families``), not from a worker's memory.
_WORKER_COUNTERS: dict[str, tuple[str, str, dict[str, str]] | None] = {
    "claimed": None,  # ba_task_attempts_total, at the claim's commit
    "handed": (
        "ba_tasks_handed",
        "Of the attempts, tasks the ingest claimed for an idle worker.",
        {},
    ),
    "done": ("ba_task_outcomes", "Task outcomes committed by workers.", {"outcome": "done"}),
    "retried": ("ba_task_outcomes", "", {"outcome": "retry"}),
    "failed": ("ba_task_outcomes", "", {"outcome": "failed"}),
    "cancelled": ("ba_task_outcomes", "", {"outcome": "cancelled"}),
    "expired": ("ba_task_outcomes", "", {"outcome": "expired"}),
    "unknown": None,  # ba_task_outcomes_total{outcome="unknown"}, the take-back's too
    "waiting_approval": ("ba_task_outcomes", "", {"outcome": "waiting_approval"}),
    "stale_commits": (
        "ba_stale_fence_refusals",
        "Commits the store refused (fence, owner,"
        " lease, deadline) and tasks not started after losing their lease.",
        {},
    ),
    "timeouts": ("ba_handler_timeouts", "Handler calls abandoned (call timeout, stop grace).", {}),
    "renewals": ("ba_lease_renewals", "Task lease renewals.", {}),
    "store_errors": (
        "ba_worker_store_errors",
        "Task outcomes whose commit failed (left to lease expiry).",
        {},
    ),
}
#: Buckets of ``ba_handler_duration_seconds``, seconds.
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class WorkerMetrics:
    """One worker process's counters, in prometheus-client's multiprocess files under
    ``directory`` (the parent's ``AdapterCollector`` reads them).

    Build it in the worker process, before any other metric of that process: it switches
    prometheus-client to multiprocess values there.
    """

    def __init__(self, directory: Path, handler: str) -> None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        from prometheus_client import CollectorRegistry, Counter, Histogram, values

        # multiprocess values even if prometheus_client was imported before the variable was set
        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
        registry = CollectorRegistry()  # private: nothing registers twice in a test process
        counters: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        for attr, exported in _WORKER_COUNTERS.items():
            if exported is None:
                continue
            name, doc, labels = exported
            if name not in counters:
                counters[name] = Counter(name, doc or name, list(labels), registry=registry)
            metric = counters[name]
            self._counters[attr] = metric.labels(**labels) if labels else metric
        publish = Counter(
            "ba_reply_publish",
            "Reply publications, by outcome.",
            ["stage", "outcome"],
            registry=registry,
        )
        self._publish = {
            attr: publish.labels(stage="worker", outcome=outcome)
            for outcome, attr in _PUBLISH_OUTCOMES.items()
        }
        self._takeovers = Counter(
            "ba_lease_takeovers", "Expired task leases taken back.", registry=registry
        )
        self._duration = Histogram(
            "ba_handler_duration_seconds",
            "Handler call time, by handler and task name.",
            ["handler", "task"],
            buckets=HANDLER_BUCKETS,
            registry=registry,
        )
        self._handler = handler
        self._seen: dict[str, int] = {}

    def observe_call(self, elapsed_s: float, task: str = "") -> None:
        """One handler call of ``elapsed_s``; ``task``: its task name (``""``: none)."""
        self._duration.labels(handler=self._handler, task=task).observe(elapsed_s)

    def sync(self, stats: WorkerStats, publish: DispatcherStats, takeovers: int) -> None:
        """Add what the counters gained since the last sync."""
        for f in fields(stats):
            if f.name in self._counters:
                self._add(f.name, getattr(stats, f.name), self._counters[f.name])
        for attr, child in self._publish.items():
            self._add(f"publish.{attr}", getattr(publish, attr), child)
        self._add("takeovers", takeovers, self._takeovers)

    def _add(self, key: str, now: int, counter: Any) -> None:
        gained = now - self._seen.get(key, 0)
        if gained > 0:
            counter.inc(gained)
            self._seen[key] = now

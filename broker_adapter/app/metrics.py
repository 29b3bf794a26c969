"""Prometheus metrics and health checks on one HTTP port (``run --metrics-port``,
``receive --metrics-port``; off by default).

What is counted where:

* The stages of this process (ingest, dispatcher, receiver) already count everything in
  their stats objects (``IngestStats``, ``ReaderStats``, ``DispatcherStats``,
  ``ReceiverStats``), whose fields declare what they are exported as
  (``metric_fields``). ``AdapterCollector`` reads them at scrape time: nothing is added to
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from broker_adapter.config import ConfigModel, setting
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.metric_fields import Family, declared
from broker_adapter.redis.probe import StreamSample, redis_client, sample_groups
from broker_adapter.stages.shared.publish import REPLY_PUBLISH, DispatcherStats
from broker_adapter.stages.worker.config import TASK_OUTCOMES, WorkerStats
from broker_adapter.store.probe import DatabaseError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from broker_adapter.stages.dispatch.dispatcher import Dispatcher
    from broker_adapter.stages.ingest.ingest import Ingestor
    from broker_adapter.stages.receiver.receiver import Receiver
    from broker_adapter.stages.shared.publish import DispatcherStats
    from broker_adapter.stages.worker.config import WorkerStats

log = logging.getLogger("broker_adapter.app.metrics")

DEFAULT_METRICS_HOST = "127.0.0.1"


class MetricsSettings(ConfigModel):
    """The metrics port's section of the settings tree (``AdapterConfig.metrics``; the
    receiver's command sets it too).

    Attributes:
        port: serve ``/metrics``, ``/healthz`` and ``/readyz`` on this port (``serving``);
            ``None`` (default): off. 0 picks a free port.
        host: the address the port binds.
    """

    port: int | None = setting(
        None,
        ge=0,
        le=65535,
        help="serve /metrics, /healthz and /readyz on this port",
        flag="--metrics-port",
        env="BA_METRICS_PORT",
        metavar="PORT",
        shown="off",
    )
    host: str = setting(
        DEFAULT_METRICS_HOST,
        help="the address the metrics port binds",
        flag="--metrics-host",
        env="BA_METRICS_HOST",
        metavar="HOST",
    )


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


# -- the collector --------------------------------------------------------------------------

#: Counted by the task store (``lease_takeovers``) of the ingest's process and of each
#: worker process.
LEASE_TAKEOVERS = Family(
    "ba_lease_takeovers",
    "Expired task leases taken back (requeued, or failed on the last attempt).",
)


def _stats_families(out: Families, stats: object, stage: str = "") -> None:
    """The exported fields of a stats dataclass, as declared on them (``metric_fields``);
    ``stage``: the label of the families declared ``per_stage``."""
    for attr, d in declared(stats):
        for labels, value in d.samples(getattr(stats, attr)):
            if d.family.per_stage:
                labels = {"stage": stage, **labels}
            out.counter(d.family.name, d.family.help, value, **labels)


def _stage_families(out: Families, observed: Observed) -> None:
    for ingestor in list(observed.ingestors):
        _stats_families(out, ingestor.stats, "ingest")
        takeovers = LEASE_TAKEOVERS
        out.counter(takeovers.name, takeovers.help, ingestor.tasks.lease_takeovers)
        for reader in ingestor.readers:
            _stats_families(out, reader.stats, "ingest")
    for dispatcher in list(observed.dispatchers):
        _stats_families(out, dispatcher.stats, "dispatcher")
    for receiver in list(observed.receivers):
        _stats_families(out, receiver.stats)
        _stats_families(out, receiver.reader.stats, "receiver")


def _database_families(out: Families, db_path: Path | str) -> None:
    from broker_adapter.clock import SystemClock
    from broker_adapter.store.backends import open_store
    from broker_adapter.store.dbclock import clock_skew, read_now
    from broker_adapter.store.outbox_types import OUTBOX_STATES
    from broker_adapter.store.report import LIVE_NAMES, snapshot

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
    live = [(state, p[state]) for state in LIVE_NAMES]
    for state, n in [*live, *report["terminal"].items()]:
        out.gauge("ba_tasks", "Tasks by state (from the database).", n, state=state)
    out.gauge("ba_tasks_ready", "Pending tasks whose not_before has come.", p["ready"])
    for lease in ("live", "expired"):
        out.gauge("ba_task_leases", "Running tasks by lease.", p[f"{lease}_leases"], lease=lease)
    out.gauge("ba_inbox_records", "Requests the inbox remembers.", report["received"]["inbox"])
    for state in OUTBOX_STATES:
        out.gauge("ba_outbox_replies", "Outbox replies by state.", delivery[state], state=state)
    oldest = delivery["oldest_unsent_age_s"]
    out.gauge(
        "ba_outbox_oldest_unsent_age_seconds",
        "Age of the oldest reply not sent yet (0: none).",
        0.0 if oldest is None else oldest,
    )
    out.gauge("ba_receipts", "Replies the receiver recorded.", report["receipts"]["replies"])
    fx = report["effects"]
    operator = fx["awaiting_operator"]
    for waiting, n in (("reconcile", fx["unknown"] - operator), ("operator", operator)):
        out.gauge(
            "ba_unknown_outcomes",
            "Tasks whose external effect's outcome is not known"
            " (unknown), by whether they wait for an operator.",
            n,
            waiting=waiting,
        )
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
        TASK_OUTCOMES.name, TASK_OUTCOMES.help, fx["task_outcomes_unknown"], outcome="unknown"
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
        families: dict[Family, Any] = {}

        def child(family: Family, labels: dict[str, str]) -> Any:
            """The counter of ``family`` with ``labels`` (registered at its first use)."""
            if family not in families:
                families[family] = Counter(
                    family.name, family.help, list(labels), registry=registry
                )
            return families[family].labels(**labels) if labels else families[family]

        #: the exported fields of ``WorkerStats``, and the publications of
        #: ``DispatcherStats``, with their counters
        self._counters = {
            attr: child(d.family, dict(d.labels)) for attr, d in declared(WorkerStats)
        }
        self._publish = {
            attr: child(d.family, {"stage": "worker", **d.labels})
            for attr, d in declared(DispatcherStats)
            if d.family == REPLY_PUBLISH
        }
        self._takeovers = child(LEASE_TAKEOVERS, {})
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
        for attr, counter in self._counters.items():
            self._add(attr, getattr(stats, attr), counter)
        for attr, child in self._publish.items():
            self._add(f"publish.{attr}", getattr(publish, attr), child)
        self._add("takeovers", takeovers, self._takeovers)

    def _add(self, key: str, now: int, counter: Any) -> None:
        gained = now - self._seen.get(key, 0)
        if gained > 0:
            counter.inc(gained)
            self._seen[key] = now

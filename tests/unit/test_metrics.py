"""The metrics collector on fake stages (stats objects filled by hand), the worker's
multiprocess counters, and the health answers."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.parser import text_string_to_metric_families

from broker_adapter.app.adapter import stages_down
from broker_adapter.app.metrics import AdapterCollector, Observed, WorkerMetrics
from broker_adapter.app.serving import MetricsServer
from broker_adapter.metric_fields import declared
from broker_adapter.redis.reader_config import ReaderStats
from broker_adapter.stages.ingest.config import IngestStats
from broker_adapter.stages.receiver.receiver import ReceiverStats
from broker_adapter.stages.shared.publish import REPLY_PUBLISH, DispatcherStats
from broker_adapter.stages.worker.config import WorkerStats
from broker_adapter.store import open_database


def _samples(observed: Observed) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AdapterCollector(observed))
    text = generate_latest(registry).decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _fake_stages() -> Observed:
    reader = SimpleNamespace(
        stream="ba:{in}:tasks",
        stats=ReaderStats(
            read=7,
            replayed=2,
            taken_over=1,
            acked=6,
            reconnects=3,
            group_recreated=1,
            by_reason={"bad_signature": 2, "poison": 1},
        ),
    )
    ingestor = SimpleNamespace(
        stats=IngestStats(
            accepted=4,
            duplicates=2,
            conflicts=1,
            expired=1,
            hop_limited=1,
            trimmed=9,
            dead_letters_trimmed=2,
            trim_failures=1,
        ),
        readers=[reader],
        tasks=SimpleNamespace(lease_takeovers=2),
    )
    dispatcher = SimpleNamespace(
        stats=DispatcherStats(published=5, dead=1, wipes=1, restarts=2, requeued=4, trimmed=3)
    )
    receiver = SimpleNamespace(
        stats=ReceiverStats(applied=3, duplicates=2, bad=1),
        reader=SimpleNamespace(stream="ba:{out.a}:replies", stats=ReaderStats(read=6)),
    )
    return Observed(ingestors=[ingestor], dispatchers=[dispatcher], receivers=[receiver])  # type: ignore[list-item]


def test_collector_exports_each_stats_counter_under_its_name() -> None:
    got = _samples(_fake_stages())
    want = {
        'ba_stream_entries_read_total{stage="ingest"}': 7,
        'ba_stream_entries_read_total{stage="receiver"}': 6,
        'ba_stream_entries_replayed_total{stage="ingest"}': 2,
        'ba_stream_entries_taken_over_total{stage="ingest"}': 1,
        'ba_stream_entries_acked_total{stage="ingest"}': 6,
        'ba_stream_dead_letters_total{reason="bad_signature",stage="ingest"}': 2,
        'ba_stream_dead_letters_total{reason="poison",stage="ingest"}': 1,
        'ba_stream_entries_trimmed_total{stage="ingest"}': 9,
        'ba_stream_entries_trimmed_total{stage="dispatcher"}': 3,
        'ba_dead_letters_trimmed_total{stage="ingest"}': 2,
        'ba_trim_failures_total{stage="ingest"}': 1,
        'ba_inbox_entries_total{outcome="stored"}': 4,
        'ba_inbox_entries_total{outcome="duplicate"}': 2,
        'ba_inbox_entries_total{outcome="conflict"}': 1,
        'ba_inbox_entries_total{outcome="expired"}': 1,
        'ba_inbox_entries_total{outcome="hop_limit"}': 1,
        "ba_lease_takeovers_total": 2,
        'ba_reply_publish_total{outcome="published",stage="dispatcher"}': 5,
        'ba_reply_publish_total{outcome="dead",stage="dispatcher"}': 1,
        "ba_replies_requeued_total": 4,
        'ba_redis_reconnects_total{stage="ingest"}': 3,
        'ba_redis_data_loss_alarms_total{kind="group_lost",stage="ingest"}': 1,
        'ba_redis_data_loss_alarms_total{kind="wipe",stage="dispatcher"}': 1,
        'ba_redis_data_loss_alarms_total{kind="restart",stage="dispatcher"}': 2,
        'ba_receiver_replies_total{outcome="applied"}': 3,
        'ba_receiver_replies_total{outcome="duplicate"}': 2,
        'ba_receiver_replies_total{outcome="bad"}': 1,
        'ba_scrape_errors_total{source="database"}': 0,
    }
    assert {k: got.get(k) for k in want} == want


def test_collector_reads_the_database_and_counts_a_source_it_cannot_read(tmp_path: Path) -> None:
    db_path = tmp_path / "a.db"
    open_database(db_path).close()
    got = _samples(Observed(db_path=db_path))
    assert got['ba_tasks{state="pending"}'] == 0
    assert got['ba_outbox_replies{state="dead"}'] == 0
    assert got["ba_outbox_oldest_unsent_age_seconds"] == 0
    gone = _samples(Observed(db_path=tmp_path / "missing.db"))
    assert 'ba_tasks{state="pending"}' not in gone
    assert gone['ba_scrape_errors_total{source="database"}'] == 1


def test_worker_counters_go_through_the_multiprocess_files_and_add_to_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored afterwards
    metrics = WorkerMetrics(tmp_path, "pkg.mod:fn")
    stats, publish = WorkerStats(claimed=3, done=2, stale_commits=1), DispatcherStats()
    metrics.sync(stats, publish, takeovers=1)
    stats.claimed, publish.published = 5, 2
    metrics.sync(stats, publish, takeovers=1)  # only what was gained is added
    metrics.observe_call(0.002)
    observed = _fake_stages()
    observed.worker_dir = tmp_path
    got = _samples(observed)
    # attempts are counted by the database when the claim commits, not by the worker
    assert "ba_task_attempts_total" not in got
    assert got['ba_task_outcomes_total{outcome="done"}'] == 2
    assert got["ba_stale_fence_refusals_total"] == 1
    assert got["ba_lease_takeovers_total"] == 2 + 1  # the ingest's store and the worker's
    assert got['ba_reply_publish_total{outcome="published",stage="worker"}'] == 2
    assert got['ba_handler_duration_seconds_count{handler="pkg.mod:fn",task=""}'] == 1
    assert got['ba_handler_duration_seconds_bucket{handler="pkg.mod:fn",le="0.001",task=""}'] == 0
    assert got['ba_handler_duration_seconds_bucket{handler="pkg.mod:fn",le="0.005",task=""}'] == 1
    assert any(name.endswith(f"_{os.getpid()}.db") for name in os.listdir(tmp_path))


def _numbered(stats_type: Any, first: int) -> Any:
    """A stats object whose declared fields hold first, first + 1, ... in field order (a
    field declared by a label: two keys, ``x`` and ``y``, holding that and its negation)."""
    return stats_type(
        **{
            attr: first + i if d.by is None else {"x": first + i, "y": -(first + i)}
            for i, (attr, d) in enumerate(declared(stats_type))
        }
    )


def _sample_key(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}_total{{{inner}}}" if inner else f"{name}_total"


def test_both_metric_paths_export_every_declared_field_under_its_declaration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored afterwards
    ingest, receiver = _numbered(IngestStats, 100), _numbered(ReceiverStats, 200)
    dispatcher, worker = _numbered(DispatcherStats, 300), _numbered(WorkerStats, 400)
    worker_publish = _numbered(DispatcherStats, 500)
    WorkerMetrics(tmp_path, "h").sync(worker, worker_publish, takeovers=0)
    ingest_reader, receiver_reader = _numbered(ReaderStats, 600), _numbered(ReaderStats, 700)
    ingestor = SimpleNamespace(
        stats=ingest,
        readers=[SimpleNamespace(stream="i", stats=ingest_reader)],
        tasks=SimpleNamespace(lease_takeovers=0),
    )
    reader = SimpleNamespace(stream="r", stats=receiver_reader)
    observed = Observed(
        ingestors=[ingestor],  # type: ignore[list-item]
        dispatchers=[SimpleNamespace(stats=dispatcher)],  # type: ignore[list-item]
        receivers=[SimpleNamespace(stats=receiver, reader=reader)],  # type: ignore[list-item]
        worker_dir=tmp_path,
    )
    got = _samples(observed)
    want: dict[str, float] = {}
    for stats, stage, only in (
        (ingest, "ingest", None),
        (receiver, "receiver", None),
        (dispatcher, "dispatcher", None),
        (worker, "", None),
        (worker_publish, "worker", REPLY_PUBLISH),
        (ingest_reader, "ingest", None),
        (receiver_reader, "receiver", None),
    ):
        for attr, d in declared(stats):
            if only is not None and d.family != only:
                continue
            for labels, value in d.samples(getattr(stats, attr)):
                if d.family.per_stage:
                    labels = {"stage": stage, **labels}
                key = _sample_key(d.family.name, labels)
                want[key] = want.get(key, 0) + value
    assert 'ba_stream_dead_letters_total{reason="y",stage="receiver"}' in want
    assert len(want) >= 60
    assert {k: got.get(k) for k in want} == want


def test_healthz_and_readyz_answers(tmp_path: Path) -> None:
    db_path = tmp_path / "a.db"
    open_database(db_path).close()
    down: list[str] = []
    server = MetricsServer(Observed(db_path=db_path, stages=lambda: down), port=0)
    try:
        assert server.respond("/healthz") == (200, "text/plain; charset=utf-8", b"ok\n")
        assert server.respond("/readyz")[0::2] == (200, b"ready\n")
        down.append("ingest")
        assert server.respond("/readyz")[0::2] == (503, b"stage not running: ingest\n")
        down.clear()
        db_path.unlink()  # not writable: the check never creates the file
        status, _, body = server.respond("/readyz")
        assert status == 503
        assert body.startswith(b"database:")
        assert not db_path.exists()
        assert server.respond("/nope")[0] == 404
        status, _, text = server.respond("/metrics")
        assert status == 200
        assert b"\nba_ready 0.0\n" in text  # the database is gone
    finally:
        server.stop()


def test_readyz_needs_the_database_write_lock(tmp_path: Path) -> None:
    db_path = tmp_path / "a.db"
    open_database(db_path).close()
    server = MetricsServer(Observed(db_path=db_path), port=0)
    holder = open_database(db_path)
    try:
        with holder.write("hold"):
            assert server.respond("/readyz")[0] == 503  # held past the check's timeout
        assert server.respond("/readyz")[0] == 200
    finally:
        holder.close()
        server.stop()


def test_stages_down_names_dead_threads_and_a_pool_without_workers() -> None:
    done = threading.Thread(target=lambda: None, name="ingest")
    done.start()
    done.join()
    alive = threading.Event()
    running = threading.Thread(target=alive.wait, name="dispatcher")
    running.start()
    try:
        pool: Any = SimpleNamespace(alive=lambda: 0)
        assert stages_down([done, running], pool) == ["ingest", "workers"]
        pool = SimpleNamespace(alive=lambda: 1)
        assert stages_down([running], pool) == []
    finally:
        alive.set()
        running.join()


def test_collector_exports_the_effect_and_approval_counts(tmp_path: Path) -> None:
    from broker_adapter.store import TaskStore
    from broker_adapter.store.approvals import ApprovalStore
    from broker_adapter.store.counters import count_in

    db_path = tmp_path / "a.db"
    with open_database(db_path) as db:
        with db.write("test") as c:  # what the reconciles' transactions count
            for name in (
                "reconciled_not-done",
                "reconciled_done",
                "compensations_started",
                "compensations_done",
            ):
                count_in(c, name)
        approvals = ApprovalStore(TaskStore(db).tx)
        approvals.grant_approval(
            "restart",
            "web1",
            "prod",
            "alice",
            approvals.clock.now() + 600,
            principal="bob",
            arguments_digest="d" * 64,
        )
    got = _samples(Observed(db_path=db_path))
    assert got['ba_reconciles_total{outcome="not-done"}'] == 1
    assert got['ba_reconciles_total{outcome="done"}'] == 1
    assert got['ba_compensations_total{outcome="done"}'] == 1
    assert got['ba_compensations_total{outcome="started"}'] == 1
    assert got["ba_compensations_open"] == 0
    assert got["ba_unknown_oldest_age_seconds"] == 0
    assert got["ba_operator_waits_overdue"] == 0
    assert got['ba_approvals{state="valid"}'] == 1
    assert got['ba_unknown_outcomes{waiting="operator"}'] == 0
    assert got["ba_approvals_waiting"] == 0

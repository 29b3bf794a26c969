"""The PostgreSQL store's schema migrations and connection layer, on a throwaway database."""

from __future__ import annotations

import psycopg
import pytest

from broker_adapter import crashpoints
from broker_adapter.errors import ConfigError, StoreError
from broker_adapter.store.backends import probe
from broker_adapter.store.db import Database, open_database
from broker_adapter.store.identity import STORE_ID_KEY
from broker_adapter.store.migrations import CONFLICT_ID_KEY
from broker_adapter.store.postgres.db import PgDatabase
from broker_adapter.store.postgres.schema import MIGRATIONS, SCHEMA_VERSION
from broker_adapter.store.report import snapshot
from broker_adapter.store.urls import is_postgres_url


def versions(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]


def test_pg_open_migrates_an_empty_database_to_the_current_version(pg_url: str) -> None:
    with PgDatabase(pg_url) as db:
        assert len(db.meta(CONFLICT_ID_KEY)) == 32
    assert versions(pg_url) == list(range(1, len(MIGRATIONS) + 1))


def test_pg_reopen_keeps_schema_and_conflict_key(pg_url: str) -> None:
    with PgDatabase(pg_url) as db:
        key = db.meta(CONFLICT_ID_KEY)
    with PgDatabase(pg_url) as db:
        assert db.meta(CONFLICT_ID_KEY) == key
    assert versions(pg_url) == list(range(1, SCHEMA_VERSION + 1))


def test_pg_refuses_a_newer_schema(pg_url: str) -> None:
    PgDatabase(pg_url).close()
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "INSERT INTO schema_migrations (version, description) VALUES (%s, 'future')",
            (SCHEMA_VERSION + 1,),
        )
    with pytest.raises(StoreError, match="upgrade broker_adapter"):
        PgDatabase(pg_url)


def test_pg_read_only_needs_the_current_schema_and_refuses_writes(pg_url: str) -> None:
    with pytest.raises(StoreError, match="not a broker_adapter database"):
        PgDatabase(pg_url, read_only=True)
    PgDatabase(pg_url).close()
    with PgDatabase(pg_url, read_only=True) as db:
        assert db.fetch_one("SELECT count(*) AS n FROM tasks") == {"n": 0}
        with pytest.raises(StoreError, match="read-only"), db.write("accept"):
            pass


def test_pg_write_commits_once_and_rolls_back_on_error(pg_url: str) -> None:
    with PgDatabase(pg_url) as db:
        with db.write("meta") as c:
            c.execute("INSERT INTO meta (name, value) VALUES ('a', 'x')")

        def failing_write() -> None:
            with db.write("meta") as c:
                c.execute("INSERT INTO meta (name, value) VALUES ('b', 'x')")
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            failing_write()
        with db.read() as c:
            names = {r["name"] for r in c.execute("SELECT name FROM meta")}
        assert names == {CONFLICT_ID_KEY, STORE_ID_KEY, "a"}


def test_pg_write_hits_the_crash_points_on_both_sides_of_commit(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PgDatabase(pg_url) as db:
        seen: list[tuple[str, int]] = []

        def hit(name: str) -> None:  # what another session sees at each point
            with psycopg.connect(pg_url) as other:
                row = other.execute("SELECT count(*) FROM meta WHERE name = 'a'").fetchone()
            seen.append((name, row[0] if row else -1))

        monkeypatch.setattr(crashpoints, "hit", hit)
        with db.write("accept") as c:
            c.execute("INSERT INTO meta (name, value) VALUES ('a', 'x')")
    assert seen == [("store.accept.before_commit", 0), ("store.accept.after_commit", 1)]


def test_pg_url_detection_and_refusal_of_other_targets() -> None:
    assert is_postgres_url("postgresql://u@h/db")
    assert is_postgres_url("postgres://u@h/db")
    assert not is_postgres_url("/var/lib/ba/tasks.db")
    with pytest.raises(ConfigError):
        PgDatabase("/var/lib/ba/tasks.db")


def test_sqlite_only_commands_refuse_a_postgres_url_clearly() -> None:
    with pytest.raises(ConfigError, match="needs a SQLite file"):
        open_database("postgresql://postgres@127.0.0.1/db")


def test_pg_probe_answers_for_a_server_and_names_an_unreachable_one(pg_url: str) -> None:
    assert probe(pg_url, 2.0) is None
    why = probe("postgresql://postgres@127.0.0.1:1/none", 1.0)
    assert why is not None
    assert why.startswith("database: postgresql://postgres@127.0.0.1:1/none")


def test_pg_snapshot_counts_like_the_sqlite_one(store_target: str) -> None:
    from broker_adapter.clock import FakeClock
    from tests.support.store_script import T0, item, open_any, stores

    with open_any(store_target) as db:
        s = stores(db, FakeClock(T0))
        s.tasks.accept([item("m1"), item("m2"), item("m1")])
        s.tasks.claim("w1", 1)
        report = snapshot(db, T0)
    assert report["received"] == {"inbox": 2, "duplicates": 1, "conflicts": 0}
    assert report["processing"]["running"] == report["processing"]["live_leases"] == 1
    assert report["processing"]["ready"] == 1
    assert report["delivery"]["oldest_unsent_age_s"] is None


def test_snapshot_counts_the_effect_records_and_approvals_alike(store_target: str) -> None:
    from broker_adapter.store.counters import count_in
    from broker_adapter.store.operator_waits import outcome_gauges
    from tests.support.store_script import T0, open_any

    with open_any(store_target) as db:
        with db.write("test") as c:
            c.execute(
                "INSERT INTO reconcile_log (task_id, outcome, by_whom, at, fence) VALUES"
                " ('t1', 'not-done', 'r', 1, 1), ('t2', 'done', 'r', 1, 1),"
                " ('t3', 'done', 'r', 1, 1)"
            )
            c.execute(
                "INSERT INTO compensations (task_id, kind, by_whom, fence, what,"
                " started_at, outcome) VALUES ('t2', 'duplicate', 'r', 1, 'x', 1,"
                " 'done')"
            )
            # what the reconciles' own transactions count with those records
            for name in (
                "reconciled_not-done",
                "reconciled_done",
                "reconciled_done",
                "compensations_started",
                "compensations_done",
            ):
                count_in(c, name)
            c.execute(
                "INSERT INTO approvals (approval_id, action, target, scope, approver,"
                " granted_at, expires_at, revoked_at) VALUES (?, 'a', 't', 's', 'alice', ?, ?, ?)",
                ("ap1", T0 - 10, T0 + 600, None),
            )
            c.execute(
                "INSERT INTO approvals (approval_id, action, target, scope, approver,"
                " granted_at, expires_at, revoked_at) VALUES (?, 'a', 't', 's', 'alice', ?, ?, ?)",
                ("ap2", T0 - 10, T0 - 1, T0 - 5),
            )
        effects = snapshot(db, T0)["effects"]
        if isinstance(db, Database):  # the effect and approval stores count the same
            from broker_adapter.store.approvals import approval_counts
            from broker_adapter.store.effects import effect_counts

            with db.read() as c:
                assert effects == {
                    **effect_counts(c),
                    **approval_counts(c, T0),
                    **outcome_gauges(c, T0),
                }
    assert effects == {
        "unknown": 0,
        "awaiting_operator": 0,
        "reconciled_done": 2,
        "reconciled_not-done": 1,
        "reconciled_unknown": 0,
        "compensations_started": 1,
        "compensations_done": 1,
        "compensations_failed": 0,
        "waiting_approval": 0,
        "approvals_valid": 1,
        "approvals_expired": 0,
        "approvals_revoked": 1,
        "task_attempts": 0,
        "task_outcomes_unknown": 0,
        "operator_timeouts_alert": 0,
        "operator_timeouts_fail": 0,
        "compensations_open": 0,
        "oldest_unknown_age_s": 0.0,
        "oldest_operator_wait_age_s": 0.0,
        "operator_overdue": 0,
    }


def test_pg_migration_recomputes_fingerprints_with_the_request_terms(pg_url: str) -> None:
    """A database at version 2 holds fingerprints without the deadline and max_attempts;
    the next migration recomputes them, so a faithful resend stays a duplicate and one
    with another deadline is a conflict."""
    from broker_adapter.clock import FakeClock
    from broker_adapter.protocol.canonical import canonical_json, canonical_numbers, sha256_hex
    from broker_adapter.store import AcceptItem, Outcome, TaskStore
    from tests.support.store_script import T0, envelope

    env = envelope("m-1", payload={"price": 13.0})
    with PgDatabase(pg_url) as db:
        (stored,) = TaskStore(db, FakeClock(T0)).accept([AcceptItem("alice", env)])
    content = {k: v for k, v in env.content().items() if k not in ("deadline", "max_attempts")}
    old = sha256_hex(canonical_numbers(canonical_json(content)))  # version 2's definition
    assert old != env.fingerprint()
    with psycopg.connect(pg_url) as conn:
        conn.execute("UPDATE tasks SET fingerprint = %s", (old,))
        conn.execute("UPDATE inbox SET fingerprint = %s", (old,))
        conn.execute("DELETE FROM schema_migrations WHERE version > 2")
    with PgDatabase(pg_url) as db:
        assert db.fetch_one("SELECT fingerprint FROM inbox") == {"fingerprint": env.fingerprint()}
        assert db.fetch_one("SELECT fingerprint FROM tasks") == {"fingerprint": env.fingerprint()}
        store = TaskStore(db, FakeClock(T0 + 5))
        (again,) = store.accept([AcceptItem("alice", env)])
        assert (again.outcome, again.task_id) == (Outcome.DUPLICATE, stored.task_id)
        (changed,) = store.accept([AcceptItem("alice", env.replace(deadline=T0 + 601))])
        assert (changed.outcome, changed.task_id) == (Outcome.CONFLICT, stored.task_id)
    assert versions(pg_url) == list(range(1, SCHEMA_VERSION + 1))

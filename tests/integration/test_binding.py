"""One store per prefix, one live process per consumer name (``app.binding``), with real
``broker-adapter`` processes on a real redis-server (and the real PostgreSQL server)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import IO, Any

import pytest
import redis

from broker_adapter.client.publisher import Publisher
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import text
from broker_adapter.store.backends import open_store
from broker_adapter.store.identity import store_identity
from tests.support.cli import cli_env, count_rows, error_line, run_cli, wait_for
from tests.support.handlers import init_effects_db
from tests.support.ingest_script import envelope, real_deadline
from tests.support.postgres import require_server
from tests.support.redis_cluster import RedisCluster, redis_cluster  # noqa: F401
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=120)


def _run_args(redis_url: str, db: str | Path, prefix: str, keyring: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--redis",
        redis_url,
        "--db",
        str(db),
        "--prefix",
        prefix,
        "--keyring",
        str(keyring),
        "--workers",
        "1",
        *extra,
    ]


def _start(log: IO[str], args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "broker_adapter", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def _store_id(db: str | Path) -> str:
    store = open_store(db)
    try:
        return store_identity(store).store_id
    finally:
        store.close()


def _bound(client: redis.Redis, prefix: str) -> str | None:
    raw = client.get(Keys(prefix).store_binding())
    return None if raw is None else str(json.loads(raw)["store"])


#: Each message id's deadline, fixed at its first publication: a resend is the same
#: request only with the same deadline (it is part of the request's fingerprint).
_DEADLINES: dict[tuple[str, str], float] = {}


def _publish(
    client: redis.Redis, prefix: str, keyring: Keyring, ids: list[str], **payload: Any
) -> None:
    publisher = Publisher(client, Keys(prefix), "alice", keyring)
    for mid in ids:
        deadline = _DEADLINES.setdefault((prefix, mid), real_deadline())
        publisher.publish(envelope(mid, payload={"value": mid, **payload}, deadline=deadline))


def _sent(db: Path) -> int:
    return count_rows(db, "SELECT count(*) FROM outbox WHERE state = 'sent'")


def test_a_second_sqlite_adapter_on_a_bound_prefix_exits_2_and_the_first_runs_on(
    redis_server: RedisServer, prefix: str, keyring: Keyring, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.json"
    first_db, second_db = tmp_path / "first.db", tmp_path / "second.db"
    client = redis_server.client()
    with open(tmp_path / "first.log", "w") as log:
        first = _start(
            log,
            _run_args(
                redis_server.url,
                first_db,
                prefix,
                keys_file,
                "--handler",
                "broker_adapter.examples:echo",
            ),
        )
        try:
            wait_for(lambda: _bound(client, prefix) is not None, "the first adapter's binding")
            res = _cli(
                *_run_args(
                    redis_server.url,
                    second_db,
                    prefix,
                    keys_file,
                    "--handler",
                    "broker_adapter.examples:echo",
                )
            )
            line = error_line(res, 2)
            first_id, second_id = _store_id(first_db), _store_id(second_db)
            assert f"prefix {prefix!r} is bound to store {first_id[:8]}" in line
            assert str(first_db) in line
            assert second_id[:8] in line
            assert "same database" in line
            assert "PostgreSQL" in line
            assert "--prefix" in line
            assert _bound(client, prefix) == first_id  # the refusal changed nothing
            # the first one runs on and answers
            assert first.poll() is None
            _publish(client, prefix, keyring, ["after-refusal"])
            wait_for(lambda: _sent(first_db) == 1, "the first adapter's reply")
            assert count_rows(second_db, "SELECT count(*) FROM tasks") == 0
        finally:
            code = _stop(first)
            client.close()
    assert code == 0, (tmp_path / "first.log").read_text()


def test_a_consumer_name_held_by_a_live_process_is_refused_and_a_dead_ones_taken_over(
    redis_server: RedisServer, prefix: str, keyring: Keyring, tmp_path: Path
) -> None:
    """One SQLite file, two processes on this host: the same store, so the binding lets
    both run, but not under one ``--name``. A SIGKILLed holder's claim is taken over at
    once by its successor on this host (its PID is gone)."""
    keys_file, db = tmp_path / "keys.json", tmp_path / "a.db"
    args = _run_args(
        redis_server.url,
        db,
        prefix,
        keys_file,
        "--handler",
        "broker_adapter.examples:echo",
        "--name",
        "worker-one",
    )
    client = redis_server.client()
    claim = Keys(prefix).consumer_claim("worker-one")
    with open(tmp_path / "a.log", "w") as log:
        first = _start(log, args)
        try:
            wait_for(lambda: client.exists(claim) == 1, "the name claim")
            holder = json.loads(client.get(claim) or b"{}")
            assert holder["pid"] == first.pid
            line = error_line(_cli(*args), 2)
            assert "consumer name 'worker-one'" in line
            assert "held by a live process" in line
            assert f"pid {first.pid}" in line
            assert "--name" in line
            assert first.poll() is None
            first.kill()
            first.wait(timeout=30)
            successor = _start(log, args)
            try:
                wait_for(
                    lambda: json.loads(client.get(claim) or b"{}").get("pid") == successor.pid,
                    "the successor's claim",
                )
                _publish(client, prefix, keyring, ["m1"])
                wait_for(lambda: _sent(db) == 1, "a reply from the successor")
            finally:
                assert _stop(successor) == 0
            assert client.exists(claim) == 0  # a clean stop gives the name up
        finally:
            if first.poll() is None:
                first.kill()
            client.close()


def _attempts(effects_db: Path) -> dict[str, int]:
    """Handler calls per message id (the record_effect handler's ledger)."""
    import sqlite3

    conn = sqlite3.connect(effects_db)
    try:
        rows = conn.execute(
            "SELECT effects.value, count(*) FROM attempts JOIN effects USING (idempotency_key)"
            " GROUP BY effects.value"
        ).fetchall()
    finally:
        conn.close()
    return {str(v): int(n) for v, n in rows}


def _ran_at_least(effects_db: Path, n: int) -> bool:
    return len(_attempts(effects_db)) >= n


def test_two_adapters_on_one_postgres_database_with_resends_in_flight_run_each_request_once(
    redis_server: RedisServer, prefix: str, keyring: Keyring, tmp_path: Path, pg_url: str
) -> None:
    """Both adapters run on this host with the default ``--name``: the same store, so two
    distinct logical consumer names (slots 0 and 1), neither the host name. The agent
    resends every unanswered request while both work."""
    require_server()
    keys_file, effects_db = tmp_path / "keys.json", tmp_path / "effects.db"
    init_effects_db(effects_db)
    args = _run_args(
        redis_server.url,
        pg_url,
        prefix,
        keys_file,
        "--handler",
        "tests.support.handlers:record_effect",
    )
    client = redis_server.client()
    ids = [f"m{i}" for i in range(40)]
    with open(tmp_path / "a.log", "w") as log_a, open(tmp_path / "b.log", "w") as log_b:
        a, b = _start(log_a, args), _start(log_b, args)
        try:
            # the first send, then resends of every id while the first ones run: once some
            # have run, and again once half have
            for round_, ran in enumerate((0, 1, len(ids) // 2)):
                wait_for(partial(_ran_at_least, effects_db, ran), f"{ran} requests run")
                _publish(client, prefix, keyring, ids, effects_db=str(effects_db))
                assert a.poll() is None, round_
                assert b.poll() is None, round_
            wait_for(
                lambda: len(_attempts(effects_db)) == len(ids), "every request run", timeout_s=180
            )
            stream = Keys(prefix).inbound()
            wait_for(
                lambda: client.xpending(stream, INGEST_GROUP)["pending"] == 0,
                "every entry acknowledged",
                timeout_s=120,
            )
            consumers = {text(c["name"]) for c in client.xinfo_consumers(stream, INGEST_GROUP)}
        finally:
            codes = (_stop(a), _stop(b))
            client.close()
    assert codes == (0, 0), (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert _attempts(effects_db) == {mid: 1 for mid in ids}
    store = _store_id(pg_url)
    # two adapters took two names: one consumer each, logical ids of the store and host
    assert len(consumers) == 2, consumers
    assert all(c.startswith(store[:8]) and c.endswith("-ingest") for c in consumers)
    assert {c.rsplit("-", 2)[1] for c in consumers} == {"0", "1"}


def test_a_second_receipt_store_on_one_receiver_group_is_refused(
    redis_server: RedisServer, prefix: str, keyring: Keyring, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.json"

    def receive(db: Path, *extra: str) -> list[str]:
        return [
            "receive",
            "--redis",
            redis_server.url,
            "--db",
            str(db),
            "--prefix",
            prefix,
            "--principal",
            "alice",
            "--keyring",
            str(keys_file),
            *extra,
        ]

    first_db, second_db = tmp_path / "r1.db", tmp_path / "r2.db"
    with open(tmp_path / "r1.log", "w") as log:
        first = _start(log, receive(first_db))
        client = redis_server.client()
        key = Keys(prefix).receipt_binding("alice", "ba-receiver")
        try:
            wait_for(lambda: client.exists(key) == 1, "the first receiver's binding")
            line = error_line(_cli(*receive(second_db, "--until-idle", "1")), 2)
            assert f"receiver group 'ba-receiver' of 'alice' on prefix {prefix!r}" in line
            assert _store_id(first_db)[:8] in line
            assert "same receipt database" in line
            assert first.poll() is None
            # the same receipt file again (a restart) is the bound store: accepted
            again = _cli(*receive(first_db, "--until-idle", "0.5"))
            assert again.returncode == 0, again.stderr
        finally:
            assert _stop(first) == 0
            client.close()


def test_rebind_is_not_needed_after_a_restore_and_says_what_a_move_forgets(
    redis_server: RedisServer, prefix: str, keyring: Keyring, tmp_path: Path
) -> None:
    keys_file, db = tmp_path / "keys.json", tmp_path / "live.db"
    client = redis_server.client()
    handler = ("--handler", "broker_adapter.examples:echo")
    with open(tmp_path / "run.log", "w") as log:
        run = _start(log, _run_args(redis_server.url, db, prefix, keys_file, *handler))
        try:
            _publish(client, prefix, keyring, ["a", "b", "c"])
            wait_for(lambda: _sent(db) == 3, "three replies")
            backup = _cli("backup", "--db", str(db), "--out", str(tmp_path / "snap.db"))
            assert backup.returncode == 0, backup.stderr
            assert json.loads(backup.stdout)["store_id"] == _store_id(db)
            # a move while the bound store's adapter runs: refused, naming it
            moved = _cli(
                "rebind",
                "--redis",
                redis_server.url,
                "--prefix",
                prefix,
                "--db",
                str(tmp_path / "other.db"),
            )
            assert "still run on" in error_line(moved, 2)
        finally:
            assert _stop(run) == 0
    # Restore: the snapshot replaces the database; same identity, so no rebind is needed.
    db.unlink()
    shutil.copy(tmp_path / "snap.db", tmp_path / "restored.db")
    restored = tmp_path / "restored.db"
    res = _cli("rebind", "--redis", redis_server.url, "--prefix", prefix, "--db", str(restored))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["rebound"] is False
    assert report["forgets"] is None
    assert "same identity" in report["note"]
    with open(tmp_path / "restored.log", "w") as log:
        run = _start(log, _run_args(redis_server.url, restored, prefix, keys_file, *handler))
        try:
            _publish(client, prefix, keyring, ["a", "d"])  # "a" again: still a duplicate
            wait_for(lambda: _sent(restored) == 4, "the new request's reply")
            assert count_rows(restored, "SELECT duplicates FROM inbox WHERE message_id = 'a'") == 1
        finally:
            assert _stop(run) == 0
    # A deliberate move to an empty store: it says what it forgets, and records the move.
    new_db = tmp_path / "new.db"
    res = _cli(
        "rebind",
        "--redis",
        redis_server.url,
        "--prefix",
        prefix,
        "--db",
        str(new_db),
        "--old-db",
        str(restored),
        "--by",
        "ops-oncall",
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    old_id, new_id = _store_id(restored), _store_id(new_db)
    assert report["rebound"] is True
    assert report["forgotten_message_ids"] == 4
    assert report["from"]["store"] == old_id
    assert report["to"]["store"] == new_id
    assert report["to"]["previous"] == old_id
    assert report["to"]["by"] == "rebind by ops-oncall"
    assert f"every message id store {old_id[:8]}" in report["forgets"]
    assert "moved from" in res.stderr  # the audit line of the log
    assert _bound(client, prefix) == new_id
    refused = _cli(*_run_args(redis_server.url, restored, prefix, keys_file, *handler))
    assert f"bound to store {new_id[:8]}" in error_line(refused, 2)
    client.close()


def test_a_redis_restarted_empty_is_bound_again_by_the_running_store(
    fresh_redis: RedisServer, prefix: str, keyring: Keyring, tmp_path: Path
) -> None:
    keys_file, db = tmp_path / "keys.json", tmp_path / "a.db"
    handler = ("--handler", "broker_adapter.examples:echo")
    client = fresh_redis.client()
    with open(tmp_path / "run.log", "w") as log:
        run = _start(log, _run_args(fresh_redis.url, db, prefix, keys_file, *handler))
        try:
            wait_for(lambda: _bound(client, prefix) is not None, "the binding")
            _publish(client, prefix, keyring, ["before"])
            wait_for(lambda: _sent(db) == 1, "the first reply")
            fresh_redis.restart(wipe=True)
            assert _bound(client, prefix) is None
            wait_for(lambda: _bound(client, prefix) == _store_id(db), "the binding taken again")
            assert run.poll() is None
            _publish(client, prefix, keyring, ["after"])
            wait_for(lambda: _sent(db) == 2, "a reply after the wipe")
            other = _cli(
                *_run_args(fresh_redis.url, tmp_path / "b.db", prefix, keys_file, *handler)
            )
            assert "is bound to store" in error_line(other, 2)
        finally:
            code = _stop(run)
            client.close()
    out = (tmp_path / "run.log").read_text()
    assert code == 0, out
    assert "Redis lost the binding" in out


def test_the_binding_the_name_claims_and_rebind_work_on_a_redis_cluster(
    redis_cluster: RedisCluster,  # noqa: F811
    prefix: str,
    tmp_path: Path,
) -> None:
    from broker_adapter.app.binding import BindingRefused, PrefixGuard, bind, claim_name
    from broker_adapter.app.rebind import _live_names
    from broker_adapter.redis.client import connect

    def identity_of(path: Path) -> Any:
        db = open_store(path)
        try:
            return store_identity(db)
        finally:
            db.close()

    a, b = identity_of(tmp_path / "a.db"), identity_of(tmp_path / "b.db")
    client, keys = connect(redis_cluster.url), Keys(prefix)
    try:
        bind(client, keys.store_binding(), a, what="p")
        with pytest.raises(BindingRefused):
            bind(client, keys.store_binding(), b, what="p")
        claim = claim_name(client, keys, a, None)
        guard = PrefixGuard(client, keys, a, claim)
        guard.check()  # the renewal script runs where the claim's slot is
        assert _live_names(client, keys, a.store_id) == [claim.name]  # SCAN of every master
        refused = _cli(
            "rebind",
            "--redis",
            redis_cluster.url,
            "--prefix",
            prefix,
            "--db",
            str(tmp_path / "b.db"),
        )
        assert "still run on" in error_line(refused, 2)
        guard.release()
        assert _live_names(client, keys, a.store_id) == []
        moved = _cli(
            "rebind",
            "--redis",
            redis_cluster.url,
            "--prefix",
            prefix,
            "--db",
            str(tmp_path / "b.db"),
        )
        assert moved.returncode == 0, moved.stderr
        assert json.loads(moved.stdout)["to"]["store"] == b.store_id
        assert _bound(client, prefix) == b.store_id
    finally:
        client.close()

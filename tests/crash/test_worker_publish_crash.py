"""A worker that publishes its own replies, killed at each point of its publication.

The worker is a subprocess (``tests.support.worker_script drain --redis-url``) on a FakeClock
fixed at ``--now``; it SIGKILLs itself at the dispatcher's crash points, now passed inside
the worker's publication path. Recovery is the dispatcher's sweep after the publisher lease
ran out. Whatever the point: one reply entry per task on the reply stream, the outbox all
``sent``, every task ``done`` once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore
from broker_adapter.store.outbox_types import OutboxPolicy, OutboxRow
from tests.support.redis_server import RedisServer
from tests.support.replies_script import entries_per_reply, reply_keyring
from tests.support.store_script import open_any

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
P = "agent-a"
N = 3
PUB_LEASE_S = OutboxPolicy().lease_s


def _submit(db_path: str) -> list[str]:
    with open_any(db_path) as db:
        results = TaskStore(db, FakeClock(T0)).accept(
            [
                AcceptItem(
                    P,
                    Envelope.build(
                        message_id=f"m{i}", sender=P, payload={"i": i}, deadline=T0 + 3600
                    ),
                )
                for i in range(N)
            ]
        )
    return [str(r.task_id) for r in results]


def _drain(
    db_path: str, server: RedisServer, prefix: str, crashpoint: str | None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("BA_CRASHPOINT", "BA_PAUSEPOINT")}
    if crashpoint is not None:
        env["BA_CRASHPOINT"] = crashpoint
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.worker_script",
            "drain",
            "--db",
            str(db_path),
            "--handler",
            "tests.support.handlers:ok",
            "--owner",
            "w1",
            "--now",
            repr(T0),
            "--batch",
            str(N),
            "--redis-url",
            server.url,
            "--prefix",
            prefix,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _rows(db_path: str) -> list[OutboxRow]:
    with open_any(db_path) as db:
        return OutboxStore(db, FakeClock(T0)).list()


def _dispatcher(db_path: str, server: RedisServer, prefix: str, now: float) -> int:
    """One dispatcher step at ``now``."""
    with open_any(db_path) as db:
        d = Dispatcher(
            DispatcherConfig(prefix=prefix, owner="d1"),
            connect(server.url),
            OutboxStore(db, FakeClock(now)),
            keyring=reply_keyring(),
        )
        return d.step()


def _sweep(db_path: str, server: RedisServer, prefix: str) -> int:
    """The dispatcher's step once the publisher lease ran out."""
    return _dispatcher(db_path, server, prefix, T0 + PUB_LEASE_S + 1)


def _assert_exactly_once(db_path: str, server: RedisServer, prefix: str, ids: list[str]) -> None:
    rows = _rows(db_path)
    assert sorted(str(r.task_id) for r in rows) == sorted(ids)
    assert {r.state for r in rows} == {"sent"}
    stream = Keys(prefix).replies(P)
    assert entries_per_reply(server.client(), stream) == {r.reply_id: 1 for r in rows}
    with open_any(db_path) as db:
        assert TaskStore(db).counts()["done"] == N


@pytest.fixture
def db_path(store_target: str) -> str:
    """The task database: a SQLite file, or a PostgreSQL schema (``store_target``)."""
    return store_target


def test_worker_publishes_and_marks_sent_without_the_dispatcher(
    db_path: str, redis_server: RedisServer, prefix: str
) -> None:
    ids = _submit(db_path)
    assert _dispatcher(db_path, redis_server, prefix, T0) == 0  # its first look sets the epoch
    proc = _drain(db_path, redis_server, prefix, None)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(db_path)
    assert {(r.state, r.owner, r.fence, r.attempts) for r in rows} == {("sent", None, 1, 1)}
    _assert_exactly_once(db_path, redis_server, prefix, ids)


@pytest.mark.parametrize(
    ("point", "state", "on_stream"),
    [
        ("dispatcher.before_xadd", "sending", 0),
        ("dispatcher.after_xadd", "sending", N),
        ("dispatcher.after_mark_sent", "sent", N),
    ],
)
def test_worker_killed_in_its_publication_leaves_one_reply_each(
    db_path: str, redis_server: RedisServer, prefix: str, point: str, state: str, on_stream: int
) -> None:
    ids = _submit(db_path)
    assert _dispatcher(db_path, redis_server, prefix, T0) == 0  # its first look sets the epoch
    proc = _drain(db_path, redis_server, prefix, point)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    rows = _rows(db_path)
    assert {r.state for r in rows} == {state}
    if state == "sending":  # held by the dead worker's publisher until its lease runs out
        assert {(r.owner, r.fence) for r in rows} == {("w1-pub", 1)}
    stream = Keys(prefix).replies(P)
    assert int(redis_server.client().xlen(stream)) == on_stream
    swept = _sweep(db_path, redis_server, prefix)  # a restarted dispatcher
    if state == "sending":
        assert swept == N  # the records return the entries published before the kill
    _assert_exactly_once(db_path, redis_server, prefix, ids)


def test_dispatcher_leaves_the_worker_rows_alone_within_the_lease(
    db_path: str, redis_server: RedisServer, prefix: str
) -> None:
    _submit(db_path)
    proc = _drain(db_path, redis_server, prefix, "dispatcher.before_xadd")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _dispatcher(db_path, redis_server, prefix, T0 + PUB_LEASE_S - 1) == 0
    assert {r.state for r in _rows(db_path)} == {"sending"}

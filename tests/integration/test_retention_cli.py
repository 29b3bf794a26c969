"""Retention end to end: the flag and the variable reach the stores of ``run`` and
``receive``, their purges run while they do, and ``backup`` snapshots a file in use."""

from __future__ import annotations

import json
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.keys import Keys
from broker_adapter.store import ReceiptStore, TaskStore, open_database
from broker_adapter.store.retention import PURGE_EVERY_S
from tests.integration.test_cli import _stop
from tests.integration.test_cli import keyring as keyring  # the fixture
from tests.support.cli import ROOT, publish
from tests.support.cli import cli_env as _env
from tests.support.cli import count_rows as _count
from tests.support.cli import run_cli as _cli
from tests.support.cli import wait_for as _wait_for
from tests.support.redis_server import RedisServer
from tests.support.replies_script import (
    dispatcher_for,
    drain,
    effect_counts,
    make_replies,
    receiver_for,
)
from tests.support.store_script import item

pytestmark = pytest.mark.integration


def test_run_and_receive_take_the_retention_from_the_environment_and_flag_and_purge(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    url = redis_server.url
    for i in range(4):
        publish(url, keyring, prefix, f"m{i}", {}, "--deadline-in", "1")
    publish(
        url, keyring, prefix, "far", {}, "--deadline-in", "30"
    )  # further ahead than a 3 s window: refused
    # The receiver, with --retention 1, reads while the replies are made (a reply older than
    # its window, about half a second here, would be refused as stale): it applies the
    # four, then forgets them.
    started = time.monotonic()
    receiver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "receive",
            "--redis",
            url,
            "--db",
            str(rdb),
            "--principal",
            "alice",
            "--prefix",
            prefix,
            "--keyring",
            str(keyring),
            "--retention",
            "1",
            "--until-idle",
            str(PURGE_EVERY_S + 3),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            url,
            "--db",
            str(db),
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "1",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(BA_RETENTION_S="3"),
    )
    try:
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 4,
            "the four replies sent",
        )
        assert _count(db, "SELECT count(*) FROM inbox WHERE message_id = 'far'") == 0
        # Past the window (3 s after the replies were sent), the purge forgets them all.
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM tasks") == 0,
            "the purge",
            timeout_s=3 + 2 * PURGE_EVERY_S + 20,
        )
        assert _count(db, "SELECT count(*) FROM inbox") == 0
        assert _count(db, "SELECT count(*) FROM outbox") == 0
    finally:
        assert _stop(proc) == 0
    dead: Any = redis_server.client().xrange(Keys(prefix).inbound_dead())
    assert [(f[b"dl.reason"], f[b"dl.field"]) for _, f in dead] == [(b"too_large", b"deadline")]

    _, errors = receiver.communicate(timeout=120)
    assert receiver.returncode == 0, errors
    assert time.monotonic() - started >= PURGE_EVERY_S
    assert "received 4 replies" in errors
    assert _count(rdb, "SELECT count(*) FROM receipts") == 0


def test_receiver_keeps_receipts_of_entries_still_pending_past_the_window(
    redis_server: RedisServer, tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver killed between its commit and its XACK, and down for longer than the
    window: its receipts are kept while their entries are pending; the redelivered replies,
    older than the reply window by then, are refused as stale and never applied again; once
    acknowledged, the next pass forgets the receipts."""
    clock = FakeClock(time.time())  # receipts and entry ids on one timeline
    with open_database(tmp_path / "agent.db") as agent, open_database(tmp_path / "rx.db") as rx:
        ids = make_replies(agent, clock, "alice", 3)
        assert dispatcher_for(redis_server.url, agent, clock, prefix, "d1").step() == 3
        first = receiver_for(redis_server.url, rx, clock, prefix, "alice", "r1", retention_s=100)
        monkeypatch.setattr(
            first.reader, "ack", lambda *a, **k: 0
        )  # killed before XACK: none acked
        assert drain(first) == 3
        assert len(ReceiptStore(rx).list()) == 3

        clock.advance(100 + 3600)  # down for an hour past the window
        again = receiver_for(redis_server.url, rx, clock, prefix, "alice", "r1", retention_s=100)
        drain(again)  # its first step purges first, then replays its own pending entries
        assert again.stats.bad == 3  # stale: older than the receiver's reply window
        assert again.stats.applied == 0
        assert effect_counts(tmp_path / "rx.db") == dict.fromkeys(ids, 1)
        assert len(ReceiptStore(rx).list()) == 3

        clock.advance(PURGE_EVERY_S)  # the next pass: nothing pending any more
        again.step()
        assert ReceiptStore(rx).list() == []


def test_backup_snapshots_a_database_while_another_connection_writes(tmp_path: Path) -> None:
    path, out = tmp_path / "adapter.db", tmp_path / "snap" / "backup.db"
    out.parent.mkdir()
    clock = FakeClock()
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        with open_database(path) as db:
            tasks = TaskStore(db, clock)
            i = 0
            while not stop.is_set() or i < 200:
                tasks.accept([item(f"w{i}", deadline=clock.now() + 60)])
                i += 1
                written.append(i)

    with open_database(path):
        pass
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        _wait_for(lambda: len(written) >= 100, "the writer under way")
        res = _cli("backup", "--db", str(path), "--out", str(out))
        during = len(written)
    finally:
        stop.set()
        thread.join()
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert report["integrity"] == "ok"
    assert list(out.parent.iterdir()) == [out]  # no partial file left behind
    conn = sqlite3.connect(f"file:{out}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        tasks = conn.execute("SELECT count(*) FROM tasks").fetchone()[0]
        inbox = conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    finally:
        conn.close()
    # A moment's state: every request whole, at least those before the backup began.
    assert 100 <= tasks == inbox == report["rows"]["tasks"] <= during
    with open_database(out) as snap:  # and it opens as a database of ours
        assert snap.integrity_check() == "ok"
    again = _cli("backup", "--db", str(path), "--out", str(out))
    assert again.returncode == 2
    assert "exists" in again.stderr
    missing = _cli("backup", "--db", str(tmp_path / "none.db"), "--out", str(tmp_path / "x.db"))
    assert missing.returncode == 2
    assert not (tmp_path / "none.db").exists()

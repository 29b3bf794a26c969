"""The CLI end to end against a real redis-server, every stage a real subprocess."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.app.cli import EXIT_FAILURE, EXIT_USAGE
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.store import AcceptItem, OutboxStore, TaskStore, open_database
from tests.support.cli import cli_env as _env
from tests.support.cli import count_rows as _count
from tests.support.cli import error_line as _error_line
from tests.support.cli import publish, publish_range
from tests.support.cli import run_cli as _cli
from tests.support.cli import wait_for as _wait_for
from tests.support.ingest_script import real_deadline, write_keyring
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60.0
#: Good flags of each command (a keyring ``k.json`` in the working directory, a Redis
#: that is never reached): the bad-flag cases add or override one.
RUN = [
    "run",
    "--redis",
    "redis://127.0.0.1:1",
    "--db",
    "a.db",
    "--handler",
    "broker_adapter.examples:echo",
    "--keyring",
    "k.json",
]
PUBLISH = [
    "publish",
    "--redis",
    "redis://127.0.0.1:1",
    "--principal",
    "alice",
    "--keyring",
    "k.json",
    "--id",
    "m",
    "--payload",
    "{}",
]
RECEIVE = [
    "receive",
    "--redis",
    "redis://127.0.0.1:1",
    "--db",
    "r.db",
    "--principal",
    "alice",
    "--keyring",
    "k.json",
    "--until-idle",
    "0",
]


def _start_run(
    redis_url: str, db: Path, keyring: Path, prefix: str, *extra: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_url,
            "--db",
            str(db),
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "2",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            "--lease",
            "2",
            "--claim-min-idle-ms",
            "1000",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    secrets = {
        "alice": {"k1": "alice-secret: a test key of 32 bytes or more"},
        "bob": {"k1": "bob-secret: a test key of 32 bytes or more"},
    }
    path.write_text(json.dumps(secrets))
    path.chmod(0o600)
    return path


def _receipts(db: Path) -> list[dict[str, Any]]:
    res = _cli("receipts", "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def _receive(redis_url: str, db: Path, prefix: str, principal: str, keyring: Path) -> None:
    res = _cli(
        "receive",
        "--redis",
        redis_url,
        "--db",
        str(db),
        "--principal",
        principal,
        "--prefix",
        prefix,
        "--until-idle",
        "1.5",
        "--keyring",
        str(keyring),
    )
    assert res.returncode == 0, res.stderr


def _stop(
    proc: subprocess.Popen[str], sig: int = signal.SIGTERM, *, keep_output: bool = False
) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.stdout and not keep_output:
            proc.stdout.close()


def test_cli_publish_run_receive_gives_one_effect_per_message(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    n = 12
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    # resends of m0..m2 with the first deadline (--deadline): duplicates
    deadline = time.time() + 300
    publish_range(redis_server.url, keyring, prefix, range(n), deadline=deadline)
    publish_range(redis_server.url, keyring, prefix, range(3), deadline=deadline)
    proc = _start_run(redis_server.url, db, keyring, prefix)
    try:
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == n,
            "all replies sent",
        )
    finally:
        assert _stop(proc) == 0
    _receive(redis_server.url, rdb, prefix, "alice", keyring)
    receipts = _receipts(rdb)
    assert sorted(r["message_id"] for r in receipts) == sorted(f"m{i}" for i in range(n))
    assert all(r["effects"] == 1 and r["status"] == "done" for r in receipts)
    assert {r["result"]["echo"]["i"] for r in receipts} == set(range(n))
    status = _cli(
        "status", "--db", str(db), "--redis", redis_server.url, "--prefix", prefix, "--json"
    )
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["received"] == {"inbox": n, "duplicates": 3, "conflicts": 0}
    assert report["terminal"]["done"] == n
    assert report["delivery"]["sent"] == n
    assert report["delivery"]["pending"] == 0
    assert report["processing"]["running"] == 0
    assert all(s["pending"] == 0 for s in report["redis"]["inbound"].values())


def test_cli_publish_resend_is_the_same_request_only_with_the_same_deadline(
    redis_server: RedisServer, keyring: Path, prefix: str
) -> None:
    """``--deadline-in`` makes a new deadline at each call (another request under the same
    id: a conflict); ``--deadline`` with the deadline the first ack printed is a resend."""

    def send(*extra: str, deadline: float | None = None) -> dict[str, Any]:
        url = redis_server.url
        return publish(url, keyring, prefix, "m-1", {"a": 1}, *extra, deadline=deadline)

    first = send("--deadline-in", "300")
    again = send(deadline=first["deadline"])
    assert (again["deadline"], again["fingerprint"]) == (first["deadline"], first["fingerprint"])
    later = send("--deadline-in", "300")
    assert later["deadline"] != first["deadline"]
    assert later["fingerprint"] != first["fingerprint"]


def test_cli_run_killed_mid_stream_and_restarted_loses_and_doubles_nothing(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    n = 40
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    publish_range(redis_server.url, keyring, prefix, range(n), principal="bob")
    proc = _start_run(redis_server.url, db, keyring, prefix)
    _wait_for(lambda: _count(db, "SELECT count(*) FROM tasks") > 0, "first tasks ingested")
    proc.kill()  # SIGKILL the whole runner (its worker children die with their parent's pipe)
    proc.wait(timeout=30)
    if proc.stdout:
        proc.stdout.close()
    proc = _start_run(redis_server.url, db, keyring, prefix)
    try:
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == n,
            "all replies sent after restart",
        )
    finally:
        assert _stop(proc) == 0
    _receive(redis_server.url, rdb, prefix, "bob", keyring)
    receipts = _receipts(rdb)
    assert len(receipts) == n
    assert sorted(r["message_id"] for r in receipts) == sorted(f"m{i}" for i in range(n))
    assert all(r["effects"] == 1 for r in receipts)
    assert _count(db, "SELECT count(*) FROM tasks") == n


def test_cli_run_killed_after_handing_tasks_to_idle_workers_loses_nothing(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    """The accept transaction claims new tasks for the idle workers (the hand-off). The
    runner is SIGKILLed right after that commit, before any worker heard of them: the tasks
    wait ``running`` under a dead worker's name, come back at lease expiry after the
    restart, and run once."""
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_server.url,
            "--db",
            str(db),
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "2",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
            "--lease",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(BA_CRASHPOINT="store.accept.after_commit@2"),
    )
    try:
        _wait_for(lambda: _count(db, "SELECT count(*) FROM sqlite_master") > 0, "database")
        publish_range(redis_server.url, keyring, prefix, range(1))
        # Its reply is out: both workers sit idle, waiting for the hand-off.
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 1,
            "the first reply",
        )
        publish_range(redis_server.url, keyring, prefix, range(1, 2))
        assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout:
            proc.stdout.close()
    handed = "SELECT count(*) FROM tasks WHERE state = 'running' AND owner IS NOT NULL"
    assert _count(db, handed) == 1  # claimed in the accept transaction, never run
    proc = _start_run(redis_server.url, db, keyring, prefix)
    try:
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 2,
            "both replies sent after the restart",
        )
    finally:
        assert _stop(proc) == 0
    assert _count(db, "SELECT attempts FROM tasks WHERE message_id = 'm1'") == 2
    _receive(redis_server.url, rdb, prefix, "alice", keyring)
    receipts = _receipts(rdb)
    assert sorted(r["message_id"] for r in receipts) == ["m0", "m1"]
    assert all(r["effects"] == 1 for r in receipts)


def test_cli_sigterm_drains_cleanly(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    db = tmp_path / "adapter.db"
    proc = _start_run(redis_server.url, db, keyring, prefix)
    _wait_for(lambda: _count(db, "SELECT count(*) FROM sqlite_master") > 0, "database created")
    publish_range(redis_server.url, keyring, prefix, range(3))
    _wait_for(
        lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 3, "replies"
    )
    assert _stop(proc) == 0
    assert _count(db, "SELECT count(*) FROM tasks WHERE state = 'running'") == 0


def test_cli_receive_with_keyring_applies_only_signed_replies(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """``run``, ``publish`` and ``receive --keyring`` as subprocesses; replies an attacker
    wrote to alice's reply stream first (no signature, an attacker's key, mallory's key)
    are dead-lettered and only the adapter's signed replies are received."""
    secrets = {
        "alice": {
            "alice-2": "alice: the current key, 32 bytes or more",
            "alice-1": "alice: the key before the current one",
        },
        "mallory": {"m-1": "mallory has a key of her own, 32+ bytes"},
    }
    keyring = tmp_path / "signed-keyring.json"
    keyring.write_text(json.dumps(secrets), encoding="utf-8")
    keyring.chmod(0o600)
    client: Any = redis_server.client()
    replies = f"{prefix}:{{out.alice}}:replies"  # spelled out as PROTOCOL.md names it

    def forged(reply_id: str, secret: str | None, kid: str) -> dict[str, Any]:
        body = json.dumps(
            {"principal": "alice", "reply_id": reply_id, "status": "done"},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        fields: dict[str, Any] = {
            "v": "2",
            "reply_id": reply_id,
            "body": body,
            "hash": hashlib.sha256(body).hexdigest(),
            "kid": kid,
        }
        if secret is not None:
            msg = b"ba.reply.v1\n" + f"{kid}\nalice\n{reply_id}\n".encode() + body
            fields["sig"] = hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()
        return fields

    client.xadd(replies, forged("r-unsigned", None, "alice-2"))
    client.xadd(replies, forged("r-guessed", "not alice's secret, but 32 bytes long", "alice-2"))
    client.xadd(replies, forged("r-mallory", secrets["mallory"]["m-1"], "m-1"))
    db, rdb = tmp_path / "adapter.db", tmp_path / "receiver.db"
    publish_range(redis_server.url, keyring, prefix, range(3))
    proc = _start_run(redis_server.url, db, keyring, prefix)
    try:
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 3, "replies"
        )
    finally:
        assert _stop(proc) == 0
    _receive(redis_server.url, rdb, prefix, "alice", keyring)
    got = _receipts(rdb)
    assert sorted(r["message_id"] for r in got) == ["m0", "m1", "m2"]
    assert {r["status"] for r in got} == {"done"}
    dead = client.xrange(f"{prefix}:{{out.alice}}:dead")
    reasons = {f[b"orig.reply_id"].decode(): f[b"dl.reason"].decode() for _, f in dead}
    assert reasons == {
        "r-unsigned": "missing_field",
        "r-guessed": "bad_signature",
        "r-mallory": "unknown_key",
    }
    # a keyring without the principal's keys cannot verify anything: refused up front
    other = tmp_path / "other-keyring.json"
    other.write_text(json.dumps({"mallory": secrets["mallory"]}), encoding="utf-8")
    other.chmod(0o600)
    res = _cli(
        "receive",
        "--redis",
        redis_server.url,
        "--db",
        str(rdb),
        "--principal",
        "alice",
        "--prefix",
        prefix,
        "--until-idle",
        "0.5",
        "--keyring",
        str(other),
    )
    assert res.returncode == 2
    assert "no keys for principal 'alice'" in res.stderr
    client.close()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--redis", "redis://x", "--db", "d.db", "--handler", "nocolon"], "handler"),
        (
            ["run", "--redis", "http://x", "--db", "d.db", "--handler", "a:b", "--keyring", "k"],
            "redis_url",
        ),
        (["run", "--redis", "redis://x", "--db", "d.db", "--handler", "a:b"], "keyring"),
        (
            [
                "run",
                "--redis",
                "redis://x",
                "--db",
                "d.db",
                "--handler",
                "a:b",
                "--workers",
                "0",
                "--keyring",
                "k",
            ],
            "workers",
        ),
        (
            ["run", "--redis", "redis://x", "--db", "d.db", "--handler", "a:b", "--workers", "x"],
            "invalid int",
        ),
        (
            [
                "publish",
                "--redis",
                "redis://127.0.0.1:1",
                "--principal",
                "a",
                "--keyring",
                "/nonexistent.json",
                "--id",
                "m",
                "--payload",
                "{}",
            ],
            "keyring",
        ),
        (
            [
                "publish",
                "--redis",
                "redis://127.0.0.1:1",
                "--principal",
                "a",
                "--keyring",
                "k",
                "--id",
                "m",
                "--payload",
                "{not json",
            ],
            "payload",
        ),
        (["receive", "--redis", "redis://x", "--db", "d.db", "--principal", "a"], "--keyring"),
        (
            [
                "receive",
                "--redis",
                "redis://x",
                "--db",
                "d.db",
                "--principal",
                "a",
                "--keyring",
                "/nonexistent.json",
            ],
            "keyring",
        ),
        (["frobnicate"], "invalid choice"),
        # a value out of its setting's bounds is refused as the flag is parsed, naming it
        ([*RUN, "--prefix", "a b"], "argument --prefix: 'a b': bad key prefix 'a b'"),
        ([*RUN, "--redis", "http://x"], "AdapterConfig.redis_url: bad Redis URL"),
        ([*RUN, "--redis", "redis://host:abc"], "AdapterConfig.redis_url: bad Redis URL: Port"),
        ([*RUN, "--lease", "-1"], "argument --lease: '-1': Input should be greater than 0"),
        ([*RUN, "--keyring", "/nonexistent.json"], "cannot read keyring /nonexistent.json"),
        ([*RUN, "--db", "no/such/dir/a.db"], "no directory no/such/dir"),
        ([*RUN, "--handler", "nomod:f"], "module 'nomod' not found in the app directory"),
        ([*RUN, "--handler", "nomod:f", "--app-dir", "/"], "the current directory"),
        ([*PUBLISH, "--prefix", "a b"], "bad key prefix 'a b'"),
        ([*PUBLISH, "--redis", "http://x"], "bad Redis URL: must start with redis://"),
        ([*PUBLISH, "--redis", "redis://host:abc"], "bad Redis URL: Port"),
        ([*PUBLISH, "--id", ""], "the envelope is refused: message_id"),
        ([*RECEIVE, "--prefix", "a b"], "argument --prefix: 'a b': bad key prefix"),
        ([*RECEIVE, "--redis", "redis://:pw@host:abc"], "bad Redis URL: Port"),
        ([*RECEIVE, "--principal", "a b"], "ReceiverConfig.principal"),
    ],
)
def test_cli_bad_flags_give_one_clear_error_line(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    write_keyring(tmp_path / "k.json")
    # -P: the working directory is not on the path, as for the console script
    res = subprocess.run(
        [sys.executable, "-P", "-m", "broker_adapter", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    assert _error_line(res, EXIT_USAGE).startswith("broker-adapter: error:")
    assert needle in res.stderr


def test_cli_a_stage_that_crashes_is_a_runtime_failure_naming_it(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    """Not a configuration error (exit 2): exit 1, and the last line names the stage and
    the exception. (A reachable Redis: the prefix is bound before any stage starts.)"""
    write_keyring(tmp_path / "k.json")
    boom = (
        "import sys\n"
        "from broker_adapter.app import adapter, cli\n"
        "def crash(self, *args):\n"
        "    raise RuntimeError('boom')\n"
        "adapter.Adapter._ingest = crash\n"
        "raise SystemExit(cli.main(sys.argv[1:]))\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            boom,
            *RUN,
            "--workers",
            "1",
            "--grace",
            "0",
            "--redis",
            redis_server.url,
            "--prefix",
            prefix,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == EXIT_FAILURE, res.stderr
    last = res.stderr.splitlines()[-1]
    assert last == "broker-adapter: error: ingest stopped: RuntimeError: boom", res.stderr


def test_cli_app_dir_finds_the_handler_and_worker_logs_reach_the_runner(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    """A handler beside the user's files is found with ``--app-dir`` in the worker
    processes too; the exception it raises is logged by the runner, traceback once, with
    the task's ids and without its payload."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "ba_cli_test_app.py").write_text(
        "def explode(task):\n    raise ValueError('the handler exploded on purpose')\n"
    )
    db = tmp_path / "adapter.db"
    env = {**_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            redis_server.url,
            "--db",
            str(db),
            "--handler",
            "ba_cli_test_app:explode",
            "--app-dir",
            "app",
            "--workers",
            "1",
            "--keyring",
            str(keyring),
            "--prefix",
            prefix,
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        payload = {"secret": "payload-never-logged"}
        publish(redis_server.url, keyring, prefix, "m-explode", payload, "--max-attempts", "1")
        _wait_for(
            lambda: _count(db, "SELECT count(*) FROM outbox WHERE state = 'sent'") == 1,
            "the failed task's reply sent",
        )
    finally:
        assert _stop(proc, keep_output=True) == 0
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count('ba_cli_test_app.py", line 2, in explode') == 1, out
    assert re.search(
        r"ERROR broker_adapter\.stages\.\S+: handler failed on task \S+ \(message m-explode from"
        r" alice, attempt 1 of 1\): ValueError: the handler exploded on purpose",
        out,
    ), out
    assert "payload-never-logged" not in out


def test_cli_dead_letters_list_show_replay(
    redis_server: RedisServer, tmp_path: Path, keyring: Path, prefix: str
) -> None:
    db = tmp_path / "adapter.db"
    client: Any = redis_server.client()
    stream = f"{prefix}:{{in}}:tasks"
    client.xadd(stream, {"v": "1", "env": "{not json", "kid": "k1", "sig": "00"})
    client.xadd(stream, {"v": "1", "env": "[also not an envelope", "kid": "k1", "sig": "00"})
    proc = _start_run(redis_server.url, db, keyring, prefix)
    try:
        _wait_for(lambda: client.xlen(f"{prefix}:{{in}}:dead") == 2, "the dead letters")
    finally:
        assert _stop(proc) == 0
    common = ["--db", str(db), "--redis", redis_server.url, "--prefix", prefix, "--json"]
    listed = _cli("dead-letters", "list", *common)
    assert listed.returncode == 0, listed.stderr
    item, other = [json.loads(line) for line in listed.stdout.splitlines()]
    assert item["reason"] == "unparseable"
    assert item["fields"]["orig.env"] == "{not json"
    # without --json: one line saying what the replay did (it crashed after the replay)
    human = _cli("dead-letters", "replay", *common[:-1], other["entry_id"])
    assert human.returncode == 0, human.stderr
    dead = f"{prefix}:{{in}}:dead"
    (line,) = human.stdout.splitlines()
    assert line.startswith(f"replayed entry {other['entry_id']} from {dead} to {stream} as ")
    assert client.xlen(dead) == 1
    shown = _cli("dead-letters", "show", *common, item["entry_id"])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["entry_id"] == item["entry_id"]
    replayed = _cli("dead-letters", "replay", *common, item["entry_id"])
    assert replayed.returncode == 0, replayed.stderr
    result = json.loads(replayed.stdout)
    assert (result["stream"], result["replayed_to"]) == (dead, stream)
    assert client.xlen(f"{prefix}:{{in}}:dead") == 0  # moved back, original fields intact
    (last,) = client.xrevrange(stream, count=1)
    assert last[1][b"env"] == b"{not json"
    missing = _cli("dead-letters", "show", *common, "0-1")
    assert missing.returncode == 2
    assert "no dead reply or dead-letter entry" in missing.stderr
    client.close()


def _cancelled_reply(db_path: Path, *, dead: bool) -> str:
    """A database holding one reply, a cancelled task's: waiting to be sent, or ``dead``
    (given up on); its id."""
    db = open_database(db_path)
    try:
        tasks, outbox = TaskStore(db), OutboxStore(db)
        env = Envelope.build(
            message_id="m-1", sender="alice", payload={"x": 1}, deadline=real_deadline()
        )
        (accepted,) = tasks.accept([AcceptItem("alice", env)])
        assert accepted.task_id is not None
        tasks.cancel(accepted.task_id)
        (row,) = outbox.list()
        if dead:
            (row,) = outbox.claim("publisher", 1)
            outbox.mark_dead(row.reply_id, "publisher", row.fence, "gave up")
        return row.reply_id
    finally:
        db.close()


def test_cli_dead_letters_replay_of_a_reply_prints_a_line_without_json(
    redis_server: RedisServer, tmp_path: Path, prefix: str
) -> None:
    db = tmp_path / "adapter.db"
    reply_id = _cancelled_reply(db, dead=True)
    common = ["--db", str(db), "--redis", redis_server.url, "--prefix", prefix]
    human = _cli("dead-letters", "replay", *common, reply_id)
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines() == [f"replayed reply {reply_id}: requeued"]
    assert _count(db, "SELECT count(*) FROM outbox WHERE state = 'pending'") == 1


def test_cli_status_shows_a_dash_when_nothing_is_unsent(tmp_path: Path) -> None:
    db = tmp_path / "adapter.db"
    open_database(db).close()
    empty = _cli("status", "--db", str(db))
    assert empty.returncode == 0, empty.stderr
    assert "oldest unsent -" in empty.stdout
    assert "None" not in empty.stdout
    _cancelled_reply(db, dead=False)  # one reply waiting to be sent
    waiting = _cli("status", "--db", str(db))
    assert waiting.returncode == 0, waiting.stderr
    assert re.search(r"oldest unsent [0-9.]+s$", waiting.stdout, re.MULTILINE), waiting.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["receipts"],
        ["receipts", "--json"],
        ["status"],
        ["status", "--json"],
        ["dead-letters", "list"],
    ],
)
def test_cli_read_only_commands_refuse_a_missing_database_and_create_none(
    tmp_path: Path, command: list[str]
) -> None:
    typo = tmp_path / "adapter.dbb"
    res = _cli(*command, "--db", str(typo))
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [f"broker-adapter: error: no database at {typo}"], res.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_receive_until_idle_gives_up_while_redis_is_down(
    fresh_redis: RedisServer, tmp_path: Path, keyring: Path
) -> None:
    """No progress counts as idle: with Redis unreachable ``--until-idle 2`` ends after
    about 2 s with one error line and exit 1 (a runtime failure, not "all received")."""
    url = fresh_redis.url
    fresh_redis.stop()
    started = time.monotonic()
    res = _cli(
        "receive",
        "--redis",
        url,
        "--db",
        str(tmp_path / "r.db"),
        "--principal",
        "alice",
        "--until-idle",
        "2",
        "--keyring",
        str(keyring),
        timeout=30,
    )
    took_s = time.monotonic() - started
    assert res.returncode == 1, res.stderr
    lines = res.stderr.splitlines()
    assert lines[-1].startswith(
        "broker-adapter: error: no reply applied for 2 s (--until-idle) and the last read failed"
    ), res.stderr
    assert len([line for line in lines if "retrying" in line]) == 1, res.stderr  # once
    assert 2.0 <= took_s < 20.0

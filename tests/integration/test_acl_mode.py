"""ACL mode on a real redis-server with real ACL users: the stream a principal may write is
what authenticates it, so no signature is needed, and a principal cannot write another's."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from broker_adapter.client.publisher import Publisher, submit_item
from broker_adapter.client.request import Client
from broker_adapter.clock import FakeClock
from broker_adapter.errors import BrokerAdapterError
from broker_adapter.protocol.keys import INGEST_GROUP, Keys
from broker_adapter.protocol.signing import Keyring, unsigned_fields
from broker_adapter.redis.client import connect, text
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, record_effect
from broker_adapter.store import OutboxStore, ReceiptStore, TaskStore, open_database
from broker_adapter.store.db import Database
from tests.support.ingest_script import (
    KEYRING,
    drain,
    envelope,
    pending_total,
    real_deadline,
    task_counts,
    write_keyring,
)
from tests.support.redis_server import RedisServer, require_binary

pytestmark = pytest.mark.integration

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw"}


@pytest.fixture
def acl_users(fresh_redis: RedisServer, prefix: str) -> Iterator[dict[str, redis.Redis]]:
    """One Redis user per principal, allowed only RPUSH on its own submit list."""
    admin = fresh_redis.client()
    keys = Keys(prefix)
    clients: dict[str, redis.Redis] = {}
    for principal, password in PASSWORDS.items():
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL",
            "SETUSER",
            principal,
            "reset",
            "on",
            f">{password}",
            f"~{keys.submit(principal)}",
            "resetchannels",
            "-@all",
            "+rpush",
        )
        clients[principal] = connect(
            f"redis://{principal}:{password}@127.0.0.1:{fresh_redis.port}/0"
        )
    yield clients
    for c in clients.values():
        c.close()
    admin.close()


def test_acl_principal_cannot_write_another_principals_stream(
    acl_users: dict[str, redis.Redis], prefix: str
) -> None:
    keys = Keys(prefix)
    alice = acl_users["alice"]
    fields = unsigned_fields(envelope("m1", sender="bob"))
    # NOPERM (redis-py turns the error code into NoPermissionError)
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        alice.rpush(keys.submit("bob"), submit_item(fields))
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        alice.rpush(keys.submit(), submit_item(fields))  # nor the shared list
    # through the library: a publisher for bob on alice's connection is refused by Redis
    with pytest.raises(BrokerAdapterError, match="no permissions"):
        Publisher(alice, keys, "bob", None).publish(envelope("m1", sender="bob"))
    assert Publisher(alice, keys, "alice", None).publish(envelope("m1")) == "m1"
    # no XADD at all, so no id of her choosing, even on her own stream
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
        alice.xadd(keys.inbound("alice"), unsigned_fields(envelope("m1")), id="9999999999999-0")  # type: ignore[arg-type]


def test_acl_ingest_charges_entries_to_the_streams_principal(
    acl_users: dict[str, redis.Redis],
    fresh_redis: RedisServer,
    prefix: str,
    tmp_path: Path,
    clock: FakeClock,
) -> None:
    keys = Keys(prefix)
    alice, bob = acl_users["alice"], acl_users["bob"]
    alice_pub = Publisher(alice, keys, "alice", None)
    assert alice_pub.stream == keys.inbound("alice")
    for i in range(4):
        alice_pub.publish(envelope(f"m{i}"))
    Publisher(bob, keys, "bob", None).publish(envelope("m0", sender="bob"))
    # alice writes her own list (allowed) but claims to be bob in the body
    alice.rpush(keys.submit("alice"), submit_item(unsigned_fields(envelope("m9", sender="bob"))))

    client = connect(fresh_redis.url)
    tasks = TaskStore(open_database(tmp_path / "inbox.db"), clock)
    config = IngestConfig(
        prefix=prefix,
        consumer="ingest-acl-0",
        mode="acl",
        acl_principals=("alice", "bob"),
        block_ms=20,
    )
    ingestor = Ingestor(config, client, tasks, None, clock=clock)
    drain(ingestor, client)

    expected = {("alice", f"m{i}"): 1 for i in range(4)} | {("bob", "m0"): 1}
    assert task_counts(tasks) == expected  # no ("bob", "m9"): the body alone proves nothing
    dead = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.inbound_dead("alice")))
    assert [(f[b"dl.reason"], f[b"dl.principal"]) for _, f in dead] == [
        (b"sender_mismatch", b"alice")
    ]
    assert client.xlen(keys.inbound_dead("bob")) == 0
    for p in ("alice", "bob"):
        assert pending_total(client, keys.inbound(p)) == 0


# -- the documented users (docs/PROTOCOL.md section 9), the whole pipeline ---------------

ROOT = Path(__file__).resolve().parents[2]
ACL_BEGIN, ACL_END = "<!-- acl-users:begin -->", "<!-- acl-users:end -->"
DOC_PREFIX = "ba"  # the lines are written for the default prefix: a server of its own


def documented_acl() -> str:
    """The users.acl block of PROTOCOL.md section 9, as written there."""
    doc = (ROOT / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    block = doc.split(ACL_BEGIN, 1)[1].split(ACL_END, 1)[0]
    return block.strip().removeprefix("```").removesuffix("```").strip() + "\n"


def documented_password(user: str) -> str:
    for line in documented_acl().splitlines():
        words = line.split()
        if words[1] == user:
            return next(w[1:] for w in words if w.startswith(">"))
    raise KeyError(user)


class AclRedisServer(RedisServer):
    """A redis-server that loads its users from an ACL file; the test talks to it as ``ops``
    (the ``default`` user is off)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.aclfile = workdir / "users.acl"
        self.aclfile.write_text(documented_acl(), encoding="utf-8")

    def args(self) -> list[str]:
        return [*super().args(), "--aclfile", str(self.aclfile)]

    def url_for(self, user: str) -> str:
        return f"redis://{user}:{documented_password(user)}@127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.url_for("ops"), **kwargs)


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[AclRedisServer]:
    require_binary()
    server = AclRedisServer(tmp_path / "redis-acl")
    server.start()
    yield server
    server.stop()


def as_user(server: AclRedisServer, user: str) -> redis.Redis:
    return connect(server.url_for(user))


def make_receiver(server: AclRedisServer, principal: str, db: Database) -> Receiver:
    """The receiver of ``principal``, connected as its own user (one place to change when
    receivers need more than a connection, e.g. key material to check replies)."""
    config = ReceiverConfig(
        prefix=DOC_PREFIX, principal=principal, consumer=f"{principal}-1", block_ms=50
    )
    return Receiver(
        config,
        as_user(server, f"{principal}-receiver"),
        ReceiptStore(db),
        record_effect,
        keyring=Keyring(KEYRING),  # the reply keys: replies are signed in ACL mode too
    )


def refused(fn: Callable[[], object]) -> str:
    """Run one Redis call that the ACL must refuse; returns Redis's error text."""
    with pytest.raises(redis.exceptions.NoPermissionError) as info:
        fn()
    return str(info.value)


def cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BA_")}


def test_documented_acl_runs_the_whole_pipeline_and_refuses_everything_else(
    acl_server: AclRedisServer, tmp_path: Path
) -> None:
    keys = Keys(DOC_PREFIX)
    adapter_url = acl_server.url_for("adapter")
    db_path = tmp_path / "adapter.db"
    keyring = tmp_path / "keyring.json"
    write_keyring(keyring)  # ACL mode authenticates requests by stream; replies are signed
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "run",
            "--redis",
            adapter_url,
            "--db",
            str(db_path),
            "--handler",
            "broker_adapter.examples:echo",
            "--workers",
            "1",
            "--mode",
            "acl",
            "--acl-principal",
            "alice",
            "--acl-principal",
            "bob",
            "--name",
            "acl-test",
            "--keyring",
            str(keyring),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )
    alice, bob = as_user(acl_server, "alice"), as_user(acl_server, "bob")
    agent_db = open_database(tmp_path / "alice.db")
    try:
        Publisher(alice, keys, "alice", None).publish(envelope("a1", deadline=real_deadline()))
        Publisher(bob, keys, "bob", None).publish(
            envelope("b1", sender="bob", deadline=real_deadline())
        )
        # alice on her own list, claiming to be bob: the adapter dead-letters it
        alice.rpush(
            keys.submit("alice"),
            submit_item(unsigned_fields(envelope("x", sender="bob", deadline=real_deadline()))),
        )
        receiver = make_receiver(acl_server, "alice", agent_db)
        deadline = time.monotonic() + 60
        while not ReceiptStore(agent_db).list():
            assert run.poll() is None, "run stopped under the adapter's ACL"
            assert time.monotonic() < deadline, "alice's reply never came"
            receiver.step()  # blocks at most block_ms on the reply stream
        (receipt,) = ReceiptStore(agent_db).list()
        assert (receipt.message_id, receipt.status, receipt.effects) == ("a1", "done", 1)

        # a Client of alice in ACL mode: publishes to her stream, tails her replies
        # without a group and reads her result records, with her agent user's rights only
        with Client(
            acl_server.url_for("alice"), "alice", Keyring(KEYRING), mode="acl", prefix=DOC_PREFIX
        ) as client:
            asked = client.request(None, {"n": 2}, message_id="a2", timeout_s=60)
            assert (asked.status, asked.message_id) == ("done", "a2")
            recorded = client.result("a1")
            assert recorded is not None
            assert recorded.status == "done"

        ops = acl_server.client()
        assert ops.exists(keys.epoch()) == 1  # the dispatcher's first look set it
        adapter = as_user(acl_server, "adapter")
        # the dispatcher falls back to the epoch key alone when INFO is refused: check it here
        assert adapter.info("server")["run_id"] == ops.info("server")["run_id"]
        adapter.close()
        dead = cast(list[tuple[bytes, dict[bytes, bytes]]], ops.xrange(keys.inbound_dead("alice")))
        assert [f[b"dl.reason"] for _, f in dead] == [b"sender_mismatch"]
        for args in (["status", "--json"], ["dead-letters", "list", "--json"]):
            res = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "broker_adapter",
                    *args,
                    "--db",
                    str(db_path),
                    "--redis",
                    adapter_url,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env=cli_env(),
                timeout=60,
            )
            assert res.returncode == 0, res.stderr
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "broker_adapter",
                "dead-letters",
                "replay",
                "--json",
                text(dead[0][0]),
                "--db",
                str(db_path),
                "--redis",
                adapter_url,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=cli_env(),
            timeout=60,
        )
        assert res.returncode == 0, res.stderr

        # -- what the lines forbid ------------------------------------------------------
        fields = cast(Any, unsigned_fields(envelope("f1")))
        anonymous = redis.Redis(port=acl_server.port)
        with pytest.raises(redis.exceptions.AuthenticationError):  # NOAUTH: default is off
            anonymous.xadd(keys.inbound("alice"), fields)
        anonymous.close()
        stream = keys.inbound("alice")
        item = submit_item(fields)
        agent_forbidden: list[Callable[[], object]] = [
            lambda: alice.xadd(stream, fields),  # no XADD: the adapter picks every id
            lambda: alice.xadd(stream, fields, id="18446744073709551615-18446744073709551615"),
            lambda: alice.rpush(keys.submit("bob"), item),
            lambda: alice.rpush(keys.submit(), item),
            lambda: alice.lpush(keys.submit("alice"), item),
            lambda: alice.lpop(keys.submit("alice")),
            lambda: alice.ltrim(keys.submit("alice"), 1, 0),
            lambda: alice.delete(keys.submit("alice")),
            lambda: alice.lrange(keys.submit("alice"), 0, -1),
            lambda: alice.xadd(keys.inbound("bob"), fields),
            lambda: alice.xadd(keys.inbound(), fields),
            lambda: alice.xadd(keys.inbound_dead("alice"), {"dl.reason": "forged"}),
            lambda: alice.xdel(stream, "0-1"),
            lambda: alice.xtrim(stream, maxlen=0),
            lambda: alice.delete(stream),
            lambda: alice.delete(keys.inbound_dead("alice")),
            lambda: alice.xgroup_setid(stream, INGEST_GROUP, "$"),
            lambda: alice.xack(stream, INGEST_GROUP, "0-1"),
            lambda: alice.xreadgroup(INGEST_GROUP, "rogue", {stream: ">"}),
            lambda: alice.xrange(keys.replies("bob")),
            lambda: alice.xadd(keys.replies("bob"), fields),
            lambda: alice.xrange(keys.replies("alice")),  # the agent is not its receiver
            lambda: alice.xreadgroup("ba-receiver", "x", {keys.replies("alice"): ">"}),
            lambda: alice.xack(keys.replies("alice"), "ba-receiver", "0-1"),
            lambda: alice.xadd(keys.replies("alice"), fields),  # read-only in the selector
            lambda: alice.hset(keys.reply_result("alice", "a1"), "v", "2"),
            lambda: alice.delete(keys.reply_result("alice", "a1")),
            lambda: alice.hgetall(keys.reply_result("bob", "b1")),
            lambda: alice.xread({keys.replies("bob"): "0-0"}),
        ]
        for fn in agent_forbidden:
            refused(fn)
        rcv = as_user(acl_server, "alice-receiver")
        receiver_forbidden: list[Callable[[], object]] = [
            lambda: rcv.xadd(keys.inbound("alice"), fields),
            lambda: rcv.xadd(keys.inbound(), fields),
            lambda: rcv.rpush(keys.submit("alice"), item),
            lambda: rcv.rpush(keys.submit(), item),
            lambda: rcv.xadd(keys.replies("alice"), {"v": "1"}),  # no forging its own replies
            lambda: rcv.xrange(keys.replies("bob")),
            lambda: rcv.xreadgroup("ba-receiver", "x", {keys.replies("bob"): ">"}),
            lambda: rcv.xadd(keys.replies_dead("bob"), {"v": "1"}),
            lambda: rcv.get(keys.reply_record("alice", "r-x")),
            lambda: rcv.xgroup_setid(keys.replies("alice"), "ba-receiver", "$"),
        ]
        for fn in receiver_forbidden:
            refused(fn)
        rcv.close()
        assert run.poll() is None
    finally:
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
        agent_db.close()
        alice.close()
        bob.close()
    assert run.returncode == 0, out
    assert "NOPERM" not in out, out
    assert "no permissions" not in out, out


@pytest.mark.parametrize("info_rule", ["+info", "-info"])
def test_dispatcher_says_once_when_its_user_may_not_run_info(
    acl_server: AclRedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, info_rule: str
) -> None:
    """The documented adapter user has ``+info``; without it restarts go unseen, and the
    dispatcher says so once (not at every look), with the rule that gives it back."""
    with acl_server.client() as ops:
        ops.execute_command("ACL", "SETUSER", "adapter", info_rule)
    db = open_database(tmp_path / "adapter.db")
    client = as_user(acl_server, "adapter")
    dispatcher = Dispatcher(
        DispatcherConfig(prefix=DOC_PREFIX, owner="d1"),
        client,
        OutboxStore(db),
        keyring=Keyring(KEYRING),
    )
    caplog.set_level(logging.WARNING, logger="broker_adapter.stages.dispatcher")
    try:
        watches = [dispatcher.watch() for _ in range(3)]
    finally:
        client.close()
        db.close()
    warned = [r.getMessage() for r in caplog.records if "refused INFO" in r.getMessage()]
    if info_rule == "+info":
        assert warned == []
        assert all(w.run_id for w in watches)  # restarts are seen by the server's run_id
        return
    (message,) = warned
    assert "no permissions to run the 'info' command" in message
    assert "restarts go unnoticed" in message
    assert "+info" in message
    assert "docs/PROTOCOL.md section 9" in message
    assert [w.run_id for w in watches] == ["", "", ""]
    assert len({w.epoch for w in watches}) == 1  # the epoch key is still watched


def test_documented_adapter_user_can_trim_its_streams(acl_server: AclRedisServer) -> None:
    """The trims' script and calls (``trimming``) pass the documented adapter ACL."""
    from broker_adapter.clock import SystemClock
    from broker_adapter.redis.trimming import now_ms, trim_by_age, trim_stream

    keys = Keys(DOC_PREFIX)
    ops = acl_server.client()
    inbound, replies = keys.inbound("alice"), keys.replies("alice")
    for stream in (inbound, replies, keys.inbound_dead("alice"), keys.replies_dead("alice")):
        ops.xadd(stream, {"reply_id": "r1"}, id="1000-0")
        ops.xadd(stream, {"reply_id": "r2"}, id="2000-0")
    ops.xgroup_create(inbound, "ba-ingest", id="0")
    ops.xreadgroup("ba-ingest", "c", {inbound: ">"}, count=2)
    ops.xack(inbound, "ba-ingest", "1000-0")
    adapter = as_user(acl_server, "adapter")
    now = now_ms(adapter, SystemClock())
    assert trim_stream(adapter, inbound, keep_from_ms=now).trimmed == 1
    assert len(trim_stream(adapter, replies, keep_from_ms=now, expire_before_ms=now).expired) == 2
    assert trim_by_age(adapter, keys.inbound_dead("alice"), now) == 2
    assert trim_by_age(adapter, keys.replies_dead("alice"), now) == 2


def test_documented_receiver_cannot_run_code_of_its_own_yet_dead_letters(
    acl_server: AclRedisServer, tmp_path: Path
) -> None:
    """A receiver user that could load a script could load one that writes and loops: every
    client gets BUSY until a Redis restart. The documented one can call the one function of
    the library (its dead letter) and load or run nothing."""
    keys = Keys(DOC_PREFIX)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "functions",
            "load",
            "--redis",
            acl_server.url_for("adapter"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "audit: functions load by os user" in res.stderr
    rcv: Any = as_user(acl_server, "alice-receiver")
    busy = "redis.call('SET', KEYS[1], 1) while true do end"
    stream = keys.replies("alice")
    library = f"#!lua name=evil\nredis.register_function('evil', function(k, a) {busy} end)"
    for fn in [
        lambda: rcv.script_load(busy),
        lambda: rcv.eval(busy, 1, keys.replies_dead("alice")),
        lambda: rcv.evalsha("0" * 40, 1, keys.replies_dead("alice")),
        lambda: rcv.execute_command("FUNCTION", "LOAD", library),
        lambda: rcv.execute_command("FUNCTION", "FLUSH"),
        lambda: rcv.execute_command("FCALL", "other", 1, keys.replies_dead("alice")),
    ]:
        refused(fn)
    ops: Any = acl_server.client()
    assert ops.ping()  # nothing ran: the server answers everyone
    ops.xadd(stream, {"v": "1", "junk": "x" * 20_000})  # not a reply: dead-lettered
    db = open_database(tmp_path / "alice.db")
    try:
        receiver = make_receiver(acl_server, "alice", db)
        deadline = time.monotonic() + 30
        while not ops.xlen(keys.replies_dead("alice")):
            assert time.monotonic() < deadline, "the receiver never dead-lettered the entry"
            receiver.step()
    finally:
        db.close()
        rcv.close()
    ((_, dead),) = ops.xrange(keys.replies_dead("alice"))
    assert dead[b"dl.reason"]
    assert b"dl.truncated" in dead  # an entry nobody authenticated: a bounded prefix
    assert pending_total(ops, stream, "ba-receiver") == 0

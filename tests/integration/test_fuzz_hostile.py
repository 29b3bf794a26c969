"""Fuzz: random field lists and random envelope bytes XADDed to a real server while
legitimate requests flow through a running ``broker-adapter run``, and random entries on a
reply stream between legitimate replies read by a ``Receiver``.

Whatever the hostile entries hold, the adapter keeps running, every legitimate request gets
exactly one reply on its reply stream, every legitimate reply is applied, and every hostile
entry ends as exactly one dead letter (``dl.entry_id`` names it). ``BA_FUZZ_EXAMPLES`` sets
the number of examples (25 by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_adapter.clock import FakeClock
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring, signature
from broker_adapter.redis.client import text
from broker_adapter.stages.receiver.receiver import Receiver
from broker_adapter.store import open_database
from tests.support.redis_server import RedisServer, require_binary
from tests.support.replies_script import drain, receiver_for, reply_keyring

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "fz"
ALICE_KID = "alice-1"
ALICE_SECRET = "alice: a secret of well over thirty-two bytes"
KEYRING = {"alice": {ALICE_KID: ALICE_SECRET}}
WAIT_S = 60.0


class _Rig:
    """One redis-server and one ``broker-adapter run`` for the whole module."""

    def __init__(self, tmp: Path) -> None:
        require_binary()
        self.server = RedisServer(tmp / "redis")
        self.server.start()
        self.client: Any = self.server.client()
        self.keys = Keys(PREFIX)
        self.keyring = Keyring(KEYRING)
        keyring_path = tmp / "keyring.json"
        keyring_path.write_text(json.dumps(KEYRING))
        keyring_path.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BA_")}
        self.log = (tmp / "run.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker_adapter",
                "run",
                "--redis",
                self.server.url,
                "--db",
                str(tmp / "adapter.db"),
                "--handler",
                "broker_adapter.examples:echo",
                "--workers",
                "1",
                "--keyring",
                str(keyring_path),
                "--prefix",
                PREFIX,
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.seq = 0
        self.replies_seen = 0
        self.dead_seen = 0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.log.close()
            self.client.close()
            self.server.stop()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def legit(self) -> str:
        self.seq += 1
        envelope = Envelope.build(
            message_id=f"legit-{self.seq}",
            sender="alice",
            payload={"n": self.seq},
            deadline=time.time() + 600,
        )
        self.client.xadd(self.keys.inbound(), self.keyring.sign(envelope))
        return envelope.message_id

    def hostile(self, pairs: list[tuple[bytes, bytes]]) -> str:
        args: list[bytes | str] = ["XADD", self.keys.inbound(), "*"]
        for name, value in pairs:
            args += [name, value]
        entry_id = self.client.execute_command(*args)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def replies_for(self, message_id: str) -> int:
        count = 0
        for _eid, fields in self.client.xrange(self.keys.replies("alice")):
            body = json.loads(fields[b"body"])
            count += body.get("message_id") == message_id
        return count

    def dead_letters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _eid, fields in self.client.xrange(self.keys.inbound_dead()):
            eid = fields.get(b"dl.entry_id", b"").decode()
            out[eid] = out.get(eid, 0) + 1
        return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Rig]:
    rig = _Rig(tmp_path_factory.mktemp("fuzz"))
    yield rig
    rig.close()


names = st.one_of(
    st.sampled_from([b"v", b"env", b"kid", b"sig"]),
    st.binary(min_size=1, max_size=12),
    st.text(max_size=8).map(lambda s: s.encode("utf-8", "surrogatepass")),
)
values = st.one_of(st.binary(max_size=64), st.sampled_from([b"1", b"", b"alice-1"]))
field_lists = st.lists(st.tuples(names, values), min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _signed(env: bytes) -> list[tuple[bytes, bytes]]:
    sig = signature(ALICE_SECRET.encode(), ALICE_KID, env).encode()
    return [(b"v", b"1"), (b"env", env), (b"kid", ALICE_KID.encode()), (b"sig", sig)]


def _envelope_bytes(value: Any) -> bytes:
    text = json.dumps(value, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


hostile_entries = st.one_of(
    field_lists,
    st.binary(max_size=256).map(_signed),  # signed garbage: exercises the envelope parser
    json_values.map(_envelope_bytes).map(_signed),
    st.fixed_dictionaries(
        {
            "message_id": st.text(max_size=6),
            "sender": st.just("alice"),
            "payload": json_values,
            "deadline": st.floats() | st.integers(),
        }
    ).map(lambda d: _signed(_envelope_bytes({**d, "\ud800": 1}))),  # a lone-surrogate member
    st.integers(min_value=100, max_value=5000).map(
        lambda n: [(f"f{i}".encode(), b"x") for i in range(n)]
    ),
)


@settings(
    max_examples=int(os.environ.get("BA_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(hostile_entries, min_size=1, max_size=6))
def test_hostile_entries_never_stop_the_adapter(
    rig: _Rig, batch: list[list[tuple[bytes, bytes]]]
) -> None:
    before = rig.legit()
    hostile_ids = [rig.hostile(pairs) for pairs in batch]
    after = rig.legit()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert rig.alive(), "broker-adapter run exited on a hostile entry"
        dead = rig.dead_letters()
        if (
            all(eid in dead for eid in hostile_ids)
            and rig.replies_for(before) == 1
            and rig.replies_for(after) == 1
        ):
            break
        time.sleep(0.05)  # polling a condition with an explicit timeout
    dead = rig.dead_letters()
    assert [dead.get(eid, 0) for eid in hostile_ids] == [1] * len(hostile_ids)
    assert (rig.replies_for(before), rig.replies_for(after)) == (1, 1)
    assert rig.alive()


@pytest.mark.parametrize(
    "shape", ["entry_64mb", "flushall", "del_inbound", "del_replies", "del_epoch"]
)
def test_huge_entries_wipes_and_deleted_keys_never_stop_the_adapter(rig: _Rig, shape: str) -> None:
    """The hostile shapes that are not entries of a batch: a 64 MB entry (screened inside
    Redis), FLUSHALL and DEL of the streams under the blocking reads, DEL of the epoch key.
    The adapter keeps running, and a request published after each is answered once."""
    before = rig.legit()
    _wait(rig, lambda: rig.replies_for(before) == 1, "the reply before")
    huge = None
    if shape == "entry_64mb":
        huge = rig.hostile([(b"v", b"1"), (b"env", b"x" * (64 * 1024 * 1024))])
    elif shape == "flushall":
        rig.client.flushall()
    elif shape == "del_epoch":
        rig.client.delete(rig.keys.epoch())
    else:
        key = rig.keys.inbound() if shape == "del_inbound" else rig.keys.replies("alice")
        rig.client.delete(key)
    after = rig.legit()
    _wait(rig, lambda: rig.replies_for(after) == 1, "the reply after")
    if huge is not None:
        assert rig.dead_letters().get(huge) == 1
    if shape == "del_epoch":  # not a wipe: nothing re-sent
        assert rig.replies_for(before) == 1
    assert rig.alive()


def _wait(rig: _Rig, pred: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert rig.alive(), f"broker-adapter run exited waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a condition with an explicit timeout


# -- the reply side ----------------------------------------------------------------------------

reply_names = st.one_of(
    st.sampled_from([b"v", b"reply_id", b"hash", b"body", b"kid", b"sig"]), names
)
reply_field_lists = st.lists(st.tuples(reply_names, values), min_size=1, max_size=14)


def _signed_reply(reply_id: str, body: bytes) -> list[tuple[bytes, bytes]]:
    signed = reply_keyring().sign_reply("alice", reply_id, body)
    return [
        (b"v", b"2"),
        (b"reply_id", reply_id.encode()),
        (b"hash", sha256_hex(body).encode()),
        (b"body", body),
        (b"kid", signed.kid.encode()),
        (b"sig", signed.sig.encode()),
    ]


def _hostile_body(value: Any) -> list[tuple[bytes, bytes]]:
    """A correctly signed reply whose body is anything at all (only the adapter's key could
    sign it, so this stands for a bug on the adapter's side, not an outsider)."""
    return _signed_reply("r-fuzz", _envelope_bytes(value))


hostile_replies = st.one_of(
    reply_field_lists,
    json_values.map(_hostile_body),
    st.binary(max_size=128).map(lambda b: _signed_reply("r-fuzz-bin", b)),
    st.integers(min_value=100, max_value=5000).map(
        lambda n: [(f"f{i}".encode(), b"x") for i in range(n)]
    ),
)


@pytest.fixture
def reply_rig(
    redis_server: RedisServer, tmp_path: Path, prefix: str, clock: FakeClock
) -> Iterator[tuple[Any, Receiver, Keys]]:
    client: Any = redis_server.client()
    receiver = receiver_for(
        redis_server.url, open_database(tmp_path / "rx.db"), clock, prefix, "alice", "fz-1"
    )
    yield client, receiver, Keys(prefix)
    client.close()


@settings(
    max_examples=int(os.environ.get("BA_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(hostile_replies, min_size=1, max_size=6))
def test_hostile_reply_entries_never_stop_the_receiver(
    reply_rig: tuple[Any, Receiver, Keys], batch: list[list[tuple[bytes, bytes]]]
) -> None:
    client, receiver, keys = reply_rig
    stream = keys.replies("alice")
    legit_ids = [f"r-legit-{uuid.uuid4().hex}" for _ in range(2)]
    body = {
        "principal": "alice",
        "status": "done",
        "result": {"ok": True},
        "finished_at": receiver.clock.now(),
    }
    ids = [
        _xadd(
            client,
            stream,
            _signed_reply(legit_ids[0], canonical_json({**body, "reply_id": legit_ids[0]})),
        )
    ]
    hostile_ids = [_xadd(client, stream, pairs) for pairs in batch]
    ids.append(
        _xadd(
            client,
            stream,
            _signed_reply(legit_ids[1], canonical_json({**body, "reply_id": legit_ids[1]})),
        )
    )
    drain(receiver)  # raises if a step fails
    applied = {r.reply_id for r in receiver.receipts.list()}
    assert set(legit_ids) <= applied
    dead: dict[str, int] = {}
    for _eid, fields in client.xrange(keys.replies_dead("alice")):
        eid = fields.get(b"dl.entry_id", b"").decode()
        dead[eid] = dead.get(eid, 0) + 1
    # no hostile entry can be a reply: its body never names its reply id and principal
    assert [dead.get(eid, 0) for eid in hostile_ids] == [1] * len(hostile_ids)
    assert [dead.get(eid, 0) for eid in ids] == [0, 0]
    assert receiver.reader.pending() == {}


def _xadd(client: Any, stream: str, pairs: list[tuple[bytes, bytes]]) -> str:
    args: list[bytes | str] = ["XADD", stream, "*"]
    for name, value in pairs:
        args += [name, value]
    entry_id = client.execute_command(*args)
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


# -- ids a writer chose (runs last: it poisons the module's stream, then repairs it) --------


def test_max_and_future_ids_are_survived_and_the_stream_repaired(rig: _Rig) -> None:
    """An entry at an id in the future and one at the largest id, as any user with
    ``+xadd`` can add them: the adapter keeps running, the largest id stops every later
    ``XADD *`` until ``broker-adapter streams repair``, and then requests flow again."""
    stream = rig.keys.inbound()
    seconds, micros = rig.client.time()
    future = f"{seconds * 1000 + micros // 1000 + 10**9}-0"  # ~11.6 days ahead
    rig.client.xadd(stream, dict(_signed(b"{}")), id=future)
    assert text(rig.client.xinfo_stream(stream)["last-generated-id"]) == future
    after_future = rig.legit()  # a * id after the future one: in the future too
    rig.client.xadd(stream, dict(_signed(b"[]")), id="18446744073709551615-18446744073709551615")
    with pytest.raises(redis.ResponseError, match="exhausted the last possible ID"):
        rig.legit()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "streams",
            "repair",
            "--redis",
            rig.server.url,
            "--prefix",
            PREFIX,
            "--stream",
            stream,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("BA_")},
    )
    assert res.returncode == 0, res.stderr
    after_repair = rig.legit()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert rig.alive(), "broker-adapter run exited on a chosen id"
        if rig.replies_for(after_future) == 1 and rig.replies_for(after_repair) == 1:
            break
        time.sleep(0.05)  # polling a condition with an explicit timeout
    assert (rig.replies_for(after_future), rig.replies_for(after_repair)) == (1, 1)
    assert rig.alive()

"""The harness's hostile entries against the real ingest and receiver on a real redis-server:
each shape ends in its dead-letter stream with the reason the checker expects, the final
read finds the harness's marker in it, and a receiver that skips the signature check (the
planted bug) applies a forgery, which the checker then counts as ``forged_reply_applied``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.protocol.canonical import sha256_hex
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect, text
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.receiver import receiver as receiver_module
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
from broker_adapter.store import ReceiptStore, TaskStore, open_database
from tests.chaos.checker import check
from tests.chaos.finalread import dead_letter, read_receiver, xrange_all
from tests.chaos.history import Event
from tests.chaos.hostile import (
    ENTRY_ID_SHAPES,
    FORGERY_SHAPES,
    INBOUND_SHAPES,
    REPLY_POISON_SHAPES,
    chosen_id,
    flat,
    forged_body,
    inbound_poison,
    reply_entry,
)
from tests.chaos.model import FinalState, HistoryModel
from tests.chaos.planted import accept_any_signature
from tests.chaos.receiver import LEDGER_SCHEMA, effect
from tests.support.ingest_script import drain
from tests.support.redis_server import RedisServer
from tests.support.replies_script import drain as drain_receiver

pytestmark = pytest.mark.chaos

KEYS = {
    "p1": {"p1-k1": "p1: a chaos test secret of more than 32 bytes"},
    "p2": {"p2-k1": "p2: a chaos test secret of more than 32 bytes"},
}


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Any]:
    c = connect(redis_server.url)
    yield c
    c.close()


def _dead_reasons(client: Any, stream: str) -> dict[str, str]:
    """Marker (``chaos_key`` or ``chaos_forged``) -> reason, over ``stream``'s dead letters."""
    out: dict[str, str] = {}
    for eid, fields in xrange_all(client, stream):
        dl = dead_letter(stream, eid, fields)
        mark = dl.chaos_key or dl.chaos_forged
        assert mark is not None, fields.get(b"dl.reason")
        out[mark] = dl.reason
    return out


def test_every_inbound_poison_shape_is_dead_lettered_with_its_reason(
    client: Any, prefix: str, tmp_path: Path
) -> None:
    keys = Keys(prefix)
    expected = {}
    for i, shape in enumerate(sorted(INBOUND_SHAPES)):
        key = f"p1:x{i:06d}"
        secret = KEYS["p1"]["p1-k1"]
        fields = inbound_poison(
            shape,
            key=key,
            principal="p1",
            ident=key[3:],
            kid="p1-k1",
            secret=secret,
            deadline_s=3600.0,
        )
        client.execute_command("XADD", keys.inbound(), "*", *flat(fields))
        expected[key] = INBOUND_SHAPES[shape][0]
    db = open_database(tmp_path / "adapter.db")
    try:
        tasks = TaskStore(db)  # the real clock: the deadlines are real
        config = IngestConfig(prefix=prefix, consumer="ingest-h-0", block_ms=20)
        drain(Ingestor(config, client, tasks, Keyring(KEYS)), client)
        with db.read() as c:
            assert c.execute("SELECT count(*) FROM tasks").fetchone()[0] == 0
    finally:
        db.close()
    assert _dead_reasons(client, keys.inbound_dead()) == expected


def test_poison_at_chosen_ids_is_dead_lettered_and_the_stream_repaired(
    client: Any, prefix: str, tmp_path: Path
) -> None:
    """Poison planted at a future id and at the largest id: each gets its shape's reason,
    the trim raises the alarm and goes on, and after ``repair_stream`` the stream takes
    ``XADD *`` again and the same ingest reads it."""
    from broker_adapter.redis.repair import repair_stream

    keys = Keys(prefix)
    stream = keys.inbound()
    secret = KEYS["p1"]["p1-k1"]
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    expected = {}
    for i, id_shape in enumerate(ENTRY_ID_SHAPES):
        key = f"p1:id{i:05d}"
        fields = inbound_poison(
            "dup_field",
            key=key,
            principal="p1",
            ident=key[3:],
            kid="p1-k1",
            secret=secret,
            deadline_s=3600.0,
        )
        client.execute_command("XADD", stream, chosen_id(id_shape, now_ms), *flat(fields))
        expected[key] = INBOUND_SHAPES["dup_field"][0]
    db = open_database(tmp_path / "adapter.db")
    try:
        config = IngestConfig(prefix=prefix, consumer="ingest-h-0", block_ms=20)
        ingestor = Ingestor(config, client, TaskStore(db), Keyring(KEYS))
        drain(ingestor, client)
        ingestor.trim()
        assert ingestor.stats.future_ids == 1  # the alarm
        assert _dead_reasons(client, keys.inbound_dead()) == expected
        with pytest.raises(Exception, match="exhausted the last possible ID"):
            client.xadd(stream, {"x": "1"})
        repair_stream(client, stream, server_ms=now_ms)
        key = "p1:id-after"
        fields = inbound_poison(
            "dup_field",
            key=key,
            principal="p1",
            ident="id-after",
            kid="p1-k1",
            secret=secret,
            deadline_s=3600.0,
        )
        client.execute_command("XADD", stream, "*", *flat(fields))
        drain(ingestor, client)
    finally:
        db.close()
    assert _dead_reasons(client, keys.inbound_dead()) == expected | {key: "duplicate_field"}


def _receiver(client: Any, prefix: str, path: Path) -> tuple[Receiver, Any]:
    db = open_database(path)
    db.conn.execute(LEDGER_SCHEMA)
    config = ReceiverConfig(prefix=prefix, principal="p1", consumer="recv-h", block_ms=20)
    return Receiver(config, client, ReceiptStore(db), effect, keyring=Keyring(KEYS)), db


def _plant_replies(client: Any, prefix: str) -> tuple[dict[str, str], list[Event]]:
    """One entry of every forged and poisoned shape on p1's reply stream; returns the
    expected reason per mark and the ``forge`` history events the nemesis would log."""
    expected: dict[str, str] = {}
    events: list[Event] = []
    shapes = {**FORGERY_SHAPES, **REPLY_POISON_SHAPES}
    for n, shape in enumerate(sorted(shapes)):
        mark, task_id = f"1.{n}", f"{n:032x}"
        reply_id = reply_id_for(task_id)
        body = forged_body(
            mark,
            "p1",
            reply_id,
            task_id,
            "m-forged",
            deep=shape == "deep_body",
            stale=shape == "stale_body",
        )
        pairs = reply_entry(
            shape, mark=mark, principal="p1", reply_id=reply_id, body=body, keyring=KEYS, other="p2"
        )
        entry_id = client.execute_command("XADD", Keys(prefix).replies("p1"), "*", *flat(pairs))
        expected[mark] = shapes[shape][0]
        value = {
            "mark": mark,
            "principal": "p1",
            "shape": shape,
            "reply_id": reply_id,
            "target": "invented",
            "hash": sha256_hex(body),
            "reasons": [expected[mark]],
        }
        events += [
            {
                "t": 1.0 + n,
                "wall": 1.0,
                "proc": "nemesis",
                "type": "invoke",
                "f": "forge",
                "value": value,
            },
            {
                "t": 1.5 + n,
                "wall": 1.0,
                "proc": "nemesis",
                "type": "ok",
                "f": "forge",
                "value": {"mark": mark, "entry_id": text(entry_id)},
            },
        ]
    return expected, events


def _received(
    client: Any, prefix: str, path: Path
) -> tuple[dict[str, str], list[Event], FinalState]:
    """Plant every reply shape, let a receiver drain them; the expected reasons, the
    history events and the final state of the receiver and its dead-letter stream."""
    expected, events = _plant_replies(client, prefix)
    receiver, db = _receiver(client, prefix, path)
    try:
        drain_receiver(receiver)
    finally:
        db.close()
    final = FinalState()
    read_receiver("p1", path, final)
    dead = Keys(prefix).replies_dead("p1")
    final.reply_dead_letters = [dead_letter(dead, e, f) for e, f in xrange_all(client, dead)]
    return expected, events, final


def test_every_forged_and_poisoned_reply_is_dead_lettered_and_never_applied(
    client: Any, prefix: str, tmp_path: Path
) -> None:
    expected, events, final = _received(client, prefix, tmp_path / "receiver.db")
    assert _dead_reasons(client, Keys(prefix).replies_dead("p1")) == expected
    assert final.receipts == []
    assert final.forged_effects == {}
    result = check(HistoryModel.from_events(events), final)
    assert result.valid, result.violations
    assert result.info["hostile"]["forgeries_dead_lettered"] == len(expected)


def test_a_receiver_that_skips_the_signature_check_fails_the_checker(
    client: Any, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receiver_module, "check_signature", accept_any_signature)
    _, events, final = _received(client, prefix, tmp_path / "receiver.db")
    applied = {r.forged for r in final.receipts}
    assert applied  # the well-formed v2 forgeries went through
    assert None not in applied
    result = check(HistoryModel.from_events(events), final)
    assert result.counts["forged_reply_applied"] == len(applied)
    assert result.counts["forgery_not_dead_lettered"] == len(applied)

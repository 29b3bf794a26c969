"""The binding of a prefix to one store and the consumer name claims (``app.binding``),
on the session's real redis-server."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from broker_adapter.app.binding import (
    MAX_SLOTS,
    Binding,
    BindingRefused,
    PrefixGuard,
    bind,
    claim_name,
    default_name,
    host_key,
    left_behind,
    machine_key,
    refuse_sqlite_copies,
)
from broker_adapter.protocol.keys import Keys
from broker_adapter.store import open_database
from broker_adapter.store.identity import StoreIdentity, store_identity
from broker_adapter.store.migrations import SCHEMA_VERSION


def identity(store_id: str, remembered: int = 0) -> StoreIdentity:
    return StoreIdentity(store_id, "sqlite", f"test:/{store_id}.db", remembered, None)


A, B = identity("a" * 32), identity("b" * 32)


def test_a_store_identity_is_made_once_and_differs_between_databases(tmp_path: Path) -> None:
    first = open_database(tmp_path / "one.db")
    first_id = store_identity(first).store_id
    first.close()
    again = open_database(tmp_path / "one.db")
    assert store_identity(again).store_id == first_id  # kept across opens
    assert again.fetch_one("PRAGMA user_version")[0] == SCHEMA_VERSION  # type: ignore[index]
    again.close()
    other = open_database(tmp_path / "two.db")
    assert store_identity(other).store_id != first_id
    assert len(first_id) == 32
    other.close()


def test_the_first_store_binds_and_another_is_refused_in_one_line(
    redis_client: redis.Redis, prefix: str
) -> None:
    key = Keys(prefix).store_binding()
    bound = bind(redis_client, key, A, what=f"prefix {prefix!r}")
    assert bound.store == A.store_id
    assert bind(redis_client, key, A, what="x").bound_at == bound.bound_at  # kept as it was
    with pytest.raises(BindingRefused) as refused:
        bind(redis_client, key, B, what=f"prefix {prefix!r}")
    message = str(refused.value)
    assert "\n" not in message
    assert f"prefix {prefix!r} is bound to store aaaaaaaa (sqlite at test:/" in message
    assert "not to this store bbbbbbbb" in message
    assert redis_client.ttl(key) == -1  # never lapses
    assert Binding.loads(redis_client.get(key).decode()).store == A.store_id  # type: ignore[union-attr]


def test_a_value_that_is_not_a_binding_is_refused_not_overwritten(
    redis_client: redis.Redis, prefix: str
) -> None:
    key = Keys(prefix).store_binding()
    redis_client.set(key, "not json")
    with pytest.raises(BindingRefused, match="unreadable value"):
        bind(redis_client, key, A, what="p")
    assert redis_client.get(key) == b"not json"


def test_a_store_that_remembers_ids_and_finds_no_binding_says_so(
    redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="broker_adapter.app.binding")
    bind(redis_client, Keys(prefix).store_binding(), identity("c" * 32, remembered=7), what="p")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "lost its data" in record.getMessage()
    assert "7 message ids" in record.getMessage()


def test_default_names_are_logical_ids_per_store_and_host() -> None:
    import socket

    name = default_name(A.store_id, 0)
    assert name.startswith("aaaaaaaa-")
    assert name.endswith("-0")
    assert socket.gethostname() not in name
    assert default_name(B.store_id, 0) != name
    assert default_name(A.store_id, 1) != name


def test_default_names_take_the_first_free_slot_up_to_the_last(
    redis_client: redis.Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    for slot in range(MAX_SLOTS - 1):  # every slot but the last held by live processes
        value = json.dumps({"pid": 1, "host": "elsewhere", "store": A.store_id})
        redis_client.set(keys.consumer_claim(default_name(A.store_id, slot)), value, px=60_000)
    claim = claim_name(redis_client, keys, A, None)
    assert claim.name == default_name(A.store_id, MAX_SLOTS - 1)
    with pytest.raises(BindingRefused, match=f"all {MAX_SLOTS} default consumer names"):
        claim_name(redis_client, keys, A, None)


def test_a_claim_of_this_host_is_left_behind_only_when_its_process_is_gone() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = os.getppid()

    def value(pid: int, host: str | None = None) -> str:
        return json.dumps({"pid": pid, "host": host or host_key()})

    assert left_behind(value(gone.pid))
    assert left_behind(value(os.getpid()))  # an earlier process with this PID (PID 1)
    assert not left_behind(value(alive))
    assert not left_behind(value(gone.pid, host="another host"))
    assert not left_behind("not json")


def test_an_explicit_name_held_elsewhere_is_refused_and_free_again_once_released(
    redis_client: redis.Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    first = claim_name(redis_client, keys, A, "w1")
    with pytest.raises(BindingRefused, match=r"consumer name 'w1' on prefix .* held by a live"):
        claim_name(redis_client, keys, B, "w1")
    redis_client.set(first.key, json.dumps({"pid": 1, "host": "elsewhere"}), px=60_000)
    with pytest.raises(BindingRefused, match="held by a live process"):
        claim_name(redis_client, keys, A, "w1")
    redis_client.delete(first.key)  # as when its TTL ran out
    assert claim_name(redis_client, keys, B, "w1").name == "w1"


def test_the_guard_renews_retakes_and_stops_on_another_store_or_holder(
    redis_client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(prefix)
    bind(redis_client, keys.store_binding(), A, what="p")
    claim = claim_name(redis_client, keys, A, "g1", ttl_s=30)
    guard = PrefixGuard(redis_client, keys, A, claim, ttl_s=30)
    redis_client.pexpire(claim.key, 1000)
    guard.check()
    assert redis_client.pttl(claim.key) > 1000  # renewed
    # Redis lost both (a wipe): the guard takes them again and says so
    redis_client.delete(claim.key, keys.store_binding())
    caplog.set_level(logging.WARNING, logger="broker_adapter.app.binding")
    guard.check()
    assert redis_client.get(claim.key) == claim.value.encode()
    assert Binding.loads(redis_client.get(keys.store_binding()).decode()).store == A.store_id  # type: ignore[union-attr]
    assert any("Redis lost the binding" in r.getMessage() for r in caplog.records)
    # another store took the prefix (a rebind): stop
    redis_client.set(keys.store_binding(), Binding.of(B, "rebind by x", 0.0).dumps())
    with pytest.raises(BindingRefused, match=r"was bound to store bbbbbbbb .* while this adapter"):
        guard.check()
    # another process holds the name now: stop
    redis_client.set(keys.store_binding(), Binding.of(A, "run", 0.0).dumps())
    redis_client.set(claim.key, json.dumps({"pid": 1, "token": "other"}))
    with pytest.raises(BindingRefused, match="was taken by another process"):
        guard.check()
    guard.release()  # not ours any more: left alone
    assert redis_client.exists(claim.key) == 1


def test_a_sqlite_store_served_from_another_machine_is_a_copy_and_refused(
    redis_client: redis.Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    assert machine_key()  # Linux: the kernel's boot id
    refuse_sqlite_copies(redis_client, keys, A)  # nobody serves it: fine
    this_machine = {"pid": 1, "store": A.store_id, "machine": machine_key()}
    redis_client.set(keys.consumer_claim("here"), json.dumps(this_machine), px=60_000)
    refuse_sqlite_copies(redis_client, keys, A)  # another process of this machine: fine
    elsewhere = {**this_machine, "machine": "another machine"}
    redis_client.set(keys.consumer_claim("there"), json.dumps(elsewhere), px=60_000)
    with pytest.raises(BindingRefused, match=r"from another machine .consumer name 'there'"):
        refuse_sqlite_copies(redis_client, keys, A)
    shared = StoreIdentity(A.store_id, "postgresql", "postgresql://db/ba", 0, None)
    refuse_sqlite_copies(redis_client, keys, shared)  # one database for every host: fine
    refuse_sqlite_copies(redis_client, keys, B)  # another store's claims are not its own

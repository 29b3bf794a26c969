"""Redis Cluster: every Lua script's keys hash to one slot, partitions are stable, and the
routed exchange finds each command's slot (docs/PROTOCOL.md "Partitions")."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from redis.crc import key_slot

from broker_adapter.errors import BrokerAdapterError, ConfigError
from broker_adapter.protocol.keys import MAX_PARTITIONS, Keys, partition_of
from broker_adapter.redis import cluster
from broker_adapter.redis.client import check_redis_url
from broker_adapter.redis.functions import LIBRARY
from broker_adapter.redis.results import PURGE_SCRIPT
from broker_adapter.redis.trimming import TRIM_SCRIPT
from broker_adapter.stages.shared.publish import PUBLISH_SCRIPT

PRINCIPALS = ["alice", "agent-7", "a.b_c-d", "Z" * 64]
PREFIXES = ["ba", "other", "x:y"]


def _slot(key: str) -> int:
    return key_slot(key.encode("utf-8"))


def _keys_used(script: str) -> int:
    """How many KEYS the script reads (its highest ``KEYS[n]``)."""
    return max(int(n) for n in re.findall(r"(?:KEYS|keys)\[(\d+)\]", script))


def _inbound_streams(keys: Keys) -> list[str]:
    return [
        keys.inbound(),
        *(keys.inbound(p) for p in PRINCIPALS),
        *keys.inbound_partitions(64),
        keys.inbound_partition(MAX_PARTITIONS - 1),
    ]


def _all_streams(keys: Keys) -> list[str]:
    return [*_inbound_streams(keys), *(keys.replies(p) for p in PRINCIPALS)]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_each_scripts_keys_hash_to_one_slot(prefix: str) -> None:
    keys = Keys(prefix)
    streams = _all_streams(keys)
    # (script, the key lists its callers pass): GroupReader._move / dead_letter_many,
    # Dispatcher's publish calls, trimming's trim_stream.
    cases = [
        (LIBRARY, [[s, keys.dead_for(s)] for s in streams]),  # ba_dead_letter, by FCALL
        # a terminal reply's call names its result record and index too (a conflict
        # answer's only the first two, the same slot)
        (
            PUBLISH_SCRIPT,
            [
                [
                    keys.reply_record(p, "r-1"),
                    keys.replies(p),
                    keys.reply_result(p, "m:1"),
                    keys.reply_results(p),
                ]
                for p in PRINCIPALS
            ],
        ),
        # the purge deletes records under its ARGV prefix: they share the index's tag
        (PURGE_SCRIPT, [[keys.reply_results(p)] for p in PRINCIPALS]),
        (TRIM_SCRIPT, [[s] for s in streams] + [[keys.dead_for(s)] for s in streams]),
    ]
    for p in PRINCIPALS:
        assert _slot(keys.reply_result(p, "any id")) == _slot(keys.reply_results(p))
    for script, key_lists in cases:
        for key_list in key_lists:
            assert len(key_list) == _keys_used(script)
            assert len({_slot(k) for k in key_list}) == 1, key_list
            for call in ("EVALSHA", "FCALL"):
                command = (call, "sha-or-name", len(key_list), *key_list, "arg")
                assert cluster.command_slot(command) == _slot(key_list[0])


def test_a_streams_dead_letters_share_its_tag_and_the_named_dead_keys_agree() -> None:
    keys = Keys()
    for p in PRINCIPALS:
        assert keys.dead_for(keys.inbound(p)) == keys.inbound_dead(p)
        assert keys.dead_for(keys.replies(p)) == keys.replies_dead(p)
    assert keys.dead_for(keys.inbound()) == keys.inbound_dead()


def test_partition_zero_is_the_unpartitioned_stream_and_partitions_are_distinct() -> None:
    keys = Keys()
    assert keys.inbound_partitions(1) == [keys.inbound()]
    streams = keys.inbound_partitions(16)
    assert streams[0] == keys.inbound()
    assert len(set(streams)) == 16
    assert len({_slot(s) for s in streams}) > 1  # partitions can live on different masters
    # No partition's key can be an ACL principal's own stream ('#' is not a principal char).
    assert not set(streams[1:]) & {keys.inbound(p) for p in PRINCIPALS}


def test_partition_of_follows_the_documented_hash() -> None:
    # The test vectors of docs/PROTOCOL.md "Partitions".
    assert hashlib.sha256(b"alice").hexdigest()[:16] == "2bd806c97f0e00af"
    assert partition_of("alice", 4) == 0x2BD806C97F0E00AF % 4 == 3
    assert partition_of("agent-7", 16) == 0xCFAD431AF89DD48C % 16 == 12
    assert partition_of("bob", 1000) == 0x81B637D8FCD2C6DA % 1000 == 650
    assert Keys("ba").inbound_partition(partition_of("alice", 4)) == "ba:{in#3}:tasks"
    assert all(partition_of(p, 1) == 0 for p in PRINCIPALS)


@pytest.mark.parametrize("bad", [0, -1, MAX_PARTITIONS + 1])
def test_partition_counts_out_of_range_are_refused(bad: int) -> None:
    with pytest.raises(ConfigError):
        partition_of("alice", bad)
    with pytest.raises(ConfigError):
        Keys().inbound_partitions(bad)


def test_command_slot_finds_the_keys_of_the_hot_path_commands() -> None:
    stream = Keys().inbound()
    slot = _slot(stream)
    read = ("XREADGROUP", "GROUP", "g", "c", "COUNT", 10, "BLOCK", 5, "STREAMS", stream, ">")
    assert cluster.command_slot(read) == slot
    assert cluster.command_slot(("XACK", stream, "g", "1-0", "2-0")) == slot
    assert cluster.command_slot(("XAUTOCLAIM", stream, "g", "c", 10, "0-0")) == slot
    assert cluster.command_slot(("INFO", "server")) is None
    assert cluster.command_slot(("EVALSHA", "sha", 0, "arg")) is None
    across = ("EVALSHA", "sha", 2, stream, Keys().replies("alice"))
    with pytest.raises(BrokerAdapterError, match="span slots"):
        cluster.command_slot(across)


def test_cluster_urls_are_accepted_and_name_their_seed_node() -> None:
    assert check_redis_url("redis+cluster://127.0.0.1:7000") == "redis+cluster://127.0.0.1:7000"
    assert check_redis_url("rediss+cluster://u:p@h:7000")
    assert cluster.node_url("redis+cluster://h:7000") == "redis://h:7000"
    assert cluster.node_url("rediss+cluster://h:7000") == "rediss://h:7000"
    with pytest.raises(ConfigError):
        check_redis_url("redis+cluster://h:notaport")
    with pytest.raises(ConfigError):
        check_redis_url("cluster://h:7000")


def test_the_partition_vectors_of_the_protocol_document_hold() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text("utf-8")
    section = doc.split("### Partitions", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| `([\w.-]+)` \| `([0-9a-f]{16})` \| (\d+) \| (\d+) \| `(\S+)` \|$", section, re.M
    )
    assert len(rows) >= 3
    for principal, head, partitions, partition, stream in rows:
        assert hashlib.sha256(principal.encode()).hexdigest()[:16] == head
        assert partition_of(principal, int(partitions)) == int(partition)
        assert Keys("ba").inbound_partition(int(partition)) == stream

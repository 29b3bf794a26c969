"""Every Redis key, stream and group name broker_adapter uses. The key schema:

==============================  =====================================================
key                             what it holds
==============================  =====================================================
``{p}:{in}:tasks``              inbound task stream shared by all principals (signed mode);
                                with P partitions, partition 0
``{p}:{in#K}:tasks``            inbound partition K (1 <= K < P) of the shared stream
``{p}:{in#K}:dead``             dead letters of partition K
``{p}:{in.P}:tasks``            inbound task stream of principal P (ACL mode)
``{p}:{in}:dead``               dead letters of the shared inbound stream
``{p}:{in}:submit``             submit list of the shared inbound stream: what agents
                                publish (RPUSH); the adapter moves it into the stream
``{p}:{in#K}:submit``           submit list of partition K
``{p}:{in.P}:submit``           submit list of P's inbound stream (ACL mode)
``{p}:{in.P}:dead``             dead letters of P's inbound stream
``{p}:{out.P}:replies``         replies addressed to principal P
``{p}:{out.P}:dead``            replies P's receiver refused (content conflicts, poison)
``{p}:{out.P}:rid:<reply id>``  publication record: content hash and entry id (TTL 30 min)
``{p}:{out.P}:res:<message id>``  result record: the signed reply entry of P's request
                                ``message id`` (a hash; ``result_ttl_s``, docs/PROTOCOL.md
                                section 12)
``{p}:{out.P}:results``         index of P's result records (sorted set: message id by the
                                time its reply was published, ms), what the purge walks
``{p}:{meta}:epoch``            set once with NX; its absence means Redis lost its data
``{p}:{meta}:store``            the store the prefix is bound to (JSON; never expires)
``{p}:{meta}:consumer:<name>``  a live adapter's claim on its consumer name (short TTL,
                                renewed)
``{p}:{out.P}:receipts:<G>``    the receipt store P's receiver group G is bound to (JSON)
==============================  =====================================================

``{p}`` is the configurable prefix (default ``ba``). The part in braces is a Redis Cluster
hash tag: a stream, its dead-letter stream and its publication records share one, so the
Lua scripts that touch several of them stay within one slot, while different principals'
streams can live on different shards. In ACL mode each principal gets key patterns of its
own (``{p}:{in.P}:*``), which is what lets an ACL bind a principal to its stream.

What stays how long (``trimming``): inbound streams up to the oldest entry any group still
needs, reply streams likewise or until ``retention_s`` for what no group acknowledged, dead
letters ``retention_s``, records ``min(record_ttl_s, retention_s)``.

Partitions (signed mode, ``--partitions P``): the shared inbound stream may be spread
over P streams so that, on a Redis Cluster, ingest reads several masters. A publisher
writes to partition ``partition_of(principal, P)`` (docs/PROTOCOL.md "Partitions"); each
partition's stream and dead letters share its own hash tag. Partition 0 is the unpartitioned
stream itself, so ``P = 1`` is the single-stream layout, key for key.

Groups: ``ba-ingest`` reads inbound streams; a receiver's group on its reply stream is
``ba-receiver`` unless configured otherwise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

from broker_adapter.config import setting
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.envelope import check_principal

INGEST_GROUP = "ba-ingest"
RECEIVER_GROUP = "ba-receiver"
DEFAULT_PREFIX = "ba"
#: The most inbound partitions a deployment may use.
MAX_PARTITIONS = 1024


def partition_of(principal: str, partitions: int) -> int:
    """The inbound partition of ``principal`` among ``partitions``: the first 8 bytes of
    SHA-256 of its UTF-8 name, read as an unsigned big-endian integer, modulo
    ``partitions`` (stable across languages and releases: docs/PROTOCOL.md)."""
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigError(f"partitions must be 1..{MAX_PARTITIONS}, not {partitions}")
    digest = hashlib.sha256(check_principal(principal, "principal").encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % partitions


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{} \n\r\t"):
            raise ConfigError(f"bad key prefix {self.prefix!r}: no braces or white space")

    def _in_tag(self, principal: str | None) -> str:
        return "in" if principal is None else f"in.{check_principal(principal, 'principal')}"

    def inbound(self, principal: str | None = None) -> str:
        """The inbound task stream: shared (``None``) or one principal's own (ACL mode)."""
        return f"{self.prefix}:{{{self._in_tag(principal)}}}:tasks"

    def inbound_dead(self, principal: str | None = None) -> str:
        return f"{self.prefix}:{{{self._in_tag(principal)}}}:dead"

    def submit(self, principal: str | None = None) -> str:
        """The submit list of ``inbound(principal)``: agents RPUSH entries there and the
        adapter adds them to the stream with ``*`` (``redis.screening``)."""
        return f"{self.prefix}:{{{self._in_tag(principal)}}}:submit"

    def submit_partition(self, partition: int) -> str:
        """The submit list of inbound partition ``partition``."""
        return self.submit_for(self.inbound_partition(partition))

    def submit_for(self, stream: str) -> str:
        """The submit list that goes with the inbound ``stream`` (same hash tag)."""
        head, sep, _ = stream.rpartition(":")
        if not sep:
            raise ValueError(f"not a broker_adapter stream key: {stream!r}")
        return f"{head}:submit"

    def inbound_partition(self, partition: int) -> str:
        """Inbound partition ``partition`` of the shared stream (0 is ``inbound()``)."""
        if not 0 <= partition < MAX_PARTITIONS:
            raise ConfigError(f"partition must be 0..{MAX_PARTITIONS - 1}, not {partition}")
        return self.inbound() if partition == 0 else f"{self.prefix}:{{in#{partition}}}:tasks"

    def inbound_partitions(self, partitions: int) -> list[str]:
        """The ``partitions`` inbound streams of the shared stream, partition 0 first."""
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ConfigError(f"partitions must be 1..{MAX_PARTITIONS}, not {partitions}")
        return [self.inbound_partition(k) for k in range(partitions)]

    def _out_tag(self, principal: str) -> str:
        return f"out.{check_principal(principal, 'principal')}"

    def replies(self, principal: str) -> str:
        """The reply stream addressed to ``principal``."""
        return f"{self.prefix}:{{{self._out_tag(principal)}}}:replies"

    def replies_dead(self, principal: str) -> str:
        return f"{self.prefix}:{{{self._out_tag(principal)}}}:dead"

    def reply_record(self, principal: str, reply_id: str) -> str:
        return f"{self.prefix}:{{{self._out_tag(principal)}}}:rid:{reply_id}"

    def reply_result(self, principal: str, message_id: str) -> str:
        """The result record of ``principal``'s request ``message_id`` (its signed reply)."""
        return f"{self.prefix}:{{{self._out_tag(principal)}}}:res:{message_id}"

    def reply_results(self, principal: str) -> str:
        """The index of ``principal``'s result records (sorted set, score ms)."""
        return f"{self.prefix}:{{{self._out_tag(principal)}}}:results"

    def epoch(self) -> str:
        return f"{self.prefix}:{{meta}}:epoch"

    def store_binding(self) -> str:
        """The store this prefix's inbound groups are bound to (``app.binding``)."""
        return f"{self.prefix}:{{meta}}:store"

    def consumer_claim(self, name: str) -> str:
        """A live adapter's claim on the consumer name ``name`` (``app.binding``)."""
        return f"{self.prefix}:{{meta}}:consumer:{name}"

    def receipt_binding(self, principal: str, group: str) -> str:
        """The receipt store ``principal``'s receiver group ``group`` is bound to."""
        return f"{self.prefix}:{{{self._out_tag(principal)}}}:receipts:{group}"

    def dead_for(self, stream: str) -> str:
        """The dead-letter stream that goes with ``stream`` (same hash tag)."""
        head, sep, _ = stream.rpartition(":")
        if not sep:
            raise ValueError(f"not a broker_adapter stream key: {stream!r}")
        return f"{head}:dead"


def _key_prefix(value: str) -> str:
    Keys(value)  # refuses braces and white space
    return value


def _principal(value: str) -> str:
    return check_principal(value, "principal")


#: A Redis key prefix as a settings field (``Keys``): no braces, no white space.
KeyPrefix = Annotated[str, AfterValidator(_key_prefix)]
#: The key prefix as a setting, with its default and its flag (every model naming a prefix).
PREFIX_SETTING = setting(
    DEFAULT_PREFIX,
    help="Redis key prefix (no braces or white space)",
    flag="--prefix",
    env="BA_PREFIX",
)
#: A principal name as a settings field (``envelope.check_principal``).
Principal = Annotated[str, AfterValidator(_principal)]
#: How many inbound partition streams a signed-mode deployment uses (``partition_of``).
PARTITIONS_SETTING = setting(
    1,
    ge=1,
    le=MAX_PARTITIONS,
    help="signed mode: inbound partition streams, a principal's by a stable hash"
    " (docs/PROTOCOL.md); publishers and the adapter must agree",
    flag="--partitions",
    env="BA_PARTITIONS",
    metavar="P",
)

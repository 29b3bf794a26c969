"""The workload: agents that publish a seeded mix of good, slow, failing and bad requests.

Each agent is one principal with its own signing key, running in a thread of the harness
with its own Redis connection (through the proxy, so net faults hit it too). Message ids are
``m<seq>`` for requests and ``x<seq>`` for planted bad input, so every key
``<principal>:<id>`` is unique and readable. The plan depends only on the seed (never on
timing or outcomes), so a run can be replayed.

A publish that fails with ``RedisUnavailable`` is *indeterminate* (``info``: the XADD may
have run); the agent retries it with the SAME envelope a bounded number of times, as
docs/RULES.md rule 1 asks. Kinds (see ``handler.py`` for what the task kinds do):

``ok``, ``transient``, ``slow``, ``poison``, ``crash``, ``deadline`` (a short or already past
deadline), ``cancel`` (slow, then cancelled by the canceller), ``dup_same`` / ``dup_diff``
(re-publish an earlier key, same or other content, soon or late), ``malformed`` (bytes that
do not parse), ``badsig`` (a wrong signature), ``spoof`` (signed with the agent's own key,
claiming another principal as sender), ``hostile`` (poison of one of the shapes of
``hostile.INBOUND_SHAPES``, dealt from a shuffled deck so that every shape comes up before
any comes up twice; logged under the shape's name).
"""

from __future__ import annotations

import json
import queue
import random
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from broker_adapter.client.publisher import Publisher
from broker_adapter.errors import AuthError, BrokerAdapterError, ConfigError
from broker_adapter.protocol.canonical import canonical_json
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.signing import Keyring, signature
from broker_adapter.redis.client import connect
from broker_adapter.store import TaskStore
from broker_adapter.store.backends import open_store
from tests.chaos.finalread import CHAOS_KEY_FIELD
from tests.chaos.history import FAIL, INFO, INVOKE, OK, History
from tests.chaos.hostile import INBOUND_SHAPES, Pairs, flat, inbound_poison
from tests.chaos.model import REJECT_CLASS, TASK_CLASS

if TYPE_CHECKING:
    from broker_adapter.store import TaskStore

ROOT = Path(__file__).resolve().parents[2]

#: Default weights of the kinds an agent draws.
DEFAULT_WEIGHTS: dict[str, float] = {
    "ok": 40,
    "transient": 8,
    "slow": 5,
    "poison": 4,
    "crash": 4,
    "deadline": 5,
    "cancel": 4,
    "dup_same": 7,
    "dup_diff": 3,
    "malformed": 4,
    "badsig": 3,
    "spoof": 3,
    "hostile": 5,
}
TASK_KINDS = frozenset(
    {"ok", "transient", "slow", "slow_long", "poison", "crash", "deadline", "cancel"}
)
REJECT_KINDS = frozenset({"malformed", "badsig", "spoof", "hostile"})
DUP_KINDS = frozenset({"dup_same", "dup_diff"})
PUBLISH_TIMEOUT_S = 3.0


def make_keyring(principals: list[str], seed: int) -> dict[str, dict[str, str]]:
    """One key per principal, named ``<principal>-k1``; secrets derived from the seed."""
    rng = random.Random(f"keys-{seed}")
    return {p: {f"{p}-k1": f"{p}-secret-{rng.getrandbits(128):032x}"} for p in principals}


@dataclass(frozen=True)
class AgentConfig:
    """One agent's share of the workload.

    Attributes:
        principal: who it publishes as.
        index: its position among the agents (seeds its generator).
        messages: how many publishes it plans (bounded by ``duration_s`` too).
        duration_s: the publishing phase's length; publishes are spread evenly over it.
        lease_s: the adapter's lease (slow tasks run longer than it).
        weights: kind -> weight.
        peers: the other principals and their message counts (spoof targets).
        deadline_s: the deadline of normal requests, seconds from publish.
        publish_retries: re-sends of an indeterminate publish (same envelope).
    """

    principal: str
    index: int
    messages: int
    duration_s: float
    lease_s: float
    weights: dict[str, float]
    peers: dict[str, int]
    deadline_s: float = 3600.0
    publish_retries: int = 3


@dataclass
class _Sent:
    envelope: Envelope
    payload: dict[str, Any]
    seq: int


class Agent(threading.Thread):
    """Publishes one principal's plan; see the module docstring.

    Args:
        config: the agent's share.
        seed: the run's seed.
        redis_url: the proxy's URL.
        prefix: the key prefix.
        keyring: the whole keyring (secrets of every principal; the agent uses its own).
        history: where it logs (``proc`` is ``agent-<principal>``).
        canceller: receives the ``cancel`` tasks once published.
        stop: set to stop early.
        partitions: the inbound partition streams (its principal's is the one it uses).
    """

    def __init__(
        self,
        config: AgentConfig,
        seed: int,
        redis_url: str,
        prefix: str,
        keyring: dict[str, dict[str, str]],
        history: History,
        canceller: Canceller | None,
        stop: threading.Event,
        *,
        partitions: int = 1,
    ) -> None:
        super().__init__(name=f"agent-{config.principal}", daemon=True)
        self.config = config
        # The plan's generator is drawn a fixed number of times per step, whatever happens;
        # draws that depend on outcomes (retry jitter) use a generator of their own.
        self.rng = random.Random(f"agent-{seed}-{config.index}")
        self.jitter = random.Random(f"agent-jitter-{seed}-{config.index}")
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.keyring_data = keyring
        self.kid, self.secret = next(iter(keyring[config.principal].items()))
        self.client = connect(redis_url, socket_timeout_s=PUBLISH_TIMEOUT_S)
        self.publisher = Publisher(
            self.client, self.keys, config.principal, Keyring(keyring), partitions=partitions
        )
        self.history = history
        self.canceller = canceller
        self.stop_event = stop
        self.sent: dict[str, _Sent] = {}
        self.order: list[str] = []
        self.storms: deque[int] = deque()
        self._shapes: list[str] = []
        self.published = 0
        self.finished = threading.Event()
        kinds = list(config.weights)
        self._kinds = kinds
        self._weights = [config.weights[k] for k in kinds]

    # -- the plan ---------------------------------------------------------------------------

    def _draw_kind(self) -> str:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        if kind in DUP_KINDS and not self.order:
            return "ok"
        return kind

    def _payload(self, kind: str, seq: int) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "kind": kind,
            "value": f"{self.config.principal}-{seq}-{self.rng.getrandbits(32):08x}",
        }
        lease = self.config.lease_s
        if kind == "slow":
            payload["sleep_s"] = round(self.rng.uniform(1.2, 2.5) * lease, 3)
        elif kind == "slow_long":
            payload["sleep_s"] = round(4.0 * lease, 3)
        elif kind == "cancel":
            payload["sleep_s"] = round(self.rng.uniform(2.0, 4.0) * lease, 3)
        elif kind == "poison":
            payload["retryable"] = self.rng.random() < 0.5
        return payload

    def request_storm(self, n: int) -> None:
        """Ask the agent to re-publish ``n`` recent keys (same envelopes) at its next step."""
        self.storms.append(n)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.config
        start = time.monotonic()
        end = start + cfg.duration_s
        interval = cfg.duration_s / max(1, cfg.messages)
        try:
            for seq in range(cfg.messages):
                due = start + seq * interval
                if self.stop_event.wait(max(0.0, due - time.monotonic())):
                    break
                if time.monotonic() > end + interval:
                    break
                self._step(seq)
                while self.storms and not self.stop_event.is_set():
                    self._storm(self.storms.popleft())
        finally:
            self.finished.set()
            self.client.close()

    def _step(self, seq: int) -> None:
        kind = self._draw_kind()
        if kind in REJECT_KINDS:
            self._publish_bad(kind, seq)
        elif kind in DUP_KINDS:
            self._publish_dup(kind, seq)
        else:
            self._publish_task(kind, seq)

    def _key(self, ident: str) -> str:
        return f"{self.config.principal}:{ident}"

    def _publish_task(self, kind: str, seq: int) -> None:
        message_id = f"m{seq:06d}"
        payload = self._payload(kind, seq)
        deadline_in = self.config.deadline_s
        if kind == "deadline":
            deadline_in = self.rng.uniform(-1.0, 3.0)
        envelope = Envelope.build(
            message_id=message_id,
            sender=self.config.principal,
            payload=payload,
            deadline=time.time() + deadline_in,
            max_attempts=3,
        )
        key = self._key(message_id)
        self.sent[key] = _Sent(envelope, payload, seq)
        self.order.append(key)
        delay = self.rng.uniform(0.0, 2.0 * self.config.lease_s) if kind == "cancel" else 0.0
        acked = self._publish(key, envelope, kind, seq)
        if acked and kind == "cancel" and self.canceller is not None:
            self.canceller.submit(key, self.config.principal, message_id, delay)

    def _publish_dup(self, kind: str, seq: int) -> None:
        late = self.rng.random() < 0.3
        pool = self.order[: max(1, len(self.order) // 4)] if late else self.order[-8:]
        key = self.rng.choice(pool)
        earlier = self.sent[key]
        payload = dict(earlier.payload)
        if kind == "dup_diff":
            payload["value"] = f"{payload['value']}-other-{seq}"
        envelope = Envelope.build(
            message_id=earlier.envelope.message_id,
            sender=self.config.principal,
            payload=payload,
            deadline=earlier.envelope.deadline,
            max_attempts=earlier.envelope.max_attempts,
        )
        self._publish(key, envelope, kind, earlier.seq, late=late)

    def _storm(self, n: int) -> None:
        for key in self.order[-n:]:
            if self.stop_event.is_set():
                return
            earlier = self.sent[key]
            self._publish(key, earlier.envelope, "storm_dup", earlier.seq)

    def _publish(
        self, key: str, envelope: Envelope, kind: str, seq: int, *, late: bool = False
    ) -> bool:
        """Publish with bounded retries of the same envelope; True once acknowledged."""
        fingerprint = envelope.fingerprint()
        for attempt in range(1, self.config.publish_retries + 2):
            self.history.log(
                INVOKE,
                "publish",
                key=key,
                value={
                    "kind": kind,
                    "class": TASK_CLASS,
                    "seq": seq,
                    "fingerprint": fingerprint,
                    "attempt": attempt,
                    "late": late,
                },
            )
            try:
                message_id = self.publisher.publish(envelope)
            except (AuthError, ConfigError) as exc:
                self.history.log(FAIL, "publish", key=key, error=str(exc))
                return False
            except BrokerAdapterError as exc:
                self.history.log(
                    INFO, "publish", key=key, value={"fingerprint": fingerprint}, error=str(exc)
                )
                if self.stop_event.wait(self.jitter.uniform(0.1, 0.5)):
                    return False
                continue
            self.published += 1
            self.history.log(
                OK,
                "publish",
                key=key,
                value={"message_id": message_id, "fingerprint": fingerprint},
            )
            return True
        return False

    # -- bad input --------------------------------------------------------------------------

    def _next_shape(self) -> str:
        if not self._shapes:
            self._shapes = sorted(INBOUND_SHAPES)
            self.rng.shuffle(self._shapes)
        return self._shapes.pop()

    def _publish_bad(self, kind: str, seq: int) -> None:
        ident = f"x{seq:06d}"
        key = self._key(ident)
        marker = (CHAOS_KEY_FIELD, key.encode())  # first: a bounded dead letter keeps it
        fields: Pairs
        claims: str | None = None
        reasons: tuple[str, ...] = ()
        fingerprint = ""
        if kind == "malformed":
            fields = [marker, *self._malformed(ident).items()]
        elif kind == "hostile":
            kind = self._next_shape()
            reasons = INBOUND_SHAPES[kind]
            fields = inbound_poison(
                kind,
                key=key,
                principal=self.config.principal,
                ident=ident,
                kid=self.kid,
                secret=self.secret,
                deadline_s=self.config.deadline_s,
            )
        else:
            if kind == "badsig":
                sender, message_id = self.config.principal, ident
                reasons = ("bad_signature",)
            else:
                sender = self.rng.choice(sorted(self.config.peers))
                message_id = f"m{self.rng.randrange(max(1, self.config.peers[sender])):06d}"
                claims = f"{sender}:{message_id}"
                reasons = ("sender_mismatch",)
            envelope = Envelope.build(
                message_id=message_id,
                sender=sender,
                payload={"kind": "ok", "value": f"{kind}-{self.config.principal}-{seq}"},
                deadline=time.time() + self.config.deadline_s,
            )
            fingerprint = envelope.fingerprint()
            env = envelope.to_json()
            secret = self.secret.encode()
            if kind == "badsig":
                secret = secret + b"-wrong"
            fields = [
                marker,
                (b"v", b"1"),
                (b"env", env),
                (b"kid", self.kid.encode()),
                (b"sig", signature(secret, self.kid, env).encode()),
            ]
        self.history.log(
            INVOKE,
            "publish",
            key=key,
            value={
                "kind": kind,
                "class": REJECT_CLASS,
                "seq": seq,
                "reasons": list(reasons),
                "claims": claims,
                "fingerprint": fingerprint,
            },
        )
        try:
            entry_id = self._xadd_raw(self.publisher.stream, fields)  # its own partition
        except redis.RedisError as exc:
            self.history.log(INFO, "publish", key=key, error=str(exc))
            return
        self.history.log(
            OK, "publish", key=key, value={"entry_id": entry_id, "fingerprint": fingerprint}
        )

    def _xadd_raw(self, stream: str, fields: Pairs) -> str:
        """XADD ``fields`` as they are: in order, repeated names kept."""
        reply = self.client.execute_command(  # type: ignore[no-untyped-call]
            "XADD", stream, "*", *flat(fields)
        )
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def _malformed(self, ident: str) -> dict[bytes, bytes]:
        good = Envelope.build(
            message_id=ident,
            sender=self.config.principal,
            payload={"kind": "ok"},
            deadline=time.time() + 60,
        ).to_json()
        sig = signature(self.secret.encode(), self.kid, good).encode()
        kid = self.kid.encode()
        variants: list[dict[bytes, bytes]] = [
            {b"v": b"1", b"env": b"\xff\xfe\x00garbage", b"kid": kid, b"sig": sig},
            {b"v": b"1", b"env": b"{not json", b"kid": kid, b"sig": sig},
            {b"v": b"1", b"env": b"[1, 2, 3]", b"kid": kid, b"sig": sig},
            {b"v": b"9", b"env": good, b"kid": kid, b"sig": sig},
            {b"v": b"1", b"env": good, b"kid": kid},
            {b"v": b"1", b"env": canonical_json({"message_id": ident}), b"kid": kid, b"sig": sig},
            {b"junk": self.rng.randbytes(64)},
        ]
        return dict(self.rng.choice(variants))


class Canceller(threading.Thread):
    """Cancels ``cancel`` tasks a little after they were published, through the store on a
    connection of its own or through ``python -m broker_adapter cancel``.

    Args:
        db_path: the adapter's database (a SQLite file or a ``postgresql://`` URL).
        history: where it logs (``proc`` ``canceller``).
        rng: picks the path (store or CLI).
        stop: set to stop; queued cancels are then dropped.
    """

    def __init__(
        self,
        db_path: Path | str,
        history: History,
        rng: random.Random,
        stop: threading.Event,
        env: dict[str, str],
    ) -> None:
        super().__init__(name="canceller", daemon=True)
        self.db_path = db_path
        self.history = history
        self.rng = rng
        self.stop_event = stop
        self.env = env
        self.queue: queue.Queue[tuple[float, str, str, str]] = queue.Queue()
        self.inflight = 0
        self._lock = threading.Lock()

    def submit(self, key: str, principal: str, message_id: str, delay_s: float) -> None:
        with self._lock:
            self.inflight += 1
        self.queue.put((time.monotonic() + delay_s, key, principal, message_id))

    @property
    def idle(self) -> bool:
        with self._lock:
            return self.inflight == 0

    def run(self) -> None:
        db = None
        try:
            while not self.stop_event.is_set():
                try:
                    due, key, principal, message_id = self.queue.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    if self.stop_event.wait(max(0.0, due - time.monotonic())):
                        return
                    if db is None:
                        db = open_store(self.db_path)
                    self._cancel(TaskStore(db), key, principal, message_id)
                except BrokerAdapterError as exc:  # the store is down: this cancel is lost
                    self.history.log(
                        INFO, "cancel", key=key, value={"state": "error"}, error=str(exc)
                    )
                finally:
                    with self._lock:
                        self.inflight -= 1
        finally:
            if db is not None:
                db.close()

    def _cancel(self, store: TaskStore, key: str, principal: str, message_id: str) -> None:
        task_id = None
        deadline = time.monotonic() + 10.0
        while task_id is None and time.monotonic() < deadline:
            try:
                row = store.find(principal, message_id)
            except BrokerAdapterError:
                row = None
            if row is not None:
                task_id = row.task_id
            elif self.stop_event.wait(0.2):
                return
        if task_id is None:
            self.history.log(INFO, "cancel", key=key, value={"state": "not_found"})
            return
        use_cli = self.rng.random() < 0.5
        self.history.log(INVOKE, "cancel", key=key, value={"task_id": task_id, "cli": use_cli})
        try:
            state = self._via_cli(task_id) if use_cli else store.cancel(task_id).value
        except subprocess.CalledProcessError as exc:
            error = f"exit {exc.returncode}: {(exc.stderr or '').strip()[-500:]}"
            self.history.log(INFO, "cancel", key=key, value={"state": "error"}, error=error)
            return
        except (BrokerAdapterError, subprocess.SubprocessError, OSError, ValueError) as exc:
            self.history.log(INFO, "cancel", key=key, value={"state": "error"}, error=str(exc))
            return
        self.history.log(OK, "cancel", key=key, value={"task_id": task_id, "state": state})

    def _via_cli(self, task_id: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "broker_adapter", "cancel", "--db", str(self.db_path), task_id],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env,
            check=True,
        )
        data = json.loads(out.stdout.strip().splitlines()[-1])
        return str(data["state"])


@dataclass
class Workload:
    """The agents and the canceller of one run."""

    agents: list[Agent] = field(default_factory=list)
    canceller: Canceller | None = None

    def start(self) -> None:
        if self.canceller is not None:
            self.canceller.start()
        for agent in self.agents:
            agent.start()

    def done(self) -> bool:
        publishing = any(not a.finished.is_set() for a in self.agents)
        cancelling = self.canceller is not None and not self.canceller.idle
        return not publishing and not cancelling

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for agent in self.agents:
            agent.join(max(0.0, deadline - time.monotonic()))

    def storm(self, rng: random.Random, n: int) -> None:
        for agent in self.agents:
            if rng.random() < 0.5:
                agent.request_storm(n)

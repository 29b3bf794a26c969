"""What the checker reads: the final state (from SQLite and Redis) and the history model.

Plain frozen dataclasses, so that checker unit tests can build both by hand. ``finalread``
fills ``FinalState`` from a finished run; ``HistoryModel.from_events`` folds the merged
history into what the agents were told and when faults happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.chaos.history import Event

TERMINAL = frozenset({"done", "failed", "cancelled", "expired", "hop_limit"})
#: States in which a handler may have applied its effect before the task ended.
EFFECT_ALLOWED = frozenset({"done", "failed", "cancelled", "expired"})
TASK_CLASS = "task"
REJECT_CLASS = "reject"


@dataclass(frozen=True)
class TaskRec:
    task_id: str
    principal: str
    message_id: str
    state: str
    fence: int
    attempts: int = 1
    max_attempts: int = 3
    fingerprint: str = ""
    owner: str | None = None
    lease_until: float | None = None
    result: Any = None
    error: str | None = None
    created_at: float = 0.0
    finished_at: float | None = None


@dataclass(frozen=True)
class InboxRec:
    principal: str
    message_id: str
    fingerprint: str
    task_id: str
    duplicates: int = 0
    conflicts: int = 0


@dataclass(frozen=True)
class OutboxRec:
    reply_id: str
    task_id: str | None
    principal: str
    message_id: str
    status: str
    state: str
    content_hash: str
    fence: int | None = None
    fingerprint: str | None = None  # a conflict answer: the refused content's fingerprint
    attempts: int = 1
    last_error: str | None = None


@dataclass(frozen=True)
class ReceiptRec:
    reply_id: str
    principal: str
    content_hash: str
    task_id: str | None = None
    status: str | None = None
    fence: int | None = None
    received_at: float = 0.0
    effects: int = 1
    forged: str | None = None  # the ``chaos_forged`` mark of a forged body it was made from


@dataclass(frozen=True)
class EffectRec:
    idempotency_key: str
    task_id: str
    principal: str
    message_id: str
    first_fence: int
    last_fence: int
    applications: int = 1


@dataclass(frozen=True)
class AttemptRec:
    task_id: str
    principal: str
    message_id: str
    fence: int
    attempt: int
    event: str


@dataclass(frozen=True)
class DeadLetterRec:
    """One dead-letter entry. ``sender``/``message_id`` come from the original envelope when
    it parses; ``chaos_key`` from the harness's marker field on inbound entries it made bad,
    ``chaos_forged`` from its marker on reply entries it forged or poisoned."""

    stream: str
    entry_id: str
    reason: str
    chaos_key: str | None = None
    sender: str | None = None
    message_id: str | None = None
    chaos_forged: str | None = None


@dataclass
class FinalState:
    """Ground truth, read after everything stopped."""

    tasks: list[TaskRec] = field(default_factory=list)
    inbox: list[InboxRec] = field(default_factory=list)
    outbox: list[OutboxRec] = field(default_factory=list)
    receipts: list[ReceiptRec] = field(default_factory=list)
    #: reply id -> rows in the append-only receiver ledgers (``ledger_principals`` only)
    receiver_effects: dict[str, int] = field(default_factory=dict)
    ledger_principals: set[str] = field(default_factory=set)
    effects: list[EffectRec] = field(default_factory=list)
    attempts: list[AttemptRec] = field(default_factory=list)
    dead_letters: list[DeadLetterRec] = field(default_factory=list)
    reply_dead_letters: list[DeadLetterRec] = field(default_factory=list)
    #: reply id -> ledger rows made from a forged body (status ``forged``)
    forged_effects: dict[str, int] = field(default_factory=dict)
    #: reply id -> entries carrying it on the reply streams (planted entries left out)
    reply_copies: dict[str, int] = field(default_factory=dict)
    #: entries the harness planted on the reply streams (``chaos_forged``)
    forged_on_streams: int = 0
    #: "<stream> <group>" -> XPENDING count
    pending: dict[str, int] = field(default_factory=dict)
    #: "<stream> <group>" -> entries after the group's last-delivered-id
    undelivered: dict[str, int] = field(default_factory=dict)
    integrity: dict[str, str] = field(default_factory=dict)
    wal_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class Publish:
    """Everything the agents did under one key (the original and its re-publishes)."""

    key: str
    principal: str
    ident: str
    cls: str
    kind: str
    seq: int
    fingerprints: set[str] = field(default_factory=set)
    acked_fingerprints: set[str] = field(default_factory=set)
    first_ack_t: float | None = None
    first_ack_wall: float | None = None
    #: monotonic times of every acknowledged publish, by fingerprint
    ack_ts: dict[str, list[float]] = field(default_factory=dict)
    invokes: int = 0
    acks: int = 0
    infos: int = 0
    fails: int = 0
    #: rejects: the reasons the ingest may give; spoofs: the key they claim
    reasons: tuple[str, ...] = ()
    claims: str | None = None

    @property
    def acked(self) -> bool:
        return self.acks > 0

    @property
    def indeterminate(self) -> bool:
        return self.acks == 0 and self.infos > 0


@dataclass
class Forgery:
    """One reply stream entry the nemesis forged or poisoned (history ``forge``).

    Attributes:
        mark: its ``chaos_forged`` mark, unique in the run.
        principal: whose reply stream it went to.
        shape: what is wrong with it (``hostile.FORGERY_SHAPES``, ``REPLY_POISON_SHAPES``).
        reply_id: the reply id it claims.
        target: ``real`` (the id of a task not yet answered) or ``invented``.
        body_hash: SHA-256 of the body it carries.
        reasons: the dead-letter reasons the receiver may give it.
        ack_ts: monotonic times its XADD was acknowledged (empty: it may never have landed).
    """

    mark: str
    principal: str
    shape: str
    reply_id: str
    target: str
    body_hash: str
    reasons: tuple[str, ...] = ()
    ack_ts: list[float] = field(default_factory=list)

    @property
    def acked(self) -> bool:
        return bool(self.ack_ts)


@dataclass(frozen=True)
class Replay:
    """A byte-identical copy of a real inbound entry, appended again (history ``replay``).

    Attributes:
        key: the request's key.
        source: the entry id it copies.
        state: the task's state when it was copied (``None``: not stored yet).
        entry_id: the copy's entry id (``None``: the XADD is indeterminate).
    """

    key: str
    source: str
    state: str | None
    entry_id: str | None


@dataclass(frozen=True)
class FaultWindow:
    fault: str
    start_t: float
    stop_t: float
    target: str = ""


@dataclass
class HistoryModel:
    publishes: dict[str, Publish] = field(default_factory=dict)
    #: mark -> the reply stream entry the nemesis planted under it
    forgeries: dict[str, Forgery] = field(default_factory=dict)
    #: key -> the copies of its entries the nemesis appended again
    replays: dict[str, list[Replay]] = field(default_factory=dict)
    faults: list[FaultWindow] = field(default_factory=list)
    fault_counts: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    unexpected_exits: list[dict[str, Any]] = field(default_factory=list)
    expected_exits: int = 0
    cancels: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    heal_t: float | None = None
    drain_ok: bool | None = None
    drain_s: float | None = None

    @classmethod
    def from_events(cls, events: list[Event]) -> HistoryModel:
        model = cls()
        open_faults: dict[str, Event] = {}
        for e in events:
            f, typ, proc = e.get("f"), e.get("type"), str(e.get("proc", ""))
            value = e.get("value") if isinstance(e.get("value"), dict) else {}
            assert isinstance(value, dict)
            if f == "publish":
                model._publish(e, str(typ), value)
            elif f == "forge":
                model._forge(e, str(typ), value)
            elif f == "replay" and typ in ("ok", "info"):
                entry_id = value.get("entry_id") if typ == "ok" else None
                model.replays.setdefault(str(e.get("key")), []).append(
                    Replay(
                        str(e.get("key")),
                        str(value.get("source")),
                        value.get("state"),
                        None if entry_id is None else str(entry_id),
                    )
                )
            elif proc == "nemesis" and f == "start":
                fid = str(value.get("id", len(open_faults)))
                open_faults[fid] = e
                fault = str(value.get("fault", "?"))
                model.fault_counts[fault] = model.fault_counts.get(fault, 0) + 1
            elif proc == "nemesis" and f == "stop":
                fid = str(value.get("id", ""))
                start = open_faults.pop(fid, None)
                if start is not None:
                    sv = start.get("value") or {}
                    model.faults.append(
                        FaultWindow(
                            str(sv.get("fault", "?")),
                            float(start["t"]),
                            float(e["t"]),
                            str(sv.get("target", "")),
                        )
                    )
            elif f == "exit":
                if value.get("expected"):
                    model.expected_exits += 1
                else:
                    model.unexpected_exits.append(dict(value, t=e.get("t")))
            elif f == "cancel" and typ in ("ok", "fail", "info"):
                state = str(value.get("state", typ))
                model.cancels[state] = model.cancels.get(state, 0) + 1
            elif f == "config":
                model.config = dict(value)
            elif f == "heal":
                model.heal_t = float(e["t"])
            elif f == "drain":
                model.drain_ok = typ == "ok"
                model.drain_s = float(value.get("seconds", 0.0))
        for fid, start in open_faults.items():  # never stopped: the window runs to the end
            sv = start.get("value") or {}
            end = float(events[-1]["t"]) if events else float(start["t"])
            model.faults.append(
                FaultWindow(
                    str(sv.get("fault", fid)), float(start["t"]), end, str(sv.get("target"))
                )
            )
        return model

    def _forge(self, e: Event, typ: str, value: dict[str, Any]) -> None:
        mark = str(value.get("mark"))
        if typ == "invoke":
            self.forgeries[mark] = Forgery(
                mark=mark,
                principal=str(value.get("principal")),
                shape=str(value.get("shape")),
                reply_id=str(value.get("reply_id")),
                target=str(value.get("target")),
                body_hash=str(value.get("hash")),
                reasons=tuple(value.get("reasons") or ()),
            )
        elif typ == "ok" and mark in self.forgeries:
            self.forgeries[mark].ack_ts.append(float(e["t"]))

    def _publish(self, e: Event, typ: str, value: dict[str, Any]) -> None:
        key = str(e.get("key"))
        pub = self.publishes.get(key)
        if typ == "invoke":
            kind = str(value.get("kind", "ok"))
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if pub is None:
                principal, _, ident = key.partition(":")
                pub = Publish(
                    key=key,
                    principal=principal,
                    ident=ident,
                    cls=str(value.get("class", TASK_CLASS)),
                    kind=kind,
                    seq=int(value.get("seq", 0)),
                    reasons=tuple(value.get("reasons") or ()),
                    claims=value.get("claims"),
                )
                self.publishes[key] = pub
            pub.invokes += 1
            fp = value.get("fingerprint")
            if fp:
                pub.fingerprints.add(str(fp))
            return
        if pub is None:
            return
        if typ == "ok":
            pub.acks += 1
            fp = str(value.get("fingerprint") or "")
            if fp:
                pub.acked_fingerprints.add(fp)
            pub.ack_ts.setdefault(fp, []).append(float(e["t"]))
            if pub.first_ack_t is None:
                pub.first_ack_t = float(e["t"])
                pub.first_ack_wall = float(e["wall"])
        elif typ == "info":
            pub.infos += 1
        elif typ == "fail":
            pub.fails += 1

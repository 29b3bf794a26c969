"""The task and outbox state machines against a simple model (hypothesis, stateful).

Outcomes commit through the production settle path, ``TaskStore.settle_batch``: a batch of
one to three outcomes (some stale or an intruder's), the next claim in the same
transaction, and for a worker that publishes its own replies the replies written already
claimed and its sent marks.

Every rule predicts the store's answer from the model first (outcome, refusal reason, which
rows may be claimed), then calls the store and compares. After every step the invariants
are checked against the database itself:

* at most one terminal reply per task, and every terminal task has exactly one;
* no fenced commit the model calls stale ever succeeded;
* attempts never exceed max_attempts;
* deadlines never change after accept;
* every task and reply row matches the model field for field.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from broker_adapter.clock import FakeClock
from broker_adapter.errors import StaleError
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.store import (
    AcceptItem,
    FailOutcome,
    Outcome,
    open_database,
)
from broker_adapter.store.db import Database
from broker_adapter.store.outbox_types import OutboxPolicy, PublisherClaim, SentMark
from broker_adapter.store.postgres import PgDatabase
from broker_adapter.store.settle import Settlement
from tests.support.postgres import ThrowawayDatabase
from tests.support.store_script import (
    LEASE_S,
    MAX_HOPS,
    OUTBOX_BACKOFF,
    OUTBOX_LEASE_S,
    RETENTION_S,
    T0,
    TASK_BACKOFF,
    dump,
    envelope,
)
from tests.support.store_script import stores as stores_on

TERMINAL = {"done", "failed", "cancelled", "expired", "hop_limit"}
LIVE = {"pending", "running"}
PRINCIPALS = ("alice", "bob")
MESSAGE_IDS = ("m0", "m1", "m2")
WORKERS = ("w1", "w2", "w3")
DISPATCHERS = ("d1", "d2")
RARELY = st.sampled_from([False, False, False, True])
# A small publication budget, so that "dead" (and replay) is reached within a few steps.
OUTBOX_MAX_ATTEMPTS = 2
OUTBOX_POLICY = OutboxPolicy(
    lease_s=OUTBOX_LEASE_S, max_attempts=OUTBOX_MAX_ATTEMPTS, backoff=OUTBOX_BACKOFF
)


@dataclass
class MTask:
    task_id: str
    state: str
    attempts: int
    max_attempts: int
    fence: int
    owner: str | None
    lease_until: float | None
    not_before: float
    deadline: float


@dataclass
class MReply:
    reply_id: str
    task_id: str | None
    state: str
    attempts: int
    fence: int
    owner: str | None
    lease_until: float | None
    not_before: float
    created_at: float


@dataclass(frozen=True)
class Handle:
    """What a worker (or dispatcher) holds after a claim: its id, owner and fence."""

    key: str
    owner: str
    fence: int


@dataclass
class InboxRecord:
    #: what the fingerprint covers that the rule varies: payload variant, deadline and
    #: max_attempts (a resend that changes any of them is a conflict)
    content: tuple[int, float, int]
    task_id: str
    received_at: float


class StoreMachine(RuleBasedStateMachine):
    task_ids = Bundle("task_ids")
    task_handles = Bundle("task_handles")
    reply_handles = Bundle("reply_handles")

    #: Where each run's database lives: ``None`` for a SQLite file in a temporary
    #: directory, else a callable giving a fresh PostgreSQL schema's URL.
    fresh_postgres: Callable[[], str] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ba-sm-"))
        self.db: Database | PgDatabase
        if self.fresh_postgres is None:
            self.db = open_database(self.dir / "sm.db", synchronous="NORMAL")
        else:
            self.db = PgDatabase(self.fresh_postgres())
        self.clock = FakeClock(T0)
        self.tasks_model: dict[str, MTask] = {}
        self.replies_model: dict[str, MReply] = {}
        self.inbox: dict[tuple[str, str], InboxRecord] = {}
        self.deadlines: dict[str, float] = {}
        self.stale_commits = 0
        stores = stores_on(self.db, self.clock)
        self.tasks, self.outbox = stores.tasks, stores.outbox
        self.tasks.rng, self.outbox.rng = random.Random(0), random.Random(1)
        self.outbox.policy = OUTBOX_POLICY

    def teardown(self) -> None:
        self.db.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(seed=st.integers(0, 2**32 - 1))
    def seed_rngs(self, seed: int) -> None:
        self.tasks.rng = random.Random(seed)
        self.outbox.rng = random.Random(seed + 1)

    # -- model helpers ------------------------------------------------------------------

    def _terminal(
        self, task: MTask, state: str, now: float, claim: PublisherClaim | None = None
    ) -> None:
        task.state, task.owner, task.lease_until = state, None, None
        self._new_reply(reply_id_for(task.task_id), task.task_id, now, claim)

    def _new_reply(
        self, reply_id: str, task_id: str | None, now: float, claim: PublisherClaim | None = None
    ) -> None:
        assert reply_id not in self.replies_model
        if claim is None:
            reply = MReply(reply_id, task_id, "pending", 0, 0, None, None, now, now)
        else:  # written already claimed by that publisher
            reply = MReply(
                reply_id, task_id, "sending", 1, 1, claim.owner, claim.lease_until, now, now
            )
        self.replies_model[reply_id] = reply

    def _reconcile_model(self, now: float) -> dict[str, int]:
        counts = {"expired": 0, "requeued": 0, "exhausted": 0}
        for t in self.tasks_model.values():
            if t.state in LIVE and t.deadline <= now:
                self._terminal(t, "expired", now)
                counts["expired"] += 1
        for t in self.tasks_model.values():
            if t.state == "running" and t.lease_until is not None and t.lease_until <= now:
                if t.attempts >= t.max_attempts:
                    self._terminal(t, "failed", now)
                    counts["exhausted"] += 1
                else:
                    t.state, t.owner, t.lease_until, t.not_before = "pending", None, None, now
                    counts["requeued"] += 1
        return counts

    def _task_refusal(self, h: Handle, owner: str) -> str | None:
        """The reason the store must give for refusing this fenced write, or None."""
        t = self.tasks_model[h.key]
        now = self.clock.now()
        if t.fence != h.fence:
            return "fence"
        if t.state == "cancelled":
            return "cancelled"
        if t.state != "running":
            return "not_running"
        if t.owner != owner:
            return "owner"
        assert t.lease_until is not None
        if t.lease_until <= now:
            return "lease_expired"
        if t.deadline <= now:
            return "deadline"
        return None

    def _reply_refusal(self, h: Handle, owner: str | None = None) -> str | None:
        r = self.replies_model[h.key]
        if r.fence != h.fence:
            return "fence"
        if r.state != "sending":
            return "not_sending"
        if r.owner != (h.owner if owner is None else owner):
            return "owner"
        assert r.lease_until is not None
        if r.lease_until <= self.clock.now():
            return "lease_expired"
        return None

    def _snapshot(self) -> str:
        rows = {table: dump(self.db)[table] for table in ("tasks", "inbox", "outbox")}
        return json.dumps(rows, sort_keys=True, default=repr)

    def _refused(self, call: Any, reason: str) -> None:
        before = self._snapshot()
        refusal: StaleError | None = None
        try:
            call()
        except StaleError as exc:
            refusal = exc
        if refusal is None:
            self.stale_commits += 1
            raise AssertionError(f"a stale write ({reason}) was committed")
        assert refusal.reason == reason, (refusal.reason, reason)
        assert self._snapshot() == before, "a refused write changed the database"

    # -- tasks --------------------------------------------------------------------------

    @rule(
        target=task_ids,
        principal=st.sampled_from(PRINCIPALS),
        message_id=st.sampled_from(MESSAGE_IDS),
        variant=st.integers(0, 1),
        # None: a faithful resend, with the first copy's deadline
        deadline_in=st.sampled_from([10.0, 20.0, 45.0, 400.0, 400.0, 0.0, -1.0, None, None]),
        max_attempts=st.integers(1, 3),
        hops=st.sampled_from([0, 0, 0, MAX_HOPS, MAX_HOPS + 1]),
    )
    def accept(
        self,
        principal: str,
        message_id: str,
        variant: int,
        deadline_in: float | None,
        max_attempts: int,
        hops: int,
    ) -> Any:
        now = self.clock.now()
        known = self.inbox.get((principal, message_id))
        if deadline_in is None:
            deadline = known.content[1] if known is not None else now + 400.0
        else:
            deadline = now + deadline_in if now + deadline_in > 0 else 1.0
        env = envelope(
            message_id,
            payload={"variant": variant},
            deadline=deadline,
            max_attempts=max_attempts,
            hops=hops,
        )
        content = (variant, env.deadline, max_attempts)
        (res,) = self.tasks.accept([AcceptItem(principal, env)])
        if known is not None and (
            now - known.received_at < RETENTION_S
            or self.tasks_model[known.task_id].state not in TERMINAL
        ):
            assert res.task_id == known.task_id
            if known.content == content:
                assert res.outcome is Outcome.DUPLICATE
            else:
                assert res.outcome is Outcome.CONFLICT
                reply_id = self.tasks.conflict_reply_id(principal, message_id, env.fingerprint())
                assert res.reply_id == reply_id
                if reply_id not in self.replies_model:
                    self._new_reply(reply_id, None, now)
            return multiple()
        assert res.task_id is not None
        assert res.task_id not in self.tasks_model
        task = MTask(res.task_id, "pending", 0, max_attempts, 0, None, None, now, env.deadline)
        self.tasks_model[res.task_id] = task
        self.deadlines[res.task_id] = env.deadline
        self.inbox[(principal, message_id)] = InboxRecord(content, res.task_id, now)
        if env.deadline <= now:
            assert res.outcome is Outcome.EXPIRED
            self._terminal(task, "expired", now)
        elif hops > MAX_HOPS:
            assert res.outcome is Outcome.HOP_LIMIT
            self._terminal(task, "hop_limit", now)
        else:
            assert res.outcome is Outcome.STORED
        return res.task_id

    @rule(target=task_handles, worker=st.sampled_from(WORKERS), n=st.integers(1, 2))
    def claim(self, worker: str, n: int) -> Any:
        now = self.clock.now()
        eligible = self._eligible(now)
        return multiple(*self._claimed(self.tasks.claim(worker, n), eligible, worker, n, now))

    def _eligible(self, now: float) -> dict[str, float]:
        """The model's reconcile, then the ready tasks (what a claim at ``now`` may take)."""
        self._reconcile_model(now)
        return {
            t.task_id: t.not_before
            for t in self.tasks_model.values()
            if t.state == "pending" and t.not_before <= now
        }

    def _claimed(
        self, got: list[Any], eligible: dict[str, float], worker: str, n: int, now: float
    ) -> list[Handle]:
        """Check a claim's tasks against the model and apply it; the new handles."""
        assert len(got) == min(n, len(eligible))
        chosen = {c.task_id for c in got}
        assert chosen <= set(eligible)
        rest = [nb for tid, nb in eligible.items() if tid not in chosen]
        if rest and chosen:
            assert max(eligible[tid] for tid in chosen) <= min(rest)
        handles = []
        for c in got:
            t = self.tasks_model[c.task_id]
            t.state, t.owner, t.lease_until = "running", worker, now + LEASE_S
            t.attempts += 1
            t.fence += 1
            assert (c.attempt, c.fence, c.lease_until, c.deadline) == (
                t.attempts,
                t.fence,
                t.lease_until,
                t.deadline,
            )
            handles.append(Handle(c.task_id, worker, c.fence))
        return handles

    @rule(
        target=task_handles,
        outcomes=st.lists(
            st.tuples(task_handles, st.sampled_from(["done", "failed", "retryable"]), RARELY),
            min_size=1,
            max_size=3,
        ),
        worker=st.sampled_from(WORKERS),
        n=st.sampled_from([0, 0, 1, 2]),
        publisher=st.sampled_from([None, None, *DISPATCHERS]),
        marks=st.lists(reply_handles, max_size=2),
    )
    def settle(
        self,
        outcomes: list[tuple[Handle, str, bool]],
        worker: str,
        n: int,
        publisher: str | None,
        marks: list[Handle],
    ) -> Any:
        """``settle_batch``: each outcome predicted in order (a refusal writes nothing of
        its item), then the claim of up to ``n`` for ``worker``; with ``publisher``, the
        replies are written claimed by it and ``marks`` (of rows it may not hold) are
        recorded first, each fenced."""
        now = self.clock.now()
        sent: list[SentMark] = []
        if publisher is not None:
            for h in marks:
                sent.append((h.key, h.fence, "1-0", now))
        items = [
            Settlement(
                h.key,
                "intruder" if intruder else h.owner,
                h.fence,
                result='{"ok":1}' if kind == "done" else None,
                error=None if kind == "done" else "boom",
                retryable=kind == "retryable",
            )
            for h, kind, intruder in outcomes
        ]
        batch = self.tasks.settle_batch(
            items, worker, n, publish_as=publisher, publish_lease_s=OUTBOX_LEASE_S, sent=sent
        )
        claim = None if publisher is None else PublisherClaim(publisher, now + OUTBOX_LEASE_S)
        assert len(batch.marks) == len(sent)
        for h, refused in zip(marks if publisher is not None else [], batch.marks, strict=True):
            reason = self._reply_refusal(h, publisher)
            self._check_refusal(refused, reason)
            if reason is None:
                r = self.replies_model[h.key]
                r.state, r.owner, r.lease_until = "sent", None, None
        assert len(batch.results) == len(items)
        before = set(self.replies_model)
        for item, (h, _, _), result in zip(items, outcomes, batch.results, strict=True):
            self._settled(item, h, result, now, claim)
        claimed_replies = (
            [] if claim is None else [rid for rid in self.replies_model if rid not in before]
        )
        eligible = self._eligible(now) if n >= 1 else {}
        handles = self._claimed(batch.claimed, eligible, worker, n, now) if n >= 1 else []
        if n < 1:
            assert batch.claimed == []
        # The replies written claimed are those of this batch's terminal outcomes, in order.
        assert [r.reply_id for r in batch.replies] == claimed_replies
        for row in batch.replies:
            r = self.replies_model[row.reply_id]
            assert (row.state, row.owner, row.fence, row.lease_until) == (
                r.state,
                r.owner,
                r.fence,
                r.lease_until,
            )
        return multiple(*handles)

    def _check_refusal(self, refused: StaleError | object | None, reason: str | None) -> None:
        if reason is None:
            assert not isinstance(refused, StaleError), refused
            return
        if not isinstance(refused, StaleError):
            self.stale_commits += 1
            raise AssertionError(f"a stale write ({reason}) was committed")
        assert refused.reason == reason, (refused.reason, reason)

    def _settled(
        self,
        item: Settlement,
        h: Handle,
        result: object,
        now: float,
        claim: PublisherClaim | None,
    ) -> None:
        """Check one item's result against the model and apply it."""
        reason = self._task_refusal(h, item.owner)
        self._check_refusal(result, reason)
        if reason is not None:
            return
        t = self.tasks_model[h.key]
        if item.result is not None:
            assert result == reply_id_for(h.key)
            self._terminal(t, "done", now, claim)
            return
        allowed = {FailOutcome.FAILED}
        ceiling = TASK_BACKOFF.ceiling(t.attempts)
        if item.retryable and t.attempts < t.max_attempts:
            if now + ceiling < t.deadline:
                allowed = {FailOutcome.RETRY}
            elif now + ceiling / 2 < t.deadline:
                allowed = {FailOutcome.RETRY, FailOutcome.FAILED}  # depends on the jitter
        assert result in allowed, (result, allowed)
        if result is FailOutcome.RETRY:
            row = self.tasks.get(h.key)
            assert row is not None
            assert now + ceiling / 2 <= row.not_before <= now + ceiling
            assert row.not_before < t.deadline
            t.state, t.owner, t.lease_until, t.not_before = "pending", None, None, row.not_before
        else:
            self._terminal(t, "failed", now, claim)

    @rule(h=task_handles, intruder=RARELY)
    def renew(self, h: Handle, intruder: bool) -> None:
        owner = "intruder" if intruder else h.owner
        reason = self._task_refusal(h, owner)
        if reason is not None:
            self._refused(lambda: self.tasks.renew(h.key, owner, h.fence), reason)
            return
        t = self.tasks_model[h.key]
        t.lease_until = self.clock.now() + LEASE_S
        assert self.tasks.renew(h.key, owner, h.fence) == t.lease_until

    @rule(task_id=task_ids, go=RARELY)
    def cancel(self, task_id: str, go: bool) -> None:
        if not go:  # keep cancellations rare, or they end most tasks before any claim
            return
        t = self.tasks_model[task_id]
        expected = "cancelled" if t.state in LIVE else t.state
        assert self.tasks.cancel(task_id).value == expected
        if t.state in LIVE:
            self._terminal(t, "cancelled", self.clock.now())

    @rule(seconds=st.sampled_from([0.25, 1.0, 4.0, 15.0, 29.0, 31.0, 120.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def reconcile(self) -> None:
        expected = self._reconcile_model(self.clock.now())
        assert self.tasks.reconcile() == expected

    # -- outbox -------------------------------------------------------------------------

    @rule(target=reply_handles, dispatcher=st.sampled_from(DISPATCHERS), n=st.integers(1, 2))
    def outbox_claim(self, dispatcher: str, n: int) -> Any:
        now = self.clock.now()
        for r in self.replies_model.values():
            if r.state == "sending" and r.lease_until is not None and r.lease_until <= now:
                # a publisher that died holding the row spent its attempt too
                r.state = "dead" if r.attempts >= OUTBOX_MAX_ATTEMPTS else "pending"
                r.owner, r.lease_until = None, None
        eligible = {
            r.reply_id: (r.not_before, r.created_at)
            for r in self.replies_model.values()
            if r.state == "pending" and r.not_before <= now
        }
        got = self.outbox.claim(dispatcher, n)
        assert len(got) == min(n, len(eligible))
        chosen = {g.reply_id for g in got}
        assert chosen <= set(eligible)
        rest = [key for rid, key in eligible.items() if rid not in chosen]
        if rest and chosen:
            assert max(eligible[rid] for rid in chosen) <= min(rest)
        handles = []
        for g in got:
            r = self.replies_model[g.reply_id]
            r.state, r.owner, r.lease_until = "sending", dispatcher, now + OUTBOX_LEASE_S
            r.attempts += 1
            r.fence += 1
            assert (g.attempts, g.fence) == (r.attempts, r.fence)
            handles.append(Handle(g.reply_id, dispatcher, g.fence))
        return multiple(*handles)

    @rule(h=reply_handles)
    def mark_sent(self, h: Handle) -> None:
        reason = self._reply_refusal(h)
        if reason is not None:
            self._refused(lambda: self.outbox.mark_sent(h.key, h.owner, h.fence, "1-0"), reason)
            return
        self.outbox.mark_sent(h.key, h.owner, h.fence, "1-0")
        r = self.replies_model[h.key]
        r.state, r.owner, r.lease_until = "sent", None, None

    @rule(h=reply_handles)
    def reply_retry(self, h: Handle) -> None:
        reason = self._reply_refusal(h)
        if reason is not None:
            self._refused(lambda: self.outbox.retry(h.key, h.owner, h.fence, "nope"), reason)
            return
        r = self.replies_model[h.key]
        now = self.clock.now()
        new_state = self.outbox.retry(h.key, h.owner, h.fence, "nope")
        assert new_state == ("dead" if r.attempts >= OUTBOX_MAX_ATTEMPTS else "pending")
        r.state, r.owner, r.lease_until = new_state, None, None
        (row,) = [o for o in dump(self.db)["outbox"] if o["reply_id"] == h.key]
        r.not_before = row["not_before"]
        if new_state == "pending":
            ceiling = OUTBOX_BACKOFF.ceiling(r.attempts)
            assert now + ceiling / 2 <= r.not_before <= now + ceiling

    @rule(h=reply_handles)
    def reply_dead(self, h: Handle) -> None:
        reason = self._reply_refusal(h)
        if reason is not None:
            self._refused(lambda: self.outbox.mark_dead(h.key, h.owner, h.fence, "perm"), reason)
            return
        self.outbox.mark_dead(h.key, h.owner, h.fence, "perm")
        r = self.replies_model[h.key]
        r.state, r.owner, r.lease_until = "dead", None, None

    @precondition(lambda self: any(r.state == "dead" for r in self.replies_model.values()))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        dead = sorted(k for k, r in self.replies_model.items() if r.state == "dead")
        reply_id = data.draw(st.sampled_from(dead))
        row = self.outbox.replay(reply_id, "ops")
        r = self.replies_model[reply_id]
        r.state, r.attempts, r.not_before = "pending", 0, self.clock.now()
        assert (row.state, row.attempts, row.replayed_by) == ("pending", 0, "ops")

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def no_stale_commit(self) -> None:
        assert self.stale_commits == 0

    @invariant()
    def database_matches_model(self) -> None:
        rows = dump(self.db)
        tasks = {t["task_id"]: t for t in rows["tasks"]}
        outbox = {o["reply_id"]: o for o in rows["outbox"]}
        assert set(tasks) == set(self.tasks_model)
        assert set(outbox) == set(self.replies_model)
        replies_per_task: dict[str, int] = {}
        for o in outbox.values():
            if o["task_id"] is not None:
                replies_per_task[o["task_id"]] = replies_per_task.get(o["task_id"], 0) + 1
        for task_id, row in tasks.items():
            m = self.tasks_model[task_id]
            n_replies = replies_per_task.get(task_id, 0)
            assert n_replies <= 1
            assert n_replies == (1 if row["state"] in TERMINAL else 0)
            assert row["attempts"] <= row["max_attempts"]
            assert row["deadline"] == self.deadlines[task_id]
            assert (row["state"], row["attempts"], row["fence"], row["owner"]) == (
                m.state,
                m.attempts,
                m.fence,
                m.owner,
            )
            assert (row["lease_until"], row["deadline"]) == (m.lease_until, m.deadline)
            if row["state"] == "pending":
                assert row["not_before"] == m.not_before
        for reply_id, row in outbox.items():
            r = self.replies_model[reply_id]
            assert (row["task_id"], row["state"], row["attempts"], row["fence"]) == (
                r.task_id,
                r.state,
                r.attempts,
                r.fence,
            )
            assert (row["owner"], row["lease_until"]) == (r.owner, r.lease_until)
            if r.task_id is not None:
                assert json.loads(row["body"])["status"] == self.tasks_model[r.task_id].state


class PostgresStoreMachine(StoreMachine):
    """The same machine on a PostgreSQL schema of its own per run."""


def test_store_state_machine_keeps_invariants() -> None:
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_store_state_machine_keeps_invariants_on_postgresql(
    pg_database: ThrowawayDatabase,
) -> None:
    """Fewer runs than on SQLite: each makes and migrates a schema of its own."""
    PostgresStoreMachine.fresh_postgres = pg_database.fresh_schema
    run_state_machine_as_test(
        PostgresStoreMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )

"""``broker-adapter demo`` (``make demo``): the guarantees, shown end to end on real Redis.

A throwaway Redis (``embedded``) and temporary SQLite files; every crash is a real process
killed by SIGKILL at a named crash point. The story:

1. two agents publish signed tasks, with a resend, a reused id with other content, and a
   spoofed sender;
2. ingest stores each request once, answers the conflict, dead-letters the spoof;
3. a worker process runs a handler's side effect and is killed before it commits; after its
   lease expires another worker takes the task with fence 2, and the zombie's commit with
   fence 1 is refused;
4. the dispatcher is killed after publishing a reply and before marking it sent: the resend
   carries the same reply id and adds no second entry;
5. the receiver is killed after committing an effect and before its XACK: the redelivered
   reply is recognised and the effect is not applied again; a forged reply, added under a
   real reply id before the real one, is refused for its signature and never applied;
6. a handler charges a card at a target that does not dedupe (declared irreversible, with
   a reconcile function) and its worker is killed after the charge: the task is not retried
   blindly but goes to ``unknown``; the reconcile finds the charge under the effect's
   idempotency key and ends the task ``done`` with one charge.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from broker_adapter import crashpoints
from broker_adapter.client.publisher import Publisher
from broker_adapter.errors import StaleError
from broker_adapter.handler.effects import Observation, effect_spec, side_effect
from broker_adapter.handler.task import Task
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.deadletter import DeadLetter
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.idempotency import idempotency_key_for
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import Reply
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.client import connect
from broker_adapter.redis.embedded import EmbeddedRedis
from broker_adapter.stages.dispatch.dispatcher import Dispatcher, DispatcherConfig
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.ingest.ingest import Ingestor
from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig, effect_key
from broker_adapter.stages.reconcile.reconciler import Reconciler
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.stages.worker.worker import Worker
from broker_adapter.store import (
    AcceptItem,
    ClaimedTask,
    OutboxStore,
    ReceiptStore,
    TaskStore,
    open_database,
)
from broker_adapter.store.effects import EffectsStore
from broker_adapter.store.task_types import TaskPolicy

PREFIX = "demo"
LEASE_S = 1.0
EFFECTS_ENV = "BA_DEMO_EFFECTS"
KEYRING = {
    "planner": {"k1": "planner-secret: demo only, never reuse (32+ bytes)"},
    "reviewer": {"k1": "reviewer-secret: demo only, never reuse (32+ bytes)"},
}


# -- the "outside world" the handler changes: an effects table keyed by idempotency key ----


def _effects_conn(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS effects (key TEXT PRIMARY KEY, message_id TEXT, fence INT)"
    )
    conn.execute(
        "CREATE TABLE IF NOT EXISTS attempts (key TEXT, message_id TEXT, fence INT, owner TEXT)"
    )
    return conn


def restart_service(task: Task) -> dict[str, Any]:
    """The demo handler: "restart" a service once per request, keyed by the idempotency key
    (a second attempt finds the effect already there and does not do it again)."""
    with closing(_effects_conn(os.environ[EFFECTS_ENV])) as conn:
        conn.execute(
            "INSERT INTO attempts VALUES (?, ?, ?, ?)",
            (task.idempotency_key, task.message_id, task.fence, task.owner),
        )
        conn.execute(
            "INSERT OR IGNORE INTO effects VALUES (?, ?, ?)",
            (task.idempotency_key, task.message_id, task.fence),
        )
    return {"restarted": task.payload.get("service"), "attempt": task.attempt}


def _charges_conn(path: str) -> sqlite3.Connection:
    """A card processor that does NOT dedupe: every request is a charge (it only records
    the idempotency key it was sent, so that a reconcile can ask about it)."""
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS charges (key TEXT, amount INT)")
    return conn


def card_charged(task: ClaimedTask, key: str) -> Observation:
    """The reconcile: ask the processor for charges under the effect's idempotency key."""
    with closing(_charges_conn(os.environ[EFFECTS_ENV])) as conn:
        n = conn.execute("SELECT count(*) FROM charges WHERE key = ?", (key,)).fetchone()[0]
    if n == 0:
        return Observation.not_happened("no charge under the key")
    return Observation.happened({"charged": task.payload["amount"]}, applied=n)


@side_effect("charge_card", reconcile=card_charged)
def charge_card(task: Task) -> dict[str, Any]:
    """The demo's irreversible handler: one charge per call, the target does not dedupe."""
    with closing(_charges_conn(os.environ[EFFECTS_ENV])) as conn:
        conn.execute(
            "INSERT INTO charges VALUES (?, ?)",
            (task.effect_key("charge_card"), task.payload["amount"]),
        )
    return {"charged": task.payload["amount"]}


# -- children: each is a real process that a crash point kills ----------------------------


def _arm(point: str) -> None:
    os.environ[crashpoints.ENV_CRASH] = point
    crashpoints.reset()


def _worker_child(db_path: str, point: str) -> None:
    _arm(point)
    db = open_database(db_path)
    tasks = TaskStore(db, policy=TaskPolicy(lease_s=LEASE_S))
    Worker(WorkerConfig(owner="worker-A"), tasks, restart_service).run_once(1)


def _charge_child(db_path: str, point: str) -> None:
    _arm(point)
    db = open_database(db_path)
    tasks = TaskStore(db, policy=TaskPolicy(lease_s=LEASE_S))
    Worker(WorkerConfig(owner="worker-C"), tasks, charge_card).run_once(1)


def _dispatcher_child(db_path: str, url: str, point: str) -> None:
    _arm(point)
    db = open_database(db_path)
    cfg = DispatcherConfig(prefix=PREFIX, owner="dispatcher-1", batch=64)
    Dispatcher(cfg, connect(url), OutboxStore(db), keyring=Keyring(KEYRING)).step()


def _receiver_child(db_path: str, url: str, principal: str, point: str) -> None:
    _arm(point)
    _drain(_receiver(db_path, url, principal).step)


def _receiver(db_path: str, url: str, principal: str) -> Receiver:
    cfg = ReceiverConfig(
        prefix=PREFIX, principal=principal, consumer=f"{principal}-1", block_ms=100
    )
    receipts = ReceiptStore(open_database(db_path))
    return Receiver(cfg, connect(url), receipts, _receiver_effect, keyring=Keyring(KEYRING))


def _receiver_effect(conn: sqlite3.Connection, reply: Reply) -> dict[str, Any]:
    conn.execute("CREATE TABLE IF NOT EXISTS applied (reply_id TEXT, message_id TEXT, status TEXT)")
    conn.execute(
        "INSERT INTO applied VALUES (?, ?, ?)", (reply.reply_id, reply.message_id, reply.status)
    )
    return {"key": effect_key(reply).idempotency_key}


def _drain(step: Any, quiet_rounds: int = 2, max_rounds: int = 1000) -> None:
    """Call ``step`` until it has done nothing ``quiet_rounds`` times in a row (the first
    read after a start replays the consumer's own pending list, which may be empty)."""
    quiet = 0
    for _ in range(max_rounds):
        quiet = quiet + 1 if step() == 0 else 0
        if quiet >= quiet_rounds:
            return


def _run_child(target: Any, *args: Any) -> int | None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=target, args=args)
    proc.start()
    proc.join(60)
    return proc.exitcode


# -- the story -----------------------------------------------------------------------------


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(keep: Path | None = None) -> int:
    """Run the story and print the report. Returns 0 when every check held.

    Args:
        keep: a directory to keep the demo's databases in, for the web console.
    """
    from broker_adapter.app.demo_console import check_keep, console_hint, keep_for_console

    if keep is not None:
        check_keep(keep)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ba-demo-") as tmp, EmbeddedRedis.start() as redis:
        ok = _story(Path(tmp), redis)
        if keep is not None:
            keep_for_console(Path(tmp), keep)
    _say(f"\n{'PASS' if ok else 'FAIL'} in {time.monotonic() - started:.1f} s\n")
    for line in console_hint(keep, PREFIX):
        _say(line)
    return 0 if ok else 1


def _story(tmp: Path, redis: EmbeddedRedis) -> bool:
    db_path, rdb_path = str(tmp / "adapter.db"), str(tmp / "planner.db")
    os.environ[EFFECTS_ENV] = str(tmp / "world.db")
    keys, keyring = Keys(PREFIX), Keyring(KEYRING)
    client = connect(redis.url)
    _say(f"broker_adapter demo on {redis.kind}, Redis {redis.version}\n")

    _say("1. Agents publish signed tasks to the inbound stream")
    planner = Publisher(client, keys, "planner", keyring)
    deadline = time.time() + 120
    services = ["web", "db", "cache"]
    for service in services:
        env = Envelope.build(
            message_id=f"restart-{service}",
            sender="planner",
            payload={"service": service},
            deadline=deadline,
        )
        planner.publish(env)
    planner.publish(
        Envelope.build(
            message_id="restart-web",
            sender="planner",
            payload={"service": "web"},
            deadline=deadline,
        )
    )
    planner.publish(
        Envelope.build(
            message_id="restart-db",
            sender="planner",
            payload={"service": "db", "force": True},
            deadline=deadline,
        )
    )
    spoof = Envelope.build(
        message_id="restart-all", sender="planner", payload={"service": "*"}, deadline=deadline
    )
    fields = keyring.sign(spoof.replace(sender="reviewer"))
    fields["env"] = spoof.to_json()  # claims to be planner, signed with reviewer's key
    client.xadd(keys.inbound(), fields)  # type: ignore[arg-type]
    _say("   planner: restart-web, restart-db, restart-cache; restart-web again (a resend);")
    _say("   restart-db again with other content; someone signs 'restart-all' as planner\n")

    db = open_database(db_path)
    tasks = TaskStore(db, policy=TaskPolicy(lease_s=LEASE_S))
    ingest = Ingestor(
        IngestConfig(prefix=PREFIX, consumer="ingest-1", block_ms=100), client, tasks, keyring
    )
    _drain(ingest.step)
    s = ingest.stats
    _say("2. Ingest: one SQLite transaction for the batch, then one XACK")
    _say(
        f"   stored {s.accepted}, duplicates {s.duplicates}, conflicts {s.conflicts} "
        f"(answered, first request kept), dead-lettered {dict(s.dead_lettered)}"
    )
    dead: Any = client.xrange(keys.inbound_dead())
    for _, f in dead:
        letter = DeadLetter.parse(f)
        _say(f"   dead letter: reason={letter.reason} ({letter.detail})")
    _say()

    _say("3. Worker A runs restart-web's side effect and is SIGKILLed before committing")
    code = _run_child(_worker_child, db_path, "worker.after_effect")
    web = tasks.find("planner", "restart-web")
    assert web is not None
    _say(
        f"   worker A exit code {code}; task state {web.state}, fence {web.fence}, "
        f"lease held by {web.owner}"
    )
    time.sleep(LEASE_S + 0.1)  # a demo runs on the real clock: let the lease run out
    worker_b = Worker(WorkerConfig(owner="worker-B"), tasks, restart_service)
    _drain(lambda: worker_b.run_once(10))
    web = tasks.find("planner", "restart-web")
    assert web is not None
    _say(
        f"   lease expired; worker B reclaimed it: attempt {web.attempts}, fence {web.fence}, "
        f"state {web.state}"
    )
    try:
        tasks.finish(web.task_id, "worker-A", 1, {"restarted": "web"})
        stale_refused = False
        _say("   worker A's late commit with fence 1 was ACCEPTED (bug)")
    except StaleError as exc:
        stale_refused = True
        _say(f"   worker A wakes up and commits with fence 1: refused ({exc.reason})")
    with closing(_effects_conn(os.environ[EFFECTS_ENV])) as world:
        attempts = world.execute(
            "SELECT count(*) FROM attempts WHERE message_id = 'restart-web'"
        ).fetchone()[0]
        effects = dict(world.execute("SELECT message_id, count(*) FROM effects GROUP BY 1"))
    restarted = effects.get("restart-web", 0)
    key = idempotency_key_for(web.principal, web.message_id)
    _say(
        f"   restart-web: handler ran {attempts} times, the service restarted {restarted} "
        f"time (idempotency key …{key[-8:]})\n"
    )

    forged = _forge_reply(client, keys, db)
    _say("4. The dispatcher publishes the replies and is SIGKILLed before marking them sent")
    _say("   (an outsider has already added a forged 'done' reply under restart-db's real")
    _say("   reply id, before the real one)")
    code = _run_child(_dispatcher_child, db_path, redis.url, "dispatcher.after_xadd")
    outbox = OutboxStore(db)
    replies_key = keys.replies("planner")
    before = client.xlen(replies_key) - 1  # the forgery is not ours
    _say(
        f"   dispatcher exit code {code}; reply entries on the stream: {before}, "
        f"outbox sent: {outbox.counts()['sent']}"
    )
    dispatcher = Dispatcher(
        DispatcherConfig(prefix=PREFIX, owner="dispatcher-2"),
        client,
        _expired_lease_outbox(db),
        keyring=keyring,
    )
    _drain(dispatcher.step)
    after = client.xlen(replies_key) - 1
    _say(
        f"   restarted: re-sent under the same reply ids, {dispatcher.stats.already_published}"
        f" already recorded; entries on the stream still {after}\n"
    )

    _say("5. The receiver applies a reply and is SIGKILLed before its XACK")
    code = _run_child(_receiver_child, rdb_path, redis.url, "planner", "receiver.after_commit")
    receiver = _receiver(rdb_path, redis.url, "planner")
    _drain(receiver.step)
    st = receiver.stats
    _say(
        f"   receiver exit code {code}; on restart the redelivered replies were recognised: "
        f"{st.duplicates} duplicates skipped, {st.applied} new"
    )
    reply_dead: Any = client.xrange(keys.replies_dead("planner"))
    letters = [DeadLetter.parse(f) for _, f in reply_dead]
    refused = {dl.source_entry_id: dl.reason for dl in letters}
    forgery_refused = refused.get(forged) == "bad_signature"
    _say(
        f"   the forged reply: dead-lettered as {refused.get(forged, 'nothing (APPLIED!)')}, "
        "before any receipt; the real one was applied"
    )
    _say()
    once = _unknown_story(str(tmp / "charges.db"))
    return _report(db, rdb_path, stale_refused, before == after, forgery_refused, once)


def _unknown_story(db_path: str) -> bool:
    """Step 6: an irreversible effect at a target that does not dedupe."""
    _say("6. A handler charges a card at a processor that does not dedupe, and is SIGKILLed")
    _say("   after the charge (the handler is declared @side_effect: irreversible, reconcile)")
    tasks = TaskStore(open_database(db_path), policy=TaskPolicy(lease_s=LEASE_S))
    env = Envelope.build(
        message_id="charge-42", sender="planner", payload={"amount": 42}, deadline=time.time() + 120
    )
    tasks.accept([AcceptItem("planner", env)])
    code = _run_child(_charge_child, db_path, "worker.after_effect")
    time.sleep(LEASE_S + 0.1)  # a demo runs on the real clock: let the lease run out
    taken = tasks.reconcile()
    task = tasks.find("planner", "charge-42")
    assert task is not None
    _say(
        f"   worker C exit code {code}; its lease ran out after the charge started:"
        f" {taken.get('unknown', 0)} task taken back as {task.state}, not pending"
    )
    retried = Worker(WorkerConfig(owner="worker-D"), tasks, charge_card).run_once(10)
    _say(f"   another worker finds nothing to retry blindly: {retried} claimed")
    fx = EffectsStore(tasks.tx)
    spec = effect_spec(charge_card)
    assert spec is not None
    Reconciler(fx, spec, "reconciler").run_once()
    task = tasks.find("planner", "charge-42")
    assert task is not None
    (record,) = fx.reconcile_log(task.task_id)
    with closing(_charges_conn(os.environ[EFFECTS_ENV])) as conn:
        charges = conn.execute("SELECT count(*) FROM charges").fetchone()[0]
    _say(
        f"   the reconcile asked the processor under the effect's idempotency key: "
        f"{record.outcome}; task {task.state}, charges {charges}\n"
    )
    tasks.db.close()
    return task.state == "done" and charges == 1 and retried == 0


def _forge_reply(client: Any, keys: Keys, db: Any) -> str:
    """What any Redis client can do: add a 'done' reply under a real reply id, signed with a
    key it made up. Returns the forged entry's id."""
    with db.read() as c:
        (reply_id,) = c.execute(
            "SELECT o.reply_id FROM outbox o JOIN tasks t ON t.task_id = o.task_id"
            " WHERE t.message_id = 'restart-db'"
        ).fetchone()
    body = canonical_json(
        {
            "principal": "planner",
            "reply_id": reply_id,
            "status": "done",
            "result": {"approved": True, "amount": 1_000_000},
        }
    )
    made_up = Keyring({"planner": {"k1": "an outsider's guess at planner's key, 32+ bytes"}})
    signed = made_up.sign_reply("planner", reply_id, body)
    fields = {
        "v": "2",
        "reply_id": reply_id,
        "hash": sha256_hex(body),
        "body": body,
        "kid": signed.kid,
        "sig": signed.sig,
    }
    entry_id = client.xadd(keys.replies("planner"), fields)
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _expired_lease_outbox(db: Any) -> OutboxStore:
    """An outbox view whose clock is past the killed dispatcher's lease, so the restarted
    dispatcher may take its rows at once (in production: after ``lease_s``)."""

    class _Later:
        def now(self) -> float:
            return time.time() + 3600

    return OutboxStore(db, _Later())


def _report(
    db: Any,
    rdb_path: str,
    stale_refused: bool,
    one_entry_per_reply: bool,
    forgery_refused: bool,
    unknown_reconciled_once: bool,
) -> bool:
    with closing(sqlite3.connect(rdb_path)) as rconn:
        applied: dict[str, int] = {}
        for reply_id, n in rconn.execute("SELECT reply_id, count(*) FROM applied GROUP BY 1"):
            applied[str(reply_id)] = int(n)
    with db.read() as c:
        rows = c.execute(
            "SELECT t.message_id, t.state, t.attempts, t.fence, o.reply_id, o.state AS ostate"
            " FROM tasks t JOIN outbox o ON o.task_id = t.task_id ORDER BY t.message_id"
        ).fetchall()
        conflict_ids = [
            r[0] for r in c.execute("SELECT reply_id FROM outbox WHERE task_id IS NULL")
        ]
    _say("Report")
    _say(
        f"   {'message':<15} {'state':<6} {'attempts':>8} {'fence':>5}  {'reply':<14} "
        f"{'receiver effects':>16}"
    )
    ok = stale_refused and one_entry_per_reply
    for r in rows:
        n = applied.get(r["reply_id"], 0)
        ok = ok and n == 1 and r["state"] == "done" and r["ostate"] == "sent"
        _say(
            f"   {r['message_id']:<15} {r['state']:<6} {r['attempts']:>8} {r['fence']:>5}  "
            f"{'r-…' + r['reply_id'][-10:]:<14} {n:>16}"
        )
    delivered = sum(applied.get(rid, 0) for rid in conflict_ids)
    ok = ok and delivered == len(conflict_ids)
    _say(
        f"   + {len(conflict_ids)} conflict answer(s), applied {delivered} time(s) by the "
        "receiver; spoofed request: no task, no effect"
    )
    checks = {
        "every request exactly one terminal state and one receiver effect": ok,
        "stale commit refused": stale_refused,
        "one stream entry per reply id": one_entry_per_reply,
        "forged reply refused, never applied": forgery_refused,
        "unknown outcome reconciled: one charge, no blind retry": unknown_reconciled_once,
    }
    for name, good in checks.items():
        _say(f"   [{'ok' if good else 'FAILED'}] {name}")
    return all(checks.values())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(run_demo())

__all__ = ["card_charged", "charge_card", "restart_service", "run_demo"]

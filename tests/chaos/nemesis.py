"""The nemesis: Jepsen's package generator over the faults this host can inject.

Every period (``period_s``, drawn per period) it picks a random non-empty subset of the
enabled packages (dealt from a shuffled deck, so all come up), or none with probability
``quiet_p``, starts each, waits out the period,
and runs each package's stop step. Every start and stop is logged with a fault id, so the
checker can tie a loss to a fault window. ``heal()`` ends everything: SIGCONT, proxy back to
pass, CLIENT UNPAUSE, Redis up, every component restarted unarmed.

Packages (the kind is the ``fault`` field of the history event):

* ``kill-adapter`` / ``kill-receiver``: SIGKILL the process group / restart it at stop;
* ``kill-worker``: SIGKILL one worker child (its runner replaces it);
* ``crashpoint``: restart a component with ``BA_CRASHPOINT=<point>@<n>``; it dies there and
  the supervisor restarts it unarmed (stop: disarm if it never fired);
* ``pausepoint``: restart an adapter with ``BA_PAUSEPOINT``; a worker stops itself there and
  the supervisor resumes it past the lease (a zombie);
* ``pause-adapter`` / ``pause-receiver``: SIGSTOP a whole adapter, one worker child or a
  receiver for the period / SIGCONT;
* ``redis-kill`` (``redis-wipe`` in ephemeral mode): SIGKILL redis-server, restart it
  (wiped) after a short outage;
* ``redis-tail-loss`` (everysec mode only): SIGKILL redis-server, truncate its AOF at a
  command boundary after the fault's start (a power loss), restart it;
* ``net``: through the proxy: reset every connection, delay, drop one reply, cut a reply
  after n bytes, or blackhole;
* ``client-pause``: ``CLIENT PAUSE <ms> ALL|WRITE``;
* ``idle-skew``: ``XCLAIM ... IDLE 3600000 JUSTID`` on every pending entry of every group;
* ``storm``: ``XGROUP SETID <replies> ba-receiver 0`` and agents re-publish recent keys;
* ``sqlite-busy``: another connection holds ``BEGIN IMMEDIATE`` on the adapter database;
* ``pg-terminate`` (PostgreSQL store, instead of ``sqlite-busy``): ``pg_terminate_backend``
  of every session the adapters (and the canceller's store) hold on the run's database
  (``application_name = 'broker_adapter'``), mid-transaction or idle in their pools;
* ``client-kill`` (Redis Cluster, instead of ``net``, which needs the proxy): ``CLIENT
  KILL TYPE normal`` on one master or on every node: each client's connections drop;
* ``master-kill`` (Redis Cluster, instead of ``redis-kill``): SIGKILL one master (AOF
  always), restart it on its port after an outage that may outlast the cluster's node
  timeout (every node then answers CLUSTERDOWN until it is back); its replica, if it is
  the replicated one, never takes over (``cluster-replica-no-failover``), so nothing it
  acknowledged is lost;
* ``forge-reply``: 2-5 forged replies on the reply streams (``hostile.FORGERY_SHAPES``:
  unsigned, a wrong secret, another principal's key; dealt from a deck of their own),
  under invented reply ids or the real ``r-<task id>`` of a task not answered yet (read
  from the adapter database), so that the forgery comes BEFORE the real reply; logged as
  history ``forge`` events;
* ``poison-reply``: the same with poisoned entries (``hostile.REPLY_POISON_SHAPES``: ~4,000
  or ~10,000 fields, a repeated field, over a megabyte, 64 MB, a signed body nested too
  deep, a signed body made 30 days ago);
* ``epoch-del``: ``DEL`` of the data-loss watch's epoch key alone (Redis keeps its data:
  a dispatcher must not take it for a wipe; the key is set back);
* ``replay``: byte-identical copies of 2-6 real inbound entries appended again, picked from
  the newest 20 (their tasks may still run) or the oldest 200 of the stream (long
  terminal); history ``replay``.

``packages_for`` says which packages a Redis mode, a topology (``single``: one server
behind the proxy; ``cluster``: a local Redis Cluster, no proxy) and a store (``sqlite``,
``postgresql``) allow.

The hostile packages open a fault window for the period but excuse nothing: the checker
judges exits, dead letters and receipts the same inside and outside it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import sqlite3
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from broker_adapter import crashpoints
from broker_adapter.protocol.canonical import sha256_hex
from broker_adapter.protocol.keys import INGEST_GROUP, RECEIVER_GROUP, Keys, partition_of
from broker_adapter.protocol.reply import reply_id_for
from broker_adapter.redis.client import text
from tests.chaos.cluster import Cluster, Component
from tests.chaos.finalread import CHAOS_KEY_FIELD, StoreTarget, store_rows
from tests.chaos.history import INFO, INVOKE, OK, History
from tests.chaos.hostile import (
    FORGERY_SHAPES,
    REPLY_POISON_SHAPES,
    flat,
    forged_body,
    reply_entry,
)
from tests.chaos.workload import Workload

ADAPTER_POINTS = tuple(
    p
    for p in (
        "ingest.after_read",
        "ingest.after_commit",
        "ingest.after_xack",
        "ingest.after_dead_letter",
        "ingest.after_autoclaim",
        "worker.after_claim",
        "worker.after_effect",
        "worker.after_finish",
        "dispatcher.before_xadd",
        "dispatcher.after_xadd",
        "dispatcher.after_mark_sent",
        *(
            f"store.{op}.{when}"
            for op in (
                "accept",
                "claim",
                "renew",
                "finish",
                "fail",
                "outbox_claim",
                "mark_sent",
                "reply_retry",
            )
            for when in ("before_commit", "after_commit")
        ),
    )
    if p in crashpoints.POINTS
)
RECEIVER_POINTS = tuple(
    p
    for p in (
        "receiver.before_commit",
        "receiver.after_commit",
        "receiver.after_xack",
        "store.receipt.before_commit",
        "store.receipt.after_commit",
    )
    if p in crashpoints.POINTS
)
PAUSE_POINTS = tuple(
    p
    for p in ("worker.after_claim", "worker.after_effect", "store.finish.before_commit")
    if p in crashpoints.POINTS
)
NET_MODES = ("reset", "delay", "drop", "cut", "blackhole")
DROP_MATCHES = (b"XADD", b"XACK", b"EVALSHA", b"XREADGROUP", b"XAUTOCLAIM", b"EVAL")
HOSTILE_PACKAGES = ("forge-reply", "poison-reply", "replay")
COMMON_PACKAGES = (
    "kill-adapter",
    "kill-worker",
    "kill-receiver",
    "crashpoint",
    "pausepoint",
    "pause-adapter",
    "pause-receiver",
    "net",
    "client-pause",
    "idle-skew",
    "storm",
    "sqlite-busy",
    "epoch-del",
    *HOSTILE_PACKAGES,
)
#: Entries ``replay`` picks from: the newest few (their tasks may still run) or the oldest.
REPLAY_SOON, REPLAY_LATE = 20, 200
SKEW_IDLE_MS = 3_600_000
BUSY_HOLD_MAX_S = 3.0
TOPOLOGIES = ("single", "cluster")
STORES = ("sqlite", "postgresql")
#: What stands in for a package on a Redis Cluster: no proxy can sit in front of one
#: (its clients follow MOVED to the nodes' own addresses), and a kill is one master's.
CLUSTER_SWAPS = {"net": "client-kill", "redis-kill": "master-kill"}
#: What stands in for a package on a PostgreSQL store (no SQLite file to lock).
POSTGRES_SWAPS = {"sqlite-busy": "pg-terminate"}
#: The session name of every store connection of the adapters (``store.postgres.db``).
PG_APPLICATION = "broker_adapter"
MASTER_DOWN_S = (0.3, 2.5)


def packages_for(mode: str, topology: str = "single", store: str = "sqlite") -> tuple[str, ...]:
    """The packages a Redis mode, topology and store allow: a kill is a wipe without
    persistence, and only ``everysec`` may lose an acknowledged write's tail; a cluster
    (AOF always only) swaps the proxy's faults and the server kill for its own
    (``CLUSTER_SWAPS``), a PostgreSQL store the SQLite lock for its own
    (``POSTGRES_SWAPS``)."""
    if topology not in TOPOLOGIES or store not in STORES:
        raise ValueError(f"topology {topology!r} or store {store!r} unknown")
    if mode == "ephemeral":
        names: tuple[str, ...] = (*COMMON_PACKAGES, "redis-wipe")
    elif mode == "everysec":
        names = (*COMMON_PACKAGES, "redis-kill", "redis-tail-loss")
    else:
        names = (*COMMON_PACKAGES, "redis-kill")
    swaps: dict[str, str] = {}
    if topology == "cluster":
        if mode != "durable":
            raise ValueError("a Redis Cluster run is durable (AOF always) only")
        swaps.update(CLUSTER_SWAPS)
    if store == "postgresql":
        swaps.update(POSTGRES_SWAPS)
    return tuple(swaps.get(n, n) for n in names)


def newest_incr_aof(redis_dir: Path) -> Path | None:
    """The AOF file Redis 7 appends to (the highest-numbered ``*.incr.aof``)."""

    def seq(path: Path) -> int:
        digits = path.name.removesuffix(".incr.aof").rpartition(".")[2]
        return int(digits) if digits.isdigit() else -1

    files = sorted(redis_dir.glob("**/*.incr.aof"), key=seq)
    return files[-1] if files else None


def command_starts(data: bytes, start: int) -> list[int]:
    """Offsets of the RESP commands (``*<n>`` arrays of bulk strings) that begin at or after
    ``start``, which must itself be a command boundary. A torn last command is left out."""
    out: list[int] = []
    i = start
    while i < len(data) and data[i : i + 1] == b"*":
        begin = i
        try:
            eol = data.index(b"\r\n", i)
            n = int(data[i + 1 : eol])
            i = eol + 2
            for _ in range(n):
                eol = data.index(b"\r\n", i)
                size = int(data[i + 1 : eol])
                i = eol + 2 + size + 2
        except ValueError:
            break
        if i > len(data):
            break
        out.append(begin)
    return out


@dataclass
class Fault:
    fid: str
    fault: str
    target: str
    stop: Callable[[], None] | None = None


class Nemesis:
    """Runs the fault schedule against a ``Cluster``.

    Args:
        cluster: the components, Redis and the proxy.
        workload: the agents (for ``storm`` re-publishes).
        history: where faults are logged (``proc`` ``nemesis``).
        rng: the seeded generator of the schedule.
        packages: the enabled packages.
        mode: ``durable``, ``everysec`` or ``ephemeral``.
        lease_s: the adapters' lease (pauses outlast it).
        adapter_db: the adapter database: a SQLite file (``sqlite-busy``) or a PostgreSQL
            URL (``pg-terminate``).
        prefix: the Redis key prefix.
        principals: every agent principal (reply streams).
        period_s: bounds of one period, seconds.
        quiet_p: probability of a period without faults.
        max_packages: most packages started in one period.
        keyring: every principal's keys (``forge-reply`` and ``poison-reply`` sign with
            them, wrongly or not); without it those two packages do nothing.
        partitions: the inbound partition streams (``replay``, ``idle-skew``).
    """

    def __init__(
        self,
        cluster: Cluster,
        workload: Workload,
        history: History,
        rng: random.Random,
        packages: tuple[str, ...],
        *,
        mode: str,
        lease_s: float,
        adapter_db: StoreTarget,
        prefix: str,
        principals: tuple[str, ...],
        period_s: tuple[float, float] = (2.0, 4.0),
        quiet_p: float = 0.25,
        max_packages: int = 3,
        keyring: Mapping[str, Mapping[str, str]] | None = None,
        partitions: int = 1,
    ) -> None:
        self.cluster = cluster
        self.workload = workload
        self.history = history
        self.rng = rng
        self.packages = packages
        self.mode = mode
        self.lease_s = lease_s
        self.adapter_db = adapter_db
        self.keys = Keys(prefix)
        self.principals = principals
        self.period_s = period_s
        self.quiet_p = quiet_p
        self.max_packages = max_packages
        self.keyring = keyring
        self.inbound = self.keys.inbound_partitions(partitions)
        #: The partitions the agents publish to (``replay`` copies from these).
        self.published_to = sorted(
            {self.keys.inbound_partition(partition_of(p, partitions)) for p in principals}
        )
        self.prng = random.Random(rng.getrandbits(64))  # per started package (see ``run``)
        self.active: list[Fault] = []
        self._deck: list[str] = []
        self._shape_decks: dict[str, list[str]] = {}
        self._admin: redis.Redis | None = None
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._busy_release = threading.Event()

    def admin(self) -> redis.Redis:
        """A direct (not proxied) client for administrative commands."""
        if self._admin is None:
            self._admin = self.cluster.admin()
        return self._admin

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def draw(self, k: int) -> list[str]:
        """``k`` different packages from a shuffled deck: every package comes up once before
        any comes up twice, so even a short run covers them all."""
        chosen: list[str] = []
        while len(chosen) < k:
            if not self._deck:
                self._deck = list(self.packages)
                self.rng.shuffle(self._deck)
            name = self._deck.pop()
            if name in chosen:
                self._deck.insert(0, name)
            else:
                chosen.append(name)
        return chosen

    # -- logging ----------------------------------------------------------------------------

    def begin(self, fault: str, target: str = "", **extra: Any) -> Fault:
        f = Fault(str(next(self._ids)), fault, target)
        self.history.log(
            INFO,
            "start",
            value={"id": f.fid, "fault": fault, "target": target, **extra},
            proc="nemesis",
        )
        return f

    def end(self, f: Fault, **extra: Any) -> None:
        self.history.log(
            INFO,
            "stop",
            value={"id": f.fid, "fault": f.fault, "target": f.target, **extra},
            proc="nemesis",
        )

    def instant(self, fault: str, target: str = "", **extra: Any) -> None:
        self.end(self.begin(fault, target, **extra))

    # -- the schedule -----------------------------------------------------------------------

    def run(self, until_monotonic: float) -> None:
        """Run periods until ``until_monotonic`` (or ``stop``), then stop the last faults."""
        import time

        while not self._stop.is_set() and time.monotonic() < until_monotonic:
            # A fixed number of draws per period: the schedule (periods, packages, and one
            # seed per started package) replays from the seed whatever the run's timing.
            period = self.rng.uniform(*self.period_s)
            quiet = self.rng.random() < self.quiet_p or not self.packages
            k = self.rng.randint(1, max(1, min(self.max_packages, len(self.packages))))
            chosen = [] if quiet else self.draw(k)
            for name, seed in [(name, self.rng.getrandbits(64)) for name in chosen]:
                self.prng = random.Random(seed)
                try:
                    fault = self.start_package(name)
                except (redis.RedisError, OSError) as exc:
                    self.history.log(
                        INFO, "skip", value={"fault": name}, error=str(exc), proc="nemesis"
                    )
                    continue
                if fault is not None:
                    self.active.append(fault)
            self._stop.wait(min(period, max(0.0, until_monotonic - time.monotonic())))
            self.stop_active()

    def stop(self) -> None:
        self._stop.set()

    def stop_active(self) -> None:
        while self.active:
            fault = self.active.pop()
            try:
                if fault.stop is not None:
                    fault.stop()
            except (redis.RedisError, OSError) as exc:
                self.history.log(
                    INFO, "stop-error", value={"fault": fault.fault}, error=str(exc), proc="nemesis"
                )
            self.end(fault)

    def heal(self) -> None:
        """Stop every fault and bring everything back, unarmed."""
        self.stop()
        self.stop_active()
        self._busy_release.set()
        if self.cluster.proxy is not None:
            self.cluster.proxy.heal()
        self.cluster.start_redis()
        for node in self.cluster.nodes():
            with contextlib.suppress(redis.RedisError), node.client(socket_timeout=5) as c:
                c.execute_command("CLIENT", "UNPAUSE")
        self.cluster.heal_processes()
        self.close()
        self.history.log(INFO, "heal", proc="run")

    # -- packages ---------------------------------------------------------------------------

    def start_package(self, name: str) -> Fault | None:
        starters: dict[str, Callable[[], Fault | None]] = {
            "kill-adapter": lambda: self.kill("adapter"),
            "kill-receiver": lambda: self.kill("receiver"),
            "kill-worker": self.kill_worker,
            "crashpoint": self.crashpoint,
            "pausepoint": self.pausepoint,
            "pause-adapter": lambda: self.pause("adapter"),
            "pause-receiver": lambda: self.pause("receiver"),
            "redis-kill": lambda: self.redis_kill(wipe=False),
            "redis-wipe": lambda: self.redis_kill(wipe=True),
            "redis-tail-loss": self.redis_tail_loss,
            "master-kill": self.master_kill,
            "net": self.net,
            "client-kill": self.client_kill,
            "client-pause": self.client_pause,
            "idle-skew": self.idle_skew,
            "storm": self.storm,
            "sqlite-busy": self.sqlite_busy,
            "pg-terminate": self.pg_terminate,
            "forge-reply": lambda: self.hostile_replies("forge-reply", FORGERY_SHAPES),
            "poison-reply": lambda: self.hostile_replies("poison-reply", REPLY_POISON_SHAPES),
            "replay": self.replay,
            "epoch-del": self.epoch_del,
        }
        return starters[name]()

    def epoch_del(self) -> Fault | None:
        """``DEL`` the epoch key alone (see the module docstring)."""
        deleted = int(self.admin().delete(self.keys.epoch()))
        self.instant("epoch-del", "redis", deleted=deleted)
        return None

    def _pick(self, role: str) -> Component | None:
        comps = [c for c in self.cluster.role(role) if c.alive() and not c.hold_down]
        return self.prng.choice(comps) if comps else None

    def kill(self, role: str, comp: Component | None = None) -> Fault | None:
        comp = comp or self._pick(role)
        if comp is None:
            return None
        with self.cluster.lock:
            comp.hold_down = True
            comp.kill()
        f = self.begin(f"kill-{role}", comp.name)

        def stop() -> None:
            with self.cluster.lock:
                if comp.hold_down:
                    self.cluster.restart(comp, why="nemesis")

        f.stop = stop
        return f

    def kill_worker(self) -> Fault | None:
        comp = self._pick("adapter")
        pids = comp.worker_pids() if comp is not None else []
        if comp is None or not pids:
            return None
        pid = self.prng.choice(pids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.instant("kill-worker", comp.name, pid=pid)
        return None

    def crashpoint(self, comp: Component | None = None, spec: str | None = None) -> Fault | None:
        if comp is None:
            role = "receiver" if self.prng.random() < 0.25 else "adapter"
            comp = self._pick(role)
        if comp is None:
            return None
        if spec is None:
            points = RECEIVER_POINTS if comp.role == "receiver" else ADAPTER_POINTS
            spec = f"{self.prng.choice(points)}@{self.prng.randint(1, 3)}"
        self.cluster.restart(comp, armed={crashpoints.ENV_CRASH: spec}, why="crashpoint")
        f = self.begin("crashpoint", comp.name, point=spec)

        def stop() -> None:
            with self.cluster.lock:
                if comp.armed.get(crashpoints.ENV_CRASH) == spec and comp.alive():
                    self.cluster.restart(comp, why="disarm")

        f.stop = stop
        return f

    def pausepoint(self, comp: Component | None = None, spec: str | None = None) -> Fault | None:
        comp = comp or self._pick("adapter")
        if comp is None:
            return None
        spec = spec or f"{self.prng.choice(PAUSE_POINTS)}@{self.prng.randint(1, 2)}"
        self.cluster.restart(comp, armed={crashpoints.ENV_PAUSE: spec}, why="pausepoint")
        return self.begin("pausepoint", comp.name, point=spec)

    def pause(self, role: str, comp: Component | None = None) -> Fault | None:
        comp = comp or self._pick(role)
        if comp is None:
            return None
        workers = comp.worker_pids() if role == "adapter" else []
        if workers and self.prng.random() < 0.5:
            pid = self.prng.choice(workers)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            f = self.begin(f"pause-{role}", comp.name, pid=pid)

            def resume_one() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

            f.stop = resume_one
            return f
        comp.pause()
        f = self.begin(f"pause-{role}", comp.name, whole=True)
        f.stop = comp.resume
        return f

    def redis_kill(self, *, wipe: bool, down_s: float | None = None) -> Fault | None:
        fault = "redis-wipe" if wipe else "redis-kill"
        f = self.begin(fault, "redis")
        self.cluster.kill_redis()
        self._stop.wait(down_s if down_s is not None else self.prng.uniform(0.2, 1.5))
        self.cluster.start_redis(wipe=wipe)
        self.end(f)
        return None

    def master_kill(self) -> Fault | None:
        """SIGKILL one cluster master and restart it (AOF always) after a short outage."""
        node = self.prng.choice(self.cluster.masters())
        down_s = self.prng.uniform(*MASTER_DOWN_S)
        f = self.begin("master-kill", f"redis:{node.port}", down_s=round(down_s, 3))
        self.cluster.kill_redis(node)
        self._stop.wait(down_s)
        self.cluster.start_redis()
        self.end(f)
        return None

    def redis_tail_loss(self) -> Fault | None:
        """Power loss under ``appendfsync everysec``: SIGKILL, then cut the AOF at a command
        boundary among the commands appended since this fault started (so only writes
        acknowledged inside the logged window can be lost), then restart."""
        server = self.cluster.masters()[0]
        aof = newest_incr_aof(server.workdir)
        if aof is None:
            return None
        f = self.begin("redis-tail-loss", "redis")
        size_before = aof.stat().st_size
        self._stop.wait(self.prng.uniform(0.3, 1.5))
        self.cluster.kill_redis()
        data = aof.read_bytes()
        starts = command_starts(data, size_before)
        cut = self.prng.choice([*starts, len(data)]) if starts else size_before
        with aof.open("r+b") as fh:
            fh.truncate(cut)
        self.cluster.start_redis()
        self.end(f, cut=cut, dropped_bytes=len(data) - cut, commands_after_start=len(starts))
        return None

    def net(self) -> Fault | None:
        proxy = self.cluster.proxy
        if proxy is None:  # a cluster has no proxy (``packages_for`` leaves ``net`` out)
            return None
        mode = self.prng.choice(NET_MODES)
        extra: dict[str, Any] = {}
        if mode == "reset":
            extra["connections"] = proxy.reset_all()
            self.instant("net-reset", "proxy", **extra)
            return None
        if mode == "delay":
            extra["delay_s"] = round(self.prng.uniform(0.02, 0.3), 3)
            proxy.delay(extra["delay_s"])
        elif mode == "drop":
            match = self.prng.choice(DROP_MATCHES)
            extra["match"] = match.decode()
            proxy.drop_reply_once(match)
        elif mode == "cut":
            extra["after_bytes"] = self.prng.randint(0, 300)
            proxy.reset_after_bytes(extra["after_bytes"])
        else:
            proxy.blackhole()
        f = self.begin(f"net-{mode}", "proxy", **extra)

        def stop() -> None:
            proxy.heal()

        f.stop = stop
        return f

    def client_kill(self) -> Fault | None:
        """``CLIENT KILL TYPE normal`` on one master, or on every node: the clients'
        connections to it drop (the harness's own command connection is skipped)."""
        nodes = self.cluster.nodes()
        if self.prng.random() < 0.6:
            nodes = [self.prng.choice(self.cluster.masters())]
        killed = 0
        for node in nodes:
            with node.client(socket_timeout=5) as c:
                killed += int(c.execute_command("CLIENT", "KILL", "TYPE", "normal"))
        target = f"redis:{nodes[0].port}" if len(nodes) == 1 else "redis:all"
        self.instant("client-kill", target, connections=killed)
        return None

    def client_pause(self) -> Fault | None:
        """``CLIENT PAUSE`` the server (a cluster: one master, which holds its slots)."""
        ms = self.prng.randint(300, 2500)
        how = self.prng.choice(("ALL", "WRITE"))
        masters = self.cluster.masters()
        node = self.prng.choice(masters) if len(masters) > 1 else masters[0]
        with node.client(socket_timeout=5) as c:
            c.execute_command("CLIENT", "PAUSE", ms, how)
        target = f"redis:{node.port}" if len(masters) > 1 else "redis"
        f = self.begin("client-pause", target, ms=ms, how=how)

        def stop() -> None:
            with contextlib.suppress(redis.RedisError), node.client(socket_timeout=5) as c:
                c.execute_command("CLIENT", "UNPAUSE")

        f.stop = stop
        return f

    def _groups(self) -> list[tuple[str, str]]:
        groups = [(stream, INGEST_GROUP) for stream in self.inbound]
        groups += [(self.keys.replies(p), RECEIVER_GROUP) for p in self.principals]
        return groups

    def idle_skew(self) -> Fault | None:
        admin = self.admin()
        aged = 0
        for stream, group in self._groups():
            try:
                rows = admin.xpending_range(stream, group, min="-", max="+", count=1000)
            except redis.ResponseError:
                continue  # no such group (yet)
            for row in rows:
                owner = row["consumer"]
                owner = owner.decode() if isinstance(owner, bytes) else str(owner)
                admin.xclaim(
                    stream, group, owner, 0, [row["message_id"]], idle=SKEW_IDLE_MS, justid=True
                )
                aged += 1
        self.instant("idle-skew", "redis", aged=aged)
        return None

    def storm(self) -> Fault | None:
        admin = self.admin()
        rewound = []
        for p in self.principals:
            if self.prng.random() < 0.5:
                with contextlib.suppress(redis.ResponseError):
                    admin.xgroup_setid(self.keys.replies(p), RECEIVER_GROUP, "0")
                    rewound.append(p)
        n = self.prng.randint(3, 10)
        self.workload.storm(self.rng, n)
        self.instant("storm", "replies", rewound=rewound, republish=n)
        return None

    def sqlite_busy(self) -> Fault | None:
        hold_s = min(BUSY_HOLD_MAX_S, self.prng.uniform(0.5, BUSY_HOLD_MAX_S))
        release = threading.Event()
        self._busy_release = release
        held = threading.Event()

        def holder() -> None:
            try:
                conn = sqlite3.connect(str(self.adapter_db), timeout=30.0, isolation_level=None)
            except sqlite3.Error:
                held.set()
                return
            try:
                conn.execute("BEGIN IMMEDIATE")
                held.set()
                release.wait(hold_s)
                conn.execute("COMMIT")
            except sqlite3.Error:
                pass
            finally:
                held.set()
                conn.close()

        thread = threading.Thread(target=holder, name="sqlite-busy", daemon=True)
        thread.start()
        held.wait(30.0)
        f = self.begin("sqlite-busy", "adapter-db", hold_s=round(hold_s, 3))

        def stop() -> None:
            release.set()
            thread.join(timeout=30.0)

        f.stop = stop
        return f

    def pg_terminate(self) -> Fault | None:
        """Terminate every session the adapters hold on the PostgreSQL database."""
        import psycopg

        with psycopg.connect(str(self.adapter_db), autocommit=True, connect_timeout=5) as c:
            rows = c.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = %s"
                " AND pid <> pg_backend_pid()",
                (PG_APPLICATION,),
            ).fetchall()
        self.instant("pg-terminate", "adapter-db", sessions=sum(1 for (ok,) in rows if ok))
        return None

    # -- hostile entries --------------------------------------------------------------------

    def _adapter_rows(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """Rows of a read-only query of the adapter database (none if it cannot be read)."""
        return store_rows(self.adapter_db, sql, args)

    def hostile_replies(self, fault: str, shapes: Mapping[str, tuple[str, ...]]) -> Fault | None:
        """Plant 2-5 entries of ``shapes`` on the reply streams; see the module docstring."""
        if not self.keyring:
            return None
        usable = sorted(s for s in shapes if len(self.principals) > 1 or "other" not in s)
        deck = self._shape_decks.setdefault(" ".join(usable), [])
        f = self.begin(fault, "replies")
        for n in range(self.prng.randint(2, 5)):
            principal = self.prng.choice(self.principals)
            unanswered = self._adapter_rows(
                "SELECT task_id, message_id FROM tasks t WHERE principal = ?"
                " AND state IN ('pending', 'running')"
                " AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.task_id = t.task_id) LIMIT 50",
                (principal,),
            )
            if not deck:  # every shape comes up before any comes up twice
                deck += usable
                self.prng.shuffle(deck)
            shape = deck.pop()
            if unanswered and self.prng.random() < 0.7:
                row = self.prng.choice(unanswered)
                task_id, message_id = str(row["task_id"]), str(row["message_id"])
                target = "real"
            else:
                task_id, message_id = f"{self.prng.getrandbits(128):032x}", "m-forged"
                target = "invented"
            self._plant_reply(
                f"{f.fid}.{n}", shape, shapes[shape], principal, task_id, message_id, target
            )
        return f

    def _plant_reply(
        self,
        mark: str,
        shape: str,
        reasons: tuple[str, ...],
        principal: str,
        task_id: str,
        message_id: str,
        target: str,
    ) -> None:
        assert self.keyring is not None
        reply_id = reply_id_for(task_id)
        body = forged_body(
            mark,
            principal,
            reply_id,
            task_id,
            message_id,
            deep=shape == "deep_body",
            stale=shape == "stale_body",
        )
        others = [p for p in self.principals if p != principal]
        pairs = reply_entry(
            shape,
            mark=mark,
            principal=principal,
            reply_id=reply_id,
            body=body,
            keyring=self.keyring,
            other=self.prng.choice(others) if others else None,
        )
        self.history.log(
            INVOKE,
            "forge",
            proc="nemesis",
            value={
                "mark": mark,
                "principal": principal,
                "shape": shape,
                "reply_id": reply_id,
                "target": target,
                "hash": sha256_hex(body),
                "reasons": list(reasons),
            },
        )
        try:
            entry_id = self.admin().execute_command(  # type: ignore[no-untyped-call]
                "XADD", self.keys.replies(principal), "*", *flat(pairs)
            )
        except redis.RedisError as exc:
            self.history.log(INFO, "forge", value={"mark": mark}, error=str(exc), proc="nemesis")
            return
        self.history.log(
            OK, "forge", value={"mark": mark, "entry_id": text(entry_id)}, proc="nemesis"
        )

    def replay(self) -> Fault | None:
        """Append byte-identical copies of 2-6 real inbound entries again: the newest ones,
        or the oldest (whose tasks are terminal by now). Entries the harness made bad
        (``chaos_key``) are left alone: only real requests are replayed."""
        admin = self.admin()
        streams = self.published_to
        stream = self.prng.choice(streams) if len(streams) > 1 else streams[0]
        late = self.prng.random() < 0.5
        page: Any = (
            admin.xrange(stream, count=REPLAY_LATE)
            if late
            else admin.xrevrange(stream, count=REPLAY_SOON)
        )
        real: list[tuple[str, dict[bytes, bytes]]] = []
        for eid, raw in page or []:
            fields = {bytes(k): bytes(v) for k, v in (raw or {}).items()}
            if CHAOS_KEY_FIELD not in fields and b"env" in fields:
                real.append((text(eid), fields))
        if not real:
            return None
        f = self.begin("replay", "inbound", late=late)
        for source, fields in self.prng.sample(real, min(len(real), self.prng.randint(2, 6))):
            try:
                env = json.loads(fields[b"env"])
                key = f"{env['sender']}:{env['message_id']}"
            except (ValueError, KeyError, TypeError):
                continue
            rows = self._adapter_rows(
                "SELECT state FROM tasks WHERE principal = ? AND message_id = ?",
                (env["sender"], env["message_id"]),
            )
            value = {"source": source, "state": str(rows[0]["state"]) if rows else None}
            self.history.log(INVOKE, "replay", key=key, value=value, proc="nemesis")
            try:
                entry_id = admin.execute_command(  # type: ignore[no-untyped-call]
                    "XADD", stream, "*", *flat(list(fields.items()))
                )
            except redis.RedisError as exc:
                self.history.log(
                    INFO, "replay", key=key, value=value, error=str(exc), proc="nemesis"
                )
                continue
            self.history.log(
                OK, "replay", key=key, value=dict(value, entry_id=text(entry_id)), proc="nemesis"
            )
        return f

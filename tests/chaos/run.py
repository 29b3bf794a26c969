"""One chaos run, end to end: ``python -m tests.chaos.run --profile short --seed 1 --out DIR``.

1. Start a private redis-server (``--redis-mode``: ``durable`` = AOF always, ``everysec``,
   ``ephemeral`` = no persistence), the loopback proxy in front of it, the adapters
   (``python -m broker_adapter run`` with the chaos handler, two on one database with
   different ``--name``) and one receiver per agent (agent 1 through the CLI's ``receive``,
   the others through ``tests.chaos.receiver`` with an append-only effect ledger). Every
   client connection goes through the proxy.
2. Run the agents and the nemesis for the profile's duration (bounded in count and time).
3. Heal everything, then drain: wait until nothing is live, pending, undelivered or unsent
   and every sent reply has its receipt, or until ``T_heal`` runs out (a violation).
4. Stop every component (SIGTERM), read the final state from the stores, check it.
5. Write ``history.jsonl`` (merged), ``result.json``, the component logs and the Redis data
   directory into ``--out``; print the summary; exit 1 on any violation.

Topology and store (``--topology``, ``--store``):

* ``--topology single`` (default): one redis-server behind the proxy, as above.
* ``--topology cluster``: a local Redis Cluster (``tests.support.redis_cluster``: three
  masters with AOF always, one replica of the master of ``{in}`` that never takes over)
  and no proxy (a cluster client follows MOVED to the nodes' own addresses, so no proxy
  can sit in front of it). The agents publish over ``--partitions`` inbound partition
  streams (default 6 here: the three agents' partitions are on the three masters),
  which the adapters read. Durable
  only; the nemesis swaps the proxy's ``net`` faults for ``client-kill`` and ``redis-kill``
  for ``master-kill`` (``nemesis.packages_for``).
* ``--store postgresql``: the adapters share one throwaway PostgreSQL database
  (``tests.support.postgres``: created at the start on ``BA_TEST_POSTGRES``'s server,
  dropped at the end unless ``--keep``) instead of the SQLite file; ``sqlite-busy`` becomes
  ``pg-terminate``. The receivers keep their SQLite receipt files, the handler its SQLite
  effects database (the ground truth, not the store under test).

With ``--topology cluster --store postgresql`` the two adapters stand in for two hosts:
two processes with their own ``--name``, nothing shared but Redis and PostgreSQL.

Everything random comes from ``--seed``: the plan of every agent, the fault schedule, the
choice of targets. Timing is real (leases of 1-2 s), so a replay with the same seed runs the
same plan and the same schedule, not the same interleaving.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType

import redis

from broker_adapter.protocol.keys import INGEST_GROUP, RECEIVER_GROUP, Keys
from tests.chaos.checker import CheckConfig, CheckResult, check, format_summary
from tests.chaos.cluster import Cluster, Component
from tests.chaos.finalread import (
    STORE_ERRORS,
    Sources,
    StoreTarget,
    group_state,
    open_ro,
    read_final,
    store_rows,
)
from tests.chaos.handler import ENV_EFFECTS_DB, init_db
from tests.chaos.history import History, merge, write_merged
from tests.chaos.hostile import FORGERY_SHAPES
from tests.chaos.model import HistoryModel
from tests.chaos.nemesis import STORES, TOPOLOGIES, Nemesis, packages_for
from tests.chaos.planted import BUGS
from tests.chaos.planted import ENV as PLANTED_ENV
from tests.chaos.proxy import ChaosProxy
from tests.chaos.workload import (
    DEFAULT_WEIGHTS,
    Agent,
    AgentConfig,
    Canceller,
    Workload,
    make_keyring,
)
from tests.support.postgres import ThrowawayDatabase
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0
DRAIN_POLL_S = 0.5
MODES = {"durable": "always", "everysec": "everysec", "ephemeral": None}
#: Inbound partitions of a cluster run unless ``--partitions`` says otherwise: with six,
#: the agents p1, p2, p3 publish to ``{in#3}``, ``{in#4}`` and ``{in#1}``, one on each master
#: of the three (``partition_of``; the other three partitions stay empty but are read).
CLUSTER_PARTITIONS = 6


@dataclass(frozen=True)
class Profile:
    """The size and shape of a run.

    Attributes:
        agents: publishing agents (2-4), each its own principal.
        messages: publishes in total (split evenly across the agents).
        duration_s: the publishing phase; the nemesis runs during it.
        adapters: adapter processes on the one database.
        workers: worker processes per adapter.
        lease_s: task lease; ``claim_min_idle_ms``: takeover of idle inbound entries.
        period_s, quiet_p, max_packages: the nemesis schedule.
        packages: enabled packages (``None``: all the Redis mode allows).
        t_heal_s: how long the drain may take after the final heal.
        weights: workload kinds and their weights.
    """

    name: str
    agents: int = 3
    messages: int = 300
    duration_s: float = 60.0
    adapters: int = 2
    workers: int = 2
    lease_s: float = 1.5
    claim_min_idle_ms: int = 1500
    period_s: tuple[float, float] = (1.5, 3.5)
    quiet_p: float = 0.15
    max_packages: int = 3
    packages: tuple[str, ...] | None = None
    t_heal_s: float = 90.0
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


PROFILES: dict[str, Profile] = {
    "short": Profile("short"),
    "long": Profile(
        "long",
        agents=4,
        messages=13_200,
        duration_s=1320.0,
        workers=3,
        period_s=(3.0, 6.0),
        t_heal_s=180.0,
    ),
    "smoke": Profile("smoke", agents=2, messages=40, duration_s=10.0, t_heal_s=60.0),
}


@dataclass(frozen=True)
class AdapterConfig:
    """One run.

    Attributes:
        profile: the run's size and schedule.
        seed: seeds everything random.
        out: the run directory (created).
        mode: ``durable``, ``everysec`` or ``ephemeral``.
        planted: a bug from ``planted.BUGS`` to run the adapters with, or ``None``.
        scenario: ``None`` for the random nemesis, or a scripted one (``SCENARIOS``).
        topology: ``single`` (one server behind the proxy) or ``cluster``.
        store: ``sqlite`` (one file) or ``postgresql`` (a throwaway database).
        partitions: inbound partition streams the agents publish to and the adapters read.
        keep: keep the PostgreSQL database at the end (its URL is in ``result.json``).
    """

    profile: Profile
    seed: int
    out: Path
    mode: str = "durable"
    planted: str | None = None
    scenario: str | None = None
    topology: str = "single"
    store: str = "sqlite"
    partitions: int = 1
    keep: bool = False


@dataclass
class RunResult:
    result: CheckResult
    out: Path
    seconds: float
    summary: str


# -- scripted scenarios (for the planted bugs) ------------------------------------------------

ScenarioFn = Callable[["Run"], None]


@dataclass(frozen=True)
class Scenario:
    """A scripted fault schedule (instead of the random nemesis), with its own profile.

    Attributes:
        script: runs the faults, in the harness's main thread.
        profile: the workload and cluster it needs.
        held: components not started with the others (the script starts them).
    """

    script: ScenarioFn
    profile: Profile
    held: tuple[str, ...] = ()


def _scenario_ingest_crash(run: Run) -> None:
    """Kill adapter a1 once at ``store.accept.before_commit``: harmless while XACK follows
    the inbox commit (the batch is replayed), a loss when XACK comes first."""
    run.wait(2.0)
    comp = run.cluster.components["a1"]
    fault = run.nemesis.crashpoint(comp, "store.accept.before_commit@2")
    if fault is not None:
        run.nemesis.active.append(fault)
    run.wait(6.0)
    run.nemesis.stop_active()


def _scenario_zombie(run: Run) -> None:
    """a1 alone claims two slow tasks; it is frozen past its lease while a2 starts and
    re-claims them (fence 2); a1 wakes up while a2 still runs them, and its commits under
    fence 1 must be refused."""
    lease = run.config.profile.lease_s
    a1, a2 = run.cluster.components["a1"], run.cluster.components["a2"]
    run.wait_until(lambda: run.running_tasks() >= 2, 30.0)
    run.wait(0.5)
    f = run.nemesis.begin("pause-adapter", a1.name, whole=True)
    a1.pause()
    run.cluster.restart(a2, why="scenario")
    run.wait(lease)
    # a2 takes the tasks over once a1's leases expired (fence 2); only then does a1 wake.
    run.wait_until(lambda: run.running_tasks(min_fence=2) >= 2, 30.0)
    run.wait(0.3)
    a1.resume()
    run.nemesis.end(f)


def _scenario_forged_reply(run: Run) -> None:
    """Forged replies, signed wrongly or not at all but otherwise well formed, land on the
    reply streams while slow tasks run: under the tasks' real reply ids (before the real
    replies) and under invented ones. A receiver that checks signatures dead-letters them
    all; one that takes them on trust applies them."""
    run.wait_until(lambda: run.running_tasks() >= 1, 30.0)
    v2 = {shape: why for shape, why in FORGERY_SHAPES.items() if shape != "unsigned_v1"}
    for _ in range(2):
        fault = run.nemesis.hostile_replies("forge-reply", v2)
        if fault is not None:
            run.nemesis.active.append(fault)
        run.wait(1.0)
    run.nemesis.stop_active()


SCENARIOS: dict[str, Scenario] = {
    "ingest-crash": Scenario(
        _scenario_ingest_crash,
        Profile(
            "ingest-crash",
            agents=2,
            messages=60,
            duration_s=8.0,
            adapters=1,
            t_heal_s=60.0,
            weights={"ok": 1.0},
        ),
    ),
    "zombie": Scenario(
        _scenario_zombie,
        Profile(
            "zombie",
            agents=2,
            messages=2,
            duration_s=0.5,
            adapters=2,
            t_heal_s=60.0,
            weights={"slow_long": 1.0},
        ),
        held=("a2",),
    ),
    "forged-reply": Scenario(
        _scenario_forged_reply,
        Profile(
            "forged-reply",
            agents=2,
            messages=6,
            duration_s=1.0,
            adapters=1,
            t_heal_s=60.0,
            weights={"slow": 1.0},
        ),
    ),
}


# -- the run --------------------------------------------------------------------------------


class Run:
    """The state of one run; ``execute`` does the whole thing."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        prof = config.profile
        self.out = config.out
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        (self.out / "history").mkdir(exist_ok=True)
        self.rng = random.Random(config.seed)
        self.prefix = f"chaos{config.seed % 100000}"
        self.principals = tuple(f"p{i + 1}" for i in range(prof.agents))
        self.adapter_db: StoreTarget = self.out / "adapter.db"
        self.pg: ThrowawayDatabase | None = None
        self.effects_db = self.out / "effects.db"
        self.receiver_dbs = {p: self.out / f"receiver-{p}.db" for p in self.principals}
        self.keyring_path = self.out / "keyring.json"
        self.stop_event = threading.Event()
        self._histories: list[History] = []
        self.history = self._history("run")
        self.redis: RedisServer | RedisCluster
        if config.topology == "cluster":
            if config.mode != "durable":
                raise ValueError("a cluster run is durable (AOF always) only")
            self.redis = RedisCluster(self.out / "redis", appendfsync="always", failover=False)
        else:
            self.redis = RedisServer(self.out / "redis", appendfsync=MODES[config.mode])
        self.proxy: ChaosProxy | None = None
        self._cluster: Cluster | None = None
        self._nemesis: Nemesis | None = None
        self.workload = Workload()

    def _history(self, proc: str) -> History:
        h = History(self.out / "history" / f"{proc}.jsonl", proc)
        self._histories.append(h)
        return h

    @property
    def cluster(self) -> Cluster:
        assert self._cluster is not None
        return self._cluster

    @property
    def nemesis(self) -> Nemesis:
        assert self._nemesis is not None
        return self._nemesis

    def wait(self, seconds: float) -> None:
        self.stop_event.wait(seconds)

    def wait_until(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            if self.stop_event.wait(0.1):
                return False
        return False

    def admin(self) -> redis.Redis:
        return self.cluster.admin()

    def inbound(self) -> list[str]:
        return Keys(self.prefix).inbound_partitions(self.config.partitions)

    # -- setup ------------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BA_", "CHAOS_"))}
        env[ENV_EFFECTS_DB] = str(self.effects_db)
        env["PYTHONUNBUFFERED"] = "1"
        if self.config.planted:
            env[PLANTED_ENV] = self.config.planted
        return env

    def _components(self, redis_url: str) -> list[Component]:
        prof = self.config.profile
        env = self._base_env()
        comps: list[Component] = []
        entry = [sys.executable, "-m", "broker_adapter"]
        if self.config.planted:
            entry = [sys.executable, "-m", "tests.chaos.planted", self.config.planted]
        for i in range(prof.adapters):
            name = f"a{i + 1}"
            args = [
                *entry,
                "run",
                "--redis",
                redis_url,
                "--db",
                str(self.adapter_db),
                "--handler",
                "tests.chaos.handler:handle",
                "--workers",
                str(prof.workers),
                "--keyring",
                str(self.keyring_path),
                "--prefix",
                self.prefix,
                "--lease",
                str(prof.lease_s),
                "--claim-min-idle-ms",
                str(prof.claim_min_idle_ms),
                "--name",
                name,
                "--grace",
                "2",
            ]
            if self.config.partitions > 1:
                args += ["--partitions", str(self.config.partitions)]
            comps.append(Component(name, "adapter", args, env, self.out / "logs" / f"{name}.log"))
        for i, p in enumerate(self.principals):
            name = f"recv-{p}"
            db = str(self.receiver_dbs[p])
            if i == 0:
                args = [
                    *entry,
                    "receive",
                    "--redis",
                    redis_url,
                    "--db",
                    db,
                    "--prefix",
                    self.prefix,
                    "--principal",
                    p,
                    "--consumer",
                    name,
                    "--keyring",
                    str(self.keyring_path),
                ]
            else:
                args = [
                    sys.executable,
                    "-m",
                    "tests.chaos.receiver",
                    "--redis",
                    redis_url,
                    "--db",
                    db,
                    "--prefix",
                    self.prefix,
                    "--principal",
                    p,
                    "--consumer",
                    name,
                    "--keyring",
                    str(self.keyring_path),
                ]
            comps.append(Component(name, "receiver", args, env, self.out / "logs" / f"{name}.log"))
        return comps

    def _agents(self, redis_url: str, keyring: dict[str, dict[str, str]]) -> None:
        prof = self.config.profile
        per_agent = max(1, prof.messages // prof.agents)
        rng = random.Random(f"cancel-{self.config.seed}")
        canceller = Canceller(
            self.adapter_db, self._history("canceller"), rng, self.stop_event, self._base_env()
        )
        self.workload.canceller = canceller
        for i, p in enumerate(self.principals):
            cfg = AgentConfig(
                principal=p,
                index=i,
                messages=per_agent,
                duration_s=prof.duration_s,
                lease_s=prof.lease_s,
                weights=prof.weights,
                peers={q: per_agent for q in self.principals if q != p},
            )
            self.workload.agents.append(
                Agent(
                    cfg,
                    self.config.seed,
                    redis_url,
                    self.prefix,
                    keyring,
                    self._history(f"agent-{p}"),
                    canceller,
                    self.stop_event,
                    partitions=self.config.partitions,
                )
            )

    def _wait_ready(self) -> None:
        keys = Keys(self.prefix)
        admin = self.admin()

        def groups_exist() -> bool:
            for stream in keys.inbound_partitions(self.config.partitions):
                try:
                    names = {g["name"] for g in admin.xinfo_groups(stream)}
                except redis.RedisError:
                    return False
                if INGEST_GROUP.encode() not in names and INGEST_GROUP not in names:
                    return False
            return True

        try:
            if not self.wait_until(groups_exist, READY_TIMEOUT_S):
                raise RuntimeError("the adapters did not create their consumer group in time")
        finally:
            admin.close()

    def running_tasks(self, min_fence: int = 0) -> int:
        return self._count(
            f"SELECT count(*) AS n FROM tasks WHERE state = 'running' AND fence >= {int(min_fence)}"
        )

    def _count(self, sql: str) -> int:
        """``SELECT count(*) AS n ...`` of the adapter database; 0 while unreadable."""
        rows = store_rows(self.adapter_db, sql)
        return int(rows[0]["n"]) if rows else 0

    # -- drain ------------------------------------------------------------------------------

    def drained(self) -> tuple[bool, str]:
        """Whether nothing is left to do; the second value says what is still going on."""
        if not self.workload.done():
            return False, "workload"
        if self._count("SELECT count(*) AS n FROM tasks WHERE state IN ('pending', 'running')"):
            return False, "live tasks"
        if self._count("SELECT count(*) AS n FROM outbox WHERE state IN ('pending', 'sending')"):
            return False, "unsent replies"
        keys = Keys(self.prefix)
        admin = self.admin()
        try:
            groups = [(stream, INGEST_GROUP) for stream in self.inbound()]
            groups += [(keys.replies(p), RECEIVER_GROUP) for p in self.principals]
            for stream, group in groups:
                pending, undelivered = group_state(admin, stream, group)
                if pending or undelivered:
                    return False, f"{stream} {group}: pending {pending}, new {undelivered}"
        except redis.RedisError as exc:
            return False, f"redis: {exc}"
        finally:
            admin.close()
        sent: dict[str, set[str]] = {p: set() for p in self.principals}
        try:
            with open_ro(self.adapter_db, timeout_s=10) as c:
                for r in c.execute("SELECT reply_id, principal FROM outbox WHERE state = 'sent'"):
                    sent.setdefault(r["principal"], set()).add(r["reply_id"])
            for p, rids in sent.items():
                path = self.receiver_dbs.get(p)
                if not rids:
                    continue
                if path is None or not path.exists():
                    return False, f"receiver {p}: no database"
                with open_ro(path, timeout_s=10) as c:
                    got = {r["reply_id"] for r in c.execute("SELECT reply_id FROM receipts")}
                if rids - got:
                    return False, f"receiver {p}: {len(rids - got)} replies not received"
        except STORE_ERRORS as exc:
            return False, f"store: {exc}"
        return True, "drained"

    def drain(self) -> bool:
        prof = self.config.profile
        start = time.monotonic()
        deadline = start + prof.t_heal_s
        streak = 0
        why = ""
        while time.monotonic() < deadline:
            ok, why = self.drained()
            streak = streak + 1 if ok else 0
            if streak >= 2:
                self.history.log(
                    "ok", "drain", value={"seconds": round(time.monotonic() - start, 3)}
                )
                return True
            time.sleep(DRAIN_POLL_S)  # polling the stores with an explicit deadline
        self.history.log(
            "fail", "drain", value={"seconds": round(time.monotonic() - start, 3)}, error=why
        )
        return False

    # -- the whole run ----------------------------------------------------------------------

    def execute(self) -> RunResult:
        t0 = time.monotonic()
        cfg, prof = self.config, self.config.profile
        self.history.log(
            "info",
            "config",
            value={
                "profile": asdict(prof),
                "seed": cfg.seed,
                "mode": cfg.mode,
                "planted": cfg.planted,
                "scenario": cfg.scenario,
                "prefix": self.prefix,
                "topology": cfg.topology,
                "store": cfg.store,
                "partitions": cfg.partitions,
            },
        )
        keyring = make_keyring(list(self.principals), cfg.seed)
        self.keyring_path.write_text(json.dumps(keyring))
        self.keyring_path.chmod(0o600)  # Keyring.load refuses a file others may read
        init_db(self.effects_db)
        final = None
        try:
            if cfg.store == "postgresql":
                self.pg = ThrowawayDatabase()
                self.adapter_db = self.pg.url
            self.redis.start()
            if isinstance(self.redis, RedisCluster):
                redis_url = self.redis.url
            else:
                self.proxy = ChaosProxy(self.redis.port)
                self.proxy.start()
                redis_url = self.proxy.url
            self._cluster = Cluster(
                self.redis, self.proxy, self._history("supervisor"), prof.lease_s + 1.5
            )
            comps = self._components(redis_url)
            held = SCENARIOS[cfg.scenario].held if cfg.scenario else ()
            for comp in comps:
                self.cluster.add(comp)
                if comp.name in held:
                    comp.hold_down = True
                else:
                    comp.start()
            self.cluster.start_supervisor()
            self._wait_ready()
            self._agents(redis_url, keyring)
            packages = prof.packages
            if packages is None:
                packages = packages_for(cfg.mode, cfg.topology, cfg.store)
            self._nemesis = Nemesis(
                self.cluster,
                self.workload,
                self._history("nemesis"),
                random.Random(f"nemesis-{cfg.seed}"),
                packages,
                mode=cfg.mode,
                lease_s=prof.lease_s,
                adapter_db=self.adapter_db,
                prefix=self.prefix,
                principals=self.principals,
                period_s=prof.period_s,
                quiet_p=prof.quiet_p,
                max_packages=prof.max_packages,
                keyring=keyring,
                partitions=cfg.partitions,
            )
            self.workload.start()
            self._run_nemesis()
            self.workload.join(prof.duration_s + 60.0)
            self.nemesis.heal()
            self.drain()
            self.stop_event.set()
            if self.workload.canceller is not None:
                self.workload.canceller.join(timeout=15)
            self.cluster.stop_supervisor()
            codes = self.cluster.stop_all()
            self.history.log("info", "stopped", value={"codes": codes})
            admin = self.admin()
            try:
                final = read_final(
                    Sources(
                        self.adapter_db,
                        self.receiver_dbs,
                        self.effects_db,
                        self.prefix,
                        self.principals,
                        cfg.partitions,
                    ),
                    admin,
                )
            finally:
                admin.close()
        finally:
            self.stop_event.set()
            if self._cluster is not None:
                self._cluster.stop_supervisor()
                for comp in self._cluster.components.values():
                    comp.terminate(timeout_s=5)
            if self.proxy is not None:
                self.proxy.stop()
            self.redis.stop()
            if self.pg is not None and not cfg.keep:
                self.pg.drop()
            for h in self._histories:
                h.close()
        assert final is not None
        work = self.work_by_adapter()
        events = merge(sorted((self.out / "history").glob("*.jsonl")))
        write_merged(events, self.out / "history.jsonl")
        model = HistoryModel.from_events(events)
        result = check(model, final, CheckConfig(mode=cfg.mode))
        seconds = time.monotonic() - t0
        summary = (
            f"chaos run: profile={prof.name} seed={cfg.seed} mode={cfg.mode} "
            f"topology={cfg.topology} store={cfg.store} partitions={cfg.partitions} "
            f"planted={cfg.planted} scenario={cfg.scenario} wall={seconds:.1f}s\n"
            + format_summary(result)
            + f"\nwork by adapter (effect calls)  {work}"
        )
        doc = {
            "profile": asdict(prof),
            "seed": cfg.seed,
            "mode": cfg.mode,
            "planted": cfg.planted,
            "scenario": cfg.scenario,
            "wall_s": round(seconds, 3),
            "history_events": len(events),
            "topology": cfg.topology,
            "store": cfg.store,
            "partitions": cfg.partitions,
            "work_by_adapter": work,
            "adapter_db": str(self.adapter_db) if cfg.keep or cfg.store == "sqlite" else None,
            "check": result.as_json(),
        }
        (self.out / "result.json").write_text(
            json.dumps(doc, indent=2, sort_keys=True, default=str)
        )
        (self.out / "summary.txt").write_text(summary + "\n")
        return RunResult(result, self.out, seconds, summary)

    def work_by_adapter(self) -> dict[str, int]:
        """Handler calls that applied an effect, by the adapter whose worker made them (the
        attempt ledger's ``owner``, ``<name>-w<i>-<pid>``): which processes did the work."""
        rows = store_rows(
            self.effects_db,
            "SELECT owner, count(*) AS n FROM attempts WHERE event = 'effect' GROUP BY owner",
        )
        work: dict[str, int] = {}
        for r in rows:
            name = str(r["owner"]).rsplit("-", 2)[0]
            work[name] = work.get(name, 0) + int(r["n"])
        return dict(sorted(work.items()))

    def _run_nemesis(self) -> None:
        cfg, prof = self.config, self.config.profile
        if cfg.scenario is not None:
            SCENARIOS[cfg.scenario].script(self)
            return
        self.wait(1.0)
        until = time.monotonic() + prof.duration_s
        thread = threading.Thread(target=self.nemesis.run, args=(until,), name="nemesis")
        thread.start()
        thread.join(prof.duration_s + 60.0)


def run_chaos(config: AdapterConfig) -> RunResult:
    """Run one chaos run; see the module docstring."""
    return Run(config).execute()


def profile_for(
    name: str, *, messages: int | None = None, duration_s: float | None = None
) -> Profile:
    prof = SCENARIOS[name].profile if name in SCENARIOS else PROFILES[name]
    if messages is not None:
        prof = replace(prof, messages=messages)
    if duration_s is not None:
        prof = replace(prof, duration_s=duration_s)
    return prof


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--redis-mode", choices=sorted(MODES), default="durable")
    parser.add_argument("--messages", type=int, default=None, help="override the profile")
    parser.add_argument("--duration", type=float, default=None, help="override, seconds")
    parser.add_argument("--planted", choices=BUGS, default=None, help="run a planted bug")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default=None)
    parser.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="single",
        help="single: one redis-server behind the proxy; cluster: a local"
        " 3-master Redis Cluster (durable, no proxy)",
    )
    parser.add_argument(
        "--store",
        choices=STORES,
        default="sqlite",
        help="the adapters' database: one SQLite file or a throwaway PostgreSQL database",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help=f"inbound partitions (1, cluster: {CLUSTER_PARTITIONS})",
    )
    parser.add_argument("--keep", action="store_true", help="keep the PostgreSQL database")
    args = parser.parse_args(argv)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds through the run's cleanup (components, Redis)

    signal.signal(signal.SIGTERM, on_signal)
    name = args.scenario or args.profile
    prof = profile_for(name, messages=args.messages, duration_s=args.duration)
    config = AdapterConfig(
        profile=prof,
        seed=args.seed,
        out=args.out,
        mode=args.redis_mode,
        planted=args.planted,
        scenario=args.scenario,
        topology=args.topology,
        store=args.store,
        keep=args.keep,
        partitions=args.partitions or (CLUSTER_PARTITIONS if args.topology == "cluster" else 1),
    )
    result = run_chaos(config)
    print(result.summary)
    print(f"history: {result.out / 'history.jsonl'}\nresult: {result.out / 'result.json'}")
    return 0 if result.result.valid else 1


if __name__ == "__main__":
    sys.exit(main())

"""Scaling out, in one run: end-to-end throughput of one adapter on SQLite with one
redis-server, of one adapter on SQLite with a 3-master Redis Cluster, and of 1, 2 and 4
adapter processes sharing one PostgreSQL database, beside the Redis floor of the same run.

Not a test. Each setup is measured as ``bench/run.py``'s throughput phase: an agent process
publishes ``--n`` signed envelopes (pipelined XADD, the bytes ``Publisher.publish`` writes,
to the inbound partition of its principal), ``broker-adapter run`` processes (handler
``broker_adapter.examples:echo``, ``--workers`` each, a distinct ``--name`` each) serve them,
and ``bench/run.py``'s receiver applies every reply with an effect that records its time in
its own SQLite file. Rate = n / (last receiver effect - first publish), after a warm-up of
``run.WARMUP`` messages; every run checks that each message was applied once and nothing was
dead-lettered. The setups of one repetition run one after the other, so drift over the run
reaches all of them; the table shows medians over ``--reps``.

The servers are private: one redis-server (AOF on, ``appendfsync always``), and for the
cluster three cluster-enabled redis-servers with the same persistence (no replica), built
with ``redis-cli --cluster create`` as ``tests/support/redis_cluster.py`` does. The
PostgreSQL setups create a throwaway database ``ba_bench_<random>`` on ``--pg-host`` (with
``psql``; dropped at the end) and run only when this build's ``broker-adapter run`` accepts
``--db postgresql://...``; otherwise their rows say so. Results in
``bench/results/scaleout.json``. Usage::

    .venv/bin/python bench/scaleout.py --quick          # 1 repetition of 2,000 messages
    .venv/bin/python bench/scaleout.py --n 10000 --reps 3
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import run as e2e
from common import KEYRING, PRINCIPAL, ROOT

from broker_adapter.protocol.keys import Keys, partition_of
from broker_adapter.redis.client import connect
from broker_adapter.testing import RedisServer
from tests.support.redis_cluster import ClusterNode, RedisCluster, _cli, cluster_supported

RESULTS = ROOT / "bench" / "results" / "scaleout.json"
PUBLISH_BATCH = 200
#: The ``--partitions`` of the cluster setups by default: today's layout, and twice the
#: masters (docs/SCALING.md). One principal publishes, so one partition carries the load.
CLUSTER_PARTITIONS = (1, 6)
PG_ADAPTERS = (1, 2, 4)
PG_MISSING = "n/a: PostgreSQL store not available in this build"


# -- the agent (this same file, run as a subprocess) ----------------------------------------


def child_publish(args: argparse.Namespace) -> int:
    """Publish ``--count`` signed envelopes, pipelined, to the principal's partition."""
    client: Any = connect(args.redis)
    stream = Keys(args.prefix).inbound_partition(partition_of(PRINCIPAL, args.partitions))
    start = time.time()
    for lo in range(0, args.count, PUBLISH_BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(lo, min(lo + PUBLISH_BATCH, args.count)):
            pipe.xadd(stream, KEYRING.sign(common.envelope(i, time.time(), args.tag)))
        pipe.execute()
    print(json.dumps({"sent": args.count, "start": start, "end": time.time()}), flush=True)
    client.close()
    return 0


# -- the servers -----------------------------------------------------------------------------


def start_cluster(workdir: Path) -> RedisCluster | str:
    """Three masters, no replica; or why there is no cluster on this machine."""
    if not cluster_supported(workdir):
        return "n/a: redis-server without cluster support (or no redis-cli)"
    cluster = RedisCluster(workdir)
    # The single server's persistence (AOF, ``appendfsync always``), so the cluster rows
    # pay for the same fsyncs as the baseline.
    cluster.masters = [
        ClusterNode(workdir / f"m{i}", appendfsync=common.DEFAULT_APPENDFSYNC) for i in range(3)
    ]
    try:
        for node in cluster.masters:
            node.start()
        _cli("--cluster", "create", *(m.address for m in cluster.masters),
             "--cluster-replicas", "0", "--cluster-yes")  # fmt: skip
        cluster.wait_ok(cluster.masters)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: RedisCluster) -> None:
    for node in cluster.masters:
        node.stop()


@functools.cache
def postgres_support() -> str | None:
    """None when this build's ``broker-adapter run`` takes ``--db postgresql://...`` (the
    store's ``backends`` module is importable, or ``run --help`` names the scheme), else
    why not."""
    try:
        found = importlib.util.find_spec("broker_adapter.store.backends") is not None
    except ModuleNotFoundError:
        found = False
    if not found:  # or the CLI names the scheme its --db takes
        help_text = subprocess.run(
            [sys.executable, "-m", "broker_adapter", "run", "--help"], cwd=ROOT,
            env=common.python_env(), capture_output=True, text=True, timeout=60, check=False,
        ).stdout  # fmt: skip
        found = "postgresql://" in help_text
    if not found:
        return PG_MISSING
    if shutil.which("psql") is None:
        return "n/a: no psql to create the throwaway database"
    return None


@dataclass
class PgDatabase:
    """A throwaway database on a local PostgreSQL, created and dropped with ``psql``."""

    host: str
    port: int
    name: str

    @property
    def url(self) -> str:
        user = os.environ.get("PGUSER", "")
        return f"postgresql://{user + '@' if user else ''}{self.host}:{self.port}/{self.name}"

    def _psql(self, sql: str) -> None:
        subprocess.run(
            ["psql", "-h", self.host, "-p", str(self.port), "-d", "postgres", "-v",
             "ON_ERROR_STOP=1", "-q", "-c", sql],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def create(self) -> None:
        self._psql(f'CREATE DATABASE "{self.name}"')

    def drop(self) -> None:
        self._psql(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


@contextmanager
def pg_database(args: argparse.Namespace) -> Iterator[PgDatabase | str]:
    """A fresh database for one setup (dropped after it), or why there is none."""
    missing = postgres_support()
    if missing is not None:
        yield missing
        return
    db = PgDatabase(args.pg_host, args.pg_port, f"ba_bench_{secrets.token_hex(4)}")
    try:
        db.create()
    except subprocess.CalledProcessError as exc:
        yield f"n/a: could not create a database: {exc.stderr.strip()[-300:]}"
        return
    try:
        yield db
    finally:
        db.drop()


# -- one setup -------------------------------------------------------------------------------


class Setup(e2e.Pipeline):
    """``adapters`` ``broker-adapter run`` processes on one store + ``bench/run.py``'s
    receiver, on fresh keys; ``store`` is a SQLite path (one adapter) or a database URL."""

    def __init__(
        self,
        url: str,
        workdir: Path,
        keyring: Path,
        *,
        store: Path | str,
        adapters: int,
        partitions: int,
        workers: int,
    ) -> None:
        self.url = url
        self.partitions = partitions
        self.prefix = common.new_prefix()
        self.sqlite = isinstance(store, Path)
        self.db = store if isinstance(store, Path) else workdir / f"{self.prefix}.unused"
        self.store = str(store)
        self.rx_db = workdir / f"{self.prefix}-rx.db"
        self.logs = workdir / f"{self.prefix}.log"
        self._log = self.logs.open("w")
        env = common.python_env()
        self.adapters = [
            self._adapter(f"bench-{i}", keyring, workers, env) for i in range(adapters)
        ]
        self.runner = self.adapters[0]
        self.receiver = subprocess.Popen(
            [sys.executable, e2e.__file__, "_receive", "--redis", url, "--db", str(self.rx_db),
             "--prefix", self.prefix],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )  # fmt: skip
        assert self.receiver.stdout is not None
        if self.receiver.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"receiver did not start; see {self.logs}")

    def _adapter(
        self, name: str, keyring: Path, workers: int, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "broker_adapter", "run", "--redis", self.url,
             "--db", self.store, "--handler", "broker_adapter.examples:echo",
             "--workers", str(workers), "--keyring", str(keyring), "--prefix", self.prefix,
             "--name", name, "--partitions", str(self.partitions)],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def publish(self, count: int, tag: str, rate: float = 0.0) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, __file__, "_publish", "--redis", self.url, "--prefix", self.prefix,
             "--count", str(count), "--tag", tag, "--partitions", str(self.partitions)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=common.python_env(),
        )  # fmt: skip

    def wait_effects(self, tag: str, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.effects(tag) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.effects(tag)}/{n} effects of {tag!r} in time")
            procs: list[subprocess.Popen[Any]] = [*self.adapters, self.receiver]
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a process died; see {self.logs}")
            time.sleep(0.02)  # polling the receiver's file, with a deadline

    def verify(self, expected: int) -> dict[str, Any]:
        """SQLite: ``run.Pipeline.verify``. A database URL: what the receiver and the
        dead-letter streams show (every reply applied once, nothing dead-lettered)."""
        if self.sqlite:
            return super().verify(expected)
        import sqlite3

        rx = sqlite3.connect(self.rx_db, timeout=10)
        try:
            receipts, effects = rx.execute(
                "SELECT count(*), coalesce(sum(effects), 0) FROM receipts"
            ).fetchone()
        finally:
            rx.close()
        client: Any = connect(self.url)
        keys = Keys(self.prefix)
        dead = sum(client.xlen(keys.dead_for(s)) for s in keys.inbound_partitions(self.partitions))
        dead += client.xlen(keys.replies_dead(PRINCIPAL))
        client.close()
        ok = receipts == expected and effects == expected and dead == 0
        return {"ok": ok, "receipts": receipts, "effects": effects, "dead_letters": dead}

    def close(self) -> dict[str, int | None]:
        codes = {f"adapter-{i}": common.terminate(p, 60) for i, p in enumerate(self.adapters)}
        codes["receiver"] = common.terminate(self.receiver, 30)
        self._log.close()
        return codes


def measure(setup: Setup, n: int) -> dict[str, Any]:
    """One throughput run of ``n`` messages after the warm-up; raises if it went wrong."""
    try:
        setup.warm_up()
        pub = setup.publish(n, "m")
        out, _ = pub.communicate(timeout=max(120.0, n / 200))
        published = json.loads(out.strip().splitlines()[-1])
        setup.wait_effects("m", n, timeout_s=max(180.0, n / 50))
        times = setup.times("m")
        first = min(p for p, _ in times)
        last = max(e for _, e in times)
        result: dict[str, Any] = {
            "rate": n / (last - first),
            "seconds": last - first,
            "publish_rate": published["sent"] / (published["end"] - published["start"]),
        }
    finally:
        codes = setup.close()
    result["check"] = setup.verify(n + e2e.WARMUP)
    result["exit_codes"] = codes
    if not result["check"]["ok"] or any(codes.values()):
        raise RuntimeError(f"run went wrong: {result}; see {setup.logs}")
    return result


# -- the run ---------------------------------------------------------------------------------


def rows(cluster_partitions: list[int]) -> list[tuple[str, str]]:
    """(key, label) of the table's rows, in order."""
    return [
        ("sqlite-1", "SQLite, 1 adapter, 1 redis-server (baseline)"),
        *((f"cluster-3-p{p}", f"SQLite, 1 adapter, 3-master Redis Cluster, --partitions {p}")
          for p in cluster_partitions),
        *((f"pg-{k}", f"PostgreSQL, {k} adapter{'s' if k > 1 else ''}, 1 redis-server")
          for k in PG_ADAPTERS),
    ]  # fmt: skip


def one_rep(
    rep: int,
    res: dict[str, Any],
    server: RedisServer,
    cluster: RedisCluster | str,
    workdir: Path,
    keyring: Path,
    args: argparse.Namespace,
) -> None:
    common.quiesce(server)
    res["floor_redis"].append(common.redis_floor(server, args.n))
    say(f"rep {rep}: floor {common.fmt_rate(res['floor_redis'][-1]['roundtrip'])} msgs/s")

    def record(key: str, setup: Setup) -> None:
        result = measure(setup, args.n)
        res["runs"][key].append(result)
        say(f"rep {rep}: {key} {common.fmt_rate(result['rate'])} msgs/s")

    common.quiesce(server)
    sqlite = workdir / f"s{rep}-{common.new_prefix()}.db"
    record("sqlite-1", Setup(server.url, workdir, keyring, store=sqlite, adapters=1,
                             partitions=1, workers=args.workers))  # fmt: skip
    for p in args.cluster_partitions:
        if isinstance(cluster, str):
            res["missing"][f"cluster-3-p{p}"] = cluster
            continue
        sqlite = workdir / f"c{rep}-{common.new_prefix()}.db"
        setup = Setup(cluster.url, workdir, keyring, store=sqlite, adapters=1, partitions=p,
                      workers=args.workers)  # fmt: skip
        record(f"cluster-3-p{p}", setup)
    for k in PG_ADAPTERS:
        key = f"pg-{k}"
        with pg_database(args) as db:
            if isinstance(db, str):
                res["missing"][key] = db
                continue
            common.quiesce(server)
            record(key, Setup(server.url, workdir, keyring, store=db.url, adapters=k,
                              partitions=1, workers=args.workers))  # fmt: skip


def print_table(res: dict[str, Any]) -> None:
    floor = common.median(r["roundtrip"] for r in res["floor_redis"])
    base = common.median(r["rate"] for r in res["runs"]["sqlite-1"])
    floors = ", ".join(common.fmt_rate(r["roundtrip"]) for r in res["floor_redis"])
    print(f"\n{'setup':<62} {'msgs/s':>9} {'vs baseline':>12}  repetitions")
    print(f"{'floor: redis-py pipelined XADD + XREADGROUP + XACK':<62} "
          f"{common.fmt_rate(floor):>9} {'':>12}  {floors}")  # fmt: skip
    for key, label in rows(res["cluster_partitions"]):
        runs = res["runs"][key]
        if not runs:
            print(f"{label:<62} {res['missing'].get(key, 'n/a')}")
            continue
        rate = common.median(r["rate"] for r in runs)
        ratio = common.fmt_ratio(common.ratio(rate, base))
        each = ", ".join(common.fmt_rate(r["rate"]) for r in runs)
        print(f"{label:<62} {common.fmt_rate(rate):>9} {ratio:>12}  {each}")
    print(f"\nmedians of {res['reps']} repetition(s) of {res['n']:,} messages; "
          f"{res['workers']} workers per adapter; results in {res['json']}")  # fmt: skip


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    p = sub.add_parser("_publish")
    p.add_argument("--redis", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 repetition of 2,000 messages")
    parser.add_argument("--n", type=int, default=None, help="messages per run [10000]")
    parser.add_argument("--reps", type=int, default=None, help="repetitions [3]")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per adapter")
    parser.add_argument("--cluster-partitions", type=_ints, default=list(CLUSTER_PARTITIONS),
                        help="--partitions of each cluster setup, as 1,6 [1,6]")  # fmt: skip
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.role is None:
        args.n = args.n or (2000 if args.quick else 10000)
        args.reps = args.reps or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "_publish":
        return child_publish(args)
    res: dict[str, Any] = {
        "n": args.n, "reps": args.reps, "workers": args.workers,
        "cluster_partitions": args.cluster_partitions, "json": str(args.json),
        "machine": common.machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True, check=False).stdout.strip(),
        "floor_redis": [], "missing": {},
        "runs": {key: [] for key, _ in rows(args.cluster_partitions)},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ba-scaleout-") as tmp:
        workdir = Path(tmp)
        keyring = common.write_keyring(workdir / "keyring.json")
        server = common.start_server(workdir)
        cluster = start_cluster(workdir / "cluster")
        try:
            for rep in range(1, args.reps + 1):
                one_rep(rep, res, server, cluster, workdir, keyring, args)
        finally:
            if isinstance(cluster, RedisCluster):
                stop_cluster(cluster)
            server.stop()
    common.write_json(args.json, res)
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

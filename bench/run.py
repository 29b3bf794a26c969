"""``make bench``: broker_adapter end to end, beside the floors and its peers, in one run.

Not a test. Starts one private redis-server (AOF on, ``appendfsync always`` unless told
otherwise: the config README.md and docker-compose.yml recommend), then measures:

1. **floors** on that server and disk: bare redis-py pipelined XADD + XREADGROUP + XACK
   (msgs/s), and one-row SQLite WAL ``synchronous=FULL`` commits/s;
2. **throughput**: an agent process publishes ``--n`` signed envelopes (pipelined XADD of
   entries signed with the keyring, the bytes ``Publisher.publish`` would write) while
   ``broker-adapter run`` (a real subprocess: ingest, ``--workers`` worker processes,
   dispatcher; handler ``broker_adapter.examples:echo``) and a receiver process (``Receiver``
   with an effect that records its time in its own SQLite file, ``synchronous=FULL``) run.
   Rate = n / (last receiver effect - first publish). Nothing is turned off;
3. **latency** publish -> receiver effect (p50/p99/max) at a fixed offered load
   (``--latency-rate``, default 1,000 msg/s; one XADD per message on a schedule). The publish
   time rides in the payload, the effect records its own time;
4. **peers**: the same trivial workload on taskiq + taskiq-redis ``RedisStreamBroker`` and on
   Celery + Redis broker (``acks_late=True``), each with 2 worker processes, installed into
   ``bench/.venv-peers`` (created here with ``python -m venv`` + pip; never in pyproject).
   Their "effect" is the result their own backend stores; a failed install is n/a;
5. **async handlers** (``async_handlers``): handlers that wait 50 ms on an ``await``,
   ``--async-concurrency`` (32) at a time per worker process (``run --concurrency``), beside
   taskiq on the same workload (``--max-async-tasks``), both printed;
6. **memory**: peak RSS of each of our processes over ``--rss-messages`` messages, against
   its RSS after a warm-up.

Before each phase the server's AOF is compacted (BGREWRITEAOF, waited for) and the page
cache synced (``common.quiesce``; ``--no-quiesce`` skips it): otherwise the AOF the earlier
phases wrote crosses Redis's rewrite threshold in the middle of a later one.
Every end-to-end run checks the outcome too: every message done, replied once and applied
once, nothing dead-lettered. Medians of ``--reps`` repetitions; results in
``bench/results/latest.json``. Usage::

    .venv/bin/python bench/run.py                 # the full run (make bench)
    .venv/bin/python bench/run.py --quick         # a smoke run: a couple of minutes
    .venv/bin/python bench/run.py --n 5000 --reps 3 --no-peers --rss-messages 20000
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import async_handlers
import common
from common import KEYRING, PRINCIPAL, ROOT

from broker_adapter.client.publisher import submit_item
from broker_adapter.protocol.keys import Keys
from broker_adapter.protocol.reply import Reply
from broker_adapter.redis.client import connect

RESULTS = ROOT / "bench" / "results" / "latest.json"
PEERS_DIR = ROOT / "bench" / "peers"
PEERS_VENV = ROOT / "bench" / ".venv-peers"
PEER_PACKAGES = ["taskiq>=0.11", "taskiq-redis>=1.0", "celery[redis]>=5.3", "redis>=5"]
WARMUP = 200
PUBLISH_BATCH = 200
log = logging.getLogger("bench")


# -- child roles (this same file, run as a subprocess) ----------------------------------------


def child_publish(args: argparse.Namespace) -> int:
    """An agent: publish ``--count`` signed envelopes to the submit list, pipelined, or paced
    at ``--rate``."""
    client = connect(args.redis)
    submit = Keys(args.prefix).submit()
    sent = 0
    start = time.time()
    if args.rate > 0:
        interval = 1.0 / args.rate
        for i in range(args.count):
            due = start + i * interval
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)  # pacing an offered load, not waiting for a result
            fields = KEYRING.sign(common.envelope(i, time.time(), args.tag, args.deadline_in))
            client.rpush(submit, submit_item(fields))
            sent += 1
    else:
        for lo in range(0, args.count, PUBLISH_BATCH):
            pipe = client.pipeline(transaction=False)
            for i in range(lo, min(lo + PUBLISH_BATCH, args.count)):
                env = common.envelope(i, time.time(), args.tag, args.deadline_in)
                pipe.rpush(submit, submit_item(KEYRING.sign(env)))
            pipe.execute()
            sent = min(lo + PUBLISH_BATCH, args.count)
    print(json.dumps({"sent": sent, "start": start, "end": time.time()}), flush=True)
    client.close()
    return 0


EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_effects (reply_id TEXT PRIMARY KEY, message_id TEXT,"
    " status TEXT, published_at REAL, effect_at REAL NOT NULL)"
)


def bench_effect(conn: sqlite3.Connection, reply: Reply) -> dict[str, Any]:
    """The receiver's effect: one row with the publish time (from the echoed payload) and
    the time of the effect itself, in the receipt's transaction."""
    result = reply.result or {}
    echo = result.get("echo") if isinstance(result, dict) else None
    published = echo.get("t") if isinstance(echo, dict) else None
    conn.execute(
        "INSERT INTO bench_effects VALUES (?, ?, ?, ?, ?)",
        (reply.reply_id, reply.message_id, reply.status, published, time.time()),
    )
    return {"status": reply.status}


def child_receive(args: argparse.Namespace) -> int:
    """The agent's receiver: apply every reply once with ``bench_effect`` until SIGTERM."""
    from broker_adapter.stages.receiver.receiver import Receiver, ReceiverConfig
    from broker_adapter.store import ReceiptStore, open_database

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    db = open_database(args.db)
    with db.write("bench_ddl") as c:
        c.execute(EFFECTS_DDL)
    config = ReceiverConfig(prefix=args.prefix, principal=PRINCIPAL, consumer="bench-rx")
    receiver = Receiver(
        config, connect(args.redis), ReceiptStore(db), bench_effect, keyring=KEYRING
    )
    print("ready", flush=True)
    receiver.run(stop)
    db.close()
    return 0


# -- one end-to-end run -----------------------------------------------------------------------


class Pipeline:
    """``broker-adapter run`` + a receiver, both real subprocesses, on fresh keys and files."""

    def __init__(
        self, url: str, workdir: Path, keyring: Path, workers: int, *, metrics: bool = False
    ) -> None:
        self.url = url
        self.prefix = common.new_prefix()
        self.db = workdir / f"{self.prefix}.db"
        self.rx_db = workdir / f"{self.prefix}-rx.db"
        self.logs = workdir / f"{self.prefix}.log"
        self._log = self.logs.open("w")
        self.runner = subprocess.Popen(
            [sys.executable, "-m", "broker_adapter", "run", "--redis", url, "--db", str(self.db),
             "--handler", "broker_adapter.examples:echo", "--workers", str(workers),
             "--keyring", str(keyring), "--prefix", self.prefix, "--name", "bench",
             *(["--metrics-port", "0"] if metrics else [])],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=common.python_env(),
        )  # fmt: skip
        self.receiver = subprocess.Popen(
            [sys.executable, __file__, "_receive", "--redis", url, "--db", str(self.rx_db),
             "--prefix", self.prefix],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=common.python_env(),
        )  # fmt: skip
        assert self.receiver.stdout is not None
        if self.receiver.stdout.readline().strip() != "ready":
            raise RuntimeError(f"receiver did not start; see {self.logs}")

    def publish(self, count: int, tag: str, rate: float = 0.0) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, __file__, "_publish", "--redis", self.url, "--prefix", self.prefix,
             "--count", str(count), "--tag", tag, "--rate", str(rate)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=common.python_env(),
        )  # fmt: skip

    def effects(self, tag: str) -> int:
        if not self.rx_db.exists():
            return 0
        conn = sqlite3.connect(self.rx_db, timeout=10)
        try:
            return int(
                conn.execute(
                    "SELECT count(*) FROM bench_effects WHERE message_id LIKE ?", (f"{tag}-%",)
                ).fetchone()[0]
            )
        except sqlite3.OperationalError:
            return 0
        finally:
            conn.close()

    def wait_effects(self, tag: str, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.effects(tag) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.effects(tag)}/{n} effects of {tag!r} in time")
            if self.runner.poll() is not None or self.receiver.poll() is not None:
                raise RuntimeError(f"a process died; see {self.logs}")
            time.sleep(0.02)  # polling the receiver's file, with a deadline

    def warm_up(self, n: int = WARMUP) -> None:
        pub = self.publish(n, "w")
        pub.communicate(timeout=120)
        self.wait_effects("w", n, 120)

    def times(self, tag: str) -> list[tuple[float, float]]:
        conn = sqlite3.connect(self.rx_db, timeout=10)
        try:
            rows = conn.execute(
                "SELECT published_at, effect_at FROM bench_effects WHERE message_id LIKE ?",
                (f"{tag}-%",),
            ).fetchall()
        finally:
            conn.close()
        return [(float(p), float(e)) for p, e in rows]

    def verify(self, expected: int) -> dict[str, Any]:
        """The run's outcome: every task done with one reply sent and applied once."""
        conn = sqlite3.connect(self.db, timeout=10)
        rx = sqlite3.connect(self.rx_db, timeout=10)
        try:
            states = dict(conn.execute("SELECT state, count(*) FROM tasks GROUP BY state"))
            outbox = dict(conn.execute("SELECT state, count(*) FROM outbox GROUP BY state"))
            receipts, effects = rx.execute(
                "SELECT count(*), coalesce(sum(effects), 0) FROM receipts"
            ).fetchone()
        finally:
            conn.close()
            rx.close()
        client = connect(self.url)
        keys = Keys(self.prefix)
        dead = client.xlen(keys.inbound_dead()) + client.xlen(keys.replies_dead(PRINCIPAL))
        client.close()
        ok = (
            states == {"done": expected}
            and outbox == {"sent": expected}
            and receipts == expected
            and effects == expected
            and dead == 0
        )
        return {"ok": ok, "tasks": states, "outbox": outbox, "receipts": receipts,
                "effects": effects, "dead_letters": dead}  # fmt: skip

    def pids(self) -> dict[str, int]:
        import psutil

        out = {"runner": self.runner.pid, "receiver": self.receiver.pid}
        try:
            for child in psutil.Process(self.runner.pid).children(recursive=True):
                kind = "worker" if "spawn_main" in " ".join(child.cmdline()) else "helper"
                out[f"{kind}-{child.pid}"] = child.pid
        except psutil.Error:
            pass
        return out

    def close(self) -> dict[str, int | None]:
        codes = {
            "runner": common.terminate(self.runner, 60),
            "receiver": common.terminate(self.receiver, 30),
        }
        self._log.close()
        return codes


def throughput_run(
    url: str, workdir: Path, keyring: Path, args: argparse.Namespace
) -> dict[str, Any]:
    pipe = Pipeline(url, workdir, keyring, args.workers, metrics=args.metrics)
    try:
        pipe.warm_up()
        pub = pipe.publish(args.n, "m")
        out, _ = pub.communicate(timeout=max(120.0, args.n / 500))
        published = json.loads(out.strip().splitlines()[-1])
        pipe.wait_effects("m", args.n, timeout_s=max(120.0, args.n / 100))
        times = pipe.times("m")
        first = min(p for p, _ in times)
        last = max(e for _, e in times)
        result = {
            "rate": args.n / (last - first),
            "seconds": last - first,
            "publish_rate": published["sent"] / (published["end"] - published["start"]),
        }
    finally:
        codes = pipe.close()
    result["check"] = pipe.verify(args.n + WARMUP)
    result["exit_codes"] = codes
    if not result["check"]["ok"] or any(codes.values()):
        raise RuntimeError(f"end-to-end run went wrong: {result}; see {pipe.logs}")
    return result


def latency_run(url: str, workdir: Path, keyring: Path, args: argparse.Namespace) -> dict[str, Any]:
    n = int(args.latency_rate * args.latency_seconds)
    pipe = Pipeline(url, workdir, keyring, args.workers, metrics=args.metrics)
    try:
        pipe.warm_up()
        pub = pipe.publish(n, "l", rate=args.latency_rate)
        out, _ = pub.communicate(timeout=args.latency_seconds * 3 + 60)
        published = json.loads(out.strip().splitlines()[-1])
        pipe.wait_effects("l", n, timeout_s=120)
        lat = sorted((e - p) * 1000 for p, e in pipe.times("l"))
    finally:
        codes = pipe.close()
    check = pipe.verify(n + WARMUP)
    if not check["ok"] or any(codes.values()):
        raise RuntimeError(f"latency run went wrong: {check} {codes}; see {pipe.logs}")
    return {
        "offered_rate": args.latency_rate,
        "achieved_publish_rate": published["sent"] / (published["end"] - published["start"]),
        "p50_ms": common.percentile(lat, 50),
        "p99_ms": common.percentile(lat, 99),
        "max_ms": lat[-1],
        "n": n,
    }


def rss_run(url: str, workdir: Path, keyring: Path, args: argparse.Namespace) -> dict[str, Any]:
    n = args.rss_messages
    pipe = Pipeline(url, workdir, keyring, args.workers, metrics=args.metrics)
    watch = common.RssWatch(pipe.pids).start()
    try:
        pipe.warm_up(2000)
        watch.mark()
        start = time.time()
        pub = pipe.publish(n, "s")
        pub.communicate(timeout=max(300.0, n / 200))
        pipe.wait_effects("s", n, timeout_s=max(300.0, n / 100))
        elapsed = time.time() - start
    finally:
        per_process = watch.stop()
        codes = pipe.close()
    check = pipe.verify(n + 2000)
    if not check["ok"] or any(codes.values()):
        raise RuntimeError(f"RSS run went wrong: {check} {codes}; see {pipe.logs}")
    return {
        "messages": n,
        "seconds": elapsed,
        "per_process": per_process,
        "max_growth_mb": max(p["growth_mb"] for p in per_process.values()),
        "samples": watch.samples,
    }


# -- peers --------------------------------------------------------------------------------------


def peers_python(quiet: bool = False) -> tuple[Path | None, str]:
    """The peers' interpreter in ``bench/.venv-peers``, created and filled on first use."""
    py = PEERS_VENV / "bin" / "python"
    stamp = PEERS_VENV / ".installed"
    if py.exists() and stamp.exists():
        return py, "ok"
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        proc = subprocess.run(
            [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             *PEER_PACKAGES],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not create {PEERS_VENV}: {exc}"
    if proc.returncode != 0:
        return None, f"pip install failed: {(proc.stderr or proc.stdout).strip()[-800:]}"
    stamp.write_text(" ".join(PEER_PACKAGES) + "\n")
    return py, "ok"


def peer_runs(name: str, py: Path, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``bench/peers/<name>_bench.py`` in the peers' environment; it prints JSON."""
    script = PEERS_DIR / f"{name}_bench.py"
    proc = subprocess.run(
        [str(py), str(script), "--redis", url, "--n", str(args.n), "--reps", str(args.reps),
         "--workers", str(args.workers)],
        cwd=PEERS_DIR, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        return {"error": f"{name} bench failed (exit {proc.returncode}): {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- the report ---------------------------------------------------------------------------------


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    med = common.median
    ours = med(r["rate"] for r in res["throughput"])
    floor_rt = med(r["roundtrip"] for r in res["floor_redis"])
    summary: dict[str, Any] = {
        "floor_redis_roundtrip": floor_rt,
        "floor_redis_xadd": med(r["xadd"] for r in res["floor_redis"]),
        "floor_redis_read_ack": med(r["read_ack"] for r in res["floor_redis"]),
        "floor_sqlite_commits": med(res["floor_sqlite"]),
        "ours": ours,
        "ours_publish_rate": med(r["publish_rate"] for r in res["throughput"]),
    }
    if res["latency"]:
        for k in ("p50_ms", "p99_ms", "max_ms"):
            summary[f"latency_{k}"] = med(r[k] for r in res["latency"])
    for peer in ("taskiq", "celery"):
        p = res["peers"].get(peer) or {}
        summary[peer] = med(p["rates"]) if p.get("rates") else None
        if p.get("p99_ms"):
            summary[f"{peer}_latency_p99_ms"] = med(p["p99_ms"])
    summary["ours/floor_redis"] = common.ratio(ours, floor_rt)
    summary["ours/floor_sqlite_commits"] = common.ratio(ours, summary["floor_sqlite_commits"])
    summary["ours/taskiq"] = common.ratio(ours, summary["taskiq"])
    summary["ours/celery"] = common.ratio(ours, summary["celery"])
    if res["rss"]:
        summary["rss_max_growth_mb"] = res["rss"]["max_growth_mb"]
    return summary


def print_table(res: dict[str, Any], s: dict[str, Any]) -> None:
    cfg = res["config"]
    reps = cfg["reps"]
    rows: list[tuple[str, str, str]] = [
        ("floor: redis-py pipelined XADD + XREADGROUP + XACK", fmt(s["floor_redis_roundtrip"]),
         "msgs/s"),
        ("  of which XADD alone", fmt(s["floor_redis_xadd"]), "msgs/s"),
        ("  of which XREADGROUP + XACK alone", fmt(s["floor_redis_read_ack"]), "msgs/s"),
        ("floor: SQLite WAL synchronous=FULL commits", fmt(s["floor_sqlite_commits"]),
         "commits/s"),
        (f"broker_adapter end to end ({cfg['workers']} workers)", fmt(s["ours"]), "msgs/s"),
        ("  agent publish rate during it", fmt(s["ours_publish_rate"]), "msgs/s"),
        ("taskiq + taskiq-redis RedisStreamBroker", fmt(s["taskiq"]), "msgs/s"),
        ("Celery + Redis broker, acks_late", fmt(s["celery"]), "msgs/s"),
        ("ratio ours / floor redis", common.fmt_ratio(s["ours/floor_redis"]), ""),
        ("ratio ours / floor SQLite commits", common.fmt_ratio(s["ours/floor_sqlite_commits"]),
         ""),
        ("ratio ours / taskiq", common.fmt_ratio(s["ours/taskiq"]), ""),
        ("ratio ours / celery", common.fmt_ratio(s["ours/celery"]), ""),
    ]  # fmt: skip
    if "latency_p50_ms" in s:
        rate = fmt(cfg["latency_rate"])
        for k in ("p50", "p99", "max"):
            rows.append((f"latency publish->effect @ {rate} msg/s {k}",
                         f"{s[f'latency_{k}_ms']:.1f}", "ms"))  # fmt: skip
    if res["rss"]:
        for role, r in res["rss"]["per_process"].items():
            rows.append((f"RSS {role}: baseline -> peak", f"{r['baseline_mb']:.1f} -> "
                         f"{r['peak_mb']:.1f}", f"MB (+{r['growth_mb']:.1f})"))  # fmt: skip
        rows.append((f"RSS growth, worst process, {res['rss']['messages']:,} msgs",
                     f"{s['rss_max_growth_mb']:.1f}", "MB"))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print()
    print(f"broker_adapter bench: n={cfg['n']:,} reps={reps} (medians) "
          f"redis appendfsync={cfg['appendfsync']} sqlite synchronous=FULL "
          f"cpus={res['machine']['cpus']}")  # fmt: skip
    for label, value, unit in rows:
        print(f"  {label:<{width}}  {value:>16}  {unit}")
    for peer, p in res["peers"].items():
        if p.get("error"):
            print(f"  {peer}: n/a - {p['error'][:300]}")


def fmt(value: float | None) -> str:
    return common.fmt_rate(value)


# -- main -----------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    p = sub.add_parser("_publish")
    p.add_argument("--redis", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--deadline-in", type=float, default=3600.0, help="seconds (<= retention)")
    r = sub.add_parser("_receive")
    r.add_argument("--redis", required=True)
    r.add_argument("--db", required=True)
    r.add_argument("--prefix", required=True)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2,000 messages, 1 repetition, no peers, short latency and RSS runs",
    )
    parser.add_argument("--n", type=int, default=None, help="messages per throughput run [20000]")
    parser.add_argument("--reps", type=int, default=None, help="repetitions [3]")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rss-messages", type=int, default=None, help="[200000]")
    parser.add_argument("--latency-rate", type=float, default=1000.0, help="offered msg/s")
    parser.add_argument("--latency-seconds", type=float, default=None, help="per rep [10]")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="run the adapter with its Prometheus endpoint on (--metrics-port 0)",
    )
    parser.add_argument(
        "--only",
        choices=["floor", "throughput", "latency", "peers", "rss", "async"],
        action="append",
        help="run only these parts (repeatable)",
    )
    parser.add_argument(
        "--appendfsync", default=common.DEFAULT_APPENDFSYNC, choices=["always", "everysec", "no"]
    )
    parser.add_argument(
        "--no-quiesce",
        action="store_true",
        help="do not compact the AOF and sync the page cache before each measured phase",
    )
    parser.add_argument("--async-n", type=int, default=5000,
                        help="tasks per async-handler run [5000]")  # fmt: skip
    parser.add_argument("--async-concurrency", type=int, default=32,
                        help="async handlers at once per worker process [32]")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.role:
        return args
    quick = args.quick
    args.n = args.n or (2000 if quick else 20_000)
    args.reps = args.reps or (1 if quick else 3)
    args.rss_messages = args.rss_messages or (10_000 if quick else 200_000)
    args.latency_seconds = args.latency_seconds or (3.0 if quick else 10.0)
    if quick:
        args.no_peers = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "_publish":
        return child_publish(args)
    if args.role == "_receive":
        return child_receive(args)
    logging.basicConfig(level=logging.WARNING)
    parts = set(args.only or ["floor", "throughput", "latency", "peers", "rss", "async"])
    if args.no_peers:
        parts.discard("peers")
    res: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("role", "json")},
        "machine": common.machine(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "floor_redis": [], "floor_sqlite": [], "throughput": [], "latency": [],
        "peers": {}, "rss": None, "async": [], "async_taskiq": None,
    }  # fmt: skip
    res["config"]["sqlite_synchronous"] = "FULL"
    with tempfile.TemporaryDirectory(prefix="ba-bench-") as tmp:
        workdir = Path(tmp)
        keyring = common.write_keyring(workdir / "keyring.json")
        server = common.start_server(workdir, args.appendfsync)
        try:
            quiet = (lambda: None) if args.no_quiesce else (lambda: common.quiesce(server))
            for rep in range(1, args.reps + 1):
                if "floor" in parts:
                    quiet()
                    res["floor_redis"].append(common.redis_floor(server, args.n))
                    res["floor_sqlite"].append(common.sqlite_floor(workdir))
                    say(f"rep {rep}: floor redis {fmt(res['floor_redis'][-1]['roundtrip'])} "
                        f"msgs/s, sqlite {fmt(res['floor_sqlite'][-1])} commits/s")  # fmt: skip
                if "throughput" in parts:
                    quiet()
                    t = throughput_run(server.url, workdir, keyring, args)
                    res["throughput"].append(t)
                    say(f"rep {rep}: broker_adapter {fmt(t['rate'])} msgs/s "
                        f"({args.n:,} in {t['seconds']:.2f} s; agent published at "
                        f"{fmt(t['publish_rate'])} msgs/s)")  # fmt: skip
                if "latency" in parts:
                    quiet()
                    lat = latency_run(server.url, workdir, keyring, args)
                    res["latency"].append(lat)
                    say(f"rep {rep}: latency @ {fmt(args.latency_rate)} msg/s: p50 "
                        f"{lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max "
                        f"{lat['max_ms']:.1f} ms")  # fmt: skip
            if "peers" in parts:
                py, why = peers_python()
                for peer in ("taskiq", "celery"):
                    if py is None:
                        res["peers"][peer] = {"error": why}
                        continue
                    server.client().flushall()
                    quiet()
                    res["peers"][peer] = peer_runs(peer, py, server.url, args)
                    say(f"{peer}: {res['peers'][peer]}")
                    server.client().flushall()
            if "async" in parts:  # async handlers of 50 ms, ours and taskiq's (async_handlers)
                run_async_phase(server, quiet, workdir, keyring, args, res)
            if "rss" in parts:
                quiet()
                res["rss"] = rss_run(server.url, workdir, keyring, args)
                say(f"RSS over {args.rss_messages:,} msgs: worst growth "
                    f"{res['rss']['max_growth_mb']:.1f} MB")  # fmt: skip
        finally:
            server.stop()
    res["summary"] = summarise(res) if res["throughput"] and res["floor_redis"] else {}
    if res["summary"]:
        print_table(res, res["summary"])
    common.write_json(args.json, res)
    print(f"\nresults: {args.json}")
    return 0


def run_async_phase(
    server: Any, quiet: Any, workdir: Path, keyring: Path, args: argparse.Namespace,
    res: dict[str, Any],
) -> None:  # fmt: skip
    """``async_handlers``: ours ``--reps`` times, then taskiq on the same workload (unless
    ``--no-peers``); both printed."""
    n, c = args.async_n, args.async_concurrency
    for rep in range(1, args.reps + 1):
        quiet()
        a = async_handlers.adapter_run(server.url, workdir, keyring, n, args.workers, c)
        res["async"].append(a)
        say(f"rep {rep}: async 50 ms handlers, --concurrency {c}: broker_adapter "
            f"{fmt(a['rate'])} tasks/s ({n:,} in {a['seconds']:.2f} s; ideal "
            f"{fmt(a['ideal_rate'])})")  # fmt: skip
    if args.no_peers:
        return
    py, why = peers_python()
    server.client().flushall()
    quiet()
    res["async_taskiq"] = (
        {"error": why} if py is None
        else async_handlers.taskiq_run(py, server.url, n, args.reps, args.workers, c)
    )  # fmt: skip
    server.client().flushall()
    t = res["async_taskiq"]
    ours = common.median(r["rate"] for r in res["async"])
    theirs = "n/a: " + t["error"][:300] if t.get("error") else f"{fmt(t['median'])} tasks/s"
    say(f"async 50 ms handlers, concurrency {c} x {args.workers} workers: broker_adapter "
        f"{fmt(ours)} tasks/s, taskiq {theirs}")  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

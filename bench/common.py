"""Shared helpers of the benchmarks: the private server, the keyring, the floors, medians,
process memory and the JSON results file.

Not a test and not part of the library. Every number these helpers produce comes from the
redis-server started here (``broker_adapter.testing.RedisServer``, a free loopback port,
its own data directory) and from SQLite files in the same temporary directory, so the Redis
floor, the SQLite floor and the end-to-end runs share one disk and one server config.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker_adapter.protocol.envelope import Envelope  # noqa: E402
from broker_adapter.protocol.keys import INGEST_GROUP  # noqa: E402
from broker_adapter.protocol.signing import Keyring  # noqa: E402
from broker_adapter.redis.client import connect  # noqa: E402
from broker_adapter.store import open_database  # noqa: E402
from broker_adapter.testing import RedisServer, binary_available  # noqa: E402

#: The server config the README and docker-compose.yml recommend: every acknowledged write
#: is fsynced before the reply.
DEFAULT_APPENDFSYNC = "always"
PRINCIPAL = "agent-a"
SECRETS = {PRINCIPAL: {"k1": "a benchmark secret of reasonable length, 32+ bytes"}}
KEYRING = Keyring(SECRETS)
#: The payload every benchmark sends (plus its index and publish time): a small agent task.
PAYLOAD_BASE = {"action": "summarise", "doc": "doc-0", "words": 400, "lang": "en"}


def write_keyring(path: Path) -> Path:
    """Write the benchmark keyring as the JSON file ``broker-adapter run --keyring`` takes."""
    path.write_text(json.dumps(SECRETS))
    path.chmod(0o600)  # Keyring.load refuses a file its group or others may read
    return path


def start_server(workdir: Path, appendfsync: str = DEFAULT_APPENDFSYNC) -> RedisServer:
    """A private redis-server (AOF on, ``appendfsync`` as given) in ``workdir/redis``."""
    if not binary_available():
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(workdir / "redis", appendfsync=appendfsync)
    server.start()
    return server


def quiesce(server: RedisServer, timeout_s: float = 120.0) -> None:
    """Start a measured phase on a compacted AOF and a clean page cache.

    The phases share one redis-server. Without this, the AOF that the floor and the
    throughput runs leave behind crosses ``auto-aof-rewrite-min-size`` (64 MB) during a
    later phase, and that phase pays for a rewrite it did not cause: a fork, a base file of
    tens of MB written and fsynced beside its own writes (measured: p99 28.4 ms at 1,000
    msg/s with one, 16–18 ms without). A steady load at 1,000 msg/s rewrites too, about
    once a minute once the streams are small; bench/RESULTS.md shows both.
    """
    client = server.client()
    try:
        try:
            client.bgrewriteaof()
        except redis.ResponseError as exc:
            if "already in progress" not in str(exc):
                raise
        deadline = time.monotonic() + timeout_s
        while True:
            info = client.info("persistence")
            if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the AOF rewrite before a phase did not finish in time")
            time.sleep(0.05)  # polling the server's state, with a deadline
    finally:
        client.close()
    os.sync()


def new_prefix() -> str:
    return f"b{uuid.uuid4().hex[:8]}"


def envelope(
    index: int, published_at: float, run: str = "r", deadline_in: float = 3600.0
) -> Envelope:
    """The benchmark's task envelope number ``index``; ``t`` is its publish time (s). Its
    deadline lies ``deadline_in`` seconds ahead: at most the adapter's retention window."""
    payload = dict(PAYLOAD_BASE, doc=f"doc-{index}", i=index, t=published_at)
    return Envelope.build(
        message_id=f"{run}-{index}",
        sender=PRINCIPAL,
        payload=payload,
        deadline=time.time() + deadline_in,
    )


# -- statistics ----------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (``q`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


# -- floors --------------------------------------------------------------------------------


def _signed_fields(n: int) -> list[dict[bytes, bytes]]:
    """``n`` signed entries of the benchmark's size (built before any timing starts)."""
    now = time.time()
    return [cast(dict[bytes, bytes], KEYRING.sign(envelope(i, now, "floor"))) for i in range(n)]


def redis_floor(server: RedisServer, n: int, batch: int = 256) -> dict[str, float]:
    """Bare redis-py on the same server: pipelined XADD of ``n`` signed entries, then
    XREADGROUP COUNT ``batch`` + one XACK per batch until all are acknowledged.

    Returns:
        ``xadd`` and ``read_ack`` rates and ``roundtrip``, msgs/s (``n`` over both phases).
    """
    fields = _signed_fields(n)
    stream = f"floor{uuid.uuid4().hex[:8]}"
    client = connect(server.url)
    try:
        start = time.perf_counter()
        for lo in range(0, n, batch):
            pipe = client.pipeline(transaction=False)
            for f in fields[lo : lo + batch]:
                pipe.xadd(stream, f)  # type: ignore[arg-type]
            pipe.execute()
        added = time.perf_counter()
        client.xgroup_create(stream, INGEST_GROUP, id="0")
        done = 0
        while done < n:
            reply: Any = client.xreadgroup(
                INGEST_GROUP, "floor-0", {stream: ">"}, count=batch, block=100
            )
            for _, items in reply or []:
                ids = [eid for eid, _f in items]
                client.xack(stream, INGEST_GROUP, *ids)
                done += len(ids)
        end = time.perf_counter()
        client.delete(stream)
    finally:
        client.close()
    return {
        "xadd": n / (added - start),
        "read_ack": n / (end - added),
        "roundtrip": n / (end - start),
    }


def sqlite_floor(workdir: Path, commits: int = 2000) -> float:
    """Commits/s of one-row ``BEGIN IMMEDIATE`` ... ``COMMIT`` transactions through
    ``broker_adapter.store.db`` (WAL, ``synchronous=FULL``) on the benchmark's disk."""
    path = workdir / f"floor-{uuid.uuid4().hex[:8]}.db"
    db = open_database(path, synchronous="FULL")
    try:
        with db.write("floor") as c:
            c.execute("CREATE TABLE floor (i INTEGER PRIMARY KEY, v TEXT)")
        start = time.perf_counter()
        for i in range(commits):
            with db.write("floor") as c:
                c.execute("INSERT INTO floor (i, v) VALUES (?, ?)", (i, "x" * 200))
        elapsed = time.perf_counter() - start
    finally:
        db.close()
    return commits / elapsed


# -- processes and memory ------------------------------------------------------------------


def python_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: no ``BA_*`` leaking in, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> int | None:
    """SIGTERM one child we started and wait; SIGKILL it if it does not go."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def start_pipeline(
    server_url: str,
    prefix: str,
    keyring: Path,
    db: Path,
    rx_db: Path,
    retention_s: float,
    run_log: IO[Any],
    rx_log: IO[Any],
    workers: int = 2,
    name: str = "bench",
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """``broker-adapter run`` (handler ``broker_adapter.examples:echo``) and ``broker-adapter
    receive`` for ``PRINCIPAL``, both with ``--retention retention_s``, as the CLI a user
    runs. Returns (runner, receiver); stop them with ``terminate``."""
    env = python_env()
    retention = str(retention_s)
    runner = subprocess.Popen(
        [sys.executable, "-m", "broker_adapter", "run", "--redis", server_url,
         "--db", str(db), "--handler", "broker_adapter.examples:echo",
         "--workers", str(workers), "--keyring", str(keyring), "--prefix", prefix,
         "--name", name, "--retention", retention],
        cwd=ROOT, stdout=run_log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    receiver = subprocess.Popen(
        [sys.executable, "-m", "broker_adapter", "receive", "--redis", server_url,
         "--db", str(rx_db), "--principal", PRINCIPAL, "--keyring", str(keyring),
         "--prefix", prefix, "--retention", retention],
        cwd=ROOT, stdout=rx_log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    return runner, receiver


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def db_facts(path: Path, tables: tuple[str, ...]) -> dict[str, int]:
    """Free pages and row counts, read with a connection of its own (a reader in WAL mode
    never blocks the writers)."""
    out = {"free_pages": 0, **dict.fromkeys(tables, 0)}
    if not path.exists():
        return out
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        out["free_pages"] = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        for table in tables:
            try:
                out[table] = int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
            except sqlite3.OperationalError:
                pass
    except sqlite3.OperationalError:
        pass
    finally:
        conn.close()
    return out


def shut_down(procs: Iterable[subprocess.Popen[Any]], *closing: Any, server: RedisServer) -> None:
    """The end of a run: ``terminate`` the children (60 s each), close the files and
    clients in ``closing``, stop the private server."""
    for proc in procs:
        terminate(proc, 60)
    for thing in closing:
        thing.close()
    server.stop()


@dataclass
class RssWatch:
    """Samples the resident set size of a process tree on a thread, every ``every_s``.

    ``mark()`` records the current RSS of each process as its baseline (after warm-up);
    ``peak`` keeps the highest sample per process. Processes are keyed by a role name, found
    by ``roles()`` (called at every sample, so restarted children are picked up).
    """

    roles: Callable[[], dict[str, int]]
    every_s: float = 0.25
    peak: dict[str, int] = field(default_factory=dict)
    baseline: dict[str, int] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)
    samples: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rss-watch", daemon=True)

    def start(self) -> RssWatch:
        self._thread.start()
        return self

    def _sample(self) -> None:
        import psutil

        now: dict[str, int] = {}
        for role, pid in self.roles().items():
            try:
                now[role] = int(psutil.Process(pid).memory_info().rss)
            except psutil.Error:
                continue
        with self._lock:
            self.last = now
            self.samples += 1
            for role, rss in now.items():
                self.peak[role] = max(self.peak.get(role, 0), rss)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def mark(self) -> None:
        """Take the current RSS as the baseline and restart the peaks from it."""
        self._sample()
        with self._lock:
            self.baseline = dict(self.last)
            self.peak = dict(self.last)

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop sampling. Returns per role: baseline, peak and growth, in MB."""
        self._sample()
        self._stop.set()
        self._thread.join(5)
        mb = 1024 * 1024
        return {
            role: {
                "baseline_mb": self.baseline.get(role, 0) / mb,
                "peak_mb": peak / mb,
                "growth_mb": (peak - self.baseline.get(role, peak)) / mb,
            }
            for role, peak in sorted(self.peak.items())
        }


# -- output --------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import redis

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "redis_server": version,
        "platform": platform.platform(),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def fmt_rate(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:,.0f}"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"

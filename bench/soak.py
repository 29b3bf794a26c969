"""A soak: does the pipeline stop growing once the retention window has passed?

Not a test. Starts a redis-server of its own on a free port, ``broker-adapter run`` and
``broker-adapter receive`` (both with ``--retention S``) and a publisher offering ``--rate``
signed tasks a second for ``--minutes``, then samples every ``--every`` seconds, into
``soak.csv``:

* Redis: ``used_memory``, the key count, the lengths of the inbound and reply streams;
* SQLite: the adapter's and the receiver's file sizes (main file and ``-wal``), their
  free pages and the rows of ``tasks``, ``inbox``, ``outbox`` and ``receipts``;
* RSS of the runner (with its worker processes), of the receiver and of redis-server.

At the end it draws ``soak.png`` (matplotlib: ``pip install -e '.[bench]'``) and writes
``summary.json``: the last samples, the growth over the second half of the run, and the
purge transactions' write-lock times from the runner's and receiver's logs (``purged ...``
lines, one per pass: the medians of their p50 and the highest p99 and max). Usage::

    .venv/bin/python bench/soak.py --rate 500 --minutes 3 --retention 30
    .venv/bin/python bench/soak.py --rate 2000 --minutes 10 --retention 60 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import KEYRING, PRINCIPAL, ROOT

from broker_adapter.protocol.envelope import Envelope
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis.client import connect

PUBLISH_BATCH = 50
COLUMNS = [
    "t_s", "published",
    "redis_used_memory", "redis_keys", "inbound_len", "replies_len",
    "adapter_db_bytes", "adapter_wal_bytes", "adapter_free_pages",
    "receiver_db_bytes", "receiver_wal_bytes", "receiver_free_pages",
    "tasks", "inbox", "outbox", "receipts",
    "runner_rss", "receiver_rss", "redis_rss",
]  # fmt: skip
PURGED = re.compile(
    r"purged (\d+) requests .*?, (\d+) receipts in (\d+) transactions; write lock held"
    r" p50 ([\d.]+) p99 ([\d.]+) max ([\d.]+) ms, work p50 ([\d.]+) p99 ([\d.]+) max ([\d.]+)"
)


# -- the publisher (this file, run as a subprocess) -------------------------------------------


def child_publish(args: argparse.Namespace) -> int:
    """Offer ``--rate`` envelopes a second until ``--seconds`` have passed or SIGTERM, in
    small pipelined batches on a schedule; deadlines inside the retention window."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    client = connect(args.redis)
    stream = Keys(args.prefix).inbound()
    ahead = min(args.retention * 0.9, 3600.0)
    start, sent = time.time(), 0
    count_file = Path(args.count_file)
    while not stop.is_set() and time.time() - start < args.seconds:
        due = start + (sent + PUBLISH_BATCH) / args.rate
        pipe = client.pipeline(transaction=False)
        now = time.time()
        for i in range(sent, sent + PUBLISH_BATCH):
            payload = dict(common.PAYLOAD_BASE, i=i, t=now)
            env = Envelope.build(message_id=f"soak-{i}", sender=PRINCIPAL, payload=payload,
                                 deadline=now + ahead)  # fmt: skip
            pipe.xadd(stream, KEYRING.sign(env))  # type: ignore[arg-type]
        pipe.execute()
        sent += PUBLISH_BATCH
        partial = count_file.with_suffix(".partial")
        partial.write_text(str(sent))
        partial.replace(count_file)  # the sampler never reads a half-written count
        delay = due - time.time()
        if delay > 0:
            stop.wait(delay)  # pacing an offered load
    client.close()
    return 0


# -- sampling ------------------------------------------------------------------------------


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += int(p.memory_info().rss)
        except psutil.Error:
            continue
    return total


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.prefix = common.new_prefix()
        self.keys = Keys(self.prefix)
        self.db = workdir / "adapter.db"
        self.rx_db = workdir / "receiver.db"
        self.count_file = workdir / "published"
        self.server = common.start_server(workdir, appendfsync=args.appendfsync)
        keyring = common.write_keyring(workdir / "keyring.json")
        retention = str(args.retention)
        self.run_log = (workdir / "run.log").open("w")
        self.rx_log = (workdir / "receive.log").open("w")
        env = common.python_env()
        self.runner, self.receiver = common.start_pipeline(
            self.server.url, self.prefix, keyring, self.db, self.rx_db, args.retention,
            self.run_log, self.rx_log, workers=args.workers, name="soak",
        )  # fmt: skip
        self.publisher = subprocess.Popen(
            [sys.executable, __file__, "_publish", "--redis", self.server.url,
             "--prefix", self.prefix, "--rate", str(args.rate),
             "--seconds", str(args.minutes * 60), "--retention", retention,
             "--count-file", str(self.count_file)],
            cwd=ROOT, stdout=self.run_log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        self.client = self.server.client()
        self.started = time.monotonic()

    def sample(self) -> dict[str, float]:
        info = self.client.info("memory")
        adapter = common.db_facts(self.db, ("tasks", "inbox", "outbox"))
        rx = common.db_facts(self.rx_db, ("receipts",))
        redis_pid = int(self.client.info("server")["process_id"])
        try:
            published = int(self.count_file.read_text() or 0)
        except (FileNotFoundError, ValueError):
            published = 0
        return {
            "t_s": round(time.monotonic() - self.started, 1),
            "published": published,
            "redis_used_memory": int(info["used_memory"]),
            "redis_keys": int(self.client.dbsize()),
            "inbound_len": int(self.client.xlen(self.keys.inbound())),
            "replies_len": int(self.client.xlen(self.keys.replies(PRINCIPAL))),
            "adapter_db_bytes": common.file_size(self.db),
            "adapter_wal_bytes": common.file_size(Path(f"{self.db}-wal")),
            "adapter_free_pages": adapter["free_pages"],
            "receiver_db_bytes": common.file_size(self.rx_db),
            "receiver_wal_bytes": common.file_size(Path(f"{self.rx_db}-wal")),
            "receiver_free_pages": rx["free_pages"],
            "tasks": adapter["tasks"],
            "inbox": adapter["inbox"],
            "outbox": adapter["outbox"],
            "receipts": rx["receipts"],
            "runner_rss": _tree_rss(self.runner.pid),
            "receiver_rss": _tree_rss(self.receiver.pid),
            "redis_rss": _tree_rss(redis_pid),
        }

    def stop(self) -> None:
        for proc in (self.publisher, self.receiver, self.runner):
            common.terminate(proc)
        self.client.close()
        self.server.stop()
        self.run_log.close()
        self.rx_log.close()


def purge_times(*logs: Path) -> dict[str, Any]:
    """The purge passes logged by the runner and the receiver (one line per pass)."""
    passes = []
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            m = PURGED.search(line)
            if m:
                passes.append([float(x) for x in m.groups()])
    if not passes:
        return {"passes": 0}
    col = list(zip(*passes, strict=True))
    return {
        "passes": len(passes),
        "requests": int(sum(col[0])),
        "receipts": int(sum(col[1])),
        "transactions": int(sum(col[2])),
        "held_ms": {"p50_median": statistics.median(col[3]), "p99_max": max(col[4]),
                    "max": max(col[5])},
        "work_ms": {"p50_median": statistics.median(col[6]), "p99_max": max(col[7]),
                    "max": max(col[8])},
    }  # fmt: skip


GROWTH_COLUMNS = ("adapter_db_bytes", "receiver_db_bytes", "tasks", "receipts",
                  "redis_used_memory", "redis_keys")  # fmt: skip


def second_half_growth(rows: list[dict[str, float]], column: str, end_s: float) -> float | None:
    """How much ``column`` grew from the middle of the publishing to its end (ratio)."""
    busy = [r for r in rows if r["t_s"] <= end_s]
    if len(busy) < 4:
        return None
    mid, last = busy[len(busy) // 2][column], busy[-1][column]
    return None if mid == 0 else (last - mid) / mid


def plot(rows: list[dict[str, float]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    mb = 1024 * 1024
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    panels: list[tuple[Any, str, list[tuple[str, str, float]]]] = [
        (axes[0][0], "SQLite files (MB)", [
            ("adapter_db_bytes", "adapter db", mb), ("adapter_wal_bytes", "adapter -wal", mb),
            ("receiver_db_bytes", "receiver db", mb), ("receiver_wal_bytes", "receiver -wal", mb),
        ]),
        (axes[0][1], "SQLite rows", [
            ("tasks", "tasks", 1), ("inbox", "inbox", 1), ("outbox", "outbox", 1),
            ("receipts", "receipts", 1),
        ]),
        (axes[1][0], "Redis used_memory (MB)", [("redis_used_memory", "used_memory", mb)]),
        (axes[1][1], "Redis keys and streams", [
            ("redis_keys", "keys", 1), ("inbound_len", "inbound stream", 1),
            ("replies_len", "reply stream", 1),
        ]),
        (axes[2][0], "RSS (MB)", [
            ("runner_rss", "runner + workers", mb), ("receiver_rss", "receiver", mb),
            ("redis_rss", "redis-server", mb),
        ]),
        (axes[2][1], "messages published (thousands)", [("published", "published", 1000)]),
    ]  # fmt: skip
    for ax, name, series in panels:
        for column, label, scale in series:
            ax.plot(t, [r[column] / scale for r in rows], label=label)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[2]:
        ax.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="messages per second offered")
    parser.add_argument("--minutes", type=float, default=3.0, help="how long to publish")
    parser.add_argument("--retention", type=float, default=30.0, help="seconds, both processes")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument(
        "--drain",
        type=float,
        default=None,
        help="seconds to sample after publishing (default: 2 windows + 15 s)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--appendfsync", default="everysec", help="the Redis AOF's fsync")
    parser.add_argument("--out", type=Path, default=None, help="directory for csv/png/json")
    args = parser.parse_args(argv)
    out = args.out or ROOT / "bench" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    drain_s = args.drain if args.drain is not None else 2 * args.retention + 15
    total_s = args.minutes * 60 + drain_s
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="ba-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        try:
            with (out / "soak.csv").open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                writer.writeheader()
                while time.monotonic() - soak.started < total_s:
                    time.sleep(args.every)  # the sampling interval
                    row = soak.sample()
                    rows.append(row)
                    writer.writerow(row)
                    f.flush()
                    print(json.dumps(row), flush=True)
                    if soak.runner.poll() is not None or soak.receiver.poll() is not None:
                        raise RuntimeError(f"a process stopped early; see {tmp}/*.log")
        finally:
            soak.stop()
            for name in ("run.log", "receive.log"):
                (out / name).write_bytes((Path(tmp) / name).read_bytes())
    title = (f"soak: {args.rate:g} msg/s for {args.minutes:g} min, retention {args.retention:g} s"
             f" ({int(rows[-1]['published']):,} messages)")  # fmt: skip
    plot(rows, out / "soak.png", title)
    summary = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "published": int(rows[-1]["published"]),
        "last": rows[-1],
        "peak": {c: max(r[c] for r in rows) for c in COLUMNS},
        "second_half_growth": {
            c: second_half_growth(rows, c, args.minutes * 60) for c in GROWTH_COLUMNS
        },
        "purge": purge_times(out / "run.log", out / "receive.log"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_publish":
        p = argparse.ArgumentParser()
        for name in ("--redis", "--prefix", "--count-file"):
            p.add_argument(name, required=True)
        for name in ("--rate", "--seconds", "--retention"):
            p.add_argument(name, type=float, required=True)
        sys.exit(child_publish(p.parse_args(sys.argv[2:])))
    sys.exit(main())

"""``status --watch``: a view per interval, read-only, until Ctrl-C; driven here by an
injected count of views, pause and clock (nothing sleeps)."""

from __future__ import annotations

import io
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker_adapter.app.ops import watch_status
from broker_adapter.clock import FakeClock
from broker_adapter.errors import ConfigError
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.store import AcceptItem, TaskStore, open_database
from broker_adapter.store.task_types import TaskPolicy
from tests.support.cli import cli_env, wait_for
from tests.support.redis_server import free_port


def _database(path: Path, clock: FakeClock, n: int) -> None:
    with open_database(path) as db:
        tasks = TaskStore(db, clock, TaskPolicy(), rng=random.Random(1))
        for i in range(n):
            env = Envelope.build(
                message_id=f"m{i}", sender="a", payload={"i": i}, deadline=clock.now() + 600
            )
            tasks.accept([AcceptItem("a", env)])


@pytest.fixture
def clock() -> FakeClock:
    """A minute ago: ``status`` reads the database at the wall clock's now."""
    return FakeClock(time.time() - 60)


class _Pauses:
    """The pauses asked for; the database changes during the second one."""

    def __init__(self, path: Path, clock: FakeClock) -> None:
        self.asked: list[float] = []
        self.path, self.clock = path, clock

    def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        if len(self.asked) == 2:
            with open_database(self.path) as db:
                TaskStore(db, self.clock, TaskPolicy(), rng=random.Random(2)).claim("w1", 2)


def test_watch_shows_a_view_per_interval_and_follows_the_database(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "adapter.db"
    _database(path, clock, 3)
    out, pauses = io.StringIO(), _Pauses(path, clock)
    times = iter([1000.0, 1002.0, 1004.0])
    code = watch_status(
        path, None, "ba", 2.0, out=out, iterations=3, wait=pauses, now=lambda: next(times)
    )
    assert code == 0
    assert pauses.asked == [2.0, 2.0]
    views = out.getvalue().split("\n\n")
    assert len(views) == 3
    for view in views:
        assert "every 2 s, Ctrl-C to stop" in view
        for stage in ("received", "processing", "terminal", "delivery"):
            assert f"\n{stage} " in view
    assert "pending 3 (ready 3)  running 0" in views[1]
    assert "pending 1 (ready 1)  running 2" in views[2]
    assert "\x1b[" not in out.getvalue()  # not a terminal: views follow each other


def test_watch_json_is_one_object_per_view(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "adapter.db"
    _database(path, clock, 2)
    before = path.stat().st_mtime_ns, path.stat().st_size
    out = io.StringIO()
    times = iter([5.0, 6.5])
    watch_status(
        path,
        None,
        "ba",
        1.5,
        as_json=True,
        out=out,
        iterations=2,
        wait=lambda s: None,
        now=lambda: next(times),
    )
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["at"] for line in lines] == [5.0, 6.5]
    assert all(line["processing"]["pending"] == 2 for line in lines)
    assert all(line["delivery"]["oldest_unsent_age_s"] is None for line in lines)
    assert (path.stat().st_mtime_ns, path.stat().st_size) == before  # only read


def test_ctrl_c_ends_the_watch_cleanly(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "adapter.db"
    _database(path, clock, 1)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    out = io.StringIO()
    assert watch_status(path, None, "ba", 1.0, out=out, wait=interrupted) == 0
    assert out.getvalue().count("Ctrl-C to stop") == 1


def test_watch_needs_the_database(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        watch_status(tmp_path / "absent.db", None, "ba", 1.0, out=io.StringIO(), iterations=1)


def test_the_command_refreshes_until_ctrl_c(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "adapter.db"
    _database(path, clock, 2)
    log = tmp_path / "watch.out"
    root = Path(__file__).resolve().parents[2]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker_adapter",
                "status",
                "--db",
                str(path),
                "--watch",
                "--interval",
                "0.05",
            ],
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli_env(),
        )
    try:
        wait_for(lambda: log.read_text().count("Ctrl-C to stop") >= 2, "two views")
    finally:
        proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert "Traceback" not in log.read_text()
    assert "pending 2" in log.read_text()


def test_a_bad_interval_is_a_usage_error(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "adapter.db"
    _database(path, clock, 0)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "status",
            "--db",
            str(path),
            "--watch",
            "--interval",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
        cwd=Path(__file__).resolve().parents[2],
    )
    assert res.returncode == 2
    assert "--interval" in res.stderr


def test_a_redis_that_does_not_answer_is_a_line_of_the_view(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "adapter.db"
    _database(path, clock, 1)
    out = io.StringIO()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    watch_status(path, url, "ba", 1.0, out=out, iterations=2, wait=lambda s: None)
    views = out.getvalue().split("\n\n")
    assert len(views) == 2
    assert all("redis       not answering:" in v and "pending 1" in v for v in views)

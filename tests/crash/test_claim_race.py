"""Two processes race ``claim`` for one task on one database, 100 rounds: a SQLite file,
and a PostgreSQL database (where the claim takes its row ``FOR UPDATE SKIP LOCKED``).

Two long-lived claim servers (``tests.support.store_script serve``) are driven over their
stdin/stdout. Each round: this process accepts one pending task, tells both servers to
claim, waits until both report ``ready`` (they now spin on a go-file), creates the go-file,
and reads both answers. Exactly one of them must hold the task, every round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.clock import FakeClock
from tests.support.store_script import T0, dump, item, open_any, stores

pytestmark = pytest.mark.crash

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 100


class Claimer:
    def __init__(self, db_path: str, owner: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("BA_CRASHPOINT", "BA_PAUSEPOINT")}
        self.owner = owner
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.store_script", "serve", str(db_path), owner],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"{self.owner} exited early with {self.proc.poll()}"
        return line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def claimers(store_target: str) -> Iterator[tuple[Claimer, Claimer]]:
    db_path = store_target
    open_any(db_path).close()  # migrate once, before the racers open it
    pair = (Claimer(db_path, "racer-a"), Claimer(db_path, "racer-b"))
    yield pair
    for claimer in pair:
        claimer.stop()
    assert [c.proc.returncode for c in pair] == [0, 0]


def test_claim_race_gives_each_task_to_exactly_one_process(
    claimers: tuple[Claimer, Claimer], store_target: str, tmp_path: Path
) -> None:
    clock = FakeClock(T0)
    winners: Counter[str] = Counter()
    with open_any(store_target) as db:
        tasks = stores(db, clock).tasks
        for n in range(ROUNDS):
            (res,) = tasks.accept([item(f"m{n}")])
            assert res.task_id is not None
            now = clock.advance(0.001)
            go = tmp_path / f"go-{n}"
            for claimer in claimers:
                claimer.send(f"claim {now!r} {go}")
            assert [c.read() for c in claimers] == ["ready", "ready"]
            go.touch()
            answers = {c.owner: json.loads(c.read()) for c in claimers}
            holders = [owner for owner, got in answers.items() if got == [res.task_id]]
            assert len(holders) == 1, f"round {n}: {answers}"
            assert sorted(map(len, answers.values())) == [0, 1], f"round {n}: {answers}"
            winners[holders[0]] += 1
            row = tasks.get(res.task_id)
            assert row is not None
            assert (row.state, row.owner, row.attempts, row.fence) == (
                "running",
                holders[0],
                1,
                1,
            )
        final = dump(db)
    assert sum(winners.values()) == ROUNDS
    assert len(final["tasks"]) == ROUNDS
    assert all(t["state"] == "running" and t["fence"] == 1 for t in final["tasks"])
    assert Counter(t["owner"] for t in final["tasks"]) == winners

"""``fences.SqlFence``: the highest fence per key, refused below it, on any DB-API driver."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_adapter.fences import SqlFence, TargetFenced


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    c = sqlite3.connect(tmp_path / "target.db")
    c.execute(SqlFence().create_sql())
    yield c
    c.close()


def test_first_write_inserts_equal_and_higher_pass_lower_is_refused(
    conn: sqlite3.Connection,
) -> None:
    fence = SqlFence()
    with conn:
        fence.advance(conn.cursor(), "task-1", 3)
    assert fence.highest(conn.cursor(), "task-1") == 3
    with conn:
        fence.advance(conn.cursor(), "task-1", 3)  # the same attempt writing again
        fence.advance(conn.cursor(), "task-1", 5)
    with pytest.raises(TargetFenced) as refused, conn:
        fence.advance(conn.cursor(), "task-1", 4)
    assert (refused.value.key, refused.value.fence, refused.value.highest) == ("task-1", 4, 5)
    assert refused.value.reason == "fence"
    assert fence.highest(conn.cursor(), "task-1") == 5


def test_keys_are_independent(conn: sqlite3.Connection) -> None:
    fence = SqlFence()
    with conn:
        fence.advance(conn.cursor(), "task-1", 9)
        fence.advance(conn.cursor(), "task-2", 1)
    assert fence.highest(conn.cursor(), "task-2") == 1
    assert fence.highest(conn.cursor(), "task-3") is None


@pytest.mark.parametrize(
    ("style", "mark"), [("qmark", "?"), ("format", "%s"), ("pyformat", "%s"), ("numeric", ":3")]
)
def test_statements_use_the_drivers_placeholders(style: str, mark: str) -> None:
    fence = SqlFence("fences", paramstyle=style)  # type: ignore[arg-type]
    assert mark in fence._update
    assert fence._update.startswith("UPDATE fences SET fence = ")


def test_numeric_style_runs_on_sqlite(conn: sqlite3.Connection) -> None:
    """sqlite3 also takes ``:1``-style placeholders: the numeric statements really run."""
    fence = SqlFence(paramstyle="numeric")
    with conn:
        fence.advance(conn.cursor(), "k", 2)
    with pytest.raises(TargetFenced), conn:
        fence.advance(conn.cursor(), "k", 1)
    assert fence.highest(conn.cursor(), "k") == 2


@pytest.mark.parametrize("table", ["", "a b", "x;DROP TABLE y", "1abc"])
def test_refuses_a_table_name_that_is_not_an_identifier(table: str) -> None:
    with pytest.raises(ValueError, match="identifier"):
        SqlFence(table)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_refuses_what_is_not_a_fence(conn: sqlite3.Connection, bad: object) -> None:
    with pytest.raises(ValueError, match="fence"):
        SqlFence().advance(conn.cursor(), "k", bad)  # type: ignore[arg-type]

"""The fake external service of the side-effect tests (``tests.support.fake_target``): its
own process and SQLite file, idempotent or not, fenced writes, lost answers, compensation."""

from __future__ import annotations

import http.client
import sqlite3
from pathlib import Path

import pytest

from tests.support.fake_target import FakeTarget, TargetError


def rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM effects").fetchone()[0])


def test_an_idempotent_target_applies_a_key_once(tmp_path: Path) -> None:
    target = FakeTarget(tmp_path / "t", idempotent=True)
    with target as client:
        first = client.apply({"restart": "web1"}, key="ba1-k")
        again = client.apply({"restart": "web1"}, key="ba1-k")
        assert (first["applied"], again["applied"], again["duplicate"]) == (True, False, True)
        assert again["effect_id"] == first["effect_id"]
        client.apply({"restart": "web2"}, key="ba1-other")
        assert [e["what"] for e in client.effects("ba1-k")] == [{"restart": "web1"}]
        assert len(client.effects()) == 2
    assert target.proc is not None
    assert target.proc.returncode is not None  # stopped
    assert rows(target.db) == 2  # its own durable file


def test_a_non_idempotent_target_applies_every_request(tmp_path: Path) -> None:
    with FakeTarget(tmp_path / "t", idempotent=False) as client:
        client.apply({"charge": 5}, key="ba1-k")
        client.apply({"charge": 5}, key="ba1-k")
        applied = client.effects("ba1-k")
        assert len(applied) == 2
        assert client.compensate(applied[1]["effect_id"])
        assert not client.compensate(applied[1]["effect_id"])  # once
        assert len(client.effects("ba1-k")) == 1


def test_a_fenced_write_from_a_zombie_is_refused(tmp_path: Path) -> None:
    with FakeTarget(tmp_path / "t") as client:
        client.apply("by fence 5", key="k5", fence_key="task-1", fence=5)
        with pytest.raises(TargetError) as refused:
            client.apply("by the zombie", key="k4", fence_key="task-1", fence=4)
        assert refused.value.status == 409
        assert refused.value.body["highest"] == 5
        assert [e["what"] for e in client.effects()] == ["by fence 5"]


def test_a_dropped_answer_still_applied_the_effect(tmp_path: Path) -> None:
    with FakeTarget(tmp_path / "t") as client:
        with pytest.raises((OSError, http.client.HTTPException)):
            client.apply("applied, never answered", key="ba1-lost", drop_response=True)
        assert len(client.effects("ba1-lost")) == 1

"""Replayability: the workload plan and the fault deck come from the seed alone."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any, cast

import pytest

from broker_adapter.protocol.envelope import Envelope
from tests.chaos.history import History, read_events
from tests.chaos.hostile import INBOUND_SHAPES
from tests.chaos.nemesis import Nemesis, packages_for
from tests.chaos.workload import DEFAULT_WEIGHTS, Agent, AgentConfig, make_keyring

pytestmark = pytest.mark.chaos


def _plan(tmp_path: Path, seed: int, *, acked: bool) -> list[tuple[str, ...]]:
    """What agent p1 would publish in 300 steps, with every publish acknowledged or not."""
    keyring = make_keyring(["p1", "p2"], seed)
    config = AgentConfig(
        principal="p1",
        index=0,
        messages=300,
        duration_s=1.0,
        lease_s=1.5,
        weights=dict(DEFAULT_WEIGHTS),
        peers={"p2": 300},
    )
    with History(tmp_path / f"h-{seed}-{acked}.jsonl") as history:
        agent = Agent(
            config, seed, "redis://127.0.0.1:1/0", "px", keyring, history, None, threading.Event()
        )
        calls: list[tuple[str, ...]] = []

        def publish(
            key: str, envelope: Envelope, kind: str, seq: int, *, late: bool = False
        ) -> bool:
            # the deadline is part of the fingerprint and comes from the wall clock: the plan
            # is the content without it
            calls.append((key, kind, envelope.replace(deadline=1.0).fingerprint()))
            return acked

        def xadd_raw(stream: str, fields: list[tuple[bytes, bytes]]) -> str:
            assert fields[0][0] == b"chaos_key"  # first, so a bounded dead letter keeps it
            calls.append(("raw", fields[0][1].decode(), *sorted({k.decode() for k, _ in fields})))
            return "1-0"

        agent._publish = publish  # type: ignore[method-assign]
        agent._xadd_raw = xadd_raw  # type: ignore[method-assign]
        for seq in range(300):
            agent._step(seq)
        agent.client.close()
    return calls


def test_workload_plan_depends_on_the_seed_only(tmp_path: Path) -> None:
    first = _plan(tmp_path, 5, acked=True)
    assert first == _plan(tmp_path, 5, acked=False)  # outcomes do not change the plan
    assert first != _plan(tmp_path, 6, acked=True)
    kinds = {c[1] for c in first if c[0] != "raw"} | {"bad"}
    assert {"ok", "transient", "slow", "crash", "dup_same", "dup_diff"} <= kinds


def test_workload_deals_every_inbound_poison_shape_with_its_reasons(tmp_path: Path) -> None:
    _plan(tmp_path, 5, acked=True)
    invokes = [
        e["value"]
        for e in read_events(tmp_path / "h-5-True.jsonl")
        if e["f"] == "publish" and e["type"] == "invoke" and e["value"]["class"] == "reject"
    ]
    shapes = {v["kind"]: tuple(v["reasons"]) for v in invokes if v["kind"] in INBOUND_SHAPES}
    assert shapes == INBOUND_SHAPES


def test_nemesis_deck_deals_every_package_before_repeating_one() -> None:
    packages = packages_for("durable")
    nemesis = Nemesis(
        cast(Any, None),
        cast(Any, None),
        cast(Any, None),
        random.Random(3),
        packages,
        mode="durable",
        lease_s=1.5,
        adapter_db=Path("x.db"),
        prefix="px",
        principals=("p1",),
    )
    dealt: list[str] = []
    rng = random.Random(4)
    while len(dealt) < len(packages):
        dealt += nemesis.draw(rng.randint(1, 3))
    assert set(dealt[: len(packages)]) == set(packages)  # one full deck first
    assert all(len(set(nemesis.draw(3))) == 3 for _ in range(50))

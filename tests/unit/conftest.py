"""Fixtures shared by the unit tests: the clock at ``T0``, the stores on the test's database
(``db``, from ``tests/conftest.py``) and the effects store on them."""

from __future__ import annotations

import pytest

from broker_adapter.clock import FakeClock
from broker_adapter.store.db import Database
from broker_adapter.store.effects import EffectsStore
from tests.support.store_script import T0, SqliteStores, Stores, stores


@pytest.fixture
def clock() -> FakeClock:
    """The test clock at ``store_script.T0``, which the unit tests' figures count from."""
    return FakeClock(T0)


@pytest.fixture
def s(db: Database, clock: FakeClock) -> SqliteStores:
    """The task, outbox and receipt stores on the test's database (``stores``: the shared
    test policies, a seeded rng)."""
    return stores(db, clock)


@pytest.fixture
def fx(s: Stores) -> EffectsStore:
    """The effects and approvals store on the test's task store."""
    return EffectsStore(s.tasks.tx)

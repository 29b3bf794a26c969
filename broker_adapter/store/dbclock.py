"""Whose clock a store judges time by: one clock for every host that shares a database.

A lease, a deadline, a backoff and an approval's expiry are compared with "now" by every
host that claims, renews, commits or takes back a row. If each host used its own clock, a
host running 40 s ahead would take over leases still held, and a paused host running
behind would commit past its own. So:

* On PostgreSQL (``Dialect.server_clock``) a store's transaction asks the database server
  for the time (``tx_now``: ``clock_timestamp()``, read inside the same transaction that
  then writes with it), whatever the host's clock says. Every host that shares the
  database judges by that one clock; no host needs a synchronised clock.
* On SQLite the database is one file on one host: the process clock is that host's, and
  ``tx_now`` returns it.

The store's injected ``Clock`` decides which: the host's clock (``SystemClock``, and
its subclasses) yields to the server's on PostgreSQL; any other
``Clock`` (a test's ``FakeClock``) is taken as the time on both engines, so tests that move
time by hand keep doing so.

``clock_skew`` measures how far the host's clock is from the server's (at start-up, for
``status`` and the ``ba_clock_skew_seconds`` metric): with the server as the one clock a
skew no longer moves a lease, but it still moves what the host alone decides (a handler's
``time_left_s``, the deadline a publisher writes, the timestamps it records).
"""

from __future__ import annotations

import logging
from typing import Any, Final

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.store.sql import Conn, Db

#: Seconds of skew between a host and the database server above which an adapter warns at
#: start (and ``BrokerAdapterClockSkew`` fires): leases stay safe, but the deadlines a
#: host writes and its handlers' time budgets are off by that much.
SKEW_WARN_S: Final = 5.0

#: The server's time, epoch seconds, as a ``double precision`` (``clock_timestamp()``
#: moves within a transaction, unlike ``now()``: the time of this statement, not of BEGIN).
SERVER_NOW: Final = "SELECT extract(epoch FROM clock_timestamp())::float8 AS now"


def uses_server(dialect_server_clock: bool, clock: Clock) -> bool:
    """Whether a store with ``clock`` on an engine with a server clock asks the server."""
    return dialect_server_clock and isinstance(clock, SystemClock)


def tx_now(c: Conn, clock: Clock) -> float:
    """The time the caller's transaction judges leases, deadlines and expiries by: the
    server's (``SERVER_NOW``, in this transaction) on PostgreSQL with the host's clock,
    else ``clock.now()``."""
    if uses_server(c.dialect.server_clock, clock):
        return float(c.execute(SERVER_NOW).fetchone()["now"])
    return clock.now()


def read_now(db: Db, clock: Clock) -> float:
    """``tx_now`` for a caller outside a transaction (a read that judges a lease)."""
    if uses_server(db.dialect.server_clock, clock):
        row = db.fetch_one(SERVER_NOW)
        assert row is not None
        return float(row["now"])
    return clock.now()


def clock_skew(db: Db, clock: Clock | None = None) -> float | None:
    """Seconds the host's ``clock`` is ahead of the database server's (negative: behind),
    measured as the server's time against the midpoint of the host's before and after the
    read; ``None`` on an engine without a server clock (SQLite: one host, one clock)."""
    if not db.dialect.server_clock:
        return None
    host = clock or SystemClock()
    before = host.now()
    row = db.fetch_one(SERVER_NOW)
    after = host.now()
    assert row is not None
    return (before + after) / 2 - float(row["now"])


def clock_report(db: Db) -> dict[str, Any]:
    """What ``status`` shows of the clocks: ``source`` (``database server`` or
    ``process``) and ``skew_s`` (``clock_skew``, rounded to the millisecond; ``None`` on
    SQLite)."""
    skew = clock_skew(db)
    return {
        "source": "database server" if db.dialect.server_clock else "process",
        "skew_s": None if skew is None else round(skew, 3),
    }


def report_clock_skew(db: Db, log: logging.Logger, clock: Clock | None = None) -> float | None:
    """Measure ``clock_skew`` of ``clock`` (default: the host's; at an adapter's start) and
    log it: a warning above ``SKEW_WARN_S``. Returns it (``None`` on SQLite, where nothing
    is logged)."""
    skew = clock_skew(db, clock)
    if skew is None:
        return None
    if abs(skew) > SKEW_WARN_S:
        log.warning(
            "this host's clock is %+.3f s from the database server's (over %g s): leases"
            " are judged by the server's clock, but the deadlines this host writes and its"
            " handlers' time budgets are off by that much; fix its time service",
            skew,
            SKEW_WARN_S,
        )
    else:
        log.info("clock: leases judged by the database server's; this host %+.3f s", skew)
    return skew

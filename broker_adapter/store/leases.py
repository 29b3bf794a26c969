"""How long a holder keeps what it claimed: the one lease default.

``DEFAULT_LEASE_S`` is the lease a worker gets on a task (``TaskPolicy.lease_s``) and a
publisher on a reply row (``OutboxPolicy.lease_s``, and a worker that publishes its own
replies). Its Redis-side counterpart, how long a stream entry stays pending before another
consumer may take it over, is ``redis.reader.DEFAULT_CLAIM_MIN_IDLE_MS`` (twice the lease).
"""

from __future__ import annotations

from typing import Final

DEFAULT_LEASE_S: Final = 30.0

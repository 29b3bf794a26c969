"""How long a holder keeps what it claimed: the defaults every package uses.

``DEFAULT_LEASE_S`` is the lease a worker gets on a task (``TaskPolicy.lease_s``) and a
publisher on a reply row (``OutboxPolicy.lease_s``, and a worker that publishes its own
replies). ``DEFAULT_CLAIM_MIN_IDLE_MS`` is how long a stream entry stays pending in a
consumer's list before another consumer of the group may take it over (XAUTOCLAIM): the
same idea on the Redis side, set to twice the lease.
"""

from __future__ import annotations

from typing import Final

DEFAULT_LEASE_S: Final = 30.0
DEFAULT_CLAIM_MIN_IDLE_MS: Final = 60_000

"""Evidence on each task's records: which effect and which adapter version.

When an attempt marks its effect started (``EffectsStore.mark_effect_started``), the task
row keeps the SHA-256 of the effect's idempotency key (``key_digest``) and the version of
the adapter that ran it; each reconcile record and each compensation record written for the
task copies the digest from the task row (``EVIDENCE``, a sub-select in its INSERT) and
names the version of the adapter that wrote it. An operator matches the digest with the
target's records by hashing the key the target shows (``key_digest``); the records never
hold the key itself, which a target may treat as a credential (it answers whoever presents
it with the first effect's outcome).
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from typing import Final


def _installed_version() -> str:
    try:
        return metadata.version("broker_adapter")
    except metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


#: The version of this adapter, as installed (``broker-adapter --version``).
ADAPTER_VERSION: Final = _installed_version()

#: The task's effect key digest, as a sub-select taking the task id as its parameter.
EVIDENCE: Final = "(SELECT effect_key_digest FROM tasks WHERE task_id = ?)"


def key_digest(key: str) -> str:
    """The digest a record keeps of an effect's idempotency key: SHA-256, 64 hex digits."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()

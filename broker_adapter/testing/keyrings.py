"""Keyring files with fresh secrets, for tests and local experiments."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from broker_adapter.protocol.signing import Keyring

SECRET_BYTES = 32


def write_keyring(path: str | Path, principals: Iterable[str] = ("agent",)) -> Keyring:
    """Write a keyring file with one fresh key per principal (key id ``<principal>-test``)
    at ``path``, mode 0600, and load it.

    The file's form is the one ``broker-adapter run --keyring`` reads:
    ``{"<principal>": {"<key id>": "<secret>"}}``.
    """
    target = Path(path)
    ring = {name: {f"{name}-test": secrets.token_hex(SECRET_BYTES)} for name in principals}
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(ring, handle)
    target.chmod(0o600)
    return Keyring.load(target)

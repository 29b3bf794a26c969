"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_adapter.protocol.signing import Keyring
from tests.support.ingest_script import write_keyring


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    """The test keyring (``ingest_script.KEYRING``), written as a 0600 file and loaded."""
    return write_keyring(tmp_path / "keys.json")

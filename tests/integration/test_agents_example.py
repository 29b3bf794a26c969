"""examples/agents/story.py: two agents delegate to each other, one is SIGKILLed after its
effect and before its commit, and the story ends with exactly one effect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_server import require_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_agents_story_ends_with_exactly_one_effect() -> None:
    require_binary()
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agents" / "story.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "restarts the world saw: 1" in res.stdout
    assert "['restarted-attempt-1', 'restarted-attempt-2']" in res.stdout
    assert "exactly one effect" in res.stdout

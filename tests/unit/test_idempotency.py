"""The idempotency key of an effect: from the intent, the action, the canonical arguments and
a version; never from the attempt, the time or randomness (``protocol.idempotency``)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from typing import Any

import pytest

from broker_adapter.protocol.idempotency import (
    ACTION_MAX_CHARS,
    EFFECT_KEY_VECTOR,
    Intent,
    action_key,
)

INTENT = Intent("agent-7", "m-0001")
ARGS: dict[str, Any] = {"to": "ops@example.com", "n": 13}


def test_vector_is_sha256_of_the_documented_canonical_array() -> None:
    (principal, message_id, action, arguments, version), expected = EFFECT_KEY_VECTOR
    material = (
        f'["ba.effect",{version},"{principal}","{message_id}","{action}",'
        '{"n":13,"to":"ops@example.com"}]'
    ).encode()
    assert expected == f"ba{version}-{hashlib.sha256(material).hexdigest()[:32]}"
    got = action_key(Intent(principal, message_id), action, arguments, version=version)
    assert got == expected


def test_same_inputs_same_key_in_another_process() -> None:
    """Nothing process-local (hash seeds, time, randomness) enters the key."""
    here = action_key(INTENT, "send_email", ARGS)
    code = (
        "from broker_adapter.protocol.idempotency import Intent, action_key;"
        "print(action_key(Intent('agent-7', 'm-0001'), 'send_email',"
        " {'n': 13, 'to': 'ops@example.com'}))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert there == here == action_key(INTENT, "send_email", dict(reversed(ARGS.items())))


def test_numbers_are_canonical_so_a_resend_with_13_0_is_the_same_effect() -> None:
    assert action_key(INTENT, "a", {"n": 13.0}) == action_key(INTENT, "a", {"n": 13})
    assert action_key(INTENT, "a", {"n": 1.3e1}) == action_key(INTENT, "a", {"n": 13})


@pytest.mark.parametrize(
    ("intent", "action", "arguments", "version"),
    [
        (Intent("agent-8", "m-0001"), "send_email", ARGS, 1),
        (Intent("agent-7", "m-0002"), "send_email", ARGS, 1),
        (INTENT, "send_sms", ARGS, 1),
        (INTENT, "send_email", {**ARGS, "n": 14}, 1),
        (INTENT, "send_email", {**ARGS, "cc": None}, 1),
        (INTENT, "send_email", [ARGS], 1),
        (INTENT, "send_email", ARGS, 2),
        # no concatenation ambiguity between the parts:
        (Intent("agent-7m", "-0001"), "send_email", ARGS, 1),
    ],
)
def test_any_input_change_changes_the_key(
    intent: Intent, action: str, arguments: Any, version: int
) -> None:
    base = action_key(INTENT, "send_email", ARGS)
    other = action_key(intent, action, arguments, version=version)
    assert other != base
    assert other.startswith(f"ba{version}-")
    assert len(other) == len(f"ba{version}-") + 32


def test_two_actions_of_one_request_have_two_keys() -> None:
    assert action_key(INTENT, "charge", ARGS) != action_key(INTENT, "receipt", ARGS)


@pytest.mark.parametrize(
    ("intent", "action", "arguments", "version"),
    [
        (Intent("", "m"), "a", {}, 1),
        (Intent("p", ""), "a", {}, 1),
        (INTENT, "", {}, 1),
        (INTENT, "x" * (ACTION_MAX_CHARS + 1), {}, 1),
        (INTENT, "a", {}, 0),
        (INTENT, "a", {}, True),
        (INTENT, "a", {"n": float("nan")}, 1),
        (INTENT, "a", {1, 2}, 1),
    ],
)
def test_refuses_what_cannot_name_an_effect(
    intent: Intent, action: str, arguments: Any, version: int
) -> None:
    with pytest.raises(ValueError, match=r"."):
        action_key(intent, action, arguments, version=version)

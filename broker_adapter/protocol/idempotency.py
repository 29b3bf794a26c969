"""Three identities of one piece of work, kept apart, and the idempotency key of an effect.

* The **intent** (``Intent``): what was asked, by whom. The authenticated principal and the
  ``message_id`` it chose (``docs/RULES.md`` rule 1). Every resend, every attempt and every
  task accepted for the same request share it.
* The **attempt**: who is doing it right now. The task id and the fence of
  the current claim. It changes at every claim (fence + 1) and is what a holder presents to
  commit (rule 10) or to write to a fenced target (``broker_adapter.fences``). It orders
  attempts of one task; it never names an effect.
* The **idempotency key** (``action_key``): which effect. Derived from the intent, the
  action's name, the action's canonical arguments and a version of the derivation, and
  from nothing else: not the attempt, not the time, not randomness. So every attempt of
  the same request asking the same action with the same arguments presents the same key,
  and a target that dedupes by it (an HTTP API's ``Idempotency-Key`` header, a unique
  column) applies the effect once however often it is asked. Two actions of one request
  (charge the card, then send the receipt) get two keys; changing the arguments changes the
  key (it is another effect, not a retry of the same one). The request-wide key a task
  carries (``Task.idempotency_key``: principal and message id only) is the special case of
  a request with one effect whose arguments never change.

The derivation, version 1: SHA-256 over the canonical JSON (``canonical.canonical_json``,
numbers written by ``canonical.canonical_numbers``, so ``13.0`` and ``13`` are one argument)
of the array ``["ba.effect", version, principal, message_id, action, arguments]``, its
first 32 hex digits after ``"ba1-"``. A JSON array leaves no ambiguity between parts (no
separator to smuggle in), and a new version changes every key, so the derivation can change
without colliding with keys already sent. ``EFFECT_KEY_VECTOR`` is a test vector of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from broker_adapter.protocol.canonical import canonical_json, canonical_numbers, sha256_hex

#: The derivation ``action_key`` uses unless told otherwise.
EFFECT_KEY_VERSION = 1
#: Longest action name accepted (an action names code, not data).
ACTION_MAX_CHARS = 128

#: ``(principal, message_id, action, arguments, version)`` and the key ``action_key`` derives
#: from them: any other implementation of the derivation must give the same key.
EFFECT_KEY_VECTOR: tuple[tuple[str, str, str, Any, int], str] = (
    ("agent-7", "m-0001", "send_email", {"to": "ops@example.com", "n": 13.0}, 1),
    "ba1-528ae01312fff9ed4f7645c3e2963cff",
)


class Intent(NamedTuple):
    """What was asked and by whom: the request's identity (``docs/RULES.md`` rule 1)."""

    principal: str
    message_id: str


def action_key(
    intent: Intent, action: str, arguments: Any, *, version: int = EFFECT_KEY_VERSION
) -> str:
    """The idempotency key of one effect: ``"ba<version>-"`` and 32 hex digits.

    Args:
        intent: the request the effect is made for.
        action: the effect's name (e.g. ``"charge_card"``): non-empty, at most
            ``ACTION_MAX_CHARS`` characters.
        arguments: what the effect is asked to do, any JSON value (usually the part of the
            payload the effect depends on); encoded canonically.
        version: the derivation (only 1 exists); part of the key's input and of its prefix.

    Returns:
        the key; the same for the same inputs in every process and every attempt.

    Raises:
        ValueError: an empty principal, message id or action, an action too long, a version
            below 1, or arguments that are not JSON (NaN, a set, bytes, ...).
    """
    if not intent.principal or not intent.message_id:
        raise ValueError("an effect key needs the intent's principal and message id")
    if not action or len(action) > ACTION_MAX_CHARS:
        raise ValueError(f"action must be 1 to {ACTION_MAX_CHARS} characters, got {action!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be an integer >= 1, got {version!r}")
    material = canonical_numbers(
        canonical_json(
            ["ba.effect", version, intent.principal, intent.message_id, action, arguments]
        )
    )
    return f"ba{version}-{sha256_hex(material)[:32]}"


def idempotency_key_for(principal: str, message_id: str) -> str:
    """The idempotency key of a request: ``"ba:"`` and the first 32 hex digits of
    SHA-256 over the UTF-8 of ``principal``, a NUL byte and ``message_id``.

    Derived from the request's identity, not from its task: a second task for the same
    request (a replay accepted anew after the retention window, a message id reused once
    it was forgotten) carries the same key, so an effect keyed by it is applied once.
    Neither part can hold a NUL (principals are letters, digits, ``._-``; message ids
    have no control characters), so distinct identities give distinct inputs.
    """
    digest = sha256_hex(f"{principal}\0{message_id}".encode())
    return f"ba:{digest[:32]}"

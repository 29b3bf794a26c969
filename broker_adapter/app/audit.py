"""What every operator command shares: who ran it (``os_user``, from the password database
by the real user id), one audit log line per command (``audit``), and bounds on the
numbers and texts an operator types (``bounded_seconds``, ``bounded_text``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pwd

from broker_adapter.errors import ConfigError

log = logging.getLogger("broker_adapter.app.audit")

#: The longest ``--by`` or ``--reason`` text kept, characters.
MAX_OPERATOR_TEXT = 1000


def os_user() -> str:
    """The operating-system user running this process, from the password database by the
    real user id (not ``$USER`` or ``$LOGNAME``, which the caller sets at will);
    ``uid <n>`` when the id has no entry."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def audit(command: str, **details: object) -> None:
    """One log line for an operator command: what, with which arguments, by whom."""
    said = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in details.items())
    log.info("audit: %s by os user %s %s", command, os_user(), said)


def bounded_seconds(flag: str, value: float, high: float) -> float:
    """``value`` when it is a finite number of seconds above 0 and at most ``high``.

    Raises:
        ConfigError: it is not (``inf`` and ``nan`` included).
    """
    if not (math.isfinite(value) and 0 < value <= high):
        raise ConfigError(f"{flag} must be above 0 and at most {high:g} seconds, not {value}")
    return value


def bounded_text(flag: str, value: str) -> str:
    """``value`` stripped, when it is not empty and at most ``MAX_OPERATOR_TEXT`` long.

    Raises:
        ConfigError: it is empty or longer.
    """
    value = value.strip()
    if not value or len(value) > MAX_OPERATOR_TEXT:
        raise ConfigError(f"{flag} must be 1..{MAX_OPERATOR_TEXT} characters")
    return value

"""Who may use the console: operator tokens from a private file, compared in constant time,
and the per-session CSRF token of its forms.

The tokens file (``--tokens FILE``, mode 0600) is a JSON object naming each operator::

    {"alice": "a long random token", "grafana": {"token": "...", "read_only": true}}

The name is what the audit records with every decision. A ``read_only`` token sees every
page and may take no action (403). A request carries its token as ``Authorization: Bearer
TOKEN`` or in the cookie the login page sets (``COOKIE``: HttpOnly, SameSite=Strict).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from broker_adapter.errors import ConfigError
from broker_adapter.private_files import read_private_json

#: The cookie the login page sets (the operator's token itself).
COOKIE: Final = "ba_console"

#: A token shorter than this is refused when the file is read: it could be guessed.
TOKEN_MIN_CHARS: Final = 16


@dataclass(frozen=True)
class Operator:
    """An authenticated caller: ``name`` goes into every record of a decision."""

    name: str
    read_only: bool = False


class Tokens:
    """The operators' tokens. ``find`` compares a presented token with every one of them
    in constant time (``hmac.compare_digest`` over SHA-256 digests, no early exit)."""

    def __init__(self, entries: dict[str, tuple[str, bool]]) -> None:
        if not entries:
            raise ConfigError("the tokens file names no operator")
        seen: set[str] = set()
        self._entries: list[tuple[bytes, Operator]] = []
        for name, (token, read_only) in entries.items():
            if not name.strip():
                raise ConfigError("an operator name is empty")
            if len(token) < TOKEN_MIN_CHARS:
                raise ConfigError(
                    f"the token of {name!r} has {len(token)} characters, at least"
                    f" {TOKEN_MIN_CHARS} are required (use e.g. 32 random bytes in hex)"
                )
            if token in seen:
                raise ConfigError(f"the token of {name!r} is another operator's too")
            seen.add(token)
            self._entries.append((_digest(token), Operator(name.strip(), read_only)))

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        """Read the tokens file.

        Raises:
            ConfigError: it cannot be read, its group or others may read or change it
                (``chmod 600`` it), it is not UTF-8 JSON, or has the wrong shape.
        """
        data = read_private_json(path, "tokens file")
        return cls.from_json_value(data, source=str(path))

    @classmethod
    def from_json_value(cls, data: Any, *, source: str = "tokens") -> Tokens:
        """Build from parsed JSON (see the module text for the shape).

        Raises:
            ConfigError: the value has the wrong shape.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be an object of operators")
        entries: dict[str, tuple[str, bool]] = {}
        for name, value in data.items():
            if isinstance(value, str):
                entries[name] = (value, False)
            elif isinstance(value, dict) and isinstance(value.get("token"), str):
                extra = set(value) - {"token", "read_only"}
                read_only = value.get("read_only", False)
                if extra or not isinstance(read_only, bool):
                    raise ConfigError(f'{source}: {name!r} takes "token" and a boolean "read_only"')
                entries[name] = (value["token"], read_only)
            else:
                raise ConfigError(
                    f'{source}: {name!r} must be a token or {{"token": ..., "read_only": true}}'
                )
        try:
            return cls(entries)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def find(self, token: str | None) -> Operator | None:
        """The operator whose token ``token`` is, or ``None``. Every stored token is
        compared, each in constant time, so the time taken says nothing about which
        one matched or how much of one did."""
        if not token:
            return None
        presented = _digest(token)
        found: Operator | None = None
        for digest, operator in self._entries:
            if hmac.compare_digest(digest, presented):
                found = operator
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class Csrf:
    """The per-session CSRF token of the console's forms: an HMAC, under a key made when
    the console starts, of the session's operator token. A form posted without the token
    of the session that carries it is refused; a restart makes every form's token stale
    (the page is loaded again)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)

    def token_for(self, session_token: str) -> str:
        """The CSRF token of the session whose operator token is ``session_token``."""
        data = b"csrf\x00" + session_token.encode("utf-8", "surrogatepass")
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def check(self, session_token: str, presented: str | None) -> bool:
        """Whether ``presented`` is that session's CSRF token (constant time)."""
        if not presented:
            return False
        return hmac.compare_digest(self.token_for(session_token), presented)

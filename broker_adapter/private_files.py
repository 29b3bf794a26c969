"""Files only their owner may use (``chmod 600``): keyrings, the console's tokens, Redis
password files. One reader for all of them, so the rule and its message are said once."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from broker_adapter.errors import ConfigError

#: Any permission of the group or of others.
GROUP_OR_OTHERS = 0o077


def read_private_file(
    path: str | Path,
    what: str,
    *,
    refused_bits: int = GROUP_OR_OTHERS,
    max_bytes: int | None = None,
) -> bytes:
    """The bytes of ``path`` (``what`` names it in errors), checked on the open file.

    Args:
        refused_bits: the mode bits that refuse the file (any of the group's or others' by
            default; a keyring allows their execute bits).
        max_bytes: refuse a larger file.

    Raises:
        ConfigError: the file cannot be read, has one of ``refused_bits`` (``chmod 600``
            it), or is larger than ``max_bytes``.
    """
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            if info.st_mode & refused_bits:
                raise ConfigError(
                    f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: its group or"
                    f" others may read or change it; run chmod 600 {path}"
                )
            if max_bytes is not None and info.st_size > max_bytes:
                raise ConfigError(f"{what} {path}: {info.st_size} bytes, at most {max_bytes}")
            return file.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def read_private_json(path: str | Path, what: str, *, refused_bits: int = GROUP_OR_OTHERS) -> Any:
    """``read_private_file``, then the file's UTF-8 JSON value.

    Raises:
        ConfigError: as ``read_private_file``, or the file is not UTF-8 JSON.
    """
    raw = read_private_file(path, what, refused_bits=refused_bits)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{what} {path} is not valid JSON: {exc}") from None

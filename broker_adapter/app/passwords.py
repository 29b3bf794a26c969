"""The Redis password kept off the command line: ``BA_REDIS_PASSWORD`` (the password
itself) or ``--redis-password-file FILE`` (env ``BA_REDIS_PASSWORD_FILE``; the file's first
line, mode 0600), joined to the ``--redis`` URL before anything connects. A URL that holds
a password of its own (``user:pw@`` or ``?password=``) as well is refused: one source.

Process listings (``ps``) and shell histories show the command line; they do not show the
environment of another user's process or a file's contents.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

from broker_adapter.errors import ConfigError
from broker_adapter.private_files import read_private_file

#: The environment variable holding the password itself.
PASSWORD_ENV = "BA_REDIS_PASSWORD"
#: The largest password file read, bytes.
MAX_PASSWORD_FILE_BYTES = 4096


def read_password_file(path: str) -> str:
    """The password in ``path``: its first line, without the line end.

    Raises:
        ConfigError: the file cannot be read, is readable or writable by others than its
            owner, is larger than ``MAX_PASSWORD_FILE_BYTES``, or holds no password.
    """
    raw = read_private_file(path, "--redis-password-file", max_bytes=MAX_PASSWORD_FILE_BYTES)
    try:
        first = raw.decode("utf-8").split("\n", 1)[0].removesuffix("\r")
    except UnicodeDecodeError:
        raise ConfigError(f"--redis-password-file {path}: not UTF-8 text") from None
    if not first:
        raise ConfigError(f"--redis-password-file {path}: the first line is empty")
    return first


def url_has_password(url: str) -> bool:
    parts = urlsplit(url)
    return parts.password is not None or "password" in parse_qs(parts.query)


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in it (percent-encoded; a ``unix://`` URL takes it as
    its ``password`` query parameter).

    Raises:
        ConfigError: ``url`` holds a password already.
    """
    if url_has_password(url):
        raise ConfigError(
            "the Redis URL holds a password and one was given by BA_REDIS_PASSWORD or "
            "--redis-password-file as well: give it once, outside the URL"
        )
    parts = urlsplit(url)
    secret = quote(password, safe="")
    if parts.scheme == "unix":  # urlunsplit would drop the empty authority of unix:///
        return f"{url}{'&' if parts.query else '?'}password={secret}"
    host = parts.netloc.rsplit("@", 1)[-1]
    user = quote(parts.username or "", safe="")
    return urlunsplit(parts._replace(netloc=f"{user}:{secret}@{host}"))


def resolve_redis_url(url: str | None, password_file: str | None) -> str | None:
    """The ``--redis`` URL with the password from ``password_file`` or ``BA_REDIS_PASSWORD``
    (the file wins), or as it is when neither is given.

    Raises:
        ConfigError: as ``read_password_file`` and ``with_password``; a password without
            a URL.
    """
    password = read_password_file(password_file) if password_file else None
    if password is None:
        password = os.environ.get(PASSWORD_ENV) or None
    if password is None:
        return url
    if url is None:
        if password_file:
            raise ConfigError("--redis-password-file needs --redis")
        return None  # BA_REDIS_PASSWORD for a command that does not use Redis this time
    return with_password(url, password)

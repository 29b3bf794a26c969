"""The Redis password off the command line: ``BA_REDIS_PASSWORD`` or ``--redis-password-file``
joined to ``--redis`` by real ``broker-adapter`` processes against a real redis-server user;
the file's bounds on both sides; passwords redacted, a ``password=`` parameter too."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from broker_adapter.app.passwords import (
    MAX_PASSWORD_FILE_BYTES,
    read_password_file,
    resolve_redis_url,
    with_password,
)
from broker_adapter.errors import ConfigError
from broker_adapter.store.urls import redacted_url
from tests.support.cli import cli_env
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret/with:odd@chars%"


@pytest.fixture
def user(redis_server: RedisServer) -> str:
    """A Redis user of its own with password ``SECRET``."""
    name = f"pw-{uuid.uuid4().hex[:8]}"
    admin: Any = redis_server.client()
    admin.execute_command("ACL", "SETUSER", name, "on", f">{SECRET}", "~*", "+@all")
    return name


def _functions_load(server: RedisServer, name: str, *more: str, **env: str) -> Any:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_adapter",
            "functions",
            "load",
            "--redis",
            f"redis://{name}@127.0.0.1:{server.port}/0",
            *more,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=cli_env(**env),
        timeout=60,
    )


def test_the_password_comes_from_the_environment_or_a_file(
    redis_server: RedisServer, user: str, tmp_path: Path
) -> None:
    res = _functions_load(redis_server, user)  # no password: refused by Redis
    assert res.returncode == 1
    assert SECRET not in res.stderr
    res = _functions_load(redis_server, user, BA_REDIS_PASSWORD=SECRET)
    assert res.returncode == 0, res.stderr
    secret_file = tmp_path / "redis.password"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    secret_file.chmod(0o600)
    res = _functions_load(redis_server, user, "--redis-password-file", str(secret_file))
    assert res.returncode == 0, res.stderr
    res = _functions_load(redis_server, user, BA_REDIS_PASSWORD_FILE=str(secret_file))
    assert res.returncode == 0, res.stderr
    secret_file.chmod(0o640)
    res = _functions_load(redis_server, user, "--redis-password-file", str(secret_file))
    assert res.returncode == 2
    assert "has mode 0640" in res.stderr
    assert "chmod 600" in res.stderr


def test_a_password_file_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_bytes(b"p" * MAX_PASSWORD_FILE_BYTES)
    path.chmod(0o600)
    assert read_password_file(str(path)) == "p" * MAX_PASSWORD_FILE_BYTES
    path.write_bytes(b"p" * (MAX_PASSWORD_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match="at most 4096"):
        read_password_file(str(path))
    path.write_bytes(b"\nsecond line")
    with pytest.raises(ConfigError, match="first line is empty"):
        read_password_file(str(path))


def test_one_source_of_password_and_redaction(monkeypatch: pytest.MonkeyPatch) -> None:
    url = with_password("redis://adapter@h:6379/0", SECRET)
    assert SECRET not in url  # percent-encoded
    assert redacted_url(url) == "redis://adapter@h:6379/0"
    assert with_password("unix:///tmp/r.sock?db=1", "pw") == "unix:///tmp/r.sock?db=1&password=pw"
    for holding in ("redis://a:pw@h:6379/0", "redis://h:6379/0?password=pw"):
        with pytest.raises(ConfigError, match="give it once"):
            with_password(holding, "other")
    monkeypatch.setenv("BA_REDIS_PASSWORD", "pw")
    assert resolve_redis_url("redis://u@h/0", None) == "redis://u:pw@h/0"
    assert resolve_redis_url(None, None) is None
    monkeypatch.delenv("BA_REDIS_PASSWORD")
    assert resolve_redis_url("redis://u@h/0", None) == "redis://u@h/0"
    said = redacted_url("redis://h:6379/0?db=1&password=hunter2&ssl_cert_reqs=none")
    assert said == "redis://h:6379/0?db=1&password=***&ssl_cert_reqs=none"
    assert redacted_url("postgresql://u:pw@h/db?PassWord=x") == "postgresql://u@h/db?PassWord=***"

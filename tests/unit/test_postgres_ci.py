"""Under ``CI=true`` a missing PostgreSQL server fails the run instead of skipping its
tests (``tests.support.postgres.require_server``); locally it still skips."""

from __future__ import annotations

import pytest

from tests.support import postgres

REASON = "no PostgreSQL server at postgresql://nowhere (BA_TEST_POSTGRES): refused"


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "unavailable", lambda: REASON)


@pytest.mark.usefixtures("no_server")
@pytest.mark.parametrize("ci", ["true", "1", "yes", "TRUE"])
def test_require_server_fails_when_ci_is_set(ci: str) -> None:
    with pytest.raises(pytest.fail.Exception, match="PostgreSQL tests must run in CI"):
        postgres.require_server({"CI": ci})


@pytest.mark.usefixtures("no_server")
@pytest.mark.parametrize("environ", [{}, {"CI": ""}, {"CI": "false"}, {"CI": "0"}, {"CI": "no"}])
def test_require_server_skips_outside_ci(environ: dict[str, str]) -> None:
    with pytest.raises(pytest.skip.Exception, match="no PostgreSQL server"):
        postgres.require_server(environ)


def test_require_server_reads_ci_from_the_environment(
    no_server: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        postgres.require_server()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        postgres.require_server()


def test_require_server_passes_when_the_server_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "unavailable", lambda: None)
    postgres.require_server({"CI": "true"})  # neither fails nor skips

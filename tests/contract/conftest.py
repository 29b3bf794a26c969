"""The contract suite's ``backend``: every test runs against a private redis-server, against
fakeredis in process and against fakeredis's TCP server (``README.md`` lists what fakeredis
does differently).

A test that fakeredis cannot pass carries ``@pytest.mark.fakeredis_differs(reason)``: on
fakeredis it is ``xfail(strict=True)`` (so a fakeredis that gets it right is noticed), or
skipped with ``skip=True`` where running it would hang or prove nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.backends import (
    FAKEREDIS,
    FAKEREDIS_TCP,
    REDIS_SERVER,
    Backend,
    FakeTcpServer,
    fake_backend,
    fake_tcp_backend,
    real_backend,
)


@pytest.fixture(scope="session")
def fake_tcp_server() -> Iterator[FakeTcpServer]:
    """One fakeredis TCP server shared by a test session; tests use unique key prefixes."""
    server = FakeTcpServer()
    yield server
    server.stop()


@pytest.fixture(
    params=[
        pytest.param(REDIS_SERVER, marks=pytest.mark.integration),
        pytest.param(FAKEREDIS),
        pytest.param(FAKEREDIS_TCP),
    ]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    """The Redis of one run of a contract test."""
    if request.param == REDIS_SERVER:
        return real_backend(request.getfixturevalue("redis_server"))
    differs = request.node.get_closest_marker("fakeredis_differs")
    if differs is not None:
        reason = f"fakeredis: {differs.args[0]}"
        if differs.kwargs.get("skip", False):
            pytest.skip(reason)
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    if request.param == FAKEREDIS_TCP:
        return fake_tcp_backend(request.getfixturevalue("fake_tcp_server"))
    return fake_backend()

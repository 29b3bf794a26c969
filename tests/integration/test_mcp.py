"""``broker-adapter mcp`` driven by the MCP SDK's own client over stdio, against a real
adapter (``broker-adapter run --app``) and a private redis-server: the tools and their
schemas, a plain call, a call as an MCP task polled to its result, a cancel, a restart of
the MCP server while a task runs, and a repeated call that runs its handler once."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed")

from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from broker_adapter.testing import RunningAdapter, write_keyring
from tests.support.mcp_app import calls
from tests.support.redis_server import RedisServer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:The experimental tasks API:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.support.mcp_app:router"
T = TypeVar("T")


class Setup:
    """A running adapter for ``mcp_app`` and what an MCP server on it needs."""

    def __init__(self, url: str, prefix: str, keyring: Path, calls_path: Path) -> None:
        self.url, self.prefix, self.keyring, self.calls_path = url, prefix, keyring, calls_path

    def server(self) -> StdioServerParameters:
        args = [
            "-m",
            "broker_adapter",
            "mcp",
            "--app",
            APP,
            "--app-dir",
            str(ROOT),
            "--redis",
            self.url,
            "--prefix",
            self.prefix,
            "--keyring",
            str(self.keyring),
            "--principal",
            "agent",
            "--instance",
            "mcp-test",
            "--timeout",
            "60",
        ]
        return StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT))

    @asynccontextmanager
    async def session(self) -> AsyncIterator[ClientSession]:
        async with (
            stdio_client(self.server()) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session

    def calls(self) -> list[str]:
        return calls(self.calls_path)


@pytest.fixture
def setup(
    redis_server: RedisServer, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Setup]:
    keyring = tmp_path / "keyring.json"
    write_keyring(keyring, ["agent"])
    calls_path = tmp_path / "calls.txt"
    monkeypatch.setenv("BA_TEST_CALLS", str(calls_path))
    adapter = RunningAdapter(
        redis_url=redis_server.url,
        db=tmp_path / "adapter.db",
        keyring=keyring,
        prefix=prefix,
        target=("--app", APP),
        app_dir=ROOT,
        extra_args=["--workers", "1", "--concurrency", "1", "--lease", "5"],
    )
    with adapter:
        yield Setup(redis_server.url, prefix, keyring, calls_path)


def run(work: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(work(), 120))


async def until(session: ClientSession, task_id: str, statuses: set[str]) -> types.GetTaskResult:
    """Poll ``tasks/get`` until the task is in one of ``statuses``."""
    while True:
        state = await session.experimental.get_task(task_id)
        if state.status in statuses:
            return state
        await asyncio.sleep(0.05)  # an MCP client's poll interval


def text_of(result: types.CallToolResult) -> str:
    (content,) = result.content
    assert isinstance(content, types.TextContent)
    return content.text


def test_tools_are_the_router_tasks_with_their_schemas_and_docstrings(setup: Setup) -> None:
    async def work() -> list[types.Tool]:
        async with setup.session() as session:
            return (await session.list_tools()).tools

    tools = {tool.name: tool for tool in run(work)}
    assert set(tools) == {"restart", "explode", "hold", "task_status", "dead_letters"}
    assert tools["restart"].description == "Restart a service by name."
    assert tools["restart"].inputSchema["required"] == ["service"]
    assert tools["restart"].inputSchema["properties"]["service"]["maxLength"] == 64
    assert tools["restart"].execution is not None
    assert tools["restart"].execution.taskSupport == "optional"


def test_a_plain_call_returns_the_reply_and_a_failed_one_is_a_tool_error(setup: Setup) -> None:
    async def work() -> tuple[types.CallToolResult, ...]:
        async with setup.session() as session:
            good = await session.call_tool("restart", {"service": "web1"})
            invalid = await session.call_tool("restart", {"service": ""})
            failed = await session.call_tool("explode", {})
            return good, invalid, failed

    good, invalid, failed = run(work)
    assert not good.isError
    assert good.structuredContent == {"restarted": "web1"}
    assert invalid.isError  # refused by the tool's input schema: nothing published
    assert failed.isError
    assert text_of(failed).startswith("failed: ")
    assert "the service is on fire" in text_of(failed)
    assert setup.calls() == ["restart web1", "explode"]


def test_a_call_as_a_task_is_polled_to_its_result(setup: Setup, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()

    async def work() -> tuple[str, str, types.CallToolResult]:
        async with setup.session() as session:
            created = await session.experimental.call_tool_as_task(
                "hold", {"gate": str(gate), "label": "one"}
            )
            task_id = created.task.taskId
            first = (await session.experimental.get_task(task_id)).status
            gate.unlink()
            await until(session, task_id, {"completed"})
            result = await session.experimental.get_task_result(task_id, types.CallToolResult)
            return task_id, first, result

    task_id, first, result = run(work)
    assert task_id.startswith("mcp-")
    assert first == "working"
    assert result.structuredContent == {"released": "one"}
    assert setup.calls() == ["hold one"]


def test_a_cancelled_task_never_runs(setup: Setup, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()

    async def work() -> str:
        async with setup.session() as session:
            busy = await session.experimental.call_tool_as_task(
                "hold", {"gate": str(gate), "label": "busy"}
            )
            await until_called(setup, "hold busy")
            queued = await session.experimental.call_tool_as_task("restart", {"service": "db"})
            await session.experimental.cancel_task(queued.task.taskId)
            state = await until(session, queued.task.taskId, {"cancelled", "completed"})
            gate.unlink()
            await until(session, busy.task.taskId, {"completed"})
            return state.status

    assert run(work) == "cancelled"
    assert setup.calls() == ["hold busy"]


async def until_called(setup: Setup, note: str) -> None:
    # the worker process writes the note: a file another process writes, polled
    while note not in setup.calls():  # noqa: ASYNC110
        await asyncio.sleep(0.05)


def test_a_restarted_server_still_fetches_a_task_started_before(
    setup: Setup, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()

    async def start() -> str:
        async with setup.session() as session:
            created = await session.experimental.call_tool_as_task(
                "hold", {"gate": str(gate), "label": "across"}
            )
            await until_called(setup, "hold across")
            return created.task.taskId

    async def fetch(task_id: str) -> tuple[str, types.CallToolResult]:
        async with setup.session() as session:  # a new server process
            state = await until(session, task_id, {"completed", "failed"})
            result = await session.experimental.get_task_result(task_id, types.CallToolResult)
            return state.status, result

    task_id = run(start)  # the first server process ends with its session
    gate.unlink()
    status, result = run(lambda: fetch(task_id))
    assert status == "completed"
    assert result.structuredContent == {"released": "across"}
    assert setup.calls() == ["hold across"]


def test_a_call_repeated_with_the_same_arguments_runs_the_handler_once(setup: Setup) -> None:
    async def work() -> list[Any]:
        async with setup.session() as session:
            twins = await asyncio.gather(
                session.call_tool("restart", {"service": "web2"}),
                session.call_tool("restart", {"service": "web2"}),
            )
            again = await session.call_tool("restart", {"service": "web2"})
            other = await session.call_tool("restart", {"service": "web3"})
            return [*twins, again, other]

    results = run(work)
    assert [r.structuredContent for r in results] == [
        {"restarted": "web2"},
        {"restarted": "web2"},
        {"restarted": "web2"},
        {"restarted": "web3"},
    ]
    assert setup.calls() == ["restart web2", "restart web3"]


def test_the_status_tool_reads_a_reply_by_message_id(setup: Setup, tmp_path: Path) -> None:
    gate = tmp_path / "gate"

    async def work() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with setup.session() as session:
            created = await session.experimental.call_tool_as_task(
                "hold", {"gate": str(gate), "label": "quick"}
            )
            task_id = created.task.taskId
            await until(session, task_id, {"completed"})
            known = await session.call_tool("task_status", {"message_id": task_id})
            unknown = await session.call_tool("task_status", {"message_id": "mcp-none"})
            return known, unknown

    known, unknown = run(work)
    assert known.structuredContent is not None
    assert known.structuredContent["status"] == "done"
    assert known.structuredContent["result"] == {"released": "quick"}
    assert unknown.structuredContent == {"status": "no reply recorded yet"}

"""``broker-adapter mcp``: an MCP server (the official SDK's low-level ``Server``) whose tools
are a router's tasks, over stdio or streamable HTTP. What each request does is
``mcp_bridge``'s; this module is the SDK's wiring and the transports.

MCP tasks (a tool call that returns a task id to poll) are the SDK's experimental API of
its 1.x line, which the 2.x line dropped with the specification's task section; the
extra pins ``mcp<2`` for that reason.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator
from typing import Any

from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.experimental import ExperimentalHandlers

from broker_adapter import __version__
from broker_adapter.app.mcp_bridge import SCOPE_META_KEY, ToolBridge

log = logging.getLogger("broker_adapter.app.mcp")

SERVER_NAME = "broker-adapter"


def _experimental(server: Server[Any, Any]) -> ExperimentalHandlers:
    """The SDK's task handlers (deprecated upstream with the 1.x task API, which is the one
    this server speaks: see the module)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return server.experimental


class _Scopes:
    """A dedupe scope per MCP session: a random id the session keeps while it lives."""

    def __init__(self) -> None:
        self._ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def of(self, session: Any) -> str:
        scope = self._ids.get(session)
        if scope is None:
            scope = self._ids[session] = uuid.uuid4().hex
        return scope


def build_server(bridge: ToolBridge) -> Server[Any, Any]:
    """The MCP server answering ``tools/list``, ``tools/call`` and the task requests
    (``tasks/get``, ``tasks/result``, ``tasks/cancel``) through ``bridge``."""
    server: Server[Any, Any] = Server(SERVER_NAME, version=__version__)
    scopes = _Scopes()

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return bridge.tools()

    @server.call_tool(validate_input=True)
    async def call_tool(
        name: str, arguments: dict[str, Any]
    ) -> types.CallToolResult | types.CreateTaskResult:
        context = server.request_context
        meta = context.meta.model_dump() if context.meta is not None else {}
        key = meta.get(SCOPE_META_KEY)
        scope = f"key:{key}" if isinstance(key, str) and key else scopes.of(context.session)
        return await bridge.call(name, arguments, as_task=context.experimental.is_task, scope=scope)

    tasks = _experimental(server)

    @tasks.get_task()
    async def get_task(request: types.GetTaskRequest) -> types.GetTaskResult:
        return await bridge.status(request.params.taskId)

    @tasks.get_task_result()
    async def get_task_result(request: types.GetTaskPayloadRequest) -> types.GetTaskPayloadResult:
        result = await bridge.result(request.params.taskId)
        return types.GetTaskPayloadResult.model_validate(result.model_dump(by_alias=True))

    @tasks.cancel_task()
    async def cancel_task(request: types.CancelTaskRequest) -> types.CancelTaskResult:
        return await bridge.cancel(request.params.taskId)

    return server


async def serve_stdio(server: Server[Any, Any]) -> None:
    """Serve one client on standard input and output until it closes them."""
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(server: Server[Any, Any], host: str, port: int) -> None:
    """Serve streamable HTTP on ``http://host:port/mcp`` until cancelled."""
    import uvicorn
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from starlette.applications import Starlette
    from starlette.routing import Mount

    manager = StreamableHTTPSessionManager(app=server)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with manager.run():
            yield

    app = Starlette(routes=[Mount("/mcp", app=manager.handle_request)], lifespan=lifespan)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    log.info("MCP over streamable HTTP on http://%s:%d/mcp", host, port)
    await uvicorn.Server(config).serve()

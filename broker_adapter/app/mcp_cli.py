"""``broker-adapter mcp``: its flags, and the start of the server they describe."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from broker_adapter.app.options import option
from broker_adapter.errors import ConfigError

DEFAULT_HTTP_PORT = 8471
DEFAULT_TOOL_TIMEOUT_S = 300.0


def add_command(sub: argparse._SubParsersAction[Any], common: Any) -> None:
    """Add ``mcp`` to the subcommands. ``common`` is the CLI module, whose flag helpers
    (``add_redis``, ``add_prefix``, ``add_partitions``, ``add_keyring``) and ``options.option``
    make the flags shared with other commands read alike."""
    p = sub.add_parser(
        "mcp",
        help="serve a router's tasks as MCP tools (stdio or streamable HTTP)",
        description="Each task of the router becomes an MCP tool; a call publishes a signed"
        " request and returns its reply, or (called as an MCP task) returns at once with the"
        " request's message id as the task id. Needs the 'mcp' extra.",
    )
    common.add_redis(p)
    common.add_prefix(p)
    common.add_partitions(p)
    common.add_keyring(p, "holds the principal's keys (signs requests, checks replies)")
    option(
        p,
        "--app",
        "the Router whose tasks are the tools, 'package.module:router'",
        env="BA_APP",
        required=True,
        metavar="MOD:ROUTER",
    )
    option(
        p,
        "--app-dir",
        "directory put first on the import path to find the app",
        env="BA_APP_DIR",
        default=".",
        metavar="DIR",
    )
    option(
        p,
        "--principal",
        "who the requests come from",
        env="BA_PRINCIPAL",
        required=True,
        metavar="P",
    )
    option(
        p,
        "--instance",
        "this server's instance id (replies are routed to it)",
        env="BA_INSTANCE",
        shown="the host name",
        metavar="ID",
    )
    option(
        p,
        "--transport",
        "stdio: one client on standard input and output;"
        " http: streamable HTTP on --host:--port/mcp",
        env="BA_MCP_TRANSPORT",
        default="stdio",
        choices=("stdio", "http"),
    )
    option(
        p,
        "--host",
        "the address the HTTP transport binds",
        env="BA_MCP_HOST",
        default="127.0.0.1",
        metavar="HOST",
    )
    option(
        p,
        "--port",
        "the HTTP transport's port",
        env="BA_MCP_PORT",
        default=DEFAULT_HTTP_PORT,
        type=int,
        metavar="PORT",
    )
    option(
        p,
        "--timeout",
        "how long a plain tool call waits for its reply, seconds",
        env="BA_MCP_TIMEOUT_S",
        default=DEFAULT_TOOL_TIMEOUT_S,
        type=float,
        metavar="S",
    )
    option(
        p,
        "--deadline",
        "each request's deadline, seconds after it is first published",
        env="BA_MCP_DEADLINE_S",
        shown="--timeout",
        type=float,
        metavar="S",
    )


def cmd_mcp(args: argparse.Namespace) -> int:
    """Serve the router's tasks as MCP tools until the client goes (stdio) or a signal."""
    try:
        from broker_adapter.app.mcp_bridge import ToolBridge
        from broker_adapter.app.mcp_server import build_server, serve_http, serve_stdio
    except ImportError as exc:
        raise ConfigError(
            f"broker-adapter mcp needs the MCP SDK: pip install 'broker_adapter[mcp]' ({exc})"
        ) from None
    from broker_adapter.client.request import AsyncClient
    from broker_adapter.protocol.signing import Keyring
    from broker_adapter.stages.shared.handlers import load_app

    if args.timeout <= 0 or (args.deadline is not None and args.deadline <= 0):
        raise ConfigError("--timeout and --deadline must be > 0")
    router = load_app(args.app, app_dir=Path(args.app_dir))
    keyring = Keyring.load(args.keyring)

    async def serve() -> None:
        async with AsyncClient(
            args.redis,
            args.principal,
            keyring,
            instance=args.instance,
            prefix=args.prefix,
            partitions=args.partitions,
        ) as client:
            bridge = ToolBridge(
                router,
                client,
                timeout_s=args.timeout,
                deadline_s=args.deadline or args.timeout,
            )
            server = build_server(bridge)
            if args.transport == "http":
                await serve_http(server, args.host, args.port)
            else:
                await serve_stdio(server)

    asyncio.run(serve())
    return 0

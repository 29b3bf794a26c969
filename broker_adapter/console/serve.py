"""``broker-adapter console``: open the stores, read the tokens, serve the app with
uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import logging

from broker_adapter.errors import ConfigError

log = logging.getLogger("broker_adapter.console")


def cmd_console(args: argparse.Namespace) -> int:
    """Serve the console on ``args.host``:``args.port`` (``console.CONSOLE_HOST`` unless told)."""
    try:
        import uvicorn

        from broker_adapter.console.app import ConsoleConfig, create_app
    except ImportError as exc:
        raise ConfigError(
            f"{exc}: the console needs the 'console' extra (pip install 'broker_adapter[console]')"
        ) from None
    from broker_adapter.console.auth import Tokens
    from broker_adapter.console.sources import open_stores
    from broker_adapter.redis.client import connect

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port")
    tokens = Tokens.load(args.tokens)
    stores = open_stores(list(args.db))
    try:
        config = ConsoleConfig(
            stores=stores, client=connect(args.redis), prefix=args.prefix, tokens=tokens
        )
        app = create_app(config)
        log.warning("console on http://%s:%d/ (%d stores)", args.host, args.port, len(stores))
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            server_header=False,
            proxy_headers=False,
        )
    finally:
        for store in stores:
            store.db.close()
    return 0

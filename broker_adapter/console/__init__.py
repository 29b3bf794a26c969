"""The web console: the pipeline's four stages, task search and story, and the decisions
a human makes (approve or deny, answer an unknown outcome, cancel, replay a dead letter),
served by ``broker-adapter console`` (docs/CONSOLE.md).

It needs the ``console`` extra (Starlette, uvicorn, Jinja2, python-multipart). Its reads
are ``store.console_queries``; its decisions call the functions the CLI commands call.
"""

from __future__ import annotations

from typing import Final

#: Where the console listens unless ``--host`` and ``--port`` say otherwise.
CONSOLE_HOST: Final = "127.0.0.1"
CONSOLE_PORT: Final = 8470

"""How ``broker-adapter demo`` points at the web console: with ``--keep DIR`` the demo's
databases are copied there (``backup.write_snapshot``: consistent, mode 0600) with a tokens file
of one operator, and the report ends with the command that opens the console on them;
without it the report says how to keep them."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from broker_adapter.console import CONSOLE_HOST, CONSOLE_PORT
from broker_adapter.errors import ConfigError
from broker_adapter.store.backup import write_snapshot

#: The demo's databases a console can show: the adapter's, and the charge story's (an
#: unknown outcome, its reconcile and compensation).
KEPT = ("adapter.db", "charges.db")


def check_keep(keep: Path) -> None:
    """Refuse ``--keep DIR`` before the demo runs if it would overwrite anything.

    Raises:
        ConfigError: DIR holds one of the files the demo would write.
    """
    for name in (*KEPT, "tokens.json"):
        if (keep / name).exists():
            raise ConfigError(f"--keep {keep}: {keep / name} exists already")


def keep_for_console(workdir: Path, keep: Path) -> Path:
    """Copy the demo's databases from ``workdir`` to ``keep`` and write a tokens file there
    (mode 0600) naming one operator, ``demo``, with a fresh random token. Returns the
    tokens file."""
    keep.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        write_snapshot(workdir / name, keep / name)
    tokens = keep / "tokens.json"
    fd = os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"demo": secrets.token_hex(16)}, out)
    return tokens


def console_hint(keep: Path | None, prefix: str) -> list[str]:
    """The report's last lines: how to open the web console on the demo's data."""
    if keep is None:
        return [
            "The web console can show this story: `broker-adapter demo --keep DIR` keeps its",
            "databases in DIR and prints the `broker-adapter console` command for them.",
        ]
    dbs = " ".join(f"--db {keep / name}" for name in KEPT)
    token = json.loads((keep / "tokens.json").read_text())["demo"]
    return [
        f"The demo's databases are kept in {keep}. To look at them in the web console",
        "(pip install 'broker_adapter[console]'; any Redis will do, the demo's is gone):",
        f"  broker-adapter console {dbs} --redis redis://localhost:6390/0"
        f" --prefix {prefix} --tokens {keep / 'tokens.json'}",
        f"then open http://{CONSOLE_HOST}:{CONSOLE_PORT}/ and sign in with the token {token}",
    ]

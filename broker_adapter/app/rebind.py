"""``broker-adapter rebind``: move a prefix (or a receiver group) to another store, on
purpose, saying what the move forgets.

A binding (``binding``) never lapses, so the only way for a prefix to change stores is
this command. It is refused while an adapter of the old store still holds a consumer name
on the prefix (stop them first), is not needed when the store is the bound one already (a
database restored from ``broker-adapter backup`` keeps its identity), and otherwise
replaces the binding only if it is still the one it read. The new binding records the old
store, who moved it and when; the command prints the same, with what dedupe is lost: every
message id the old store remembers (counted when ``--old-db`` names it) is unknown to the
new one, so a resend of any of them runs again.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from typing import Any

from broker_adapter.app.binding import Binding, BindingRefused, bind, describe_store
from broker_adapter.app.tasks_cli import print_json
from broker_adapter.clock import SystemClock
from broker_adapter.errors import ConfigError, TransientError
from broker_adapter.protocol.keys import RECEIVER_GROUP, Keys
from broker_adapter.redis import claims
from broker_adapter.redis.client import connect
from broker_adapter.store.backends import open_store
from broker_adapter.store.identity import StoreIdentity, store_identity

log = logging.getLogger("broker_adapter.app.rebind")


def add_rebind(sub: Any, option: Any, add_redis: Any, add_db: Any, add_prefix: Any) -> None:
    """Register ``rebind`` on the CLI's subcommands (with ``cli``'s option helpers)."""
    p = sub.add_parser(
        "rebind",
        help="bind a prefix (or a receiver group) to another store, saying what dedupe is lost",
    )
    add_redis(p)
    add_db(p, "the store to bind: a SQLite file, or a postgresql:// URL")
    add_prefix(p)
    option(
        p,
        "--principal",
        "rebind this principal's receiver group (its receipt store)"
        " instead of the adapter's prefix",
        shown="the adapter's prefix",
        metavar="P",
    )
    option(p, "--group", "with --principal: the receiver group", default=RECEIVER_GROUP)
    option(
        p,
        "--old-db",
        "the store bound now, if still readable: the message ids it remembers are counted",
        shown="not counted",
        metavar="PATH",
    )
    option(p, "--by", "who moves it (kept with the binding)", default="operator")


def _identity(target: str) -> StoreIdentity:
    db = open_store(target)
    try:
        return store_identity(db)
    finally:
        db.close()


def rebind_command(args: argparse.Namespace) -> int:
    identity = _identity(args.db)
    keys = Keys(args.prefix)
    client = connect(args.redis)
    if args.principal:
        key = keys.receipt_binding(args.principal, args.group)
        what = f"receiver group {args.group!r} of {args.principal!r} on prefix {keys.prefix!r}"
    else:
        key, what = keys.store_binding(), f"prefix {keys.prefix!r}"
    found = claims.read(client, key)
    out: dict[str, Any] = {"what": what, "store": identity.store_id, "where": identity.where}
    if found is None:
        bind(client, key, identity, what=what, by=f"rebind by {args.by}", logger=log)
        print_json(
            {
                **out,
                "rebound": False,
                "forgets": None,
                "note": "it was not bound: bound to this store now, nothing forgotten",
            }
        )
        return 0
    bound = Binding.loads(found)
    if bound.store == identity.store_id:
        print_json(
            {
                **out,
                "rebound": False,
                "forgets": None,
                "note": "bound to this store already (the same identity, e.g. a database"
                " restored from a backup): nothing to do, nothing forgotten",
            }
        )
        return 0
    if not args.principal:
        live = _live_names(client, keys, bound.store)
        if live:
            raise BindingRefused(
                f"adapters of {bound.describe()} still run on {what} (consumer names"
                f" {', '.join(sorted(live))}): stop them first"
            )
    old = _old_store(args.old_db, bound)
    new = Binding.of(identity, f"rebind by {args.by}", SystemClock().now(), bound.store)
    if not claims.swap(client, key, found, new.dumps()):
        raise TransientError(f"the binding of {what} changed while it was moved: run it again")
    forgets = (
        f"every message id {bound.describe()} remembers: a resend of a request it accepted"
        f" (within its dedupe window) runs again on {describe_store(identity)}"
    )
    log.warning(
        "%s moved from %s to %s by %s: %s",
        what,
        bound.describe(),
        describe_store(identity),
        args.by,
        forgets,
    )
    report: dict[str, Any] = {
        **out,
        "rebound": True,
        "from": asdict(bound),
        "to": asdict(new),
        "forgets": forgets,
    }
    if old is not None:
        report["forgotten_message_ids"] = old.remembered
        report["forgotten_since"] = old.oldest_at
    print_json(report)
    return 0


def _live_names(client: Any, keys: Keys, store_id: str) -> list[str]:
    """The consumer names held now by adapters of ``store_id`` on ``keys``' prefix."""
    live = []
    for key, value in claims.values(client, keys.consumer_claim("*")):
        try:
            holder = json.loads(value)
        except ValueError:
            continue
        if isinstance(holder, dict) and holder.get("store") == store_id:
            live.append(key.rpartition(":")[2])
    return live


def _old_store(target: str | None, bound: Binding) -> StoreIdentity | None:
    if target is None:
        return None
    old = _identity(target)
    if old.store_id != bound.store:
        raise ConfigError(
            f"--old-db {old.where} is {describe_store(old)}, not the bound {bound.describe()}"
        )
    return old

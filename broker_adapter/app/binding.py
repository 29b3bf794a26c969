"""One store per prefix, one live process per consumer name: what the dedupe rests on.

A request is run once because the one inbox that remembers its ``(principal,
message_id)`` sees every delivery of it. Two stores on one prefix would each see some of
the resends and run them again, so the first adapter to serve a prefix **binds** it to its
store (``{p}:{meta}:store``, the store's identity from ``store.identity``): an adapter
whose store has another identity refuses to start (``BindingRefused``, exit 2). Adapters
sharing one PostgreSQL database, or one SQLite file on one host, share its identity and
run side by side. The binding never lapses: an empty store replacing a full one would
forget every message id, so moving a prefix is ``broker-adapter rebind`` (``rebind``),
which says what the move forgets. A Redis that lost the binding (a wipe, a failover that
lost writes) gives it to the first store that comes; the adapter logs that.

Receivers likewise: a principal's receiver group is bound to one receipt store
(``{p}:{out.P}:receipts:<group>``).

Consumer names (and the owner names of leases, which derive from them) are logical ids:
by default ``<store>-<host>-<slot>``, the first 8 characters of the store id, 8 of a
digest of this host and the first free slot number (``default_name``), never the bare
host name. Each live adapter holds its name with a short claim that it renews
(``{p}:{meta}:consumer:<name>``, ``NAME_TTL_S``); a second live process asking for the
same ``--name`` is refused. A claim left behind by a process of this host that is gone is
taken over at once; another one lapses ``NAME_TTL_S`` after its process stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker_adapter.clock import Clock, SystemClock
from broker_adapter.errors import ConfigError, TransientError
from broker_adapter.protocol.keys import Keys
from broker_adapter.redis import claims

if TYPE_CHECKING:
    from broker_adapter.redis.client import Redis
    from broker_adapter.store.identity import StoreIdentity

log = logging.getLogger("broker_adapter.app.binding")

#: A consumer name claim lapses this long after its process stopped renewing it.
NAME_TTL_S = 15.0
#: How often a running adapter renews its claim and looks at its prefix's binding.
RENEW_EVERY_S = NAME_TTL_S / 3
#: Default names try slots 0, 1, ... up to this many processes of one store on one host.
MAX_SLOTS = 64
BOOT_ID = "/proc/sys/kernel/random/boot_id"
#: Where the adapter's fix is explained.
FIX = (
    "use that same database, PostgreSQL for several hosts (docs/SCALING.md), or another"
    " --prefix; to move the prefix to this store on purpose: broker-adapter rebind"
)


#: The claims this process holds now (their values): a claim with this process's PID that is
#: not one of them was left by an earlier process that had the same PID.
_held_here: set[str] = set()


class BindingRefused(ConfigError):
    """This store (or this consumer name) may not serve the prefix: another one holds it."""


@dataclass(frozen=True)
class Binding:
    """The store a prefix (or a receiver group) is bound to, as Redis keeps it (JSON)."""

    store: str
    kind: str
    where: str
    bound_at: float
    by: str
    previous: str | None = None

    @classmethod
    def of(
        cls, identity: StoreIdentity, by: str, now: float, previous: str | None = None
    ) -> Binding:
        return cls(identity.store_id, identity.kind, identity.where, now, by, previous)

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> Binding:
        """A binding read back; a value that is not one of ours reads as an unknown store
        (it never matches an identity, so it is refused, not overwritten)."""
        try:
            d = json.loads(raw)
            return cls(
                str(d["store"]),
                str(d["kind"]),
                str(d["where"]),
                float(d["bound_at"]),
                str(d["by"]),
                None if d.get("previous") is None else str(d["previous"]),
            )
        except (ValueError, KeyError, TypeError):
            return cls("?", "?", f"an unreadable value {raw[:40]!r}", 0.0, "?")

    def describe(self) -> str:
        return f"store {self.store[:8]} ({self.kind} at {self.where})"


def describe_store(identity: StoreIdentity) -> str:
    return f"store {identity.short} ({identity.kind} at {identity.where})"


def bind(
    client: Redis,
    key: str,
    identity: StoreIdentity,
    *,
    what: str,
    fix: str = FIX,
    by: str = "run",
    clock: Clock | None = None,
    logger: logging.Logger | None = None,
) -> Binding:
    """Bind ``key`` (``what`` says what it binds, for messages) to ``identity``'s store
    unless it is bound already; a binding to the same store is kept as it is.

    Returns:
        the binding in force (this store's).

    Raises:
        BindingRefused: bound to another store (one line: what, the store it is bound to,
            this store, ``fix``).
        RedisUnavailable: Redis could not be asked.
    """
    lg = logger or log
    mine = Binding.of(identity, by, (clock or SystemClock()).now())
    found = claims.set_once(client, key, mine.dumps())
    if found is None:
        if identity.remembered:
            lg.warning(
                "%s had no store binding in Redis (a new Redis, or one that lost its data):"
                " bound to this %s, which remembers %d message ids",
                what,
                describe_store(identity),
                identity.remembered,
            )
        else:
            lg.info("%s bound to %s", what, describe_store(identity))
        return mine
    bound = Binding.loads(found)
    if bound.store != identity.store_id:
        raise BindingRefused(binding_refusal(what, bound, identity, fix))
    return bound


def binding_refusal(what: str, bound: Binding, identity: StoreIdentity, fix: str) -> str:
    return (
        f"{what} is bound to {bound.describe()}, not to this {describe_store(identity)}: two stores"
        f" on one prefix would run resent requests twice. Fix: {fix}"
    )


# -- consumer names -------------------------------------------------------------------


def _read(path: str, link: bool = False) -> str:
    try:
        return os.readlink(path) if link else Path(path).read_text().strip()
    except OSError:
        return ""


def host_key() -> str:
    """A digest naming this host and process namespace: the host name, the kernel's boot
    id and the PID namespace, where readable. Two processes with the same host key can
    see each other's PIDs."""
    parts = [socket.gethostname(), _read(BOOT_ID), _read("/proc/self/ns/pid", link=True)]
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:16]


def machine_key() -> str:
    """A digest of the running kernel's boot id: processes that share it share one file
    system's locks (containers of one machine included); ``""`` where it is not known."""
    boot = _read(BOOT_ID)
    return hashlib.sha256(boot.encode("utf-8")).hexdigest()[:16] if boot else ""


def default_name(store_id: str, slot: int) -> str:
    """The default consumer name of slot ``slot`` of this host for store ``store_id``: a
    logical id, never the host name."""
    host = hashlib.sha256(f"{store_id}\0{socket.gethostname()}".encode()).hexdigest()
    return f"{store_id[:8]}-{host[:8]}-{slot}"


@dataclass(frozen=True)
class NameClaim:
    """A consumer name this process holds: its key and the value that proves it is ours."""

    name: str
    key: str
    value: str


def _claim_value(identity: StoreIdentity, now: float) -> str:
    return json.dumps(
        {
            "token": secrets.token_hex(8),
            "pid": os.getpid(),
            "host": host_key(),
            "machine": machine_key(),
            "store": identity.store_id,
            "since": now,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def _holder(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def left_behind(raw: str) -> bool:
    """Whether a claim was left by a process of this host (same host key) that is gone,
    or by an earlier process that had this one's PID (a restarted container's PID 1): a
    claim this process holds itself (another adapter in it) is not."""
    holder = _holder(raw)
    pid = holder.get("pid")
    if holder.get("host") != host_key() or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return raw not in _held_here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def claim_name(
    client: Redis,
    keys: Keys,
    identity: StoreIdentity,
    name: str | None,
    *,
    clock: Clock | None = None,
    ttl_s: float = NAME_TTL_S,
    logger: logging.Logger | None = None,
) -> NameClaim:
    """Claim ``name``, or the first free default name of this store and host.

    Raises:
        BindingRefused: ``name`` is held by a live process (or every default slot is).
        RedisUnavailable: Redis could not be asked.
    """
    now = (clock or SystemClock()).now()
    ttl_ms = int(ttl_s * 1000)
    value = _claim_value(identity, now)
    candidates = [name] if name else [default_name(identity.store_id, s) for s in range(MAX_SLOTS)]
    for candidate in candidates:
        key = keys.consumer_claim(candidate)
        held = claims.set_once(client, key, value, ttl_ms)
        if held is not None and left_behind(held) and claims.swap(client, key, held, value, ttl_ms):
            (logger or log).info(
                "consumer name %s: took over the claim of a process of this host that is gone",
                candidate,
            )
            held = None
        if held is None:
            _held_here.add(value)
            return NameClaim(candidate, key, value)
        if name:
            h = _holder(held)
            raise BindingRefused(
                f"consumer name {name!r} on prefix {keys.prefix!r} is held by a live process"
                f" (pid {h.get('pid', '?')}, store {str(h.get('store', '?'))[:8]}, host"
                f" {str(h.get('host', '?'))[:8]}); its claim lapses {ttl_s:g} s after that"
                " process stops. Fix: give this adapter another --name, or leave --name"
                " unset for a unique one"
            )
    raise BindingRefused(
        f"all {MAX_SLOTS} default consumer names of {describe_store(identity)} on this host are"
        f" held by live processes on prefix {keys.prefix!r}. Fix: stop some, or use --name"
    )


def refuse_sqlite_copies(client: Redis, keys: Keys, identity: StoreIdentity) -> None:
    """Refuse a SQLite store that a live adapter of another machine serves already: one
    file cannot be shared across machines, so that is a copy of the database (same
    identity, separate inboxes from the copy on). PostgreSQL stores are shared by design.

    Raises:
        BindingRefused: such an adapter holds a consumer name on the prefix now.
    """
    here = machine_key()
    if identity.kind != "sqlite" or not here:
        return
    for key, raw in claims.values(client, keys.consumer_claim("*")):
        holder = _holder(raw)
        if holder.get("store") == identity.store_id and holder.get("machine") not in (here, ""):
            raise BindingRefused(
                f"{describe_store(identity)} is served on prefix {keys.prefix!r} from another"
                f" machine (consumer name {key.rpartition(':')[2]!r}): two copies of one SQLite"
                " database keep separate inboxes and would run resent requests twice. Fix: serve"
                " it from one machine, or move to PostgreSQL for several hosts (docs/SCALING.md)"
            )


# -- the running adapter's guard ------------------------------------------------------


class PrefixGuard:
    """Keeps a running adapter's place: renews its consumer name claim and looks at its
    prefix's binding every ``RENEW_EVERY_S``. A binding Redis lost is taken again (logged);
    a binding to another store (a rebind, or another store that came first after a loss)
    or a name taken by another process stops the adapter (``BindingRefused``).

    Args:
        client: a Redis client of the guard's own.
        keys: the prefix's keys.
        identity: this adapter's store.
        claim: the consumer name this adapter holds.
        ttl_s: the claim's lifetime.
    """

    def __init__(
        self,
        client: Redis,
        keys: Keys,
        identity: StoreIdentity,
        claim: NameClaim,
        *,
        ttl_s: float = NAME_TTL_S,
        logger: logging.Logger | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.identity = identity
        self.claim = claim
        self.ttl_ms = int(ttl_s * 1000)
        self.log = logger or log
        self.what = f"prefix {keys.prefix!r}"

    def check(self) -> None:
        """Renew the claim and look at the binding once.

        Raises:
            BindingRefused: the name or the prefix went to someone else.
            RedisUnavailable: Redis could not be asked (try again later).
        """
        renewed = claims.renew(self.client, self.claim.key, self.claim.value, self.ttl_ms)
        if renewed == 2:
            self.log.warning(
                "the claim on consumer name %s had lapsed (Redis lost it, or this process could"
                " not renew it in time): held again",
                self.claim.name,
            )
        elif isinstance(renewed, str):
            raise BindingRefused(
                f"consumer name {self.claim.name!r} was taken by another process while this"
                " one could not renew its claim: stopping (two consumers of one name would"
                " share their pending entries)"
            )
        found = claims.read(self.client, self.keys.store_binding())
        if found is None:
            self.log.warning(
                "Redis lost the binding of %s (a wipe, or a failover that lost writes): this"
                " store takes it again",
                self.what,
            )
            bind(
                self.client,
                self.keys.store_binding(),
                self.identity,
                what=self.what,
                logger=self.log,
            )
            return
        bound = Binding.loads(found)
        if bound.store != self.identity.store_id:
            raise BindingRefused(
                f"{self.what} was bound to {bound.describe()} while this adapter of"
                f" {describe_store(self.identity)} ran (by {bound.by}): stopping"
            )

    def run(self, stop: threading.Event) -> None:
        """``check`` every ``RENEW_EVERY_S`` until ``stop``; Redis outages are waited out
        (said once each)."""
        outage = False
        while not stop.wait(RENEW_EVERY_S):
            try:
                self.check()
            except TransientError as exc:
                if not outage:
                    self.log.warning("cannot renew the consumer name claim, will retry: %s", exc)
                outage = True
                continue
            outage = False

    def release(self) -> None:
        """Give the name up (a clean stop), if it is still ours; errors are only logged."""
        _held_here.discard(self.claim.value)
        try:
            claims.swap(self.client, self.claim.key, self.claim.value, None)
        except TransientError as exc:
            self.log.info("consumer name %s not released (%s): it lapses", self.claim.name, exc)

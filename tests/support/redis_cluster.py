"""A throwaway local Redis Cluster for tests: three masters and one replica, each a
``redis-server --cluster-enabled yes`` on a free loopback port with its own directory.

The replica serves the master that owns the slot of the shared inbound stream's hash tag
(``{in}``), so that a failover test can kill the shard the ingest reads. The cluster node
timeout is short (``NODE_TIMEOUT_MS``), so a killed master's replica is promoted within a
few seconds. Readiness is polled (``cluster_state:ok`` on every node, the replica's link
up), never waited for by sleeping. Never touches the machine's shared Redis on 6379.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from broker_adapter.errors import ConfigError
from tests.support.redis_server import REDIS_BINARY, RedisServer, require_binary

NODE_TIMEOUT_MS = 1000
REDIS_CLI = "redis-cli"
#: The slot whose master gets the replica (``{in}``: the shared inbound stream's tag).
REPLICATED_SLOT = key_slot(b"in")


class ClusterNode(RedisServer):
    """One cluster-enabled redis-server: no persistence by default (the replica is the
    copy); with ``appendfsync`` an AOF, so a killed node restarts with what it had
    acknowledged. ``failover=False`` makes a replica that never takes its master over
    (``cluster-replica-no-failover``)."""

    def __init__(
        self, workdir: Path, appendfsync: str | None = None, *, failover: bool = True
    ) -> None:
        super().__init__(workdir, appendfsync=appendfsync)
        self.failover = failover

    def args(self) -> list[str]:
        return [
            *super().args(),
            "--cluster-replica-no-failover",
            "no" if self.failover else "yes",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.workdir / "nodes.conf"),
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage",
            "yes",
            "--repl-diskless-sync-delay",
            "0",  # the replica syncs at once, not after 5 s
        ]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def node_id(self) -> str:
        with self.client(socket_timeout=2) as c:
            return str(c.execute_command("CLUSTER", "MYID").decode())

    def role(self) -> str:
        with self.client(socket_timeout=2) as c:
            return str(c.info("replication")["role"])


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``check`` until it holds (errors count as "not yet")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)  # polling the servers' state, not waiting for time to pass
    raise TimeoutError(f"redis cluster: {what} within {timeout_s}s")


class RedisCluster:
    """Three masters (``masters``) and one replica (``replica``) of the master owning
    ``REPLICATED_SLOT`` (``replicated_master``).

    Args:
        workdir: one directory per node under it.
        appendfsync: every node's AOF policy (``None``: no persistence).
        failover: whether the replica takes a dead master over (``False``: a killed master
            is only ever restarted, and keeps its slots).
    """

    def __init__(
        self, workdir: Path, appendfsync: str | None = None, *, failover: bool = True
    ) -> None:
        self.masters = [ClusterNode(workdir / f"m{i}", appendfsync) for i in range(3)]
        self.replica = ClusterNode(workdir / "r0", appendfsync, failover=failover)
        self.replicated_master = self.masters[0]

    @property
    def nodes(self) -> list[ClusterNode]:
        return [*self.masters, self.replica]

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL of the first master (any node would do)."""
        return f"redis+cluster://{self.masters[0].address}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        _cli(
            "--cluster",
            "create",
            *(m.address for m in self.masters),
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        )
        self.wait_ok(self.masters)
        self.replicated_master = self.owner(REPLICATED_SLOT)
        master = self.replicated_master
        _cli(
            "--cluster",
            "add-node",
            self.replica.address,
            master.address,
            "--cluster-slave",
            "--cluster-master-id",
            master.node_id(),
        )
        self.wait_ok(self.nodes)
        wait_until("replica in sync", lambda: self._replica_in_sync(self.replica))

    def owner(self, slot: int) -> ClusterNode:
        """The master that serves ``slot`` now (as the first live master sees it)."""
        with self.live_masters()[0].client(socket_timeout=2) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"slot {slot} is not served")

    def live_masters(self) -> list[ClusterNode]:
        return [
            n
            for n in self.nodes
            if n.proc is not None and n.proc.poll() is None and n.role() == "master"
        ]

    def wait_ok(self, nodes: list[ClusterNode]) -> None:
        def ok() -> bool:
            for node in nodes:
                with node.client(socket_timeout=2) as c:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    if "cluster_state:ok" not in info:
                        return False
                    known = int(info.split("cluster_known_nodes:")[1].split()[0])
                    if known < len(nodes):
                        return False
            return True

        wait_until("cluster_state:ok on every node", ok)

    @staticmethod
    def _replica_in_sync(node: ClusterNode) -> bool:
        with node.client(socket_timeout=2) as c:
            info = c.info("replication")
        return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")

    def replica_caught_up(self, timeout_s: float = 5.0) -> bool:
        """Whether the replica has applied everything its master had written when asked
        (replication offsets), within ``timeout_s``: what it holds then survives a
        failover."""
        with self.replicated_master.client(socket_timeout=2) as master:
            target = int(master.info("replication")["master_repl_offset"])

        def applied() -> bool:
            with self.replica.client(socket_timeout=2) as replica:
                return int(replica.info("replication")["slave_repl_offset"]) >= target

        try:
            wait_until("the replica caught up", applied, timeout_s)
        except TimeoutError:
            return False
        return True

    def kill_and_promote(self) -> ClusterNode:
        """SIGKILL the replicated master and wait until its replica is promoted and the
        cluster is whole again. Returns the killed node."""
        dead = self.replicated_master
        dead.kill()
        wait_until("replica promoted", lambda: self.replica.role() == "master")
        live = [n for n in self.nodes if n is not dead]

        def ok() -> bool:
            for node in live:
                with node.client(socket_timeout=2) as c:
                    if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                        return False
            return True

        wait_until("cluster_state:ok after the failover", ok)
        self.replicated_master = self.replica
        return dead

    def migrate_slot(self, slot: int, target: ClusterNode) -> None:
        """Move ``slot`` with its keys to ``target`` the way ``redis-cli --cluster
        reshard`` does: IMPORTING/MIGRATING, MIGRATE key by key, then SETSLOT NODE."""
        source = self.owner(slot)
        if source is target:
            return
        self.begin_migration(slot, target)
        self.move_keys(slot, source, target)
        self.end_migration(slot, target)

    def begin_migration(self, slot: int, target: ClusterNode) -> None:
        """Mark ``slot`` IMPORTING on ``target`` and MIGRATING on its owner: from now on
        the owner answers ASK for the slot's keys it no longer holds."""
        source = self.owner(slot)
        with target.client(socket_timeout=5) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id())
        with source.client(socket_timeout=5) as src:
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id())

    def move_keys(self, slot: int, source: ClusterNode, target: ClusterNode) -> None:
        """MIGRATE every key of ``slot`` from ``source`` to ``target``."""
        src: Any = source.client(socket_timeout=5)
        try:
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        finally:
            src.close()

    def end_migration(self, slot: int, target: ClusterNode) -> None:
        """Hand ``slot`` to ``target`` on every master (the old owner answers MOVED)."""
        target_id = target.node_id()
        for node in self.live_masters():
            with node.client(socket_timeout=5) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        wait_until(f"slot {slot} served by {target.address}", lambda: self.owner(slot) is target)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cli(*args: str) -> None:
    subprocess.run([REDIS_CLI, *args], check=True, capture_output=True, timeout=60)


def cluster_supported(workdir: Path) -> bool:
    """Whether this machine's redis-server runs in cluster mode and redis-cli can build
    a cluster."""
    if shutil.which(REDIS_BINARY) is None or shutil.which(REDIS_CLI) is None:
        return False
    probe = ClusterNode(workdir / "probe")
    try:
        probe.start(timeout_s=5.0)
    except ConfigError:
        return False
    try:
        with probe.client(socket_timeout=2) as c:
            return bool(c.info("cluster").get("cluster_enabled"))
    finally:
        probe.stop()


def require_cluster(workdir: Path) -> None:
    """Skip the calling test when this machine's Redis cannot run a cluster (no
    redis-server, no redis-cli, or no cluster support)."""
    require_binary()
    if not cluster_supported(workdir):
        pytest.skip("redis-server without cluster support (or no redis-cli)")


def start_cluster(workdir: Path) -> RedisCluster:
    """A started cluster, or a skip when this machine's Redis cannot run one."""
    require_cluster(workdir)
    cluster = RedisCluster(workdir)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One cluster for the session (tests that break it use ``fresh_redis_cluster``)."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of the test's own, for a test that kills a node."""
    cluster = start_cluster(tmp_path / "cluster")
    yield cluster
    cluster.stop()

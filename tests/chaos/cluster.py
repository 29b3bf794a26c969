"""The processes under test: redis-server (one, behind the proxy, or a local Redis
Cluster of three masters and a replica, without one), adapters and receivers, and a
supervisor that notices deaths, tells expected from unexpected ones and restarts.

Every adapter and receiver runs in a session of its own (``start_new_session``), so the
nemesis can signal a whole adapter (runner and worker children) with one ``killpg``. Output
goes to a log file per component under the run directory.

Crash and pause points are armed per incarnation through ``BA_CRASHPOINT`` /
``BA_PAUSEPOINT``. A component that dies while armed, or after the nemesis killed it, is an
expected death; anything else is logged as an unexpected exit (a liveness violation) with
the tail of its log, and the component is restarted so the run can go on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis as redis_py

from broker_adapter.redis.client import connect
from tests.chaos.history import INFO, History
from tests.chaos.proxy import ChaosProxy
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
SUPERVISE_EVERY_S = 0.2
STOP_TIMEOUT_S = 20.0
LOG_TAIL_BYTES = 2000
RESTART_MIN_S = 1.0


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def log_tail(path: Path, n: int = LOG_TAIL_BYTES) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - n))
        return fh.read().decode("utf-8", "replace")


@dataclass
class Component:
    """One restartable subprocess (an adapter or a receiver).

    Attributes:
        name: ``a1``, ``recv-p1``, ...
        role: ``adapter`` or ``receiver``.
        args: its command line.
        env: its base environment (no crash point).
        log_path: where stdout and stderr go.
    """

    name: str
    role: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    armed: dict[str, str] = field(default_factory=dict)
    hold_down: bool = False
    paused: bool = False
    killing: bool = False
    starts: int = 0
    started_at: float = 0.0
    exit_noted: bool = False
    self_paused: dict[int, float] = field(default_factory=dict)

    def start(self, armed: dict[str, str] | None = None) -> None:
        """Start a new incarnation, with ``armed`` crash/pause variables if given."""
        self.armed = dict(armed or {})
        env = dict(self.env)
        env.update(self.armed)
        self.self_paused = {}
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start #{self.starts + 1} armed={self.armed} ===\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.args,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.starts += 1
        self.started_at = time.monotonic()
        self.killing = False
        self.paused = False
        self.exit_noted = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (runner and worker children)."""
        if self.proc is None:
            return
        self.killing = True
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        if self.proc is not None and _signal_group(self.proc.pid, signal.SIGSTOP):
            self.paused = True

    def resume(self) -> None:
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the main process (a clean drain); SIGKILL the group if it outlives
        ``timeout_s``. Returns the exit code."""
        if self.proc is None:
            return None
        self.killing = True
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Leftovers of the group (e.g. a worker that missed the drain) go too.
        _signal_group(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def group_pids(self) -> list[int]:
        """The main process and all its descendants."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.Error:
            return []

    def worker_pids(self) -> list[int]:
        """The adapter's worker processes (multiprocessing spawn children)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        out: list[int] = []
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=False):
                cmd = " ".join(child.cmdline())
                if "spawn_main" in cmd and "resource_tracker" not in cmd:
                    out.append(child.pid)
        except psutil.Error:
            return out
        return out


class Cluster:
    """Redis, the proxy and the components of one run.

    Args:
        redis: the redis-server, or the Redis Cluster (started by the caller).
        proxy: the loopback proxy in front of a single server; ``None`` for a cluster
            (its clients follow MOVED to the nodes' own addresses: no proxy can sit
            in front of it).
        history: where the supervisor logs (``proc`` ``supervisor``).
        pause_resume_s: how long a component that stopped itself at a pause point stays
            stopped before the supervisor resumes it (past the lease).
    """

    def __init__(
        self,
        redis: RedisServer | RedisCluster,
        proxy: ChaosProxy | None,
        history: History,
        pause_resume_s: float,
    ) -> None:
        self.redis = redis
        self.proxy = proxy
        self.history = history
        self.pause_resume_s = pause_resume_s
        self.components: dict[str, Component] = {}
        self.lock = threading.RLock()
        self.redis_down = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, comp: Component) -> None:
        self.components[comp.name] = comp

    def role(self, role: str) -> list[Component]:
        return [c for c in self.components.values() if c.role == role]

    # -- supervision ------------------------------------------------------------------------

    def start_supervisor(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._thread.start()

    def stop_supervisor(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _supervise(self) -> None:
        while not self._stop.wait(SUPERVISE_EVERY_S):
            with self.lock:
                for comp in list(self.components.values()):
                    self._look_at(comp)

    def _look_at(self, comp: Component) -> None:
        proc = comp.proc
        if proc is None:
            return
        rc = proc.poll()
        if rc is None:
            self._resume_self_paused(comp)
            return
        if not comp.exit_noted:
            self._note_exit(comp, rc)
        if comp.hold_down:
            return  # killed by the nemesis: stays down until its stop step
        if time.monotonic() - comp.started_at < RESTART_MIN_S:
            return  # died right after starting: no tight restart loop
        self.restart(comp, why="supervisor")

    def _note_exit(self, comp: Component, rc: int) -> None:
        comp.exit_noted = True
        armed = bool(comp.armed.get("BA_CRASHPOINT"))
        expected = comp.killing or (armed and rc == -signal.SIGKILL)
        value: dict[str, Any] = {
            "target": comp.name,
            "rc": rc,
            "expected": expected,
            "cause": "nemesis" if comp.killing else "crashpoint" if expected else "unexpected",
            "armed": comp.armed,
        }
        if not expected:
            value["log_tail"] = log_tail(comp.log_path)
        self.history.log(INFO, "exit", value=value, proc="supervisor")

    def _resume_self_paused(self, comp: Component) -> None:
        """A worker stopped at an armed pause point is resumed after ``pause_resume_s``."""
        if not comp.armed.get("BA_PAUSEPOINT") or comp.paused:
            return
        now = time.monotonic()
        for pid in comp.group_pids():
            try:
                status = psutil.Process(pid).status()
            except psutil.Error:
                continue
            if status == psutil.STATUS_STOPPED:
                since = comp.self_paused.setdefault(pid, now)
                if since == now:
                    self.history.log(
                        INFO, "paused", value={"target": comp.name, "pid": pid}, proc="supervisor"
                    )
                elif now - since >= self.pause_resume_s:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                    self.history.log(
                        INFO, "resumed", value={"target": comp.name, "pid": pid}, proc="supervisor"
                    )

    def restart(self, comp: Component, *, armed: dict[str, str] | None = None, why: str) -> None:
        """Kill (if alive) and start ``comp`` again, armed or not."""
        with self.lock:
            if comp.alive():
                comp.kill()
            if comp.proc is not None and comp.proc.returncode is not None and not comp.exit_noted:
                self._note_exit(comp, comp.proc.returncode)
            comp.hold_down = False
            comp.start(armed)
            self.history.log(
                INFO,
                "restart",
                value={"target": comp.name, "why": why, "armed": comp.armed, "pid": comp.pid},
                proc="supervisor",
            )

    # -- redis --------------------------------------------------------------------------------

    @property
    def is_redis_cluster(self) -> bool:
        return isinstance(self.redis, RedisCluster)

    def nodes(self) -> list[RedisServer]:
        """Every redis-server of the run: the one server, or the cluster's nodes."""
        if isinstance(self.redis, RedisCluster):
            return list(self.redis.nodes)
        return [self.redis]

    def masters(self) -> list[RedisServer]:
        """The servers that own slots (the one server, or the cluster's masters)."""
        if isinstance(self.redis, RedisCluster):
            return list(self.redis.masters)
        return [self.redis]

    def admin(self) -> redis_py.Redis:
        """A direct (not proxied) client for administrative commands: a cluster client
        for a cluster (commands go to the node owning their key)."""
        if isinstance(self.redis, RedisCluster):
            return connect(self.redis.url, socket_timeout_s=5.0)
        return redis_py.Redis(port=self.redis.port, socket_timeout=5)

    def kill_redis(self, node: RedisServer | None = None) -> None:
        """SIGKILL the one server, or ``node`` of the cluster."""
        with self.lock:
            (node or self.masters()[0]).kill()
            self.redis_down = True

    def start_redis(self, *, wipe: bool = False) -> None:
        """Start every server that is down (all of them again, emptied, with ``wipe``)."""
        with self.lock:
            for node in self.nodes():
                if node.proc is not None and node.proc.poll() is None and not wipe:
                    continue
                node.restart(wipe=wipe)
            self.redis_down = False

    # -- end of run ---------------------------------------------------------------------------

    def heal_processes(self) -> None:
        """SIGCONT everything; restart what is down or armed, unarmed."""
        with self.lock:
            for comp in self.components.values():
                if comp.proc is not None:
                    _signal_group(comp.proc.pid, signal.SIGCONT)
                comp.paused = False
                if comp.armed or not comp.alive() or comp.hold_down:
                    self.restart(comp, why="heal")

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every component (receivers last) and wait for each."""
        codes: dict[str, int | None] = {}
        with self.lock:
            order = self.role("adapter") + self.role("receiver")
            for comp in order:
                codes[comp.name] = comp.terminate()
        return codes

"""What the supervisor starts and tracks: a function's process spec, each child process, a
replica, and the replicas of one function (a unit), with how they are reported."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..manifests.runtimes import Runtime
from . import memory
from .replica_logs import Stream
from .sandbox import Command, Sandbox

__all__ = [
    "AdoptedProcess",
    "Child",
    "ProcessSpec",
    "Replica",
    "ReplicaEvent",
    "Unit",
    "UnitStatus",
    "Upstreams",
    "exit_reason",
    "free_port",
]

_BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT")

# (env, function, upstreams, why the last replica that left the route ended, the key
# the function's replicas ask of every call: see ``replica_key``)
Upstreams = Callable[[str, str, tuple[tuple[str, int], ...], str | None, str], None]
# (env, function, "exited" | "recovered" | "scaled", reason: "OOMKilled: ..." or None)
ReplicaEvent = Callable[[str, str, str, str | None], None]


@dataclass(frozen=True)
class ProcessSpec:
    """Everything needed to start one function's processes."""

    env_name: str
    function: str
    runtime: Runtime
    entrypoint: str
    artifact: Path
    timeout_sec: float
    env_vars: Mapping[str, str]
    memory_mb: int | None = None  # killed above this (OOMKilled); None: no limit
    max_processes: int | None = None  # tasks (processes and threads) in its sandbox
    # "": the replicas that take the function's traffic; else a kept revision's id, whose
    # replicas serve only its own URL (name@revision) and run apart (see ``unit``)
    revision: str = ""
    # SIGTERM to SIGKILL when its streams and sockets drain (Function.stop_grace_sec);
    # None: a replica of a function with none, stopped as always
    stop_grace_sec: float | None = None

    @property
    def unit(self) -> str:
        """What the supervisor and the routes know these replicas as: the function's name,
        or ``name@revision`` for a kept revision's."""
        return f"{self.function}@{self.revision}" if self.revision else self.function

    def environ(self, extra: Mapping[str, str]) -> dict[str, str]:
        base = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        return {
            **base,
            **self.env_vars,
            "SLESS_ENTRYPOINT": self.entrypoint,
            "SLESS_FUNCTION_DIR": str(self.artifact),
            "SLESS_FUNCTION_NAME": self.function,
            "SLESS_ENV": self.env_name,
            "SLESS_TIMEOUT_SEC": f"{self.timeout_sec:g}",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def command(self, role: str) -> list[str]:
        script = self.runtime.server if role == "server" else self.runtime.runner
        return [self.runtime.interpreter, str(self.runtime.folder / script)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class UnitStatus:
    """One function's replicas as the supervisor sees them."""

    wanted: int
    ready: int
    restarts: int  # replicas that ended since it was deployed
    last_exit: str | None
    failing: bool = False  # the last replica ended or failed to start, and none came back


class AdoptedProcess:
    """A replica started before this process re-executed itself: still its child, waited
    for by pid (the ``subprocess.Popen`` calls the supervisor makes, and no more)."""

    def __init__(self, pid: int, stdout: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # waited for elsewhere: its status is lost
                    pid, status = self.pid, -1
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status) if status >= 0 else -9
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0)
            time.sleep(0.01)
        return code


@dataclass(eq=False)
class Child:
    """A started process, tracked until it has been waited for."""

    process: subprocess.Popen[bytes] | AdoptedProcess
    limit: memory.Limit
    spec: ProcessSpec
    sandbox: Sandbox
    command: Command
    _reason: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.process.pid

    def finish(self) -> str:
        """Why the (exited, waited for) process ended; releases its limit. Idempotent."""
        with self._lock:
            if self._reason is None:
                code = self.sandbox.returncode(self.process.returncode)
                oom = self.limit.reason()
                self._reason = oom or exit_reason(code if code is not None else -9)
                self.limit.release()
                self.sandbox.release(self.command)
            return self._reason


@dataclass(eq=False)
class Replica:
    child: Child
    port: int
    log_path: Path
    output: Stream
    started: float = field(default_factory=time.monotonic)
    withdrawn: bool = False  # being killed: out of the route before it dies

    @property
    def process(self) -> subprocess.Popen[bytes] | AdoptedProcess:
        return self.child.process


@dataclass(eq=False)
class Unit:
    spec: ProcessSpec
    spec_hash: str
    wanted: int
    replicas: list[Replica] = field(default_factory=list)
    failures: int = 0  # in a row: the backoff grows with it
    restarts: int = 0  # in all, since deployed
    restart_at: float = 0.0
    last_exit: str | None = None
    degraded: bool = False  # a replica exited; "recovered" once all are back
    starting: int = 0  # replicas being started now
    # why the last start failed, until a replica starts: with restart_at, what a call that
    # waits for a replica is told (the activator answers 502 with it while the backoff holds)
    start_failed: str | None = None
    # taken over across a restart in place, its spec still without its environment: no
    # replica is started from it until the restore hands the full spec over
    adopted: bool = False

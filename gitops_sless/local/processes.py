"""Runtime processes on loopback: replicas of function servers, and one-shot runners.

A replica takes traffic only after ``/health`` answers. Replacing a function
starts the new replicas first, switches the route, and only then stops the
old ones, so no request finds nothing to answer it. A replica that dies is
taken out of the route at once and restarted with exponential backoff.

Every child's pid is written under ``<state>/pids`` so that a reconciler that
was killed outright can stop its orphans when it starts again.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..backend import ApplyFailed, JobFailed
from ..runtimes import Runtime
from .orphans import ProcessGroups

__all__ = ["ProcessSpec", "Supervisor", "run_once"]

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_SEC = 20.0
STOP_GRACE_SEC = 5.0
DRAIN_SEC = 1.0
BACKOFF_FIRST_SEC = 0.5
BACKOFF_MAX_SEC = 60.0
STABLE_AFTER_SEC = 30.0
LOG_TAIL_BYTES = 2000
_BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT")


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


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class _Replica:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Unit:
    spec: ProcessSpec
    spec_hash: str
    wanted: int
    replicas: list[_Replica] = field(default_factory=list)
    failures: int = 0
    restart_at: float = 0.0


class Supervisor:
    """Keeps the wanted number of healthy replicas of every function running."""

    def __init__(
        self,
        state_dir: Path,
        on_upstreams: Callable[[str, str, tuple[tuple[str, int], ...]], None],
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.logs = state_dir / "logs"
        self.pids = ProcessGroups(state_dir / "pids" / "servers")
        orphans = self.pids.stop_orphans()
        if orphans:
            log.warning("stopped %d runtime processes left by an earlier run", orphans)
        self._on_upstreams = on_upstreams
        self._units: dict[tuple[str, str], _Unit] = {}
        self._draining: list[_Replica] = []
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="sless-supervisor", daemon=True)
        self._monitor.start()

    # --- public -------------------------------------------------------------------------

    def deployed(self, env: str) -> dict[str, str]:
        with self._lock:
            return {name: u.spec_hash for (e, name), u in self._units.items() if e == env}

    def apply(self, spec: ProcessSpec, spec_hash: str, replicas: int) -> None:
        """Run ``replicas`` healthy servers of ``spec``; the old ones stop after the switch."""
        key = (spec.env_name, spec.function)
        fresh = [self._start_healthy(spec) for _ in range(replicas)] if replicas else []
        with self._lock:
            old = self._units.get(key)
            self._units[key] = _Unit(spec, spec_hash, replicas, fresh)
            self._publish(key)
        if old:
            self._stop_later(old.replicas)

    def remove(self, env: str, name: str) -> None:
        with self._lock:
            unit = self._units.pop((env, name), None)
        if unit:
            self._stop(unit.replicas)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            units, self._units = list(self._units.values()), {}
            draining, self._draining = self._draining, []
        self._stop([r for u in units for r in u.replicas] + draining)

    # --- replicas -------------------------------------------------------------------------

    def _publish(self, key: tuple[str, str]) -> None:
        unit = self._units.get(key)
        upstreams = tuple((self.host, r.port) for r in unit.replicas) if unit else ()
        self._on_upstreams(key[0], key[1], upstreams)

    def _spawn(self, spec: ProcessSpec) -> _Replica:
        port = free_port(self.host)
        log_dir = self.logs / spec.env_name
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{spec.function}.log"
        command = spec.command("server")
        with log_path.open("ab") as out:
            process = subprocess.Popen(
                command,
                cwd=spec.artifact,
                env=spec.environ({"PORT": str(port), "SLESS_HOST": self.host}),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids.add(process.pid, command)
        return _Replica(process, port, log_path)

    def _start_healthy(self, spec: ProcessSpec) -> _Replica:
        replica = self._spawn(spec)
        deadline = time.monotonic() + HEALTH_TIMEOUT_SEC
        while time.monotonic() < deadline:
            if replica.process.poll() is not None:
                self._stop([replica])
                raise ApplyFailed(
                    f"{spec.function}: the runtime exited with code {replica.process.returncode}"
                    f" before it was healthy: {_tail(replica.log_path).strip()[-500:]}"
                )
            if self._healthy(replica.port):
                return replica
            time.sleep(0.02)
        self._stop([replica])
        raise ApplyFailed(f"{spec.function}: no healthy answer on /health in {HEALTH_TIMEOUT_SEC}s")

    def _healthy(self, port: int) -> bool:
        conn = http.client.HTTPConnection(self.host, port, timeout=1)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _stop(self, replicas: list[_Replica]) -> None:
        for replica in replicas:
            if replica.process.poll() is None:
                _signal_group(replica.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SEC
        for replica in replicas:
            try:
                replica.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(replica.process.pid, signal.SIGKILL)
                replica.process.wait()
            self.pids.remove(replica.process.pid)

    def _stop_later(self, replicas: list[_Replica]) -> None:
        # requests already sent to the old replicas get DRAIN_SEC to be answered
        with self._lock:
            self._draining.extend(replicas)

        def later() -> None:
            time.sleep(DRAIN_SEC)
            self._stop(replicas)
            with self._lock:
                self._draining = [r for r in self._draining if r not in replicas]

        threading.Thread(target=later, name="sless-drain", daemon=True).start()

    # --- crash recovery ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            with self._lock:
                items = list(self._units.items())
            for key, unit in items:
                self._check(key, unit)

    def _check(self, key: tuple[str, str], unit: _Unit) -> None:
        dead = [r for r in unit.replicas if r.process.poll() is not None]
        now = time.monotonic()
        if dead:
            with self._lock:
                if self._units.get(key) is not unit:
                    return
                unit.replicas = [r for r in unit.replicas if r not in dead]
                self._publish(key)
            for replica in dead:
                self.pids.remove(replica.process.pid)
                log.warning(
                    "%s/%s: replica on port %d exited with code %s; restarting",
                    *key,
                    replica.port,
                    replica.process.returncode,
                )
            unit.failures += 1
            backoff = min(BACKOFF_MAX_SEC, BACKOFF_FIRST_SEC * 2 ** (unit.failures - 1))
            unit.restart_at = now + backoff
        if len(unit.replicas) < unit.wanted and now >= unit.restart_at:
            self._restart_one(key, unit)
        elif unit.failures and all(now - r.started > STABLE_AFTER_SEC for r in unit.replicas):
            unit.failures = 0

    def _restart_one(self, key: tuple[str, str], unit: _Unit) -> None:
        try:
            replica = self._start_healthy(unit.spec)
        except ApplyFailed as exc:
            unit.failures += 1
            backoff = min(BACKOFF_MAX_SEC, BACKOFF_FIRST_SEC * 2 ** (unit.failures - 1))
            unit.restart_at = time.monotonic() + backoff
            log.warning("%s/%s: restart failed (next try in %.1fs): %s", *key, backoff, exc)
            return
        with self._lock:
            if self._units.get(key) is not unit:
                self._stop([replica])
                return
            unit.replicas.append(replica)
            self._publish(key)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # the process may have exited since it was last looked at
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def run_once(spec: ProcessSpec, event: Mapping[str, object], timeout_sec: float) -> str:
    """Run the runtime's runner once with ``event``; its stdout (JSON) is the result."""
    try:
        done = subprocess.run(
            spec.command("runner"),
            cwd=spec.artifact,
            env=spec.environ({"SLESS_EVENT": json.dumps(dict(event), sort_keys=True)}),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_sec + 5,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        raise JobFailed(f"{spec.function}: timed out after {timeout_sec:g}s") from exc
    stderr = done.stderr.decode("utf-8", "replace").strip()
    if done.returncode != 0:
        reason = stderr.splitlines()[-1] if stderr else "no output on stderr"
        raise JobFailed(f"{spec.function}: exited with code {done.returncode}: {reason}")
    result = done.stdout.decode("utf-8", "replace").strip()
    try:
        json.loads(result)
    except ValueError as exc:
        raise JobFailed(f"{spec.function}: the result is not JSON: {result[:200]!r}") from exc
    return result

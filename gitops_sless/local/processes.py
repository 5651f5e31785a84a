"""Runtime processes on loopback: replicas of function servers, and one-shot runners.

A replica takes traffic only once it says it listens (``readiness``), and
runs as many as its function wants now (``scale``: the autoscaler's). Replacing a function
starts the new replicas first, switches the route, and only then stops the
old ones, so no request finds nothing to answer it. A replica that dies is
taken out of the route at once and restarted with exponential backoff; why it
ended (``OOMKilled: …``, ``exited with code 1``) goes with the route.

Every process runs under its function's ``memoryMB`` (see ``memory``), and is
tracked from the moment it is started until it has been waited for, so
:meth:`Supervisor.close` stops all of them, whatever was starting at the time;
after ``close`` nothing new starts. Every child's pid is also written under
``<state>/pids`` so that a reconciler that was killed outright can stop its
orphans when it starts again.

Every process runs in the supervisor's ``sandbox`` (see ``sandbox``): a
replica is stopped by SIGTERM to what runs inside it, so it drains as it
would unconfined, and then by SIGKILL to its whole process group.

What replicas print goes through a pipe to ``replica_logs``, which puts a
timestamp on every line of ``<state>/logs/<env>/<function>.log``; the
supervisor adds lines of its own there: a kill for memory, a replica that
ended, each after the replica's last line. That file never passes its cap (8
MiB, rotated as it is written: see ``logfiles``). Jobs and cron runs are
one-shot runs of the runner (``oneshot``).
"""

from __future__ import annotations

import dataclasses
import hmac
import http.client
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import failure, logs
from ..plan.backend import ApplyFailed
from . import adoption, memory, oneshot
from .orphans import ProcessGroups
from .readiness import ReadyLine, StartFailed, record_start, tail
from .recovery import Recovery
from .replica_logs import LogPump
from .sandbox import Sandbox, signal_group
from .units import (
    Child,
    ProcessSpec,
    Replica,
    ReplicaEvent,
    Unit,
    UnitStatus,
    Upstreams,
    free_port,
)

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_SEC = 20.0
STOP_GRACE_SEC = 5.0
DRAIN_SEC = 1.0


class Supervisor(Recovery):
    """Keeps the wanted number of healthy replicas of every function running."""

    def __init__(
        self,
        state_dir: Path,
        on_upstreams: Upstreams,
        host: str = "127.0.0.1",
        on_replica_event: ReplicaEvent | None = None,
        memory_guard: memory.MemoryGuard | None = None,
        sandbox: Sandbox | None = None,
        adopt: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """``adopt``: what :meth:`hand_over` returned in this process before it re-executed
        itself; those replicas serve on, and are no orphans."""
        self.host = host
        self.sandbox = sandbox or Sandbox()
        self.logs = state_dir / "logs"
        self.output = LogPump()
        self.pids = ProcessGroups(state_dir / "pids" / "servers")
        self.memory = memory_guard or memory.detect()
        self.memory.on_kill = self._withdraw
        self._on_upstreams = on_upstreams
        self._on_replica_event = on_replica_event
        self._units: dict[tuple[str, str], Unit] = {}
        self._keys: dict[tuple[str, str], str] = {}  # replica_key of each function
        # the reconciler's span relay (/internal/otlp) when spans are exported, else None
        self.span_relay: str | None = None
        self.version = 0  # moves whenever a unit or its replicas change: status() may differ
        self._children: dict[int, Child] = {}  # every process started and not yet reaped
        self._spawning = 0  # Popen calls under way
        self._closing = False
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._closed = threading.Event()
        kept = self._adopt(adopt)  # before any orphan is stopped: these are not orphans
        orphans = self.pids.stop_orphans(keep=kept)
        if orphans:
            log.warning("stopped %d runtime processes left by an earlier run", orphans)
        self._monitor = threading.Thread(target=self._watch, name="sless-supervisor", daemon=True)
        self._monitor.start()

    # --- public -------------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._closing

    def deployed(self, env: str) -> dict[str, str]:
        with self._lock:
            return {name: u.spec_hash for (e, name), u in self._units.items() if e == env}

    def spec_hash(self, env: str, unit: str) -> str | None:
        """What ``unit`` of ``env`` runs (None: no such unit); one lookup, not a listing."""
        with self._lock:
            found = self._units.get((env, unit))
            return found.spec_hash if found is not None else None

    def unit_keys(self) -> list[tuple[str, str]]:
        """(env, unit) of every unit, adopted ones included."""
        with self._lock:
            return list(self._units)

    def status(self, env: str) -> dict[str, UnitStatus]:
        with self._lock:
            return {
                name: UnitStatus(
                    wanted=u.wanted,
                    ready=sum(1 for r in u.replicas if not r.withdrawn),
                    restarts=u.restarts,
                    last_exit=u.last_exit,
                    failing=u.failures > 0,
                )
                for (e, name), u in self._units.items()
                if e == env
            }

    def artifacts_in_use(self) -> set[Path]:
        """Artifact folders of every function deployed and every process still running."""
        with self._lock:
            units = {u.spec.artifact for u in self._units.values()}
            return units | {c.spec.artifact for c in self._children.values()}

    def apply(self, spec: ProcessSpec, spec_hash: str, replicas: int) -> None:
        """Run ``replicas`` healthy servers of ``spec``; the old ones stop after the switch."""
        key = (spec.env_name, spec.unit)
        old = None
        fresh: list[Replica] = []
        try:
            for _ in range(replicas):
                fresh.append(self._start_healthy(spec))
        except BaseException:
            self._stop([r.child for r in fresh])
            raise
        with self._lock:
            refused = self._closing
            if not refused:
                old = self._units.get(key)
                self._units[key] = Unit(spec, spec_hash, replicas, fresh)
                self._publish(key)
        if refused:
            self._stop([r.child for r in fresh])
            raise self._shutting_down(spec)
        if old:
            grace = old.spec.stop_grace_sec or STOP_GRACE_SEC
            self._stop_later([r.child for r in old.replicas], grace)

    def scale(self, env: str, name: str, replicas: int) -> None:
        """Run ``replicas`` of an applied function from now on: more start at once (unless
        a failed start's backoff holds: then when it ends), fewer leave the route at once
        and stop once their calls are answered (within the function's timeout)."""
        key = (env, name)
        with self._lock:
            unit = self._units.get(key)
            if unit is None or self._closing or unit.wanted == replicas:
                return
            unit.wanted = replicas
            self.version += 1
            extra = unit.replicas[replicas:]
            if extra:
                unit.replicas = unit.replicas[:replicas]
                self._publish(key)
        if extra:
            grace = unit.spec.stop_grace_sec or unit.spec.timeout_sec + STOP_GRACE_SEC
            self._stop_later([r.child for r in extra], grace)
        self._grow(key, unit)
        self._notify(key, "scaled", None)  # Idle and back: the status store looks again

    def swap(
        self, env: str, name: str, kept: str, spec: ProcessSpec, spec_hash: str, retired: str
    ) -> bool:
        """The ready replicas of unit ``kept`` (a kept revision's) serve ``name`` from now
        on, as ``spec``, at once; ``name``'s own go on as the unit of revision ``retired``
        (their calls under way are answered: nothing stops). Both keep their replica keys.
        False, changing nothing, when ``kept`` has no ready replica to take over."""
        with self._lock:
            unit = self._units.get((env, kept))
            if self._closing or unit is None or not any(not r.withdrawn for r in unit.replicas):
                return False
            before = self._units.pop((env, name), None)
            before_key = self._keys.pop((env, name), None)
            del self._units[(env, kept)]
            self._keys[(env, name)] = self._keys.pop((env, kept))
            unit.spec, unit.spec_hash, unit.adopted = spec, spec_hash, False
            unit.wanted = max(unit.wanted, 1)
            for replica in unit.replicas:
                replica.child.spec = spec
            self._units[(env, name)] = unit
            self._publish((env, name))
            if before is not None:
                old_spec = dataclasses.replace(before.spec, revision=retired)
                before.spec = old_spec
                for replica in before.replicas:
                    replica.child.spec = old_spec
                self._units[(env, old_spec.unit)] = before
                if before_key is not None:
                    self._keys[(env, old_spec.unit)] = before_key
                self._publish((env, old_spec.unit))
        self._grow((env, name), unit)
        return True

    def publish(self, env: str, name: str) -> None:
        """Tell the routes where ``name``'s replicas are again (what else its route says
        changed: a rollout's share)."""
        with self._lock:
            if (env, name) in self._units:
                self._publish((env, name))

    def start_failure(self, env: str, name: str) -> tuple[str, float] | None:
        """(why, until when: monotonic) while a failed start's backoff holds, else None."""
        with self._lock:
            unit = self._units.get((env, name))
            if unit is None or unit.start_failed is None:
                return None
            return unit.start_failed, unit.restart_at

    def remove(self, env: str, name: str) -> None:
        with self._lock:
            unit = self._units.pop((env, name), None)
            self._keys.pop((env, name), None)
            self.version += 1
        if unit:
            self._stop([r.child for r in unit.replicas])

    def remove_environment(self, env: str) -> None:
        """Stop every process of ``env``: its replicas, and the jobs and cron runs under way."""
        with self._lock:
            units = [key for key in self._units if key[0] == env]
            for key in units:
                self._units.pop(key)
                self._keys.pop(key, None)
            self.version += 1
            children = [c for c in self._children.values() if c.spec.env_name == env]
        self._stop(children)

    def note(self, env: str, function: str, line: str) -> None:
        """A line of the reconciler's own in ``function``'s log (what a cron run that
        failed printed: read through the API, never in the reconciler's log)."""
        log_dir = self.logs / env
        log_dir.mkdir(parents=True, exist_ok=True)
        self.output.note(log_dir / f"{function}.log", line.replace("\n", "\\n"))

    def run_once(
        self,
        spec: ProcessSpec,
        event: Mapping[str, object],
        timeout_sec: float,
        trace: Mapping[str, str] | None = None,
    ) -> str:
        """Run the runtime's runner once with ``event``; its stdout (JSON) is the result."""
        return oneshot.run_once(self, spec, event, timeout_sec, trace)

    def close(self) -> None:
        """Stop every process started, and start none from now on (safe to call twice)."""
        with self._lock:
            self._closing = True
            # a Popen under way returns quickly; its process is then tracked and stopped here
            self._changed.wait_for(lambda: self._spawning == 0, timeout=30)
            self._units = {}
            children = list(self._children.values())
        self._closed.set()
        self._stop(children)
        self.memory.close()
        self.output.close()

    def hand_over(self) -> list[dict[str, Any]]:
        """Like :meth:`close`, but every replica of a deployed function runs on, to be
        adopted by this process's next image (see ``adoption``): its records."""
        with self._lock:
            self._closing = True
            self._changed.wait_for(lambda: self._spawning == 0, timeout=30)
            units, self._units = self._units, {}
            keys = dict(self._keys)
        self._closed.set()
        self.output.hand_over()  # nothing reads the pipes from here on; they stay open
        records = [adoption.unit_record(u, keys[k]) for k, u in units.items() if k in keys]
        kept = {r["pid"] for record in records for r in record["replicas"]}
        with self._lock:
            others = [c for c in self._children.values() if c.pid not in kept]
        self._stop(others)  # jobs, cron runs, replicas draining after a switch
        self.memory.close()
        return records

    def adopt_spec(self, spec: ProcessSpec, spec_hash: str) -> bool:
        """An adopted function is still wanted as ``spec``: its replicas serve it, and are
        restarted from it from now on. False: nothing adopted runs ``spec_hash``."""
        key = (spec.env_name, spec.unit)
        with self._lock:
            unit = self._units.get(key)
            if unit is None or unit.spec_hash != spec_hash or self._closing:
                return False
            unit.spec, unit.adopted = spec, False
            for replica in unit.replicas:
                replica.child.spec = spec
            self._publish(key)
        self._grow(key, unit)
        return True

    def _adopt(self, records: Sequence[Mapping[str, Any]]) -> set[int]:
        """Units rebuilt from :meth:`hand_over`'s records; the pids kept."""
        kept: set[int] = set()
        for record in records:
            unit = adoption.restore(record, self.memory, self.sandbox, self.output)
            if unit is None:
                continue
            key = (unit.spec.env_name, unit.spec.unit)
            self._units[key] = unit
            self._keys[key] = record["key"]
            for replica in unit.replicas:
                self._children[replica.child.pid] = replica.child
                kept.add(replica.child.pid)
            self._publish(key)
            if unit.replicas:  # a job-only or idle function has none to speak of
                logs.event(
                    log,
                    "replica.adopted",
                    f"{len(unit.replicas)} replica(s) serve on across the restart",
                    env=key[0],
                    function=key[1],
                )
        return kept

    # --- processes ----------------------------------------------------------------------

    def _shutting_down(self, spec: ProcessSpec) -> ApplyFailed:
        return ApplyFailed(f"{spec.function}: not started: the local backend is shutting down")

    def start_process(
        self, spec: ProcessSpec, command: list[str], refused: Exception, **popen: Any
    ) -> Child:
        """A process of ``spec``, sandboxed and limited, tracked from the moment Popen
        returns until :meth:`reap`; ``refused`` is raised once closing."""
        with self._lock:
            if self._closing:
                raise refused
            self._spawning += 1
        child = None
        try:
            # with a sandbox of its own uid the kernel caps tasks too; the guard reports it
            limit = self.memory.limit(
                spec.memory_mb, f"{spec.env_name}/{spec.function}", spec.max_processes
            )
            run = self.sandbox.run(
                command,
                artifact=spec.artifact,
                runtime=spec.runtime.folder,
                env=popen.pop("env"),
                max_processes=spec.max_processes,
            )
            try:
                # the limit wraps the sandbox: bwrap and everything in it count
                process = subprocess.Popen(
                    limit.command(run.argv),
                    start_new_session=True,
                    env=run.env,
                    cwd=run.cwd,
                    **popen,
                )
            except BaseException:
                limit.release()
                self.sandbox.release(run)
                raise
            child = Child(process, limit, spec, self.sandbox, run)
            limit.started(process.pid)
            self.pids.add(process.pid, command)
        finally:
            with self._lock:
                self._spawning -= 1
                if child is not None:
                    self._children[child.pid] = child
                self._changed.notify_all()
        return child

    def function_dir(self, spec: ProcessSpec) -> Path:
        return self.sandbox.function_dir(spec.artifact)

    def reap(self, child: Child) -> str:
        """The process has been waited for: why it ended; it is no longer tracked."""
        reason = child.finish()
        self.pids.remove(child.pid)
        with self._lock:
            self._children.pop(child.pid, None)
        return reason

    def _stop(self, children: list[Child], grace: float = STOP_GRACE_SEC) -> None:
        for child in children:
            if child.process.poll() is None:
                self.sandbox.terminate(child.pid)
        deadline = time.monotonic() + grace
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(child.pid, signal.SIGKILL)
                child.process.wait()
            signal_group(child.pid, signal.SIGKILL)  # whatever it left behind in its group
            reason = self.reap(child)
            logs.event(
                log,
                "replica.stopped",
                f"pid {child.pid} stopped ({reason})",
                level=logging.DEBUG,
                env=child.spec.env_name,
                function=child.spec.function,
            )

    def _stop_later(self, children: list[Child], grace: float = STOP_GRACE_SEC) -> None:
        # requests already sent to the old replicas get DRAIN_SEC to be answered (and
        # then ``grace`` to end after SIGTERM, which the runtimes drain on); they stay
        # tracked meanwhile, so close() stops them if it comes first
        def later() -> None:
            time.sleep(DRAIN_SEC)
            self._stop(children, grace)

        threading.Thread(target=later, name="sless-drain", daemon=True).start()

    # --- replicas -------------------------------------------------------------------------

    def _publish(self, key: tuple[str, str]) -> None:
        self.version += 1
        unit = self._units.get(key)
        replicas = [r for r in unit.replicas if not r.withdrawn] if unit else []
        upstreams = tuple((self.host, r.port) for r in replicas)
        last_exit = unit.last_exit if unit else None
        self._on_upstreams(key[0], key[1], upstreams, last_exit, self.replica_key(*key))

    def _withdraw(self, pid: int, reason: str) -> None:
        """A replica is about to be killed: no new call goes to it, and the route says why."""
        with self._lock:
            for key, unit in self._units.items():
                for replica in unit.replicas:
                    if replica.child.pid == pid:
                        replica.withdrawn = True
                        unit.last_exit = reason
                        self._publish(key)
                        self.output.note(replica.log_path, f"replica pid {pid} killed: {reason}")
                        return

    def _notify(self, key: tuple[str, str], kind: str, reason: str | None) -> None:
        """Tell the status store; never called with the lock held."""
        if self._on_replica_event is None or self._closing:
            return
        try:
            self._on_replica_event(key[0], key[1], kind, reason)
        except Exception:
            log.exception("%s/%s: the replica event hook failed", *key)

    def replica_key(self, env: str, function: str) -> str:
        """What the proxy sends with every call to ``function``'s replicas, and they check.

        Replicas listen on loopback, which every sandbox shares: without the key a
        function could call another one directly, past the proxy's limits and
        records. One per function (its replicas may call each other: they are it),
        kept while the supervisor runs it, in no file and in no other environment.
        """
        with self._lock:
            return self._keys.setdefault((env, function), secrets.token_urlsafe(24))

    def key_owner(self, key: str) -> tuple[str, str] | None:
        """(environment, function) whose replicas hold ``key``, if any: who sent spans."""
        with self._lock:
            keys = list(self._keys.items())
        given = key.encode()
        for (env, unit), known in keys:
            if hmac.compare_digest(given, known.encode()):
                return env, unit.partition("@")[0]
        return None

    def _span_relay(self, spec: ProcessSpec) -> dict[str, str]:
        """Where the runtime sends its spans (the reconciler, which exports them), when
        spans are exported: see ``telemetry.relay``."""
        if self.span_relay is None:
            return {}
        return {
            "SLESS_OTLP_ENDPOINT": self.span_relay,
            "SLESS_OTLP_TOKEN": self.replica_key(spec.env_name, spec.unit),
            "SLESS_OTLP_SERVICE": f"{spec.env_name}/{spec.function}",
        }

    def _start_healthy(self, spec: ProcessSpec) -> Replica:
        port = free_port(self.host)
        log_dir = self.logs / spec.env_name
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{spec.function}.log"
        with log_path.open("ab") as out:
            since = out.seek(0, os.SEEK_END)  # the log goes on across starts: read only ours
        # the runtime says on this pipe when it listens, with when each phase ended: no
        # polling of /health, so a start is seen the moment it is done
        ready_fd, write_fd = os.pipe()
        spawned = time.monotonic()
        try:
            child = self.start_process(
                spec,
                spec.command("server"),
                self._shutting_down(spec),
                env=spec.environ(
                    {
                        "PORT": str(port),
                        "SLESS_HOST": self.host,
                        "SLESS_REPLICA_KEY": self.replica_key(spec.env_name, spec.unit),
                        "SLESS_READY_FD": str(write_fd),
                        **self._span_relay(spec),
                    }
                ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
            )
        except BaseException:
            os.close(ready_fd)
            raise
        finally:
            os.close(write_fd)
        assert child.process.stdout is not None
        output = self.output.attach(child.process.stdout, log_path, str(port))
        ready = ReadyLine(ready_fd)
        deadline = time.monotonic() + HEALTH_TIMEOUT_SEC
        try:
            while time.monotonic() < deadline:
                if self._closing:
                    self._stop([child])
                    raise self._shutting_down(spec)
                phases = ready.wait(0.05) if not ready.done else None
                if phases is not None or (ready.done and self._healthy(port)):
                    record_start(spec, spawned, phases)
                    logs.event(
                        log,
                        "replica.started",
                        f"replica on port {port} is healthy (pid {child.pid})",
                        level=logging.DEBUG,
                        env=spec.env_name,
                        function=spec.function,
                    )
                    return Replica(child, port, log_path, output)
                if child.process.poll() is not None:
                    reason = self.reap(child)
                    if self._closing:  # stopped by close(), not a start that failed
                        raise self._shutting_down(spec)
                    output.wait(oneshot.OUTPUT_WAIT_SEC)  # its last lines say why
                    printed = tail(log_path, since)
                    why = failure.cause(printed, self.function_dir(spec)) or "no output"
                    self.output.note(
                        log_path, f"replica pid {child.pid} ended before it was healthy: {reason}"
                    )
                    raise StartFailed(
                        f"{spec.function}: the runtime ended before it was healthy "
                        f"({reason}): {why}",
                        reason,
                    )
                if ready.done:  # said nothing and lives on (not one of our runtimes): poll
                    time.sleep(0.02)
        finally:
            ready.close()
        self._stop([child])
        raise StartFailed(
            f"{spec.function}: no healthy answer on /health in {HEALTH_TIMEOUT_SEC:g}s", None
        )

    def _healthy(self, port: int) -> bool:
        conn = http.client.HTTPConnection(self.host, port, timeout=1)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()
